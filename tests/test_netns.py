"""Network faults on real links (local_testnet/netns.py): each process in a namespace of its
own, joined over veth pairs to a bridge, a member's link set down mid-upload. Needs root and
`ip netns`; without them these tests skip, unless MATFORMER_REQUIRE_NETNS=1 (.ci/run sets
it), which turns a missing privilege into a failure."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from support.helpers import local_testnet_toml, run_testnet

from matformer.local_testnet.netns import NetnsUnavailable, Network, check_privilege
from matformer.modeling.mdat import build_default_mdat

REPO = Path(__file__).resolve().parents[1]
REQUIRE_NETNS = "MATFORMER_REQUIRE_NETNS"
# Read at import: conftest.py clears every MATFORMER_* variable before each test runs.
NETNS_REQUIRED = os.environ.get(REQUIRE_NETNS) == "1"
HEARTBEAT_S, TIMEOUT_S = 0.5, 2.0
ROUNDS = 14  # the run outlasts the cut and TCP's next retransmission after it
CUT_S = 4.0  # twice the heartbeat timeout: the coordinator must drop the member
MARGIN_S = 2.0  # the coordinator sweeps for silence between calls; a busy machine is late


@pytest.fixture(autouse=True)
def privileged() -> None:
    try:
        check_privilege()
    except NetnsUnavailable as err:
        if NETNS_REQUIRED:
            pytest.fail(f"{REQUIRE_NETNS}=1 but {err}")
        pytest.skip(str(err))


def namespaces() -> str:
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


# -- the harness -----------------------------------------------------------------------------

def test_a_network_leaves_nothing_behind_also_on_error():
    with pytest.raises(RuntimeError, match="boom"), Network.open() as net:
        net.add("a", rate_mbit=2)
        assert net.prefix in namespaces()
        raise RuntimeError("boom")
    assert net.prefix not in namespaces()
    links = subprocess.run(["ip", "link", "show"], capture_output=True, text=True).stdout
    assert net.prefix not in links


def test_two_networks_at_once_do_not_collide():
    with Network.open() as one, Network.open() as two:
        assert one.prefix != two.prefix and not one.subnet.overlaps(two.subnet)
        one.add("a")
        two.add("a")


def test_a_rate_is_a_tbf_on_both_ends_of_the_link():
    with Network.open() as net:
        node = net.add("member", rate_mbit=2)
        for namespace, device in ((node.namespace, "eth0"), (net.hub, node.hub_end)):
            shown = subprocess.run(["tc", "-n", namespace, "qdisc", "show", "dev", device],
                                   capture_output=True, text=True).stdout
            assert "tbf" in shown and "rate 2Mbit" in shown, shown


RECEIVER = """\
import socket
server = socket.create_server(("0.0.0.0", 9000))
peer, _ = server.accept()
got = 0
while data := peer.recv(65536):
    got += len(data)
print(got)
"""


def test_tcp_rides_out_a_flapping_link():
    """A stream through three short outages arrives whole: a link down is silence, never a
    RST."""
    payload = 400_000
    with Network.open() as net:
        net.add("receiver")
        net.add("sender", rate_mbit=4)
        receiver = subprocess.Popen(net.wrap("receiver", [sys.executable, "-c", RECEIVER]),
                                    stdout=subprocess.PIPE, text=True)
        sender = subprocess.Popen(net.wrap("sender", [sys.executable, "-c", (
            "import socket, time\ntime.sleep(0.5)\n"
            f"s = socket.create_connection(('{net.address('receiver')}', 9000), timeout=60)\n"
            f"s.sendall(b'x' * {payload})\ns.close()")]))
        net.flap("sender", times=3, down_s=0.3, up_s=0.2)
        assert sender.wait(timeout=60) == 0
        out, _ = receiver.communicate(timeout=60)
        assert int(out) == payload


def test_without_root_the_harness_says_what_it_needs(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(NetnsUnavailable, match="need root"):
        check_privilege()


# -- a member's link cut mid-upload ----------------------------------------------------------

@pytest.fixture(scope="module")
def cut_run(tmp_path_factory) -> tuple[dict, str]:
    """One run of two members over real links at 1 Mbit/s, member-1's link down for CUT_S
    while it uploads its round 2 (dense results: about 90 KiB, most of a second on the link):
    its summary's ``link_cut`` record and the log."""
    try:
        check_privilege()
    except NetnsUnavailable as err:
        pytest.skip(str(err))  # the autouse fixture fails it where required
    folder = tmp_path_factory.mktemp("cut")
    build_default_mdat(folder / "d.mdat", limit=20).close()
    config = local_testnet_toml(
        folder / "run.toml", deadline=10.0, tokens=1024, rounds=ROUNDS,
        compression={"encoding": "dense"},
        faults={"heartbeat_s": HEARTBEAT_S, "heartbeat_timeout_s": TIMEOUT_S})
    result = run_testnet(
        [sys.executable, "-m", "matformer.local_testnet.main", "--netns", "--link-rate", "1",
         "--num-clients", "2", "--tiers", "0,1", "--config", str(config), "--no-eval",
         "--cut-link-at", "2", "--cut-s", str(CUT_S)], cwd=REPO, timeout=120)
    log = result.stdout + result.stderr
    assert result.returncode == 0, log[-5000:]
    return json.loads((folder / "run" / "summary.json").read_text())["link_cut"], log


def test_a_member_cut_mid_upload_comes_back_and_no_sequence_is_lost(cut_run):
    cut, log = cut_run
    assert cut["cut"] and cut["round"] >= 2, cut
    assert "member-1's link goes down mid-upload" in log
    assert cut["recovered_s"] is not None, log[-5000:]  # its results were taken again
    assert cut["sequences_lost"] == 0 and cut["sequences_duplicated"] == 0, cut
    assert cut["rounds"] == ROUNDS


def test_the_coordinator_drops_a_half_open_member_within_the_heartbeat_timeout(cut_run):
    cut, log = cut_run
    assert cut["coordinator_noticed_s"] is not None, log[-5000:]
    # the member's last call came up to a heartbeat before the cut
    assert TIMEOUT_S - HEARTBEAT_S - 0.1 <= cut["coordinator_noticed_s"] <= TIMEOUT_S + MARGIN_S
    assert "drop member-1" in log and "silent for" in log


def test_the_member_notices_a_half_open_connection_within_the_heartbeat_timeout(cut_run):
    cut, _ = cut_run
    assert cut["member_noticed_s"] is not None and cut["member_noticed_s"] <= (
        TIMEOUT_S + MARGIN_S), cut


def test_replicas_are_equal_after_the_partition(cut_run):
    cut, _ = cut_run
    assert cut["replicas"] == {"member-0": "equal", "member-1": "equal"}, cut
    assert cut["passed"]
