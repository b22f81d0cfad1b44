"""Small models and data the tests build in milliseconds: a tiny Llama-shaped config, its
logits, a manifest edited in place, and MDAT containers with one-token tails or a BPE
tokenizer."""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch

from matformer.modeling import ModelConfig
from matformer.modeling.checkpoint.manifest import MANIFEST_NAME
from matformer.modeling.mdat import Mdat

TAILS_STRATEGY = "fixed8"  # what ``mdat_with_one_token_tails`` pretokenizes: bytes, chunks of 8


# the byte tokenizer's special ids: a checkpoint a run starts from on byte data names these
BYTE_IDS = dict(pad_token_id=256, bos_token_id=257, eos_token_id=258, mask_token_id=259)


def tiny_config(**overrides) -> ModelConfig:
    """A 2-layer Llama-shaped model small enough for exhaustive tests."""
    fields = dict(
        vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=64, max_position_embeddings=64,
        pad_token_id=0, bos_token_id=1, eos_token_id=2, mask_token_id=95,
    )
    fields.update(overrides)
    return ModelConfig(**fields)


def logits(model, tier=None):
    ids = torch.arange(3, 15)[None]
    with torch.no_grad():
        return model(ids, tier=tier)


def edit_manifest(source, change):
    path = source / MANIFEST_NAME
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


def mdat_with_one_token_tails(path: Path, documents: int = 40) -> Path:
    """An MDAT of ``documents`` texts of 8k + 1 bytes (k = 1, 2, 3), pretokenized as
    ``TAILS_STRATEGY``: at ``max_seq_len`` 8 each document ends in a one-token sequence, which
    carries no target for a causal model."""
    draw = random.Random(0)
    texts = ["".join(draw.choices("abcdefgh ", k=8 * draw.randint(1, 3) + 1))
             for _ in range(documents)]
    with Mdat.create(path) as mdat:
        mdat.add_records("tails", ({"text": t} for t in texts))
        mdat.add_strategy({"strategy_name": TAILS_STRATEGY, "chunk_size": 8})
        mdat.pretokenize(TAILS_STRATEGY)
    return path


def bpe_mdat(root: Path, texts: list[str], vocab_size: int, *, pretokenize: bool = True):
    """``root/bpe.mdat``, holding ``texts`` under strategy "bpe": a BPE tokenizer.json
    (``root/tokenizer.json``) trained on them, as a user builds one for their own data.
    Returns the tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel()
    bpe.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=vocab_size,
                                                       special_tokens=["<unk>", "<eos>"]))
    bpe.save(str(root / "tokenizer.json"))
    with Mdat.create(root / "bpe.mdat") as mdat:
        mdat.add_records("t", ({"text": t} for t in texts))
        mdat.add_strategy({"strategy_name": "bpe", "tokenizer_type": "huggingface",
                           "tokenizer_name": str(root / "tokenizer.json"), "chunk_size": 16})
        if pretokenize:
            mdat.pretokenize("bpe")
    return bpe
