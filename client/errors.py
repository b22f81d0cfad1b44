"""Error types of the client: each names what is wrong and what to do next.

The transport edge (``client.connection``) turns the coordinator's status codes into the
errors below, so nothing past it handles a gRPC status."""

from matformer.modeling.errors import MatformerError


class ClientError(MatformerError):
    """Base class of every error the client raises on purpose."""


# -- the coordinator's answers --------------------------------------------------------------


class Refused(ClientError):
    """The coordinator refused a call for a reason the client cannot act on; ``status`` names
    the reason's kind (a gRPC status name) and the message is the coordinator's."""

    def __init__(self, call: str, status: str, details: str) -> None:
        super().__init__(f"{call} refused with {status}: {details}")
        self.call = call
        self.status = status
        self.details = details


class RoundOver(Refused):
    """The coordinator ended this round for the client (it closed at its deadline, the
    coordinator restarted and split it anew, or the work is no longer this client's): the
    round's results are not taken; go on to the next assignment."""


class SessionEnded(Refused):
    """The coordinator no longer knows this client's session (it expired while the machine
    slept, or the coordinator lost it): join again."""


class Excluded(Refused):
    """The coordinator excluded this client from the run."""


class NameTaken(Refused):
    """Another member holds this client's name; it is freed when the coordinator stops
    hearing from that member."""


class UpdatesPruned(Refused):
    """The update log no longer reaches back to the round asked for: load the latest
    checkpoint and replay from there."""


class NotServed(Refused):
    """The coordinator does not serve the file asked for."""


class Unreachable(ClientError):
    """The coordinator did not answer within the connection's patience."""


# -- this client's own state ----------------------------------------------------------------


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


class RankSilent(ClientError):
    """A rank of this torchrun node showed no sign of life for the ranks' timeout: it is
    stopped or hung, and the node cannot train without it."""

    def __init__(self, rank: int, silent_s: float) -> None:
        super().__init__(
            f"rank {rank} of this node has shown no sign of life for {silent_s:g} s (stopped, "
            f"hung or starved); this rank leaves too: find out what holds rank {rank} "
            f"(debugger, SIGSTOP, swapping), then start the node again (--rank-timeout-s "
            f"sets the wait)")
        self.rank = rank


class DamagedTransfer(ClientError):
    """A checkpoint file arrived damaged (sha256 or length wrong) on every attempt."""


class DamagedOnServer(Refused):
    """The coordinator refused to send a checkpoint file: its own copy fails its manifest."""


class Terminated(KeyboardInterrupt):
    """SIGTERM, stopping the client as Ctrl-C does; told apart in what it says."""
