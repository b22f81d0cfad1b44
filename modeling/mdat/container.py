"""`Mdat`: one dataset container folder, and every operation on it.

The class is the single entry point; the work lives in the modules it calls (importing,
pretokenizing, views, sequences). Each method reads or writes the catalogue in its own
transactions, so an interrupted call leaves the container readable.
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from modeling.errors import InvalidName, MdatExists, NameTaken, PretokIncomplete, SubmdatIncomplete
from modeling.mdat.catalogue import (
    MAX_SUBMDATS,
    Catalogue,
    PretokProgress,
    ShuffleInfo,
    SubmdatInfo,
    unknown,
)
from modeling.mdat.importer import import_records
from modeling.mdat.npy_files import load_npy, save_npy
from modeling.mdat.pretok_files import (
    TOKENIZER_FILE,
    PretokArrays,
    pretok_folder,
    strategy_folder,
)
from modeling.mdat.pretokenize import pretokenize
from modeling.mdat.records import dict_records, folder_records, jsonl_records
from modeling.mdat.sequences import SequenceReader, chunks_per_sequence
from modeling.mdat.splitting import DocumentSplitter
from modeling.mdat.strategy import Strategy, check_name
from modeling.mdat.submdat import Submdat
from modeling.mdat.views import DEFAULT_VIEW, Quota, View, quota_documents, view_folder, write_view

FOLDERS = ("datasets", "functions", "pretok", "shuffling", "views")


class Mdat:
    """An MDAT container; get one with `Mdat.create` or `Mdat.open`."""

    def __init__(self, path: Path, catalogue: Catalogue) -> None:
        self.path = path
        self._catalogue = catalogue

    @classmethod
    def create(cls, path: str | os.PathLike[str], *, extended: bool = False) -> Mdat:
        """A new, empty container; ``extended`` allows 65,535 submdats instead of 255."""
        path = Path(path)
        if path.exists() and (not path.is_dir() or any(path.iterdir())):
            raise MdatExists(f"{path} exists and is not empty; open it with Mdat.open() or "
                             "choose a new path.")
        building = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.building")
        for folder in FOLDERS:
            (building / folder).mkdir(parents=True)
        Catalogue.create(building, extended=extended).close()
        if path.exists():
            path.rmdir()
        building.rename(path)
        return cls.open(path)

    @classmethod
    def open(cls, path: str | os.PathLike[str]) -> Mdat:
        path = Path(path)
        return cls(path, Catalogue.open(path))

    def close(self) -> None:
        self._catalogue.close()

    def __enter__(self) -> Mdat:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def max_submdats(self) -> int:
        return MAX_SUBMDATS[self._catalogue.extended]

    # Documents.

    def add_records(
        self, name: str, records: Iterable[Mapping[str, Any]], *, text_field: str = "text",
        source: str = "python", compress: bool = False, skip_bad: bool = False,
        batch_size: int = 1000, progress: bool = False,
    ) -> SubmdatInfo:
        """Import dicts as submdat ``name``: ``record[text_field]`` is the text, the rest metadata.

        ``compress``: zstd per document. ``skip_bad``: skip and count invalid or non-UTF-8
        records instead of raising `BadRecord` / `NotUtf8`. ``batch_size``: documents per
        transaction. ``progress``: a progress bar on stderr. An interrupted import resumes
        when called again with the same ``name``, ``records`` and ``source``. Returns the
        catalogue row, with the counts of documents, bytes and skipped records.
        """
        return import_records(
            self._catalogue, self.path / "datasets" / check_name("submdat", name),
            dict_records(records, text_field), name=name, source=source, text_field=text_field,
            compress=compress, skip_bad=skip_bad, batch_size=batch_size, progress=progress,
        )

    def add_jsonl(
        self, name: str, file: str | os.PathLike[str], *, text_field: str = "text",
        compress: bool = False, skip_bad: bool = False, batch_size: int = 1000,
        progress: bool = False,
    ) -> SubmdatInfo:
        """Import a JSON Lines file, one document per line (options as in `add_records`)."""
        file = Path(file).resolve()
        if not file.is_file():
            raise FileNotFoundError(f"JSON Lines file {file} does not exist")
        return import_records(
            self._catalogue, self.path / "datasets" / check_name("submdat", name),
            jsonl_records(file, text_field), name=name, source=str(file), text_field=text_field,
            compress=compress, skip_bad=skip_bad, batch_size=batch_size, progress=progress,
        )

    def add_folder(
        self, name: str, folder: str | os.PathLike[str], *, pattern: str = "**/*.txt",
        compress: bool = False, skip_bad: bool = False, batch_size: int = 1000,
        progress: bool = False,
    ) -> SubmdatInfo:
        """Import one document per file matching ``pattern``, metadata ``{"path": ...}``."""
        folder = Path(folder).resolve()
        if not folder.is_dir():
            raise FileNotFoundError(f"folder {folder} does not exist")
        return import_records(
            self._catalogue, self.path / "datasets" / check_name("submdat", name),
            folder_records(folder, pattern), name=name, source=f"{folder}/{pattern}",
            text_field="text", compress=compress, skip_bad=skip_bad, batch_size=batch_size,
            progress=progress,
        )

    def submdats(self) -> list[SubmdatInfo]:
        """Every submdat's catalogue row, complete or still importing, in id order."""
        return self._catalogue.submdats()

    def submdat(self, name: str) -> Submdat:
        """Read access to a submdat's documents (``text(i)``, ``metadata(i)``, ``sizes``)."""
        return Submdat(self.path / "datasets" / name, self._catalogue.submdat(name))

    # Strategies.

    def add_strategy(self, definition: Mapping[str, Any] | str | os.PathLike[str]) -> Strategy:
        """Check and store a strategy (a dict or a JSON file); returns it with defaults filled.

        A "huggingface" tokenizer file is copied into the container. Adding the same
        strategy again does nothing; a different one under a taken name raises `NameTaken`.
        """
        if isinstance(definition, Mapping):
            strategy = Strategy.from_dict(dict(definition))
        else:
            strategy = Strategy.from_file(Path(definition))
        tokenizer = Path(strategy.tokenizer_name).resolve() if strategy.tokenizer_name else None
        if tokenizer is not None:
            strategy = replace(strategy, tokenizer_name=str(tokenizer))
        resolved = DocumentSplitter(strategy, self.path / "functions", tokenizer).resolved()
        existing = self._catalogue.strategies().get(strategy.name)
        if existing is not None:
            if existing != resolved.to_dict():
                raise NameTaken(f"strategy {strategy.name!r} exists with another definition; "
                                "give the new one another strategy_name.")
            return resolved
        if tokenizer is not None:
            folder = strategy_folder(self.path, strategy.name)
            folder.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(tokenizer, folder / TOKENIZER_FILE)
        self._catalogue.add_strategy(strategy.name, resolved.to_dict())
        return resolved

    def strategies(self) -> list[Strategy]:
        return [Strategy.from_dict(d) for d in self._catalogue.strategies().values()]

    def strategy(self, name: str) -> Strategy:
        stored = self._catalogue.strategies()
        if name not in stored:
            raise unknown("strategy", name, stored)
        return Strategy.from_dict(stored[name])

    def pretokenize(self, strategy: str, *, submdats: Iterable[str] | None = None,
                    processes: int = 1, batch_size: int = 256,
                    progress: bool = False) -> list[PretokProgress]:
        """Pretokenize complete submdats (default: all) with ``strategy``; resumes."""
        chosen = self._complete_submdats(submdats)
        pretokenize(self.path, self._catalogue, self.strategy(strategy), chosen,
                    processes=processes, batch_size=batch_size, progress=progress)
        return self.pretok_status(strategy)

    def pretok_status(self, strategy: str) -> list[PretokProgress]:
        """The committed pretokenization progress of every submdat."""
        name = self.strategy(strategy).name
        return [self._catalogue.pretok(name, info.id) for info in self.submdats()]

    def _complete_submdats(self, names: Iterable[str] | None) -> list[SubmdatInfo]:
        if names is None:
            return [info for info in self.submdats() if info.complete]
        chosen = [self._catalogue.submdat(name) for name in names]
        for info in chosen:
            if not info.complete:
                raise SubmdatIncomplete(
                    f"submdat {info.name!r} was interrupted while importing; run the same "
                    "add again to finish it first."
                )
        return chosen

    # Reading.

    def sequences(self, strategy: str, max_seq_len: int, view: str | None = None) -> SequenceReader:
        """The view's sequences of ``max_seq_len`` tokens at most (`SequenceReader`)."""
        chosen = self.strategy(strategy)
        chunks_per_sequence(chosen, max_seq_len)
        parts = []
        for info, documents in self._view_documents(view):
            progress = self._catalogue.pretok(chosen.name, info.id)
            if not progress.complete:
                raise PretokIncomplete(
                    f"submdat {info.name!r} is not pretokenized with {chosen.name!r}; run "
                    f"`matformer-mdat pretokenize {self.path} {chosen.name}` (it resumes)."
                )
            arrays = PretokArrays.load(pretok_folder(self.path, chosen.name, info.name), progress)
            parts.append((info.name, arrays, documents))
        return SequenceReader(parts, chosen, max_seq_len)

    # Views and shuffles.

    def create_view(self, name: str, quotas: Mapping[str, Quota], *, seed: int = 0) -> View:
        """A named subset: per submdat a count, a fraction or a text size (see `views`)."""
        if check_name("view", name) == DEFAULT_VIEW:
            raise InvalidName(f"{DEFAULT_VIEW!r} is the view of everything; name yours otherwise.")
        if name in self._catalogue.views():
            raise NameTaken(f"view {name!r} exists already; choose another name.")
        chosen = {}
        for submdat in quotas:
            info = self._complete_submdats([submdat])[0]
            sizes = self.submdat(submdat).sizes
            chosen[submdat] = quota_documents(quotas[submdat], info, sizes, seed)
        view = View(name, seed, dict(quotas), {s: len(d) for s, d in chosen.items()})
        write_view(self.path, view, chosen)
        self._catalogue.add_view(name, {"seed": seed, "quotas": view.quotas,
                                        "documents": view.documents})
        return view

    def views(self) -> list[View]:
        return [View(name, d["seed"], d["quotas"], d["documents"])
                for name, d in self._catalogue.views().items()]

    def _view_documents(self, view: str | None) -> list[tuple[SubmdatInfo, np.ndarray]]:
        """(submdat, sorted document indices) of a view, in submdat id order."""
        if view in (None, DEFAULT_VIEW):
            return [(info, np.arange(info.documents)) for info in self._complete_submdats(None)]
        stored = self._catalogue.views()
        if view not in stored:
            raise unknown("view", view, [DEFAULT_VIEW, *stored])
        counts = stored[view]["documents"]
        infos = sorted((self._catalogue.submdat(name) for name in counts), key=lambda i: i.id)
        folder = view_folder(self.path, view)
        return [(i, load_npy(folder / f"{i.name}.npy", counts[i.name])) for i in infos]

    def shuffle(self, view: str | None, strategy: str, max_seq_len: int, seed: int) -> np.ndarray:
        """A permutation of the view's sequence ids, saved under ``shuffling/`` (uint32/64).

        Deterministic in ``seed``; no data moves. Read sequence ``order[i]`` at step ``i``.
        """
        view = view or DEFAULT_VIEW
        count = len(self.sequences(strategy, max_seq_len, view))
        name = f"{view}.{strategy}.{max_seq_len}.seed{seed}"
        path = self.path / "shuffling" / f"{name}.npy"
        order = np.random.default_rng(seed).permutation(count)
        save_npy(path, order.astype(np.uint32 if count < 1 << 32 else np.uint64))
        self._catalogue.add_shuffle(ShuffleInfo(name, view, strategy, max_seq_len, seed, count))
        return load_npy(path, count)

    def shuffles(self) -> list[ShuffleInfo]:
        return self._catalogue.shuffles()
