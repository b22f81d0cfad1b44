"""The sections of run.toml, one typed dataclass each (``[compression]`` is modeling's own
``CompressionConfig``). Each checks its own values when built; checks that need two sections
(tiers against the model, ...) live in ``server.config.RunConfig.validate``.

See ``examples/run.toml`` for every key, its default and what it does.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from modeling.checkpoint.files import CONFIG_NAME
from modeling.checkpoint.hf_config import from_config_dict
from modeling.checkpoint.pretrained import read_config
from modeling.checkpoint.remote_code import consented
from modeling.compression import UPDATE_RULES, CompressionConfig, UpdateConfig, universal_shapes
from modeling.config import ModelConfig
from modeling.errors import MatformerError
from modeling.mdat import DEFAULT_STRATEGY
from modeling.optim import SCHEDULES, OptimizerConfig, constant_after_warmup, lr_factor
from modeling.tracking import TRACKERS
from protocol.channel import MAX_MESSAGE_BYTES
from server.call_slots import CallLimits
from server.errors import (
    ConflictingKeys,
    InvalidValue,
    MissingFile,
    MissingKey,
    MissingSecret,
)
from server.tables import INT64, reject_unknown
from server.tiers import TierPolicy
from server.update_steps import Momentum

_RUN_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
# Fractions of a target mix may be written to a few digits: 0.33 + 0.33 + 0.34.
_MIX_TOLERANCE = 1e-6
# Ranges of run.toml's numbers beyond "positive" (server.tables bounds every number further:
# floats finite, integers 64-bit). Each keeps a value that would crash or wreck the run out.
MAX_DIMENSION = 2**24  # vocab_size, hidden_size, intermediate_size, max_position_embeddings
MAX_LAYERS = 1024  # the coordinator builds the model (on the meta device) to read its shapes
MAX_TIER = MAX_DIMENSION.bit_length() - 1  # a tier halves the FFN width: 24 halvings at most
MAX_SECONDS = 30 * 24 * 3600.0  # deadlines, heartbeats and session lifetimes
MIN_DEADLINE_S = 1.0  # no round is ever trained and submitted in less
MIN_HEARTBEAT_S = 0.1  # more often, every member's heartbeats become a busy loop of calls
MAX_LR = 10.0  # a step of 10·sign(aggregate) already wipes out any trained weight
MIB = 1024 * 1024
# Broadcast coefficients per 64 × 64 chunk: with DeMo's 32 per chunk sent up, a tier-0
# client moves about 1/128 of dense float32 both ways (bench/scale.py)
DEFAULT_BROADCAST_TOPK = 48
MAX_MESSAGE_MB = MAX_MESSAGE_BYTES / MIB  # no client sends a larger message (protocol.channel)
MAX_SUBMISSION_MB = 1024.0 * 1024  # 1 TiB: a dense float32 submission of 270 G parameters
UINT32_MAX = 2**32 - 1  # chunk and topk travel to clients as uint32 (TrainingSettings)
DEFAULT_PEER_CLIP = 2.0  # [faults] peer_clip: a member weighs at most twice a typical one


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise InvalidValue(message)


def _within(where: str, value: float, low: float, high: float, *, above: bool = False,
            unit: str = "") -> None:
    """InvalidValue unless ``low <= value <= high`` (``low < value`` when ``above``)."""
    ok = (low < value if above else low <= value) and value <= high
    _require(ok, f"{where} must lie in {'(' if above else '['}{low}, {high}]{unit}, got {value}.")


@dataclass(kw_only=True, slots=True)
class RunSection:
    id: str  # names the run in Join requests, logs and the dashboard
    dir: Path  # run directory: state.json, checkpoints/, updates/ (created on start)

    def __post_init__(self) -> None:
        _require(bool(_RUN_ID.fullmatch(self.id)),
                 f"[run] id {self.id!r} must be letters, digits, '.', '_' or '-', starting "
                 "with a letter or digit; rename it.")


@dataclass(kw_only=True, slots=True)
class ServerSection:
    host: str = "127.0.0.1"  # address both servers bind; "0.0.0.0" to accept other machines
    grpc_port: int = 7070  # coordinator service (clients)
    http_port: int = 7071  # status, dashboard, metrics, checkpoint files

    def __post_init__(self) -> None:
        _require(bool(self.host), "[server] host is empty; give an address such as 127.0.0.1.")
        for key in ("grpc_port", "http_port"):
            port = getattr(self, key)
            _require(1 <= port <= 65535, f"[server] {key} must lie in 1..65535, got {port}.")
        _require(self.grpc_port != self.http_port,
                 f"[server] grpc_port and http_port are both {self.grpc_port}; give each its own "
                 "port.")


@dataclass(kw_only=True, slots=True)
class ModelSection:
    """Where the model comes from: exactly one of the three keys."""

    inline: dict[str, Any] | None = None  # ModelConfig fields, as in config.json
    config_path: Path | None = None  # a config.json (Matformer's or a Hugging Face Llama one)
    checkpoint: Path | None = None  # a universal checkpoint folder: its weights start the run
    # run the module files the checkpoint carries (read them first); without it the model
    # must be built of registered components. Clients decide for themselves.
    trust_remote_code: bool = False

    def __post_init__(self) -> None:
        given = [k for k in ("inline", "config_path", "checkpoint") if getattr(self, k) is not None]
        if not given:
            raise MissingKey("[model] needs one of: a [model.inline] table of model config "
                             "fields, config_path (a config.json) or checkpoint (a folder).")
        if len(given) > 1:
            raise ConflictingKeys(f"[model] gives {' and '.join(given)}; keep exactly one.")
        if self.inline is not None:
            reject_unknown("[model.inline]", self.inline, list(ModelConfig.__dataclass_fields__))
        _check_size(self.build())

    def build(self) -> ModelConfig:
        """The run's (universal) model config."""
        if self.inline is not None:
            where = "[model.inline]"
            config = _model(where, lambda: ModelConfig.from_dict(self.inline))
        else:
            path = self.config_path if self.config_path is not None else (
                self.checkpoint / CONFIG_NAME)
            where = f"[model] {path}"
            if not path.is_file():
                raise MissingFile(f"{where} does not exist; fix the path in [model].")
            if self.checkpoint is None:
                config = _model(where, lambda: from_config_dict(json.loads(path.read_text())))
            else:  # its module files are the checkpoint's, found and allowed as for any load
                config = _model(where, lambda: consented(
                    read_config(self.checkpoint), self.trust_remote_code, self.checkpoint))
        _require(config.matformer_tier == 0 and config.matformer_layer_tiers is None,
                 f"{where} describes a tier {config.matformer_tier} slice; a run trains the "
                 "universal (tier 0) model, so point [model] at the universal config.")
        return config


def _check_size(config: ModelConfig) -> None:
    """A model the coordinator can build and hold: sizes within MAX_DIMENSION and MAX_LAYERS,
    finite numbers, and a float32 master that fits in this machine's memory."""
    for key in ("vocab_size", "hidden_size", "intermediate_size", "max_position_embeddings"):
        _within(f"[model] {key}", getattr(config, key), 1, MAX_DIMENSION)
    _within("[model] num_hidden_layers", config.num_hidden_layers, 1, MAX_LAYERS)
    nonfinite = _first_nonfinite(config.to_dict())
    _require(nonfinite is None, f"[model] {nonfinite} is not a finite number; give a finite one.")
    parameters = sum(math.prod(shape) for shape in universal_shapes(config).values())
    master, memory = 4 * parameters, os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    _require(master <= memory,
             f"[model] has {parameters:,} parameters, whose float32 master alone takes "
             f"{master / 2**30:,.1f} GiB, more than this machine's {memory / 2**30:,.1f} GiB of "
             "memory; choose a smaller model.")


def _first_nonfinite(value: Any, where: str = "") -> str | None:
    """``key.key = value`` for the first infinite or NaN float in plain data, if any."""
    if isinstance(value, float):
        return None if math.isfinite(value) else f"{where} = {value}"
    children = (value.items() if isinstance(value, dict)
                else enumerate(value) if isinstance(value, list | tuple) else ())
    found = (_first_nonfinite(child, f"{where}.{key}" if where else str(key))
             for key, child in children)
    return next((f for f in found if f is not None), None)


def _model(where: str, make: Callable[[], ModelConfig]) -> ModelConfig:
    try:
        return make()
    except json.JSONDecodeError as err:
        raise InvalidValue(f"{where} is not valid JSON: {err}.") from err
    except MatformerError as err:
        raise InvalidValue(f"{where}: {err}") from err


@dataclass(kw_only=True, slots=True)
class DataSection:
    path: Path  # the MDAT container
    strategy: str = DEFAULT_STRATEGY["strategy_name"]  # its pretokenization strategy
    view: str | None = None  # a view of the container; None: all of it
    max_seq_len: int = 256  # tokens per sequence (a multiple of the strategy's chunk size)
    seed: int = 0  # seed of the shuffle that orders sequences over rounds

    def __post_init__(self) -> None:
        _require(self.max_seq_len >= 1,
                 f"[data] max_seq_len must be a positive integer, got {self.max_seq_len}.")
        _within("[data] seed", self.seed, 0, INT64[1])  # numpy's shuffle needs seed >= 0


@dataclass(kw_only=True, slots=True)
class TiersSection:
    allowed: list[int] = field(default_factory=lambda: [0, 1, 2])  # tiers clients may get
    pins: dict[str, int] = field(default_factory=dict)  # client name → tier, always
    mix: dict[int, float] = field(default_factory=dict)  # tier → target share of members

    def __post_init__(self) -> None:
        _require(bool(self.allowed), "[tiers] allowed is empty; list at least one tier.")
        _require(all(0 <= t <= MAX_TIER for t in self.allowed)
                 and len(set(self.allowed)) == len(self.allowed),
                 f"[tiers] allowed must list distinct tiers in [0, {MAX_TIER}], got "
                 f"{self.allowed}.")
        for name, tier in self.pins.items():
            _require(tier in self.allowed,
                     f"[tiers.pins] pins {name!r} to tier {tier}, which is not in allowed "
                     f"{self.allowed}; add it there or pin another tier.")
        if self.mix:
            for tier, share in self.mix.items():
                _require(tier in self.allowed,
                         f"[tiers.mix] names tier {tier}, which is not in allowed {self.allowed}.")
                _require(0.0 <= share <= 1.0,
                         f"[tiers.mix] share of tier {tier} must lie in [0, 1], got {share}.")
            total = sum(self.mix.values())
            _require(abs(total - 1.0) <= _MIX_TOLERANCE,
                     f"[tiers.mix] shares sum to {total:g}; make them sum to 1.")

    def build(self, model: ModelConfig) -> TierPolicy:
        return TierPolicy(model, allowed=self.allowed, pins=self.pins, mix=self.mix)


@dataclass(kw_only=True, slots=True)
class RoundSection:
    """When rounds start and end, and when the run stops: after ``rounds`` rounds or ``tokens``
    tokens, whichever comes first (at least one of the two)."""

    min_clients: int = 1  # members needed before a round opens
    deadline_s: float = 60.0  # a client that has not submitted by then is dropped from the round
    tokens_per_round: int = 8192  # the round's token budget, shared by speed among clients
    rounds: int | None = None
    tokens: int | None = None

    def __post_init__(self) -> None:
        _require(self.min_clients >= 1,
                 f"[round] min_clients must be >= 1, got {self.min_clients}.")
        _within("[round] deadline_s", self.deadline_s, MIN_DEADLINE_S, MAX_SECONDS,
                unit=" seconds")
        _require(self.tokens_per_round >= 1,
                 f"[round] tokens_per_round must be >= 1, got {self.tokens_per_round}.")
        if self.rounds is None and self.tokens is None:
            raise MissingKey("[round] needs a stop: rounds, tokens, or both (whichever comes "
                             "first).")
        for key in ("rounds", "tokens"):
            value = getattr(self, key)
            _require(value is None or value >= 1, f"[round] {key} must be >= 1, got {value}.")

    @property
    def planned_rounds(self) -> int:
        """Rounds until the stop, counting every round as a full ``tokens_per_round``; the
        learning-rate schedule ends here."""
        by_tokens = math.inf if self.tokens is None else -(-self.tokens // self.tokens_per_round)
        return int(min(self.rounds or math.inf, by_tokens))


@dataclass(kw_only=True, slots=True)
class UpdateSection:
    """How the coordinator and every client apply the aggregate (docs/architecture.md, "The
    update record"), with a per-round learning-rate schedule (modeling.optim.lr_factor,
    counted in rounds)."""

    rule: str = "sign"  # sign (DeMo) | sgd
    lr: float = 1e-3  # peak learning rate, reached at the end of warmup
    weight_decay: float = 0.0  # decoupled, on covered elements
    # rule = "sgd": momentum of the step, torch.optim.SGD's (buf ← μ·buf + aggregate), kept
    # by the coordinator; nesterov: step along aggregate + μ·buf. With [inner] local steps
    # and no [update] rule given, DiLoCo's outer optimizer: sgd, lr 0.7 (constant), momentum
    # 0.9, nesterov.
    momentum: float = 0.0
    nesterov: bool = False
    warmup_rounds: int = 0  # linear warmup from lr / warmup_rounds to lr
    schedule: str = "cosine"  # cosine | linear | constant, after warmup
    final_lr: float = 0.0  # learning rate at the last planned round (cosine, linear)
    # mean: results weighted by their tokens | majority (rule = "sign"): one sign vote per
    # result, so no member outweighs another whatever its share or magnitude
    vote: str = "mean"
    # What clients download: the top broadcast_topk DCT coefficients per [compression] chunk
    # of the aggregate, as int8 levels that every replica decodes to the same bits, with the
    # rest carried to the next round (0: the exact aggregate, 1 byte per element or 4 under
    # sgd). Default: 48 when clients send top-k or DCT results, 0 for dense ones.
    broadcast_topk: int | None = None

    def __post_init__(self) -> None:
        _require(self.rule in UPDATE_RULES,
                 f"[update] rule {self.rule!r} is unknown; choose one of "
                 f"{', '.join(UPDATE_RULES)}.")
        _require(self.vote in VOTES,
                 f"[update] vote {self.vote!r} is unknown; choose one of {', '.join(VOTES)}.")
        _require(self.vote == "mean" or self.rule == "sign",
                 f"[update] vote = \"majority\" counts signs, so it needs rule = \"sign\", not "
                 f"{self.rule!r}.")
        _require(self.schedule in SCHEDULES,
                 f"[update] schedule {self.schedule!r} is unknown; choose one of "
                 f"{', '.join(SCHEDULES)}.")
        _within("[update] lr", self.lr, 0, MAX_LR, above=True)
        _require(0 <= self.final_lr <= self.lr,
                 f"[update] final_lr must lie in [0, lr={self.lr}], got {self.final_lr}.")
        _require(0 <= self.weight_decay <= 1 / self.lr,
                 f"[update] weight_decay must lie in [0, 1 / lr] = [0, {1 / self.lr:g}], got "
                 f"{self.weight_decay}: beyond 1 / lr the decay w ← w·(1 − lr·wd) flips the sign "
                 "of the weights.")
        _require(0 <= self.momentum < 1,
                 f"[update] momentum must lie in [0, 1), got {self.momentum}.")
        _require(self.momentum == 0 or self.rule == "sgd",
                 f"[update] momentum needs rule = \"sgd\" (the sign rule reads only the "
                 f"aggregate's signs), not {self.rule!r}.")
        _require(not self.nesterov or self.momentum > 0,
                 "[update] nesterov needs a momentum > 0.")
        _require(self.warmup_rounds >= 0,
                 f"[update] warmup_rounds must be >= 0, got {self.warmup_rounds}.")
        if self.broadcast_topk is not None:
            _within("[update] broadcast_topk", self.broadcast_topk, 0, UINT32_MAX)

    def broadcast(self, compression: CompressionConfig) -> int:
        """Coefficients per chunk in the broadcast (0: exact), the default resolved."""
        if self.broadcast_topk is not None:
            return self.broadcast_topk
        return 0 if compression.encoding == "dense" else DEFAULT_BROADCAST_TOPK

    def momentum_of(self) -> Momentum | None:
        """The outer step's momentum, None without one."""
        return Momentum(self.momentum, self.nesterov) if self.momentum else None

    def lr_at(self, round_index: int, planned_rounds: int) -> float:
        """Learning rate of round ``round_index`` (0-based)."""
        return self.lr * lr_factor(round_index, warmup_steps=self.warmup_rounds,
                                   total_steps=planned_rounds, schedule=self.schedule,
                                   min_ratio=self.final_lr / self.lr)

    def build(self, round_index: int, planned_rounds: int,
              compression: CompressionConfig) -> UpdateConfig:
        """The update rule's config for one round of a run compressing with
        ``compression``."""
        return UpdateConfig(rule=self.rule, lr=self.lr_at(round_index, planned_rounds),
                            weight_decay=self.weight_decay,
                            broadcast_topk=self.broadcast(compression), chunk=compression.chunk)


# [update] when [inner] enables local steps and gives no rule: DiLoCo's outer optimizer
OUTER_DEFAULTS = {"rule": "sgd", "lr": 0.7, "momentum": 0.9, "nesterov": True,
                  "schedule": "constant"}


@dataclass(kw_only=True, slots=True)
class InnerSection:
    """Local steps (docs/architecture.md, "Local steps"): with ``batch_tokens`` > 0 each
    client trains its assigned sequences as token-budget batches of that many tokens, one
    step of this optimizer each, and submits its pseudo-gradient, the change of its tier's
    weights over the round. 0: one gradient per round, the coordinator's step alone."""

    batch_tokens: int = 0  # tokens per inner step (padded, as matformer-train's budget)
    optimizer: str = "adamw"  # adamw | adam | muon
    lr: float = 1e-3  # the inner optimizer's peak learning rate
    weight_decay: float = 0.1  # on matrices (ndim >= 2), as matformer-train applies it
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    warmup_steps: int = 0  # linear warmup over each client's own steps, counted across rounds
    # after warmup: cosine | linear from lr at round 0 to final_lr at the last planned round
    # ([round] rounds or tokens), the run's clock, the same for every client; or constant
    schedule: str = "constant"
    final_lr: float | None = None  # None: lr / 10, as matformer-train decays

    def __post_init__(self) -> None:
        _within("[inner] batch_tokens", self.batch_tokens, 0, UINT32_MAX)
        _within("[inner] warmup_steps", self.warmup_steps, 0, UINT32_MAX)
        _require(self.schedule in SCHEDULES,
                 f"[inner] schedule {self.schedule!r} is unknown; choose one of "
                 f"{', '.join(SCHEDULES)}.")
        try:
            self.build()
        except MatformerError as err:
            raise InvalidValue(f"[inner] {err}") from err
        _require(0 <= self.final_lr_value <= self.lr,
                 f"[inner] final_lr must lie in [0, lr={self.lr}], got {self.final_lr}.")

    @property
    def enabled(self) -> bool:
        return self.batch_tokens > 0

    @property
    def final_lr_value(self) -> float:
        return self.lr / 10 if self.final_lr is None else self.final_lr

    def build(self) -> OptimizerConfig:
        """The inner optimizer's config, as every client builds it."""
        return constant_after_warmup(self.optimizer, lr=self.lr, weight_decay=self.weight_decay,
                                     betas=tuple(self.betas), eps=self.eps,
                                     warmup_steps=self.warmup_steps)


@dataclass(kw_only=True, slots=True)
class CheckpointSection:
    every_rounds: int = 10  # universal + tier slices + manifest after every this many rounds
    # the newest checkpoints kept; older ones are removed once a newer one is complete. At
    # least 2: the update log starts at the one before the latest.
    keep_last: int = 3
    keep_first: bool = True  # also keep the run's first checkpoint (its starting weights)

    def __post_init__(self) -> None:
        _require(self.every_rounds >= 1,
                 f"[checkpoint] every_rounds must be >= 1, got {self.every_rounds}.")
        _within("[checkpoint] keep_last", self.keep_last, 2, 1_000_000)


@dataclass(kw_only=True, slots=True)
class TrackingSection:
    """Where the coordinator's per-round figures go besides state.json."""

    # tensorboard: event files in the run directory's tensorboard/ | trackio | wandb | none
    kind: str = "tensorboard"
    project: str = "matformer"  # trackio's and wandb's project name

    def __post_init__(self) -> None:
        _require(self.kind in TRACKERS,
                 f"[tracking] kind {self.kind!r} is not one of {', '.join(TRACKERS)}.")
        _require(self.kind == "none" or importlib.util.find_spec(self.kind) is not None,
                 f"[tracking] kind {self.kind!r} needs the {self.kind} package (pip install "
                 f"{self.kind}); or kind = \"none\".")


VOTES = ("mean", "majority")
AUTH_MODES = ("token", "keys", "none")


@dataclass(kw_only=True, slots=True)
class AuthSection:
    """Who may join and who may change the run. Each token is written here or (better) read
    from an environment variable. ``mode = "keys"`` admits only holders of a client key the
    operator issued (``matformer-server keys add NAME``; server/keys.py), each under its key's
    name. ``mode = "none"`` admits any client without a join token, and the server then
    listens on loopback only, whatever [server] host says."""

    # token: Join needs the join token | keys: a client key | none: nothing, loopback only
    mode: str = "token"
    join_token: str | None = field(default=None, repr=False, metadata={"secret": True})
    join_token_env: str | None = None  # name of the environment variable holding the token
    # The operator token unlocks the HTTP side's writes (POST ...); without one it is read-only.
    operator_token: str | None = field(default=None, repr=False, metadata={"secret": True})
    operator_token_env: str | None = None
    keys_file: Path | None = None  # mode = "keys": the client keys; None: keys.json in [run] dir

    def __post_init__(self) -> None:
        _require(self.mode in AUTH_MODES,
                 f"[auth] mode {self.mode!r} is unknown; choose \"token\" (clients present the "
                 "join token), \"keys\" (clients present keys issued with `matformer-server "
                 "keys add NAME`) or \"none\" (no join token; the server listens on loopback "
                 "only).")
        for key in ("join_token", "operator_token"):
            if getattr(self, key) is not None and getattr(self, f"{key}_env") is not None:
                raise ConflictingKeys(f"[auth] gives both {key} and {key}_env; keep one.")
            _require(getattr(self, key) != "", f"[auth] {key} is empty; set a token.")
        join_keys = [k for k in ("join_token", "join_token_env") if getattr(self, k) is not None]
        if self.mode != "token" and join_keys:
            raise ConflictingKeys(f"[auth] mode = \"{self.mode}\" admits clients without the "
                                  f"join token, but {join_keys[0]} is given; remove it, or set "
                                  "mode = \"token\" to require the token.")
        if self.mode != "keys" and self.keys_file is not None:
            raise ConflictingKeys(f"[auth] keys_file is given but mode = \"{self.mode}\" does "
                                  "not read it; set mode = \"keys\" or remove keys_file.")
        if self.mode == "token" and not join_keys:
            raise MissingKey("[auth] needs join_token_env (the name of an environment variable "
                             "holding the join token) or join_token; "
                             "python -c 'from protocol.auth import new_join_token as t; "
                             "print(t())' makes one. (mode = \"none\" runs without one, on "
                             "loopback only.)")
        if self.mode == "token":
            self.token()
        self.operator()

    def token(self) -> str:
        """The join token, read from the environment now when ``join_token_env`` names it."""
        if self.mode != "token":  # callers check the mode first; never compare against nothing
            raise InvalidValue(f"[auth] mode = \"{self.mode}\" has no join token.")
        return self._secret("join_token")

    def operator(self) -> str | None:
        """The operator token (read from the environment now when ``operator_token_env`` names
        it), or None when the run has none and its HTTP side is read-only."""
        return self._secret("operator_token")

    def _secret(self, key: str) -> str | None:
        env = getattr(self, f"{key}_env")
        if env is None:
            return getattr(self, key)
        token = os.environ.get(env, "")
        if not token:
            raise MissingSecret(f"[auth] {key}_env names ${env}, which is unset or empty; "
                                "export it before starting the server.")
        return token


@dataclass(kw_only=True, slots=True)
class TlsSection:
    """TLS for the gRPC and HTTP servers (one certificate for both): both files or neither
    (then plaintext, for loopback runs)."""

    cert: Path | None = None  # PEM certificate chain
    key: Path | None = None  # PEM private key

    def __post_init__(self) -> None:
        if (self.cert is None) != (self.key is None):
            given, absent = ("cert", "key") if self.key is None else ("key", "cert")
            raise MissingKey(f"[tls] gives {given} but not {absent}; give both or neither.")
        for key in ("cert", "key"):
            path = getattr(self, key)
            if path is not None and not path.is_file():
                raise MissingFile(f"[tls] {key} {path} does not exist; fix the path.")

    @property
    def enabled(self) -> bool:
        return self.cert is not None


NORM_ACTIONS = ("clip", "reject")


@dataclass(kw_only=True, slots=True)
class FaultsSection:
    """How the coordinator treats clients that die, hang, lag or misbehave (docs/architecture.md,
    "Members that fail or misbehave").

    A member silent for ``heartbeat_timeout_s`` is dropped from the open round (its sequences
    go back to the queue) and counts as inactive until it calls again; silent for
    ``session_ttl_s``, it is removed and its session expires. Each round it misses halves the
    speed its share is sized by; ``miss_limit`` misses in a row move it to the next smaller
    allowed tier. Finishing within ``early_fraction`` of the deadline ``early_rounds`` times in
    a row offers it the next larger tier its memory and request allow. A submission that
    breaks a limit is refused and counted; ``max_rejections`` refusals exclude the client.
    """

    heartbeat_s: float = 5.0  # how often clients heartbeat, also while training
    heartbeat_timeout_s: float = 30.0  # silence after which a member counts as gone
    session_ttl_s: float = 3600.0  # silence after which a member is removed (rejoin needed)
    miss_limit: int = 2  # consecutive missed rounds before a smaller tier; 0: never
    early_fraction: float = 0.25  # "early": submitted within this fraction of the deadline
    early_rounds: int = 5  # consecutive early rounds before a larger tier is offered; 0: never
    max_rejections: int = 3  # refused submissions before the client is excluded; 0: never
    max_norm: float | None = None  # L2 bound on one submission's values; None: unbounded
    norm_action: str = "reject"  # clip | reject, for a submission over max_norm
    # each result's RMS scaled down to at most this × the round's lower median for that
    # parameter, so no member steers an element by magnitude alone; 0: off. On by default:
    # it costs an honest run less than its seed-to-seed spread (bench/README.md)
    peer_clip: float = DEFAULT_PEER_CLIP
    max_submission_mb: float = 64.0  # one SubmitResult stream, all messages together
    max_message_mb: float = 64.0  # any single gRPC message the server receives
    # What one member's calls may hold of the server (server/call_slots.py); an honest
    # client makes 2 calls at once (a heartbeat beside its main call), 1 a stream.
    max_calls_per_member: int = 4
    max_streams_per_member: int = 2
    # streams shared by all members; each member with work in the open round has one more
    max_streams: int = 16
    # a stream waiting on its peer this much longer than its message needs at 8 Mbit/s is ended
    stream_idle_s: float = 10.0
    request_idle_s: float = 10.0  # a call whose request has not arrived in this long is ended
    max_members: int = 512  # members at once (silent ones count until session_ttl_s)
    max_joins_per_minute: int = 60  # admissions; a burst of this many, then one per 60/N s

    def __post_init__(self) -> None:
        _within("[faults] heartbeat_s", self.heartbeat_s, MIN_HEARTBEAT_S, MAX_SECONDS,
                unit=" seconds")
        for key in ("heartbeat_timeout_s", "session_ttl_s"):
            _within(f"[faults] {key}", getattr(self, key), 0, MAX_SECONDS, above=True,
                    unit=" seconds")
        _within("[faults] max_submission_mb", self.max_submission_mb, 1, MAX_SUBMISSION_MB,
                unit=" MiB")
        _within("[faults] max_message_mb", self.max_message_mb, 1, MAX_MESSAGE_MB, unit=" MiB")
        _require(self.heartbeat_timeout_s >= 2 * self.heartbeat_s,
                 f"[faults] heartbeat_timeout_s {self.heartbeat_timeout_s} must be at least twice "
                 f"heartbeat_s {self.heartbeat_s}, or one late heartbeat drops a healthy client.")
        _require(self.session_ttl_s >= self.heartbeat_timeout_s,
                 f"[faults] session_ttl_s {self.session_ttl_s} must be >= heartbeat_timeout_s "
                 f"{self.heartbeat_timeout_s}.")
        for key in ("miss_limit", "early_rounds", "max_rejections"):
            value = getattr(self, key)
            _require(value >= 0, f"[faults] {key} must be >= 0 (0 turns it off), got {value}.")
        _require(0 < self.early_fraction < 1,
                 f"[faults] early_fraction must lie in (0, 1), got {self.early_fraction}.")
        _require(self.max_norm is None or (self.max_norm > 0 and math.isfinite(self.max_norm)),
                 f"[faults] max_norm must be a positive number, got {self.max_norm}.")
        _require(1 <= self.max_streams_per_member <= self.max_calls_per_member <= 64,
                 f"[faults] needs 1 <= max_streams_per_member ({self.max_streams_per_member}) "
                 f"<= max_calls_per_member ({self.max_calls_per_member}) <= 64.")
        _within("[faults] max_streams", self.max_streams, 1, 1024)
        _within("[faults] max_members", self.max_members, 1, 100_000)
        _within("[faults] max_joins_per_minute", self.max_joins_per_minute, 1, 100_000)
        for key in ("stream_idle_s", "request_idle_s"):
            _within(f"[faults] {key}", getattr(self, key), 0, MAX_SECONDS, above=True,
                    unit=" seconds")
        _require(self.peer_clip == 0 or 1 <= self.peer_clip <= 100,
                 f"[faults] peer_clip must be 0 (off) or lie in 1..100, got {self.peer_clip}.")
        _require(self.norm_action in NORM_ACTIONS,
                 f"[faults] norm_action {self.norm_action!r} is unknown; choose one of "
                 f"{', '.join(NORM_ACTIONS)}.")

    def call_limits(self) -> CallLimits:
        return CallLimits(per_member=self.max_calls_per_member,
                          streams_per_member=self.max_streams_per_member,
                          streams=self.max_streams, idle_s=self.stream_idle_s,
                          request_s=self.request_idle_s, members=self.max_members,
                          message_bytes=self.max_message_bytes)

    @property
    def max_submission_bytes(self) -> int:
        return int(self.max_submission_mb * MIB)

    @property
    def max_message_bytes(self) -> int:
        return int(self.max_message_mb * MIB)


def check_compression(compression: CompressionConfig) -> None:
    """What [compression] (modeling's CompressionConfig, which checks its own lower bounds)
    must keep for a run: an lr that scales gradients no more than [update] lr may, a chunk
    within the uint32 field that carries it to clients, and (for chunked encodings) no more
    values per chunk than a chunk of the run's matrices holds."""
    _within("[compression] lr", compression.lr, 0, MAX_LR, above=True)
    _within("[compression] chunk", compression.chunk, 1, UINT32_MAX)
    if compression.encoding != "dense":
        _within("[compression] topk", compression.topk, 1,
                min(compression.chunk ** 2, UINT32_MAX), unit=f" (chunk {compression.chunk}²)")
