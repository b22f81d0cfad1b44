"""Token-budget batches inside ``transformers.Trainer``, for any model it trains::

    trainer = TokenBudgetTrainer(model=model, args=args, train_dataset=dataset,
                                 data_collator=CausalLMCollator(pad_token_id=0),
                                 max_tokens=4096)
    trainer.train()

``TokenBudgetTrainer`` overrides one extension point of the Trainer,
``get_train_dataloader``: its batches come from ``TokenBudgetBatchSampler``, so each batch's
rows × longest row (rounded up to the collator's ``pad_to_multiple_of``) stays within
``max_tokens``, and every example is used once per epoch. Everything else is the Trainer's
own: optimizer, schedule, precision, logging, checkpoints. ``per_device_train_batch_size``
is not used; evaluation keeps the Trainer's batches of ``per_device_eval_batch_size``.

A batch is one forward/backward pass; ``gradient_accumulation_steps`` sets how many make an
optimizer step. A model that takes ``num_items_in_batch`` (transformers' Llama and BERT do)
then averages over every target token of the step's batches, as one large batch would; for
one that does not, the Trainer averages the batches' means.

The collators work from token ids alone (no tokenizer): they pad a batch to its longest row
and label it. ``CausalLMCollator`` labels every real token (the model shifts the labels);
``MaskedLMCollator`` masks tokens and labels the masked ones. Any collator that pads to the
batch's longest row keeps the budget too, transformers' ``DataCollatorForLanguageModeling``
for one. ``MatformerForTrainer`` is a Matformer model as the Trainer calls a model.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader

from matformer.modeling.batch import MaskedBatch
from matformer.modeling.budget_sampler import TokenBudgetBatchSampler
from matformer.modeling.components.loss import IGNORE_INDEX
from matformer.modeling.errors import ConfigError
from matformer.modeling.matformer import Tier
from matformer.modeling.models import TransformerWithLMHead

try:
    import accelerate  # noqa: F401  (the Trainer cannot run without it)
    from transformers import Trainer, default_data_collator
except ImportError as error:
    raise ImportError("token-budget batches in transformers' Trainer need transformers and "
                      "accelerate: pip install 'matformer[hf-trainer]'.") from error


class TokenBudgetTrainer(Trainer):
    """A ``transformers.Trainer`` whose training batches hold at most ``max_tokens`` padded
    tokens each."""

    def __init__(self, *args: Any, max_tokens: int, lengths: Sequence[int] | None = None,
                 sort_window: int = 16, **kwargs: Any) -> None:
        """``lengths``: each training example's length in tokens, when known (else read from
        every example's ``input_ids`` once); ``sort_window``: as ``plan_batches``. The other
        arguments are the Trainer's; ``data_collator`` must pad (one of ours, say)."""
        super().__init__(*args, **kwargs)
        if self.data_collator is default_data_collator:
            raise ConfigError(
                "token-budget batches hold sequences of different lengths, which the Trainer's "
                "default collator cannot stack; pass data_collator=CausalLMCollator(...) or "
                "MaskedLMCollator(...) (or a tokenizer as processing_class).")
        self.max_tokens = max_tokens
        self.lengths = lengths
        self.sort_window = sort_window

    def get_train_dataloader(self) -> DataLoader:
        dataset = self.train_dataset
        if dataset is None:
            raise ValueError("Trainer: training requires a train_dataset.")
        if not hasattr(dataset, "__len__"):
            raise ConfigError("token-budget batches are planned over the whole dataset; give a "
                              "Dataset with a length, not an IterableDataset.")
        lengths = self.lengths
        if lengths is None:
            name = getattr(self.model, "main_input_name", "input_ids")
            lengths = [len(dataset[i][name]) for i in range(len(dataset))]
        seed = self.args.seed if self.args.data_seed is None else self.args.data_seed
        sampler = TokenBudgetBatchSampler(
            lengths, self.max_tokens, sort_window=self.sort_window, seed=seed,
            pad_to_multiple_of=getattr(self.data_collator, "pad_to_multiple_of", None))
        loader = DataLoader(
            dataset, batch_sampler=sampler,
            collate_fn=self._get_collator_with_removed_columns(self.data_collator, "training"),
            num_workers=self.args.dataloader_num_workers,
            pin_memory=self.args.dataloader_pin_memory,
            persistent_workers=self.args.dataloader_persistent_workers)
        return self.accelerator.prepare(loader)


@dataclass(kw_only=True)
class CausalLMCollator:
    """``input_ids`` padded to the batch's longest row; labels are the ids, -100 at padding."""

    pad_token_id: int = 0
    pad_to_multiple_of: int | None = None  # pad rows to a multiple (tensor cores like 8)

    def __call__(self, features: Sequence[Mapping[str, Any]]) -> dict[str, Tensor]:
        input_ids, attention_mask = _padded([_ids(f) for f in features], self.pad_token_id,
                                            self.pad_to_multiple_of)
        labels = input_ids.masked_fill(attention_mask == 0, IGNORE_INDEX)
        return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


@dataclass(kw_only=True)
class MaskedLMCollator:
    """Each token is masked with probability ``mlm_probability``; the label of a masked token
    is its id, of every other position -100. A masked token reads as ``mask_token_id`` (as
    ``BERTModel`` trains; BERT's 80/10/10 split is transformers' collator's)."""

    mask_token_id: int
    pad_token_id: int = 0
    mlm_probability: float = 0.15
    never_mask: tuple[int, ...] = ()  # ids never masked, a BERT tokenizer's [CLS] and [SEP]
    pad_to_multiple_of: int | None = None
    seed: int | None = None  # draws from a generator seeded once; None: torch's global RNG
    _generator: torch.Generator | None = field(init=False, repr=False, default=None)

    def __post_init__(self) -> None:
        if not 0 < self.mlm_probability < 1:
            raise ConfigError(f"mlm_probability must lie in (0, 1), got {self.mlm_probability}.")
        if self.seed is not None:
            self._generator = torch.Generator().manual_seed(self.seed)

    def __call__(self, features: Sequence[Mapping[str, Any]]) -> dict[str, Tensor]:
        rows = [self._masked(_ids(f)) for f in features]
        input_ids, attention_mask = _padded([read for read, _ in rows], self.pad_token_id,
                                            self.pad_to_multiple_of)
        labels, _ = _padded([label for _, label in rows], IGNORE_INDEX, self.pad_to_multiple_of)
        return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}

    def _masked(self, ids: Tensor) -> tuple[Tensor, Tensor]:
        """(what the model reads, the labels) of one row of ids."""
        draw = torch.rand(ids.shape, generator=self._generator)
        eligible = ~torch.isin(ids, torch.tensor(self.never_mask, dtype=ids.dtype))
        masked = (draw < self.mlm_probability) & eligible
        if not bool(masked.any()) and bool(eligible.any()):
            # A row with nothing masked teaches nothing, and alone in a batch its loss is 0/0.
            masked[draw.masked_fill(~eligible, 2.0).argmin()] = True
        return ids.masked_fill(masked, self.mask_token_id), torch.where(masked, ids, IGNORE_INDEX)


class MatformerForTrainer(nn.Module):
    """A Matformer model as the Trainer calls one: ``input_ids``, ``attention_mask`` and
    ``labels`` in (labels as transformers lays them: a causal model's are its inputs,
    unshifted), the mean loss over labelled positions and the logits out. ``tier`` picks the
    FFN widths that train (None: the model's own). It takes no ``num_items_in_batch``, so
    under gradient accumulation a step averages its batches' means."""

    main_input_name = "input_ids"

    def __init__(self, model: TransformerWithLMHead, *, tier: Tier | None = None) -> None:
        super().__init__()
        self.model = model
        self.tier = tier

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None,
                labels: Tensor | None = None) -> dict[str, Tensor]:
        logits = self.model(input_ids, attention_mask, tier=self.tier)  # (B, T, V)
        if labels is None:
            return {"logits": logits}
        if self.model.config.is_causal:  # position t is scored on token t + 1
            labels = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)
        return {"loss": self.model.loss_fn(logits, labels), "logits": logits}


def _ids(feature: Mapping[str, Any]) -> Tensor:
    return torch.as_tensor(feature["input_ids"], dtype=torch.long)


def _padded(rows: Sequence[Tensor], value: int, multiple: int | None) -> tuple[Tensor, Tensor]:
    """(B, T) ``rows`` padded on the right with ``value`` to the longest row, rounded up to
    ``multiple``; and the (B, T) attention mask, 1 on real tokens."""
    batch = MaskedBatch.from_list(rows, pad_value=value, pad_to_multiple_of=multiple or 1)
    return batch.data, batch.tokens.long()
