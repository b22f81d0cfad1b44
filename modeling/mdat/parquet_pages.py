"""What the pages of a Parquet column chunk declare, read from their own headers.

pyarrow decompresses each page into a buffer of the size the page's header declares, and
exposes neither the headers nor a limit; the footer's ``total_uncompressed_size`` is only
a claim about them, which nothing checks. To bound what an import decodes, `chunk_pages`
walks a chunk's page headers (``PageHeader`` of parquet.thrift, in Thrift's compact
protocol) for what each one declares, as pyarrow will read them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

from matformer.modeling.errors import UnreadableSource

if TYPE_CHECKING:
    import pyarrow.parquet as pq

# Thrift compact protocol type codes; a struct ends at a field header of 0.
_TRUE, _FALSE, _BYTE, _I16, _I32, _I64, _DOUBLE, _BINARY, _LIST, _SET, _MAP, _STRUCT = \
    range(1, 13)
_UNCOMPRESSED, _COMPRESSED = 2, 3  # PageHeader's fields for the page's sizes
_MAX_VALUES = 10_000  # far above an honest header's; a crafted one could loop per byte
_MAX_DEPTH = 16
_READ = 4096  # bytes read at a time; an honest page header takes tens


class _BadHeader(Exception):
    """The bytes at a page's position are not a page header that fits in the chunk."""


class _Header:
    """One page header, parsed from ``stream`` at ``position`` without passing ``end``."""

    def __init__(self, stream: BinaryIO, position: int, end: int) -> None:
        self._stream, self._end = stream, end
        self.position = position
        self._buffer, self._at = b"", 0  # bytes read from ``position``, and how many used
        self._values = 0

    def sizes(self) -> tuple[int, int]:
        """(uncompressed, compressed) size of the page's data, as its header declares."""
        fields = self._struct(0, keep={_UNCOMPRESSED, _COMPRESSED})
        if set(fields) != {_UNCOMPRESSED, _COMPRESSED} or min(fields.values()) < 0:
            raise _BadHeader("no page sizes")
        return fields[_UNCOMPRESSED], fields[_COMPRESSED]

    def _take(self, count: int) -> bytes:
        if self.position + count > self._end:
            raise _BadHeader("runs past the column chunk")
        if self._at + count > len(self._buffer):  # refill from here on
            self._stream.seek(self.position)
            self._buffer, self._at = self._stream.read(max(count, _READ)), 0
            if len(self._buffer) < count:
                raise _BadHeader("runs past the file")
        taken = self._buffer[self._at:self._at + count]
        self._at += count
        self.position += count
        return taken

    def _skip_bytes(self, count: int) -> None:
        if count > len(self._buffer) - self._at:
            self._buffer, self._at = b"", 0
            if self.position + count > self._end:
                raise _BadHeader("runs past the column chunk")
            self.position += count
        else:
            self._take(count)

    def _varint(self) -> int:
        value = shift = 0
        while True:
            byte = self._take(1)[0]
            value |= (byte & 0x7F) << shift
            if byte < 0x80:
                return value
            shift += 7
            if shift > 63:
                raise _BadHeader("varint too long")

    def _zigzag(self) -> int:
        value = self._varint()
        return (value >> 1) ^ -(value & 1)

    def _struct(self, depth: int, keep: set[int] = frozenset()) -> dict[int, int]:
        """Skip a struct's fields, returning the integer ones whose ids are in ``keep``."""
        if depth > _MAX_DEPTH:
            raise _BadHeader("nested too deep")
        kept, field = {}, 0
        while (head := self._take(1)[0]) != 0:
            delta, kind = head >> 4, head & 0x0F
            field = field + delta if delta else self._zigzag()
            if field in keep and kind in (_I16, _I32, _I64):
                kept[field] = self._zigzag()
            else:
                self._skip(kind, depth)
        return kept

    def _skip(self, kind: int, depth: int, in_list: bool = False) -> None:
        self._values += 1
        if self._values > _MAX_VALUES:
            raise _BadHeader("too many values")
        if kind in (_TRUE, _FALSE):
            if in_list:  # a boolean element takes a byte; a boolean field, none
                self._take(1)
        elif kind == _BYTE:
            self._take(1)
        elif kind in (_I16, _I32, _I64):
            self._varint()
        elif kind == _DOUBLE:
            self._take(8)
        elif kind == _BINARY:
            self._skip_bytes(self._varint())
        elif kind in (_LIST, _SET):
            head = self._take(1)[0]
            count = head >> 4 if head >> 4 != 15 else self._varint()
            for _ in range(count):
                self._skip(head & 0x0F, depth + 1, in_list=True)
        elif kind == _MAP:
            count = self._varint()
            kinds = self._take(1)[0] if count else 0
            for _ in range(count):
                self._skip(kinds >> 4, depth + 1, in_list=True)
                self._skip(kinds & 0x0F, depth + 1, in_list=True)
        elif kind == _STRUCT:
            self._struct(depth + 1)
        else:
            raise _BadHeader(f"unknown type {kind}")


@dataclass(frozen=True, slots=True)
class ChunkPages:
    """What a column chunk's pages declare once decompressed: in all (headers included, as
    the footer's ``total_uncompressed_size``), and the largest page, which bounds any value
    read from the chunk (a value, or the prefix it shares, lies within one page)."""

    total: int
    largest: int


def chunk_pages(stream: BinaryIO, start: int, length: int, where: str) -> ChunkPages:
    """The pages in ``length`` bytes from ``start`` of ``stream``, by their headers."""
    if start < 0 or length < 0:
        raise UnreadableSource(f"{where}: the footer places the column at byte {start} for "
                               f"{length} bytes; the file is damaged: write or download it "
                               "again.")
    total = largest = 0
    position, end = start, start + length
    while position < end:
        header = _Header(stream, position, end)
        try:
            uncompressed, compressed = header.sizes()
        except _BadHeader as err:
            raise UnreadableSource(
                f"{where}: no readable page header at byte {position} ({err}); the file is "
                "damaged or was not written as Parquet: write or download it again."
            ) from None
        total += header.position - position + uncompressed
        largest = max(largest, uncompressed)
        position = header.position + compressed
    return ChunkPages(total, largest)


def column_pages(file: Path, metadata: pq.FileMetaData, column: str) -> list[ChunkPages]:
    """Per row group of ``file``, what the pages of its flat column ``column`` declare (by
    their own headers: the footer's sizes are a claim that pyarrow never checks)."""
    leaves = [j for j in range(metadata.num_columns)
              if metadata.schema.column(j).path == column]
    if len(leaves) != 1:  # its Arrow schema, which pyarrow reports, says otherwise
        raise UnreadableSource(f"{file} stores column {column!r} in {len(leaves)} Parquet "
                               "columns, not one; check the file.")
    (leaf,) = leaves
    chunks = []
    with open(file, "rb") as stream:
        for group in range(metadata.num_row_groups):
            chunk = metadata.row_group(group).column(leaf)
            # Where pyarrow starts reading the chunk: its dictionary page, if any, comes first.
            start = chunk.data_page_offset
            if chunk.has_dictionary_page and 0 < chunk.dictionary_page_offset < start:
                start = chunk.dictionary_page_offset
            chunks.append(chunk_pages(stream, start, chunk.total_compressed_size,
                                      f"{file} row group {group}"))
    return chunks
