"""Error types of the server package: each names what is wrong and what to do about it."""

from __future__ import annotations

import grpc

from modeling.errors import MatformerError


class ServerError(MatformerError):
    """Base class of every error the server raises on purpose."""


class ServerConfigError(ServerError, ValueError):
    """run.toml (or a RunConfig built in code) cannot be used as written."""


class InvalidToml(ServerConfigError):
    """The file is not TOML at all."""


class UnknownKey(ServerConfigError):
    """A section or key that run.toml does not have; the message lists the valid ones."""


class MissingKey(ServerConfigError):
    """A required key (or one of a set of alternatives) is absent."""


class ConflictingKeys(ServerConfigError):
    """Keys that exclude each other were given together."""


class WrongType(ServerConfigError):
    """A value of the wrong TOML type (a string where a number belongs, ...)."""


class InvalidValue(ServerConfigError):
    """A value of the right type that makes no sense (a negative port, fractions not summing
    to 1, a tier the model does not have, ...)."""


class MissingSecret(ServerConfigError):
    """``auth.join_token_env`` names an environment variable that is unset or empty."""


class MissingFile(ServerConfigError, FileNotFoundError):
    """A file the config names (run.toml itself, a model config, a TLS certificate) is absent."""


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
