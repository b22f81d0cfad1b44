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


def special_id_conflicts(named: Mapping[str, int | None], data: Mapping[str, int | None]
                         ) -> str:
    """The ids a model names (``named``) that the data's tokenizer (``data``:
    ``special_ids``) sets otherwise, as "bos_token_id 1 (the data's: 257), ..."; "" if none."""
    return ", ".join(f"{name} {named[name]} (the data's: {index})"
                     for name, index in data.items()
                     if index is not None and named.get(name) not in (None, index))


def check_special_ids(named: Mapping[str, int | None], data: Mapping[str, int | None],
                      where: str) -> None:
    """SpecialIdsMismatch when a pretrained model's ids (``named``) and the data's tokenizer's
    differ: its embeddings learned the markers at its own ids, so it would read the data's as
    other tokens, and mask or pad with ids the data means otherwise. ``where``: the data, as
    the message names it."""
    if listed := special_id_conflicts(named, data):
        raise SpecialIdsMismatch(
            f"the model's special ids differ from those of {where}'s tokenizer: {listed}. "
            "Tokenize the data with the model's own tokenizer (a strategy of the tokenizer "
            "the checkpoint ships), or set the model's ids to the data's in its config.json "
            "if the two vocabularies are the same.")


def tokenizer_files(root: Path, strategy: Strategy, *, max_length: int) -> dict[str, bytes]:
    """``tokenizer.json`` and ``tokenizer_config.json`` for the strategy's tokenizer (none
    for a tokenizer type of the container's own code), with its chat template if it has one."""
    template = None
    if strategy.tokenizer_type == "bytes":
        data = byte_level_json()
    elif strategy.tokenizer_type == "huggingface":
        data = read_json(_file(root, strategy))
        template = HuggingFaceTokenizer(_file(root, strategy)).chat_template
    else:
        return {}
    spelling = {token["id"]: token["content"] for token in data.get("added_tokens", [])}
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": max_length,
              "clean_up_tokenization_spaces": False}
    for name, index in special_ids(root, strategy).items():
        if index in spelling:
            config[_SPECIAL_KEYS[name]] = spelling[index]
    if template is not None:
        config["chat_template"] = template
    return {TOKENIZER_FILE: json.dumps(data, ensure_ascii=False).encode(),
            "tokenizer_config.json": (json.dumps(config, indent=2) + "\n").encode()}


def _file(root: Path, strategy: Strategy) -> Path:
    return strategy_folder(root, strategy.name) / TOKENIZER_FILE
