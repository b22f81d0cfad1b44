"""What a submission may hold beyond being well formed (docs/architecture.md, "Members
that fail or misbehave"): the run's own
encoding, chunking and value dtype, at most ``topk`` values per chunk, no value beyond
``MAX_ABS_VALUE``, and an L2 norm within ``[faults] max_norm`` (clipped or refused, per
``norm_action``).

    limits = SubmissionLimits(config.compression, config.faults)
    results = limits.check(results)   # the results to keep (clipped), or a BadResult

The norm is taken over every value of the submission at once. The DCT is orthonormal, so the
norm of the coefficients is the norm of the gradient they encode, whatever the encoding.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from matformer.modeling.compression import CompressionConfig, SparseResult, region_shape
from matformer.modeling.compression.grid import ChunkGrid
from matformer.server.errors import NormTooLarge, TooManyCoefficients, ValueTooLarge, WrongEncoding
from matformer.server.sections import FaultsSection

# No healthy client sends a coefficient this large, and below it every sum the coordinator
# forms (a chunk's inverse DCT, the token-weighted mean, the master update) stays finite in
# float32, whatever max_norm says.
MAX_ABS_VALUE = 1e9


class SubmissionLimits:
    def __init__(self, compression: CompressionConfig, faults: FaultsSection) -> None:
        self.compressor = compression.build()
        self.faults = faults

    def check(self, results: Sequence[SparseResult], *, partial: bool = False
              ) -> list[SparseResult]:
        """``results`` as the coordinator keeps them, or the BadResult that refuses them.
        ``partial``: a relay's partial sums, whose layout (float32 values, up to a whole
        chunk of positions) the wire checked; their values and norm are bounded alike."""
        for result in results:
            if partial:
                self._check_magnitude(result)
            else:
                self._check_one(result)
        bound = self.faults.max_norm
        if bound is None:
            return list(results)
        norm = math.sqrt(sum(float(r.values.double().square().sum()) for r in results))
        if norm <= bound:
            return list(results)
        if self.faults.norm_action == "reject":
            raise NormTooLarge(f"the submission's values have L2 norm {norm:.4g}, above [faults] "
                               f"max_norm {bound:g}; the client's gradient exploded, so it "
                               "should reload the checkpoint.")
        scale = bound / norm
        return [dataclasses.replace(r, values=(r.values.double() * scale).to(r.values.dtype))
                for r in results]

    def _check_magnitude(self, result: SparseResult) -> None:
        largest = float(result.values.abs().max()) if result.values.numel() else 0.0
        if largest > MAX_ABS_VALUE:
            raise ValueTooLarge(f"{result.name} holds a value of magnitude {largest:.3g}, above "
                                f"{MAX_ABS_VALUE:g}; the client's gradient exploded, so it "
                                "should reload the checkpoint.")

    def _check_one(self, result: SparseResult) -> None:
        c = self.compressor
        name = result.name
        self._check_magnitude(result)
        if result.encoding != c.encoding_name:
            raise WrongEncoding(f"{name} is encoded as {result.encoding!r}, the run uses "
                                f"{c.encoding_name!r}; take the settings from JoinReply.")
        want_dtype = c.momentum_dtype if c.encoding_name == "dense" else c.value_dtype
        if result.values.dtype != want_dtype or result.value_bits != c.value_bits:
            sent = f"{result.value_bits}-bit codes" if result.value_bits else result.values.dtype
            want = f"{c.value_bits}-bit codes" if c.value_bits else want_dtype
            raise WrongEncoding(f"{name}: values are {sent}, the run sends {want}; take "
                                "value_dtype from JoinReply.settings.")
        if c.encoding_name == "dense":
            return
        chunk = tuple(ChunkGrid.of(result.shape, c.chunk).chunk)
        if tuple(result.chunk) != chunk:
            raise WrongEncoding(f"{name}: chunk {tuple(result.chunk)}, the run's grid uses "
                                f"{chunk} for shape {tuple(result.shape)}.")
        per_chunk = result.values.shape[-1] if result.values.dim() else 0
        if per_chunk > c.topk:
            raise TooManyCoefficients(f"{name}: {per_chunk} values per chunk, the run's topk "
                                      f"allows {c.topk}.")


def clip_to_peers(results: Sequence[SparseResult], factor: float) -> list[SparseResult]:
    """One parameter's results of a round, each scaled down so that its root mean square
    over the region it covers is at most ``factor`` × the lower median of theirs.

    A result's weight in the aggregate is its assigned tokens, but its magnitude is its own:
    without this, one member sending the largest values allowed steers the mean (and so
    the sign) of every element it covers. Norms of DCT coefficients are norms of the
    gradients they encode, so this needs no decoding. Fewer than two results: unchanged (a
    lone member has no peers). Of two, the lower median is the smaller: the mean of two, which
    a loud result drags up, would bound nothing; a quiet one scales the other down instead.
    """
    if factor <= 0 or len(results) < 2:
        return list(results)
    rms = [math.sqrt(float(r.values.double().square().sum()) / math.prod(region_shape(r.region)))
           for r in results]
    bound = factor * sorted(rms)[(len(rms) - 1) // 2]
    return [r if size <= bound or size == 0 else dataclasses.replace(
                r, values=(r.values.double() * (bound / size)).to(r.values.dtype))
            for r, size in zip(results, rms, strict=True)]

