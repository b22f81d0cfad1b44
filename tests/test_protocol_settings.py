"""protocol.settings: the TrainingSettings record both ways, and what a member builds of it."""

from __future__ import annotations

import dataclasses

import pytest
from support.helpers import run_tables

from matformer.client.local_round import LocalSteps
from matformer.modeling.compression import CompressionConfig
from matformer.protocol.matformer.v1 import coordinator_pb2 as pb
from matformer.protocol.settings import (
    InnerSettings,
    RunSettings,
    decode_settings,
    encode_settings,
)
from matformer.server.config import RunConfig

INNER = InnerSettings(name="adamw", lr=3e-3, weight_decay=0.01, beta1=0.9, beta2=0.95,
                      eps=1e-8, warmup_steps=7, batch_tokens=256, schedule="cosine",
                      final_lr=3e-4, planned_rounds=40, grad_clip=0.5)
PLAIN = RunSettings(compression=CompressionConfig(encoding="dct", chunk=16, topk=8,
                                                  value_dtype="bfloat16"),
                    sequence_length=128, data_strategy="bytes128", data_view=None,
                    data_fingerprint="abc123", heartbeat_s=2.0)


@pytest.mark.parametrize("settings", [
    PLAIN,
    dataclasses.replace(PLAIN, inner=INNER, overlap=True, peer_clip=2.0, max_norm=50.0,
                        norm_action="clip", data_view="train"),
    dataclasses.replace(PLAIN, compression=CompressionConfig(encoding="dense"),
                        heartbeat_s=0.0)],
    ids=["one gradient a round", "local steps, overlapped, bounded", "dense"])
def test_a_record_comes_back_from_its_message_unchanged(settings):
    message = encode_settings(settings)
    again = decode_settings(pb.TrainingSettings.FromString(message.SerializeToString()))
    assert again == settings


def test_an_older_coordinators_unset_fields_read_as_their_defaults():
    message = encode_settings(dataclasses.replace(PLAIN, inner=INNER))
    message.inner.ClearField("schedule")
    message.inner.ClearField("grad_clip")
    message.inner.planned_rounds = 0
    message.ClearField("norm_action")
    got = decode_settings(message)
    assert got.inner.schedule == "constant" and got.inner.planned_rounds == 1
    assert got.inner.grad_clip == 0.0  # an older coordinator's members never clipped
    assert got.norm_action == "reject" and got.max_norm is None and got.data_view is None


def test_the_coordinators_settings_are_its_config_and_a_member_builds_its_steps_from_them(
        mdat_path):
    config = RunConfig.from_dict(run_tables(
        mdat_path, inner={"batch_tokens": 256, "lr": 2e-3, "warmup_steps": 5},
        round={"min_clients": 1, "deadline_s": 30.0, "tokens_per_round": 1024, "rounds": 9,
               "overlap": True}))
    got = decode_settings(encode_settings(config.member_settings("f00d")))
    assert got.compression == config.compression and got.overlap
    assert (got.sequence_length, got.data_fingerprint) == (128, "f00d")
    assert got.inner == InnerSettings(
        name=config.inner.optimizer, lr=2e-3, weight_decay=config.inner.weight_decay,
        beta1=config.inner.betas[0], beta2=config.inner.betas[1], eps=config.inner.eps,
        warmup_steps=5, batch_tokens=256, schedule=config.inner.schedule,
        final_lr=config.inner.final_lr_value, planned_rounds=9, grad_clip=1.0)
    steps = LocalSteps.of(got.inner)
    assert (steps.batch_tokens, steps.planned_rounds, steps.optimizer.lr) == (256, 9, 2e-3)
    assert steps.grad_clip == 1.0  # as matformer train clips, unless [inner] says
    assert LocalSteps.of(None) is None
