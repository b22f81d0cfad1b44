"""A BPE tokenizer trained on a submdat serves a "huggingface" strategy."""

import hashlib

import numpy as np
import pytest
from tokenizers import Tokenizer

from matformer.modeling.corpus import python_docs
from matformer.modeling.errors import StrategyError, TokenizerChanged
from matformer.modeling.mdat import Mdat
from matformer.modeling.tokenizers import train_tokenizer

DOCS = list(python_docs(limit=80))


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("bpe")
    with Mdat.create(root / "c") as mdat:
        mdat.add_records("docs", ({"text": t} for t in DOCS))
        path = train_tokenizer(mdat.submdat("docs"), root / "tok" / "tokenizer.json",
                               vocab_size=400)
        yield mdat, path


def test_training_writes_a_byte_level_bpe(trained) -> None:
    _, path = trained
    tokenizer = Tokenizer.from_file(str(path))
    assert tokenizer.get_vocab_size() == 400
    assert [tokenizer.token_to_id(t) for t in ("<pad>", "<bos>", "<eos>", "<mask>")] == [0, 1, 2, 3]
    text = "Return the naïve café's value."
    assert tokenizer.decode(tokenizer.encode(text).ids) == text
    assert len(tokenizer.encode(DOCS[0]).ids) < len(DOCS[0].encode()) * 0.8  # it learned merges
    assert [p.name for p in path.parent.iterdir()] == ["tokenizer.json"]


@pytest.mark.parametrize("splitter", ["fixed_chunks", "sentence_chunks"])
def test_huggingface_strategy_pretokenizes_with_it(trained, splitter) -> None:
    mdat, path = trained
    name = f"bpe_{splitter}"
    strategy = mdat.add_strategy({
        "strategy_name": name, "tokenizer_type": "huggingface", "tokenizer_name": str(path),
        "chunk_size": 16, "splitter_class": splitter, "bos_token_id": 1, "eos_token_id": 2,
    })
    assert strategy.vocab_size == 400 and strategy.mask_token_id == 3  # from the file
    assert (mdat.path / "pretok" / name / "tokenizer.json").read_bytes() == path.read_bytes()
    mdat.pretokenize(name)
    reader = mdat.sequences(name, 64)
    tokenizer = Tokenizer.from_file(str(path))
    per_document: dict[int, list[int]] = {}
    for i in range(len(reader)):
        per_document.setdefault(reader.locate(i).document, []).extend(reader[i].tolist())
    assert list(per_document.values()) == [
        tokenizer.encode(t, add_special_tokens=False).ids for t in DOCS
    ]
    if splitter == "fixed_chunks":
        ids = tokenizer.encode(DOCS[0], add_special_tokens=False).ids
        assert np.array_equal(reader[0], ids[:64])


def test_vocabulary_too_small(trained, tmp_path) -> None:
    mdat, _ = trained
    with pytest.raises(StrategyError, match=r"cannot hold the 256 byte symbols"):
        train_tokenizer(mdat.submdat("docs"), tmp_path / "t.json", vocab_size=100)


def test_special_ids_come_from_the_tokenizer_file(trained) -> None:
    mdat, path = trained
    strategy = mdat.add_strategy({"strategy_name": "bpe_specials", "chunk_size": 16,
                                  "tokenizer_type": "huggingface", "tokenizer_name": str(path)})
    assert strategy.special_tokens() == {"bos_token_id": 1, "eos_token_id": 2,
                                         "mask_token_id": 3}
    mdat.pretokenize("bpe_specials")
    assert mdat.sequences("bpe_specials", 16).strategy.eos_token_id == 2
    with pytest.raises(StrategyError, match=r"eos_token_id 400 is outside the vocabulary "
                                            r"0\.\.399"):
        mdat.add_strategy({"strategy_name": "bpe_bad_eos", "chunk_size": 16, "eos_token_id": 400,
                           "tokenizer_type": "huggingface", "tokenizer_name": str(path)})


def test_a_changed_tokenizer_file_needs_a_new_strategy_name(trained, tmp_path) -> None:
    mdat, _ = trained
    path = tmp_path / "tokenizer.json"
    train_tokenizer(mdat.submdat("docs"), path, vocab_size=400)
    definition = {"strategy_name": "bpe_changing", "chunk_size": 16,
                  "tokenizer_type": "huggingface", "tokenizer_name": str(path)}
    sha256 = mdat.add_strategy(definition).tokenizer_sha256
    assert mdat.add_strategy(definition).tokenizer_sha256 == sha256  # unchanged: fine
    train_tokenizer(mdat.submdat("docs"), path, vocab_size=400,
                    special_tokens=("<pad>", "<eos>", "<bos>", "<mask>"))
    with pytest.raises(TokenizerChanged, match=rf"sha256 {sha256}.*new strategy_name"):
        mdat.add_strategy(definition)
    stored = mdat.path / "pretok" / "bpe_changing" / "tokenizer.json"
    assert hashlib.sha256(stored.read_bytes()).hexdigest() == sha256


def test_an_invalid_tokenizer_file_is_named(trained, tmp_path) -> None:
    mdat, _ = trained
    (tmp_path / "broken.json").write_text('{"model": 1}')
    with pytest.raises(StrategyError, match=r"broken.json is not a tokenizer.json"):
        mdat.add_strategy({"strategy_name": "broken", "chunk_size": 16,
                           "tokenizer_type": "huggingface",
                           "tokenizer_name": str(tmp_path / "broken.json")})


def _hub_cache(root, repo, snapshots, main):
    """A folder laid out like the Hugging Face hub cache: repo's snapshots, refs/main."""
    folder = root / f"models--{repo.replace('/', '--')}"
    (folder / "refs").mkdir(parents=True, exist_ok=True)
    (folder / "refs" / "main").write_text(main)
    for commit, tokenizer in snapshots.items():
        (folder / "snapshots" / commit).mkdir(parents=True, exist_ok=True)
        (folder / "snapshots" / commit / "tokenizer.json").write_bytes(tokenizer.read_bytes())
    return root


@pytest.fixture
def offline_hub(tmp_path, monkeypatch):
    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(cache))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    return cache


def test_a_hub_tokenizer_resolves_through_the_cache_and_is_pinned(trained, tmp_path,
                                                                    offline_hub) -> None:
    mdat, path = trained
    other = tmp_path / "other" / "tokenizer.json"
    train_tokenizer(mdat.submdat("docs"), other, vocab_size=400,
                    special_tokens=("<pad>", "<eos>", "<bos>", "<mask>"))
    commits = {"a" * 40: path, "b" * 40: other}
    _hub_cache(offline_hub, "org/bpe", commits, main="a" * 40)
    definition = {"strategy_name": "bpe_hub", "chunk_size": 16,
                  "tokenizer_type": "huggingface", "tokenizer_name": "org/bpe"}
    strategy = mdat.add_strategy(definition)
    local = mdat.add_strategy({**definition, "strategy_name": "bpe_local",
                               "tokenizer_name": str(path)})
    assert strategy.tokenizer_name == "org/bpe"  # recorded by repo id, not the cache path
    assert strategy.tokenizer_sha256 == local.tokenizer_sha256
    mdat.pretokenize("bpe_hub")
    mdat.pretokenize("bpe_local")
    hub_reader, local_reader = mdat.sequences("bpe_hub", 64), mdat.sequences("bpe_local", 64)
    assert all(np.array_equal(hub_reader[i], local_reader[i]) for i in range(len(hub_reader)))

    # the repo's main moves to another tokenizer: the strategy's data no longer match it
    _hub_cache(offline_hub, "org/bpe", commits, main="b" * 40)
    with pytest.raises(TokenizerChanged, match=r"org/bpe \(sha256 [0-9a-f]{64}\) is another"):
        mdat.add_strategy(definition)
    pinned = mdat.add_strategy({**definition, "strategy_name": "bpe_hub_a",
                                "tokenizer_revision": "a" * 40})  # the revision it was
    assert pinned.tokenizer_sha256 == strategy.tokenizer_sha256
    # a sha256 given up front pins the file wherever it comes from
    with pytest.raises(StrategyError, match=r"has sha256 .*not the 0{64} the strategy gives"):
        mdat.add_strategy({**definition, "strategy_name": "bpe_pinned",
                           "tokenizer_sha256": "0" * 64})


def test_a_hub_tokenizer_missing_from_the_offline_cache_is_named(trained, offline_hub) -> None:
    from matformer.modeling.errors import TokenizerNotFound

    mdat, _ = trained
    with pytest.raises(TokenizerNotFound, match=r"hub:org/absent: no tokenizer.json there"):
        mdat.add_strategy({"strategy_name": "bpe_absent", "chunk_size": 16,
                           "tokenizer_type": "huggingface", "tokenizer_name": "org/absent"})
