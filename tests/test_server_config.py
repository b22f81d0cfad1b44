"""run.toml: the shipped example, round trips, paths, and a named error for each mistake."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import re
from pathlib import Path

import pytest
from support.helpers import CHECKED_MODEL as MODEL
from support.helpers import checked_tables

from matformer.modeling.checkpoint.hf_config import is_llama_shaped
from matformer.modeling.compression import CompressionConfig
from matformer.modeling.config import ModelConfig
from matformer.modeling.settings import table_of
from matformer.server.config import RunConfig
from matformer.server.errors import (
    ConflictingKeys,
    InvalidToml,
    InvalidValue,
    MissingFile,
    MissingKey,
    MissingSecret,
    ServerConfigError,
    UnknownKey,
    WrongType,
)
from matformer.server.main import main
from matformer.server.sections import (
    CheckpointSection,
    DataSection,
    InnerSection,
    RoundSection,
    ServerSection,
    TiersSection,
    TlsSection,
    UpdateSection,
)

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "run.toml"
TOKEN = "s3cret-join-token"


@pytest.fixture(autouse=True)
def join_token(monkeypatch):
    monkeypatch.setenv("MATFORMER_JOIN_TOKEN", TOKEN)


def minimal(**changes: dict) -> dict:
    """The smallest valid run.toml as data, its join token from the environment, with whole
    sections replaced by ``changes``."""
    return checked_tables(**{"auth": {"join_token_env": "MATFORMER_JOIN_TOKEN"}, **changes})


def with_keys(section: str, **keys) -> dict:
    data = minimal()
    data[section] = {**data.get(section, {}), **keys}
    return data


def test_example_loads_with_the_documented_values():
    config = RunConfig.load(EXAMPLE)
    assert config.data.path == ROOT / "runs" / "python_docs.mdat"
    assert (config.data.strategy, config.data.max_seq_len) == ("bytes128", 256)
    assert config.run.dir == ROOT / "runs" / "example"
    model = config.model.build()
    assert model.vocab_size == 260 and is_llama_shaped(model)
    assert config.auth.token() == TOKEN
    assert (config.server.grpc_port, config.server.http_port) == (7070, 7071)


def test_example_shows_every_key_with_its_default():
    text = EXAMPLE.read_text()
    config = RunConfig.load(EXAMPLE)
    for section in dataclasses.fields(config):
        for key in dataclasses.fields(getattr(config, section.name)):
            shown = rf"^(#? ?{key.name} = |\[{section.name}\.{key.name}\])"
            assert re.search(shown, text, re.M), f"{section.name}.{key.name}"
    defaults = [ServerSection(), TiersSection(), CompressionConfig(), UpdateSection(),
                InnerSection(), CheckpointSection(), TlsSection()]
    assert [getattr(config, n) for n in ("server", "tiers", "compression", "update", "inner",
                                         "checkpoint", "tls")] == defaults
    data_defaults = DataSection(path=Path("x"))
    assert (config.data.strategy, config.data.view, config.data.seed) == (
        data_defaults.strategy, data_defaults.view, data_defaults.seed)
    assert config.data.max_seq_len == data_defaults.max_seq_len
    round_defaults = RoundSection(rounds=1)
    assert table_of(config.round) == {**table_of(round_defaults), "rounds": 100}


def test_to_dict_round_trips_through_json(tmp_path):
    config = RunConfig.from_dict(with_keys("tiers", pins={"alice": 2}, mix={"0": 0.5, "2": 0.5}),
                                 base=tmp_path)
    assert config.tiers.mix == {0: 0.5, 2: 0.5}
    data = json.loads(json.dumps(config.to_dict()))
    assert data["tiers"]["mix"] == {"0": 0.5, "2": 0.5}
    assert RunConfig.from_dict(data, base="/elsewhere") == config
    example = RunConfig.load(EXAMPLE)
    assert RunConfig.from_dict(example.to_dict()) == example


def test_relative_paths_resolve_against_the_toml_folder(tmp_path, monkeypatch):
    folder = tmp_path / "conf"
    folder.mkdir()
    ModelConfig(**MODEL).to_json(folder / "model.json")
    (folder / "run.toml").write_text(
        '[run]\nid = "r"\ndir = "../state"\n[model]\nconfig_path = "model.json"\n'
        '[data]\npath = "d.mdat"\n[round]\ntokens = 5000\ntokens_per_round = 2048\n'
        '[auth]\njoin_token_env = "MATFORMER_JOIN_TOKEN"\n'
    )
    monkeypatch.chdir(tmp_path)
    config = RunConfig.load("conf/run.toml")
    assert config.run.dir == tmp_path / "state"
    assert config.data.path == folder / "d.mdat"
    assert config.model.build() == ModelConfig(**MODEL)
    assert config.round.planned_rounds == 3  # ceil(5000 / 2048)


@pytest.mark.parametrize(("data", "pattern"), [
    (with_keys("round", deadline=5),
     r"\[round\] has no key 'deadline'; did you mean 'deadline_s'\? valid keys: min_clients, "
     r"deadline_s, tokens_per_round, rounds, tokens, overlap, late_rounds, late_weight\."),
    (minimal(roud={}), r"run\.toml has no key 'roud'; did you mean 'round'\?"),
    (minimal(model={"inline": {**MODEL, "hiden_size": 8}}),
     r"\[model\.inline\] has no key 'hiden_size'; did you mean 'hidden_size'\?"),
    (with_keys("compression", top_k=8), r"\[compression\] has no key 'top_k'; did you mean 'topk'"),
])
def test_unknown_keys_are_named_with_the_valid_ones(data, pattern):
    with pytest.raises(UnknownKey, match=pattern):
        RunConfig.from_dict(data)


@pytest.mark.parametrize(("data", "pattern"), [
    (with_keys("server", grpc_port="7070"), r"server\.grpc_port must be an int, got '7070'"),
    (with_keys("data", max_seq_len=1.5), r"data\.max_seq_len must be an int, got 1\.5"),
    (with_keys("data", max_seq_len=True), r"data\.max_seq_len must be an int, got True"),
    (with_keys("round", deadline_s="soon"), r"round\.deadline_s must be a number"),
    (with_keys("tiers", allowed=[0, "1"]), r"tiers\.allowed\[1\] must be an int"),
    (with_keys("tiers", mix={"one": 1.0}), r"keys are tier numbers"),
    (minimal(round=3), r"\[round\] must be a table"),
])
def test_wrong_types(data, pattern):
    with pytest.raises(WrongType, match=pattern):
        RunConfig.from_dict(data)


@pytest.mark.parametrize(("data", "pattern"), [
    (with_keys("server", grpc_port=-1), r"\[server\] grpc_port must lie in \[1, 65535\], got -1\."),
    (with_keys("server", http_port=7070), r"both 7070; give each its own port"),
    (with_keys("round", deadline_s=0), r"deadline_s must lie in \[1\.0, 2592000\.0\] seconds"),
    (with_keys("faults", stream_idle_s=1e-300), r"stream_idle_s must lie in \[0\.5, "),
    (with_keys("faults", request_idle_s=0.01), r"request_idle_s must lie in \[0\.5, "),
    (with_keys("round", tokens_per_round=2**63 - 1),
     r"\[round\] tokens_per_round must lie in \[1, 1099511627776\]"),
    (with_keys("faults", max_misses=2**40), r"\[faults\] max_misses must lie in \[0, 1000000\]"),
    (with_keys("round", min_clients=0), r"min_clients must lie in \[1, 1000000\], got 0"),
    (with_keys("data", max_seq_len=0), r"\[data\] max_seq_len must lie in \[1, 1048576\], got 0\."),
    (with_keys("data", max_seq_len=512), r"exceeds the model's max_position_embeddings 256"),
    (with_keys("round", tokens_per_round=100), r"less than one sequence"),
    (with_keys("tiers", mix={"0": 0.5, "1": 0.4}), r"shares sum to 0\.9; make them sum to 1"),
    (with_keys("tiers", mix={"3": 1.0}),
     r"names tier 3, which is not one of the run.s tiers \[0, 1, 2\]"),
    (with_keys("tiers", pins={"alice": 3}),
     r"pins .alice. to tier 3, which is not one of the run.s tiers"),
    (with_keys("tiers", allowed=[0, 9]), r"allowed tier 9: .*not a whole number"),
    (with_keys("tiers", allowed=[]), r"allowed is empty"),
    (with_keys("run", id="my run"), r"rename it"),
    (with_keys("update", rule="adam"), r"\[update\] rule 'adam' is not one of sgd, sign"),
    (with_keys("update", schedule="step"),
     r"\[update\] schedule 'step' is not one of cosine, linear, constant; choose one\."),
    (with_keys("update", vote="median"), r"\[update\] vote 'median' is not one of mean, "
                                         r"majority; did you mean 'mean'\? choose one\."),
    (with_keys("update", rule="sgd", vote="majority"), r'vote = "majority" counts signs, so it '
                                                        r'needs rule = "sign", not \'sgd\''),
    (with_keys("update", final_lr=1.0), r"final_lr must lie in \[0, lr=0\.001\]"),
    (with_keys("update", warmup_rounds=11), r"warmup_rounds 11 exceeds the 10 rounds"),
    (with_keys("inner", batch_tokens=1024, schedule="step"),
     r"\[inner\] schedule 'step' is not one of cosine, linear, constant; choose one\."),
    (with_keys("inner", batch_tokens=1024, final_lr=0.01),
     r"\[inner\] final_lr must lie in \[0, lr=0\.001\], got 0\.01"),
    (with_keys("compression", encoding="zip"), r"\[compression\] .*zip"),
    (with_keys("compression", decay=2.0), r"\[compression\] decay must lie in \[0, 1\]"),
    (with_keys("checkpoint", every_rounds=0), r"every_rounds must lie in \[1, 1000000\]"),
    (with_keys("tracking", kind="mlflow"), r"\[tracking\] kind 'mlflow' is not one of "
                                           r"tensorboard, trackio, wandb, none"),
    (minimal(model={"inline": {**MODEL, "num_attention_heads": 5}}), r"\[model\.inline\]: "),
])
def test_impossible_values(data, pattern):
    with pytest.raises(InvalidValue, match=pattern):
        RunConfig.from_dict(data)


@pytest.mark.parametrize(("data", "pattern"), [
    (with_keys("update", lr=math.inf), r"^update\.lr must be a finite number, got inf"),
    (with_keys("update", weight_decay=math.inf), r"update\.weight_decay must be a finite number"),
    (with_keys("round", deadline_s=math.nan), r"round\.deadline_s must be a finite number"),
    (with_keys("compression", lr=math.inf), r"compression\.lr must be a finite number, got inf"),
    (with_keys("update", lr=100), r"\[update\] lr must lie in \(0, 10\.0\], got 100\.0\."),
    (with_keys("update", lr=0.5, weight_decay=3),
     r"weight_decay must lie in \[0, 1 / lr\] = \[0, 2\], got 3\.0: .* flips the sign"),
    (with_keys("compression", topk=2**32),
     r"\[compression\] topk must lie in \[1, 4096\] \(chunk 64²\), got 4294967296\."),
    (with_keys("faults", max_message_mb=1e-9),
     r"\[faults\] max_message_mb must lie in \[1, 256\.0\] MiB, got 1e-09\."),
    (with_keys("faults", max_message_mb=1e308), r"max_message_mb must lie in \[1, 256\.0\] MiB"),
    (with_keys("faults", max_submission_mb=1e308),
     r"max_submission_mb must lie in \[1, 1048576\.0\] MiB, got 1e\+308\."),
    (with_keys("faults", heartbeat_s=1e300, heartbeat_timeout_s=1e301, session_ttl_s=1e302),
     r"\[faults\] heartbeat_s must lie in \[0\.1, 2592000\.0\] seconds, got 1e\+300\."),
    (with_keys("data", seed=-1), r"\[data\] seed must lie in \[0, 9223372036854775807\], got -1\."),
    (with_keys("data", seed=10**23),
     r"data\.seed must lie in \[-9223372036854775808, 9223372036854775807\] \(TOML's "
     r"64-bit integers\), got 1(0){23}\."),
    (with_keys("tiers", allowed=[0, 2**40]), r"allowed must list distinct tiers in \[0, 24\]"),
    (minimal(model={"inline": {**MODEL, "vocab_size": 10**10}}),
     r"\[model\] vocab_size must lie in \[1, 16777216\], got 10000000000\."),
    (minimal(model={"inline": {**MODEL, "num_hidden_layers": 10**6}}),
     r"\[model\] num_hidden_layers must lie in \[1, 1024\], got 1000000\."),
    (minimal(model={"inline": {**MODEL, "rope_theta": math.inf}}),
     r"\[model\] rope_theta = inf is not a finite number"),
    (minimal(model={"inline": {**MODEL, "vocab_size": 2**24, "hidden_size": 2**16}}),
     r"\[model\] has [\d,]+ parameters, whose float32 master alone takes [\d,.]+ GiB, more "
     r"than this machine's"),
])
def test_every_number_has_a_range(data, pattern):
    with pytest.raises(InvalidValue, match=pattern):
        RunConfig.from_dict(data)


@pytest.mark.parametrize(("override", "key"), [
    ("update.lr=inf", "update.lr"), ("update.weight_decay=inf", "update.weight_decay"),
    ("compression.lr=inf", "compression.lr"), ("faults.max_message_mb=1e-9", "max_message_mb"),
    ("faults.max_message_mb=1e308", "max_message_mb"),
    ("faults.max_submission_mb=1e308", "max_submission_mb"), ("data.seed=-1", "seed"),
    ("data.seed=100000000000000000000000", "data.seed"),
    ("model.inline.vocab_size=10000000000", "vocab_size"),
])
def test_the_server_reports_an_out_of_range_number_in_one_line(override, key, capsys):
    # data.path names no file, so a value let through could not start a server either
    assert main(["--config", str(EXAMPLE), "--set", 'data.path="absent.mdat"',
                 "--set", override]) == 2
    err = capsys.readouterr().err
    assert err.startswith("matformer-server: ") and err.count("\n") == 1, err
    assert key in err and "must" in err and "Traceback" not in err


def test_missing_required_keys():
    data = minimal()
    del data["data"]
    with pytest.raises(MissingKey, match=r"\[data\] is missing the required key 'path'"):
        RunConfig.from_dict(data)
    with pytest.raises(MissingKey, match=r"needs a stop: rounds, tokens"):
        RunConfig.from_dict(minimal(round={}))


def test_stop_by_rounds_or_tokens_whichever_first():
    assert RoundSection(rounds=10, tokens=8192 * 4).planned_rounds == 4
    assert RoundSection(rounds=3, tokens=8192 * 4).planned_rounds == 3


def test_model_source_exactly_one(tmp_path):
    with pytest.raises(MissingKey, match=r"\[model\] needs one of"):
        RunConfig.from_dict(minimal(model={}))
    with pytest.raises(ConflictingKeys, match=r"gives inline and checkpoint; keep exactly one"):
        RunConfig.from_dict(minimal(model={"inline": MODEL, "checkpoint": "ckpt"}))
    with pytest.raises(MissingFile, match=r"config\.json does not exist"):
        RunConfig.from_dict(minimal(model={"checkpoint": "ckpt"}), base=tmp_path)


def test_model_from_a_checkpoint_folder_must_be_universal(tmp_path):
    (tmp_path / "ckpt").mkdir()
    ModelConfig(**MODEL).to_json(tmp_path / "ckpt" / "config.json")
    config = RunConfig.from_dict(minimal(model={"checkpoint": "ckpt"}), base=tmp_path)
    assert config.model.checkpoint_folder() == tmp_path / "ckpt"
    ModelConfig(**{**MODEL, "intermediate_size": 128, "matformer_tier": 1}).to_json(
        tmp_path / "ckpt" / "config.json")
    with pytest.raises(InvalidValue, match=r"tier 1 slice; a run trains the universal"):
        RunConfig.from_dict(minimal(model={"checkpoint": "ckpt"}), base=tmp_path)


def test_compression_takes_one_name_per_encoding_and_names_the_renamed_ones():
    config = RunConfig.from_dict(with_keys("compression", encoding="dense"))
    assert config.compression.encoding == "dense"
    assert config.to_dict()["compression"]["encoding"] == "dense"
    for old, new in (("none", "dense"), ("demo", "dct")):
        with pytest.raises(InvalidValue, match=(
                rf"\[compression\] encoding '{old}' is not one of dense, topk, dct; '{old}' is "
                rf"now called '{new}': write encoding = \"{new}\"")):
            RunConfig.from_dict(with_keys("compression", encoding=old))


def test_update_schedule_in_rounds():
    update = UpdateSection(lr=0.1, warmup_rounds=2, schedule="linear", final_lr=0.0)
    assert [update.lr_at(r, 12) for r in (0, 1, 2, 7, 12)] == pytest.approx(
        [0.05, 0.1, 0.1, 0.05, 0.0])
    built = update.build(7, 12, CompressionConfig(chunk=32))
    assert (built.rule, built.lr) == ("sign", pytest.approx(0.05))
    assert (built.broadcast_topk, built.chunk) == (48, 32)  # compressed results: compressed down
    assert update.build(7, 12, CompressionConfig(encoding="dense")).broadcast_topk == 0
    exact = UpdateSection(broadcast_topk=0).build(0, 1, CompressionConfig())
    assert exact.broadcast_topk == 0 and exact.build().broadcast is None


def test_auth_token_sources(monkeypatch):
    with pytest.raises(MissingKey, match=r"join_token_env .* or join_token"):
        RunConfig.from_dict(minimal(auth={}))
    with pytest.raises(ConflictingKeys, match=r"both join_token and join_token_env"):
        RunConfig.from_dict(minimal(auth={"join_token": "a", "join_token_env": "B"}))
    monkeypatch.delenv("MATFORMER_JOIN_TOKEN")
    with pytest.raises(MissingSecret, match=r"\$MATFORMER_JOIN_TOKEN, which is unset or empty"):
        RunConfig.from_dict(minimal())


def test_secrets_never_shown():
    config = RunConfig.from_dict(minimal(auth={"join_token": TOKEN}))
    assert config.auth.token() == TOKEN
    assert TOKEN not in repr(config) and TOKEN not in str(config)
    assert TOKEN not in repr(RunConfig.from_dict(minimal()))
    with pytest.raises(WrongType) as err:
        RunConfig.from_dict(minimal(auth={"join_token": 123456789}))
    assert "123456789" not in str(err.value)


def test_tls_both_or_neither_and_files_exist(tmp_path):
    (tmp_path / "c.pem").write_text("cert")
    (tmp_path / "k.pem").write_text("key")
    config = RunConfig.from_dict(minimal(tls={"cert": "c.pem", "key": "k.pem"}), base=tmp_path)
    assert config.tls.enabled and config.tls.key == tmp_path / "k.pem"
    assert not RunConfig.from_dict(minimal()).tls.enabled
    with pytest.raises(MissingKey, match=r"gives cert but not key; give both or neither"):
        RunConfig.from_dict(minimal(tls={"cert": "c.pem"}), base=tmp_path)
    with pytest.raises(MissingFile, match=r"\[tls\] key .*nope\.pem does not exist"):
        RunConfig.from_dict(minimal(tls={"cert": "c.pem", "key": "nope.pem"}), base=tmp_path)


def test_file_errors(tmp_path):
    with pytest.raises(MissingFile, match=r"examples/run\.toml shows one"):
        RunConfig.load(tmp_path / "absent.toml")
    (tmp_path / "bad.toml").write_text("[run\nid = 1")
    with pytest.raises(InvalidToml, match=r"is not valid TOML"):
        RunConfig.load(tmp_path / "bad.toml")


def test_every_config_error_is_a_server_config_error_and_a_value_error():
    for error in (UnknownKey, WrongType, InvalidValue, MissingKey, ConflictingKeys,
                  MissingSecret, MissingFile, InvalidToml):
        assert issubclass(error, ServerConfigError) and issubclass(error, ValueError)


@pytest.mark.skipif(importlib.util.find_spec("wandb") is not None, reason="wandb is installed")
def test_a_tracker_whose_package_is_missing_is_refused_at_start(tmp_path):
    with pytest.raises(InvalidValue, match=r"\[tracking\] kind 'wandb' needs the wandb package"):
        RunConfig.from_dict(checked_tables(tracking={"kind": "wandb"}), base=tmp_path)
