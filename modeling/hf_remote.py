"""Matformer models inside ``transformers``: the bases of the code a checkpoint carries.

A model ``transformers`` cannot open as a Llama is saved with ``configuration_matformer.py``
and ``modeling_matformer.py`` beside its weights (``modeling/checkpoint/remote_code.py``
writes them). Their classes subclass the ones here, so

    AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)

builds the model from this package, with the components it names, and loads the weights
through transformers' own loader (dtype, device_map and the Hub work as for any model). The
wrapper holds the Matformer model's children as its own, so its tensor names are the
model's; where a component names a tensor otherwise than the canonical name the file
holds, the canonical name is mapped to it while loading.

Only this module and ``hf_trainer.py`` (token-budget batches in transformers' Trainer)
import ``transformers``; only a checkpoint's code imports this one.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from matformer.modeling.checkpoint.hf_config import from_config_dict
from matformer.modeling.config import ModelConfig
from matformer.modeling.models import build_model
from matformer.modeling.naming import canonical_names

try:
    from transformers import GenerationMixin, PretrainedConfig, PreTrainedModel
    from transformers.modeling_outputs import CausalLMOutput, MaskedLMOutput
except ImportError as error:  # an optional extra: only checkpoints' own code comes here
    raise ImportError("opening a Matformer checkpoint's code through transformers needs "
                      "transformers: pip install 'matformer[transformers]'.") from error

_FIELDS = frozenset(f.name for f in dataclasses.fields(ModelConfig))


class MatformerConfigBase(PretrainedConfig):
    """config.json as written by Matformer: every ModelConfig field, kept as attributes."""

    model_type = "matformer"

    def matformer_config(self) -> ModelConfig:
        """The ModelConfig these attributes describe; the model's own components are
        registered already (the checkpoint's code imports their files)."""
        data = {key: value for key, value in self.to_dict().items() if key in _FIELDS}
        return dataclasses.replace(from_config_dict(data), external_modules_path=None)


class MatformerPreTrainedModel(PreTrainedModel):
    """Holds a Matformer model's children (``model``, ``lm_head``, ``loss_fn``) as its own,
    so the tensor names are the Matformer model's."""

    base_model_prefix = "model"
    main_input_name = "input_ids"
    _tied_weights_keys: ClassVar[dict[str, str]] = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: MatformerConfigBase) -> None:
        super().__init__(config)
        # The components compute some buffers (RoPE frequencies, ALiBi slopes, ...) rather
        # than store them. transformers builds a model on the meta device and replaces such
        # buffers with empty ones before asking _init_weights to fill them: so the model is
        # built for real here, and each module keeps its computed buffers to fill them from.
        with torch.device("cpu"):
            matformer = build_model(config.matformer_config())
        for module in matformer.modules():
            module._computed_buffers = {name: getattr(module, name).clone()
                                        for name in module._non_persistent_buffers_set}
        object.__setattr__(self, "matformer", matformer)  # not a child: its children are ours
        for name, child in matformer.named_children():
            self.add_module(name, child)
        self.post_init()

    @classmethod
    def from_pretrained(cls, *args: Any, **kwargs: Any) -> MatformerPreTrainedModel:
        """transformers' loader, told where a component's own tensor names differ from the
        canonical names the checkpoint holds."""
        config = kwargs.get("config")
        if isinstance(config, MatformerConfigBase) and "key_mapping" not in kwargs:
            renames = _renames(config.matformer_config())
            if renames:
                kwargs["key_mapping"] = renames
        return super().from_pretrained(*args, **kwargs)

    def _init_weights(self, module: nn.Module) -> None:
        """The computed buffers again; the weights all come from the checkpoint."""
        for name, value in getattr(module, "_computed_buffers", {}).items():
            getattr(module, name).copy_(value)

    def get_input_embeddings(self) -> nn.Module:
        return self.model.embed_tokens

    def set_input_embeddings(self, value: nn.Module) -> None:
        self.model.embed_tokens = value

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head

    def _logits(self, input_ids: Tensor, attention_mask: Tensor | None) -> Tensor:
        if attention_mask is not None and bool(attention_mask.all()):
            attention_mask = None  # nothing padded: the plain path
        return self.matformer(input_ids, attention_mask=attention_mask)


class MatformerCausalLMBase(MatformerPreTrainedModel, GenerationMixin):
    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None,
                labels: Tensor | None = None, **_: Any) -> CausalLMOutput:
        logits = self._logits(input_ids, attention_mask)
        loss = None
        if labels is not None:  # transformers' convention: labels are the inputs, unshifted
            loss = nn.functional.cross_entropy(
                logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100)
        return CausalLMOutput(loss=loss, logits=logits)

    def prepare_inputs_for_generation(self, input_ids: Tensor, attention_mask: Tensor | None = None,
                                      **_: Any) -> dict[str, Any]:
        return {"input_ids": input_ids, "attention_mask": attention_mask}


class MatformerMaskedLMBase(MatformerPreTrainedModel):
    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None,
                labels: Tensor | None = None, **_: Any) -> MaskedLMOutput:
        logits = self._logits(input_ids, attention_mask)
        loss = None
        if labels is not None:
            loss = nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(),
                                               ignore_index=-100)
        return MaskedLMOutput(loss=loss, logits=logits)


def _renames(config: ModelConfig) -> dict[str, str]:
    """{canonical name pattern: own name} for every tensor whose names differ."""
    with torch.device("meta"):
        model = build_model(config)
    return {f"^{re.escape(canonical)}$": own
            for own, canonical in canonical_names(model).items() if own != canonical}
