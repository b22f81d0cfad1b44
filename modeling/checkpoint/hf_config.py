"""``config.json``: a ModelConfig written the way Hugging Face reads it, and read back.

A Llama-shaped model (RoPE, RMSNorm before each sublayer, SwiGLU, no hooks, causal) is
written as ``model_type: llama`` with the fields ``LlamaForCausalLM`` needs, so plain
``transformers`` opens it. Every config also carries the Matformer fields and the full layer
spec, which is what Matformer reads back: a model of any shape reloads exactly.

Reading accepts Llama configs as transformers 4 and 5 write them: transformers 5 keeps
``rope_theta`` (and any RoPE scaling or partial rotation) inside ``rope_parameters``, possibly
once per layer type. A field Matformer cannot honour (RoPE scaling, partial rotation, biases,
an activation other than SiLU) is an error, never silently dropped: the model would compute
something else than the checkpoint's. Missing MatFormer metadata is inferred as psyche-elastic
does: the tier from ``matformer_base_intermediate_size / intermediate_size``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from matformer.modeling.config import LayerConfig, ModelConfig
from matformer.modeling.errors import ConfigError, TierError, closest
from matformer.modeling.matformer import tier_of_width

# A tier slice's record of the weights it was cut from (``export.export_tiers``).
SOURCE_KEY = "matformer_source_sha256"
# A converted model's record of how its FFN neurons were ordered (``neuron_order.convert``).
NEURON_ORDER_KEY = "matformer_neuron_order"
# Keys that carry nothing the model needs: Hugging Face's bookkeeping (or what we check
# below), and provenance: the slice's, which the loader reads, and a conversion's.
_HF_ONLY = {
    "architectures", "model_type", "torch_dtype", "dtype", "transformers_version", "use_cache",
    "pretraining_tp", "rms_norm_eps", "hidden_act", "attention_bias",
    "mlp_bias", "rope_scaling", "head_dim", "rope_parameters", "layer_types",
    "partial_rotary_factor", "auto_map", SOURCE_KEY, NEURON_ORDER_KEY,
}
_PLAIN_ROPE = {"rope_type", "type", "rope_theta", "partial_rotary_factor"}
LLAMA_LAYER = LayerConfig()  # the default layer is Llama's


def is_llama_shaped(config: ModelConfig) -> bool:
    """True when ``transformers.LlamaForCausalLM`` computes exactly what this model does."""
    return (
        config.is_causal
        and config.matformer_layer_tiers is None  # Llama has one FFN width for all layers
        and config.hidden_dropout == config.ffn_dropout == 0.0  # Llama's only dropout: attention
        and all(layer == LLAMA_LAYER for layer in config.layer_configs())
    )


def to_config_dict(config: ModelConfig, code: dict[str, Any] | None = None) -> dict[str, Any]:
    """The ``config.json`` content for ``config``; ``code``: the entries of the code packed
    beside it (``remote_code.pack_code``), for a model that is not Llama-shaped."""
    data = config.to_dict()
    data["external_modules_path"] = None  # a path of this machine means nothing elsewhere
    if is_llama_shaped(config):
        data.update(
            architectures=["LlamaForCausalLM"], model_type="llama", hidden_act="silu",
            rms_norm_eps=config.norm_eps, head_dim=config.head_dim, attention_bias=False,
            mlp_bias=False, rope_scaling=None,
            rope_parameters={"rope_type": "default", "rope_theta": config.rope_theta},
        )
    else:
        objective = "CausalLM" if config.is_causal else "MaskedLM"
        data.update(architectures=[f"MatformerFor{objective}"], model_type="matformer",
                    **(code or {}))
    return data


def from_config_dict(data: dict[str, Any], *, tier: int | None = None,
                     base: int | None = None) -> ModelConfig:
    """A ModelConfig from ``config.json`` content, ours or a plain Hugging Face Llama one.

    ``tier`` and ``base`` are what a manifest says of these files, used where the config
    itself lacks ``matformer_tier`` or ``matformer_base_intermediate_size``.
    """
    data = infer_metadata(data, tier=tier, base=base)
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
    for bias in ("attention_bias", "mlp_bias"):
        if data.get(bias):
            raise ConfigError(
                f"{bias} is true: this Llama has bias vectors, which Matformer's Llama layer "
                "does not have; train it with transformers, or drop the biases first."
            )
    _take_rope_parameters(data)
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
        if key in fields or key.startswith("matformer_") or closest(key, fields, cutoff=0.8):
            kept[key] = value
    return ModelConfig.from_dict(kept)


def _take_rope_parameters(data: dict[str, Any]) -> None:
    """Move ``rope_theta`` out of transformers 5's ``rope_parameters`` (flat, or one dict per
    layer type), refusing any RoPE variant other than plain full-head rotation."""
    params = data.get("rope_parameters") or {}
    if not isinstance(params, dict):
        raise ConfigError(f"rope_parameters must be an object, got {params!r}.")
    nested = [v for v in params.values() if isinstance(v, dict)]
    if nested:  # one dict per layer type ("full_attention": {...}, ...)
        if len(nested) != len(params) or any(v != nested[0] for v in nested):
            raise ConfigError(
                f"rope_parameters differ between layer types ({params}); Matformer uses one "
                "RoPE for every layer."
            )
        params = nested[0]
    rope_type = params.get("rope_type", params.get("type", "default"))
    unknown = sorted(set(params) - _PLAIN_ROPE)
    if rope_type != "default" or unknown:
        raise ConfigError(
            f"rope_parameters asks for RoPE type {rope_type!r}"
            + (f" with {', '.join(unknown)}" if unknown else "")
            + "; Matformer implements plain RoPE ('default') only: remove the scaling, or "
            "load this model with transformers."
        )
    partial = params.get("partial_rotary_factor", data.get("partial_rotary_factor"))
    if partial is not None and float(partial) != 1.0:
        raise ConfigError(
            f"partial_rotary_factor {partial}: Matformer rotates the whole head dimension; "
            "load this model with transformers."
        )
    theta = params.get("rope_theta")
    if theta is None:
        return
    if data.get("rope_theta") is not None and float(data["rope_theta"]) != float(theta):
        raise ConfigError(
            f"config.json sets rope_theta {data['rope_theta']} and rope_parameters.rope_theta "
            f"{theta}; keep one value."
        )
    data["rope_theta"] = theta


def infer_metadata(data: dict[str, Any], *, tier: int | None, base: int | None
                   ) -> dict[str, Any]:
    """``data`` with ``matformer_tier`` and ``matformer_base_intermediate_size`` filled in.

    A config's own base width wins over ``base`` (the manifest's); a missing tier is
    ``tier`` (the manifest entry's), else inferred from base / width, else 0. A width that
    is no power-of-two fraction of the base is a ConfigError.
    """
    data = dict(data)
    width = data.get("intermediate_size")
    if data.get("matformer_base_intermediate_size") is None and base is not None:
        data["matformer_base_intermediate_size"] = base
    base = data.get("matformer_base_intermediate_size")
    if data.get("matformer_tier") is None:
        if tier is None and isinstance(base, int) and isinstance(width, int):
            try:
                tier = tier_of_width(base, width)
            except TierError as err:
                raise ConfigError(str(err)) from err
        data["matformer_tier"] = tier or 0
    return data
