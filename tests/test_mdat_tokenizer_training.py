"""A BPE tokenizer trained on a submdat serves a "huggingface" strategy."""

import hashlib

import numpy as np
import pytest
from tokenizers import Tokenizer

from modeling.corpus import python_docs
from modeling.errors import StrategyError, TokenizerChanged
from modeling.mdat import Mdat
from modeling.tokenizers import train_tokenizer

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
