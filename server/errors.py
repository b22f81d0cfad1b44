"""Error types of the server package: each names what is wrong and what to do about it."""

from __future__ import annotations

import grpc

from matformer.modeling.errors import ConflictingKeys as ConflictingKeys  # run.toml's errors are
from matformer.modeling.errors import InvalidToml as InvalidToml  # those of every settings file
from matformer.modeling.errors import InvalidValue as InvalidValue
from matformer.modeling.errors import MatformerError
from matformer.modeling.errors import MissingKey as MissingKey
from matformer.modeling.errors import SettingsError as ServerConfigError
from matformer.modeling.errors import UnknownKey as UnknownKey
from matformer.modeling.errors import WrongType as WrongType


class ServerError(MatformerError):
    """Base class of every error the server raises on purpose."""


class MissingSecret(ServerConfigError):
    """``auth.join_token_env`` (or ``operator_token_env``) names an environment variable that
    is unset or empty."""


class MissingFile(ServerConfigError, FileNotFoundError):
    """A file the config names (run.toml itself, a model config, a TLS certificate) is absent."""


class PortUnavailable(ServerError):
    """The server cannot listen where [server] says (a port in use, an address not this
    machine's)."""


class ShardError(ServerError, ValueError):
    """Shares to split a round's ids by are empty, negative, all 0, or name a client twice."""


class TierAssignmentError(ServerError):
    """No tier can be given to a joining client. ``code`` is the gRPC status ``Join`` answers
    with: ``context.abort(err.code, str(err))``."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class BadCapabilities(TierAssignmentError, ValueError):
    """A capability report that cannot be used (memory or token budget not positive, ...)."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class NoAllowedTier(TierAssignmentError):
    """The client asked for a tier smaller than every tier the run allows."""


class NoTierFits(TierAssignmentError):
    """Even the smallest allowed tier needs more memory than the client reports."""


class PinnedTierDoesNotFit(TierAssignmentError):
    """run.toml pins the client to a tier that needs more memory than the client reports."""


class NotARunTier(TierAssignmentError):
    """Updates asked for at a tier the run does not have."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class CoordinatorError(ServerError):
    """A call the coordinator refuses. ``code`` is the gRPC status the servicer answers with:
    ``context.abort(err.code, str(err))``."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class UnknownClient(CoordinatorError, KeyError):
    """A client id that is not (or no longer) a member; the client should call Join again."""

    code = grpc.StatusCode.NOT_FOUND

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0])


class NotInRound(CoordinatorError):
    """A client submitted for a round it has no assignment in (it joined late or was dropped)."""


class UpdatesPruned(CoordinatorError):
    """Updates asked for from before the latest checkpoint; the client loads that checkpoint."""

    code = grpc.StatusCode.OUT_OF_RANGE


class ResumeError(CoordinatorError):
    """The run directory cannot be resumed as written (state.json names missing files, ...)."""


class BadResult(CoordinatorError, ValueError):
    """A submitted result the coordinator rejects; nothing of the submission is kept.
    ``counted``: the refusal counts towards the client's exclusion ([faults] max_rejections);
    lateness does not, a malformed or out-of-bounds submission does."""

    code = grpc.StatusCode.INVALID_ARGUMENT
    counted = True


class UnknownParameter(BadResult):
    """A result names a parameter the model does not have."""


class WrongRegion(BadResult):
    """A result's shape or region is not the one the client's tier covers."""


class StaleRound(BadResult):
    """A result for a round other than the one being collected."""

    counted = False


class StaleAssignment(StaleRound):
    """Results for an assignment that is no longer the client's (the coordinator restarted and
    reopened the round with a new split)."""


class DuplicateResult(BadResult):
    """A second result from one client for one parameter in one round."""


class AlreadySubmitted(DuplicateResult):
    """A second submission for one round (e.g. a retry whose first attempt got through)."""

    counted = False


class MissedNotAssigned(BadResult):
    """A submission names missed sequences its assignment does not hold, or is not a relay's
    (only a relay names the sequences its members did not deliver)."""


class MalformedResult(BadResult):
    """A result that fails modeling's checks (bad indices, NaN/Inf values, token count...)."""


class WrongEncoding(BadResult):
    """A result encoded otherwise than the run's [compression] says (encoding, chunk, dtype)."""


class TooManyCoefficients(BadResult):
    """A result with more values per chunk than [compression] topk allows."""


class NormTooLarge(BadResult):
    """A submission whose values' L2 norm exceeds [faults] max_norm (norm_action = "reject")."""


class WrongTokenCount(BadResult):
    """A result claims another token count than the client's assignment holds: results are
    weighted by the tokens the coordinator assigned, never by what a client says."""


class ValueTooLarge(BadResult):
    """A result holds a value beyond any a healthy client sends (and beyond what float32
    arithmetic on the master can absorb)."""


class BadReport(BadResult):
    """A number a client reports about itself (speed, training time, loss) is not finite or
    lies outside what any machine can do."""


class SubmissionTooLarge(BadResult):
    """A SubmitResult stream over [faults] max_submission_mb."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class RunDirectoryUnavailable(CoordinatorError):
    """The coordinator cannot write its run directory (disk full, I/O error): the round that
    was closing stays open in memory and on disk as before, and closes once writing works."""

    code = grpc.StatusCode.UNAVAILABLE


class SessionInvalid(CoordinatorError):
    """A session token that is unknown, revoked, or expired ([faults] session_ttl_s)."""

    code = grpc.StatusCode.UNAUTHENTICATED


class Excluded(CoordinatorError):
    """A call from a client excluded from the run: by its session token, or a Join with an
    excluded client key or an excluded member's session token."""

    code = grpc.StatusCode.PERMISSION_DENIED


class NameTaken(CoordinatorError):
    """A Join under the name of a live member that it cannot prove to be (by a client key or
    that member's session token)."""

    code = grpc.StatusCode.ALREADY_EXISTS


class RunFull(CoordinatorError):
    """A Join while the run has [faults] max_members members."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class JoinsTooFast(CoordinatorError):
    """A Join beyond [faults] max_joins_per_minute: transient, so clients retry it."""

    code = grpc.StatusCode.UNAVAILABLE


class FileNotServed(ServerError):
    """A requested checkpoint path that is neither a manifest nor a file a manifest lists with
    its sha256 (temp files, stray files): never served."""

    code = grpc.StatusCode.NOT_FOUND


class ServedFileDamaged(ServerError):
    """The server's own copy of a checkpoint file does not match its manifest's sha256, so it
    is not sent; the checkpoint on disk must be restored or written again."""

    code = grpc.StatusCode.DATA_LOSS


class CallRefused(ServerError):
    """A call refused or ended so that no member holds more of the server's worker threads
    than its share (server/call_slots.py); ``code`` is the status the service answers with."""


class TooManyCalls(CallRefused):
    """A member started a call while holding as many calls (or streams) as one member may."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class NoStreamSlot(CallRefused):
    """Every shared stream slot the member may take is in use (a member with work in the open
    round never meets this): a call worth retrying in a few seconds."""

    code = grpc.StatusCode.UNAVAILABLE  # clients retry it


class NoRequestSlot(CallRefused):
    """Calls without a session (Join) already wait for their request as many at once as the
    server takes: worth retrying in a few seconds."""

    code = grpc.StatusCode.UNAVAILABLE  # clients retry it


class StreamIdle(CallRefused):
    """A stream whose peer sent or took nothing for ``CallLimits.idle_s`` beyond what its
    message needs on a slow link; it was ended."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED


class RepeatedSequenceIds(ServerError):
    """A FetchSequences request that names one id more than once: each assigned sequence is
    served once per request, so no request holds more ids than the assignment."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class UnknownSequence(ServerError):
    """A FetchSequences request for an id beyond the run's data."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class JoinRefused(CoordinatorError):
    """A Join the run cannot take as it stands: another run's id, another model, or a relay
    where the round policy must see each member's result."""


class WrongJoinToken(CoordinatorError):
    """A Join without the run's join token (or, ``[auth] mode = "keys"``, a key the run's
    keys file does not hold)."""

    code = grpc.StatusCode.UNAUTHENTICATED


class RoleNotGranted(CoordinatorError):
    """A Join as a relay with a member's credential, or as a member with a relay's: the
    relay role is granted by the run's operator ([auth] relay_token, or a key issued with
    ``--relay``)."""

    code = grpc.StatusCode.PERMISSION_DENIED


class KeysUnreadable(CoordinatorError):
    """The coordinator cannot read its client keys file: the reason is logged, not told."""

    code = grpc.StatusCode.UNAVAILABLE


class UpstreamError(ServerError):
    """A relay's root refused or failed a call: passed on to the relay's member with the
    root's status and words."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"the root: {details}")
        self.code, self.details = code, details
