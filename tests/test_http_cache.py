"""The broadcast as immutable HTTP resources (server/blobs.py) and a member that takes it from
a mirror (client/mirror.py), behind a real caching proxy: Debian's nginx, which .ci/run
installs and requires (MATFORMER_REQUIRE_NGINX=1 turns a missing nginx into a failure).
The proxy tests run a real coordinator on loopback, nginx in front of its HTTP port, and
count on the coordinator the bodies it sent: behind the cache, one per blob."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import http.client
import http.server
import json
import os
import socket
import subprocess
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import pytest
from support.helpers import JOIN_TOKEN, served_run_toml
from support.http import serving_http
from support.rounds import committed, flat_results, same
from support.wire import header_of, joined, serving, serving_config

import matformer.client.mirror as mirror_module
import matformer.server.blobs as blobs_module
from matformer.client.errors import ClientError
from matformer.client.federated import FederatedClient, FederatedOptions
from matformer.client.mirror import HttpMirror, unframed
from matformer.modeling.compression import region_slices
from matformer.modeling.naming import canonical_state_dict
from matformer.protocol.matformer.v1 import coordinator_pb2 as pb
from matformer.protocol.submission import submission_messages
from matformer.protocol.updates import read_updates, update_messages
from matformer.server.blobs import IMMUTABLE, Commits, byte_range
from matformer.server.config import RunConfig
from matformer.server.update_cache import framed

NGINX = Path("/usr/sbin/nginx")
REQUIRE_NGINX = "MATFORMER_REQUIRE_NGINX"
# Read at import: conftest.py clears every MATFORMER_* variable before each test runs.
NGINX_REQUIRED = os.environ.get(REQUIRE_NGINX) == "1"
MEMBERS = 32  # downloading each round at once through the proxy
ROUNDS = 3
TIERS = (0, 1)  # served_run_toml's
WAIT_S = 120.0  # generous: a busy two-core machine runs these
NGINX_CONF = """\
{user}worker_processes 1;
pid {dir}/nginx.pid;
events {{ worker_connections 512; }}
http {{
    access_log {dir}/access.log;
    client_body_temp_path {dir}/body;
    proxy_temp_path {dir}/proxy;
    fastcgi_temp_path {dir}/fastcgi;
    uwsgi_temp_path {dir}/uwsgi;
    scgi_temp_path {dir}/scgi;
    proxy_cache_path {dir}/cache levels=1:2 keys_zone=broadcast:10m max_size=1g inactive=7d
                     use_temp_path=off;
    server {{
        listen 127.0.0.1:{port};
        # what is kept, and how long, is what the coordinator's Cache-Control says (blobs a
        # year, the index and misses never): no proxy_cache_valid
        proxy_cache broadcast;
        add_header X-Cache-Status $upstream_cache_status always;
        location /blobs/ {{
            proxy_pass http://127.0.0.1:{upstream};
            proxy_cache_lock on;  # members asking at once: one fetch upstream, the rest wait
            proxy_cache_lock_timeout 120s;
            proxy_cache_lock_age 120s;
        }}
        location / {{
            proxy_pass http://127.0.0.1:{upstream};
            proxy_read_timeout 120s;  # an index request may wait for its round to close
        }}
    }}
}}
"""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def caching_proxy(tmp_path: Path, upstream: int) -> Iterator[str]:
    """nginx on a loopback port, caching what ``upstream`` (an HTTP port) answers as its
    headers allow; its base URL. The process is this test's, stopped on exit."""
    if not NGINX.is_file():
        message = f"{NGINX} not found: install Debian's nginx (apt-get install nginx)"
        if NGINX_REQUIRED:
            pytest.fail(f"{REQUIRE_NGINX}=1 but {message}")
        pytest.skip(message)
    folder = tmp_path / "nginx"
    folder.mkdir()
    port = free_port()
    conf = folder / "nginx.conf"
    conf.write_text(NGINX_CONF.format(dir=folder, port=port, upstream=upstream,
                                      user="user root;\n" if os.geteuid() == 0 else ""))
    log = folder / "error.log"
    process = subprocess.Popen([str(NGINX), "-p", str(folder), "-e", str(log), "-c", str(conf),
                                "-g", "daemon off;"], stdout=subprocess.DEVNULL,
                               stderr=subprocess.STDOUT)
    try:
        give_up = time.monotonic() + WAIT_S
        while True:
            if process.poll() is not None:
                pytest.fail(f"nginx exited with {process.returncode}: "
                            f"{log.read_text() if log.exists() else '(no log)'}")
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 1):
                break
            assert time.monotonic() < give_up, "nginx did not listen within its time"
            time.sleep(0.05)
        yield f"http://127.0.0.1:{port}"
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def get(url: str, headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
    """Status, headers (lowercase names) and body of a GET, whatever its status."""
    request = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=WAIT_S) as reply:
            return reply.status, {k.lower(): v for k, v in reply.headers.items()}, reply.read()
    except urllib.error.HTTPError as err:
        return err.code, {k.lower(): v for k, v in err.headers.items()}, err.read()


class Member:
    """One member closing rounds over gRPC with flat results: the run's only member."""

    def __init__(self, server, stub) -> None:
        self.server, self.stub = server, stub
        self.reply, self.auth, self.work = joined(stub, server, "alice")
        self.coordinator = server.service.coordinator

    def close_rounds(self, rounds: int) -> None:
        for _ in range(rounds):
            self.stub.SubmitResult(submission_messages(
                header_of(self.reply, self.work),
                flat_results(self.coordinator, self.reply.client_id)),
                metadata=self.auth, timeout=WAIT_S)
            committed(self.coordinator, self.work.round + 1, WAIT_S)
            self.work = self.stub.GetRound(pb.GetRoundRequest(), metadata=self.auth,
                                           timeout=WAIT_S)

    def messages(self, tier: int, since_round: int = 0) -> list[pb.UpdateMessage]:
        """The logged rounds' GetUpdates messages at ``tier``."""
        return list(self.stub.GetUpdates(pb.GetUpdatesRequest(since_round=since_round,
                                                              tier=tier),
                                         metadata=self.auth, timeout=WAIT_S))


def blobs_of(server):
    """The coordinator's BlobStore: what it served, per digest."""
    return server.http_server.config.app.state.blobs


def test_32_members_behind_a_caching_proxy_take_each_blob_from_the_coordinator_once(tmp_path):
    with serving(tmp_path) as (server, stub):
        alice = Member(server, stub)
        alice.close_rounds(ROUNDS)
        with caching_proxy(tmp_path, server.http_port) as proxy:
            # a blob the coordinator has not indexed yet is a miss, and the cache keeps none
            last = framed(alice.messages(0, since_round=ROUNDS - 1))  # as GetUpdates sends it
            unseen = f"{proxy}/blobs/sha256/{hashlib.sha256(last).hexdigest()}"
            assert get(unseen)[0] == 404
            start = threading.Barrier(MEMBERS)

            def member(n: int) -> dict[tuple[int, int], bytes]:
                tier = TIERS[n % len(TIERS)]
                start.wait(WAIT_S)  # all at once: the cache fills while they ask
                status, headers, body = get(f"{proxy}/updates?since_round=0&tier={tier}")
                assert status == 200 and headers["cache-control"] == "no-store"
                got = {}
                for entry in json.loads(body)["updates"]:
                    status, _, data = get(proxy + entry["url"])
                    assert status == 200 and hashlib.sha256(data).hexdigest() == entry["sha256"]
                    got[entry["round"], entry["tier"]] = data
                return got

            with ThreadPoolExecutor(MEMBERS) as pool:
                fetched = list(pool.map(member, range(MEMBERS)))
            mirrored = HttpMirror(proxy).updates(0, 1)  # a member's own path, through the cache
            status, headers, _ = get(unseen)
            assert status == 200 and headers["x-cache-status"] == "HIT"
        for n, got in enumerate(fetched):
            assert set(got) == {(r, TIERS[n % len(TIERS)]) for r in range(ROUNDS)}
        blobs = {key: data for got in fetched for key, data in got.items()}
        assert all(got[key] == blobs[key] for got in fetched for key in got)
        # one body per (round, tier) left the coordinator; the proxy served the 15 others
        assert blobs_of(server).served == Counter(
            {hashlib.sha256(data).hexdigest(): 1 for data in blobs.values()})
        for tier in TIERS:  # a round's blob is its GetUpdates stream, framed
            assert [m for r in range(ROUNDS) for m in unframed(blobs[r, tier])] == (
                alice.messages(tier))
        assert list(update_messages(mirrored)) == list(update_messages(
            read_updates(alice.messages(1), 1)))


def test_blobs_are_immutable_resources_and_misses_are_not_kept(tmp_path):
    with serving(tmp_path) as (server, stub):
        alice = Member(server, stub)
        alice.close_rounds(2)
        base = f"http://127.0.0.1:{server.http_port}"
        status, headers, body = get(f"{base}/updates?since_round=1&tier=0")
        assert status == 200 and headers["cache-control"] == "no-store"
        [entry] = json.loads(body)["updates"]  # round 1 only; round 2 is still open
        assert (entry["round"], entry["tier"]) == (1, 0) and not json.loads(body)["more"]
        url, digest, size = base + entry["url"], entry["sha256"], entry["bytes"]
        status, headers, data = get(url)
        assert status == 200 and hashlib.sha256(data).hexdigest() == digest == url[-64:]
        assert len(data) == size == int(headers["content-length"])
        assert headers["etag"] == f'"{digest}"' and headers["cache-control"] == IMMUTABLE
        assert headers["accept-ranges"] == "bytes"
        assert [m.header.round for m in unframed(data) if m.HasField("header")] == [1]
        for asked, (first, last) in {"bytes=10-19": (10, 19), "bytes=-7": (size - 7, size - 1),
                                     f"bytes={size - 3}-": (size - 3, size - 1),
                                     f"bytes=5-{size + 100}": (5, size - 1)}.items():
            status, headers, part = get(url, {"Range": asked})
            assert status == 206 and part == data[first:last + 1], asked
            assert headers["content-range"] == f"bytes {first}-{last}/{size}", asked
            assert headers["content-length"] == str(last + 1 - first), asked
        status, headers, _ = get(url, {"Range": f"bytes={size}-"})
        assert status == 416 and headers["content-range"] == f"bytes */{size}"
        assert headers["cache-control"] == "no-store"
        status, _, whole = get(url, {"Range": "bytes=0-1", "If-Range": '"other"'})
        assert status == 200 and whole == data  # a range of other bytes: all of these
        status, headers, empty = get(url, {"If-None-Match": f'"x", W/"{digest}"'})
        assert status == 304 and empty == b"" and headers["etag"] == f'"{digest}"'
        connection = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=WAIT_S)
        connection.request("HEAD", entry["url"])
        head = connection.getresponse()
        assert head.status == 200 and head.read() == b""
        assert head.getheader("content-length") == str(size)
        assert head.getheader("etag") == f'"{digest}"'
        assert head.getheader("cache-control") == IMMUTABLE
        connection.close()
        for missing in ("0" * 64, digest.upper(), "not-a-digest"):
            status, headers, body = get(f"{base}/blobs/sha256/{missing}")
            assert status == 404 and headers["cache-control"] == "no-store"
            assert b"/updates" in body  # says where digests come from
        status, headers, body = get(f"{base}/updates?since_round=0&tier=5")
        assert status == 404 and headers["cache-control"] == "no-store"
        assert b"its tiers: 0, 1" in body
        # a checkpoint file, by the digest its manifest lists; a damaged copy is never served
        folder = alice.coordinator.dir / "checkpoints" / "round-0"
        listed = json.loads((folder / "matformer_manifest.json").read_text())["sha256"]
        name, wanted = next((n, d) for n, d in listed.items() if n.endswith(".json"))
        status, headers, data = get(f"{base}/blobs/sha256/{wanted}")
        assert status == 200 and data == (folder / name).read_bytes()
        assert headers["etag"] == f'"{wanted}"' and headers["cache-control"] == IMMUTABLE
        status, headers, part = get(f"{base}/blobs/sha256/{wanted}", {"Range": "bytes=2-"})
        assert status == 206 and part == data[2:]
        (folder / name).write_bytes(data + b"\n")
        for method in ("GET", "HEAD"):
            connection = http.client.HTTPConnection("127.0.0.1", server.http_port,
                                                    timeout=WAIT_S)
            connection.request(method, f"/blobs/sha256/{wanted}")
            damaged = connection.getresponse()
            body = damaged.read()
            assert damaged.status == 500 and damaged.getheader("cache-control") == "no-store"
            assert method == "HEAD" or f"round-0/{name}".encode() in body
            connection.close()
        # bodies sent: the GET, four ranges and the If-Range of the update; the file's GET and
        # range. A 304, a 416, a HEAD and a damaged file send none.
        assert blobs_of(server).served == Counter({digest: 6, wanted: 2})
        _, _, metrics = get(f"{base}/metrics")
        assert 'matformer_blob_bodies_served_total{run="svc-test",kind="update"} 6' in (
            metrics.decode())


def test_an_index_request_waits_for_its_round_to_close(tmp_path, monkeypatch):
    monkeypatch.setattr(blobs_module, "MAX_WAIT_S", 10 * WAIT_S)  # only a close answers it
    with serving(tmp_path) as (server, stub):
        alice = Member(server, stub)
        alice.close_rounds(1)
        url = f"http://127.0.0.1:{server.http_port}/updates?since_round=1&tier=0&wait_s=3600"
        with ThreadPoolExecutor(1) as pool:
            asked = pool.submit(get, url)
            time.sleep(0.5)
            assert not asked.done()  # round 1 is open: the answer waits for its close
            alice.close_rounds(1)
            status, _, body = asked.result(timeout=WAIT_S)
        assert status == 200 and [e["round"] for e in json.loads(body)["updates"]] == [1]


def test_a_close_wakes_every_waiting_index_request():
    coordinator = SimpleNamespace(state=SimpleNamespace(round=0, finished=False),
                                  round_closed=[])
    commits = Commits(coordinator)

    def close() -> None:  # as server/close.py does: commit, then the hooks
        coordinator.state.round = 1
        for hook in coordinator.round_closed:
            hook(None)

    async def waiting() -> None:
        waiters = [asyncio.create_task(commits.wait(0, 3600)) for _ in range(3)]
        late = asyncio.create_task(commits.wait(1, 0.05))  # round 1 never closes here
        await asyncio.sleep(0.1)
        assert not any(w.done() for w in waiters)
        threading.Thread(target=close).start()
        await asyncio.wait_for(asyncio.gather(*waiters, late), WAIT_S)

    asyncio.run(waiting())


@pytest.mark.parametrize("overlap", [False, True], ids=["synchronous", "overlapped"])
def test_a_member_with_a_mirror_takes_the_broadcast_from_it_and_holds_the_master(tmp_path,
                                                                                 overlap):
    config = RunConfig.load(served_run_toml(tmp_path, round={
        "min_clients": 1, "deadline_s": 60.0, "tokens_per_round": 1024, "rounds": ROUNDS,
        "overlap": overlap}))
    with serving_config(config) as (server, _), caching_proxy(tmp_path,
                                                              server.http_port) as proxy:
        logs = []
        member = mirrored(server, tmp_path, proxy, logs)
        summary = member.run()
        assert holds_the_master(server, member)
    assert summary.finished and summary.rounds_trained == ROUNDS
    assert summary.resynchronisations == 0 and member.broadcast.fallbacks == 0, logs
    # every update came from the mirror (GetUpdates answers only when it lists none yet), and
    # every checkpoint file but the manifest
    assert member.connection.update_bytes == 0
    assert member.connection.calls["DownloadCheckpoint"] == 1
    assert summary.update_bytes == member.broadcast.mirror.update_bytes > 0
    served = blobs_of(server).served
    assert len(served) > ROUNDS and set(served.values()) == {1}  # updates and files, once


@contextlib.contextmanager
def lying_mirror(upstream: int) -> Iterator[str]:
    """A mirror of ``upstream`` (an HTTP port) whose blobs each have their last byte
    flipped; its base URL."""

    def answer(path: str) -> tuple[int, bytes]:
        status, _, body = get(f"http://127.0.0.1:{upstream}{path}")
        if path.startswith("/blobs/") and body:
            body = body[:-1] + bytes([body[-1] ^ 1])
        return status, body

    with serving_http(answer) as url:
        yield url


@pytest.mark.parametrize("fault", ["wrong-bytes", "no-answer"])
def test_a_member_whose_mirror_fails_takes_the_broadcast_over_grpc_and_says_so_once(
        tmp_path, monkeypatch, fault):
    monkeypatch.setattr(mirror_module, "MIRROR_REST_S", 0.0)  # tried for every download
    config = RunConfig.load(served_run_toml(tmp_path, round={
        "min_clients": 1, "deadline_s": 60.0, "tokens_per_round": 1024, "rounds": 2}))
    with serving_config(config) as (server, _), (
            lying_mirror(server.http_port) if fault == "wrong-bytes"
            else contextlib.nullcontext(f"http://127.0.0.1:{free_port()}")) as mirror:
        logs = []
        member = mirrored(server, tmp_path, mirror, logs)
        summary = member.run()
        assert holds_the_master(server, member)
    assert summary.finished and summary.resynchronisations == 0
    # the checkpoint's files and each round's updates, all over gRPC
    assert member.broadcast.fallbacks > 2 and member.broadcast.mirror.update_bytes == 0
    assert member.connection.update_bytes > 0
    said = [line for line in logs if line.startswith("the mirror ")]
    assert len(said) == 1 and "from the coordinator over gRPC" in said[0], logs


def mirrored(server, tmp_path: Path, mirror: str, logs: list[str]) -> FederatedClient:
    """A member at tier 1 of ``server``'s run that takes the broadcast from ``mirror``."""
    return FederatedClient(FederatedOptions(
        server=f"127.0.0.1:{server.grpc_port}", tier=1, name="mirrored", join_token=JOIN_TOKEN,
        state_dir=tmp_path / "member", microbatch_tokens=256, progress=False, mirror=mirror),
        log=logs.append)


def holds_the_master(server, member: FederatedClient) -> bool:
    """The member's replica is the coordinator's master cut to its tier, bit for bit."""
    master = server.service.coordinator.master
    held = canonical_state_dict(member.replica.model)
    return same({n: held[n].detach() for n in member.replica.regions},
                {n: master[n][region_slices(r)] for n, r in member.replica.regions.items()})


@pytest.mark.parametrize("header, span", [
    ("bytes=0-9", (0, 10)), ("bytes=90-", (90, 100)), ("bytes=-10", (90, 100)),
    ("bytes=-1000", (0, 100)), ("bytes=95-1000", (95, 100)), ("bytes=5-4", None),
    ("bytes=0-1,5-6", None), ("items=0-1", None), ("bytes=-", None), (None, None),
    ("bytes=x-1", None)])
def test_one_byte_range_is_honoured_and_anything_else_sends_all_bytes(header, span):
    assert byte_range(header, 100) == span


@pytest.mark.parametrize("header", ["bytes=100-", "bytes=100-200", "bytes=-0"])
def test_a_range_past_the_end_is_unsatisfiable(header):
    with pytest.raises(ValueError):
        byte_range(header, 100)


def test_a_mirror_must_be_an_http_url():
    with pytest.raises(ClientError, match="--mirror 'cache:8080' is not an http"):
        HttpMirror("cache:8080")
