"""A byte-level tokenizer with no vocabulary file and no dependencies.

Every UTF-8 byte is its own token (ids 0..255), so any text round-trips exactly; four special
tokens follow. It suits tests, tiny models and baselines where a learned vocabulary would only
add a download.
"""

from __future__ import annotations

from collections.abc import Iterable


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
