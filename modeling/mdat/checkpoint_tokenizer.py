"""The tokenizer a model trained on a strategy's sequences carries in its checkpoint folder:
``tokenizer.json`` and ``tokenizer_config.json``, so that ``AutoTokenizer``, ``pipeline(
"text-generation", model=FOLDER)`` and ``matformer-generate FOLDER`` need nothing else.

A "huggingface" strategy's file is the container's own copy of it; the byte vocabulary is
written as the equivalent ``tokenizer.json`` (`byte_level_json`). A tokenizer type of the
container's own code has no such file, and the checkpoint goes without one.

    files = tokenizer_files(mdat.path, mdat.strategy("bpe"), max_length=1024)
    save_pretrained(model, out, files=files)
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

from matformer.modeling.checkpoint.files import read_json
from matformer.modeling.errors import SpecialIdsMismatch
from matformer.modeling.mdat.pretok_files import TOKENIZER_FILE, strategy_folder
from matformer.modeling.mdat.strategy import Strategy
from matformer.modeling.tokenizers import ByteTokenizer, HuggingFaceTokenizer
from matformer.modeling.tokenizers.byte_level import byte_level_json

# tokenizer_config.json's key for each special id (ModelConfig's name for it)
_SPECIAL_KEYS = {"bos_token_id": "bos_token", "eos_token_id": "eos_token",
                 "mask_token_id": "mask_token", "pad_token_id": "pad_token"}
SPECIAL_ID_NAMES = frozenset(_SPECIAL_KEYS)


def special_ids(root: Path, strategy: Strategy) -> dict[str, int | None]:
    """The special ids sequences of ``strategy`` use: the strategy's own, else its
    tokenizer's (pad: the byte vocabulary's, else none)."""
    if strategy.tokenizer_type == "bytes":
        tokenizer = ByteTokenizer()
    elif strategy.tokenizer_type == "huggingface":
        tokenizer = HuggingFaceTokenizer(_file(root, strategy))
    else:
        tokenizer = None
    own = strategy.special_tokens()
    ids = {name: own.get(name) if own.get(name) is not None else getattr(tokenizer, name, None)
           for name in _SPECIAL_KEYS}
    return ids


def check_special_ids(named: Mapping[str, int | None], data: Mapping[str, int | None],
                      where: str) -> None:
    """SpecialIdsMismatch when an id the run named for its model (``named``: a pretrained
    model's own, or the keys a config gives) and the data's tokenizer (``data``:
    ``special_ids``) are both set and differ: the model would read the data's markers as
    other tokens, and mask or pad with ids the data means otherwise. ``where``: the data,
    as the message names it."""
    differ = {name: (named[name], index) for name, index in data.items()
              if index is not None and named.get(name) not in (None, index)}
    if differ:
        listed = ", ".join(f"{name} {model} (the data's: {index})"
                           for name, (model, index) in differ.items())
        raise SpecialIdsMismatch(
            f"the model's special ids differ from those of {where}'s tokenizer: {listed}. "
            "Tokenize the data with the model's own tokenizer (a strategy of the tokenizer "
            "the checkpoint ships), or set the model's ids to the data's in its config if "
            "the two vocabularies are the same.")


def tokenizer_files(root: Path, strategy: Strategy, *, max_length: int) -> dict[str, bytes]:
    """``tokenizer.json`` and ``tokenizer_config.json`` for the strategy's tokenizer (none
    for a tokenizer type of the container's own code)."""
    if strategy.tokenizer_type == "bytes":
        data = byte_level_json()
    elif strategy.tokenizer_type == "huggingface":
        data = read_json(_file(root, strategy))
    else:
        return {}
    spelling = {token["id"]: token["content"] for token in data.get("added_tokens", [])}
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": max_length,
              "clean_up_tokenization_spaces": False}
    for name, index in special_ids(root, strategy).items():
        if index in spelling:
            config[_SPECIAL_KEYS[name]] = spelling[index]
    return {TOKENIZER_FILE: json.dumps(data, ensure_ascii=False).encode(),
            "tokenizer_config.json": (json.dumps(config, indent=2) + "\n").encode()}


def _file(root: Path, strategy: Strategy) -> Path:
    return strategy_folder(root, strategy.name) / TOKENIZER_FILE
