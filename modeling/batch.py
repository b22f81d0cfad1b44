"""Variable-length batches the models consume: padded (MaskedBatch) and packed (PackedBatch).

Both describe their tokens the same way, so the model needs no branch per batch type:
``data`` (B, T, ...) holds the examples, ``segment_ids`` (B, T) says which document each
position belongs to (0 = padding, documents numbered from 1 within a row) and
``position_ids`` (B, T) gives each token's position inside its own document. Attention only
connects positions of the same segment, positional encodings read ``position_ids`` and the
loss never predicts across a segment boundary, so padding and neighbouring documents never
leak into an example's result.

``unbatch`` turns a (B, T, ...) output back into one tensor per example, in input order, which
is what the equivalence check in ``modeling.equivalence`` compares against a per-example loop.

A MaskedBatch can also stand in for one example in code written for a single example at batch
size one: torch functions, Tensor methods and operators run on it through
``__torch_function__`` and the op table in ``modeling.batch_ops``, and return MaskedBatches
whose masks say which results are real; ``examples()`` cuts such a result back into one tensor
per example.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from matformer.modeling.batch_surface import TensorSurface
from matformer.modeling.errors import BatchError


def _check_examples(examples: Sequence[Tensor], *, scalars: bool = False) -> None:
    """Refuse an empty list or an empty example; ``scalars`` lets 0-d examples through."""
    if not examples:
        raise BatchError("a batch needs at least one example; got an empty list.")
    for index, example in enumerate(examples):
        if (example.dim() == 0 and not scalars) or example.numel() == 0:
            raise BatchError(
                f"example {index} is empty (shape {tuple(example.shape)}); drop empty "
                "documents before batching."
            )


def padded_size(size: int, multiple: int) -> int:
    """``size`` padded up to the next multiple of ``multiple`` (``pad_to_multiple_of``: 8 or
    64 suit tensor cores; 1 pads nothing)."""
    if isinstance(multiple, bool) or not isinstance(multiple, int) or multiple < 1:
        raise BatchError(f"pad_to_multiple_of must be a whole number >= 1 (1: pad to the "
                         f"longest row only), got {multiple!r}.")
    return -(-size // multiple) * multiple


@dataclass(frozen=True, slots=True, eq=False)
class MaskedBatch(TensorSurface):
    """Examples padded to a common size in their dynamic dimensions.

    ``dims`` has one flag per non-batch dimension of ``data``: True if examples may differ in
    size there (dynamic), False if they all share it (static). ``mask`` is (B, *sizes) with the
    full size in dynamic dimensions and 1 in static ones: True marks real data. The models read
    dimension 1 as the sequence, so for them ``dims`` starts with True and the rest is static.
    What lies under a False of the mask is not required to be anything (ops may leave any value
    there), so only real positions are compared with per-example runs. ``TensorSurface`` lets
    example-level code treat it as a tensor.
    """

    data: Tensor
    mask: Tensor
    dims: tuple[bool, ...]

    def __post_init__(self) -> None:
        if not self.data.dim() == self.mask.dim() == len(self.dims) + 1:
            raise BatchError(f"a MaskedBatch needs data and mask of rank len(dims) + 1; got "
                             f"data {tuple(self.data.shape)}, mask {tuple(self.mask.shape)}, "
                             f"dims {self.dims}.")
        if self.mask.dtype != torch.bool:
            raise BatchError(f"the mask must be bool (True = real data), not {self.mask.dtype}.")

    @classmethod
    def from_list(
        cls, examples: Sequence[Tensor], dims: Sequence[bool] | None = None, pad_value: float = 0,
        pad_to_multiple_of: int = 1,
    ) -> MaskedBatch:
        """Pad ``examples`` (each without a batch dimension) on the right of dynamic dims, to
        the longest example's size rounded up to ``pad_to_multiple_of`` (8 or 64: shapes
        tensor cores take whole).

        ``dims`` defaults to: the first dimension dynamic, the others static. Examples written
        at batch size one, (1, *sizes) with one flag per size (Matchbox's layout), are accepted
        too; 0-d examples make a batch of one value per example (``dims == ()``).
        """
        _check_examples(examples, scalars=True)
        rank = examples[0].dim()
        if dims is not None and len(dims) == rank - 1 and all(
                e.dim() == rank and e.shape[0] == 1 for e in examples):
            examples, rank = [e[0] for e in examples], rank - 1
        dims = tuple(dims) if dims is not None else tuple(axis == 0 for axis in range(rank))
        if len(dims) != rank:
            raise BatchError(f"dims has {len(dims)} flags for examples of rank {rank}.")
        for index, example in enumerate(examples):
            if example.dim() != rank:
                raise BatchError(f"example {index} has rank {example.dim()}, expected {rank}.")
            for axis, dynamic in enumerate(dims):
                if not dynamic and example.shape[axis] != examples[0].shape[axis]:
                    raise BatchError(
                        f"example {index} has size {example.shape[axis]} in static dimension "
                        f"{axis}, others have {examples[0].shape[axis]}; mark it dynamic."
                    )
        sizes = [max(e.shape[axis] for e in examples) for axis in range(rank)]
        sizes = [padded_size(size, pad_to_multiple_of) if dynamic else size
                 for size, dynamic in zip(sizes, dims, strict=True)]
        data = examples[0].new_full((len(examples), *sizes), pad_value)
        mask_sizes = [size if dynamic else 1 for size, dynamic in zip(sizes, dims, strict=True)]
        mask = torch.zeros(len(examples), *mask_sizes, dtype=torch.bool, device=data.device)
        for row, example in enumerate(examples):
            data[(row, *(slice(0, n) for n in example.shape))] = example
            mask[(row, *(slice(0, n) if d else slice(None) for n, d in
                         zip(example.shape, dims, strict=True)))] = True
        return cls(data, mask, dims)

    @property
    def tokens(self) -> Tensor:
        """(B, T) bool: which sequence positions are real (the mask along dimension 1)."""
        mask = self.mask
        return mask.reshape(mask.shape[0], mask.shape[1], -1).all(dim=-1)

    @property
    def lengths(self) -> Tensor:
        """(B,) number of real sequence positions per example."""
        return self.tokens.sum(dim=1)

    @property
    def segment_ids(self) -> Tensor:
        return self.tokens.to(torch.int32)  # one document per row: 1 real, 0 padding

    @property
    def position_ids(self) -> Tensor:
        return (self.tokens.cumsum(dim=1) - 1).clamp(min=0)

    def unbatch(self, output: Tensor) -> list[Tensor]:
        """Per-example slices of a (B, T, ...) ``output`` aligned with this batch."""
        return [output[row, :length] for row, length in enumerate(self.lengths.tolist())]

    def examples(self) -> list[Tensor]:
        """This batch's own data cut per example (without the batch dimension) to the extent
        its mask marks: in each dynamic dimension, up to the last position holding any real
        data."""
        return [self.data[(row, *self._extent(row))] for row in range(self.data.shape[0])]

    def example_masks(self) -> list[Tensor]:
        """The mask cut as ``examples()`` cuts the data (1 in static dimensions)."""
        return [self.mask[(row, *self._extent(row))] for row in range(self.mask.shape[0])]

    def _extent(self, row: int) -> list[slice]:
        mask = self.mask[row]
        extent = []
        for axis in range(mask.dim()):
            if mask.shape[axis] == 1:
                extent.append(slice(None))
                continue
            others = tuple(a for a in range(mask.dim()) if a != axis)
            present = (mask.any(dim=others) if others else mask).nonzero()
            extent.append(slice(0, int(present.max()) + 1 if len(present) else 0))
        return extent

    def to(self, *args: Any, **kwargs: Any) -> MaskedBatch:
        """``Tensor.to`` for the data (device, dtype); the mask follows to the same device."""
        data = self.data.to(*args, **kwargs)
        return MaskedBatch(data, self.mask.to(data.device), self.dims)


@dataclass(frozen=True, slots=True)
class PackedBatch:
    """Several documents laid end to end in each row, with per-document positions.

    ``spans`` (N, 3) records, for each input example in order, its (row, start, length).
    """

    data: Tensor
    segment_ids: Tensor
    position_ids: Tensor
    spans: Tensor

    @classmethod
    def pack(
        cls, examples: Sequence[Tensor], row_length: int, pad_value: float = 0
    ) -> PackedBatch:
        """Place examples first-fit into rows of ``row_length`` (no example is split).

        First fit keeps the input order within each row and fills earlier rows before opening
        new ones; rows are padded on the right.
        """
        _check_examples(examples)
        longest = max(e.shape[0] for e in examples)
        if longest > row_length:
            raise BatchError(
                f"an example has {longest} tokens but rows hold {row_length}; raise row_length "
                "or cut the example into chunks first."
            )
        free: list[int] = []  # room left in each row
        rows: list[list[int]] = []
        for index, example in enumerate(examples):
            size = example.shape[0]
            row = next((r for r, room in enumerate(free) if room >= size), len(free))
            if row == len(free):
                free.append(row_length)
                rows.append([])
            rows[row].append(index)
            free[row] -= size
        return cls._place(examples, rows, row_length, pad_value)

    @classmethod
    def from_rows(
        cls, examples: Sequence[Tensor], rows: Sequence[Sequence[int]], pad_value: float = 0,
        pad_to_multiple_of: int = 1,
    ) -> PackedBatch:
        """Lay ``examples`` out as ``rows`` says: each row lists indices into ``examples``,
        placed end to end in that order, and every example appears in exactly one row. Rows
        are padded on the right to the longest row (a planner that packed them well leaves
        little padding), rounded up to ``pad_to_multiple_of``."""
        _check_examples(examples)
        placed = sorted(i for row in rows for i in row)
        if placed != list(range(len(examples))) or not all(rows):
            raise BatchError(f"rows must place each of the {len(examples)} examples exactly "
                             f"once and none may be empty; got {[list(r) for r in rows]}.")
        longest = max(sum(examples[i].shape[0] for i in row) for row in rows)
        return cls._place(examples, rows, padded_size(longest, pad_to_multiple_of), pad_value)

    @classmethod
    def _place(cls, examples: Sequence[Tensor], rows: Sequence[Sequence[int]],
               row_length: int, pad_value: float) -> PackedBatch:
        first = examples[0]
        data = first.new_full((len(rows), row_length, *first.shape[1:]), pad_value)
        segments = torch.zeros(len(rows), row_length, dtype=torch.int32, device=first.device)
        positions = torch.zeros(len(rows), row_length, dtype=torch.long, device=first.device)
        spans = [(0, 0, 0)] * len(examples)  # in the examples' order
        for row, indices in enumerate(rows):
            start = 0
            for document, index in enumerate(indices, start=1):
                size = examples[index].shape[0]
                data[row, start:start + size] = examples[index]
                segments[row, start:start + size] = document
                positions[row, start:start + size] = torch.arange(size, device=first.device)
                spans[index] = (row, start, size)
                start += size
        return cls(data, segments, positions, torch.tensor(spans, dtype=torch.long))

    @property
    def tokens(self) -> Tensor:
        return self.segment_ids > 0

    @property
    def lengths(self) -> Tensor:
        return self.spans[:, 2]

    def unbatch(self, output: Tensor) -> list[Tensor]:
        return [output[row, start:start + size] for row, start, size in self.spans.tolist()]

    def to(self, device: torch.device | str) -> PackedBatch:
        return PackedBatch(self.data.to(device), self.segment_ids.to(device),
                           self.position_ids.to(device), self.spans)


Batch = MaskedBatch | PackedBatch


@dataclass(frozen=True, slots=True)
class TokenLayout:
    """What the model reads from any input: data plus where segments and positions lie."""

    data: Tensor  # (B, T) ids or (B, T, C) hidden states
    segment_ids: Tensor | None  # (B, T) int, 0 = padding; None: every position real, one doc
    position_ids: Tensor  # (B, T)


def layout(
    inputs: Tensor | Batch | TokenLayout,
    attention_mask: Tensor | None = None,
    position_ids: Tensor | None = None,
) -> TokenLayout:
    """Normalise the model's accepted inputs: a batch object, or a tensor with an optional
    (B, T) ``attention_mask`` (1 = real token, Hugging Face style) and ``position_ids``."""
    if isinstance(inputs, TokenLayout):
        return inputs
    if isinstance(inputs, MaskedBatch | PackedBatch):
        if attention_mask is not None or position_ids is not None:
            raise BatchError("a MaskedBatch/PackedBatch carries its own mask and positions; "
                             "do not pass attention_mask or position_ids with it.")
        segments = inputs.segment_ids
        full = isinstance(inputs, MaskedBatch) and bool(inputs.tokens.all())
        return TokenLayout(inputs.data, None if full else segments, inputs.position_ids)
    batch, length = inputs.shape[:2]
    segments = None
    if attention_mask is not None and not bool(attention_mask.all()):
        segments = attention_mask.to(torch.int32)
    if position_ids is None:
        position_ids = torch.arange(length, device=inputs.device).expand(batch, length)
    return TokenLayout(inputs, segments, position_ids)


def next_token_targets(ids: Tensor, segment_ids: Tensor | None, ignore_index: int) -> Tensor:
    """(B, T) labels: the next token of the same document, else ``ignore_index``."""
    labels = F.pad(ids[:, 1:], (0, 1), value=ignore_index)
    if segment_ids is not None:
        same = segment_ids[:, 1:] == segment_ids[:, :-1]
        keep = F.pad(same & (segment_ids[:, 1:] > 0), (0, 1), value=False)
        labels = labels.masked_fill(~keep, ignore_index)
    return labels
