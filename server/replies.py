"""The service's answers that carry the run's own records: the checkpoint to load, the
settings to train with, and a member's assignment (server/service.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from matformer.modeling.checkpoint.export import read_manifest
from matformer.modeling.checkpoint.manifest import MANIFEST_NAME
from matformer.protocol.matformer.v1 import coordinator_pb2 as pb
from matformer.protocol.settings import InnerSettings, RunSettings, encode_settings
from matformer.server.rounds import RoundAssignment

if TYPE_CHECKING:
    from matformer.server.coordinator import Coordinator


def checkpoint_ref(coordinator: Coordinator, tier: int) -> pb.CheckpointRef:
    """The latest universal checkpoint's manifest and its entry for ``tier``."""
    ref = coordinator.latest_checkpoint()
    message = pb.CheckpointRef(round=ref.round,
                               manifest_path=f"{ref.path.name}/{MANIFEST_NAME}")
    manifest = read_manifest(ref.path)
    entry = manifest.entry(tier) if manifest is not None else None
    if entry is not None:
        message.entry.CopyFrom(pb.TierEntry(tier=str(entry.tier),
                                            intermediate_size=entry.intermediate_size or 0,
                                            files=entry.files))
    return message

def settings(coordinator: Coordinator) -> pb.TrainingSettings:
    """What a client needs to train as the run does."""
    cfg = coordinator.config
    inner = cfg.inner
    return encode_settings(RunSettings(
        compression=cfg.compression, sequence_length=cfg.data.max_seq_len,
        data_strategy=cfg.data.strategy, data_view=cfg.data.view,
        data_fingerprint=coordinator.reader.fingerprint, heartbeat_s=cfg.faults.heartbeat_s,
        inner=None if not inner.enabled else InnerSettings(
            name=inner.optimizer, lr=inner.lr, weight_decay=inner.weight_decay,
            beta1=inner.betas[0], beta2=inner.betas[1], eps=inner.eps,
            warmup_steps=inner.warmup_steps, batch_tokens=inner.batch_tokens,
            schedule=inner.schedule, final_lr=inner.final_lr_value,
            planned_rounds=cfg.round.planned_rounds),
        overlap=cfg.round.overlap, peer_clip=cfg.faults.peer_clip,
        max_norm=cfg.faults.max_norm, norm_action=cfg.faults.norm_action,
        deadline_s=cfg.round.deadline_s))


def planned(coordinator: Coordinator) -> dict[str, int]:
    """JoinReply's stop, for a client's progress: [round] rounds when that stop comes first
    (every round counted full, as ``planned_rounds`` does), and [round] tokens; 0 for none."""
    stop = coordinator.config.round
    rounds_first = stop.rounds is not None and stop.rounds == stop.planned_rounds
    return {"rounds_planned": stop.rounds if rounds_first else 0,
            "tokens_planned": stop.tokens or 0}


def assignment(assigned: RoundAssignment, run_tokens: int, now: float) -> pb.RoundAssignment:
    """A member's work in a round: ROUND_STATE_TRAIN (``run_tokens``: the run's so far;
    ``now``: the clock the assignment's deadline is on)."""
    return pb.RoundAssignment(
        state=pb.ROUND_STATE_TRAIN, round=assigned.round,
        sequence_ids=assigned.sequence_ids, tier=assigned.tier,
        assignment_id=assigned.assignment_id, run_tokens=run_tokens,
        deadline_in_seconds=max(assigned.deadline - now, 0.0))
