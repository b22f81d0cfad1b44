"""Instruction tuning: prompt/response pairs imported as conversations, rendered with a chat
template, trained on their responses only, standalone (``--init``) and in a federated run."""

from __future__ import annotations

import dataclasses
import json
import random

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from support.helpers import JOIN_TOKEN, run_tables, write_run_toml
from support.models import tiny_config

from matformer.client import standalone
from matformer.client.federated import FederatedClient, FederatedOptions
from matformer.modeling import AutoregressiveModel, BERTModel
from matformer.modeling.batching import AdaptiveLimitsConfig, MicrobatchRunner, pack_rows
from matformer.modeling.batching.accumulate import TrainingExamples, accumulate_gradients
from matformer.modeling.checkpoint import load_pretrained, save_pretrained
from matformer.modeling.components.loss import IGNORE_INDEX
from matformer.modeling.errors import BadRecord, SplitterError
from matformer.modeling.mdat import Mdat
from matformer.modeling.mdat.chat_templates import TokenizerTemplate
from matformer.modeling.mdat.checkpoint_tokenizer import tokenizer_files
from matformer.modeling.mdat.pretok_files import LOSS_MASK, pretok_folder
from matformer.modeling.naming import canonical_state_dict
from matformer.modeling.prompt_marks import mark_prompt, read_marks
from matformer.modeling.tokenizers import ByteTokenizer, HuggingFaceTokenizer
from matformer.modeling.tokenizers.byte_level import byte_level_json
from matformer.modeling.training import TierSchedule, held_out_loss, train_step_on_examples
from matformer.server.config import RunConfig
from matformer.server.main import RunningServer

BOS, EOS = ByteTokenizer.bos_token_id, ByteTokenizer.eos_token_id
CHAT = {"strategy_name": "chat", "chunk_size": 32, "splitter_class": "conversation",
        "returns": ["tokens", "chunks", "loss_mask"]}
SEQ_LEN = 64
# the model of the finetuning tests: the byte vocabulary's ids, as the data's
BYTES_MODEL = dict(vocab_size=260, max_position_embeddings=128, pad_token_id=256,
                   bos_token_id=257, eos_token_id=258, mask_token_id=259)


def pairs(count: int = 48) -> list[dict]:
    draw = random.Random(0)
    lines = []
    for number in range(count):
        word = "".join(draw.choices("abcdefgh", k=draw.randint(3, 8)))
        lines.append({"prompt": f"Reverse {word}.", "response": word[::-1], "id": number})
    lines[5] = {"prompt": "Read this: " + "z" * 150, "response": "done", "id": 5}  # 3 sequences
    lines[7] = {"messages": [{"role": "system", "content": "Be brief."},
                             {"role": "user", "content": "Hi"},
                             {"role": "assistant", "content": "Hello"},
                             {"role": "user", "content": "Bye"},
                             {"role": "assistant", "content": "Ciao"}], "id": 7}
    return lines


def write_jsonl(path, lines):
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


@pytest.fixture(scope="module")
def chat_mdat(tmp_path_factory):
    root = tmp_path_factory.mktemp("chat")
    with Mdat.create(root / "chat.mdat") as mdat:
        mdat.add_pairs("pairs", write_jsonl(root / "pairs.jsonl", pairs()))
        mdat.add_strategy(CHAT)
        mdat.pretokenize("chat")
    return root / "chat.mdat"


def plain(prompt: str, response: str) -> tuple[list[int], list[int]]:
    """The plain template's tokens and loss mask of one pair, built by hand."""
    head = [BOS, *f"User: {prompt}\nAssistant: ".encode()]
    tail = [*response.encode(), EOS]
    return head + tail, [0] * len(head) + [1] * len(tail)


def test_pairs_import_as_conversations_and_bad_records_are_named(tmp_path):
    lines = [{"prompt": "Q", "response": "A", "source": "web"},
             {"messages": [{"role": "user", "content": "Hi"},
                           {"role": "assistant", "content": "Hello"}]},
             {"question": "Q", "answer": "A"}, {"prompt": "Q", "response": "  "}]
    with Mdat.create(tmp_path / "m.mdat") as mdat:
        with pytest.raises(BadRecord, match=r":3: no string fields 'prompt' and 'response'"):
            mdat.add_pairs("strict", write_jsonl(tmp_path / "p.jsonl", lines))
        mdat.remove_submdat("strict")
        info = mdat.add_pairs("p", tmp_path / "p.jsonl", skip_bad=True)
        assert (info.documents, info.skipped_invalid, info.skipped_empty) == (2, 1, 1)
        stored = mdat.submdat("p")
        assert json.loads(stored.text(0)) == {"messages": [
            {"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}]}
        assert stored.metadata(0) == {"source": "web"}
        assert json.loads(stored.text(1))["messages"][1] == {"role": "assistant",
                                                             "content": "Hello"}
        renamed = mdat.add_pairs("renamed", [lines[2]], prompt_field="question",
                                 response_field="answer")
        assert renamed.documents == 1


def test_pretokenization_stores_the_response_mask_beside_the_tokens(chat_mdat, tmp_path):
    with Mdat.open(chat_mdat) as mdat:
        folder = pretok_folder(chat_mdat, "chat", "pairs")
        mask = np.load(folder / LOSS_MASK)
        tokens, expected_mask = plain(pairs()[0]["prompt"], pairs()[0]["response"])
        assert np.load(folder / "tokens.npy")[:len(tokens)].tolist() == tokens
        assert mask[:len(tokens)].tolist() == expected_mask
        reader = mdat.sequences("chat", SEQ_LEN)
        assert reader.token_dtype == np.int32
        marked = reader[0]
        assert marked.tolist() == [t if m else ~t
                                   for t, m in zip(tokens, expected_mask, strict=True)]
        ids, trained = read_marks(torch.from_numpy(marked.astype(np.int64)))
        assert ids.tolist() == tokens and trained.tolist() == [bool(m) for m in expected_mask]
        # the long prompt fills two sequences without a response: they carry no target
        empty = np.flatnonzero(reader.response_lengths() == 0)
        assert [reader.locate(int(i)).document for i in empty] == [5, 5]
    # plain text: no mask file, sequences as before; the conversation splitter refuses it
    with Mdat.create(tmp_path / "plain.mdat") as mdat:
        mdat.add_records("docs", [{"text": "plain text"}])
        mdat.add_strategy({"strategy_name": "bytes", "chunk_size": 32})
        mdat.add_strategy(CHAT)
        mdat.pretokenize("bytes")
        assert not (pretok_folder(mdat.path, "bytes", "docs") / LOSS_MASK).exists()
        assert mdat.sequences("bytes", 32)[0].dtype == np.uint16
        with pytest.raises(SplitterError, match="not a conversation"):
            mdat.pretokenize("chat")


def test_labels_ignore_exactly_the_prompt_tokens_and_the_padding():
    torch.manual_seed(0)
    model = AutoregressiveModel(tiny_config())
    a = torch.tensor([10, 11, 12, 13, 14, 15]), [0, 0, 1, 1, 0, 1]  # two turns
    b = torch.tensor([20, 21, 22, 23]), [0, 1, 1, 1]
    marked = [torch.from_numpy(mark_prompt(t.numpy(), np.array(m))).long() for t, m in (a, b)]
    no = IGNORE_INDEX
    labels_a, labels_b = [no, 12, 13, no, 15, no], [21, 22, 23, no]  # by hand
    prepared = TrainingExamples.of(model, marked)
    assert [x.tolist() for x in prepared.inputs] == [a[0].tolist(), b[0].tolist()]
    assert [y.tolist() for y in prepared.labels] == [labels_a, labels_b]
    assert prepared.targets == 6

    seen = []
    labelled_loss = model.labelled_loss
    model.labelled_loss = lambda batch, labels, **kw: seen.append(labels) or labelled_loss(
        batch, labels, **kw)
    accumulate_gradients(model, marked, [[0, 1]])  # padded rows
    accumulate_gradients(model, marked, [[0]], rows=[[0, 1]])  # one packed row
    padded, packed = seen
    assert padded.tolist() == [labels_a, [*labels_b, no, no]]
    assert packed[0, :10].tolist() == labels_a + labels_b
    assert (packed[0, 10:] == no).all()

    bert = BERTModel(tiny_config(is_causal=False, masked_substitution_rate=1.0))
    read, labels = bert.example_targets(marked[0])
    assert labels.tolist() == [no, no, 12, 13, no, 15]  # only response tokens are masked
    assert read.tolist() == [10, 11, 95, 95, 14, 95]


def test_the_loss_is_the_mean_over_response_tokens_however_batched():
    torch.manual_seed(0)
    model = AutoregressiveModel(tiny_config())
    draw = torch.Generator().manual_seed(1)
    examples, masks = [], []
    for length in (9, 14, 5):
        examples.append(torch.randint(3, 90, (length,), generator=draw))
        masks.append((torch.rand(length, generator=draw) < 0.5).long())
    marked = [torch.from_numpy(mark_prompt(t.numpy(), m.numpy())).long()
              for t, m in zip(examples, masks, strict=True)]
    total, count = 0.0, 0
    with torch.no_grad():  # by hand: each example alone, its response positions only
        for tokens, mask in zip(examples, masks, strict=True):
            logits = model(tokens[None])[0, :-1]
            chosen = mask[1:].bool()
            total += F.cross_entropy(logits[chosen], tokens[1:][chosen], reduction="sum").item()
            count += int(chosen.sum())
    reference = total / count
    padded = accumulate_gradients(model, marked, [[0, 1], [2]])
    packed = accumulate_gradients(model, marked, [[0, 1]], rows=[[0, 2], [1]])
    assert padded.targets == packed.targets == count
    assert padded.loss == pytest.approx(reference, rel=1e-5)
    assert packed.loss == pytest.approx(reference, rel=1e-5)
    held = held_out_loss(model, marked, [0], batch_tokens=64)
    assert next(iter(held.values())) == pytest.approx(reference, rel=1e-5)


CHATML = ("{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
          "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}<|im_end|>"
          "{% endgeneration %}{% else %}{{ m['content'] }}<|im_end|>{% endif %}{{ '\n' }}"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_the_tokenizers_chat_template_renders_as_transformers_does(tmp_path):
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    folder = tmp_path / "chatml"
    folder.mkdir()
    bpe = Tokenizer.from_str(json.dumps(byte_level_json()))
    bpe.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    bpe.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<bos>",
        "eos_token": "<eos>", "pad_token": "<pad>", "chat_template": CHATML}))
    reference = AutoTokenizer.from_pretrained(folder)
    messages = pairs()[7]["messages"]

    template = TokenizerTemplate(tokenizer=HuggingFaceTokenizer(folder / "tokenizer.json"))
    for upto, prompt in ((5, False), (2, True), (4, True)):
        assert template.render(messages[:upto], add_generation_prompt=prompt) == \
            reference.apply_chat_template(messages[:upto], tokenize=False,
                                          add_generation_prompt=prompt)

    def ids(upto, prompt=False):
        return reference.apply_chat_template(messages[:upto], add_generation_prompt=prompt,
                                             return_dict=False)

    expected = np.zeros(len(ids(5)), dtype=np.uint8)
    for turn in (2, 4):  # each assistant message and its end-of-turn marker
        expected[len(ids(turn, prompt=True)):len(ids(turn + 1))] = 1
    with Mdat.create(tmp_path / "m.mdat") as mdat:
        mdat.add_pairs("chat", [{"messages": messages}])
        strategy = mdat.add_strategy({**CHAT, "strategy_name": "chatml", "chunk_size": 64,
                                      "tokenizer_type": "huggingface",
                                      "tokenizer_name": str(folder)})
        mdat.pretokenize("chatml")
        marked = mdat.sequences("chatml", 128)[0].astype(np.int64)
        files = tokenizer_files(mdat.path, strategy, max_length=128)
    tokens, trained = read_marks(torch.from_numpy(marked))
    assert tokens.tolist() == ids(5)
    assert trained.numpy().astype(np.uint8).tolist() == expected.tolist()
    assert reference.decode(tokens[trained]) == "Hello<|im_end|>\nCiao<|im_end|>\n"
    # the finetuned model's folder carries the template, for apply_chat_template at inference
    assert json.loads(files["tokenizer_config.json"])["chat_template"] == CHATML


def test_train_init_finetunes_a_checkpoint_on_the_responses(chat_mdat, tmp_path, monkeypatch):
    torch.manual_seed(0)
    save_pretrained(AutoregressiveModel(tiny_config(**BYTES_MODEL)), tmp_path / "base")
    first = {}
    original = standalone.train_step_on_examples

    def recorded(runner, optimizer, examples, schedule, step, *args, **kwargs):
        first.setdefault("examples", [e.clone() for e in examples])
        return original(runner, optimizer, examples, schedule, step, *args, **kwargs)

    monkeypatch.setattr(standalone, "train_step_on_examples", recorded)
    standalone.main(["--init", str(tmp_path / "base"), "--data", str(chat_mdat),
                     "--strategy", "chat", "--seq-len", str(SEQ_LEN), "--steps", "3",
                     "--batch-tokens", "256", "--tiers", "0", "--no-eval", "--track", "none",
                     "--out", str(tmp_path / "run")])
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert len(metrics["history"]) == 3
    assert any((e < 0).any() for e in first["examples"])  # the prompts arrived marked
    base, total, count = load_pretrained(tmp_path / "base"), 0.0, 0
    with torch.no_grad():
        for example in first["examples"]:
            tokens, trained = read_marks(example)
            chosen = trained[1:]
            logits = base(tokens[None])[0, :-1]
            total += F.cross_entropy(logits[chosen], tokens[1:][chosen], reduction="sum").item()
            count += int(chosen.sum())
    assert metrics["history"][0]["loss"]["0"] == pytest.approx(total / count, rel=1e-5)
    assert (tmp_path / "run" / "model.safetensors").is_file()


class Recording(FederatedClient):
    """Remembers the sequence ids of every round it trained."""

    def train_round(self, work, progress):
        self.trained = {**getattr(self, "trained", {}), work.round: list(work.sequence_ids)}
        return super().train_round(work, progress)


def test_a_federated_member_trains_on_the_responses_only(chat_mdat, tmp_path):
    """One client, dense results and SGD: the run's weights are those of standalone SGD on the
    same marked sequences, and not those of the same sequences with every token a target."""
    lr, rounds = 0.05, 3
    model = {k: v for k, v in dataclasses.asdict(tiny_config(**BYTES_MODEL)).items()
             if v is not None}
    tables = run_tables(chat_mdat, model={"inline": model}, tiers={"allowed": [0]},
                        data={"path": str(chat_mdat), "strategy": "chat",
                              "max_seq_len": SEQ_LEN},
                        round={"rounds": rounds, "tokens_per_round": 512},
                        update={"rule": "sgd", "lr": lr, "schedule": "constant"},
                        compression={"encoding": "dense", "value_dtype": "float32"})
    server = RunningServer.start(RunConfig.load(write_run_toml(tmp_path / "run.toml", tables)),
                                 grpc_port=0, http_port=0)
    try:
        member = Recording(FederatedOptions(
            server=f"127.0.0.1:{server.grpc_port}", tier=0, name="solo", join_token=JOIN_TOKEN,
            state_dir=tmp_path / "solo", microbatch_tokens=256, progress=False),
            log=lambda line: None)
        summary = member.run()
        reader = server.service.coordinator.reader
    finally:
        server.stop()
    assert summary.finished and summary.rounds_trained == rounds

    def standalone_sgd(unmarked: bool) -> dict[str, torch.Tensor]:
        model = load_pretrained(tmp_path / "run" / "checkpoints" / "round-0")
        runner = MicrobatchRunner(model, AdaptiveLimitsConfig(max_tokens=256).build())
        sgd = torch.optim.SGD(model.parameters(), lr=lr)
        for step in range(rounds):
            examples = [torch.from_numpy(reader[i].astype(np.int64))
                        for i in member.trained[step]]
            if unmarked:
                examples = [read_marks(e)[0] for e in examples]
            rows = pack_rows([len(e) for e in examples], SEQ_LEN)  # as the member packs
            train_step_on_examples(runner, sgd, examples, TierSchedule(tiers=[0]), step,
                                   rows=rows)
        return canonical_state_dict(model)

    trained = canonical_state_dict(member.replica.model)
    masked, everything = standalone_sgd(False), standalone_sgd(True)
    assert all(torch.equal(trained[n], masked[n]) for n in masked)
    assert not all(torch.equal(trained[n], everything[n]) for n in everything)
