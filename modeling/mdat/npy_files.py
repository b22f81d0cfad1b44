"""1-D ``.npy`` files that grow at their end, and safe loading and saving of any ``.npy`` file.

Pretokenized tokens, chunk and document offsets and document sizes are written batch by
batch and must survive an interruption. An :class:`AppendableNpy` keeps a fixed 128-byte
header that is rewritten with the current length at every :meth:`~AppendableNpy.commit`, so
after each commit the file is an ordinary ``.npy`` that ``np.load(path, mmap_mode="r")``
reads. Bytes past the last commit are cut off when the file is reopened with the committed
length.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

import numpy as np

from matformer.modeling.atomic import built_aside
from matformer.modeling.errors import MdatCorrupt

_MAGIC = b"\x93NUMPY\x01\x00"
_HEADER_BYTES = 128  # a multiple of 64, as the .npy format asks


def _header(dtype: np.dtype, length: int) -> bytes:
    described = {"descr": dtype.str, "fortran_order": False, "shape": (length,)}
    text = repr(described).encode("latin1")
    pad = _HEADER_BYTES - len(_MAGIC) - 2 - len(text) - 1
    return _MAGIC + struct.pack("<H", len(text) + pad + 1) + text + b" " * pad + b"\n"


class AppendableNpy:
    """A 1-D ``.npy`` file opened for appending, cut back to ``length`` items on open."""

    def __init__(self, path: Path, dtype: np.dtype | type, length: int = 0) -> None:
        self.path = path
        self.dtype = np.dtype(dtype)
        self.length = length
        end = _HEADER_BYTES + length * self.dtype.itemsize
        if length and (not path.exists() or path.stat().st_size < end):
            raise MdatCorrupt(f"{path} holds fewer than the {length} committed items; {_REWRITE}.")
        self._file = open(path, "r+b" if path.exists() else "w+b")  # noqa: SIM115 (kept open)
        self._file.truncate(end)
        self._file.seek(0)
        self._file.write(_header(self.dtype, length))
        self._file.seek(end)

    def append(self, values: np.ndarray) -> None:
        self._file.write(np.ascontiguousarray(values, dtype=self.dtype).tobytes())
        self.length += len(values)

    def commit(self) -> None:
        """Make everything appended so far durable and visible in the header."""
        self._file.seek(0)
        self._file.write(_header(self.dtype, self.length))
        self._file.seek(0, os.SEEK_END)
        self._file.flush()
        os.fsync(self._file.fileno())

    def close(self) -> None:
        self._file.close()


_REWRITE = "delete the folder it is in and run the step that wrote it again"


def load_npy(path: Path, length: int | None = None, *, fix: str = _REWRITE,
             uncommitted_tail: bool = False) -> np.ndarray:
    """A read-only memory map of a 1-D ``.npy`` file, checked against ``length`` items.

    ``fix`` tells the user, in the error for a damaged file, how to get a good one again.
    ``uncommitted_tail``: the file may hold more than ``length`` items (appended before an
    interrupted step recorded them in the catalogue); only the first ``length`` are returned.
    """
    try:
        array = np.load(path, mmap_mode="r")
    except (OSError, ValueError, EOFError) as err:
        raise MdatCorrupt(f"{path} cannot be read ({err}); {fix}.") from err
    if length is None:
        return array
    if len(array) < length or (len(array) > length and not uncommitted_tail):
        raise MdatCorrupt(
            f"{path} holds {len(array)} items where the catalogue records {length}; {fix}."
        )
    return array[:length]


def save_npy(path: Path, array: np.ndarray) -> None:
    """Write ``array`` to ``path`` atomically and durably (`built_aside`)."""
    with built_aside(path) as building, open(building, "wb") as file:
        np.save(file, array)
