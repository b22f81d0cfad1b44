"""Prompt marks: which tokens of a training sequence are prompt, read but never a target.

Instruction data (docs/training.md, "Instruction tuning") trains a model on its responses
only. Its sequences say which tokens those are in the token ids themselves: a prompt token
``t`` is written ``~t`` (that is ``-1 - t``), a response token as it is. The marks therefore
go wherever a sequence goes (a reader, the wire to a federated member, a data-parallel
broadcast, a saetta export) with no second array to keep in step, and a consumer that does
not read them cannot take them for tokens: a negative id fails at the embedding.

``mark_prompt`` writes them (`modeling.mdat.sequences`, from the stored loss mask);
``read_marks`` reads them, in ``example_targets`` (modeling/models.py) and nowhere else.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor


def marked_dtype(token_dtype: np.dtype) -> np.dtype:
    """The signed dtype that holds every id of ``token_dtype`` and its mark."""
    return np.dtype(np.int32 if np.dtype(token_dtype).itemsize < 4 else np.int64)


def mark_prompt(tokens: np.ndarray, loss_mask: np.ndarray) -> np.ndarray:
    """``tokens`` (T,) with each token where ``loss_mask`` (T,) is 0 written as ``~token``."""
    signed = tokens.astype(marked_dtype(tokens.dtype))
    return np.where(loss_mask.astype(bool), signed, ~signed)


def read_marks(ids: Tensor) -> tuple[Tensor, Tensor]:
    """(the token ids, (T,) bool: True where a token may be a target) of a sequence (T,);
    a sequence without marks has every token a possible target."""
    prompt = ids < 0
    return torch.where(prompt, ~ids, ids), ~prompt
