"""``config.json``: a ModelConfig written the way Hugging Face reads it, and read back.

A Llama-shaped model (RoPE, RMSNorm before each sublayer, SwiGLU, no hooks, causal) is
written as ``model_type: llama`` with the fields ``LlamaForCausalLM`` needs, so plain
``transformers`` opens it. Every config also carries the Matformer fields and the full layer
spec, which is what Matformer reads back: a model of any shape reloads exactly.
"""

from __future__ import annotations

import dataclasses
import difflib
from typing import Any

from modeling.config import LayerConfig, ModelConfig
from modeling.errors import ConfigError

# Keys Hugging Face writes that carry nothing Matformer needs (or that we check below).
_HF_ONLY = {
    "architectures", "model_type", "torch_dtype", "dtype", "transformers_version", "use_cache",
    "pretraining_tp", "attention_dropout", "rms_norm_eps", "hidden_act", "attention_bias",
    "mlp_bias", "rope_scaling", "head_dim", "rope_parameters", "layer_types",
}
LLAMA_LAYER = LayerConfig()  # the default layer is Llama's


def is_llama_shaped(config: ModelConfig) -> bool:
    """True when ``transformers.LlamaForCausalLM`` computes exactly what this model does."""
    return (
        config.is_causal
        and config.matformer_layer_tiers is None  # Llama has one FFN width for all layers
        and all(layer == LLAMA_LAYER for layer in config.layer_configs())
    )


def to_config_dict(config: ModelConfig) -> dict[str, Any]:
    """The ``config.json`` content for ``config``."""
    data = config.to_dict()
    if is_llama_shaped(config):
        data.update(
            architectures=["LlamaForCausalLM"], model_type="llama", hidden_act="silu",
            rms_norm_eps=config.norm_eps, head_dim=config.head_dim, attention_bias=False,
            mlp_bias=False, rope_scaling=None,
        )
    else:
        objective = "CausalLM" if config.is_causal else "MaskedLM"
        data.update(architectures=[f"MatformerFor{objective}"], model_type="matformer")
    return data


def from_config_dict(data: dict[str, Any]) -> ModelConfig:
    """A ModelConfig from ``config.json`` content, ours or a plain Hugging Face Llama one."""
    data = dict(data)
    model_type = data.get("model_type")
    if model_type not in (None, "llama", "matformer"):
        raise ConfigError(
            f"config.json describes a {model_type!r} model; Matformer reads Llama-shaped and "
            "Matformer checkpoints only."
        )
    if data.get("rope_scaling") not in (None, {}):
        raise ConfigError("rope_scaling is not supported; remove it or set it to null.")
    if data.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"hidden_act {data['hidden_act']!r}: Llama checkpoints use 'silu'.")
    for token in ("pad_token_id", "bos_token_id", "eos_token_id", "mask_token_id"):
        data.setdefault(token, None)  # absent means none, not the byte tokenizer's ids
    if "norm_eps" not in data and "rms_norm_eps" in data:
        data["norm_eps"] = data["rms_norm_eps"]
    head_dim = data.get("head_dim")
    heads = data.get("num_attention_heads")
    if head_dim is not None and heads and head_dim * heads != data.get("hidden_size"):
        raise ConfigError(
            f"head_dim={head_dim} × {heads} heads differs from hidden_size="
            f"{data.get('hidden_size')}; Matformer needs head_dim = hidden_size / heads."
        )
    fields = [f.name for f in dataclasses.fields(ModelConfig)]
    kept = {}
    for key, value in data.items():
        if key in _HF_ONLY:
            continue
        # Other Hugging Face bookkeeping is ignored, but a key that looks like a Matformer
        # field is kept so that from_dict rejects the misspelling and names the right one.
        if key in fields or key.startswith("matformer_") or difflib.get_close_matches(
            key, fields, n=1, cutoff=0.8
        ):
            kept[key] = value
    return ModelConfig.from_dict(kept)
