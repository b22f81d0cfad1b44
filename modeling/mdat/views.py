"""Views: named subsets of a container, one quota per submdat.

A quota is a document count (``1000``), a fraction of the submdat's documents (``0.1``) or an
amount of raw UTF-8 text (``"10K"``, ``"500M"``, ``"2G"``; powers of 1024). Documents are
drawn uniformly at random with the view's seed, so a small view is a fair sample rather than
the head of a possibly sorted source; for a size quota, the fewest drawn documents whose texts
reach the size. The chosen document indices are stored, sorted, in
``views/<view>/<submdat>.npy`` next to ``view.json``; no document is copied.
"""

from __future__ import annotations

import json
import math
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from matformer.modeling.atomic import built_aside
from matformer.modeling.errors import QuotaError, QuotaTooLarge
from matformer.modeling.mdat.catalogue import SubmdatInfo

Quota = int | float | str
# Every document of every complete submdat; never stored. Importing or removing a submdat
# changes it, which the fingerprint of a shuffle of it notices (`modeling.mdat.fingerprints`).
DEFAULT_VIEW = "default"
_SIZE = re.compile(r"(\d+(?:\.\d+)?)([KMGT])B?", re.IGNORECASE)
_UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


@dataclass(frozen=True, slots=True)
class View:
    name: str
    seed: int
    quotas: dict[str, Quota]  # submdat name → quota, as given
    documents: dict[str, int]  # submdat name → documents chosen


def quota_documents(quota: Quota, info: SubmdatInfo, sizes: np.ndarray, seed: int) -> np.ndarray:
    """The sorted indices of the documents of ``info`` that ``quota`` selects."""
    order = np.random.default_rng([seed, info.id]).permutation(info.documents)
    if isinstance(quota, bool) or not isinstance(quota, int | float | str):
        raise QuotaError(_bad(quota, info))
    if isinstance(quota, str):
        match = _SIZE.fullmatch(quota.strip())
        if match is None:
            raise QuotaError(_bad(quota, info))
        wanted = int(float(match[1]) * _UNITS[match[2].upper()])
        if wanted < 1:
            raise QuotaError(_bad(quota, info))
        if wanted > info.raw_bytes:
            raise QuotaTooLarge(
                f"quota {quota!r} ({wanted:,} bytes) exceeds submdat {info.name!r}'s "
                f"{info.raw_bytes:,} bytes of text; lower it."
            )
        reached = np.cumsum(sizes[order])
        count = int(np.searchsorted(reached, wanted, side="left")) + 1
    elif isinstance(quota, float):
        if not 0 < quota <= 1:
            raise QuotaError(_bad(quota, info))
        count = math.ceil(quota * info.documents)
    else:
        if quota < 1:
            raise QuotaError(_bad(quota, info))
        if quota > info.documents:
            raise QuotaTooLarge(
                f"quota {quota} exceeds submdat {info.name!r}'s {info.documents} documents; "
                "lower it, or give a fraction such as 0.5."
            )
        count = quota
    return np.sort(order[:count])


def _bad(quota: object, info: SubmdatInfo) -> str:
    return (
        f"quota {quota!r} for submdat {info.name!r} is not a document count (1000), a fraction "
        "in (0, 1] (0.1) or a size of text (\"10K\", \"500M\", \"2G\")."
    )


def view_folder(root: Path, name: str) -> Path:
    return root / "views" / name


def write_view(root: Path, view: View, chosen: dict[str, np.ndarray]) -> None:
    """Write the view's folder whole and durably (`built_aside`)."""
    folder = view_folder(root, view.name)
    # A folder the catalogue does not list is left over from an interrupted create_view.
    shutil.rmtree(folder, ignore_errors=True)
    with built_aside(folder) as building:
        building.mkdir()
        for submdat, documents in chosen.items():
            np.save(building / f"{submdat}.npy", documents.astype(np.int64))
        definition = {"seed": view.seed, "quotas": view.quotas, "documents": view.documents}
        (building / "view.json").write_text(json.dumps(definition, indent=2) + "\n")
