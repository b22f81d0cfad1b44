"""The weight hash a coordinator publishes each round and a client compares with its replica.

A client holds only its tier's slice, so the hash is defined per tier: sha256 over the
canonical names in sorted order, each followed by its region of the universal tensor as
contiguous little-endian bytes. The coordinator hashes its master at every tier in use; a
client hashes its own slice (its region is the whole of each tensor it holds) and gets the
same digest when, and only when, the replicas agree bit for bit.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

import torch
from torch import Tensor

from modeling.compression.grid import Region, region_slices


def weight_hash(state: Mapping[str, Tensor], regions: Mapping[str, Region] | None = None) -> str:
    """sha256 of ``state`` (canonical names), each tensor cut to ``regions[name]`` if given."""
    digest = hashlib.sha256()
    for name in sorted(state):
        tensor = state[name].detach()
        if regions is not None and name in regions:
            tensor = tensor[region_slices(regions[name])]
        data = tensor.contiguous().cpu()
        digest.update(name.encode())
        digest.update(str(data.dtype).encode() + str(tuple(data.shape)).encode())
        digest.update(data.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()
