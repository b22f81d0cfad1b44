"""Aggregation of one parameter's results from several clients (coordinator side).

Element by element, over the clients whose region covers that element:
``agg = Σ tokens_i · value_i / Σ tokens_i``. Elements nobody covered stay 0 with ``covered``
False, and get no update. Each client's share ``tokens_i / Σ tokens`` is computed first, so a
single client's values come through unchanged (share exactly 1.0): no-compression federated
training then matches standalone training bit for bit. Cost: one decode per result, one pass
over its region; linear in the number of clients.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from modeling.compression.encodings import decode
from modeling.compression.grid import region_slices
from modeling.compression.sparse import SparseResult
from modeling.compression.validation import validate_group
from modeling.errors import CompressionError


@dataclass(frozen=True, slots=True)
class Aggregate:
    values: Tensor  # float32, universal shape; 0 where not covered
    tokens: Tensor  # float32, universal shape: Σ tokens of the results covering each element

    @property
    def covered(self) -> Tensor:
        """bool, universal shape: True where some result covered the element."""
        return self.tokens > 0


def aggregate(results: Sequence[SparseResult], *, votes: bool = False) -> Aggregate:
    """Token-weighted, coverage-normalised mean of results for one parameter. Every result
    is validated before any arithmetic, so a bad one raises CompressionError and changes
    nothing. ``votes``: each result is one vote of its values' signs instead, the mean of the
    votes covering an element (signSGD with majority vote: under the sign rule, the majority
    decides, and no result weighs more than another whatever its tokens or magnitude)."""
    if not results:
        raise CompressionError("aggregate needs at least one result; skip parameters with none.")
    validate_group(results)
    shape = results[0].shape
    device = results[0].values.device
    tokens = torch.zeros(shape, device=device)  # Σ tokens over the clients covering each element
    for result in results:
        tokens[region_slices(result.region)] += result.tokens
    voters = torch.zeros(shape, device=device)
    if votes:
        for result in results:
            voters[region_slices(result.region)] += 1
    values = torch.zeros(shape, device=device)
    for result in results:
        where = region_slices(result.region)
        if votes:
            values[where] += torch.sign(decode(result)) / voters[where]
            continue
        covering = tokens[where]
        share = torch.full_like(covering, result.tokens) / covering  # true division: t/t is 1.0
        values[where] += decode(result) * share
    return Aggregate(values=values, tokens=tokens)


def scatter(result: SparseResult) -> Aggregate:
    """One result placed in its universal shape, with its coverage (validated)."""
    return aggregate([result])
