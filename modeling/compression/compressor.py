"""Compression settings (DeMo's defaults) and the compressor they build.

``CompressionConfig`` is plain data; ``build()`` gives a ``Compressor``, which encodes one
region of one parameter into a ``SparseResult`` and makes each parameter's error-feedback
state. The defaults are DeMo's: DCT over 64 × 64 chunks, 32 coefficients kept per chunk,
momentum decay 0.999.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from matformer.modeling.compression.encodings import ENCODERS, Encoding, get_encoding
from matformer.modeling.compression.feedback import ErrorFeedback
from matformer.modeling.compression.grid import ChunkGrid, Region, region_shape
from matformer.modeling.compression.quantize import QUANTIZED_BITS
from matformer.modeling.compression.sparse import SparseResult
from matformer.modeling.errors import CompressionConfigError, ResultShapeMismatch, SettingsError
from matformer.modeling.settings import check_declared, setting

UINT32_MAX = 2**32 - 1  # chunk and topk travel to clients as uint32 (TrainingSettings)
MAX_LR = 10.0  # a run's bound on a learning rate: a step of 10·sign(aggregate) wipes out weights

# Value dtypes a result may travel in. bfloat16 keeps fp32's exponent range, which small
# lr-scaled momenta need (float16 loses precision below 6e-5 and rounds values below 3e-8 to 0).
# float64 is for dense results only: the exact reference path, where a pseudo-gradient
# (float32 weights before minus after a client's local steps) travels without rounding, so
# the coordinator's step lands on the client's float32 weights bit for bit.
VALUE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
                "float64": torch.float64,
                # codes of 2, 4 or 8 bits and a float32 scale per chunk (topk, dct): the
                # values stand on the scale's half-integer levels (compression/quantize.py)
                **dict.fromkeys(QUANTIZED_BITS, torch.float32)}


@dataclass(kw_only=True, slots=True)
class CompressionConfig:
    """How clients encode their results: run.toml's [compression], with the bounds of the
    uint32 fields that carry it to them."""

    encoding: str = setting("dct", choices=ENCODERS, help=(
        "dense | topk | dct (modeling.compression.encodings)"))
    chunk: int = setting(64, low=1, high=UINT32_MAX, help=(
        "chunk side on the universal grid, clipped to smaller dimensions"))
    topk: int = setting(32, low=1, help=(  # at most chunk²: __post_init__
        "values kept per chunk (topk, dct); at most chunk²"))
    value_dtype: str = setting("bfloat16", choices=VALUE_DTYPES, help=(
        "dtype of the values sent (topk, dct): bfloat16 | float16 | float32, or int2 | int4 "
        "| int8 (codes of that many bits and a scale per chunk); dense sends float32, or "
        "float64 when asked"))
    decay: float = setting(0.999, low=0, high=1, help=(
        "momentum decay β in m ← β·m + lr·g; 1 accumulates without decay"))
    lr: float = setting(1.0, low=0, above=True, high=MAX_LR, help=(
        "gradient scale lr in m ← β·m + lr·g; the step size is [update] lr"))

    def __post_init__(self) -> None:
        get_encoding(self.encoding)  # raises UnknownEncoding, with a did-you-mean
        try:
            check_declared(self, "compression")
        except SettingsError as err:
            raise CompressionConfigError(str(err)) from None
        if self.value_dtype == "float64" and self.encoding != "dense":
            raise CompressionConfigError(f"value_dtype float64 is for encoding dense (exact "
                                         f"results), not {self.encoding}.")
        if self.value_dtype in QUANTIZED_BITS and self.encoding == "dense":
            raise CompressionConfigError(f"value_dtype {self.value_dtype} quantizes each "
                                         "chunk's kept values, so it needs encoding topk or "
                                         "dct, not dense.")
        most = min(self.chunk ** 2, UINT32_MAX)
        if self.encoding != "dense" and self.topk > most:
            raise CompressionConfigError(f"topk must lie in [1, {most}] (chunk {self.chunk}²), "
                                         f"got {self.topk}.")

    def build(self) -> Compressor:
        return Compressor(
            encoding_name=self.encoding, encoding=get_encoding(self.encoding), chunk=self.chunk,
            topk=self.topk, value_dtype=VALUE_DTYPES[self.value_dtype], decay=self.decay,
            lr=self.lr, value_bits=QUANTIZED_BITS.get(self.value_dtype, 0),
        )


@dataclass(frozen=True, slots=True)
class Compressor:
    encoding_name: str
    encoding: Encoding
    chunk: int
    topk: int
    value_dtype: torch.dtype
    decay: float
    lr: float
    value_bits: int = 0  # codes of this many bits and a scale per chunk; 0: value_dtype

    def encode(
        self, name: str, values: Tensor, *, shape: Sequence[int], region: Region, tokens: int
    ) -> SparseResult:
        """Encode region-shaped ``values`` of the parameter ``name`` (universal ``shape``)."""
        grid = ChunkGrid.of(shape, self.chunk)
        grid.check_region(region)
        if tuple(values.shape) != region_shape(region):
            raise ResultShapeMismatch(
                f"{name}: values of shape {tuple(values.shape)} do not fill region {region} "
                f"(shape {region_shape(region)}); pass the tier slice of the tensor."
            )
        encoded = self.encoding.encode(
            values, grid, region, topk=self.topk, value_dtype=self.value_dtype,
            value_bits=self.value_bits,
        )
        return SparseResult(
            name=name, shape=grid.shape, region=region, encoding=self.encoding_name,
            chunk=encoded.chunk, chunks=encoded.chunks, indices=encoded.indices,
            values=encoded.values, tokens=tokens, value_bits=self.value_bits,
            scales=encoded.scales,
        )

    @property
    def momentum_dtype(self) -> torch.dtype:
        """Error-feedback momentum (and what dense sends): float64 when asked, else float32."""
        return torch.float64 if self.value_dtype == torch.float64 else torch.float32

    def feedback(self, name: str, shape: Sequence[int], region: Region) -> ErrorFeedback:
        """Fresh error-feedback state (zero momentum) for one parameter's region."""
        ChunkGrid.of(shape, self.chunk).check_region(region)
        return ErrorFeedback(self, name=name, shape=tuple(shape), region=region)
