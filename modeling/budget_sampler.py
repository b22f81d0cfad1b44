"""Token-budget batches for a torch ``DataLoader``, so that trainers other than ours get them.

``TokenBudgetBatchSampler`` is a ``batch_sampler``: it hands a DataLoader the batches that
``plan_batches`` plans, each batch's rows × longest row within ``max_tokens``. That is the
one piece transformers' Trainer (``modeling/hf_trainer.py``) and Lightning's
(``modeling/lightning_wrapper.py``) need to train on token-budget batches.

The batches are planned once, so the same sequences share a batch in every epoch and only
the order of the batches changes, drawn per epoch from ``seed``. Both trainers read the
number of batches once, before the first epoch, to count their steps; planning every epoch
anew would change that number from one epoch to the next.

``pad_to_multiple_of`` plans each sequence at its length rounded up to that multiple: a
collator that pads to a multiple makes the batch that wide, and the budget must hold for
the batch as padded.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence

from torch import Tensor
from torch.utils.data import DataLoader, Sampler

from matformer.modeling.batching import plan_batches
from matformer.modeling.errors import ConfigError


class TokenBudgetBatchSampler(Sampler[list[int]]):
    """Index lists of token-budget batches; every index once per epoch."""

    def __init__(
        self,
        lengths: Sequence[int],
        max_tokens: int,
        *,
        sort_window: int = 16,
        pad_to_multiple_of: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
    ) -> None:
        """``lengths``: each example's length in tokens, in dataset order. ``sort_window``:
        as ``plan_batches`` (0 keeps data order inside batches too). ``shuffle``: a new
        order of the batches each epoch (``set_epoch``), else plan order."""
        super().__init__()
        if pad_to_multiple_of is not None and pad_to_multiple_of < 1:
            raise ConfigError(
                f"pad_to_multiple_of must be at least 1 (or None), got {pad_to_multiple_of}."
            )
        self.batches = plan_batches(lengths, max_tokens, sort_window=sort_window,
                                    pad_to_multiple_of=pad_to_multiple_of or 1)
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Order the batches of ``epoch`` (both trainers call this before each epoch)."""
        self.epoch = epoch

    def __iter__(self) -> Iterator[list[int]]:
        order = list(range(len(self.batches)))
        if self.shuffle:
            random.Random(f"{self.seed}:{self.epoch}").shuffle(order)
        for number in order:
            yield list(self.batches[number])

    def __len__(self) -> int:
        return len(self.batches)


def token_budget_loader(
    documents: Sequence[Tensor],
    max_tokens: int,
    *,
    sort_window: int = 16,
    shuffle: bool = True,
    seed: int = 0,
) -> DataLoader:
    """Batches of ``documents`` (1-D token ids) as lists of tensors, each list a token-budget
    batch: what ``tier_gradients`` and ``MicrobatchRunner`` take, unpadded."""
    sampler = TokenBudgetBatchSampler([len(d) for d in documents], max_tokens,
                                      sort_window=sort_window, shuffle=shuffle, seed=seed)
    return DataLoader(documents, batch_sampler=sampler, collate_fn=list)
