"""Error types of the modeling package: each names what is wrong and how to fix it; and
``did_you_mean``, the hint every "unknown name" error gives."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


def closest(name: str, known: Iterable[str], *, cutoff: float = 0.6) -> str | None:
    """The name of ``known`` most like a misspelt ``name``, if one is close (``difflib``'s
    similarity of at least ``cutoff``)."""
    close = difflib.get_close_matches(name, list(known), n=1, cutoff=cutoff)
    return close[0] if close else None


def did_you_mean(name: str, known: Iterable[str]) -> str:
    """``"did you mean 'x'? "`` for the closest of ``known``, or ``""``: the hint an unknown
    name's error puts before the list of valid ones."""
    close = closest(name, known)
    return f"did you mean {close!r}? " if close else ""


class MatformerError(Exception):
    """Base class of every error Matformer raises on purpose."""


class ConfigError(MatformerError, ValueError):
    """A model or layer config is malformed (unknown key, impossible shape, bad value)."""


class SpecialIdsMismatch(ConfigError):
    """A pretrained model's bos/eos/pad/mask ids differ from those of the data's tokenizer."""


class SettingsError(ConfigError):
    """A settings file (run.toml, train.toml, a strategy) or its flags cannot be used as
    written; `modeling.settings` raises the kinds below."""


class InvalidToml(SettingsError):
    """The file is not TOML at all."""


class UnknownKey(SettingsError):
    """A section or key the file does not have; the message lists the valid ones."""


class MissingKey(SettingsError):
    """A required key (or one of a set of alternatives) is absent."""


class ConflictingKeys(SettingsError):
    """Keys that exclude each other were given together."""


class WrongType(SettingsError):
    """A value of the wrong TOML type (a string where a number belongs, ...)."""


class InvalidValue(SettingsError):
    """A value of the right type that makes no sense (a negative port, a number out of its
    range, a tier the model does not have, ...)."""


class DeviceUnavailable(ConfigError):
    """A device was asked for that this machine does not have (or that is no device)."""


class RegistryError(MatformerError, LookupError):
    """A registry lookup named a component that does not exist or cannot run here."""


class TierError(MatformerError, ValueError):
    """A MatFormer tier or Mix'n'Match tier list cannot be realised on this model."""


class HookPositionError(ConfigError):
    """A hook was attached at a position the transformer block does not expose."""


class WersaUnsupported(MatformerError, ValueError):
    """WERSA attention was asked for something it does not compute (the message says what to
    use instead)."""


class TensorParallelError(MatformerError, ValueError):
    """Tensor parallelism cannot split this model as asked (the message says what to change)."""


class UnevenSplit(TensorParallelError):
    """Attention heads or FFN neurons (a layer's stored width, or a tier's) do not divide
    evenly over the ranks."""


class NotParallelizable(TensorParallelError):
    """The model holds something tensor parallelism does not combine with: FSDP2 (or another
    split already applied), a per-head score bias (ALiBi), an attention kernel with weights of
    its own, or an FFN implementation it does not know."""


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


class RemoteCodeRefused(MatformerError):
    """A checkpoint or container needs code of its own to build, and the user did not allow
    it (``trust_remote_code``)."""


class CodeOutsideCheckpoint(CheckpointError):
    """A checkpoint lists code that does not lie inside its own folder (an absolute path,
    ``..``, a folder, or a symlink out)."""


class AlreadySliced(CheckpointError):
    """A tier-sliced checkpoint was given where the universal one is needed."""


class CheckpointExists(CheckpointError, FileExistsError):
    """A new checkpoint was to be written to a folder that already holds files."""


class NotConvertible(CheckpointError):
    """A checkpoint whose FFN neurons cannot be ordered: not Llama-shaped, or no FFN weights."""


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


class SliceMismatch(CheckpointError):
    """A slice folder holds another tier, or another model, than the one asked for."""


class PublishError(MatformerError):
    """A checked checkpoint could not be pushed to a Hugging Face hub repository: no token,
    no such repository or branch, no write access, or the hub refused the commit."""


class BatchOpError(MatformerError):
    """An operation cannot run on a MaskedBatch as asked."""


class UnsupportedBatchOp(BatchOpError, NotImplementedError):
    """The op (named in the message) has no masked implementation yet; computing it on the
    padded data would silently mix padding into the result."""


class BatchDimError(BatchOpError, ValueError):
    """The op would act on dimension 0, the batch dimension, and so mix examples together."""


class DynamicDimError(BatchOpError, ValueError):
    """The op would count the padding of a dynamic dimension (one whose size differs per
    example), or needs that size as a single number."""


class BatchShapeError(BatchOpError, ValueError):
    """Operands do not line up example by example (ranks differ, a plain tensor adds dimensions
    in front of the batch dimension, a size does not divide)."""


class BatchControlFlowError(BatchOpError, TypeError):
    """Python control flow met a value that differs per example outside what ``@batch``
    rewrites (a truth value of a whole batch, a ``return`` inside a per-example ``if``...)."""


class MdatError(MatformerError):
    """An MDAT dataset container is missing something, or cannot do what was asked."""


class MdatNotFound(MdatError, FileNotFoundError):
    """A path holds no MDAT container (no ``mdat.db`` catalogue)."""


class MdatExists(MdatError, FileExistsError):
    """``Mdat.create`` was pointed at a folder that already holds files."""


class InvalidName(MdatError, ValueError):
    """A submdat, strategy or view name is not a plain folder name, or is reserved."""


class UnknownName(MdatError, LookupError):
    """A submdat, strategy, view or shuffle name that the catalogue does not hold."""


class NameTaken(MdatError):
    """A submdat, strategy or view of that name exists already, with different contents."""


class SubmdatLimit(MdatError):
    """The container holds as many submdats as its id width allows (255, or 65,535 extended)."""


class SubmdatIncomplete(MdatError):
    """A submdat's import was interrupted; ``add`` with the same source resumes it."""


class ResumeMismatch(MdatError):
    """An interrupted import was resumed with other records, another source or other settings."""


class BadRecord(MdatError, ValueError):
    """An input record has no usable text: not a JSON object with the text field, or a table
    row whose text cell is null or not text (file and line, or row, are named)."""


class NotUtf8(MdatError, ValueError):
    """Input text is not valid UTF-8 (file and line, or file, are named)."""


class FormatUnavailable(MdatError, ImportError):
    """Importing Parquet or a `datasets` dataset needs a package that is not installed."""


class MissingTextColumn(MdatError, LookupError):
    """A table to import has no column of the text field's name (its columns are listed), or
    that column holds no text (numbers, lists: its type is named)."""


class UnreadableSource(MdatError, ValueError):
    """A file or folder to import is not in the format it was given as, or is damaged."""


class SplitError(MdatError, LookupError):
    """A `datasets` source holds several splits or configs, and none or an unknown one was
    chosen (the ones it holds are listed)."""


class StrategyError(MdatError, ValueError):
    """A pretokenization strategy is malformed: unknown field, wrong type, impossible value."""


class TokenizerNotFound(StrategyError):
    """A strategy's tokenizer file does not exist."""


class UnknownSplitter(StrategyError):
    """A strategy names a splitter that no built-in nor ``functions/`` file registers."""


class SplitterError(MdatError):
    """A splitter failed on a document, or returned tokens and chunks that disagree."""


class PretokIncomplete(MdatError):
    """A strategy has not been pretokenized over every submdat a reader needs."""


class SequenceLengthError(MdatError, ValueError):
    """``max_seq_len`` is not a positive multiple of the strategy's ``chunk_size``."""


class QuotaError(MdatError, ValueError):
    """A view quota is not a count, a fraction in (0, 1] or a size string like ``"500M"``."""


class QuotaTooLarge(QuotaError):
    """A view quota asks for more documents or bytes than its submdat holds."""


class SaettaError(MdatError):
    """A saetta folder is missing a file, or its files disagree with each other."""


class MdatCorrupt(MdatError):
    """A file of the container is truncated or damaged; the message names it and the fix."""


class MdatFormatError(MdatError):
    """A container was written in another MDAT format version than this code reads."""


class SourceNotFound(MdatError, FileNotFoundError):
    """What an import was asked to read does not exist: a file, a folder, a cached hub
    dataset."""


class ImportTooLarge(MdatError, ValueError):
    """A table to import holds more text at once than the read limit allows: a row group that
    declares more, a cell larger, or a file that decodes to more than it declares (a
    decompression bomb). The message names the file, the sizes and how to raise the limit."""


class SourceOutsideDataset(MdatError, ValueError):
    """A dataset's own description (a hub card's ``data_files``, a ``save_to_disk``
    state.json) names a file outside the dataset's folder: an absolute path, ``..``, a URL,
    or a link out."""


class EmptyDocument(MdatError, ValueError):
    """An input record's text is empty or whitespace only (file and line, or record, named)."""


class TokenizerChanged(NameTaken):
    """A strategy name is taken by a strategy whose tokenizer file had other contents."""


class SubmdatInUse(MdatError):
    """A submdat cannot be removed while named views select documents from it."""


class StaleShuffle(MdatError):
    """A stored shuffle was made for other data than the view now holds (the changes named)."""


class SequenceTooLong(BatchError):
    """One sequence alone exceeds a token budget: raise the budget or shorten the sequence."""


class BatchDoesNotFit(MatformerError, RuntimeError):
    """Out of memory even at the smallest microbatch limits for these sequence lengths."""


class CompressionError(MatformerError, ValueError):
    """A sparse result or compression setting is malformed (the coordinator answers
    INVALID_ARGUMENT); the subclass and message name the field at fault."""


class CompressionConfigError(CompressionError, ConfigError):
    """A compression or update-rule config holds an impossible value."""


class UnknownEncoding(CompressionError):
    """A config or sparse result names an encoding that is not registered."""


class RegionError(CompressionError):
    """A region is empty, reaches outside the universal shape, or starts off the chunk grid."""


class ChunkIdError(CompressionError):
    """A chunk id is out of range, repeated, or outside the result's region."""


class ChunkIndexError(CompressionError):
    """A position inside a chunk is out of range or repeated within its chunk."""


class NonFiniteValues(CompressionError):
    """A sparse result carries NaN or infinite values."""


class ResultShapeMismatch(CompressionError):
    """A result's tensors disagree with its shape, region or chunk, or results for one
    parameter disagree with each other."""


class BadTokenCount(CompressionError):
    """A sparse result's token count is not a positive integer."""
