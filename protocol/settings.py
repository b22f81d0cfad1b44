"""``TrainingSettings``: what a member needs to train as the run does, as a record both sides
hold, converted here in both directions (the coordinator fills it from its config, a member
or relay reads it; neither touches the message's fields).

    message = encode_settings(settings)   # server/replies.py
    settings = decode_settings(message)   # client/connection.py, relay/relay.py

The record holds values only: a member builds its training objects from them (the inner
optimizer: ``client.local_round.LocalSteps.of``).
"""

from __future__ import annotations

from dataclasses import dataclass

from matformer.modeling.compression import CompressionConfig
from matformer.modeling.matformer import TierIds
from matformer.protocol.matformer.v1 import coordinator_pb2 as pb


@dataclass(frozen=True, slots=True)
class InnerSettings:
    """Local steps ([inner]): a round's share trained as batches of ``batch_tokens``, one
    step of the named optimizer each, its lr on the run's schedule over ``planned_rounds``."""

    name: str
    lr: float
    weight_decay: float
    beta1: float
    beta2: float
    eps: float
    warmup_steps: int
    batch_tokens: int
    schedule: str
    final_lr: float
    planned_rounds: int
    grad_clip: float = 0.0  # each inner step's gradient norm at most this; 0: not clipped


@dataclass(frozen=True, slots=True)
class RunSettings:
    """What a client needs to train as the run does."""

    compression: CompressionConfig  # how results are compressed, with error feedback
    sequence_length: int
    data_strategy: str  # pretokenization strategy of the run's MDAT
    data_view: str | None  # the view of it the run reads; None: the whole container
    data_fingerprint: str  # of that view: a local copy (--data) must match it
    heartbeat_s: float  # how often to heartbeat, also while training; 0: not asked
    inner: InnerSettings | None = None  # None: one gradient per round
    # overlapped rounds: round r is trained on the weights after r - 1 rounds, and the next
    # rounds' work is handed out ahead (docs/architecture.md, "One round")
    overlap: bool = False
    # what the coordinator does to members' results ([faults]): a relay does it to its own
    peer_clip: float = 0.0  # 0: off
    max_norm: float | None = None  # None: unbounded
    norm_action: str = "reject"
    deadline_s: float = 0.0  # [round] deadline_s; 0: not said (an older coordinator)
    # the run's Mix'n'Match slices ([tiers] layer_mixes), tier FIRST_MIX_ID + k each
    layer_mixes: tuple[tuple[int, ...], ...] = ()

    def tier_ids(self) -> TierIds:
        """What each of the run's tier ids stands for."""
        return TierIds(self.layer_mixes)


def encode_settings(s: RunSettings) -> pb.TrainingSettings:
    c = s.compression
    message = pb.TrainingSettings(
        encoding=c.encoding, chunk=c.chunk, topk=c.topk, value_dtype=c.value_dtype,
        decay=c.decay, compression_lr=c.lr, sequence_length=s.sequence_length,
        data_fingerprint=s.data_fingerprint, data_strategy=s.data_strategy,
        data_view=s.data_view or "", heartbeat_seconds=s.heartbeat_s, overlap=s.overlap,
        peer_clip=s.peer_clip, max_norm=s.max_norm or 0.0, norm_action=s.norm_action,
        round_deadline_seconds=s.deadline_s,
        layer_mixes=[pb.LayerTiers(tiers=layers) for layers in s.layer_mixes])
    if s.inner is not None:
        i = s.inner
        message.inner.CopyFrom(pb.InnerOptimizer(
            name=i.name, lr=i.lr, weight_decay=i.weight_decay, beta1=i.beta1, beta2=i.beta2,
            eps=i.eps, warmup_steps=i.warmup_steps, batch_tokens=i.batch_tokens,
            schedule=i.schedule, final_lr=i.final_lr, planned_rounds=i.planned_rounds,
            grad_clip=i.grad_clip))
    return message


def decode_settings(m: pb.TrainingSettings) -> RunSettings:
    """The record of ``m``; a field an older coordinator left unset reads as its default
    (the constant schedule, at least one planned round, norms rejected)."""
    compression = CompressionConfig(encoding=m.encoding, chunk=m.chunk, topk=m.topk,
                                    value_dtype=m.value_dtype, decay=m.decay,
                                    lr=m.compression_lr)
    inner = None
    if m.HasField("inner"):
        i = m.inner
        inner = InnerSettings(name=i.name, lr=i.lr, weight_decay=i.weight_decay,
                              beta1=i.beta1, beta2=i.beta2, eps=i.eps,
                              warmup_steps=i.warmup_steps, batch_tokens=i.batch_tokens,
                              schedule=i.schedule or "constant", final_lr=i.final_lr,
                              planned_rounds=max(1, i.planned_rounds),
                              grad_clip=max(0.0, i.grad_clip))
    return RunSettings(compression=compression, sequence_length=m.sequence_length,
                       data_strategy=m.data_strategy, data_view=m.data_view or None,
                       data_fingerprint=m.data_fingerprint, heartbeat_s=m.heartbeat_seconds,
                       inner=inner, overlap=m.overlap, peer_clip=m.peer_clip,
                       max_norm=m.max_norm or None, norm_action=m.norm_action or "reject",
                       deadline_s=m.round_deadline_seconds,
                       layer_mixes=tuple(tuple(mix.tiers) for mix in m.layer_mixes))
