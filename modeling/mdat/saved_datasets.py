"""A folder written by `datasets`' ``save_to_disk``, read with pyarrow alone.

One dataset is a folder of ``state.json`` (``_data_files``: its Arrow stream files, in order;
``_split``), ``dataset_info.json`` and those ``.arrow`` files; a DatasetDict is
``dataset_dict.json`` (``{"splits": [...]}``) beside one such folder per split. It is read
here rather than by ``datasets.load_from_disk`` so that every file is checked before a row is
read, with an error naming the file and what is wrong, and so that the folder's own files
cannot send the import elsewhere: a split or data file must be a plain name inside the folder
that resolves inside it. Arrow files are memory-mapped and read a record batch at a time.
``save_to_disk`` never compresses them; a compressed batch, which pyarrow would decompress
to whatever size it declares before anything could count it, is refused.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

from matformer.modeling.errors import MdatError, SourceOutsideDataset, UnreadableSource
from matformer.modeling.mdat.tables import (
    TableSource,
    check_column,
    metadata_columns,
    pyarrow_module,
    table_records,
    warn_left_out,
)

if TYPE_CHECKING:
    import pyarrow as pa

_AGAIN = "save the dataset again with save_to_disk"
_MAX_JSON = 16 << 20  # save_to_disk's JSON files take kilobytes
_U16, _I32, _U32 = struct.Struct("<H"), struct.Struct("<i"), struct.Struct("<I")


@dataclass(frozen=True, slots=True)
class SavedDataset:
    """One saved dataset (not a DatasetDict): its Arrow files, checked, and its split."""

    files: list[Path]
    split: str | None

    @classmethod
    def open(cls, folder: Path) -> SavedDataset:
        """The dataset saved in ``folder``, its JSON files and the presence of its data files
        checked."""
        state_file = folder / "state.json"
        if not state_file.is_file() and not (folder / "dataset_info.json").is_file():
            raise UnreadableSource(
                f"{folder} is not a folder written by save_to_disk (it holds no state.json "
                "nor dataset_dict.json); give Parquet files with --parquet, or a hub dataset "
                "id."
            )
        state = _json_object(state_file)
        _json_object(folder / "dataset_info.json")  # written beside every saved dataset
        listed = state.get("_data_files")
        if not isinstance(listed, list) or not all(
                isinstance(entry, dict) and "filename" in entry for entry in listed):
            raise UnreadableSource(f"{state_file} has no _data_files list of {{\"filename\": "
                                   f"...}} entries; {_AGAIN}.")
        files = [_member(folder, entry["filename"], state_file) for entry in listed]
        for file in files:
            if not file.is_file():
                raise UnreadableSource(f"{state_file} lists {file.name}, which {folder} does not "
                                       f"hold; {_AGAIN}.")
        split = state.get("_split")
        return cls(files, split if isinstance(split, str) else None)

    def source(self, text_field: str, description: str, *, limit: int) -> TableSource:
        """Every row of the dataset, counted from 0 across its files (as ``dataset[row]``):
        its text column's cell, and the cells of the columns kept as metadata
        (`tables.metadata_columns`); each file's schema and record batches are checked before
        any row is read."""
        pyarrow = pyarrow_module("a dataset saved with save_to_disk")
        columns, left_out = [], []
        for file in self.files:
            kept, left = metadata_columns(_check_stream(pyarrow, file, text_field, description),
                                          text_field)
            columns.append([text_field, *kept])
            left_out.extend(left)
        warn_left_out(description, left_out)
        declared = sum(file.stat().st_size for file in self.files)  # read as it is stored
        return TableSource(description, table_records(
            self._batches(pyarrow, columns), text_field, description, declared=declared,
            limit=limit))

    def _batches(self, pyarrow: ModuleType,
                 columns: list[list[str]]) -> Iterator[pa.RecordBatch]:
        """The record batches of each file, of its ``columns`` only."""
        for file, names in zip(self.files, columns, strict=True):
            with pyarrow.memory_map(str(file)) as source:
                try:
                    stream = pyarrow.ipc.open_stream(source)
                    chosen = [stream.schema.get_field_index(name) for name in names]
                    for batch in stream:
                        read = batch.select(chosen)
                        read.validate(full=True)  # offsets in bounds: pyarrow trusts the file
                        yield read
                except (OSError, pyarrow.ArrowException) as err:  # changed since checked
                    raise _unreadable(file, err) from err


def saved_splits(folder: Path) -> list[str] | None:
    """The splits of a saved DatasetDict (from its ``dataset_dict.json``), or None for a
    folder of one dataset."""
    listing = folder / "dataset_dict.json"
    if not listing.is_file():
        return None
    splits = _json_object(listing).get("splits")
    if not isinstance(splits, list) or not all(isinstance(name, str) for name in splits):
        raise UnreadableSource(f"{listing} has no \"splits\" list of names; {_AGAIN}.")
    for name in splits:
        if not _member(folder, name, listing).is_dir():
            raise UnreadableSource(f"{listing} lists split {name}, but {folder} holds no "
                                   f"folder {name}; {_AGAIN}.")
    return splits


def _json_object(file: Path) -> dict[str, Any]:
    try:
        if file.stat().st_size > _MAX_JSON:
            raise UnreadableSource(f"{file} takes {file.stat().st_size:,} bytes, far more than "
                                   f"save_to_disk writes; {_AGAIN}.")
        value = json.loads(file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UnreadableSource(f"{file} is missing; {_AGAIN}.") from None
    except (UnicodeError, json.JSONDecodeError) as err:
        raise UnreadableSource(f"{file} is not valid JSON ({err}); {_AGAIN}.") from None
    if not isinstance(value, dict):
        raise UnreadableSource(f"{file} holds a JSON {type(value).__name__}, not an object; "
                               f"{_AGAIN}.")
    return value


def _member(folder: Path, name: object, listed_in: Path) -> Path:
    """``folder / name``, where ``name`` (read from ``listed_in``) must be a plain name that
    resolves inside ``folder``."""
    if not isinstance(name, str) or name in ("", ".", "..") or Path(name).name != name:
        raise SourceOutsideDataset(f"{listed_in} names {name!r}, not a file or folder name "
                                   f"inside {folder}; only files inside it are read.")
    path = folder / name
    if not path.resolve().is_relative_to(folder.resolve()):
        raise SourceOutsideDataset(f"{listed_in} names {name}, a link to {path.resolve()} "
                                   f"outside {folder}; only files inside it are read: copy "
                                   "the file into the folder.")
    return path


def _check_stream(pyarrow: ModuleType, file: Path, text_field: str, where: str) -> pa.Schema:
    """``file``'s schema, once it is known to be a whole Arrow stream with the text column
    in which no batch is compressed."""
    try:
        with pyarrow.memory_map(str(file)) as source:
            messages = pyarrow.ipc.MessageReader.open_stream(source)
            schema = pyarrow.ipc.read_schema(messages.read_next_message())
            check_column(schema, text_field, where)
            for number, message in enumerate(iter(messages.read_next_message, None)):
                if _compressed(message):
                    raise UnreadableSource(
                        f"{file} message {number + 1} is compressed, which save_to_disk never "
                        f"writes, and would decompress to any size it declares; {_AGAIN}."
                    )
        return schema
    except StopIteration:
        raise UnreadableSource(f"{file} is empty, not an Arrow stream; {_AGAIN}.") from None
    except MdatError:
        raise
    except (OSError, ValueError, pyarrow.ArrowException) as err:  # names that are not UTF-8
        raise _unreadable(file, err) from err


def _unreadable(file: Path, err: Exception) -> UnreadableSource:
    return UnreadableSource(f"{file} is not a whole Arrow stream ({' '.join(str(err).split())});"
                            f" it is damaged or truncated: {_AGAIN}.")


def _compressed(message: Any) -> bool:
    """Whether a record or dictionary batch message declares compressed buffers: the
    ``compression`` field of its RecordBatch table (Arrow's Message.fbs, a flatbuffer read
    by hand: pyarrow decompresses as it reads a batch, and offers no other way to ask)."""
    if message.type not in ("record batch", "dictionary batch"):
        return False
    data = message.metadata.to_pybytes()

    def table(at: int) -> int:  # the table that the offset stored at ``at`` points to
        return at + _U32.unpack_from(data, at)[0]

    def field(at: int, slot: int) -> int | None:  # where field ``slot`` of a table lies
        vtable = at - _I32.unpack_from(data, at)[0]
        if 4 + 2 * slot >= _U16.unpack_from(data, vtable)[0]:
            return None
        offset = _U16.unpack_from(data, vtable + 4 + 2 * slot)[0]
        return at + offset if offset else None

    try:
        header = field(table(0), 2)  # Message.header
        if header is not None and message.type == "dictionary batch":
            header = field(table(header), 1)  # DictionaryBatch.data
        return header is not None and field(table(header), 3) is not None  # .compression
    except struct.error:  # metadata too short for what it points to: not Arrow's writing
        return True
