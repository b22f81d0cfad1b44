"""Contribution scores: how far each accepted result points the way its peers' results do
(docs/architecture.md, "Members that fail or misbehave").

The norm limits bound how much a result weighs, never which way it pushes: a member that
sends its honest result with the sign flipped, at an honest norm, passes every bound and
undoes a peer's work each round. Its direction gives it away. A result's score is the cosine
between it and the token-weighted sum of the round's other results, over the coordinates it
sent (``agreement``): near 1 for a result its peers' agree with, near 0 for noise, negative for
one that pushes against them. It is taken where the results were sent, in the DCT (or top-k)
domain: the chunkwise DCT is orthonormal, so inner products there are those of the decoded
values. A large round is scored on a sample of its values (``SCORED_VALUES``), drawn anew
each round after the results are in.

Two results cannot tell which of them is wrong, so a round is scored only when it has at
least ``MIN_RESULTS`` results (a relay's partial sum is one). A member is excluded when the
mean of its last ``[faults] score_rounds`` scores is below ``[faults] min_score``
(``ScoreJudge``); the scores and their mean are in the round records, on the dashboard and
in ``/api/clients``.

    scores = agreement({"client-0": results0, "client-1": results1, "client-2": results2})
    judge = ScoreJudge(faults)
    why = judge.add(member, scores["client-2"])   # the exclusion's reason, or None
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from matformer.modeling.compression import SparseResult
from matformer.modeling.compression.grid import ChunkGrid, region_slices

if TYPE_CHECKING:
    from matformer.server.membership import Member
    from matformer.server.sections import FaultsSection

MIN_RESULTS = 3  # results in a round before any is scored: a majority to agree with
PAIRWISE_MAX = 8  # up to this many results, the majority is found from every pair
# values a round's scores compare at most, all results together: more are sampled (a sign
# flip shows at a few thousand values a member; 0.19-0.87 s of a 150M close, 4-64 members)
SCORED_VALUES = 2**19


def agreement(results: Mapping[str, Sequence[SparseResult]]) -> dict[str, float]:
    """Client → the cosine between its results and the token-weighted sum of its peers'
    in the round's majority (each parameter compared where the client sent values, among
    results of one layout), in [-1, 1]. Clients are left out where the round has fewer than
    MIN_RESULTS results, or no peer sent values where they did.

    The majority is the n // 2 + 1 results that agree most with the others: by the sum of
    their cosines with each other result (up to PAIRWISE_MAX results), else by their cosine
    with the sum of all the others. Against all peers, one result pushing against the rest
    drags every honest member's reference with it (with three members an honest one's peers
    sum to an honest result minus another, near 0 or below); against the majority, everyone
    is compared with honest results only, as long as fewer than half push against them.

    A round of more than SCORED_VALUES values is scored on a sample of them: every
    ``stride``-th chunk (element, for dense results) from an offset drawn anew each round,
    after the results are in, so no member knows which of its values are compared."""
    if len(results) < MIN_RESULTS:
        return {}
    sent = sum(r.values.numel() for rs in results.values() for r in rs)
    stride = max(1, -(-sent // SCORED_VALUES))
    slot = {client: i for i, client in enumerate(results)}
    groups = _groups(results, slot, stride, secrets.randbelow(stride))
    ranks = (_support(groups, slot) if len(results) <= PAIRWISE_MAX
             else _cosines(groups, slot, set(results)))
    majority = sorted(ranks, key=ranks.__getitem__, reverse=True)[:len(results) // 2 + 1]
    return _cosines(groups, slot, set(majority))


@dataclass(frozen=True, slots=True)
class _Placed:
    """One parameter's sampled values of one layout, every client's end to end."""

    size: int  # the index space they lie in
    at: Tensor  # int64: where each value lies in it
    values: Tensor  # float32
    tokens: Tensor  # float32: the tokens of the result each value came from
    owner: Tensor  # int64: the slot of the client that sent it


def _groups(results: Mapping[str, Sequence[SparseResult]], slot: Mapping[str, int],
            stride: int, offset: int) -> list[_Placed]:
    """The results of each parameter and layout that more than one client sent, their sample
    (the chunks, or elements, ``i`` with ``(i + offset) % stride == 0``) placed on one index
    space, that of the parameter's sample (its chunks whole, for chunked results). No sort:
    the sums are taken by adding into that space."""
    by_layout: dict[tuple[str, str, tuple[int, ...]], list[tuple[str, SparseResult]]] = {}
    for client, sent in results.items():
        for result in sent:
            by_layout.setdefault((result.name, result.encoding, result.chunk), []).append(
                (client, result))
    return [_placed(group, slot, stride, offset)
            for group in by_layout.values() if len(group) > 1]


def _placed(group: list[tuple[str, SparseResult]], slot: Mapping[str, int], stride: int,
            offset: int) -> _Placed:
    """``group``'s sample, placed; chunked results of one k are taken all at once."""
    first = group[0][1]
    if first.encoding == "dense":  # the universal shape's elements, each region's own
        size = (math.prod(first.shape) + offset) // stride + 1
        flat = torch.arange(math.prod(first.shape)).view(first.shape)
        pieces = []
        for client, r in group:
            ids = flat[region_slices(r.region)].reshape(-1) + offset
            keep = ids % stride == 0
            pieces.append((ids[keep] // stride, r.values.float().reshape(-1)[keep],
                           r.tokens, slot[client]))
        return _joined(size, pieces)
    chunk = math.prod(first.chunk)  # the chunked coefficients: (chunk id, position)
    size = (ChunkGrid(shape=first.shape, chunk=first.chunk).size + offset) // stride + 1
    size *= chunk
    if len({r.indices.shape[1] for _, r in group}) > 1:  # k differs: one result at a time
        pieces = []
        for client, r in group:
            ids = r.chunks.long() + offset
            keep = ids % stride == 0
            at = (ids[keep] // stride).unsqueeze(1) * chunk + r.indices[keep].long()
            pieces.append((at.reshape(-1), r.values[keep].float().reshape(-1), r.tokens,
                           slot[client]))
        return _joined(size, pieces)
    counts = torch.tensor([len(r.chunks) for _, r in group])
    ids = torch.cat([r.chunks.long() for _, r in group]) + offset
    keep = ids % stride == 0
    at = (ids[keep] // stride).unsqueeze(1) * chunk \
        + torch.cat([r.indices.long() for _, r in group])[keep]
    k = at.shape[1]
    values = torch.cat([r.values.float() for _, r in group])[keep].reshape(-1)
    tokens = torch.tensor([float(r.tokens) for _, r in group]).repeat_interleave(counts)
    owner = torch.tensor([slot[c] for c, _ in group]).repeat_interleave(counts)
    return _Placed(size=size, at=at.reshape(-1), values=values,
                   tokens=tokens[keep].repeat_interleave(k),
                   owner=owner[keep].repeat_interleave(k))


def _joined(size: int, pieces: list[tuple[Tensor, Tensor, int, int]]) -> _Placed:
    """Pieces (at, values, tokens, slot), one per result, end to end."""
    lengths = torch.tensor([len(at) for at, _, _, _ in pieces])
    return _Placed(size=size, at=torch.cat([at for at, _, _, _ in pieces]),
                   values=torch.cat([v for _, v, _, _ in pieces]),
                   tokens=torch.tensor([float(t) for _, _, t, _ in pieces]).repeat_interleave(
                       lengths),
                   owner=torch.tensor([s for _, _, _, s in pieces]).repeat_interleave(lengths))


def _cosines(groups: list[_Placed], slot: Mapping[str, int], counted: set[str]
             ) -> dict[str, float]:
    """Each client's cosine with the token-weighted sum of the ``counted`` clients' results
    but its own, over the coordinates it sent: per parameter one sum of the counted ones
    (added in the clients' order), and each client's three inner products added up in
    float64."""
    dot, own, peer = (torch.zeros(len(slot), dtype=torch.float64) for _ in range(3))
    chosen = torch.tensor([slot[client] for client in counted])
    for g in groups:
        weighted = g.values * g.tokens
        inside = torch.isin(g.owner, chosen)
        total = torch.zeros(g.size, dtype=torch.float32).index_add_(
            0, g.at[inside], weighted[inside])
        peers = total[g.at] - torch.where(inside, weighted, 0.0)  # but its own
        dot.index_add_(0, g.owner, (g.values * peers).double())
        own.index_add_(0, g.owner, (g.values * g.values).double())
        peer.index_add_(0, g.owner, (peers * peers).double())
    scores = {}
    for client, i in slot.items():
        if own[i] > 0 and peer[i] > 0:
            cosine = float(dot[i]) / math.sqrt(float(own[i]) * float(peer[i]))
            scores[client] = max(-1.0, min(1.0, cosine))
    return scores


def _support(groups: list[_Placed], slot: Mapping[str, int]) -> dict[str, float]:
    """Each client's cosines with every other client's results (each over all the values
    both sent), summed: high for one the others agree with."""
    dots: dict[tuple[str, str], float] = {}
    norms = dict.fromkeys(slot, 0.0)
    for g in groups:
        sent = {client: g.owner == i for client, i in slot.items()}
        for client in slot:
            mine = sent[client]
            if not bool(mine.any()):
                continue
            values = g.values[mine]
            norms[client] += float(torch.dot(values, values))
            spread = torch.zeros(g.size, dtype=torch.float32).index_put_((g.at[mine],), values)
            for other in slot:
                if other > client and bool(sent[other].any()):  # each pair once
                    pair = (client, other)
                    dots[pair] = dots.get(pair, 0.0) + float(
                        torch.dot(spread[g.at[sent[other]]], g.values[sent[other]]))
    support = dict.fromkeys(slot, 0.0)
    for (a, b), dot in dots.items():
        if norms[a] > 0 and norms[b] > 0:
            cosine = dot / math.sqrt(norms[a] * norms[b])
            support[a] += cosine
            support[b] += cosine
    return support


class ScoreJudge:
    """Each member's recent scores, and who keeps pushing against its peers."""

    def __init__(self, faults: FaultsSection) -> None:
        self.faults = faults  # min_score and score_rounds, read at each round

    def add(self, member: Member, score: float | None) -> str | None:
        """Record ``member``'s score for a round it delivered in (None: not scored); the
        reason to exclude it, or None."""
        member.score = score
        if score is None:
            return None
        window = self.faults.score_rounds
        member.scores = [*member.scores, score][-max(window, 1):]
        mean = sum(member.scores) / len(member.scores)
        member.score_mean = mean
        if window and len(member.scores) >= window and mean < self.faults.min_score:
            return (f"its results pointed against its peers': mean agreement {mean:+.3f} over "
                    f"its last {window} scored rounds, below [faults] min_score "
                    f"{self.faults.min_score:+g}")
        return None
