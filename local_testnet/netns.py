"""Real links for the testnet (``--netns``): each process in a network namespace of its own,
joined over a veth pair to one bridge, with a rate per link and scripted link faults.

    with Network.open() as net:           # NetnsUnavailable without root or `ip netns`
        net.add("server")                 # a namespace, its link, its address
        net.add("member-0", rate_mbit=2)  # tc tbf on both ends of its link
        argv = net.wrap("member-0", [...])                   # ip netns exec <namespace> ...
        net.down("member-0", seconds=5)                      # the link down, then up again
        net.flap("member-0", times=3, down_s=1, up_s=1)      # down and up, again and again
        if net.wait_for_upload("member-0"):                  # its upload under way: cut it
            net.down("member-0", seconds=30)

A hub namespace holds the bridge; a node's namespace holds ``eth0``, a veth whose peer is on
the bridge, at ``10.A.B.n/24``. This namespace joins the bridge too, at ``.254``, so the
testnet reaches the coordinator's ports. A link goes down at its hub end: the node's end
loses carrier, packets both ways are dropped, and neither side's TCP hears a FIN or a RST, a
half-open connection, as when a home router loses its uplink. A rate is a tc tbf on each
end, which shapes what that end sends: the node's end its upload, the hub's its download.

Every namespace and this namespace's veth are named with one prefix drawn per network
(``mf`` and 8 hex digits), so networks of parallel tests never collide, and leaving the
``with`` deletes them all, also on error.
"""

from __future__ import annotations

import ipaddress
import json
import os
import random
import secrets
import shutil
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from matformer.modeling.errors import MatformerError

HOST_OCTET = 254  # this namespace's address on the bridge
NODE_IF = "eth0"  # a node's end of its link, in its namespace
BRIDGE = "bridge0"
BURST_S = 0.005  # tbf's bucket: 5 ms of the rate (at least BURST_MIN bytes)
BURST_MIN = 3200
QUEUE_S = 0.5  # tbf queues this long before it drops
SAMPLE_S = 0.05  # how often wait_for_upload reads a link's byte counter
UPLOAD_BYTES = 2048  # sent within UPLOAD_WINDOW_S: an upload, not heartbeats and acks
UPLOAD_WINDOW_S = 0.5


class NetnsUnavailable(MatformerError):
    """This machine cannot make namespaces here: not root, or no ``ip netns``. Tests skip on
    it unless ``MATFORMER_REQUIRE_NETNS=1``."""


class NetnsError(MatformerError):
    """An ``ip`` or ``tc`` command failed; the message holds the command and its error."""


@dataclass(kw_only=True, slots=True)
class Node:
    name: str  # the process's name in the testnet ("server", "member-0")
    namespace: str
    address: str  # on the bridge
    hub_end: str  # its link's end on the bridge, in the hub namespace


@dataclass(kw_only=True)
class Network:
    prefix: str  # of every namespace and link this network makes
    subnet: ipaddress.IPv4Network
    nodes: dict[str, Node] = field(default_factory=dict)

    @property
    def hub(self) -> str:
        return f"{self.prefix}-hub"

    @property
    def host_address(self) -> str:
        """This namespace's address on the bridge."""
        return str(self.subnet[HOST_OCTET])

    @classmethod
    @contextmanager
    def open(cls) -> Iterator[Network]:
        """A new network with its hub and this namespace's link; deleted on leaving."""
        check_privilege()
        net = cls(prefix=f"mf{secrets.token_hex(4)}", subnet=free_subnet())
        try:
            net._make_hub()
            yield net
        finally:
            net.delete()

    def _make_hub(self) -> None:
        ip("netns", "add", self.hub)
        ip("-n", self.hub, "link", "set", "lo", "up")
        ip("-n", self.hub, "link", "add", "name", BRIDGE, "type", "bridge")
        ip("-n", self.hub, "link", "set", BRIDGE, "up")
        # this namespace's end carries the prefix: it is the one name outside the namespaces
        ip("link", "add", self.prefix, "type", "veth", "peer", "name", "host", "netns", self.hub)
        ip("-n", self.hub, "link", "set", "host", "master", BRIDGE, "up")
        ip("addr", "add", f"{self.host_address}/{self.subnet.prefixlen}", "dev", self.prefix)
        ip("link", "set", self.prefix, "up")

    def add(self, name: str, *, rate_mbit: float = 0.0) -> Node:
        """A namespace for ``name`` linked to the bridge (at ``rate_mbit`` each way; 0: none)."""
        index = len(self.nodes) + 1
        node = Node(name=name, namespace=f"{self.prefix}-{index}", hub_end=f"link{index}",
                    address=str(self.subnet[index]))
        ip("netns", "add", node.namespace)
        self.nodes[name] = node
        ip("-n", node.namespace, "link", "set", "lo", "up")
        ip("link", "add", NODE_IF, "netns", node.namespace, "type", "veth", "peer", "name",
           node.hub_end, "netns", self.hub)
        ip("-n", self.hub, "link", "set", node.hub_end, "master", BRIDGE, "up")
        ip("-n", node.namespace, "addr", "add", f"{node.address}/{self.subnet.prefixlen}",
           "dev", NODE_IF)
        ip("-n", node.namespace, "link", "set", NODE_IF, "up")
        if rate_mbit:
            shape(node.namespace, NODE_IF, rate_mbit)  # its upload
            shape(self.hub, node.hub_end, rate_mbit)  # its download
        return node

    def wrap(self, name: str, argv: list[str]) -> list[str]:
        """``argv`` run in ``name``'s namespace (``ip netns exec`` execs it: same pid)."""
        return ["ip", "netns", "exec", self.nodes[name].namespace, *argv]

    def address(self, name: str) -> str:
        return self.nodes[name].address

    # -- faults ---------------------------------------------------------------------------

    def set_link(self, name: str, *, up: bool) -> None:
        """``name``'s link up or down at its hub end: no FIN, no RST reaches either side."""
        ip("-n", self.hub, "link", "set", self.nodes[name].hub_end, "up" if up else "down")

    def down(self, name: str, *, seconds: float) -> None:
        """``name``'s link down for ``seconds``, then up again."""
        self.set_link(name, up=False)
        try:
            time.sleep(seconds)
        finally:
            self.set_link(name, up=True)

    def flap(self, name: str, *, times: int, down_s: float, up_s: float) -> None:
        """``name``'s link down ``down_s`` and up ``up_s``, ``times`` over."""
        for _ in range(times):
            self.down(name, seconds=down_s)
            time.sleep(up_s)

    def wait_for_upload(self, name: str, *, wait_s: float = 60.0) -> bool:
        """Return once ``name`` sends more than a heartbeat's worth (UPLOAD_BYTES within
        UPLOAD_WINDOW_S): an upload is under way, the moment to cut it. False when none came
        within ``wait_s``."""
        samples: list[tuple[float, int]] = []
        give_up = time.monotonic() + wait_s
        while time.monotonic() < give_up:
            now = time.monotonic()
            samples = [(t, b) for t, b in samples if now - t <= UPLOAD_WINDOW_S]
            samples.append((now, self.sent_bytes(name)))
            if samples[-1][1] - samples[0][1] >= UPLOAD_BYTES:
                return True
            time.sleep(SAMPLE_S)
        return False

    def sent_bytes(self, name: str) -> int:
        """Bytes ``name``'s end of its link has sent."""
        node = self.nodes[name]
        [link] = json.loads(ip("-n", node.namespace, "-j", "-s", "link", "show", NODE_IF))
        return int(link["stats64"]["tx"]["bytes"])

    def delete(self) -> None:
        """Every namespace (with its links and the bridge) and this namespace's link."""
        run_quietly(["ip", "link", "del", self.prefix])
        for namespace in [*(n.namespace for n in self.nodes.values()), self.hub]:
            run_quietly(["ip", "netns", "del", namespace])


def check_privilege() -> None:
    """NetnsUnavailable unless this process may make namespaces, links and qdiscs."""
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        raise NetnsUnavailable(f"{' and '.join(missing)} not found: install iproute2 "
                               "(apt-get install iproute2)")
    if os.geteuid() != 0:
        raise NetnsUnavailable("network namespaces need root (CAP_NET_ADMIN and CAP_SYS_ADMIN); "
                               "run as root, or leave out --netns")
    probe = f"mf{secrets.token_hex(4)}-probe"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        raise NetnsUnavailable(f"`ip netns add` failed: {made.stderr.strip()} (a container "
                               "without CAP_SYS_ADMIN cannot make namespaces)")
    run_quietly(["ip", "netns", "del", probe])


def free_subnet() -> ipaddress.IPv4Network:
    """A /24 in 10.200.0.0/13 that no address or route of this namespace touches."""
    used = [ipaddress.ip_network(r["dst"], strict=False)
            for r in json.loads(ip("-j", "-4", "route", "show", "table", "all"))
            if r.get("dst", "default") not in ("default", "")]
    for _ in range(100):
        octets = random.randint(200, 207), random.randint(0, 255)
        subnet = ipaddress.ip_network(f"10.{octets[0]}.{octets[1]}.0/24")
        if not any(subnet.overlaps(u) for u in used):
            return subnet
    raise NetnsError("no free /24 in 10.200.0.0/13 for the testnet's bridge")


def shape(namespace: str, device: str, rate_mbit: float) -> None:
    """What ``device`` sends held to ``rate_mbit`` (tc tbf)."""
    rate = rate_mbit * 1e6 / 8  # bytes per second
    burst = max(int(rate * BURST_S), BURST_MIN)
    tc = ["tc", "-n", namespace, "qdisc", "add", "dev", device, "root", "tbf", "rate",
          f"{int(rate_mbit * 1e6)}bit", "burst", str(burst), "latency", f"{int(QUEUE_S * 1e3)}ms"]
    command(tc)


def ip(*args: str) -> str:
    return command(["ip", *args])


def command(argv: list[str]) -> str:
    """Run ``argv``; its output, or NetnsError with its error."""
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0:
        raise NetnsError(f"`{' '.join(argv)}` failed: {done.stderr.strip()}")
    return done.stdout


def run_quietly(argv: list[str]) -> None:
    """Cleanup: whatever is already gone stays gone."""
    subprocess.run(argv, capture_output=True)
