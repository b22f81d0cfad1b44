"""The outer state a restart needs besides the weights (docs/architecture.md, "The update
record"): the broadcast's residual and the outer momentum (``Carried``), saved with every
checkpoint, and each logged round's inputs, so that a resume rebuilds them exactly.

Replicas apply only steps, so the steps alone rebuild the weights; but the residual and the
momentum follow the aggregates, which no step holds. So a checkpoint ``round-K`` holds the
carried state after its round (``matformer_outer_state.safetensors``, written in the same
staging folder as the weights: whole or not at all), and each round the log holds since
holds the results its close aggregated (``updates/round-<r>.inputs.safetensors``, as they
went into ``close_round``: after the peer clip). A resume closes the logged rounds again
from the checkpoint's weights and carried state, which gives bit for bit the weights and
the carried state of the run that was not interrupted.

A run whose update carries nothing (no compressed broadcast, no outer momentum) logs no
inputs. Chunk ids and positions are stored at the narrowest integer dtype that holds them
(as on the wire), values at the dtype they arrived in, every result's end to end in a few
flat tensors: a round's inputs take about what its members uploaded.

    save_carried(folder, carried)            # into a checkpoint's staging folder
    carried = load_carried(folder, broadcast)  # None for a checkpoint written before this
    tensors, meta = results_record(by_name)  # a round's inputs, for the update log
    by_name = results_from(tensors, meta)
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor

from matformer.modeling.compression import Broadcast, SparseResult, index_dtype
from matformer.modeling.errors import CheckpointError
from matformer.server.update_steps import Carried

OUTER_STATE_STEM = "matformer_outer_state"
OUTER_STATE_NAME = f"{OUTER_STATE_STEM}.safetensors"
# 2: under a compressed broadcast the momentum is kept in its coefficients (1: in values)
VERSION = "2"
_KINDS = ("residual", "momentum")


def save_carried(folder: Path, carried: Carried, *, part: tuple[int, int] | None = None
                 ) -> None:
    """``carried`` as ``folder/matformer_outer_state.safetensors`` (float32, by name); with
    ``part`` (i, n), the part shard i of n holds, as ``matformer_outer_state-<i+1>-of-<n>``
    (``server/shards.py``). ``load_carried`` reads either back whole."""
    tensors = {f"{kind}/{name}": tensor.contiguous()
               for kind, by_name in _by_kind(carried).items() for name, tensor in by_name.items()}
    name = OUTER_STATE_NAME if part is None else \
        f"{OUTER_STATE_STEM}-{part[0] + 1:05d}-of-{part[1]:05d}.safetensors"
    save_file(tensors, str(Path(folder) / name),
              metadata={"format": "matformer-outer-state", "version": VERSION})


def load_carried(folder: Path, broadcast: Broadcast | None = None,
                 names: Collection[str] | None = None) -> Carried | None:
    """The carried state saved with the checkpoint in ``folder``, for a run whose broadcast
    is ``broadcast``; None when it has none (a checkpoint written before outer state was
    saved). ``names``: only theirs (a shard of the close reads its part so). A version 1
    file holds the momentum as values: under a compressed broadcast it
    is taken to the coefficients the close keeps it in now."""
    paths = outer_state_files(Path(folder))
    if not paths:
        return None
    carried = Carried()
    for path in paths:
        with safe_open(str(path), framework="pt") as opened:
            for key in opened.keys():  # noqa: SIM118  (a safetensors file is no mapping)
                kind, _, name = key.partition("/")
                if names is not None and name not in names:  # another shard's
                    continue
                tensor = opened.get_tensor(key)
                if kind in _KINDS:
                    getattr(carried, kind)[name] = tensor
                else:  # a round policy's own state (server/policies/)
                    carried.buffers.setdefault(kind, {})[name] = tensor
    with safe_open(str(paths[0]), framework="pt") as opened:
        version = (opened.metadata() or {}).get("version", "1")
    if version == "1" and broadcast is not None:
        carried.momentum = {name: broadcast.residual_of(values)
                            for name, values in carried.momentum.items()}
    return carried


def outer_state_files(folder: Path) -> list[Path]:
    """The outer state files of a checkpoint: one, or one per shard of the close that wrote
    it (all of them, whatever the shard count that reads them)."""
    whole = folder / OUTER_STATE_NAME
    if whole.is_file():
        return [whole]
    parts = sorted(folder.glob(f"{OUTER_STATE_STEM}-*-of-*.safetensors"))
    counts = {p.stem.rsplit("-of-", 1)[1] for p in parts}
    if parts and (len(counts) != 1 or len(parts) != int(counts.pop())):
        raise CheckpointError(
            f"{folder} holds outer state parts {', '.join(p.name for p in parts)}, which do "
            "not make one whole; restore the checkpoint's files, or resume from another one.")
    return parts


def carried_bytes(carried: Carried) -> int:
    """Bytes ``carried`` takes, in memory and in a checkpoint."""
    return sum(t.numel() * t.element_size()
               for by_name in _by_kind(carried).values() for t in by_name.values())


def _by_kind(carried: Carried) -> dict[str, dict[str, Tensor]]:
    """Every tensor ``carried`` holds, by kind: the residual, the momentum, a policy's own."""
    return {**{kind: getattr(carried, kind) for kind in _KINDS}, **carried.buffers}


def results_record(by_name: Mapping[str, Sequence[SparseResult]]
                   ) -> tuple[dict[str, Tensor], dict[str, dict[str, Any]]]:
    """A round's results as a few flat tensors, and their fields. The tensors: every
    result's chunk ids end to end in ``chunks``, its positions in ``indices`` (each at the
    narrowest integer dtype that holds them all), its values in ``values/<dtype>``, in
    aggregation order. The fields, by name: the parameter's ``shape`` and, per result in
    that order, ``[region, tokens, encoding, chunk, chunks' shape, indices' shape, values'
    shape, values' dtype]``; where a result's tensors start follows from the shapes before it. A few
    tensors rather than three per result, and no offsets: a round of a thousand members
    is a few million numbers, and its record costs about what copying them does."""
    parts: dict[str, list[Tensor]] = {}

    def place(key: str, tensor: Tensor) -> list[int]:
        parts.setdefault(key, []).append(tensor.reshape(-1))
        return list(tensor.shape)

    meta = {}
    for name, results in by_name.items():
        rows = []
        for result in results:
            dtype = str(result.values.dtype).removeprefix("torch.")
            rows.append([[list(r) for r in result.region], result.tokens, result.encoding,
                         list(result.chunk), place("chunks", result.chunks),
                         place("indices", result.indices),
                         place(f"values/{dtype}", result.values), dtype])
        meta[name] = {"shape": list(results[0].shape) if results else [], "results": rows}
    tensors = {}
    for key, pieces in parts.items():
        flat = torch.cat(pieces)
        if not key.startswith("values/"):
            flat = flat.to(index_dtype(int(flat.max()) + 1 if flat.numel() else 1))
        tensors[key] = flat
    return tensors, meta


def results_from(tensors: Mapping[str, Tensor], meta: Mapping[str, Any]
                 ) -> dict[str, list[SparseResult]]:
    """Inverse of ``results_record``; also reads the records of the two layouts before
    it: a dict of fields per result, with each tensor's offset (``[key, first, shape]``),
    or three tensors per result (``<name>/<j>/chunks|indices|values``)."""
    ends: dict[str, int] = {}

    def take(key: str, shape: list[int]) -> Tensor:
        at = ends.get(key, 0)
        ends[key] = at + math.prod(shape)
        return tensors[key][at:ends[key]].view(shape)

    def part(fields: Mapping[str, Any], field: str, name: str, j: int) -> Tensor:
        if field not in fields:  # the first layout
            return tensors[f"{name}/{j}/{field}"]
        key, at, shape = fields[field]
        return tensors[key][at:at + math.prod(shape)].view(shape)

    by_name: dict[str, list[SparseResult]] = {}
    for name, entries in meta.items():
        if isinstance(entries, Mapping):  # this layout
            shape = tuple(entries["shape"])
            by_name[name] = [SparseResult(
                name=name, shape=shape, region=tuple(tuple(r) for r in region),
                encoding=encoding, chunk=tuple(chunk),
                chunks=take("chunks", chunks).to(torch.int64),
                indices=take("indices", indices).to(torch.int64),
                values=take(f"values/{dtype}", values), tokens=tokens)
                for region, tokens, encoding, chunk, chunks, indices, values, dtype
                in entries["results"]]
            continue
        by_name[name] = [SparseResult(
            name=name, shape=tuple(fields["shape"]),
            region=tuple(tuple(r) for r in fields["region"]), encoding=fields["encoding"],
            chunk=tuple(fields["chunk"]), chunks=part(fields, "chunks", name, j).to(torch.int64),
            indices=part(fields, "indices", name, j).to(torch.int64),
            values=part(fields, "values", name, j), tokens=fields["tokens"])
            for j, fields in enumerate(entries)]
    return by_name
