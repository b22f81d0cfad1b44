"""`matformer-client`: the command a participant runs.

``matformer-client train --server HOST:PORT`` joins a federated run (client/federated.py),
as one participant however many ranks ``torchrun`` starts (client/node.py);
without ``--server`` it trains on one machine: the baseline a federated run is compared with,
on the same data path (MDAT sequences, token-budget microbatches, several tiers per step).
"""

from __future__ import annotations

import argparse
import math
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from matformer.client import train_config
from matformer.client.errors import RankSilent, Terminated
from matformer.client.federated import JOIN_TOKEN_ENV, FederatedClient, FederatedOptions
from matformer.client.node import follow
from matformer.client.standalone import add_arguments, run
from matformer.modeling import trust
from matformer.modeling.checkpoint.loader import STRATEGIES
from matformer.modeling.commands import DefaultsShown, command_parser
from matformer.modeling.devices import resolve_device
from matformer.modeling.distributed import DataParallel
from matformer.modeling.errors import MatformerError
from matformer.modeling.threads import use_threads

# the standalone flags a federated client reads too: FederatedOptions fields of the same name
SHARED = ("data", "device", "precision", "batching", "compile", "microbatch_tokens",
          "microbatch_examples", "threads")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = command_parser("matformer-client", __doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    train = commands.add_parser(
        "train", help="join a federated run (--server), or train standalone without one",
        formatter_class=DefaultsShown)
    add_arguments(train)
    add_federated_arguments(train.add_argument_group("federated run (with --server)"))
    args = parser.parse_args(argv)
    if args.server:
        named = {key: name for name, (_, key) in train_config.KEYS.items()}  # path: data
        unused = [d for d in _given(args, add_arguments) if named.get(d, d) not in SHARED]
        where = ("standalone training only (in a federated run the coordinator's run.toml "
                 "decides). Drop {them}, or leave out --server to train on this machine alone")
    else:
        unused = [d for d in _given(args, add_federated_arguments) if d != "server"]
        where = "a federated run only: add --server HOST:PORT, or drop {them}"
    if unused:
        flags = ", ".join("--" + dest.replace("_", "-") for dest in unused)
        one = len(unused) == 1
        train.error(f"{flags} {'applies' if one else 'apply'} to "
                    f"{where.format(them='it' if one else 'them')}.")
    return args


def _given(args: argparse.Namespace, add: Callable[[Any], None]) -> list[str]:
    """The options ``add`` declares whose values in ``args`` are not their defaults."""
    probe = argparse.ArgumentParser(add_help=False)
    add(probe)
    return [dest for dest, default in vars(probe.parse_args([])).items()
            if getattr(args, dest) != default]


def add_federated_arguments(federated: Any) -> None:
    """The options of a federated run (a parser or an argument group)."""
    federated.add_argument("--server", help="HOST:PORT of the coordinator's gRPC service")
    federated.add_argument("--tier", type=int, default=None,
                           help="smallest tier index (largest model) wanted; default: any")
    federated.add_argument("--load-strategy", choices=STRATEGIES, default="auto",
                           help="auto: the tier slice if listed, else slice the universal "
                                "checkpoint; sliced: the slice or fail; universal: always whole")
    federated.add_argument("--checkpoint", default="server",
                           help="where checkpoint files come from: server (default), a folder "
                                "or hf:ORG/NAME holding a copy of the run's checkpoints "
                                "(files whose sha256 differs from the manifest are downloaded)")
    federated.add_argument("--mirror", default=None, metavar="URL",
                           help="base URL of an HTTP server or cache that serves the "
                                "coordinator's HTTP side (or a copy of it): round updates and "
                                "checkpoint files come from there, checked by sha256, and "
                                "over gRPC whenever it fails")
    trust.add_option(federated)
    federated.add_argument("--join-token", default=None,
                           help=f"the run's join token (default: ${JOIN_TOKEN_ENV})")
    federated.add_argument("--name", default=None,
                           help="this client's name ([tiers.pins] match it; default: hostname)")
    federated.add_argument("--run-id", default="", help="refuse to join any other run")
    federated.add_argument("--state-dir", type=Path, default=None,
                           help="checkpoint cache and error feedback (default: "
                                "runs/clients/<name>)")
    federated.add_argument("--tls-ca", type=Path, default=None,
                           help="PEM certificate to trust: connect with TLS")
    federated.add_argument("--also-train", default="",
                           help="comma-separated smaller tiers trained in the same step")
    federated.add_argument("--latency-ms", type=float, default=0.0,
                           help="delay every call by this much (simulates a slow network)")
    federated.add_argument("--bandwidth-mbit", type=float, default=0.0,
                           help="limit uploads and downloads to this many Mbit/s each "
                                "(simulates a slow link; 0: no limit)")
    federated.add_argument("--compute-speed", type=_speed, default=1.0, metavar="FRACTION",
                           help="compute at this fraction of the machine's speed (each "
                                "round's training is followed by a pause in proportion; "
                                "simulates a slower machine, as local-testnet "
                                "--client-speeds does; default: 1)")
    federated.add_argument("--max-rounds", type=int, default=None,
                           help="leave after training this many rounds")
    federated.add_argument("--no-progress", action="store_true",
                           help="plain log lines instead of a progress bar")
    federated.add_argument("--rank-timeout-s", type=float, default=30.0,
                           help="under torchrun: the node's ranks leave when one of them "
                                "shows no sign of life (stopped, hung) for this long; "
                                "waiting for the coordinator does not count (default: 30)")


def _speed(text: str) -> float:
    """A fraction in (0, 1]: argparse's type for --compute-speed."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a fraction in (0, 1], e.g. 0.25")
    return value


def federated_options(args: argparse.Namespace) -> FederatedOptions:
    options = FederatedOptions(
        server=args.server, tier=args.tier, load_strategy=args.load_strategy,
        checkpoint=args.checkpoint, mirror=args.mirror,
        trust_remote_code=args.trust_remote_code,
        **{dest: getattr(args, dest) for dest in SHARED},
        join_token=args.join_token, run_id=args.run_id, state_dir=args.state_dir,
        tls_ca=args.tls_ca,
        also_train=tuple(int(t) for t in args.also_train.split(",") if t.strip()),
        latency_ms=args.latency_ms, bandwidth_mbit=args.bandwidth_mbit,
        compute_speed=args.compute_speed, max_rounds=args.max_rounds,
        progress=False if args.no_progress else None)
    if args.name:
        options.name = args.name
    return options


def run_federated(args: argparse.Namespace) -> int:
    # Ctrl-C leaves the run, and SIGTERM likewise. SIGINT's handler is set here, not left to
    # Python: a shell starts a background job (`cmd &`) with SIGINT ignored, and Python keeps
    # an ignored SIGINT, so such a client would never hear the Ctrl-C meant for it.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, _terminated)
    try:
        args = train_config.apply(args)  # the defaults of the shared keys, checked
        parallel = DataParallel.from_environment(resolve_device(args.device))
        threads = use_threads(args.threads)
        args.threads = threads.count  # what the summary records
        print(f"matformer-client: computing with {threads.describe()}", flush=True)
        if parallel is not None:
            parallel = parallel.watched(args.rank_timeout_s, _leave_silent_node)
        if parallel is not None and not parallel.leader:
            follow(parallel)  # rank 0 talks to the coordinator; this rank trains its share
            parallel.close()
            return 0
        options = federated_options(args)
        summary = FederatedClient(options, parallel=parallel).run()
        if parallel is not None:
            parallel.close()
    except MatformerError as error:
        print(f"matformer-client: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as stop:
        why = "SIGTERM" if isinstance(stop, Terminated) else "Ctrl-C"
        print(f"matformer-client: left the run ({why})", file=sys.stderr)
        return 130
    # its --name, the member's name in the coordinator's log and dashboard (under [auth]
    # mode = "keys" they show the key's name); the client id names only this session
    print(f"matformer-client: {options.name} trained {summary.rounds_trained} rounds at "
          f"tier {summary.tier}, sent {summary.bytes_sent / 1024:,.1f} KiB, received "
          f"{summary.update_bytes / 1024:,.1f} KiB of updates, "
          f"{summary.resynchronisations} resynchronisations")
    return 0


def _terminated(signum: int, frame: object) -> None:
    raise Terminated()


def _leave_silent_node(rank: int, silent_s: float) -> None:
    print(f"matformer-client: error: {RankSilent(rank, silent_s)}", file=sys.stderr, flush=True)
    os._exit(2)  # at once: the main thread may wait inside a collective that never returns


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.server:
        raise SystemExit(run_federated(args))
    run(args, "matformer-client")


if __name__ == "__main__":
    main()
