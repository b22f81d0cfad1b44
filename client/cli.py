"""`matformer-client`: the command a participant runs.

``matformer-client train --server HOST:PORT`` joins a federated run (client/federated.py),
as one participant however many ranks ``torchrun`` starts (client/node.py);
without ``--server`` it trains on one machine: the baseline a federated run is compared with,
on the same data path (MDAT sequences, token-budget microbatches, several tiers per step).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass
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
from matformer.modeling.settings import add_flags, given_flags, read_table, setting
from matformer.modeling.threads import use_threads

# the standalone flags a federated client reads too: FederatedOptions fields of the same name
SHARED = ("data", "device", "precision", "batching", "compile", "microbatch_tokens",
          "microbatch_examples", "pad_to_multiple_of", "threads")


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
    if args.server:
        try:
            federated_settings(args)
        except MatformerError as err:
            train.error(str(err))
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


@dataclass(kw_only=True, slots=True)
class FederatedSettings:
    """The options of a federated run, one flag per key (``modeling.settings.add_flags``)."""

    server: str | None = setting(None, help="HOST:PORT of the coordinator's gRPC service")
    tier: int | None = setting(None, low=0, help=(
        "smallest tier index (largest model) wanted, or a Mix'n'Match slice's id (64 and up: "
        "that slice or smaller); unset: any"))
    load_strategy: str = setting("auto", choices=STRATEGIES, help=(
        "auto: the tier slice if listed, else slice the universal checkpoint; sliced: the "
        "slice or fail; universal: always whole"))
    checkpoint: str = setting("server", help=(
        "where checkpoint files come from: server, a folder or hf:ORG/NAME holding a copy of "
        "the run's checkpoints (files whose sha256 differs from the manifest are downloaded)"))
    mirror: str | None = setting(None, help=(
        "base URL of an HTTP server or cache that serves the coordinator's HTTP side (or a "
        "copy of it): round updates and checkpoint files come from there, checked by sha256, "
        "and over gRPC whenever it fails"))
    join_token: str | None = setting(None, secret=True, help=(
        f"the run's join token (unset: ${JOIN_TOKEN_ENV})"))
    name: str | None = setting(None, help=(
        "this client's name ([tiers.pins] match it; unset: the hostname)"))
    run_id: str = setting("", help="refuse to join any other run")
    state_dir: Path | None = setting(None, help=(
        "checkpoint cache and error feedback (unset: runs/clients/<name>)"))
    tls_ca: Path | None = setting(None, help="PEM certificate to trust: connect with TLS")
    also_train: list[int] = setting([], help=(
        "comma-separated smaller tiers trained in the same step"))
    latency_ms: float = setting(0.0, low=0, help=(
        "delay every call by this much (simulates a slow network)"))
    bandwidth_mbit: float = setting(0.0, low=0, help=(
        "limit uploads and downloads to this many Mbit/s each (simulates a slow link; 0: no "
        "limit)"))
    compute_speed: float = setting(1.0, low=0, above=True, high=1, help=(
        "compute at this fraction of the machine's speed (each round's training is followed "
        "by a pause in proportion; simulates a slower machine, as local-testnet "
        "--client-speeds does)"))
    busy_s: float = setting(0.0, low=0, help=(
        "with --compute-speed: compute at that fraction only every other this many seconds, "
        "at full speed between (a machine busy half the time; 0: always)"))
    max_rounds: int | None = setting(None, low=0, help=(
        "leave after training this many rounds (0: join, load the run's weights, leave)"))
    progress: bool | None = setting(None, help=(
        "a progress bar (--no-progress: plain log lines; unset: when stderr is a terminal)"))
    rank_timeout_s: float = setting(30.0, low=0, above=True, help=(
        "under torchrun: the node's ranks leave when one of them shows no sign of life "
        "(stopped, hung) for this long; waiting for the coordinator does not count"))


def add_federated_arguments(federated: Any) -> None:
    """The options of a federated run (a parser or an argument group)."""
    add_flags(federated, FederatedSettings)
    trust.add_option(federated)


def federated_settings(args: argparse.Namespace) -> FederatedSettings:
    """The command line's federated options, each checked against its declaration."""
    return read_table(FederatedSettings, given_flags(args, FederatedSettings), "client",
                      Path.cwd())


def federated_options(args: argparse.Namespace) -> FederatedOptions:
    given = federated_settings(args)
    options = FederatedOptions(
        server=given.server, tier=given.tier, load_strategy=given.load_strategy,
        checkpoint=given.checkpoint, mirror=given.mirror,
        trust_remote_code=args.trust_remote_code,
        **{dest: getattr(args, dest) for dest in SHARED},
        join_token=given.join_token, run_id=given.run_id, state_dir=given.state_dir,
        tls_ca=given.tls_ca, also_train=tuple(given.also_train),
        latency_ms=given.latency_ms, bandwidth_mbit=given.bandwidth_mbit,
        compute_speed=given.compute_speed, busy_s=given.busy_s, max_rounds=given.max_rounds,
        progress=given.progress)
    if given.name:
        options.name = given.name
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
            parallel = parallel.watched(federated_settings(args).rank_timeout_s,
                                        _leave_silent_node)
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
