"""Shuffles: stored permutations of a view's sequence ids, tied to the data they permute.

A shuffle is ``shuffling/<view>.<strategy>.<max_seq_len>.seed<seed>.npy`` (uint32, or uint64
past 2**32 sequences) and a catalogue row holding the fingerprint and the description of the
data it permutes (`modeling.mdat.fingerprints`). Sequence ids mean something only for that
data: a submdat imported into the default view, for one, moves them. So a stored shuffle is
given back only while the fingerprint still matches (`StaleShuffle` names what changed), and
it is never overwritten: another permutation of other data needs another seed.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from matformer.modeling.errors import StaleShuffle
from matformer.modeling.mdat.catalogue import ShuffleInfo
from matformer.modeling.mdat.fingerprints import Description, changes, digest
from matformer.modeling.mdat.npy_files import load_npy, save_npy


def shuffle_name(view: str, strategy: str, max_seq_len: int, seed: int) -> str:
    return f"{view}.{strategy}.{max_seq_len}.seed{seed}"


def shuffle_path(root: Path, name: str) -> Path:
    return root / "shuffling" / f"{name}.npy"


def write_shuffle(root: Path, info: ShuffleInfo) -> np.ndarray:
    """Save the permutation of ``info.sequences`` ids that ``info.seed`` gives; returns it."""
    order = np.random.default_rng(info.seed).permutation(info.sequences)
    dtype = np.uint32 if info.sequences < 1 << 32 else np.uint64
    save_npy(shuffle_path(root, info.name), order.astype(dtype))
    return load_npy(shuffle_path(root, info.name), info.sequences)


def read_shuffle(root: Path, info: ShuffleInfo, dataset: Description) -> np.ndarray:
    """The stored permutation, if ``dataset`` (the view's data now) is what it was made for."""
    if digest(dataset) != info.fingerprint:
        raise StaleShuffle(
            f"shuffle {info.name!r} permutes the sequence ids view {info.view!r} had when it "
            f"was made, and its data changed since ({changes(json.loads(info.dataset), dataset)}"
            "); the ids now point at other sequences. Shuffle under a new seed (the old "
            "shuffle stays, for the runs that used it)."
        )
    return load_npy(shuffle_path(root, info.name), info.sequences,
                    fix="shuffle under a new seed")
