import itertools

import pytest
import torch

from matformer.modeling.corpus import python_docs, python_docs_tokens
from matformer.modeling.tokenizers import ByteTokenizer

TOK = ByteTokenizer()


def test_unicode_round_trip() -> None:
    text = "naïve café — 東京 🚀 done"
    ids = TOK.encode(text)
    assert len(ids) == len(text.encode("utf-8"))
    assert all(0 <= i < 256 for i in ids)
    assert TOK.decode(ids) == text


def test_special_tokens_are_added_and_skipped() -> None:
    ids = TOK.encode("hi", add_bos=True, add_eos=True)
    assert ids == [TOK.bos_token_id, ord("h"), ord("i"), TOK.eos_token_id]
    assert TOK.decode([TOK.pad_token_id, *ids, TOK.mask_token_id]) == "hi"
    assert TOK.vocab_size == 260
    assert TOK.decode(torch.tensor(ids)) == "hi"


def test_decode_replaces_broken_bytes_and_rejects_unknown_ids() -> None:
    assert TOK.decode(TOK.encode("é")[:1]) == "\ufffd"
    with pytest.raises(ValueError, match="outside"):
        TOK.decode([TOK.vocab_size])


def test_corpus_is_deterministic_real_english() -> None:
    first = list(python_docs(limit=50))
    assert first == list(python_docs(limit=50))
    assert len(first) == 50
    assert all(len(doc) >= 200 for doc in first)
    assert any(" the " in doc for doc in first)


def test_corpus_respects_min_chars_and_limit() -> None:
    docs = list(python_docs(limit=30, min_chars=1000))
    assert len(docs) == 30
    assert all(len(doc) >= 1000 for doc in docs)
    assert list(itertools.islice(python_docs(), 5)) == list(python_docs(limit=5))


def test_corpus_tokens() -> None:
    max_tokens = 20_000
    tokens = python_docs_tokens(TOK, max_tokens=max_tokens)
    assert tokens.dtype == torch.long and tokens.ndim == 1
    assert len(tokens) == max_tokens  # the stdlib holds far more than this
    assert int(tokens.max()) < TOK.vocab_size
    eos_at = (tokens == TOK.eos_token_id).nonzero().flatten().tolist()
    assert len(eos_at) >= 2
    # The ids between two EOS markers decode to exactly one corpus document.
    docs = list(python_docs(limit=len(eos_at)))
    assert TOK.decode(tokens[: eos_at[0]]) == docs[0]
    assert TOK.decode(tokens[eos_at[0] + 1 : eos_at[1]]) == docs[1]
