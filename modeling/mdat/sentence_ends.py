"""Where a text's sentences end, for the sentence splitter: NLTK's Punkt model of a language
when NLTK and that model are installed, else a built-in rule.

A sentence ends after . ! or ? (and any closing quotes or brackets) that whitespace follows;
a paragraph ends before a blank line. The whitespace goes with the next sentence, as
byte-level BPE attaches a leading space to the word after it. Punkt knows a language's
abbreviations ("Sig. Rossi" is one sentence in Italian); the rule does not. Models are never
downloaded here: ``python -m nltk.downloader punkt_tab`` installs them.
"""

from __future__ import annotations

import functools
import logging
import re
from collections.abc import Callable

log = logging.getLogger("matformer.mdat")

_PARAGRAPH_END = re.compile(r"(?=\n[ \t]*\n)")
_SENTENCE_END = re.compile(r"[.!?][\"')\]]*(?=\s)|" + _PARAGRAPH_END.pattern)

SentenceEnds = Callable[[str], list[int]]  # text → character offsets where sentences end


def rule_ends(text: str) -> list[int]:
    return [match.end() for match in _SENTENCE_END.finditer(text)]


def sentence_ends(language: str | None) -> SentenceEnds:
    """The sentence ends of ``language`` ("italian", "english", ...: Punkt's model names);
    None, or a language Punkt cannot serve here, gets the rule (the latter said once)."""
    return (_punkt(language) if language is not None else None) or rule_ends


@functools.cache  # one model, and one warning, per language and process
def _punkt(language: str) -> SentenceEnds | None:
    try:
        from nltk.tokenize.punkt import PunktTokenizer
    except ImportError:
        reason = "NLTK (with PunktTokenizer) is not installed: pip install nltk"
    else:
        try:
            tokenizer = PunktTokenizer(language)
        except (LookupError, ValueError, OSError) as err:
            said = next((line.strip() for line in str(err).splitlines()
                         if line.strip().strip("*")), type(err).__name__)
            reason = (f"NLTK has no Punkt model for it here ({said}); python -m "
                      "nltk.downloader punkt_tab installs them")
        else:
            def ends(text: str) -> list[int]:
                spans = list(tokenizer.span_tokenize(text))
                paragraphs = [m.end() for m in _PARAGRAPH_END.finditer(text)]
                return [end for _, end in spans[:-1]] + paragraphs

            return ends
    log.warning("matformer.mdat: sentences in %r are split by the built-in rule, not Punkt: %s",
                language, reason)
    return None
