"""[round], [update] and [inner], and what a run needs of [compression]: when rounds open
and close, how members train their share and how the results become each round's step."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from modeling.compression import UPDATE_RULES, CompressionConfig, UpdateConfig
from modeling.errors import MatformerError
from modeling.optim import SCHEDULES, OptimizerConfig, constant_after_warmup, lr_factor
from server.errors import InvalidValue, MissingKey
from server.sections.checks import MAX_SECONDS, require, within
from server.update_steps import Momentum

MIN_DEADLINE_S = 1.0  # no round is ever trained and submitted in less
MAX_LR = 10.0  # a step of 10·sign(aggregate) already wipes out any trained weight
UINT32_MAX = 2**32 - 1  # chunk and topk travel to clients as uint32 (TrainingSettings)
# Broadcast coefficients per 64 × 64 chunk: with DeMo's 32 per chunk sent up, a tier-0
# client moves about 1/128 of dense float32 both ways (bench/scale.py)
DEFAULT_BROADCAST_TOPK = 48
VOTES = ("mean", "majority")


@dataclass(kw_only=True, slots=True)
class RoundSection:
    """When rounds start and end, and when the run stops: after ``rounds`` rounds or ``tokens``
    tokens, whichever comes first (at least one of the two)."""

    min_clients: int = 1  # members ready to train (their speed measured) before a round opens
    deadline_s: float = 60.0  # a client that has not submitted by then is dropped from the round
    tokens_per_round: int = 8192  # the round's token budget, shared by speed among clients
    rounds: int | None = None
    tokens: int | None = None
    # hand out round r+1's work before round r closes: members train it on the weights they
    # hold and apply round r's update when it arrives (a one-round-delayed update)
    overlap: bool = False

    def __post_init__(self) -> None:
        require(self.min_clients >= 1,
                f"[round] min_clients must be >= 1, got {self.min_clients}.")
        within("[round] deadline_s", self.deadline_s, MIN_DEADLINE_S, MAX_SECONDS,
               unit=" seconds")
        require(self.tokens_per_round >= 1,
                f"[round] tokens_per_round must be >= 1, got {self.tokens_per_round}.")
        if self.rounds is None and self.tokens is None:
            raise MissingKey("[round] needs a stop: rounds, tokens, or both (whichever comes "
                             "first).")
        for key in ("rounds", "tokens"):
            value = getattr(self, key)
            require(value is None or value >= 1, f"[round] {key} must be >= 1, got {value}.")

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
        require(self.rule in UPDATE_RULES,
                f"[update] rule {self.rule!r} is unknown; choose one of "
                f"{', '.join(UPDATE_RULES)}.")
        require(self.vote in VOTES,
                f"[update] vote {self.vote!r} is unknown; choose one of {', '.join(VOTES)}.")
        require(self.vote == "mean" or self.rule == "sign",
                f"[update] vote = \"majority\" counts signs, so it needs rule = \"sign\", not "
                f"{self.rule!r}.")
        require(self.schedule in SCHEDULES,
                f"[update] schedule {self.schedule!r} is unknown; choose one of "
                f"{', '.join(SCHEDULES)}.")
        within("[update] lr", self.lr, 0, MAX_LR, above=True)
        require(0 <= self.final_lr <= self.lr,
                f"[update] final_lr must lie in [0, lr={self.lr}], got {self.final_lr}.")
        require(0 <= self.weight_decay <= 1 / self.lr,
                f"[update] weight_decay must lie in [0, 1 / lr] = [0, {1 / self.lr:g}], got "
                f"{self.weight_decay}: beyond 1 / lr the decay w ← w·(1 − lr·wd) flips the sign "
                "of the weights.")
        require(0 <= self.momentum < 1,
                f"[update] momentum must lie in [0, 1), got {self.momentum}.")
        require(self.momentum == 0 or self.rule == "sgd",
                f"[update] momentum needs rule = \"sgd\" (the sign rule reads only the "
                f"aggregate's signs), not {self.rule!r}.")
        require(not self.nesterov or self.momentum > 0,
                "[update] nesterov needs a momentum > 0.")
        require(self.warmup_rounds >= 0,
                f"[update] warmup_rounds must be >= 0, got {self.warmup_rounds}.")
        if self.broadcast_topk is not None:
            within("[update] broadcast_topk", self.broadcast_topk, 0, UINT32_MAX)

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
        within("[inner] batch_tokens", self.batch_tokens, 0, UINT32_MAX)
        within("[inner] warmup_steps", self.warmup_steps, 0, UINT32_MAX)
        require(self.schedule in SCHEDULES,
                f"[inner] schedule {self.schedule!r} is unknown; choose one of "
                f"{', '.join(SCHEDULES)}.")
        try:
            self.build()
        except MatformerError as err:
            raise InvalidValue(f"[inner] {err}") from err
        require(0 <= self.final_lr_value <= self.lr,
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


def check_compression(compression: CompressionConfig) -> None:
    """What [compression] (modeling's CompressionConfig, which checks its own lower bounds)
    must keep for a run: an lr that scales gradients no more than [update] lr may, a chunk
    within the uint32 field that carries it to clients, and (for chunked encodings) no more
    values per chunk than a chunk of the run's matrices holds."""
    within("[compression] lr", compression.lr, 0, MAX_LR, above=True)
    within("[compression] chunk", compression.chunk, 1, UINT32_MAX)
    if compression.encoding != "dense":
        within("[compression] topk", compression.topk, 1,
               min(compression.chunk ** 2, UINT32_MAX), unit=f" (chunk {compression.chunk}²)")
