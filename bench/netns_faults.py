"""How long is a member cut off by a dead link gone, and who notices? A real partition, on
real links (local_testnet/netns.py; needs root and `ip netns`).

One ``local-testnet --netns`` run: the coordinator and two members, each in a network
namespace of its own over a veth link (members at ``--link-rate`` Mbit/s each way, tc tbf),
results dense so that an upload takes most of a second on the link. Once round
``--cut-at`` is open, member-1's link goes down as soon as its upload is under way, for
``--cut-s``: no process dies and no FIN or RST is sent, so both ends hold a half-open
connection. From the children's own lines (``testnet.CutRecord``):

- ``coordinator_noticed_s``: from the cut until the coordinator drops the member for silence
  (the reference: ``[faults] heartbeat_timeout_s``);
- ``member_noticed_s``: from the cut until the member says the coordinator does not answer
  (null: it said nothing while the link was down);
- ``recovered_s``: from the link coming back until the member's next results are taken;
- ``sequences_lost`` (must be 0) and ``replicas_equal``, from the ledger audit and the
  weight hashes at the end (``chaos.check_run``).

Printed: the figures and ``recovery / heartbeat timeout`` and ``coordinator detection /
heartbeat timeout``, both against the timeout measured in the same run's settings.
``--json OUT`` writes ``cut_s``, ``heartbeat_timeout_s``, ``coordinator_noticed_s``,
``member_noticed_s``, ``recovered_s``, ``recovery_over_timeout``, ``sequences_lost``,
``replicas_equal``.

    python bench/netns_faults.py                     # a 30 s cut, 100 rounds (~2 min)
    python bench/netns_faults.py --cut-s 60 --link-rate 0.5 --json runs/netns_faults.json
    python bench/netns_faults.py --smoke             # a 3 s cut in round 1 of 12: it runs
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from harness import parse, print_table

from matformer.modeling.mdat import build_default_mdat

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from support.helpers import local_testnet_toml

SMOKE = dict(cut_s=3.0, cut_at=1, rounds=12, heartbeat_timeout_s=1.5)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cut-s", type=float, default=30.0, help="how long the link is down")
    parser.add_argument("--cut-at", type=int, default=2, help="the round the cut waits for")
    parser.add_argument("--rounds", type=int, default=100,
                        help="the run's rounds: enough to outlast the cut and the recovery")
    parser.add_argument("--link-rate", type=float, default=1.0, help="Mbit/s per member link")
    parser.add_argument("--heartbeat-timeout-s", type=float, default=3.0)
    parser.add_argument("--json", type=Path, default=None, help="write the figures here")
    args = parse(parser, SMOKE, argv)
    with tempfile.TemporaryDirectory() as folder:
        cut = cut_run(Path(folder), args)
    timeout = args.heartbeat_timeout_s
    figures = {
        "cut_s": args.cut_s, "heartbeat_timeout_s": timeout,
        "coordinator_noticed_s": cut["coordinator_noticed_s"],
        "member_noticed_s": cut["member_noticed_s"], "recovered_s": cut["recovered_s"],
        "recovery_over_timeout": ratio(cut["recovered_s"], timeout),
        "sequences_lost": cut["sequences_lost"],
        "replicas_equal": set(cut["replicas"].values()) == {"equal"},
    }
    print(f"{sys.version.split()[0]} | 2 members at {args.link_rate:g} Mbit/s, member-1's "
          f"link down {args.cut_s:g} s mid-upload | heartbeat_timeout_s {timeout:g}")
    print_table(["coordinator noticed s", "member noticed s", "recovered s",
                 "recovery / heartbeat timeout", "coordinator detection / heartbeat timeout",
                 "sequences lost", "replicas"],
                [[show(cut["coordinator_noticed_s"]), show(cut["member_noticed_s"]),
                  show(cut["recovered_s"]), show(figures["recovery_over_timeout"]),
                  show(ratio(cut["coordinator_noticed_s"], timeout)),
                  str(cut["sequences_lost"]),
                  "equal" if figures["replicas_equal"] else str(cut["replicas"])]])
    if args.json is not None:
        args.json.write_text(json.dumps(figures, indent=1) + "\n")
    if cut["sequences_lost"] or not figures["replicas_equal"]:
        sys.exit("netns_faults: the partition lost sequences or left replicas apart")


def cut_run(folder: Path, args: argparse.Namespace) -> dict:
    """The testnet's ``link_cut`` record of one run with a cut."""
    build_default_mdat(folder / "d.mdat", limit=40).close()
    config = local_testnet_toml(
        folder / "run.toml", deadline=30.0, tokens=1024, rounds=args.rounds,
        compression={"encoding": "dense"},  # an upload of most of a second: cut inside it
        faults={"heartbeat_s": args.heartbeat_timeout_s / 4,
                "heartbeat_timeout_s": args.heartbeat_timeout_s})
    done = subprocess.run(
        [sys.executable, "-m", "matformer.local_testnet.main", "--netns", "--num-clients", "2",
         "--tiers", "0,1", "--config", str(config), "--no-eval", "--link-rate",
         str(args.link_rate), "--cut-link-at", str(args.cut_at), "--cut-s", str(args.cut_s)],
        capture_output=True, text=True)
    summary = folder / "run" / "summary.json"
    if done.returncode != 0 or not summary.is_file():
        sys.exit(f"netns_faults: the testnet failed ({done.returncode}):\n"
                 f"{(done.stdout + done.stderr)[-4000:]}")
    return json.loads(summary.read_text())["link_cut"]


def ratio(seconds: float | None, reference: float) -> float | None:
    return None if seconds is None else round(seconds / reference, 2)


def show(value: float | None) -> str:
    return "-" if value is None else f"{value:g}"


if __name__ == "__main__":
    main()
