"""Tokenizers: the byte-level tokenizer that needs no file (``byte_level.py``), the tokenizers
an MDAT strategy can name and the one place they are built (``text.py``), and training a BPE
``tokenizer.json`` on a submdat's text (``training.py``).
"""

from matformer.modeling.tokenizers.byte_level import ByteTokenizer
from matformer.modeling.tokenizers.text import (
    SPECIAL_TOKEN_NAMES,
    BytesTokenizer,
    HuggingFaceTokenizer,
    TextTokenizer,
    build_text_tokenizer,
)
from matformer.modeling.tokenizers.training import DEFAULT_SPECIAL_TOKENS, train_tokenizer

__all__ = [
    "DEFAULT_SPECIAL_TOKENS",
    "SPECIAL_TOKEN_NAMES",
    "ByteTokenizer",
    "BytesTokenizer",
    "HuggingFaceTokenizer",
    "TextTokenizer",
    "build_text_tokenizer",
    "train_tokenizer",
]
