"""The weight hash a coordinator publishes each round and a client compares with its replica.

A client holds only its tier's slice, so the hash is defined per tier: sha256 over the
canonical names in sorted order, each followed by the dtype and shape of its region of the
universal tensor and the sha256 of that region as contiguous little-endian bytes. The
coordinator hashes its master at every tier in use; a client hashes its own slice (its
region is the whole of each tensor it holds) and gets the same digest when, and only when,
the replicas agree bit for bit.

Tiers share most tensors whole and the rest by prefix, so ``tier_hashes`` reads each byte
about once whatever the number of tiers: a region several tiers share is digested once, and
row prefixes of one tensor (gate and up projections) are digested in one pass, the digest
taken at each tier's boundary.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor

import torch
from torch import Tensor

from matformer.modeling.compression.grid import Region, full_region, region_shape, region_slices


def weight_hash(state: Mapping[str, Tensor], regions: Mapping[str, Region] | None = None) -> str:
    """sha256 of ``state`` (canonical names), each tensor cut to ``regions[name]`` if given."""
    return tier_hashes(state, {0: regions or {}})[0]


def tier_hashes(state: Mapping[str, Tensor], regions: Mapping[int, Mapping[str, Region]]
                ) -> dict[int, str]:
    """``weight_hash(state, regions[tier])`` for every tier, each region digested once."""
    return combine_digests(layout_of(state), regions, region_digests(state, regions))


def layout_of(state: Mapping[str, Tensor]) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Each tensor's dtype and shape, all a hash needs besides the digests of its regions."""
    return {name: (str(t.dtype), tuple(t.shape)) for name, t in state.items()}


def region_digests(state: Mapping[str, Tensor], regions: Mapping[int, Mapping[str, Region]]
                   ) -> dict[tuple[str, Region], bytes]:
    """The sha256 of every region of ``state`` that some tier in ``regions`` covers. The
    digests of parts of a state, taken where each part is held (a shard of the close), are
    combined by ``combine_digests`` into the hashes of the whole."""
    def digest(name: str) -> dict[Region, bytes]:
        tensor = state[name]
        return _digests(tensor, {r.get(name, full_region(tensor.shape)) for r in regions.values()})

    # sha256 lets go of the GIL while it reads a buffer: tensors are digested side by side
    with ThreadPoolExecutor(max_workers=max(1, torch.get_num_threads())) as pool:
        per_name = dict(zip(sorted(state), pool.map(digest, sorted(state)), strict=True))
    return {(name, region): d for name, found in per_name.items() for region, d in found.items()}


def combine_digests(layout: Mapping[str, tuple[str, tuple[int, ...]]],
                    regions: Mapping[int, Mapping[str, Region]],
                    digests: Mapping[tuple[str, Region], bytes]) -> dict[int, str]:
    """Each tier's hash of a state laid out as ``layout`` (name → dtype, shape) from the
    digests of its regions."""
    hashes = {}
    for tier, cut in regions.items():
        digest = hashlib.sha256()
        for name in sorted(layout):
            dtype, shape = layout[name]
            region = cut.get(name, full_region(shape))
            digest.update(name.encode())
            digest.update(dtype.encode() + str(region_shape(region)).encode())
            digest.update(digests[name, region])
        hashes[tier] = digest.hexdigest()
    return hashes


def _digests(tensor: Tensor, regions: set[Region]) -> dict[Region, bytes]:
    """sha256 of each region's bytes; regions that are row prefixes of the tensor (start 0,
    whole in every other dimension) are read in one pass."""
    prefixes = sorted((r for r in regions if _row_prefix(r, tensor.shape)),
                      key=lambda r: r[0][1])
    out = {}
    if prefixes:
        rows = tensor.detach().contiguous().cpu().reshape(tensor.shape[0], -1)
        digest, done = hashlib.sha256(), 0
        for region in prefixes:
            stop = region[0][1]
            digest.update(_bytes(rows[done:stop]))
            out[region], done = digest.copy().digest(), stop
    for region in regions - set(prefixes):
        out[region] = hashlib.sha256(_bytes(tensor.detach()[region_slices(region)])).digest()
    return out


def _row_prefix(region: Region, shape: torch.Size) -> bool:
    return bool(shape) and region[0][0] == 0 and all(
        pair == (0, size) for pair, size in zip(region[1:], shape[1:], strict=True))


def _bytes(tensor: Tensor) -> memoryview:
    data = tensor.contiguous().cpu().reshape(-1).view(torch.uint8)
    return memoryview(data.numpy())
