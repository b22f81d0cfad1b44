"""Dataset fingerprints: one hash of everything that decides a view's sequence ids.

Sequence ids are positions in a list built from the strategy, ``max_seq_len`` and, per
submdat of the view in id order, its documents, tokens, chunks and which documents the view
selects (`modeling.mdat.sequences`). `describe` gathers exactly those as plain data and
`digest` hashes it (sha256 of canonical JSON). Two containers with the same fingerprint give
every sequence id the same tokens; a shuffle stores the description it was made from, so when
the data moved on, `changes` can name what moved.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import numpy as np

from matformer.modeling.mdat.catalogue import PretokProgress, SubmdatInfo
from matformer.modeling.mdat.strategy import Strategy

Description = dict[str, Any]
_SHOWN = 6  # changes named in a message at most


def describe(
    strategy: Strategy, max_seq_len: int,
    parts: list[tuple[SubmdatInfo, PretokProgress, np.ndarray | None]],
) -> Description:
    """What the sequence ids of ``parts`` (submdat, progress, selected documents or None for
    all of them) depend on."""
    return {
        "strategy": strategy.to_dict(),
        "max_seq_len": max_seq_len,
        "submdats": {
            info.name: {
                "id": info.id, "documents": info.documents, "tokens": progress.tokens,
                "chunks": progress.chunks, "selection": "all" if documents is None else
                f"{len(documents)} documents, sha256 "
                f"{hashlib.sha256(np.ascontiguousarray(documents, np.int64)).hexdigest()}",
            }
            for info, progress, documents in parts
        },
    }


def digest(description: Description) -> str:
    canonical = json.dumps(description, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def changes(before: Description, now: Description) -> str:
    """The differences from ``before`` to ``now``, as one line: "path: old → new; ..."."""
    old, new = _flat(before), _flat(now)
    found = [f"{path}: {old.get(path, 'absent')} → {new.get(path, 'absent')}"
             for path in sorted(old.keys() | new.keys()) if old.get(path) != new.get(path)]
    more = f"; and {len(found) - _SHOWN} more" if len(found) > _SHOWN else ""
    return "; ".join(found[:_SHOWN]) + more


def _flat(value: Any, path: str = "") -> dict[str, Any]:
    """Nested dicts as one dict of dotted paths ("submdats.wiki.documents") to leaf values."""
    if not isinstance(value, dict):
        return {path: value}
    return {leaf: item for key, sub in value.items()
            for leaf, item in _flat(sub, f"{path}.{key}" if path else key).items()}
