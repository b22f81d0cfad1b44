"""Training a byte-level BPE ``tokenizer.json`` on a submdat's text, offline.

The result loads with ``tokenizers.Tokenizer.from_file`` and serves a strategy with
``"tokenizer_type": "huggingface", "tokenizer_name": "<path>"``. Special tokens take the first
ids, in the order given (by default pad 0, bos 1, eos 2, mask 3).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from matformer.modeling.atomic import built_aside
from matformer.modeling.errors import StrategyError

if TYPE_CHECKING:
    from matformer.modeling.mdat.submdat import Submdat

DEFAULT_SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<mask>")
_BATCH = 256  # documents read per cursor pass


def _texts(submdat: Submdat) -> Iterator[str]:
    for start in range(0, len(submdat), _BATCH):
        for raw in submdat.raw_range(start, min(start + _BATCH, len(submdat))):
            yield raw.decode("utf-8")


def train_tokenizer(
    submdat: Submdat,
    out: str | Path,
    *,
    vocab_size: int,
    special_tokens: Sequence[str] = DEFAULT_SPECIAL_TOKENS,
    min_frequency: int = 2,
) -> Path:
    """Train byte-level BPE with ``vocab_size`` ids on ``submdat`` and save it to ``out``."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if vocab_size < len(alphabet) + len(special_tokens):
        raise StrategyError(
            f"vocab_size {vocab_size} cannot hold the {len(alphabet)} byte symbols and "
            f"{len(special_tokens)} special tokens; use at least "
            f"{len(alphabet) + len(special_tokens)}."
        )
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=list(special_tokens),
        initial_alphabet=alphabet, show_progress=False,
    )
    tokenizer.train_from_iterator(_texts(submdat), trainer=trainer, length=len(submdat))
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with built_aside(out) as building:
        tokenizer.save(str(building))
    return out
