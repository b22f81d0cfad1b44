"""Mdat-saetta: a shuffled view's sequences laid out flat, to be read sequentially.

A saetta folder holds ``tokens.npy`` (every sequence's tokens, one after another, in the
order given), ``offsets.npy`` (uint64, ``offsets[i]:offsets[i + 1]`` is sequence ``i``) and
``saetta.json`` (counts and provenance: strategy, view, shuffle seed and the dataset
fingerprint the sequence ids refer to). Reading sequence ``i`` is one slice of a memory map,
which is as fast as reading the same tokens from any flat array. The folder is built aside
(`built_aside`), so it appears whole or not at all.

Training reads one in place of the view it was exported from (``[data] saetta``): its order
is the view's shuffle, so reading sequences ``0, 1, 2, ...`` is the run's first epoch, read
front to back. `Mdat.saetta` opens one after checking, by its provenance, that it holds what
the container's view would give (`SaettaReader.check_source`).
"""

from __future__ import annotations

import itertools
import json
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import closing
from pathlib import Path

import numpy as np
from tqdm import tqdm

from matformer.modeling.atomic import built_aside
from matformer.modeling.errors import MdatCorrupt, SaettaError
from matformer.modeling.mdat.npy_files import AppendableNpy, load_npy
from matformer.modeling.mdat.sequences import SequenceReader

TOKENS = "tokens.npy"
OFFSETS = "offsets.npy"
MANIFEST = "saetta.json"
_ITER_BLOCK = 1 << 16  # offsets turned into Python ints at a time while iterating


def export_saetta(
    sequences: SequenceReader,
    order: Sequence[int] | np.ndarray,
    out: str | Path,
    *,
    seed: int | None = None,
    progress: bool = False,
) -> Path:
    """Write ``sequences[order[0]], sequences[order[1]], ...`` as a saetta folder ``out``.

    ``seed``: the seed of the shuffle ``order`` comes from, recorded with the reader's view
    and fingerprint in ``saetta.json`` (None for an order of another origin, such as a shard).
    """
    out = Path(out)
    if out.exists():
        raise SaettaError(f"{out} exists already; remove it or export to another path.")
    with built_aside(out) as building:
        building.mkdir(parents=True)
        tokens = AppendableNpy(building / TOKENS, sequences.token_dtype)  # marks kept
        offsets = np.zeros(len(order) + 1, dtype=np.uint64)
        with closing(tokens):
            for position, index in enumerate(tqdm(order, desc="export saetta", unit="seq",
                                                  file=sys.stderr, disable=not progress)):
                sequence = sequences[int(index)]
                tokens.append(sequence)
                offsets[position + 1] = offsets[position] + len(sequence)
            tokens.commit()
        np.save(building / OFFSETS, offsets)
        manifest = {
            "sequences": len(order), "tokens": int(offsets[-1]),
            "max_seq_len": sequences.max_seq_len, "strategy": sequences.strategy.to_dict(),
            "view": sequences.view, "seed": seed, "fingerprint": sequences.fingerprint,
        }
        (building / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return out


class SaettaReader:
    """Sequences of a saetta folder: ``len``, ``reader[i]`` (a 1-D token array), iteration."""

    def __init__(self, folder: str | Path) -> None:
        folder = Path(folder)
        try:
            self.manifest = json.loads((folder / MANIFEST).read_text())
            count = self.manifest["sequences"]
            self._offsets = np.asarray(load_npy(folder / OFFSETS, count + 1))  # (count + 1,)
            self._tokens = np.asarray(load_npy(folder / TOKENS, self.manifest["tokens"]))
        except (OSError, ValueError, KeyError, MdatCorrupt) as err:
            raise SaettaError(
                f"{folder} is not a complete saetta folder ({err}); export it again with "
                "`matformer-mdat export-saetta`."
            ) from err
        self._count = count
        self.folder = folder

    def __len__(self) -> int:
        return self._count

    def lengths(self) -> np.ndarray:
        """(len(self),) int64: every sequence's length, from the offsets alone."""
        return np.diff(self._offsets).astype(np.int64)

    def check_source(self, fingerprint: Callable[[], str], *, strategy: str, view: str,
                     max_seq_len: int, seed: int) -> None:
        """That this export holds view ``view``'s sequences of ``max_seq_len`` tokens at most,
        pretokenized with ``strategy``, in the order of the shuffle of ``seed``; then that the
        view's data have the same fingerprint now (``fingerprint()``, `Mdat.fingerprint`) as
        when exported. `SaettaError` names what differs, and what to do."""
        manifest = self.manifest
        exported = {"strategy": manifest["strategy"].get("strategy_name"),
                    "view": manifest["view"], "max_seq_len": manifest["max_seq_len"],
                    "seed": manifest["seed"]}
        asked = {"strategy": strategy, "view": view, "max_seq_len": max_seq_len, "seed": seed}
        differ = [f"{key} {exported[key]!r} (asked: {value!r})" for key, value in asked.items()
                  if exported[key] != value]
        if differ:
            raise SaettaError(
                f"{self.folder} was exported with {', '.join(differ)}; read it with the "
                "strategy, view, max_seq_len and shuffle seed it was exported with (training: "
                "--strategy, --view, --seq-len, --seed), or export the view you asked for "
                "(`matformer-mdat export-saetta`)."
            )
        now = fingerprint()
        if now != manifest["fingerprint"]:
            raise SaettaError(
                f"{self.folder} holds view {view!r} as it was when exported (fingerprint "
                f"{manifest['fingerprint']}), and its data changed since (fingerprint now "
                f"{now}); export it again (`matformer-mdat export-saetta`)."
            )

    def __getitem__(self, index: int) -> np.ndarray:
        if index < 0:
            index += self._count
        if not 0 <= index < self._count:
            raise IndexError(f"sequence {index} outside 0..{self._count - 1}")
        offsets = self._offsets
        return self._tokens[offsets[index]:offsets[index + 1]]  # (<= max_seq_len,)

    def __iter__(self) -> Iterator[np.ndarray]:
        tokens = self._tokens
        for block in range(0, self._count, _ITER_BLOCK):
            offsets = self._offsets[block:block + _ITER_BLOCK + 1].tolist()  # Python ints
            for start, stop in itertools.pairwise(offsets):
                yield tokens[start:stop]
