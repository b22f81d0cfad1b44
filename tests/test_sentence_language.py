"""The sentence splitter takes a language (seed 000's ``splitter_init: {"language": ...}``):
NLTK's Punkt model of it where installed, else the built-in rule, said once."""

from __future__ import annotations

import logging
import sys

import numpy as np
import pytest

from matformer.modeling.mdat import sentence_ends
from matformer.modeling.mdat.builtin_splitters import SentenceChunks
from matformer.modeling.tokenizers.text import BytesTokenizer

TEXT = "Il Sig. Rossi arriva. Poi parte."


@pytest.fixture(autouse=True)
def fresh_models():
    sentence_ends._punkt.cache_clear()  # models and warnings are kept per process
    yield
    sentence_ends._punkt.cache_clear()


def pieces(language: str | None, chunk_size: int = 14) -> list[str]:
    splitter = SentenceChunks(tokenizer=BytesTokenizer(), chunk_size=chunk_size,
                              language=language)
    result = splitter({"data": TEXT})
    assert np.array_equal(result["tokens"], np.frombuffer(TEXT.encode(), dtype=np.uint8))
    edges = np.cumsum(result["chunks"])
    return [TEXT.encode()[a:b].decode() for a, b in zip([0, *edges[:-1]], edges, strict=True)]


def test_punkt_knows_the_languages_abbreviations(tmp_path, monkeypatch):
    nltk = pytest.importorskip("nltk")
    model = tmp_path / "tokenizers" / "punkt_tab" / "italian"
    model.mkdir(parents=True)
    for name in ("collocations.tab", "sent_starters.txt", "ortho_context.tab"):
        (model / name).write_text("")
    (model / "abbrev_types.txt").write_text("sig\n")  # a Punkt model knowing one abbreviation
    monkeypatch.setattr(nltk.data, "path", [str(tmp_path)])
    assert sentence_ends.sentence_ends("italian")(TEXT) == [21]  # after "arriva." alone
    assert sentence_ends.sentence_ends(None)(TEXT) == [7, 21]  # the rule: after "Sig." too
    assert pieces("italian", chunk_size=21) == ["Il Sig. Rossi arriva.", " Poi parte."]
    assert pieces(None) == ["Il Sig.", " Rossi arriva.", " Poi parte."]


@pytest.mark.parametrize("nltk_installed", [True, False])
def test_without_punkt_the_rule_splits_and_says_so_once(tmp_path, monkeypatch, caplog,
                                                       nltk_installed):
    if nltk_installed:
        nltk = pytest.importorskip("nltk")
        monkeypatch.setattr(nltk.data, "path", [str(tmp_path)])  # no models there
    else:
        for module in ("nltk", "nltk.tokenize", "nltk.tokenize.punkt"):
            monkeypatch.setitem(sys.modules, module, None)  # importing it fails
    with caplog.at_level(logging.WARNING, logger="matformer.mdat"):
        assert pieces("italian") == pieces(None)
        assert pieces("italian") == pieces(None)
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "'italian' are split by the built-in rule" in said[0]
    assert ("no Punkt model" if nltk_installed else "pip install nltk") in said[0]
