"""Model configuration: plain data that round-trips through JSON and chooses components by name.

Field names follow Hugging Face's ``config.json`` where one exists, so a Llama-shaped
Matformer config reads like a Llama config plus the ``matformer_*`` fields and a layer spec.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from matformer.modeling.errors import ConfigError, HookPositionError, did_you_mean

# Where a block calls hooks; see modeling/block.py for the exact points.
HOOK_POSITIONS = ("pre_attn", "pre_mlp", "post_mlp", "pre_output")


def _reject_unknown(kind: str, given: dict[str, Any], cls: type, also: tuple[str, ...] = ()
                    ) -> None:
    valid = [f.name for f in dataclasses.fields(cls)] + list(also)
    for key in given:
        if key not in valid:
            raise ConfigError(f"unknown {kind} key {key!r}: {did_you_mean(key, valid)}valid "
                              f"keys: {', '.join(valid)}.")


@dataclass(kw_only=True, slots=True)
class LayerConfig:
    """Which registered component each part of a transformer block uses."""

    attn_impl: str | None = None  # attention kernel; None lets the registry pick (sdpa on CPU)
    positional_encoding: str = "rope"  # learnable | rope | alibi | sinusoidal | nope (per model)
    normalization: str = "rmsnorm"  # rmsnorm | layernorm
    normalization_position: str = "pre"  # pre | post
    ffn_activation: str = "swiglu"  # swiglu | geglu | gelu
    # position → hook name, or {"name": ..., **constructor params}
    hooks: dict[str, str | dict[str, Any]] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LayerConfig:
        _reject_unknown("layer config", data, cls)
        return cls(**data)

    def merged(self, override: dict[str, Any]) -> LayerConfig:
        """This layer config with the keys of a per-layer override replaced."""
        _reject_unknown("layer override", override, LayerConfig)
        return dataclasses.replace(self, **override)

    def hook_specs(self) -> dict[str, tuple[str, dict[str, Any]]]:
        """position → (hook name, params), checking positions and shapes."""
        specs = {}
        for position, hook in self.hooks.items():
            if position not in HOOK_POSITIONS:
                raise HookPositionError(
                    f"hook position {position!r} does not exist; a block exposes "
                    f"{', '.join(HOOK_POSITIONS)}."
                )
            if isinstance(hook, str):
                specs[position] = (hook, {})
            elif isinstance(hook, dict) and isinstance(hook.get("name"), str):
                params = {k: v for k, v in hook.items() if k != "name"}
                specs[position] = (hook["name"], params)
            else:
                raise ConfigError(
                    f"hook at {position!r} must be a name or {{'name': ..., **params}}, "
                    f"got {hook!r}."
                )
        return specs


@dataclass(kw_only=True, slots=True)
class ModelConfig:
    """A whole model: sizes, tokens, objective, MatFormer tier and the layer spec."""

    vocab_size: int = 260  # the built-in byte tokenizer's vocabulary
    hidden_size: int = 256  # model width (C)
    num_hidden_layers: int = 4
    num_attention_heads: int = 4  # must divide hidden_size
    num_key_value_heads: int | None = None  # grouped-query attention; None = one per head
    intermediate_size: int = 1024  # FFN width of this checkpoint (sliced width at tier > 0)
    max_position_embeddings: int = 1024  # longest sequence (learnable/sinusoidal tables)
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    initializer_range: float = 0.02  # std of the normal init of linear and embedding weights
    tie_word_embeddings: bool = False  # lm_head shares embed_tokens' weight
    pad_token_id: int | None = 256
    bos_token_id: int | None = 257
    eos_token_id: int | None = 258
    mask_token_id: int | None = 259  # BERT-style objective only
    is_causal: bool = True  # causal attention mask (GPT) or bidirectional (BERT)
    masked_substitution_rate: float = 0.15  # fraction of tokens masked by BERTModel
    # dropout while training (0: none, Llama's choice): on the attention probabilities, on
    # each sublayer's output before it joins the residual stream (bias-dropout-add), and on
    # the FFN's hidden activations
    attention_dropout: float = 0.0
    hidden_dropout: float = 0.0
    ffn_dropout: float = 0.0
    matformer_tier: int = 0  # tier this checkpoint was sliced at (0 = universal)
    matformer_base_intermediate_size: int | None = None  # universal FFN width; None = same
    # a Mix'n'Match slice: the tier each layer was sliced at (None: all at matformer_tier)
    matformer_layer_tiers: list[int] | None = None
    default_layer: LayerConfig = field(default_factory=LayerConfig)
    # layer index (int or str, as JSON has it) → partial LayerConfig applied on top
    layer_overrides: dict[int, dict[str, Any]] = field(default_factory=dict)
    # user components to register: a folder of .py files, or the files themselves (a
    # checkpoint lists its packed copies, relative to its folder)
    external_modules_path: str | list[str] | None = None

    def __post_init__(self) -> None:
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.matformer_base_intermediate_size is None:
            self.matformer_base_intermediate_size = self.intermediate_size << self.matformer_tier
        if isinstance(self.default_layer, dict):
            self.default_layer = LayerConfig.from_dict(self.default_layer)
        self.layer_overrides = {int(i): dict(v) for i, v in self.layer_overrides.items()}
        self.validate()

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def validate(self) -> None:
        """Check shapes and choices; runs before any tensor is allocated."""
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "intermediate_size", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}.")
        if self.hidden_size % self.num_attention_heads:
            raise ConfigError(
                f"num_attention_heads={self.num_attention_heads} does not divide "
                f"hidden_size={self.hidden_size}; pick a head count that divides it "
                f"(e.g. {_divisors_near(self.hidden_size, self.num_attention_heads)})."
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"num_key_value_heads={self.num_key_value_heads} must divide "
                f"num_attention_heads={self.num_attention_heads} (each key/value head serves "
                "a whole group of query heads)."
            )
        if self.hidden_size // self.num_attention_heads % 2 and self._uses("rope"):
            raise ConfigError("RoPE needs an even head dimension (hidden_size / heads).")
        for name in ("pad_token_id", "bos_token_id", "eos_token_id", "mask_token_id"):
            value = getattr(self, name)
            if value is not None and not 0 <= value < self.vocab_size:
                raise ConfigError(
                    f"{name}={value} lies outside the vocabulary (0..{self.vocab_size - 1}); "
                    "set it to an id inside it or to null."
                )
        if not 0.0 <= self.masked_substitution_rate <= 1.0:
            raise ConfigError("masked_substitution_rate must lie in [0, 1].")
        for name in ("attention_dropout", "hidden_dropout", "ffn_dropout"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ConfigError(f"{name} is a probability in [0, 1), got "
                                  f"{getattr(self, name)!r}.")
        if self.matformer_tier < 0:
            raise ConfigError(f"matformer_tier must be >= 0, got {self.matformer_tier}.")
        if self.matformer_base_intermediate_size != self.intermediate_size << self.matformer_tier:
            raise ConfigError(
                f"intermediate_size={self.intermediate_size} is not "
                f"matformer_base_intermediate_size={self.matformer_base_intermediate_size} / "
                f"2**matformer_tier ({self.matformer_tier}); fix one of the three fields."
            )
        if self.matformer_layer_tiers is not None:
            tiers = list(self.matformer_layer_tiers)
            if len(tiers) != self.num_hidden_layers or tiers != sorted(tiers):
                raise ConfigError(
                    f"matformer_layer_tiers {tiers} needs one tier per layer "
                    f"({self.num_hidden_layers}), never decreasing with depth."
                )
            if tiers[0] != self.matformer_tier:
                raise ConfigError(
                    f"matformer_tier ({self.matformer_tier}) must equal the first layer's tier "
                    f"in matformer_layer_tiers ({tiers[0]}): it names the widest layer."
                )
        for index, override in self.layer_overrides.items():
            if not 0 <= index < self.num_hidden_layers:
                raise ConfigError(
                    f"layer_overrides names layer {index}, but the model has layers "
                    f"0..{self.num_hidden_layers - 1}."
                )
            if "positional_encoding" in override:
                raise ConfigError(
                    "positional_encoding is chosen once per model in default_layer; "
                    f"remove it from layer_overrides[{index}]."
                )
        for layer in self.layer_configs():
            layer.hook_specs()

    def stored_tiers(self) -> list[int]:
        """The tier each layer's FFN weights were sliced at."""
        if self.matformer_layer_tiers is not None:
            return list(self.matformer_layer_tiers)
        return [self.matformer_tier] * self.num_hidden_layers

    def _uses(self, positional: str) -> bool:
        return self.default_layer.positional_encoding == positional

    def layer_configs(self) -> list[LayerConfig]:
        """The effective LayerConfig of every layer (default_layer + overrides)."""
        return [
            self.default_layer.merged(self.layer_overrides.get(i, {}))
            for i in range(self.num_hidden_layers)
        ]

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelConfig:
        """Build from a JSON-like dict; unknown keys are an error naming the closest one.
        Seed 000's spellings are read too (`SEED_SPELLINGS`)."""
        _reject_unknown("model config", data, cls, SEED_SPELLINGS)
        data = _from_seed_spellings(data)
        return cls(**data)

    def to_dict(self) -> dict[str, Any]:
        data = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        data["default_layer"] = dataclasses.asdict(self.default_layer)
        data["layer_overrides"] = {str(i): v for i, v in self.layer_overrides.items()}
        return data

    @classmethod
    def from_json(cls, path: str | Path) -> ModelConfig:
        try:
            data = json.loads(Path(path).read_text())
        except json.JSONDecodeError as err:
            raise ConfigError(f"{path} is not valid JSON: {err}") from err
        return cls.from_dict(data)

    def to_json(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")


# Seed 000's model-config keys that are other fields here: ffn_factor (the FFN width is
# ffn_factor × hidden_size) and training_objective (is_causal, by objective).
SEED_SPELLINGS = ("ffn_factor", "training_objective")
OBJECTIVES = {"causal": True, "autoregressive": True, "masked": False}


def _from_seed_spellings(data: dict[str, Any]) -> dict[str, Any]:
    """``data`` with `SEED_SPELLINGS` turned into our fields; one that disagrees with the
    field given beside it is refused."""
    data = dict(data)
    if "ffn_factor" in data:
        factor = data.pop("ffn_factor")
        hidden = data.get("hidden_size", ModelConfig.__dataclass_fields__["hidden_size"].default)
        width = factor * hidden if _is_number(factor) and _is_number(hidden) else 0
        if width < 1 or abs(width - round(width)) > 1e-6:  # 0.1 × 30 is 3.0000000000000004
            raise ConfigError(f"ffn_factor={factor!r} × hidden_size={hidden!r} is no whole "
                              "number of FFN neurons; give a factor that makes one, or "
                              "intermediate_size.")
        _agree(data, "intermediate_size", round(width), f"ffn_factor={factor} × hidden_size")
    if "training_objective" in data:
        objective = data.pop("training_objective")
        if not isinstance(objective, str) or objective not in OBJECTIVES:
            raise ConfigError(f"training_objective {objective!r} is not one of "
                              f"{', '.join(OBJECTIVES)}.")
        _agree(data, "is_causal", OBJECTIVES[objective], f"training_objective={objective!r}")
    return data


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _agree(data: dict[str, Any], field: str, value: Any, source: str) -> None:
    if field in data and data[field] != value:
        raise ConfigError(f"{field}={data[field]!r} disagrees with {source} ({value!r}); give "
                          "one of the two, or make them agree.")
    data[field] = value


def _divisors_near(n: int, k: int) -> str:
    divisors = [d for d in range(1, n + 1) if n % d == 0]
    best = sorted(divisors, key=lambda d: abs(d - k))[:3]
    return ", ".join(str(d) for d in sorted(best))
