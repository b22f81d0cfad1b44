"""The embedded run: written to ``<run dir>/run.toml`` when ``local-testnet`` gets no
``--config``. A small Llama-shaped model (client/standalone.py's TINY) on the stdlib
docstrings corpus, sized to finish in a few minutes on a 2-core CPU with loss falling at
every tier. Clients take local steps (``[inner]``): in the same rounds, for about 15% more
time, they reach a held-out loss about 0.6 nats per byte lower than one compressed gradient
per round with the sign rule, and are ahead at equal time too (bench/README.md, "The
default run").
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from matformer.modeling.mdat import build_default_mdat, default_data_path
from matformer.modeling.mdat.catalogue import CATALOGUE_NAME

RUN_TOML = """\
# run.toml written by local-testnet (the embedded default); the keys are those of
# examples/run.toml. local-testnet overrides [server] ports, [round] rounds and min_clients
# with `matformer-server --set`, so this file shows the run as it would start by hand.

[run]
id = "testnet"
dir = "."                       # this folder: state.json, checkpoints/, updates/

[model.inline]                  # client/standalone.py's TINY model
vocab_size = 260                # bytes128: 256 bytes + 4 special tokens
hidden_size = 128
num_hidden_layers = 4
num_attention_heads = 4
num_key_value_heads = 2
intermediate_size = 512         # tier t trains the first 512 / 2**t FFN neurons
max_position_embeddings = 512

[data]
path = "{data}"
strategy = "bytes128"
max_seq_len = 256
seed = 0

[tiers]
allowed = [0, 1, 2]

[round]
min_clients = {min_clients}     # every client joins before round 0 opens
deadline_s = 30.0               # a slow client is dropped from the round this long after it opened
tokens_per_round = {tokens_per_round}
rounds = {rounds}

[compression]
encoding = "dct"                # DeMo's DCT over 64x64 chunks, top 48 per chunk as 4-bit codes:
chunk = 64                      # the bytes of top 32 in bfloat16, 0.5-1.6% lower held-out loss
topk = 48                       # over 3 seeds (bench/README.md, "Low-bit values")
value_dtype = "int4"
decay = 0.999
lr = 1.0

[update]                        # the outer step: the mean of the clients' pseudo-gradients
rule = "sgd"
lr = 1.0                        # plain averaging: DiLoCo's Nesterov momentum (lr 0.7, 0.9)
schedule = "constant"           # overshoots with a handful of inner steps per round

[inner]                         # local steps: each client trains its share of a round
batch_tokens = 256              # as AdamW steps of this many tokens (about 5 per round)
optimizer = "adamw"
lr = 0.003
weight_decay = 0.01
warmup_steps = 20               # each client's first 20 inner steps
schedule = "constant"           # a cosine over the rounds ends 3% worse here (bench/README.md)
grad_clip = 1.0                 # each inner step's gradient norm, as matformer train clips it

[checkpoint]
every_rounds = 10

[faults]
heartbeat_s = 2.0               # clients heartbeat every 2 s, also while training
heartbeat_timeout_s = 20.0      # 20 s of silence: killed or hung (a member starved of CPU on a
                                # busy machine went 5 s without a heartbeat and was not)

[auth]
join_token_env = "MATFORMER_JOIN_TOKEN"    # local-testnet generates the token
relay_token_env = "MATFORMER_RELAY_TOKEN"  # ... and the relays' (--relays)
"""


def write_default_run(run_dir: Path, *, data: Path, min_clients: int, rounds: int,
                      tokens_per_round: int) -> Path:
    """``<run_dir>/run.toml`` for the embedded default; returns its path."""
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / "run.toml"
    path.write_text(RUN_TOML.format(
        data=data.resolve().as_posix(), min_clients=min_clients, rounds=rounds,
        tokens_per_round=tokens_per_round))
    return path


def ensure_default_data(documents: int | None, say: Callable[[str], None]) -> Path:
    """The stdlib docstrings MDAT, built (or finished: building resumes) on first use."""
    path = default_data_path(documents)
    if not (path / CATALOGUE_NAME).is_file():
        say(f"[testnet] building the stdlib docstrings corpus at {path} (once)")
    build_default_mdat(path, limit=documents).close()
    return path
