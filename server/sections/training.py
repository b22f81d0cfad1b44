"""[round], [update] and [inner]: when rounds open and close, how members train their share,
and how the results become each round's step. [compression] is modeling's own
``CompressionConfig``."""

from __future__ import annotations

import math
from dataclasses import dataclass

from matformer.modeling.compression import UPDATE_RULES, CompressionConfig, UpdateConfig
from matformer.modeling.compression.compressor import MAX_LR, UINT32_MAX
from matformer.modeling.compression.steps import LEVEL_BITS
from matformer.modeling.errors import MatformerError
from matformer.modeling.optim import (
    OPTIMIZER_NAMES,
    SCHEDULES,
    OptimizerConfig,
    constant_after_warmup,
    lr_factor,
)
from matformer.modeling.settings import setting
from matformer.server.errors import InvalidValue, MissingKey
from matformer.server.sections.checks import MAX_COUNT, MAX_SECONDS, MAX_TOKENS, SECONDS, require
from matformer.server.update_steps import Momentum

MIN_DEADLINE_S = 1.0  # no round is ever trained and submitted in less
# Broadcast coefficients per 64 × 64 chunk: with DeMo's 32 per chunk sent up, a tier-0
# client moves about 1/128 of dense float32 both ways (bench/scale.py)
DEFAULT_BROADCAST_TOPK = 48
VOTES = ("mean", "majority")


@dataclass(kw_only=True, slots=True)
class RoundSection:
    """When rounds start and end, and when the run stops: after ``rounds`` rounds or ``tokens``
    tokens, whichever comes first (at least one of the two)."""

    min_clients: int = setting(1, low=1, high=MAX_COUNT, help=(
        "members ready to train (their speed measured) before a round opens"))
    deadline_s: float = setting(60.0, low=MIN_DEADLINE_S, high=MAX_SECONDS, unit=SECONDS,
                                help="a client that has not submitted by then leaves the round")
    tokens_per_round: int = setting(8192, low=1, high=2**40, help=(
        "the round's token budget, shared among clients by their measured speed"))
    rounds: int | None = setting(None, low=1, high=MAX_COUNT,
                                 help="stop after this many rounds ...")
    tokens: int | None = setting(None, low=1, high=MAX_TOKENS,
                                 help="... or this many tokens, whichever first")
    # Members train round r+1 on the weights they hold and apply round r's update as soon
    # as it arrives (docs/architecture.md, "Overlapped rounds"). On by default: members
    # compute about twice as much of their time as in synchronous rounds, at the same
    # held-out loss (bench/README.md, "Overlapped rounds, measured").
    overlap: bool = setting(True, help=(
        "hand out round r+1's work before round r closes (false: synchronous rounds)"))
    # A result that misses its round's deadline is folded into a later round instead of its
    # sequences being trained again (docs/architecture.md, "Late results").
    late_rounds: int = setting(0, low=0, high=MAX_COUNT, help=(
        "rounds after its own a late result may still be folded into (0: a late result is "
        "refused and its sequences are trained again)"))
    late_weight: float = setting(1.0, low=0, above=True, high=1.0, help=(
        "a late result's weight in the aggregate, per round late, as a share of its tokens"))

    def __post_init__(self) -> None:
        if self.rounds is None and self.tokens is None:
            raise MissingKey("[round] needs a stop: rounds, tokens, or both (whichever comes "
                             "first).")

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
    counted in rounds). With [inner] local steps and no rule given, the keys left out take
    DiLoCo's outer optimizer: sgd, lr 0.7 (constant), momentum 0.9, nesterov."""

    rule: str = setting("sign", choices=UPDATE_RULES, help=(
        "sign (DeMo: w ← w − lr·sign(agg)) | sgd (w ← w − lr·agg)"))
    lr: float = setting(1e-3, low=0, above=True, high=MAX_LR, help=(
        "peak learning rate, reached at the end of warmup"))
    weight_decay: float = setting(0.0, low=0, help=(
        "decoupled, w ← w·(1 − lr·wd) on covered elements; at most 1 / lr"))
    momentum: float = setting(0.0, low=0, help=(
        "rule sgd: buf ← μ·buf + agg (torch.optim.SGD's), kept by the coordinator; below 1"))
    nesterov: bool = setting(False, help="step along agg + μ·buf (needs momentum > 0)")
    warmup_rounds: int = setting(0, low=0, high=MAX_COUNT,
                                 help="linear warmup from lr / warmup_rounds to lr")
    schedule: str = setting("cosine", choices=SCHEDULES, help="the decay after warmup")
    final_lr: float = setting(0.0, low=0, help=(
        "learning rate at the last planned round (cosine, linear); at most lr"))
    vote: str = setting("mean", choices=VOTES, help=(
        "mean: results weighted by their tokens | majority (rule sign): one sign vote per "
        "result, so no member outweighs another"))
    # The top-k coefficients of each [compression] chunk of the aggregate go as int8 levels
    # that every replica decodes to the same bits; the rest is carried to the next round.
    # 0 sends the exact aggregate, 1 byte per element (4 under sgd).
    broadcast_topk: int | None = setting(None, low=0, high=UINT32_MAX, help=(
        "DCT coefficients per chunk clients download; 0: the exact aggregate; unset: "
        f"{DEFAULT_BROADCAST_TOPK}, or 0 for dense results"))
    broadcast_bits: int = setting(8, low=min(LEVEL_BITS), high=max(LEVEL_BITS), help=(
        "bits of each broadcast coefficient's level: 8 (int8), 4 (±7) or 2 (-1, 0, 1), with "
        "a float32 scale per chunk; what a level rounds away is carried to the next round"))

    def __post_init__(self) -> None:
        require(self.vote == "mean" or self.rule == "sign",
                f"[update] vote = \"majority\" counts signs, so it needs rule = \"sign\", not "
                f"{self.rule!r}.")
        require(self.final_lr <= self.lr,
                f"[update] final_lr must lie in [0, lr={self.lr}], got {self.final_lr}.")
        require(self.weight_decay <= 1 / self.lr,
                f"[update] weight_decay must lie in [0, 1 / lr] = [0, {1 / self.lr:g}], got "
                f"{self.weight_decay}: beyond 1 / lr the decay w ← w·(1 − lr·wd) flips the sign "
                "of the weights.")
        require(self.momentum < 1, f"[update] momentum must lie in [0, 1), got {self.momentum}.")
        require(self.momentum == 0 or self.rule == "sgd",
                f"[update] momentum needs rule = \"sgd\" (the sign rule reads only the "
                f"aggregate's signs), not {self.rule!r}.")
        require(not self.nesterov or self.momentum > 0,
                "[update] nesterov needs a momentum > 0.")
        require(self.broadcast_bits in LEVEL_BITS,
                f"[update] broadcast_bits must be one of {', '.join(map(str, LEVEL_BITS))}, got "
                f"{self.broadcast_bits}.")

    def broadcast(self, compression: CompressionConfig) -> int:
        """Coefficients per chunk in the broadcast (0: exact), the default resolved."""
        if self.broadcast_topk is not None:
            return self.broadcast_topk
        return 0 if compression.encoding == "dense" else DEFAULT_BROADCAST_TOPK

    def carries_state(self, compression: CompressionConfig) -> bool:
        """Whether the outer step carries state from round to round (the broadcast's
        residual, the momentum buffer), which a resume rebuilds (server/outer_state.py)."""
        return bool(self.momentum) or bool(self.broadcast(compression))

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
                            broadcast_topk=self.broadcast(compression), chunk=compression.chunk,
                            broadcast_bits=self.broadcast_bits)


# [update] when [inner] enables local steps and gives no rule: DiLoCo's outer optimizer
OUTER_DEFAULTS = {"rule": "sgd", "lr": 0.7, "momentum": 0.9, "nesterov": True,
                  "schedule": "constant"}


@dataclass(kw_only=True, slots=True)
class InnerSection:
    """Local steps (docs/architecture.md, "Local steps"): with ``batch_tokens`` > 0 each
    client trains its assigned sequences as token-budget batches of that many tokens, one
    step of this optimizer each, and submits its pseudo-gradient, the change of its tier's
    weights over the round. 0: one gradient per round, the coordinator's step alone."""

    batch_tokens: int = setting(0, low=0, high=UINT32_MAX, help=(
        "> 0: local steps, batches of this many tokens (padded); 0: one gradient per round"))
    optimizer: str = setting("adamw", choices=OPTIMIZER_NAMES, help="the inner optimizer")
    lr: float = setting(1e-3, low=0, above=True, help="its peak learning rate, after warmup")
    weight_decay: float = setting(0.1, low=0, help=(
        "on matrices (ndim >= 2), as matformer-train applies it"))
    betas: list[float] = setting([0.9, 0.95], help=(
        "Adam's moment decay rates, in [0, 1)"))
    eps: float = setting(1e-8, low=0, above=True, help="Adam's denominator floor")
    warmup_steps: int = setting(0, low=0, high=UINT32_MAX, help=(
        "linear warmup over each client's own steps, counted across rounds"))
    # After warmup, cosine and linear fall from lr at round 0 to final_lr at the last planned
    # round ([round] rounds or tokens): the run's clock, the same for every client.
    schedule: str = setting("constant", choices=SCHEDULES, help="the decay after warmup")
    final_lr: float | None = setting(None, low=0, help=(
        "learning rate at the last planned round, at most lr; unset: lr / 10"))
    grad_clip: float = setting(1.0, low=0, help=(
        "clip each inner step's gradient norm to this, as matformer train does (0: no "
        "clipping)"))

    def __post_init__(self) -> None:
        try:
            self.build()
        except MatformerError as err:
            raise InvalidValue(f"[inner] {err}") from err
        require(self.final_lr_value <= self.lr,
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
