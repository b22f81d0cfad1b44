"""Strategies: validation on registration, built-in and custom splitters."""

import textwrap

import numpy as np
import pytest

from matformer.modeling.errors import (
    InvalidName,
    NameTaken,
    SplitterError,
    StrategyError,
    TokenizerNotFound,
    UnknownName,
    UnknownSplitter,
)
from matformer.modeling.mdat import Mdat, Strategy
from matformer.modeling.mdat.builtin_splitters import SentenceChunks, pack_sentences
from matformer.modeling.mdat.document_splitter import DocumentSplitter
from matformer.modeling.registry import registry
from matformer.modeling.tokenizers import BytesTokenizer

SEED_EXAMPLE = {
    "strategy_name": "Bytes64",
    "tokenizer_type": "bytes",
    "tokenizer_name": None,
    "vocab_size": 260,
    "bos_token_id": 257,
    "eos_token_id": 258,
    "mask_token_id": None,
    "splitter_class": "sentence_chunks",
    "splitter_init": None,
    "splitter_arguments": None,
    "modality": "text",
    "chunk_size": 64,
    "wants_from_db": ["data"],
    "wants_raw": True,
    "returns": ["tokens", "chunks"],
    "required_databases": ["tokens", "chunks"],
}


@pytest.fixture
def mdat(tmp_path):
    with Mdat.create(tmp_path / "c") as mdat:
        mdat.add_records("d", [{"text": "One. Two two! Three three three?\n\nNew paragraph."}])
        yield mdat


def test_seed_style_strategy_is_stored_with_defaults_filled(mdat) -> None:
    strategy = mdat.add_strategy(SEED_EXAMPLE)
    assert strategy.mask_token_id == 259  # left null: the tokenizer's own
    assert mdat.strategy("Bytes64") == strategy
    assert mdat.strategy("Bytes64").token_dtype == np.uint16
    assert mdat.add_strategy(SEED_EXAMPLE) == strategy  # the same again: nothing happens
    with pytest.raises(NameTaken, match=r"another definition"):
        mdat.add_strategy({**SEED_EXAMPLE, "chunk_size": 32})


def test_strategy_from_a_json_file(mdat, tmp_path) -> None:
    file = tmp_path / "s.json"
    file.write_text('{"strategy_name": "f", "chunk_size": 16}')
    assert mdat.add_strategy(file).vocab_size == 260
    assert [s.name for s in mdat.strategies()] == ["f"]
    with pytest.raises(UnknownName, match=r"'g'.*f"):
        mdat.strategy("g")


def test_typo_names_the_field_and_lists_valid_ones() -> None:
    with pytest.raises(StrategyError, match=r"\[strategy\] has no key 'chunksize'; did you "
                                            r"mean 'chunk_size'\? valid keys: strategy_name, "
                                            r"chunk_size"):
        Strategy.from_dict({"strategy_name": "s", "chunksize": 64})


@pytest.mark.parametrize(("change", "message"), [
    ({"chunk_size": "64"}, "chunk_size must be an int"),
    ({"chunk_size": True}, "chunk_size must be an int"),
    ({"chunk_size": 0}, r"\[strategy\] chunk_size must be >= 1, got 0"),
    ({"modality": "audio"}, "modality 'audio' is not one of text"),
    ({"wants_from_db": ["data", "pixels"]}, "wants_from_db may hold"),
    ({"required_databases": ["tokens"]}, "required_databases must be"),
    ({"returns": ["tokens"]}, "must include every required database"),
    ({"returns": "tokens"}, "returns must be a list"),
    ({"tokenizer_sha256": 5}, "tokenizer_sha256 must be a str"),
])
def test_bad_values_are_named(change, message) -> None:
    with pytest.raises(StrategyError, match=message):
        Strategy.from_dict({"strategy_name": "s", "chunk_size": 64, **change})


def test_missing_required_field() -> None:
    with pytest.raises(StrategyError, match=r"missing the required key 'chunk_size'"):
        Strategy.from_dict({"strategy_name": "s"})


def test_bad_strategy_name() -> None:
    with pytest.raises(InvalidName, match=r"strategy name"):
        Strategy.from_dict({"strategy_name": "../s", "chunk_size": 64})


def test_large_vocabularies_use_uint32() -> None:
    base = {"strategy_name": "s", "chunk_size": 8}
    assert Strategy.from_dict({**base, "vocab_size": 65_536}).token_dtype == np.uint16
    assert Strategy.from_dict({**base, "vocab_size": 65_537}).token_dtype == np.uint32


def test_missing_tokenizer_file(mdat, tmp_path) -> None:
    with pytest.raises(TokenizerNotFound, match=r"missing.json does not exist"):
        mdat.add_strategy({"strategy_name": "hf", "chunk_size": 8, "tokenizer_type": "huggingface",
                           "tokenizer_name": str(tmp_path / "missing.json")})


def test_special_ids_must_be_in_the_vocabulary(mdat) -> None:
    with pytest.raises(StrategyError, match=r"bos_token_id 260 is outside the vocabulary 0\.\.259"):
        mdat.add_strategy({"strategy_name": "s", "chunk_size": 8, "bos_token_id": 260})
    with pytest.raises(StrategyError, match=r"mask_token_id -1 is outside"):
        mdat.add_strategy({"strategy_name": "s", "chunk_size": 8, "mask_token_id": -1})
    assert mdat.add_strategy({"strategy_name": "s", "chunk_size": 8}).special_tokens() == {
        "bos_token_id": 257, "eos_token_id": 258, "mask_token_id": 259}


def test_unknown_tokenizer_type_and_small_vocab(mdat) -> None:
    with pytest.raises(StrategyError, match=r"unknown tokenizer_type 'sentencepiece'.*bytes"):
        mdat.add_strategy({"strategy_name": "s", "chunk_size": 8,
                           "tokenizer_type": "sentencepiece"})
    with pytest.raises(StrategyError, match=r"smaller than its tokenizer's 260"):
        mdat.add_strategy({"strategy_name": "s", "chunk_size": 8, "vocab_size": 100})


def test_unknown_splitter_lists_what_exists(mdat) -> None:
    with pytest.raises(UnknownSplitter, match=r"'nltk_sentences'.*fixed_chunks.*sentence_chunks"
                                              r".*functions"):
        mdat.add_strategy({"strategy_name": "s", "chunk_size": 8,
                           "splitter_class": "nltk_sentences"})


def test_splitter_init_must_fit(mdat) -> None:
    with pytest.raises(StrategyError, match=r"splitter_init .* does not fit"):
        mdat.add_strategy({"strategy_name": "s", "chunk_size": 8,
                           "splitter_init": {"language": "italian"}})


def test_fixed_chunks_cut_every_chunk_size(mdat) -> None:
    mdat.add_strategy({"strategy_name": "f", "chunk_size": 8})
    mdat.pretokenize("f")
    text = mdat.submdat("d").text(0)
    reader = mdat.sequences("f", 8)
    assert [bytes(reader[i].tolist()) for i in range(len(reader))] == [
        text.encode()[i:i + 8] for i in range(0, len(text.encode()), 8)
    ]


def test_sentence_chunks_hold_whole_sentences() -> None:
    splitter = SentenceChunks(tokenizer=BytesTokenizer(), chunk_size=20)
    text = "One. Two two! Three three three?\n\nNew paragraph. " + "x" * 45 + ". End."
    result = splitter({"data": text})
    ids = np.frombuffer(text.encode(), dtype=np.uint8)
    assert np.array_equal(result["tokens"], ids)
    edges = np.cumsum(result["chunks"])
    pieces = [text.encode()[a:b].decode() for a, b in zip([0, *edges[:-1]], edges, strict=True)]
    assert pieces == [
        "One. Two two!", " Three three three?", "\n\nNew paragraph.",
        " " + "x" * 19, "x" * 20, "x" * 6 + ". End.",
    ]
    assert max(result["chunks"]) <= 20 and sum(result["chunks"]) == len(ids)


def test_sentence_chunks_align_multibyte_text() -> None:
    splitter = SentenceChunks(tokenizer=BytesTokenizer(), chunk_size=14)
    text = "Café crème. Ünïcödé? Ja."  # sentences of 13, 13 and 4 bytes
    result = splitter({"data": text})
    edges = np.cumsum(result["chunks"])
    pieces = [text.encode()[a:b].decode() for a, b in zip([0, *edges[:-1]], edges, strict=True)]
    assert pieces == ["Café crème.", " Ünïcödé?", " Ja."]


def test_pack_sentences_cuts_only_long_sentences() -> None:
    assert pack_sentences([3, 4, 2, 10, 1], chunk_size=5).tolist() == [3, 4, 2, 5, 5, 1]
    assert pack_sentences([0, 2, 0, 3], chunk_size=5).tolist() == [5]


CUSTOM_SPLITTER = '''
import numpy as np
from matformer.modeling.registry import registry


@registry.register("splitter", "test_word_chunks", "default")
class WordChunks:
    """One chunk per word (byte tokens), words longer than chunk_size are cut."""

    def __init__(self, *, tokenizer, chunk_size, separator=" "):
        self.tokenizer, self.chunk_size, self.separator = tokenizer, chunk_size, separator

    def __call__(self, document, upper=False):
        text = document["data"].upper() if upper else document["data"]
        tokens, _ = self.tokenizer.encode(text)
        chunks = []
        for word in text.split(self.separator):
            size = len((word + self.separator).encode())
            while size > 0:
                chunks.append(min(size, self.chunk_size))
                size -= self.chunk_size
        chunks[-1] -= len(self.separator.encode())
        return {"tokens": tokens, "chunks": [c for c in chunks if c], "meta": document["meta"]}


@registry.register("splitter", "test_broken_sum", "default")
class BrokenSum:
    def __init__(self, *, tokenizer, chunk_size):
        self.tokenizer = tokenizer

    def __call__(self, document):
        tokens, _ = self.tokenizer.encode(document["data"])
        return {"tokens": tokens, "chunks": [len(tokens) + 1]}
'''


def test_custom_splitter_from_functions_folder(tmp_path) -> None:
    with Mdat.create(tmp_path / "c", trust_remote_code=True) as mdat:
        (mdat.path / "functions" / "words.py").write_text(textwrap.dedent(CUSTOM_SPLITTER))
        mdat.add_records("d", [{"text": "ab cd", "lang": "x"}])
        mdat.add_strategy({
            "strategy_name": "w", "chunk_size": 4, "splitter_class": "test_word_chunks",
            "splitter_init": {"separator": " "}, "splitter_arguments": {"upper": True},
            "wants_from_db": ["data", "meta"], "returns": ["tokens", "chunks", "meta"],
        })
        mdat.pretokenize("w")
        reader = mdat.sequences("w", 4)
        assert [bytes(reader[i].tolist()) for i in range(len(reader))] == [b"AB ", b"CD"]
        mdat.add_strategy({"strategy_name": "broken", "chunk_size": 64,
                           "splitter_class": "test_broken_sum"})
        with pytest.raises(SplitterError, match=r"document 0 of submdat 'd'.*sum to 6, not to "
                                                r"the 5 tokens"):
            mdat.pretokenize("broken")


@registry.register("splitter", "test_returns_given", "default")
class ReturnsGiven:
    """Returns whatever the test put in splitter_arguments."""

    def __init__(self, *, tokenizer, chunk_size) -> None:
        pass

    def __call__(self, document, result=None):
        return result


@pytest.mark.parametrize(("result", "message"), [
    ([1, 2], "returned a list, not a dict"),
    ({"tokens": [1]}, r"lacks \['chunks'\]"),
    ({"tokens": [[1], [2]], "chunks": [2]}, "must be 1-D sequences of integers"),
    ({"tokens": [1.5], "chunks": [1]}, "must be 1-D sequences of integers"),
    ({"tokens": [1, 300], "chunks": [2]}, r"outside the vocabulary 0\.\.259"),
    ({"tokens": [1] * 9, "chunks": [9]}, r"chunk length is outside 1\.\.8"),
    ({"tokens": [1, 2], "chunks": [0, 2]}, r"chunk length is outside 1\.\.8"),
    ({"tokens": [1], "chunks": [1], "lang": "en"},
     r"has \['lang'\], which the strategy's returns \['tokens', 'chunks'\] does not list"),
])
def test_invalid_splitter_results_are_named(tmp_path, result, message) -> None:
    strategy = Strategy.from_dict({"strategy_name": "s", "chunk_size": 8, "vocab_size": 260,
                                   "splitter_class": "test_returns_given",
                                   "splitter_arguments": {"result": result}})
    splitter = DocumentSplitter(strategy, tmp_path, None)
    with pytest.raises(SplitterError, match=rf"invalid result for document 4: .*{message}"):
        splitter.split({"data": "x"}, "document 4")
