"""A JSON file holding one array of records (``[{"text": ...}, ...]``), read an element at a
time.

The file is read a block of characters at a time and each element decoded as soon as it is
whole, so a file of any size takes the memory of its largest element, which may not pass the
read limit (`tables.read_limit`). Each element is one record (`records.document_from_dict`):
its text field is the text, its other keys the metadata; it is named in errors by file and
element (counted from 0). Text that is not UTF-8 is kept as escaped characters until its
element is stored, so that `records` names it per element as `NotUtf8`. A file that is not an
array, or whose JSON breaks off, raises `UnreadableSource`: past a syntax error the next
element cannot be found, so it cannot be skipped.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import TextIO

from matformer.modeling.errors import BadRecord, ImportTooLarge, UnreadableSource
from matformer.modeling.mdat.records import Record, document_from_dict
from matformer.modeling.mdat.tables import READ_LIMIT_ENV

_READ = 1 << 20  # characters read at a time at least
_TAIL = 16  # how close to the end of what was read a cut-short value's error is reported
_SPACE = re.compile(r"[ \t\n\r]*")  # what JSON allows between tokens
_SKIP_HINT = "or pass skip_bad=True (--skip-bad) to skip and count such records"


class _JsonText:
    """The text of an open file, read on demand, with a cursor over it."""

    def __init__(self, stream: TextIO, file: Path, limit: int) -> None:
        self._stream, self._file, self._limit = stream, file, limit
        self._text, self._at = "", 0
        self._dropped = 0  # characters before ``_text`` (consumed and let go)
        self._ended = False
        self._decoder = json.JSONDecoder()

    @property
    def position(self) -> int:
        """The cursor, in characters from the start of the file."""
        return self._dropped + self._at

    def _read(self, wanted: int) -> bool:
        """Append at least ``wanted`` more characters, fewer at the end; False at the end."""
        block = "" if self._ended else self._stream.read(max(_READ, wanted))
        if not block:
            self._ended = True
            return False
        self._dropped += self._at
        self._text, self._at = self._text[self._at:] + block, 0
        return True

    def peek(self) -> str:
        """The next character that is not white space, left unread ("" at the end)."""
        while True:
            self._at = _SPACE.match(self._text, self._at).end()
            if self._at < len(self._text):
                return self._text[self._at]
            if not self._read(0):
                return ""

    def skip(self) -> None:
        self._at += 1

    def value(self, element: int) -> object:
        """The JSON value at the cursor, reading on while it may be cut short: a number at the
        end of what was read may go on in the next block."""
        while True:
            held = len(self._text) - self._at  # the element is at least this long, or ends
            try:
                value, end = self._decoder.raw_decode(self._text, self._at)
                held = end - self._at
            except json.JSONDecodeError as err:
                # Input cut short shows as an error at its very end, or as a string that
                # never closes; any other error is in the file, wherever it goes on.
                cut_short = (err.pos >= len(self._text) - _TAIL
                             or err.msg.startswith("Unterminated string"))
                if self._ended or not cut_short:
                    raise UnreadableSource(
                        f"{self._file}: element {element} is not valid JSON ({err.msg} at "
                        f"character {self._dropped + err.pos:,}); fix the file."
                    ) from None
            else:
                if held <= self._limit and (end < len(self._text) or self._ended):
                    self._at = end
                    return value
            if held > self._limit:
                raise ImportTooLarge(
                    f"{self._file}: element {element} is longer than the read limit of "
                    f"{self._limit / 2**20:,.1f} MiB of text; if you trust the file, raise the "
                    f"limit ({READ_LIMIT_ENV}=1024 for 1 GiB)."
                )
            self._read(held)  # doubles what is held: a long element is decoded a few times


def json_array_records(file: Path, text_field: str, limit: int) -> Iterator[Record]:
    """One record per element of the JSON array ``file`` holds."""
    # utf-8-sig: a byte order mark, as some editors write, is not the array's first character.
    with open(file, encoding="utf-8-sig", errors="surrogateescape", newline="") as stream:
        text = _JsonText(stream, file, limit)
        first = text.peek()
        if first != "[":
            found = f"starts with {first!r}" if first else "is empty"
            raise UnreadableSource(
                f"{file} holds no JSON array (it {found}); give a file of the form "
                "[{\"text\": ...}, ...], or JSON Lines with --jsonl (Mdat.add_jsonl)."
            )
        text.skip()
        element = 0
        while (after := text.peek()) != "]":
            if element:
                if after != ",":
                    found = repr(after) if after else "the end of the file"
                    raise UnreadableSource(
                        f"{file}: expected , or ] after element {element - 1} (character "
                        f"{text.position:,}), found {found}; fix the file."
                    )
                text.skip()
                text.peek()  # to the element, past white space
            value = text.value(element)
            where = f"{file} element {element}"
            if isinstance(value, dict):
                yield document_from_dict(value, text_field, where)
            else:
                yield BadRecord(f"{where}: a JSON {type(value).__name__}, not an object; "
                                f"{_SKIP_HINT}.")
            element += 1
        text.skip()
        if text.peek():
            raise UnreadableSource(f"{file}: more follows the array's end (character "
                                   f"{text.position:,}); a file holds one array: fix it.")
