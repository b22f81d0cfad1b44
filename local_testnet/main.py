"""`local-testnet`: a whole federated run as processes on this machine.

    local-testnet --num-clients 3 --tiers 0,1,2                  # the embedded default run
    local-testnet --config run.toml --rounds 20 --kill-client-at 5 --latency-ms 50
    local-testnet --bandwidth-mbit 20 --latency-ms 50      # every client on a home link
    local-testnet --chaos 7                    # seeded client kills and one server kill
    local-testnet --netns --link-rate 2 --cut-link-at 3 --cut-s 30   # real links, one cut

It starts ``matformer-server`` and the clients on loopback, streams their logs with
prefixes, and at the end prints a per-tier loss table and writes ``loss.png`` and
``summary.json`` into the run directory, next to the checkpoints, tier slices and manifest.
Exit code 0 when the run finished and the held-out loss fell at every tier (and, with
``--chaos`` or ``--cut-link-at``, every sequence was trained exactly once and the surviving
replicas agree). ``--netns`` (root) puts each process in a network namespace of its own, over
real links (local_testnet/netns.py).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import shutil
import signal
import sys
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path

from matformer.local_testnet.chaos import ChaosEvent, chaos_plan, check_run, format_chaos
from matformer.local_testnet.default_run import ensure_default_data, write_default_run
from matformer.local_testnet.held_out import MAX_SEQUENCES, HeldOut
from matformer.local_testnet.netns import NetnsError, NetnsUnavailable, Network
from matformer.local_testnet.processes import free_port, say
from matformer.local_testnet.report import (
    add_to_summary,
    client_costs,
    format_costs,
    format_relay_traffic,
    format_table,
    relay_summaries,
    relay_traffic,
    tier_reports,
    write_plot,
    write_summary,
)
from matformer.local_testnet.testnet import (
    RESTART_AFTER_S,
    ClientSpec,
    LinkCut,
    Testnet,
    TestnetFailed,
    TestnetPlan,
)
from matformer.modeling.commands import apply_overrides, command_parser
from matformer.modeling.devices import resolve_device
from matformer.modeling.errors import DeviceUnavailable, MatformerError
from matformer.modeling.folder_lock import FolderInUse, locked
from matformer.modeling.settings import add_flags, given_flags, read_table, setting
from matformer.modeling.threads import use_threads
from matformer.protocol.auth import new_join_token
from matformer.server.config import RunConfig
from matformer.server.errors import InvalidValue
from matformer.server.held_out_log import HeldOutLog

JOIN_TOKEN_ENV = "MATFORMER_JOIN_TOKEN"
RELAY_TOKEN_ENV = "MATFORMER_RELAY_TOKEN"
DEFAULT_RUN_DIR = Path("runs/testnet")
PREVIOUS_SUFFIX = "-previous"  # the run before the current one, kept beside it
# The embedded run: about two and a half minutes on two CPU cores with three clients.
DEFAULT_ROUNDS = 150
DEFAULT_TOKENS_PER_ROUND = 4096


@dataclass(kw_only=True, slots=True)
class TestnetSettings:
    """What ``matformer testnet`` takes, one flag per key (``modeling.settings.add_flags``)."""

    num_clients: int = setting(3, low=1, help="clients, each a process of its own")
    tiers: list[int] = setting([0, 1, 2], help=(
        "comma-separated tiers the clients ask for, cycled over them"))
    config: Path | None = setting(None, help=(
        "a run.toml (unset: the embedded run, in --run-dir)"))
    rounds: int | None = setting(None, low=1, help="stop after this many rounds")
    kill_client_at: int | None = setting(None, low=0, help=(
        "SIGKILL the last client in this round, then restart it"))
    chaos: int | None = setting(None, low=0, help=(
        "SIGKILL random clients and the server once on a schedule drawn from this seed, "
        "restart them, and check at the end that every sequence was trained exactly once and "
        "the replicas agree"))
    latency_ms: float = setting(0.0, low=0, help=(
        "delay every client call by this much (a simulated WAN)"))
    bandwidth_mbit: float = setting(0.0, low=0, help=(
        "limit each client's upload and download to this many Mbit/s (a simulated home "
        "link; 0: no limit)"))
    client_speeds: list[float] = setting([1.0], help=(
        "comma-separated fractions of this machine's speed the clients compute at, cycled "
        "over them (e.g. 1,0.5,0.25: a fast, a half and a quarter-speed member)"))
    busy_s: float = setting(0.0, low=0, help=(
        "the clients slowed by --client-speeds are slowed only every other this many seconds, "
        "and compute at full speed between: machines busy half the time, whose speed the "
        "coordinator cannot foresee (0: slowed throughout)"))
    netns: bool = setting(False, help=(
        "each process in a network namespace of its own, joined over veth pairs to one "
        "bridge: real links, real TCP (needs root and `ip netns`)"))
    link_rate: float = setting(0.0, low=0, help=(
        "with --netns: each client's link rate, each way, in Mbit/s (tc tbf; 0: no limit; "
        "the coordinator's and the relays' links have none)"))
    cut_link_at: int | None = setting(None, low=0, help=(
        "with --netns: once this round is open, set the last client's link down while it "
        "uploads, for --cut-s, then check that nothing was lost and the replicas agree"))
    cut_s: float = setting(30.0, low=0, help="how long --cut-link-at keeps the link down")
    overlap: bool | None = setting(None, help=(
        "overlapped rounds ([round] overlap, on unless the run says otherwise): members "
        "train the next round while the last one closes; --no-overlap: synchronous rounds"))
    shards: int = setting(1, low=1, high=64, help=(
        "processes the coordinator's close is sharded over ([coordinator] shards)"))
    relays: int = setting(0, low=0, help=(
        "relays between the coordinator and the clients (matformer relay), the clients "
        "spread over them: the root sees that many members and one partial sum from each "
        "per round"))
    device: str | None = setting(None, help=(
        "the clients' device (cpu, cuda, cuda:N; unset: their own default, the CPU); the "
        "coordinator's close stays on the CPU"))
    threads: int = setting(1, low=1, help=(
        "CPU threads each client computes with (the coordinator and relays take one; the "
        "held-out evaluation, the cores idle then)"))
    eval_sequences: int = setting(MAX_SEQUENCES, low=1, help=(
        "held-out sequences the first and final checkpoints are evaluated on at the end, at "
        "most (never more tokens than the run trains)"))
    eval: bool = setting(True, help=(
        "evaluate held-out loss at the end (--no-eval: the table shows training loss)"))
    resume: bool = setting(False, help=(
        "continue the run in --run-dir instead of starting anew"))
    run_dir: Path = setting(DEFAULT_RUN_DIR, help=(
        f"the embedded run's folder (the run before is kept beside it as "
        f"{DEFAULT_RUN_DIR}{PREVIOUS_SUFFIX})"))

    def __post_init__(self) -> None:
        if not self.tiers:
            raise InvalidValue("--tiers is empty; give at least one tier, e.g. --tiers 0,1,2")
        if not self.client_speeds or not all(0 < v <= 1 for v in self.client_speeds):
            raise InvalidValue("--client-speeds takes fractions in (0, 1], e.g. 1,0.5,0.25")
        if self.chaos is not None and self.kill_client_at is not None:
            raise InvalidValue("--chaos plans its own kills; leave out --kill-client-at")
        if not self.relays <= self.num_clients:
            raise InvalidValue(f"--relays must lie in [0, --num-clients], got {self.relays}: "
                               "each relay serves at least one client")
        if not self.netns and (self.link_rate or self.cut_link_at is not None):
            raise InvalidValue("--link-rate and --cut-link-at act on real links; add --netns")
        if self.relays and self.chaos is not None:
            raise InvalidValue("--chaos kills clients and the server of a run without relays; "
                               "leave out --relays")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = command_parser("local-testnet", __doc__.split("\n")[0])
    add_flags(parser, TestnetSettings)
    # undocumented knobs of the embedded run, for tests and quick looks
    parser.add_argument("--documents", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--tokens-per-round", type=int, default=DEFAULT_TOKENS_PER_ROUND,
                        help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    try:
        given = read_table(TestnetSettings, given_flags(args, TestnetSettings), "testnet",
                           Path.cwd())
    except MatformerError as err:
        parser.error(str(err))
    for f in dataclasses.fields(given):
        setattr(args, f.name, getattr(given, f.name))
    if args.device is not None:
        try:
            resolve_device(args.device)  # a device this machine lacks stops here, not in N clients
        except DeviceUnavailable as err:
            parser.error(str(err))
    return args


def prepare_run(args: argparse.Namespace) -> tuple[Path, list[str]]:
    """The run.toml to start from and the overrides besides the ports."""
    members = args.relays or args.num_clients  # what the root counts: relays, or clients
    overrides = [f"round.min_clients={members}"]
    if args.overlap is not None:
        overrides.append(f"round.overlap={str(args.overlap).lower()}")
    if args.shards > 1:
        overrides.append(f"coordinator.shards={args.shards}")
    if args.config is not None:
        if args.rounds is not None:
            overrides.append(f"round.rounds={args.rounds}")
        return args.config, overrides
    run_dir = args.run_dir
    if run_dir.exists() and not args.resume:
        set_aside(run_dir)
    data = ensure_default_data(args.documents, say)
    config = write_default_run(run_dir, data=data, min_clients=members,
                               rounds=args.rounds or DEFAULT_ROUNDS,
                               tokens_per_round=args.tokens_per_round)
    return config, overrides


def set_aside(run_dir: Path) -> None:
    """Keep the previous run as ``<run_dir>-previous`` (replacing the one kept before)."""
    kept = run_dir.with_name(run_dir.name + PREVIOUS_SUFFIX)
    if kept.exists():
        shutil.rmtree(kept)
    run_dir.rename(kept)
    say(f"[testnet] the previous run in {run_dir} is kept as {kept} (the one kept before "
        "it is removed; --resume continues a run instead)")


def hold_run_dir(args: argparse.Namespace) -> contextlib.AbstractContextManager:
    """The embedded run's folder, held by this testnet while it runs: a second testnet
    there would move the folder away under the first one's server and members."""
    if args.config is not None:
        return contextlib.nullcontext()  # the server guards a configured run's folder
    lock = args.run_dir.with_name(f".{args.run_dir.name}.lock")
    return locked(lock, f"pid {os.getpid()}, started {time.strftime('%Y-%m-%d %H:%M:%S')}")


def load_run_config(path: Path, overrides: list[str]) -> RunConfig:
    """The config the server will run (it reads the same file with the same overrides)."""
    data = tomllib.loads(path.read_text())
    return RunConfig.from_dict(apply_overrides(data, overrides), base=path.resolve().parent)


def token_env(path: Path, relays: int) -> tuple[dict[str, str], dict[str, str]]:
    """The join token for every child (the config's env var when set, else a new token),
    and the relay token for the coordinator and the relays alone; TestnetFailed where
    ``relays`` are asked of a run that grants no relay role."""
    auth = tomllib.loads(path.read_text()).get("auth", {})
    if not isinstance(auth, dict) or auth.get("mode") == "none":
        return {}, {}  # auth = "none": anyone on loopback joins
    env = {}
    for key, default, secret in (("join_token", JOIN_TOKEN_ENV, True),
                                 ("relay_token", RELAY_TOKEN_ENV, relays > 0)):
        name = auth.get(f"{key}_env")
        if isinstance(auth.get(key), str):
            env[key] = {default: auth[key]}
        elif name or key == "join_token":
            token = os.environ.get(name or default) or new_join_token()
            env[key] = {default: token, **({name: token} if name else {})}
        elif secret:
            raise TestnetFailed(f"--relays {relays}: {path} grants no relay role; add [auth] "
                                f"relay_token_env = \"{RELAY_TOKEN_ENV}\" (the testnet makes "
                                "the token) to run relays.")
    return env["join_token"], env.get("relay_token", {})


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        with hold_run_dir(args):
            return run(args)
    except FolderInUse as err:
        print(f"local-testnet: another testnet is running in {args.run_dir} ({err.holder}); "
              "wait for it to finish, stop it, or give this one its own folder with "
              "--run-dir DIR", file=sys.stderr)
        return 2


def run(args: argparse.Namespace) -> int:
    started = time.monotonic()
    try:
        config_path, overrides = prepare_run(args)
        env, relay_env = token_env(config_path, args.relays)
        os.environ.update({**env, **relay_env})  # this process reads the config too
        grpc_port, http_port = free_port(), free_port()
        while http_port == grpc_port:
            http_port = free_port()
        # the server stays up after the finish: the testnet reads its final /status, then
        # stops it
        # --netns: the server listens on its namespace's link
        host = "0.0.0.0" if args.netns else "127.0.0.1"
        overrides += [f"server.grpc_port={grpc_port}", f"server.http_port={http_port}",
                      f'server.host="{host}"', "server.stay_after_finish=true"]
        config = load_run_config(config_path, overrides)
    except (MatformerError, OSError, tomllib.TOMLDecodeError, TestnetFailed) as err:
        print(f"local-testnet: {err}", file=sys.stderr)
        return 2
    run_dir = Path(config.run.dir)
    if args.kill_client_at is not None and args.kill_client_at >= config.round.planned_rounds:
        say(f"[testnet] --kill-client-at {args.kill_client_at} is past the run's last round "
            f"({config.round.planned_rounds - 1}); no client will be killed")
    relay_ports = [free_port() for _ in range(args.relays)]
    clients = [ClientSpec(name=f"member-{i}", tier=args.tiers[i % len(args.tiers)],
                          speed=args.client_speeds[i % len(args.client_speeds)],
                          port=relay_ports[i % args.relays] if args.relays else None)
               for i in range(args.num_clients)]
    say(f"[testnet] run {config.run.id} in {run_dir}: {len(clients)} clients at tiers "
        f"{[c.tier for c in clients]}, {config.round.planned_rounds} rounds of "
        f"{config.round.tokens_per_round} tokens")
    events = []
    if args.kill_client_at is not None:
        events.append(ChaosEvent(round=args.kill_client_at, target=clients[-1].name,
                                 delay_s=0.0, down_s=RESTART_AFTER_S))
    if args.chaos is not None:
        events = chaos_plan(args.chaos, rounds=config.round.planned_rounds,
                            clients=[c.name for c in clients])
        say(f"[testnet] chaos (seed {args.chaos}): " + ", ".join(
            f"round {e.round} {e.target}" for e in events))
    cut = (LinkCut(round=args.cut_link_at, target=clients[-1].name, seconds=args.cut_s)
           if args.cut_link_at is not None else None)
    with contextlib.ExitStack() as stack:
        try:
            links = stack.enter_context(Network.open()) if args.netns else None
        except NetnsUnavailable as err:
            print(f"local-testnet: --netns: {err}", file=sys.stderr)
            return 2
        net = Testnet(TestnetPlan(
            config=config_path, overrides=overrides, grpc_port=grpc_port, http_port=http_port,
            run_dir=run_dir, clients=clients, latency_ms=args.latency_ms, busy_s=args.busy_s,
            bandwidth_mbit=args.bandwidth_mbit, device=args.device, threads=args.threads,
            events=events, tls_ca=config.tls.cert, tls_key=config.tls.key, env=env,
            relay_env=relay_env,
            relay_ports=relay_ports, links=links, link_rate_mbit=args.link_rate, cut=cut))
        return drive(args, config, net, clients, started)


def drive(args: argparse.Namespace, config: RunConfig, net: Testnet, clients: list[ClientSpec],
          started: float) -> int:
    """Run the testnet to its end and report; the exit code."""
    # `kill` and `timeout` stop the run as Ctrl-C does: the children are stopped with it
    # (each runs in its own session, so nothing else would stop them)
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        try:
            status = net.run()
        finally:
            net.stop_members()  # the server stays: its page shows the finished run meanwhile
        return finish(args, config, net, status, clients, time.monotonic() - started)
    except (TestnetFailed, NetnsError) as err:
        print(f"local-testnet: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        say("[testnet] interrupted; stopping the clients and the server")
        return 130
    finally:
        net.stop()
        signal.signal(signal.SIGTERM, previous)


def finish(args: argparse.Namespace, config: RunConfig, net: Testnet, status: dict,
           clients: list[ClientSpec], train_s: float) -> int:
    """The report of a finished run, its relays' traffic and the chaos check; the exit code.
    The server still serves the dashboard meanwhile."""
    run_dir = Path(config.run.dir)
    say(f"[testnet] the dashboard stays up at {net.http_base}/ until the report is done")
    tiers_seen = net.tiers_seen
    if args.relays:  # the root saw the relays; each client's summary says its tier
        names = [c.name for c in clients]
        tiers_seen = {n: c["tier"] for n, c in client_costs(run_dir / "clients", names).items()}
    code = report(config, status, tiers_seen, train_s,
                  eval_sequences=args.eval_sequences if args.eval else None)
    if args.relays:
        relayed = relay_traffic(status, relay_summaries(run_dir / "relays", list(net.relays)),
                                client_costs(run_dir / "clients", list(tiers_seen)))
        say("\n" + format_relay_traffic(relayed))
        add_to_summary(run_dir / "summary.json", "relays", relayed)
    if net.cut is not None:
        code = check_cut(config, net) or code
    if args.chaos is None:
        return code
    check = check_run(config, net.survivors)
    say("\n" + format_chaos(net.chaos, check))
    write_chaos(run_dir / "summary.json", args.chaos, net, check)
    if not check.passed:
        print("local-testnet: the chaos check failed (see above)", file=sys.stderr)
        return 1
    return code


def check_cut(config: RunConfig, net: Testnet) -> int:
    """The link cut's record and the run's check (every sequence trained exactly once, the
    replicas equal), printed and added to summary.json; 1 when the cut never came or the
    check failed."""
    check = check_run(config, net.survivors)
    record = {**net.cut.summary(), "rounds": check.rounds,
              "sequences_lost": len(check.audit.lost),
              "sequences_duplicated": len(check.audit.duplicated), "replicas": check.replicas,
              "passed": check.passed and net.cut.down_at is not None}
    say("\n[testnet] link cut: " + ", ".join(f"{k} {v}" for k, v in record.items()))
    add_to_summary(Path(config.run.dir) / "summary.json", "link_cut", record)
    if not record["passed"]:
        print("local-testnet: the link cut's check failed (see above)", file=sys.stderr)
        return 1
    return 0


def write_chaos(path: Path, seed: int, net: Testnet, check) -> None:
    """Add the chaos record and check to summary.json."""
    audit = check.audit
    add_to_summary(path, "chaos", {
        "seed": seed, "kills": net.chaos.kills, "client_kills": net.chaos.client_kills,
        "server_kills": net.chaos.server_kills, "skipped": len(net.chaos.skipped),
        "restart_to_round_s": net.chaos.restart_to_round_s, "rounds": check.rounds,
        "sequences_trained": audit.trained, "sequences_waiting": audit.waiting,
        "passes_complete": audit.passes_complete,
        "sequences_lost": len(audit.lost), "sequences_duplicated": len(audit.duplicated),
        "replicas": check.replicas, "passed": check.passed})


def report(config: RunConfig, status: dict, tiers_seen: dict[str, int], train_s: float, *,
           eval_sequences: int | None = MAX_SEQUENCES) -> int:
    """Evaluate the first and final checkpoints on ``eval_sequences`` held-out sequences at
    most (None: not at all), print the table, write the plot and summary; the exit code."""
    run_dir = Path(config.run.dir)
    checkpoints = status.get("checkpoints") or []
    if len(checkpoints) < 2:
        print(f"local-testnet: the run left {len(checkpoints)} checkpoints in {run_dir}; "
              "nothing to compare", file=sys.stderr)
        return 1
    tiers = sorted(config.tiers.ids())
    first, last = (run_dir / "checkpoints" / f"round-{r}"
                   for r in (checkpoints[0], checkpoints[-1]))

    initial: dict[int, float] = {}
    final: dict[int, float] = {}
    if eval_sequences is not None:
        say(f"[testnet] evaluating with {use_threads().describe()}")  # the children are gone
        held, log = HeldOut.of(config, eval_sequences), HeldOutLog(run_dir)
        for r, losses in ((checkpoints[0], initial), (checkpoints[-1], final)):
            checkpoint = run_dir / "checkpoints" / f"round-{r}"  # said first: it takes a while
            say(f"[testnet] evaluating held-out loss of {checkpoint.name} at tiers "
                f"{', '.join(map(str, tiers))} on {len(held.examples)} sequences…")
            losses.update(held.loss(checkpoint, tiers, config.tiers.tier_ids()))
            log.record(r, losses, sequences=len(held.examples))  # on the dashboard at once
    counts: dict[int, int] = {}
    for tier in tiers_seen.values():
        counts[tier] = counts.get(tier, 0) + 1
    reports = tier_reports(status, clients=counts, initial=initial, final=final)
    say(f"\nrun {status.get('run_id')}: {status.get('round')} rounds, "
        f"{status.get('tokens', 0):,} tokens in {train_s:.0f} s; "
        + (f"held-out loss of {first.name} → {last.name}\n" if final else
           "no held-out evaluation (--no-eval)\n"))
    say(format_table(reports))
    costs = client_costs(run_dir / "clients", sorted(tiers_seen))
    if costs:
        say("\n" + format_costs(costs))
    plot = write_plot(status, run_dir / "loss.png", costs)
    summary = write_summary(run_dir / "summary.json", reports, status, wall_s=round(train_s, 1),
                            first_checkpoint=first.name, final_checkpoint=last.name,
                            clients=costs)
    drawn = f"{plot}, " if plot else ""
    say(f"\nwrote {drawn}{summary}; checkpoints, tier slices and manifest in {last.parent}")
    if plot is None:
        say("no loss.png: it needs matplotlib (pip install 'matformer[plot]')")
    worse = [r.tier for r in reports if r.tier in final and not r.improved]
    if worse:
        print(f"local-testnet: the held-out loss did not fall at tier(s) {worse}; train longer "
              "or raise [update] lr", file=sys.stderr)
        return 1
    return 0


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


if __name__ == "__main__":
    sys.exit(main())
