"""`Mdat`: one dataset container folder, and every operation on it.

The class is the single entry point; the work lives in the modules it calls (importing,
pretokenizing, views, sequences, fingerprints). Each method reads or writes the catalogue in
its own transactions, so an interrupted call leaves the container readable. Removals change
the catalogue first and delete files after: a crash in between leaves only files that no row
lists, which the next import, view or shuffle of the same name replaces.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from matformer.modeling.atomic import built_aside
from matformer.modeling.errors import (
    InvalidName,
    MdatExists,
    NameTaken,
    SourceNotFound,
    SubmdatIncomplete,
    SubmdatInUse,
    TokenizerChanged,
    UnknownName,
)
from matformer.modeling.mdat.catalogue import (
    MAX_SUBMDATS,
    Catalogue,
    PretokProgress,
    ShuffleInfo,
    SubmdatInfo,
    unknown,
)
from matformer.modeling.mdat.conversations import PairFields
from matformer.modeling.mdat.document_splitter import DocumentSplitter
from matformer.modeling.mdat.fingerprints import Description, describe, digest
from matformer.modeling.mdat.hf_datasets import hf_dataset_source
from matformer.modeling.mdat.importer import import_records
from matformer.modeling.mdat.json_arrays import json_array_records
from matformer.modeling.mdat.npy_files import load_npy
from matformer.modeling.mdat.pretok_files import TOKENIZER_FILE, pretok_folder, strategy_folder
from matformer.modeling.mdat.pretokenize import PretokTarget, pretokenize
from matformer.modeling.mdat.records import (
    dict_records,
    folder_records,
    jsonl_records,
    text_documents,
)
from matformer.modeling.mdat.saetta import SaettaReader
from matformer.modeling.mdat.selection import Selected, ViewDocuments, select, view_targets
from matformer.modeling.mdat.sequences import SequenceReader, chunks_per_sequence
from matformer.modeling.mdat.shuffles import read_shuffle, shuffle_name, shuffle_path, write_shuffle
from matformer.modeling.mdat.strategy import Strategy, check_name
from matformer.modeling.mdat.submdat import Submdat
from matformer.modeling.mdat.tables import parquet_source, read_limit
from matformer.modeling.mdat.views import (
    DEFAULT_VIEW,
    Quota,
    View,
    quota_documents,
    view_folder,
    write_view,
)
from matformer.modeling.tokenizers.text import CHAT_TEMPLATE_FILES, locate_tokenizer

FOLDERS = ("datasets", "functions", "pretok", "shuffling", "views")


class Mdat:
    """An MDAT container; get one with `Mdat.create` or `Mdat.open`."""

    def __init__(self, path: Path, catalogue: Catalogue, trust_remote_code: bool = False) -> None:
        self.path = path
        self._catalogue = catalogue
        # whether the code in functions/ may run (modeling.trust): never by default
        self.trust_remote_code = trust_remote_code

    @classmethod
    def create(cls, path: str | os.PathLike[str], *, extended: bool = False,
               trust_remote_code: bool = False) -> Mdat:
        """A new, empty container; ``extended`` allows 65,535 submdats instead of 255."""
        path = Path(path)
        if path.exists() and (not path.is_dir() or any(path.iterdir())):
            raise MdatExists(f"{path} exists and is not empty; open it with Mdat.open() or "
                             "choose a new path.")
        with built_aside(path) as building:
            for folder in FOLDERS:
                (building / folder).mkdir(parents=True)
            Catalogue.create(building, extended=extended).close()
        return cls.open(path, trust_remote_code=trust_remote_code)

    @classmethod
    def open(cls, path: str | os.PathLike[str], *, trust_remote_code: bool = False) -> Mdat:
        """The container at ``path``; the ``.py`` files of its ``functions/`` run (when a
        strategy needs them) only with ``trust_remote_code``."""
        path = Path(path)
        return cls(path, Catalogue.open(path), trust_remote_code)

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

        ``compress``: zstd per document. ``skip_bad``: skip and count invalid, non-UTF-8 and
        empty records instead of raising `BadRecord` / `NotUtf8` / `EmptyDocument`.
        ``batch_size``: documents per transaction. ``progress``: a progress bar on stderr. An
        interrupted import resumes when called again with the same ``name``, ``source`` and
        records (checked by hash: `ResumeMismatch` otherwise). Returns the catalogue row, with
        the counts of documents, bytes and skipped records.
        """
        return import_records(
            self._catalogue, self.path / "datasets" / check_name("submdat", name),
            dict_records(records, text_documents(text_field)), name=name, source=source,
            text_field=text_field,
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
            raise SourceNotFound(f"JSON Lines file {file} does not exist; check the path.")
        return import_records(
            self._catalogue, self.path / "datasets" / check_name("submdat", name),
            jsonl_records(file, text_documents(text_field)), name=name, source=str(file),
            text_field=text_field,
            compress=compress, skip_bad=skip_bad, batch_size=batch_size, progress=progress,
        )

    def add_pairs(
        self, name: str, source: str | os.PathLike[str] | Iterable[Mapping[str, Any]], *,
        prompt_field: str = "prompt", response_field: str = "response",
        messages_field: str = "messages", compress: bool = False, skip_bad: bool = False,
        batch_size: int = 1000, progress: bool = False,
    ) -> SubmdatInfo:
        """Import instruction data: one conversation per line of a JSON Lines file ``source``
        (or per dict of an iterable), its ``messages_field`` list of chat messages, else its
        ``prompt_field`` and ``response_field`` (`conversations`). Pretokenize it with a
        strategy of splitter ``conversation``, which applies the chat template and stores
        which tokens are responses (`chat_templates`). Options as in `add_records`.
        """
        fields = PairFields(prompt_field, response_field, messages_field)
        if isinstance(source, str | os.PathLike):
            file = Path(source).resolve()
            if not file.is_file():
                raise SourceNotFound(f"JSON Lines file {file} does not exist; check the path.")
            records, origin = jsonl_records(file, fields.record), str(file)
        else:
            records, origin = dict_records(source, fields.record), "python"
        return import_records(
            self._catalogue, self.path / "datasets" / check_name("submdat", name), records,
            name=name, source=origin, text_field=fields.describe(), compress=compress,
            skip_bad=skip_bad, batch_size=batch_size, progress=progress,
        )

    def add_json(
        self, name: str, file: str | os.PathLike[str], *, text_field: str = "text",
        compress: bool = False, skip_bad: bool = False, batch_size: int = 1000,
        progress: bool = False,
    ) -> SubmdatInfo:
        """Import a JSON file holding one array of objects, one document per element, read an
        element at a time (`json_arrays`); options as in `add_records`."""
        file = Path(file).resolve()
        if not file.is_file():
            raise SourceNotFound(f"JSON file {file} does not exist; check the path.")
        return import_records(
            self._catalogue, self.path / "datasets" / check_name("submdat", name),
            json_array_records(file, text_field, read_limit()), name=name, source=str(file),
            text_field=text_field, compress=compress, skip_bad=skip_bad, batch_size=batch_size,
            progress=progress,
        )

    def add_folder(
        self, name: str, folder: str | os.PathLike[str], *, pattern: str = "**/*.txt",
        compress: bool = False, skip_bad: bool = False, batch_size: int = 1000,
        progress: bool = False,
    ) -> SubmdatInfo:
        """Import one document per file matching ``pattern``, metadata ``{"path": ...}``."""
        folder = Path(folder).resolve()
        if not folder.is_dir():
            raise SourceNotFound(f"folder {folder} does not exist; check the path.")
        return import_records(
            self._catalogue, self.path / "datasets" / check_name("submdat", name),
            folder_records(folder, pattern), name=name, source=f"{folder}/{pattern}",
            text_field="text", compress=compress, skip_bad=skip_bad, batch_size=batch_size,
            progress=progress,
        )

    def add_parquet(
        self, name: str, files: str | os.PathLike[str] | Iterable[str | os.PathLike[str]], *,
        text_field: str = "text", compress: bool = False, skip_bad: bool = False,
        batch_size: int = 1000, progress: bool = False,
    ) -> SubmdatInfo:
        """Import Parquet files in order, one document per row of column ``text_field``.

        The row's other columns are its metadata, one field each, where they hold text,
        numbers, booleans, nulls, dates or times (`tables.metadata_columns`; a warning names
        those left out). Rows are read a bounded batch at a time. A null, non-text, empty or
        non-UTF-8 text cell, or a non-UTF-8 metadata cell, is a bad record (file and row
        named); options as in `add_records`. Needs pyarrow (`FormatUnavailable`).
        """
        chosen = [files] if isinstance(files, str | os.PathLike) else list(files)
        source = parquet_source(chosen, text_field)
        return import_records(
            self._catalogue, self.path / "datasets" / check_name("submdat", name),
            source.records, name=name, source=source.description, text_field=text_field,
            compress=compress, skip_bad=skip_bad, batch_size=batch_size, progress=progress,
        )

    def add_hf_dataset(
        self, name: str, dataset: str | os.PathLike[str], *, split: str | None = None,
        config: str | None = None, revision: str | None = None, text_field: str = "text",
        compress: bool = False, skip_bad: bool = False, batch_size: int = 1000,
        progress: bool = False,
    ) -> SubmdatInfo:
        """Import a `datasets` dataset: a folder written by ``save_to_disk`` (a DatasetDict
        needs ``split``), or a hub dataset id found in the huggingface_hub cache, never
        downloaded (``split`` needed; ``config`` where it has several; ``revision``: a
        branch or commit, default main). Rows as in `add_parquet`; needs `datasets`.
        """
        source = hf_dataset_source(dataset, text_field, split=split, config=config,
                                   revision=revision)
        return import_records(
            self._catalogue, self.path / "datasets" / check_name("submdat", name),
            source.records, name=name, source=source.description, text_field=text_field,
            compress=compress, skip_bad=skip_bad, batch_size=batch_size, progress=progress,
        )

    def submdats(self) -> list[SubmdatInfo]:
        """Every submdat's catalogue row, complete or still importing, in id order."""
        return self._catalogue.submdats()

    def submdat(self, name: str) -> Submdat:
        """Read access to a submdat's documents (``text(i)``, ``metadata(i)``, ``sizes``)."""
        return Submdat(self.path / "datasets" / name, self._catalogue.submdat(name))

    def remove_submdat(self, name: str) -> None:
        """Remove a submdat, complete or interrupted, freeing its name and its id.

        Its documents go, and its pretokenized files for every strategy, and the shuffles of
        the default view that include it (they could only raise `StaleShuffle` from now on).
        A named view that chooses documents from it must be removed first (`SubmdatInUse`).
        """
        info = self._catalogue.submdat(name)
        users = [view for view, d in self._catalogue.views().items() if name in d["documents"]]
        if users:
            raise SubmdatInUse(
                f"submdat {name!r} is used by view(s) {', '.join(users)}; remove them first "
                "(Mdat.remove_view, `matformer-mdat remove PATH view NAME`)."
            )
        stale = [s.name for s in self.shuffles() if s.view == DEFAULT_VIEW
                 and json.loads(s.dataset)["submdats"].get(name, {}).get("id") == info.id]
        self._catalogue.remove_submdat(info, stale)
        for shuffle in stale:
            shuffle_path(self.path, shuffle).unlink(missing_ok=True)
        for strategy in self._catalogue.strategies():
            shutil.rmtree(pretok_folder(self.path, strategy, name), ignore_errors=True)
        shutil.rmtree(self.path / "datasets" / name, ignore_errors=True)

    # Strategies.

    def add_strategy(self, definition: Mapping[str, Any] | str | os.PathLike[str]) -> Strategy:
        """Check and store a strategy (a dict or a JSON file); returns it with defaults filled.

        A "huggingface" tokenizer file is copied into the container and its sha256 stored.
        Adding the same strategy again does nothing; a different one under a taken name
        raises `NameTaken`, and `TokenizerChanged` when its tokenizer file has changed.
        """
        if isinstance(definition, Mapping):
            strategy = Strategy.from_dict(dict(definition))
        else:
            strategy = Strategy.from_file(Path(definition))
        tokenizer = None
        if strategy.tokenizer_name:
            tokenizer, recorded = locate_tokenizer(strategy.tokenizer_name,
                                                   strategy.tokenizer_revision)
            strategy = replace(strategy, tokenizer_name=recorded)
        resolved = DocumentSplitter(strategy, self.path / "functions", tokenizer,
                                    trust_remote_code=self.trust_remote_code).resolved()
        existing = self._catalogue.strategies().get(strategy.name)
        if existing is not None and existing != resolved.to_dict():
            if (existing["tokenizer_name"], existing["tokenizer_sha256"]) == (
                    resolved.tokenizer_name, resolved.tokenizer_sha256):
                raise NameTaken(f"strategy {strategy.name!r} exists with another definition; "
                                "give the new one another strategy_name.")
            raise TokenizerChanged(
                f"strategy {strategy.name!r} was added with tokenizer file "
                f"{existing['tokenizer_name']} (sha256 {existing['tokenizer_sha256']}), and "
                f"its data were pretokenized with it; {strategy.tokenizer_name} (sha256 "
                f"{resolved.tokenizer_sha256}) is another: add it under a new strategy_name."
            )
        if existing is not None:
            return resolved
        if tokenizer is not None:
            folder = strategy_folder(self.path, strategy.name)
            folder.mkdir(parents=True, exist_ok=True)
            with built_aside(folder / TOKENIZER_FILE) as building:
                shutil.copyfile(tokenizer, building)
            for name in CHAT_TEMPLATE_FILES:  # its chat template, where it has one
                if (tokenizer.parent / name).is_file():
                    with built_aside(folder / name) as building:
                        shutil.copyfile(tokenizer.parent / name, building)
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
        chosen = self.strategy(strategy)
        targets = [PretokTarget(info, pretok_folder(self.path, chosen.name, info.name))
                   for info in self._complete_submdats(submdats)]
        pretokenize(self.path, self._catalogue, chosen, targets, processes=processes,
                    batch_size=batch_size, progress=progress,
                    trust_remote_code=self.trust_remote_code)
        return self.pretok_status(strategy)

    def pretokenize_view(self, strategy: str, view: str, *, processes: int = 1,
                         batch_size: int = 256, progress: bool = False) -> list[PretokProgress]:
        """Pretokenize only the documents named ``view`` chooses, into the view's own files
        (resumes), so that the view reads without its submdats pretokenized whole.

        A submdat already pretokenized whole is skipped: the view reads it from there. Once
        the view has its own files of a submdat, it reads them from then on, even after the
        whole submdat is pretokenized too, so its sequence ids, fingerprint and shuffles never
        change under it (`selection`). The default view is every document: it pretokenizes
        every submdat whole. Returns `view_pretok_status`.
        """
        chosen = self.strategy(strategy)
        if view == DEFAULT_VIEW:
            self.pretokenize(strategy, processes=processes, batch_size=batch_size,
                             progress=progress)
            return []
        stored = self._catalogue.views()
        if view not in stored:
            listing = ", ".join(sorted(stored)) or "none"
            raise UnknownName(
                f"unknown view {view!r}; the container has: {listing} (and {DEFAULT_VIEW!r}, "
                f"every document). Create the view first (`matformer-mdat view {self.path} "
                f"{view} SUBMDAT=QUOTA`, Mdat.create_view), or pretokenize whole submdats "
                "(without --view)."
            )
        targets = view_targets(self.path, self._catalogue, chosen, view,
                               self._view_documents(view))
        pretokenize(self.path, self._catalogue, chosen, targets, processes=processes,
                    batch_size=batch_size, progress=progress,
                    trust_remote_code=self.trust_remote_code)
        return self.view_pretok_status(strategy, view)

    def pretok_status(self, strategy: str) -> list[PretokProgress]:
        """The committed pretokenization progress of every submdat."""
        name = self.strategy(strategy).name
        return [self._catalogue.pretok(name, info.id) for info in self.submdats()]

    def view_pretok_status(self, strategy: str, view: str) -> list[PretokProgress]:
        """The progress of named ``view``'s own files, per submdat it pretokenized on its own
        (in id order); the view reads its other submdats from their whole files."""
        name = self.strategy(strategy).name
        progress = [self._catalogue.pretok(name, info.id, view)
                    for info, _ in self._view_documents(view)]
        return [row for row in progress if row.documents or row.complete]

    def _complete_submdats(self, names: Iterable[str] | None) -> list[SubmdatInfo]:
        if names is None:
            return [info for info in self.submdats() if info.complete]
        chosen = [self._catalogue.submdat(name) for name in names]
        for info in chosen:
            if not info.complete:
                raise SubmdatIncomplete(
                    f"submdat {info.name!r} was interrupted while importing; run the same "
                    "add again to finish it first, or remove it."
                )
        return chosen

    # Reading.

    def sequences(self, strategy: str, max_seq_len: int, view: str | None = None) -> SequenceReader:
        """The view's sequences of ``max_seq_len`` tokens at most (`SequenceReader`)."""
        chosen, selection = self._selection(strategy, max_seq_len, view)
        return self._reader(chosen, selection, max_seq_len, view)

    def _reader(self, strategy: Strategy, selection: list[Selected], max_seq_len: int,
                view: str | None) -> SequenceReader:
        return SequenceReader([selected.part(strategy) for selected in selection], strategy,
                              max_seq_len, view=view or DEFAULT_VIEW,
                              fingerprint=digest(_describe(strategy, max_seq_len, selection)))

    def fingerprint(self, strategy: str, max_seq_len: int, view: str | None = None) -> str:
        """A sha256 of everything the view's sequence ids depend on (`fingerprints`): two
        containers with equal fingerprints give every sequence id the same tokens."""
        chosen, selection = self._selection(strategy, max_seq_len, view)
        return digest(_describe(chosen, max_seq_len, selection))

    def saetta(self, folder: str | os.PathLike[str], strategy: str, max_seq_len: int,
               view: str | None, seed: int) -> SaettaReader:
        """A saetta export of this container's view, checked to hold what
        ``load_shuffle(view, strategy, max_seq_len, seed)`` orders, in that order: its
        ``reader[i]`` is ``sequences(...)[shuffle[i]]``, read sequentially. `SaettaError`
        names what differs."""
        reader = SaettaReader(folder)
        reader.check_source(lambda: self.fingerprint(strategy, max_seq_len, view),
                            strategy=strategy, view=view or DEFAULT_VIEW,
                            max_seq_len=max_seq_len, seed=seed)
        return reader

    def _selection(self, strategy: str, max_seq_len: int,
                   view: str | None) -> tuple[Strategy, list[Selected]]:
        chosen = self.strategy(strategy)
        chunks_per_sequence(chosen, max_seq_len)
        return chosen, select(self.path, self._catalogue, chosen, view or DEFAULT_VIEW,
                              self._view_documents(view))

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

    def remove_view(self, name: str) -> None:
        """Remove a named view and every shuffle of it; its documents stay."""
        if name == DEFAULT_VIEW:
            raise InvalidName(f"{DEFAULT_VIEW!r} is every complete submdat and cannot be "
                              "removed; remove submdats instead.")
        stored = self._catalogue.views()
        if name not in stored:
            raise unknown("view", name, stored)
        shuffles = [s.name for s in self.shuffles() if s.view == name]
        self._catalogue.remove_view(name)
        for shuffle in shuffles:
            shuffle_path(self.path, shuffle).unlink(missing_ok=True)
        shutil.rmtree(view_folder(self.path, name), ignore_errors=True)

    def _view_documents(self, view: str | None) -> ViewDocuments:
        """(submdat, sorted chosen document indices or None for all) of a view, by submdat id."""
        if view in (None, DEFAULT_VIEW):
            return [(info, None) for info in self._complete_submdats(None)]
        stored = self._catalogue.views()
        if view not in stored:
            raise unknown("view", view, [DEFAULT_VIEW, *stored])
        counts = stored[view]["documents"]
        infos = sorted((self._catalogue.submdat(name) for name in counts), key=lambda i: i.id)
        folder = view_folder(self.path, view)
        return [(i, load_npy(folder / f"{i.name}.npy", counts[i.name])) for i in infos]

    def shuffle(self, view: str | None, strategy: str, max_seq_len: int, seed: int) -> np.ndarray:
        """A permutation of the view's sequence ids, saved under ``shuffling/`` (`shuffles`).

        Deterministic in ``seed``; no data moves. Read sequence ``order[i]`` at step ``i``.
        Asked for again, the stored shuffle is given back (`load_shuffle`), never replaced.
        """
        view = view or DEFAULT_VIEW
        name = shuffle_name(view, strategy, max_seq_len, seed)
        if name in {s.name for s in self.shuffles()}:
            return self.load_shuffle(view, strategy, max_seq_len, seed)
        chosen, selection = self._selection(strategy, max_seq_len, view)
        dataset = _describe(chosen, max_seq_len, selection)
        count = len(self._reader(chosen, selection, max_seq_len, view))
        info = ShuffleInfo(name, view, chosen.name, max_seq_len, seed, count, digest(dataset),
                           json.dumps(dataset))
        order = write_shuffle(self.path, info)
        self._catalogue.add_shuffle(info)
        return order

    def load_shuffle(self, view: str | None, strategy: str, max_seq_len: int,
                     seed: int) -> np.ndarray:
        """The permutation `shuffle` stored; `StaleShuffle` if the view's data changed since."""
        view = view or DEFAULT_VIEW
        name = shuffle_name(view, strategy, max_seq_len, seed)
        stored = {s.name: s for s in self.shuffles()}
        if name not in stored:
            raise unknown("shuffle", name, stored)
        chosen, selection = self._selection(strategy, max_seq_len, view)
        return read_shuffle(self.path, stored[name], _describe(chosen, max_seq_len, selection))

    def shuffles(self) -> list[ShuffleInfo]:
        return self._catalogue.shuffles()


def _describe(strategy: Strategy, max_seq_len: int, selection: list[Selected]) -> Description:
    """The fingerprint's description of what ``selection`` reads (`fingerprints.describe`)."""
    return describe(strategy, max_seq_len,
                    [(part.info, part.progress, part.documents) for part in selection])
