"""Token-budget batches inside transformers' Trainer (modeling/hf_trainer.py): the batches
hold the budget and use every example once an epoch, the collators label correctly, and a
short ``Trainer.train()`` trains a tiny Llama, a tiny BERT and Matformer models alike. The
models are built from configs; nothing is downloaded."""

from __future__ import annotations

import importlib
import math
import sys

import pytest
import torch
from support.models import tiny_config

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from transformers import (
    BertConfig,
    BertForMaskedLM,
    LlamaConfig,
    LlamaForCausalLM,
    TrainingArguments,
)

from matformer.modeling import AutoregressiveModel, BERTModel, MaskedBatch
from matformer.modeling.hf_trainer import (
    CausalLMCollator,
    MaskedLMCollator,
    MatformerForTrainer,
    TokenBudgetTrainer,
)

VOCAB, CLS, SEP, MASK = 96, 1, 2, 95
SHAPE = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
             max_position_embeddings=64)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _examples(count: int = 40, longest: int = 30) -> list[dict[str, list[int]]]:
    """Rows counting up from 3 + their index: the first token names the example, and each
    token predicts the next, a pattern a tiny model picks up in a few steps."""
    draw = torch.Generator().manual_seed(0)
    lengths = torch.randint(2, longest + 1, (count,), generator=draw).tolist()
    return [{"input_ids": [3 + (index + k) % 90 for k in range(n)]}
            for index, n in enumerate(lengths)]


def _args(tmp_path, steps: int = 8) -> TrainingArguments:
    return TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[],
                             max_steps=steps, logging_steps=1, save_strategy="no",
                             learning_rate=1e-2, disable_tqdm=True, seed=0)


def _llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, num_key_value_heads=2, **SHAPE))


def test_batches_hold_the_budget_and_use_every_example_once_per_epoch(tmp_path):
    examples = _examples()
    trainer = TokenBudgetTrainer(model=_llama(), args=_args(tmp_path), train_dataset=examples,
                                 data_collator=CausalLMCollator(pad_to_multiple_of=8),
                                 max_tokens=96)
    loader = trainer.get_train_dataloader()
    orders = []
    for epoch in (0, 1):
        loader.set_epoch(epoch)  # as the Trainer does before each epoch
        seen = []
        for batch in loader:
            ids, mask, labels = batch["input_ids"], batch["attention_mask"], batch["labels"]
            assert ids.numel() <= 96 and ids.shape[1] % 8 == 0  # padded to the multiple
            for row, real in zip(ids, mask.bool(), strict=True):
                assert row[real].tolist() == examples[int(row[0]) - 3]["input_ids"]
            assert torch.equal(labels, ids.masked_fill(mask == 0, -100))
            seen += [int(first) - 3 for first in ids[:, 0]]
        assert sorted(seen) == list(range(len(examples)))
        orders.append(seen)
    assert orders[0] != orders[1]  # the batches come in a new order each epoch


def test_masked_labels_are_the_masked_tokens_and_nothing_else():
    draw = torch.Generator().manual_seed(1)
    rows = [[CLS, *torch.randint(3, 90, (int(n),), generator=draw).tolist(), SEP]
            for n in torch.randint(1, 30, (200,), generator=draw)]
    collator = MaskedLMCollator(mask_token_id=MASK, never_mask=(CLS, SEP), pad_to_multiple_of=8,
                                seed=0)
    batch = collator([{"input_ids": row} for row in rows])
    ids, real, labels = batch["input_ids"], batch["attention_mask"].bool(), batch["labels"]
    original = MaskedBatch.from_list([torch.tensor(row) for row in rows]).data
    original = torch.nn.functional.pad(original, (0, ids.shape[1] - original.shape[1]))
    masked = labels != -100
    assert torch.equal(ids[masked], torch.full_like(ids[masked], MASK))
    assert torch.equal(labels[masked], original[masked])
    assert torch.equal(ids[~masked], original[~masked])  # the rest reads as it was
    special = (original == CLS) | (original == SEP)
    assert not masked[~real].any() and not masked[special].any()
    assert masked.any(dim=1).all()  # every row carries a target
    share = masked.sum() / (real & ~special).sum()
    assert share.item() == pytest.approx(0.15, abs=0.03)


def test_the_matformer_adapter_scores_what_the_model_scores():
    """Labels laid out as transformers lays them give the model's own next-token loss."""
    model = AutoregressiveModel(tiny_config())
    examples = _examples(count=5)
    batch = CausalLMCollator(pad_to_multiple_of=8)(examples)
    docs = MaskedBatch.from_list([torch.tensor(e["input_ids"]) for e in examples])
    loss = MatformerForTrainer(model, tier=1)(**batch)["loss"]
    torch.testing.assert_close(loss, model.loss(docs, tier=1))


def _bert() -> BertForMaskedLM:
    torch.manual_seed(0)
    return BertForMaskedLM(BertConfig(vocab_size=VOCAB, **SHAPE))


def _matformer(causal: bool) -> MatformerForTrainer:
    torch.manual_seed(0)
    config = tiny_config(is_causal=causal)
    return MatformerForTrainer(AutoregressiveModel(config) if causal else BERTModel(config))


CASES = {
    "llama": (_llama, lambda: CausalLMCollator()),
    "bert": (_bert, lambda: MaskedLMCollator(mask_token_id=MASK, seed=0)),
    "matformer-causal": (lambda: _matformer(True), lambda: CausalLMCollator()),
    "matformer-masked": (lambda: _matformer(False),
                         lambda: MaskedLMCollator(mask_token_id=MASK, seed=0)),
}


@pytest.mark.parametrize("case", CASES)
def test_a_short_run_trains_on_token_budget_batches(case, tmp_path):
    build, collator = CASES[case]
    trainer = TokenBudgetTrainer(model=build(), args=_args(tmp_path), train_dataset=_examples(),
                                 data_collator=collator(), max_tokens=128)
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert len(losses) == 8 and all(math.isfinite(loss) for loss in losses)
    assert sum(losses[-2:]) < sum(losses[:2])


def test_the_default_collator_is_refused(tmp_path):
    with pytest.raises(ValueError, match="CausalLMCollator"):
        TokenBudgetTrainer(model=_llama(), args=_args(tmp_path), train_dataset=_examples(),
                           max_tokens=128)


def test_without_the_extra_the_import_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "accelerate", None)
    monkeypatch.delitem(sys.modules, "matformer.modeling.hf_trainer")
    with pytest.raises(ImportError, match=r"pip install 'matformer\[hf-trainer\]'"):
        importlib.import_module("matformer.modeling.hf_trainer")
