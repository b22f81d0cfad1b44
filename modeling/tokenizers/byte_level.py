"""A byte-level tokenizer with no vocabulary file and no dependencies.

Every UTF-8 byte is its own token (ids 0..255), so any text round-trips exactly; four special
tokens follow. It suits tests, tiny models and baselines where a learned vocabulary would only
add a download.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


class ByteTokenizer:
    pad_token_id = 256
    bos_token_id = 257
    eos_token_id = 258
    mask_token_id = 259
    vocab_size = 260

    def encode(self, text: str, *, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        ids = list(text.encode("utf-8"))
        if add_bos:
            ids.insert(0, self.bos_token_id)
        if add_eos:
            ids.append(self.eos_token_id)
        return ids

    def decode(self, ids: Iterable[int]) -> str:
        """Text for `ids` without special tokens; a cut-off multi-byte character becomes U+FFFD."""
        data = bytearray()
        for raw in ids:
            token = int(raw)  # also accepts the 0-d tensors that iterating a tensor yields
            if not 0 <= token < self.vocab_size:
                raise ValueError(
                    f"token id {token} is outside ByteTokenizer's vocabulary [0, {self.vocab_size})"
                )
            if token < 256:
                data.append(token)
        return data.decode("utf-8", errors="replace")


def byte_level_json() -> dict[str, Any]:
    """`ByteTokenizer` as a ``tokenizers`` ``tokenizer.json``: the same ids for every text
    (byte b is id b, the four special tokens follow), so a checkpoint trained on bytes opens
    with ``AutoTokenizer`` like any other. The bytes are spelt as the byte-level
    pre-tokenizer spells them (printable characters stand in for the others)."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    stand_in = {b: chr(b) for b in printable}
    stand_in.update({b: chr(256 + n) for n, b in enumerate(
        b for b in range(256) if b not in stand_in)})
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False,
                  "use_regex": False}
    specials = [("<pad>", ByteTokenizer.pad_token_id), ("<bos>", ByteTokenizer.bos_token_id),
                ("<eos>", ByteTokenizer.eos_token_id), ("<mask>", ByteTokenizer.mask_token_id)]
    return {
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": [{"id": index, "content": content, "single_word": False,
                          "lstrip": False, "rstrip": False, "normalized": False,
                          "special": True} for content, index in specials],
        "normalizer": None, "pre_tokenizer": byte_level, "post_processor": None,
        "decoder": byte_level,
        "model": {"type": "BPE", "dropout": None, "unk_token": None,
                  "continuing_subword_prefix": None, "end_of_word_suffix": None,
                  "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": {stand_in[b]: b for b in range(256)}, "merges": []},
    }
