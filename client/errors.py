"""Error types of the client: each names what is wrong and what to do next."""

from modeling.errors import MatformerError


class ClientError(MatformerError):
    """Base class of every error the client raises on purpose."""


class ModelMismatch(ClientError, KeyError):
    """A broadcast update names a parameter this replica does not hold, or gives it another
    shape: the coordinator runs another model. (The coordinator's own ``UnknownParameter``
    is a submission naming a parameter the run does not have.)"""


class FeedbackStateMismatch(ClientError, ValueError):
    """Saved error-feedback state does not fit this client's parameters, regions or settings."""


class DataMismatch(ClientError, ValueError):
    """A local MDAT (--data) is not the run's data: its fingerprint differs."""


class ReplicaDiverged(ClientError):
    """The replica's weight hash disagrees with the coordinator's even after a reload."""


class DamagedTransfer(ClientError):
    """A checkpoint file arrived damaged (sha256 or length wrong) on every attempt."""


class DamagedOnServer(ClientError):
    """The coordinator refused to send a checkpoint file: its own copy fails its manifest."""
