"""Error types of the modeling package: each names what is wrong and how to fix it."""


class MatformerError(Exception):
    """Base class of every error Matformer raises on purpose."""


class ConfigError(MatformerError, ValueError):
    """A model or layer config is malformed (unknown key, impossible shape, bad value)."""


class RegistryError(MatformerError, LookupError):
    """A registry lookup named a component that does not exist or cannot run here."""


class TierError(MatformerError, ValueError):
    """A MatFormer tier or Mix'n'Match tier list cannot be realised on this model."""


class HookPositionError(ConfigError):
    """A hook was attached at a position the transformer block does not expose."""


class BatchError(MatformerError, ValueError):
    """Examples cannot form the requested batch (empty, ragged static dims, too long)."""


class CheckpointError(MatformerError):
    """A checkpoint directory is missing something, or holds something inconsistent."""


class ShapeMismatch(CheckpointError):
    """A stored tensor's shape disagrees with what config.json describes."""


class MissingShard(CheckpointError):
    """A sharded checkpoint's index names a weights file that is not there."""


class ManifestError(CheckpointError):
    """matformer_manifest.json is missing, malformed, or does not list what was asked for."""


class IntegrityError(CheckpointError):
    """A file's sha256 differs from the one the manifest records."""


class AlreadySliced(CheckpointError):
    """A tier-sliced checkpoint was given where the universal one is needed."""


class PathEscapesRepository(ManifestError):
    """A manifest path is absolute, empty, or leads outside the repository."""


class ManifestMissing(ManifestError):
    """The ``sliced`` strategy was asked for, but the checkpoint has no manifest."""


class ManifestVersionError(ManifestError):
    """The manifest uses a schema version this Matformer does not read."""


class TierNotInManifest(ManifestError):
    """The manifest lists no slice for the requested tier."""


class IncompleteTier(ManifestError):
    """Files the manifest lists for a tier are missing."""
