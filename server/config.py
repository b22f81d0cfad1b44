"""``RunConfig``: everything ``matformer-server --config run.toml`` needs, as typed sections.

    config = RunConfig.load("run.toml", ["round.rounds=5"])  # with --set: checked whole
    config.model.build()                        # -> ModelConfig (universal)
    config.tiers.build(config.model.build())    # -> TierPolicy
    config.compression.build()                  # -> modeling's Compressor
    config.update.build(r, config.round.planned_rounds, config.compression)  # round r's rule
    config.auth.token()                         # the join token (never in repr/str)
    config.auth.operator()                      # the operator token (HTTP writes), or None
    RunConfig.from_dict(config.to_dict()) == config
    run_schema()                                # run.toml's JSON schema, from the same keys

Relative paths resolve against the TOML file's folder. ``examples/run.toml`` shows every key
with its default. Compression encodings take modeling's names (``dense | topk | dct``); the
old ``none`` and ``demo`` are refused with the name to write instead. ``[inner]`` with
``batch_tokens`` > 0 (local steps) and no ``[update] rule`` takes DiLoCo's outer optimizer
(``sections.OUTER_DEFAULTS``) for the keys ``[update]`` leaves out. ``auth = "none"`` is
short for ``[auth] mode = "none"``; ``to_dict`` writes the table.

``to_dict`` holds ``auth.join_token`` (and ``operator_token``) when run.toml wrote the token
inline (it must, to round trip); keep such a dict where run.toml itself may be read, or use
the ``*_env`` keys.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import MISSING, dataclass, field
from pathlib import Path
from typing import Any, get_type_hints

from matformer.modeling.commands import apply_overrides
from matformer.modeling.compression import ENCODERS, Broadcast, CompressionConfig, universal_shapes
from matformer.modeling.errors import CompressionConfigError, TierError
from matformer.modeling.matformer import layer_widths, tier_width
from matformer.modeling.settings import (
    check_declared,
    default_of,
    json_schema,
    read_table,
    read_toml,
    reject_unknown,
    table_of,
)
from matformer.protocol.settings import InnerSettings, RunSettings
from matformer.server.errors import InvalidValue, MissingFile
from matformer.server.policies.section import PolicySection, policy_schema
from matformer.server.sections import (
    OUTER_DEFAULTS,
    AuthSection,
    CheckpointSection,
    CoordinatorSection,
    DataSection,
    FaultsSection,
    InnerSection,
    ModelSection,
    RoundSection,
    RunSection,
    ServerSection,
    TiersSection,
    TlsSection,
    TrackingSection,
    UpdateSection,
)

RENAMED_ENCODINGS = {"none": "dense", "demo": "dct"}  # names run.toml once took → today's


@dataclass(kw_only=True, slots=True)
class RunConfig:
    run: RunSection
    model: ModelSection
    data: DataSection
    round: RoundSection
    auth: AuthSection
    server: ServerSection = field(default_factory=ServerSection)
    tiers: TiersSection = field(default_factory=TiersSection)
    compression: CompressionConfig = field(default_factory=CompressionConfig)
    update: UpdateSection = field(default_factory=UpdateSection)
    policy: PolicySection = field(default_factory=PolicySection)
    inner: InnerSection = field(default_factory=InnerSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    tls: TlsSection = field(default_factory=TlsSection)
    faults: FaultsSection = field(default_factory=FaultsSection)
    tracking: TrackingSection = field(default_factory=TrackingSection)
    coordinator: CoordinatorSection = field(default_factory=CoordinatorSection)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Each section's declared ranges (a config built in code has not been read), then
        the checks across sections."""
        for f in dataclasses.fields(self):
            if f.name != "policy":  # its keys are its policy's (PolicySection checks them)
                check_declared(getattr(self, f.name), f.name)
        self.policy.build(self.update, peer_clip=self.faults.peer_clip)  # across sections
        model = self.model.build()
        for tier in self.tiers.allowed:
            try:
                tier_width(model, tier)
            except TierError as err:
                raise InvalidValue(f"[tiers] allowed tier {tier}: {err}") from err
        for k, layers in enumerate(self.tiers.layer_mixes):
            try:
                layer_widths(model, layers)
            except TierError as err:
                raise InvalidValue(f"[tiers] layer_mixes[{k}]: {err}") from err
        if self.data.max_seq_len > model.max_position_embeddings:
            raise InvalidValue(
                f"[data] max_seq_len {self.data.max_seq_len} exceeds the model's "
                f"max_position_embeddings {model.max_position_embeddings}; lower one or raise "
                "the other."
            )
        if self.round.tokens_per_round < self.data.max_seq_len:
            raise InvalidValue(
                f"[round] tokens_per_round {self.round.tokens_per_round} is less than one "
                f"sequence ([data] max_seq_len {self.data.max_seq_len}); raise it."
            )
        if self.update.broadcast(self.compression):
            broadcast = Broadcast(topk=self.update.broadcast(self.compression),
                                  chunk=self.compression.chunk, bits=self.update.broadcast_bits)
            try:
                for shape in universal_shapes(model).values():
                    broadcast.check(shape)
            except CompressionConfigError as err:
                raise InvalidValue(f"[update] broadcast_topk: {err}") from err
        if self.inner.enabled and self.inner.batch_tokens < self.data.max_seq_len:
            raise InvalidValue(
                f"[inner] batch_tokens {self.inner.batch_tokens} is less than one sequence "
                f"([data] max_seq_len {self.data.max_seq_len}); raise it.")
        if self.update.warmup_rounds > self.round.planned_rounds:
            raise InvalidValue(
                f"[update] warmup_rounds {self.update.warmup_rounds} exceeds the "
                f"{self.round.planned_rounds} rounds the run plans ([round]); lower it."
            )

    @classmethod
    def load(cls, path: str | Path, overrides: Iterable[str] = ()) -> RunConfig:
        """run.toml at ``path`` with ``--set SECTION.KEY=VALUE`` ``overrides`` applied;
        relative paths (also those of overrides) resolve against the file's folder."""
        path = Path(path)
        if not path.is_file():
            raise MissingFile(f"{path} does not exist; pass the run's TOML file "
                              "(examples/run.toml shows one).")
        return cls.from_dict(apply_overrides(read_toml(path), overrides),
                             base=path.resolve().parent)

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, base: str | Path = ".") -> RunConfig:
        """From parsed TOML (or ``to_dict``'s output); relative paths resolve against ``base``."""
        types = get_type_hints(cls)  # section name → its dataclass
        reject_unknown("run.toml", data, list(types))
        tables = {name: data.get(name, {}) for name in types}
        if isinstance(tables["auth"], str):  # auth = "none": short for [auth] mode = "none"
            tables["auth"] = {"mode": tables["auth"]}
        if isinstance(tables["compression"], dict):
            _refuse_renamed_encoding(tables["compression"].get("encoding"))
        if _local_steps(tables["inner"]) and isinstance(tables["update"], dict) \
                and "rule" not in tables["update"]:
            tables["update"] = {**OUTER_DEFAULTS, **tables["update"]}
        base = Path(base).resolve()
        return cls(**{name: PolicySection.read(tables[name], base) if name == "policy"
                      else read_table(kind, tables[name], name, base)
                      for name, kind in types.items()})

    @property
    def keys_path(self) -> Path:
        """The client keys file of ``[auth] mode = "keys"`` (server/keys.py)."""
        return self.auth.keys_file or Path(self.run.dir) / "keys.json"

    def member_settings(self, data_fingerprint: str) -> RunSettings:
        """What a member needs to train as this run does (``data_fingerprint``: the data's,
        which the member checks its copy against)."""
        inner = self.inner
        return RunSettings(
            compression=self.compression, sequence_length=self.data.max_seq_len,
            data_strategy=self.data.strategy, data_view=self.data.view,
            data_fingerprint=data_fingerprint, heartbeat_s=self.faults.heartbeat_s,
            inner=None if not inner.enabled else InnerSettings(
                name=inner.optimizer, lr=inner.lr, weight_decay=inner.weight_decay,
                beta1=inner.betas[0], beta2=inner.betas[1], eps=inner.eps,
                warmup_steps=inner.warmup_steps, batch_tokens=inner.batch_tokens,
                schedule=inner.schedule, final_lr=inner.final_lr_value,
                planned_rounds=self.round.planned_rounds, grad_clip=inner.grad_clip),
            overlap=self.round.overlap, peer_clip=self.faults.peer_clip,
            max_norm=self.faults.max_norm, norm_action=self.faults.norm_action,
            deadline_s=self.round.deadline_s, layer_mixes=self.tiers.tier_ids().mixes)

    def to_dict(self) -> dict[str, Any]:
        """Plain data (TOML and JSON types) that ``from_dict`` reads back to an equal config."""
        return {f.name: self.policy.table() if f.name == "policy"
                else table_of(getattr(self, f.name)) for f in dataclasses.fields(self)}


def _local_steps(inner: Any) -> bool:
    """Whether an [inner] table, as written, asks for local steps."""
    steps = inner.get("batch_tokens", 0) if isinstance(inner, dict) else 0
    return isinstance(steps, int) and not isinstance(steps, bool) and steps > 0


def _refuse_renamed_encoding(encoding: Any) -> None:
    """InvalidValue for an encoding under a name it no longer has, naming the new one (the
    generic "unknown encoding" error would not)."""
    if isinstance(encoding, str) and encoding in RENAMED_ENCODINGS:
        raise InvalidValue(
            f"[compression] encoding {encoding!r} is not one of {', '.join(ENCODERS)}; "
            f"{encoding!r} is now called {RENAMED_ENCODINGS[encoding]!r}: write "
            f'encoding = "{RENAMED_ENCODINGS[encoding]}".'
        )


def run_schema() -> dict[str, Any]:
    """The JSON schema (draft 2020-12) of run.toml, from the declarations RunConfig reads with,
    ``auth`` also as a mode alone (``auth = "none"``). Checks across keys and sections are
    RunConfig's alone."""
    required = [f.name for f in dataclasses.fields(RunConfig) if default_of(f) is MISSING]
    schema = json_schema(get_type_hints(RunConfig), title="run.toml", required=required,
                         description="One federated Matformer run, for `matformer-server "
                         "--config run.toml`; examples/run.toml shows every key with its default.")
    auth = schema["properties"]["auth"]
    mode = {**auth["properties"]["mode"], "description": "short for [auth] mode = this"}
    schema["properties"]["auth"] = {"anyOf": [mode, auth]}
    schema["properties"]["policy"] = policy_schema()
    return schema

