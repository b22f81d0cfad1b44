"""From config to specs: the one place where component names are resolved in the registry.

Everything is resolved before any module is built, so a config that names something
unknown fails before a single tensor is allocated.
"""

from __future__ import annotations

from dataclasses import dataclass

from matformer.modeling.attention import AttentionSubmodules, SelfAttention
from matformer.modeling.block import BlockSubmodules
from matformer.modeling.config import LayerConfig, ModelConfig
from matformer.modeling.registry import Registry
from matformer.modeling.registry import registry as default_registry
from matformer.modeling.spec import Identity, ModuleSpec


@dataclass(slots=True)
class ModelSpec:
    """Every module of a model, as specs."""

    embedding: ModuleSpec
    positional: ModuleSpec
    layers: list[ModuleSpec]
    final_norm: ModuleSpec | type
    loss: ModuleSpec


def layer_spec(layer: LayerConfig, registry: Registry, ffn_width: int) -> ModuleSpec:
    """The spec of one transformer block whose stored FFN has ``ffn_width`` neurons."""
    norm = ModuleSpec(registry.get("norm", layer.normalization))
    hooks = {
        position: ModuleSpec(registry.get("hook", name), params=params)
        for position, (name, params) in layer.hook_specs().items()
    }
    attention = ModuleSpec(
        SelfAttention,
        submodules=AttentionSubmodules(
            kernel=ModuleSpec(registry.get("attention", "kernel", layer.attn_impl))
        ),
    )
    residual = ModuleSpec(registry.get("residual", "bias_dropout_add"))
    return ModuleSpec(
        registry.get("block", layer.normalization_position),
        submodules=BlockSubmodules(
            input_layernorm=norm,
            self_attn=attention,
            self_attn_bda=residual,
            post_attention_layernorm=norm,
            mlp=ModuleSpec(registry.get("mlp", layer.ffn_activation),
                           params={"intermediate_size": ffn_width}),
            mlp_bda=residual,
            hooks=hooks,
        ),
    )


def model_spec(config: ModelConfig, registry: Registry = default_registry) -> ModelSpec:
    """Resolve a whole model config; loads the config's external modules first."""
    registry.load_modules(config.external_modules_path)
    widths = [config.matformer_base_intermediate_size >> t for t in config.stored_tiers()]
    layers = [
        layer_spec(layer, registry, width)
        for layer, width in zip(config.layer_configs(), widths, strict=True)
    ]
    last = config.layer_configs()[-1]
    norm = ModuleSpec(registry.get("norm", last.normalization))
    return ModelSpec(
        embedding=ModuleSpec(registry.get("embedding", "token")),
        positional=ModuleSpec(registry.get("positional", config.default_layer.positional_encoding)),
        layers=layers,
        final_norm=norm if layers[-1].module.needs_final_norm else Identity,
        loss=ModuleSpec(registry.get("loss", "cross_entropy")),
    )
