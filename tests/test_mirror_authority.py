"""The coordinator is the authority on every round a member takes from a mirror
(client/mirror.py, docs/architecture.md "Transport"): a real coordinator on loopback, a
mirror of its HTTP side that misbehaves from round 1 on, and a member that takes the
broadcast from that mirror. However the mirror misbehaves (it lists rounds that change
nothing under round 0's weight hash, it stalls, it withholds rounds, it serves a damaged
blob under a digest of its own), the member notices at round 1, says so once naming the
mirror, takes the round from the coordinator and ends on the coordinator's master."""

from __future__ import annotations

import contextlib
import hashlib
import json
import threading
import urllib.parse
from collections.abc import Callable, Iterator

import pytest
from support.helpers import served_run_toml
from support.http import serving_http
from support.wire import HONEST_TIMEOUT_S, join_request, serving_config
from test_http_cache import get, holds_the_master, mirrored
from test_relay import ROUNDS as RELAY_ROUNDS
from test_relay import WAIT_S as RELAY_WAIT_S
from test_relay import config as relay_config
from test_relay import relay_for, run_members

import matformer.client.mirror as mirror_module
from matformer.client.mirror import unframed
from matformer.protocol.auth import session_metadata
from matformer.protocol.matformer.v1 import coordinator_pb2 as pb
from matformer.protocol.tensors import decode_tensor, encode_tensor
from matformer.protocol.updates import read_headers
from matformer.relay.upstream import rounds_of
from matformer.server.config import RunConfig
from matformer.server.update_cache import framed

ROUNDS = 3
STALL_S = 30.0  # how long the stalled mirror holds an index request (released at the end)
MIRROR_TIMEOUT_S = 1.0  # the member's patience with the mirror here
Entry = dict[str, object]
# what a bad mirror lists instead of a round's messages (from round 1 on), given them and
# round 0's header at the same tier
Forgery = Callable[[list[pb.UpdateMessage], pb.RoundUpdateHeader], list[pb.UpdateMessage]]


class BadMirror:
    """A mirror of the coordinator's HTTP side at ``base``, honest about round 0. From round
    1 on, its index ``stall``s, lists no round (``withhold``), or lists
    ``forge(messages, round_0)`` in place of each round's messages, as a blob under its own
    digest."""

    def __init__(self, *, forge: Forgery | None = None, stall: bool = False,
                 withhold: bool = False) -> None:
        self.base = ""  # the coordinator's HTTP side, once it serves
        self.forge, self.stall, self.withhold = forge, stall, withhold
        self.forged: dict[str, bytes] = {}  # digest → a blob this mirror made up
        self.released = threading.Event()

    def answer(self, path: str) -> tuple[int, bytes]:
        if path.startswith("/blobs/sha256/") and path[-64:] in self.forged:
            return 200, self.forged[path[-64:]]
        status, _, body = get(self.base + path)
        if not path.startswith("/updates") or status != 200:
            return status, body
        index = json.loads(body)
        since = int(urllib.parse.parse_qs(urllib.parse.urlsplit(path).query)["since_round"][0])
        if since >= 1 and self.stall:
            self.released.wait(STALL_S)
        if self.withhold:
            index["updates"] = [e for e in index["updates"] if e["round"] < 1]
        elif self.forge is not None:
            index["updates"] = [self._forged(e) if e["round"] >= 1 else e
                                for e in index["updates"]]
        return 200, json.dumps(index).encode()

    def _forged(self, entry: Entry) -> Entry:
        first = json.loads(get(f"{self.base}/updates?since_round=0&tier={entry['tier']}")[2])
        [round_0] = [m.header for m in self._messages(first["updates"][0])
                     if m.HasField("header")]
        data = framed(self.forge(self._messages(entry), round_0))
        digest = hashlib.sha256(data).hexdigest()
        self.forged[digest] = data
        return {**entry, "sha256": digest, "bytes": len(data), "url": f"/blobs/sha256/{digest}"}

    def _messages(self, entry: Entry) -> list[pb.UpdateMessage]:
        return list(unframed(get(self.base + str(entry["url"]))[2]))


@contextlib.contextmanager
def serving_mirror(mirror: BadMirror) -> Iterator[str]:
    """``mirror`` on a loopback port; its base URL."""
    with serving_http(mirror.answer) as url:
        try:
            yield url
        finally:
            mirror.released.set()  # a stalled answer ends before the server does


def nothing_under_round_0s_hash(messages: list[pb.UpdateMessage],
                                round_0: pb.RoundUpdateHeader) -> list[pb.UpdateMessage]:
    """The round with no parameter updates, under the weight hash after round 0: a replica
    that applies it stays on round 0's weights, and its hash agrees with the blob's."""
    header = next(m.header for m in messages if m.HasField("header"))
    header.weight_hash, header.parameters = round_0.weight_hash, 0
    return [pb.UpdateMessage(header=header)]


def one_off_values(messages: list[pb.UpdateMessage],
                   round_0: pb.RoundUpdateHeader) -> list[pb.UpdateMessage]:
    """The round with its header intact and every value of its first step one higher: only
    applying it shows the damage."""
    step = next(m.parameters.parameters[0] for m in messages if m.HasField("parameters"))
    step.values.CopyFrom(encode_tensor(decode_tensor(step.values, "values") + 1))
    return messages


def member_through(tmp_path, mirror: BadMirror, *, overlap: bool = False):
    """A three-round run whose one member takes the broadcast from ``mirror``: the member,
    its log, and whether its replica is the coordinator's master at the end."""
    config = RunConfig.load(served_run_toml(tmp_path, round={
        "min_clients": 1, "deadline_s": 60.0, "tokens_per_round": 1024, "rounds": ROUNDS,
        "overlap": overlap}))
    logs: list[str] = []
    with serving_config(config) as (server, _):
        mirror.base = f"http://127.0.0.1:{server.http_port}"
        with serving_mirror(mirror) as url:
            member = mirrored(server, tmp_path, url, logs)
            member.broadcast.mirror.timeout_s = MIRROR_TIMEOUT_S
            summary = member.run()
            master = holds_the_master(server, member)
    assert summary.finished and summary.rounds_trained == ROUNDS
    return member, logs, master, url


def warning(logs: list[str], url: str) -> str:
    """The one line that says the mirror failed."""
    said = [line for line in logs if line.startswith("the mirror ")]
    assert len(said) == 1, logs
    assert said[0].startswith(f"the mirror {url} failed for ") and "over gRPC" in said[0]
    return said[0]


@pytest.mark.parametrize("overlap", [False, True], ids=["synchronous", "overlapped"])
def test_a_mirror_listing_empty_rounds_under_round_0s_hash_is_caught_at_round_1(
        tmp_path, monkeypatch, overlap):
    monkeypatch.setattr(mirror_module, "MIRROR_REST_S", 0.0)  # tried again every round
    mirror = BadMirror(forge=nothing_under_round_0s_hash)
    member, logs, master, url = member_through(tmp_path, mirror, overlap=overlap)
    assert master
    said = warning(logs, url)
    assert "updates from round 1: it lists round 1 with 0 parameter updates" in said, said
    # every round it lied about was taken from the coordinator, none applied
    assert member.broadcast.fallbacks == ROUNDS - 1 and member.summary.resynchronisations == 0
    assert mirror.forged


@pytest.mark.parametrize("fault", ["stall", "withhold"])
def test_a_mirror_that_stalls_or_withholds_a_closed_round_is_caught_at_round_1(
        tmp_path, fault):
    mirror = BadMirror(**{fault: True})
    member, logs, master, url = member_through(tmp_path, mirror)
    assert master
    said = warning(logs, url)
    assert "for updates from round 1: " in said, said
    assert ("timed out" in said if fault == "stall"
            else "it lists 0 rounds from round 1 on, while the coordinator has closed 1"
            in said), said
    # resting after it, the mirror was not asked again in a three-round run
    assert member.broadcast.fallbacks == 1 and member.summary.resynchronisations == 0


def test_a_mirror_serving_a_damaged_round_under_its_own_digest_is_caught_at_round_1(
        tmp_path, monkeypatch):
    monkeypatch.setattr(mirror_module, "MIRROR_REST_S", 0.0)  # tried again every round
    mirror = BadMirror(forge=one_off_values)
    member, logs, master, url = member_through(tmp_path, mirror)
    assert master
    said = warning(logs, url)
    assert "for round 1: its update of round 1 carries the coordinator's header, but " in said
    # each damaged round applied, then undone: the latest checkpoint reloaded and the rounds
    # since replayed from the coordinator, though the mirror no longer rests by then
    assert member.summary.resynchronisations == member.broadcast.fallbacks == ROUNDS - 1
    assert mirror.forged


@pytest.mark.parametrize("fault", ["forge", "withhold"])
def test_a_relays_mirror_is_checked_against_the_roots_headers(tmp_path, monkeypatch, fault):
    """A relay with --mirror takes a round from it only as the root's headers say it closed:
    a mirror that lists round 1 with no parameter updates under round 0's hash, or withholds
    it, is caught at round 1, said once naming the mirror, and the relay's members get the
    root's rounds."""
    monkeypatch.setattr(mirror_module, "MIRROR_REST_S", 0.0)  # tried again every round
    mirror = BadMirror(**({"forge": nothing_under_round_0s_hash} if fault == "forge"
                          else {"withhold": True}))
    logs: list[str] = []
    with serving_config(relay_config(tmp_path, min_clients=1)) as (server, stub):
        mirror.base = f"http://127.0.0.1:{server.http_port}"
        with serving_mirror(mirror) as url:
            relay = relay_for(server, tmp_path, mirror=url, log=logs.append)
            try:
                run_members(f"127.0.0.1:{relay.port}", server, rounds=RELAY_ROUNDS)
                root = server.service.coordinator
                root.wait_for_round(RELAY_ROUNDS - 1, RELAY_WAIT_S)
                cache = relay.relay.updates
                reader = stub.Join(join_request(server, name="reader"), timeout=HONEST_TIMEOUT_S)
                for tier in (0, 1):
                    served = [h for _, messages in rounds_of(cache.messages(0, tier, 0.0))
                              for h in read_headers(messages)]
                    published = [h for _, messages in rounds_of(root_updates(stub, reader, tier))
                                 for h in read_headers(messages)]
                    assert served == published and len(served) == RELAY_ROUNDS, tier
            finally:
                relay.stop("done")
    said = warning(logs, url)
    assert "for updates from round 1: " in said, said
    assert ("it lists round 1 with 0 parameter updates" in said if fault == "forge"
            else "it lists 0 rounds from round 1 on, while the coordinator has closed" in said)
    assert relay.relay.updates.source.fallbacks >= 1


def root_updates(stub, reader: pb.JoinReply, tier: int) -> list[pb.UpdateMessage]:
    """Every round the root logged, at ``tier``, as a member of its own reads them."""
    return list(stub.GetUpdates(pb.GetUpdatesRequest(since_round=0, tier=tier),
                                metadata=session_metadata(reader.session_token),
                                timeout=HONEST_TIMEOUT_S))
