"""The member RPCs' small records, as both ends hold them, converted here in both directions
(as ``protocol/settings.py`` converts the settings): the checkpoint a member is told to load,
and a submission's header.

    message = encode_checkpoint(ServedCheckpoint(round=4, manifest_path="round-4/..."))
    served = decode_checkpoint(message)            # the relay's upstream, a member's edge
    header = decode_header(first.header)           # the service, before any result is read
    message = encode_header(header)                # a relay handing its round in
"""

from __future__ import annotations

from dataclasses import dataclass

from matformer.protocol.matformer.v1 import coordinator_pb2 as pb


@dataclass(frozen=True, slots=True)
class ServedEntry:
    """A checkpoint manifest's entry for one tier: its files, relative to the manifest."""

    tier: str  # "2", or a Mix'n'Match label such as "mix:0,0,1,2"
    intermediate_size: int
    files: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class ServedCheckpoint:
    """Where a member starts: the checkpoint written after ``round`` rounds (it replays the
    updates from ``round`` on), its manifest, and the entry of the member's tier."""

    round: int
    manifest_path: str  # relative to the run's checkpoint directory
    entry: ServedEntry | None = None  # None: the manifest has no entry for that tier


def encode_checkpoint(served: ServedCheckpoint) -> pb.CheckpointRef:
    message = pb.CheckpointRef(round=served.round, manifest_path=served.manifest_path)
    if served.entry is not None:
        message.entry.CopyFrom(pb.TierEntry(tier=served.entry.tier,
                                            intermediate_size=served.entry.intermediate_size,
                                            files=served.entry.files))
    return message


def decode_checkpoint(m: pb.CheckpointRef) -> ServedCheckpoint:
    entry = ServedEntry(tier=m.entry.tier, intermediate_size=m.entry.intermediate_size,
                        files=tuple(m.entry.files)) if m.HasField("entry") else None
    return ServedCheckpoint(round=m.round, manifest_path=m.manifest_path, entry=entry)


@dataclass(frozen=True, slots=True)
class TierLoss:
    """A relay's members' loss at one tier, weighted by the tokens they trained."""

    tier: int
    tokens: int
    loss: float


@dataclass(frozen=True, slots=True)
class SubmitHeader:
    """What a submission says before its results: whose, for which assignment, and what the
    training reported. ``missed_ids`` and ``tier_losses`` are a relay's only."""

    round: int
    client_id: str
    tokens: int
    loss: float
    train_seconds: float
    assignment_id: str
    missed_ids: tuple[int, ...] = ()
    tier_losses: tuple[TierLoss, ...] = ()


def encode_header(header: SubmitHeader) -> pb.SubmitHeader:
    return pb.SubmitHeader(
        round=header.round, client_id=header.client_id, tokens=header.tokens,
        loss=header.loss, train_seconds=header.train_seconds,
        assignment_id=header.assignment_id, missed_ids=header.missed_ids,
        tier_losses=[pb.TierLoss(tier=t.tier, tokens=t.tokens, loss=t.loss)
                     for t in header.tier_losses])


def decode_header(m: pb.SubmitHeader) -> SubmitHeader:
    return SubmitHeader(
        round=m.round, client_id=m.client_id, tokens=m.tokens, loss=m.loss,
        train_seconds=m.train_seconds, assignment_id=m.assignment_id,
        missed_ids=tuple(m.missed_ids),
        tier_losses=tuple(TierLoss(tier=t.tier, tokens=t.tokens, loss=t.loss)
                          for t in m.tier_losses))
