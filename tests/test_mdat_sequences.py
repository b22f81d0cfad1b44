"""Sequences rebuilt from stored chunks equal direct tokenization cut the same way."""

import tracemalloc

import numpy as np
import pytest

from matformer.modeling.corpus import python_docs
from matformer.modeling.errors import PretokIncomplete, SequenceLengthError
from matformer.modeling.mdat import Mdat, SequenceLocation
from matformer.modeling.tokenizers import ByteTokenizer

DOCS = list(python_docs(limit=40))
CHUNK = 32


@pytest.fixture(scope="module")
def mdat(tmp_path_factory):
    with Mdat.create(tmp_path_factory.mktemp("seq") / "c") as mdat:
        mdat.add_records("a", ({"text": t} for t in DOCS[:25]))
        mdat.add_records("b", ({"text": t} for t in DOCS[25:]), compress=True)
        mdat.add_strategy({"strategy_name": "fixed", "chunk_size": CHUNK})
        mdat.add_strategy({"strategy_name": "sentences", "chunk_size": CHUNK,
                           "splitter_class": "sentence_chunks"})
        mdat.pretokenize("fixed")
        mdat.pretokenize("sentences")
        mdat.create_view("some", {"a": 10, "b": 0.5}, seed=1)  # some documents of each
        yield mdat


def expected_sequences(k: int) -> list[list[int]]:
    """Each document tokenized directly, cut every CHUNK tokens, k chunks per sequence."""
    out = []
    for text in DOCS:
        ids = ByteTokenizer().encode(text)
        out.extend(ids[i:i + k * CHUNK] for i in range(0, len(ids), k * CHUNK))
    return out


@pytest.mark.parametrize("k", [1, 2, 4])
def test_sequences_equal_direct_tokenization(mdat, k) -> None:
    reader = mdat.sequences("fixed", k * CHUNK)
    expected = expected_sequences(k)
    assert len(reader) == len(expected)
    assert [reader[i].tolist() for i in range(len(reader))] == expected
    assert [s.tolist() for s in reader] == expected


@pytest.mark.parametrize("k", [1, 3])
def test_sentence_chunked_sequences_stay_in_their_document(mdat, k) -> None:
    reader = mdat.sequences("sentences", k * CHUNK)
    rebuilt: dict[tuple[str, int], list[int]] = {}
    for i in range(len(reader)):
        where = reader.locate(i)
        assert len(reader[i]) <= k * CHUNK
        rebuilt.setdefault((where.submdat, where.document), []).extend(reader[i].tolist())
    assert list(rebuilt.values()) == [ByteTokenizer().encode(t) for t in DOCS]


def test_length_from_histogram_matches(mdat) -> None:
    for k in (1, 2, 5):
        total = 0
        for sub in ("a", "b"):
            histogram = np.load(mdat.path / "pretok" / "fixed" / sub / "histogram.npy")
            total += sum(int(n) * -(-c // k) for c, n in enumerate(histogram))
        assert len(mdat.sequences("fixed", k * CHUNK)) == total


def test_length_needs_no_pass_over_the_chunks(tmp_path) -> None:
    texts = ["x" * (2000 + i) for i in range(20)]  # 40,190 one-token chunks
    with Mdat.create(tmp_path / "c") as mdat:
        mdat.add_records("a", ({"text": t} for t in texts))
        mdat.add_strategy({"strategy_name": "one", "chunk_size": 1})
        mdat.pretokenize("one")
        mdat.create_view("v", {"a": 5})
        chosen = np.load(mdat.path / "views" / "v" / "a.npy")
        tracemalloc.start()
        try:
            lengths = [len(mdat.sequences("one", k)) for k in (1, 7)]
            view_length = len(mdat.sequences("one", 7, "v"))
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert peak < 100_000  # an int64 per chunk alone would be 321,520 bytes
        assert lengths == [sum(len(t) for t in texts), sum(-(-len(t) // 7) for t in texts)]
        assert view_length == sum(-(-len(texts[d]) // 7) for d in chosen)
        reader = mdat.sequences("one", 7, "v")
        assert b"".join(bytes(s.tolist()) for s in reader) == b"".join(
            texts[d].encode() for d in chosen)


@pytest.mark.parametrize("strategy", ["fixed", "sentences"])
def test_lengths_equal_the_length_of_each_sequence(mdat, strategy) -> None:
    for view in (None, "some"):
        for k in (1, 3):
            reader = mdat.sequences(strategy, k * CHUNK, view)
            lengths = reader.lengths()
            assert lengths.dtype == np.int64
            assert lengths.tolist() == [len(reader[i]) for i in range(len(reader))]


def test_locate_names_submdat_document_and_end(mdat) -> None:
    reader = mdat.sequences("fixed", 2 * CHUNK)
    first_doc_sequences = -(-len(DOCS[0].encode()) // (2 * CHUNK))
    assert reader.locate(0) == SequenceLocation("a", 0, 0, 2, first_doc_sequences == 1)
    last = reader.locate(first_doc_sequences - 1)
    assert (last.document, last.first_chunk, last.ends_document) == (
        0, 2 * (first_doc_sequences - 1), True)
    assert reader.locate(len(reader) - 1).submdat == "b"
    assert reader.locate(-1) == reader.locate(len(reader) - 1)
    with pytest.raises(IndexError):
        reader[len(reader)]


@pytest.mark.parametrize("length", [CHUNK + 1, 48, 0, -CHUNK])
def test_length_must_be_a_positive_multiple_of_chunk_size(mdat, length) -> None:
    with pytest.raises(SequenceLengthError, match=f"not a positive multiple.*chunk_size {CHUNK}"):
        mdat.sequences("fixed", length)


def test_reading_before_pretokenizing_names_the_command(tmp_path) -> None:
    with Mdat.create(tmp_path / "c") as mdat:
        mdat.add_records("a", [{"text": "hello"}])
        mdat.add_strategy({"strategy_name": "s", "chunk_size": 8})
        with pytest.raises(PretokIncomplete, match=r"pretokenize .* s"):
            mdat.sequences("s", 8)
