"""A federated run starts from a pretrained model (issue 33, item 3): [model] checkpoint takes
a Hugging Face Llama folder or a hub id the hub cache holds, as ``matformer-train --init``
does, and the run's first master is that model's weights."""

from __future__ import annotations

import shutil

import pytest
import torch
import transformers
from support.helpers import Clock, run_tables
from support.rounds import caps, drive

from matformer.modeling.errors import SpecialIdsMismatch
from matformer.server.config import RunConfig
from matformer.server.coordinator import Coordinator
from matformer.server.errors import ServerConfigError


def saved_llama(folder, **ids):
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=260, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=64, max_position_embeddings=128,
        tie_word_embeddings=False, **ids))
    model.save_pretrained(folder)
    return model, folder


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    # the byte tokenizer's ids, as the run's data have them
    return saved_llama(tmp_path_factory.mktemp("llama"), pad_token_id=256, bos_token_id=257,
                       eos_token_id=258)


def hub_cache(cache, repo, folder):
    """``folder``'s files as the hub cache holds a downloaded ``repo``."""
    root = cache / f"models--{repo.replace('/', '--')}"
    (root / "refs").mkdir(parents=True)
    (root / "refs" / "main").write_text("0123abcd")
    shutil.copytree(folder, root / "snapshots" / "0123abcd")


def run(tmp_path, mdat_path, checkpoint) -> Coordinator:
    tables = run_tables(mdat_path, run={"id": "ft", "dir": str(tmp_path / "run")},
                        model={"checkpoint": checkpoint})
    return Coordinator(RunConfig.from_dict(tables, base=tmp_path), clock=Clock())


@pytest.mark.parametrize("source", ["folder", "hub id"])
def test_a_run_starts_from_a_hugging_face_llama(tmp_path, mdat_path, monkeypatch, llama,
                                                source):
    model, folder = llama
    if source == "hub id":
        hub_cache(tmp_path / "hub", "org/tiny-llama", folder)
        monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "hub"))
        monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    c = run(tmp_path, mdat_path, "org/tiny-llama" if source == "hub id" else str(folder))
    weights = model.state_dict()
    assert c.master.keys() == weights.keys()
    assert all(torch.equal(c.master[name], weights[name]) for name in weights)
    cid = c.join(caps("a", tier=1))[0].client_id
    drive(c, c.clock, cid, 1)  # and it trains
    assert c.state.round == 1
    assert not torch.equal(c.master["lm_head.weight"], weights["lm_head.weight"])


def test_a_hub_id_the_cache_lacks_is_named(tmp_path, mdat_path, monkeypatch):
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    with pytest.raises(ServerConfigError, match="huggingface-cli download org/absent"):
        run(tmp_path, mdat_path, "org/absent")


def test_a_checkpoint_whose_special_ids_are_not_the_datas_is_refused(tmp_path, mdat_path):
    """transformers' Llama defaults (bos 1, eos 2) against the byte data's (257, 258): the
    run would train the model's embeddings of those markers on ordinary bytes."""
    _, folder = saved_llama(tmp_path / "llama")
    with pytest.raises(SpecialIdsMismatch, match=r"bos_token_id 1 \(the data's: 257\), "
                                                 r"eos_token_id 2 \(the data's: 258\)"):
        run(tmp_path, mdat_path, str(folder))
