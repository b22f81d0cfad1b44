"""Which pretokenized files a view reads, and what pretokenizing a view on its own writes.

A submdat is read, with a strategy, from one of two places:

- the whole submdat's files (``pretok/<strategy>/<submdat>/``), through the view's choice of
  documents (every document, for the default view);
- a named view's own files (``views/<view>/pretok/<strategy>/<submdat>/``), which hold only
  the documents the view chooses: `Mdat.pretokenize_view` writes them, so that a small view of
  a large corpus is trained on without pretokenizing the corpus.

Both give the same sequence ids and tokens, but not the same fingerprint (it counts the
tokens of the files read), and a stored shuffle is tied to its fingerprint. So the place a
view reads a submdat from never changes under it: its own files once they are complete,
even after the whole submdat is pretokenized too; else the whole submdat's. Pretokenizing a
view on its own skips a submdat already pretokenized whole (the view reads it from there),
and drops what it had begun of that submdat. Removing the view removes its own files.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from matformer.modeling.errors import PretokIncomplete
from matformer.modeling.mdat.catalogue import Catalogue, PretokProgress, SubmdatInfo
from matformer.modeling.mdat.pretok_files import PretokArrays, pretok_folder, view_pretok_folder
from matformer.modeling.mdat.pretokenize import PretokTarget
from matformer.modeling.mdat.sequences import ReaderPart
from matformer.modeling.mdat.strategy import Strategy
from matformer.modeling.mdat.views import DEFAULT_VIEW

# Per submdat of a view, in id order: its row and its chosen documents (None: all).
ViewDocuments = list[tuple[SubmdatInfo, np.ndarray | None]]


@dataclass(frozen=True, slots=True)
class Selected:
    """What a view reads of one submdat with one strategy."""

    info: SubmdatInfo
    progress: PretokProgress  # of the files read (complete)
    documents: np.ndarray | None  # (chosen,) the view's sorted document indices; None: all
    folder: Path  # the pretokenized files read
    own: bool  # the view's own files, which hold only ``documents``, in order

    def part(self, strategy: Strategy) -> ReaderPart:
        """The reader's share of this submdat, its arrays loaded and checked."""
        arrays = PretokArrays.load(self.folder, self.progress, strategy.vocab_size,
                                   masked=strategy.loss_masked)
        if self.own:
            return ReaderPart(self.info.name, arrays, numbers=self.documents)
        return ReaderPart(self.info.name, arrays, documents=self.documents)


def select(root: Path, catalogue: Catalogue, strategy: Strategy, view: str,
           documents: ViewDocuments) -> list[Selected]:
    """Where ``view`` reads each of its submdats; `PretokIncomplete` names the command that
    pretokenizes one it cannot read yet."""
    selected = []
    for info, chosen in documents:
        whole = catalogue.pretok(strategy.name, info.id)
        own = catalogue.pretok(strategy.name, info.id, view) if view != DEFAULT_VIEW else None
        if own is not None and own.complete:
            folder = view_pretok_folder(root, view, strategy.name, info.name)
            selected.append(Selected(info, own, chosen, folder, own=True))
        elif whole.complete:
            folder = pretok_folder(root, strategy.name, info.name)
            selected.append(Selected(info, whole, chosen, folder, own=False))
        else:
            only = "" if view == DEFAULT_VIEW else (
                f", or only view {view!r}'s documents with `matformer-mdat pretokenize {root} "
                f"{strategy.name} --view {view}`")
            raise PretokIncomplete(
                f"submdat {info.name!r} is not pretokenized with {strategy.name!r}; run "
                f"`matformer-mdat pretokenize {root} {strategy.name}` (it resumes){only}."
            )
    return selected


def view_targets(root: Path, catalogue: Catalogue, strategy: Strategy, view: str,
                 documents: ViewDocuments) -> list[PretokTarget]:
    """What pretokenizing named ``view`` on its own writes: each of its submdats not
    pretokenized whole yet, into the view's folder. What it began of a submdat pretokenized
    whole since is dropped: the view reads that one from the whole submdat's files."""
    targets = []
    for info, chosen in documents:
        own = catalogue.pretok(strategy.name, info.id, view)
        folder = view_pretok_folder(root, view, strategy.name, info.name)
        if catalogue.pretok(strategy.name, info.id).complete and not own.complete:
            catalogue.forget_view_pretok(view, strategy.name, info.id)
            shutil.rmtree(folder, ignore_errors=True)
            continue
        targets.append(PretokTarget(info, folder, view, chosen))
    return targets
