"""Fuzz the root's HTTP side (server/http.py, server/api.py, server/blobs.py) with random and
mutated requests over real HTTP on loopback: it must never fail, hang or serve a file it
should not, and a request it refuses must leave the run as it was.

    python tests/fuzz_rpc.py --target http --examples 1000 --seconds 120 --seed 0

Each case (drawn by hypothesis) is made one of three ways, in turn (``KINDS``):

- ``route``: a route of the app's own table (``route_table``: what /openapi.json documents,
  and the dashboard, the docs and /static), with one of its methods or another; its path
  parameters what the run serves (client ids, digests of update blobs and checkpoint files,
  checkpoint and dashboard files), near misses of those, climbs out of a folder or random
  text; its documented query parameters (and others), left out, given or repeated, with
  values at the edges (negative, huge, NaN, not numbers); random headers (Range,
  If-None-Match, If-Range, Authorization with and without the operator token, one header
  past h11's 16 KiB); and a body, a valid exclusion or garbage, where the method takes one;
- ``traversal``: a GET or HEAD under a served folder (/files/, /static/, /blobs/sha256/) of
  a path that climbs out of it (``..`` plain, percent-encoded or doubled, backslashes,
  absolute paths) towards a canary file planted beside run.toml, in the run directory, and
  in the checkpoints folder and a checkpoint in it, where no manifest lists them;
- ``mutated``: a route case's bytes with bits flipped and bytes replaced, inserted or
  deleted, leaning to the request line and the first headers; sent raw.

A crash is: an answer 5xx but 503 (what the documented limits answer: [server]
http_connections and http_streams_per_client); a well-formed request unanswered after
``HTTP_TIMEOUT_S`` (a mutated one may leave the server waiting for bytes that never come: it
is given ``MUTATED_WAIT_S``); a GET /status after the case not answered 200; an error logged
(uvicorn's too); or a leak: an answer holding a canary's contents or a token of run.toml, or
a 200 under /files/, /static/ or /blobs/sha256/ whose bytes are no file of that folder (or
not those of the digest named). After an answer 4xx, ``snapshot`` must be unchanged.

The RPC fuzzer's honest members (tests/fuzz_rpc.py) complete two rounds before the cases,
so that update blobs exist, and one after: the run still serves them. Members that join
with no speed (so they get no work) are the client ids an operator may exclude.
"""

from __future__ import annotations

import contextlib
import hashlib
import http.client
import json
import re
import socket
import string
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote, unquote, urlencode

import grpc
from fastapi import FastAPI
from fuzz_rpc import (
    ASCII_TOKEN,
    CALL_TIMEOUT_S,
    JOIN_TOKEN,
    OPERATOR_TOKEN,
    RELAY_TOKEN,
    ROUND_EVERY,
    TEXT,
    ErrorLog,
    FuzzReport,
    RootTarget,
    RpcFuzzer,
    join_request,
    mutated,
    run_cases,
    snapshot,
    watching,
)
from hypothesis import strategies as st

from matformer.modeling.checkpoint.manifest import MANIFEST_NAME
from matformer.protocol.channel import GRPC_OPTIONS
from matformer.server.http import STATIC
from matformer.server.main import RunningServer
from matformer.server.service import MAX_WAIT_S

HTTP_TIMEOUT_S = MAX_WAIT_S + 10.0  # a valid /updates wait holds its answer up to MAX_WAIT_S
MUTATED_WAIT_S = 0.5
KINDS = ["route", "traversal", "mutated"]
ROUNDS_BEFORE = 2  # honest rounds before the cases: update blobs to serve
BYSTANDERS = 3  # members with no speed: the client ids a fuzzed exclusion names
CANARY = "canary.txt"
CANARY_TEXT = b"canary: a file the HTTP side must never serve\n"
SECRETS = (CANARY_TEXT, *(token.encode() for token in (JOIN_TOKEN, RELAY_TOKEN, OPERATOR_TOKEN)))
METHODS = ["GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "TRACE", "FUZZ"]
SAFE = string.punctuation.replace("#", "").replace("?", "")  # kept as they are in a path


@dataclass(frozen=True, order=True, slots=True)
class Route:
    path: str  # {name} for each path parameter
    methods: tuple[str, ...]
    query: tuple[str, ...]  # its documented query parameters


@dataclass(frozen=True, slots=True)
class Request:
    called: str  # what the report counts it under: its route's path, or how it was made
    method: str
    target: str  # path and query, as sent
    headers: tuple[tuple[str, str], ...] = ()
    body: bytes = b""

    def raw(self) -> bytes:
        lines = [f"{self.method} {self.target} HTTP/1.1", "Host: fuzz",
                 *(f"{name}: {value}" for name, value in self.headers),
                 f"Content-Length: {len(self.body)}", "Connection: close"]
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + self.body


@dataclass(frozen=True, slots=True)
class Answer:
    status: str  # "200", ..., or "closed" (the server closed without answering), "timeout"
    body: bytes = b""


STATUS = Request("health", "GET", "/status")


def exchange(port: int, raw: bytes, method: str, timeout_s: float) -> Answer:
    """Send ``raw`` on a fresh connection; the answer, read whole."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as sock:
            with contextlib.suppress(ConnectionError):  # answered and closed before all
                sock.sendall(raw)  # was sent: the answer is read all the same
            response = http.client.HTTPResponse(sock, method=method)
            response.begin()
            return Answer(str(response.status), response.read())
    except TimeoutError:
        return Answer("timeout")
    except (http.client.HTTPException, OSError):
        return Answer("closed")


def route_table(app: FastAPI) -> list[Route]:
    """Every route ``app`` serves: those /openapi.json documents, with their methods and
    query parameters, then the rest of its table (the dashboard, the docs, /static)."""
    routes = {path: Route(path, tuple(sorted(m.upper() for m in operations)), tuple(sorted(
        {p["name"] for op in operations.values() for p in op.get("parameters", [])
         if p["in"] == "query"})))
        for path, operations in app.openapi()["paths"].items()}
    for route in app.routes:
        path = getattr(route, "path_format", None)  # an included router's are documented
        if path is not None and path not in routes:
            methods = getattr(route, "methods", None) or ("GET", "HEAD")  # a mount: files
            routes[path] = Route(path, tuple(sorted(methods)), ())
    return sorted(routes.values())


@dataclass(frozen=True, slots=True)
class Served:
    """What the run serves over HTTP: the values a case draws its paths from, and the
    digests an answer of a served folder may have."""

    client_ids: tuple[str, ...]  # members no round needs: an operator may exclude them
    digests: tuple[str, ...]  # of update blobs and checkpoint files
    files: tuple[str, ...]  # checkpoint manifests and the files they list, as /files/ takes them
    static: tuple[str, ...]  # the dashboard's files
    file_digests: frozenset[str]  # of every file in the checkpoints folder but the canaries
    static_digests: frozenset[str]

    @classmethod
    def of(cls, server: RunningServer, client_ids: list[str]) -> Served:
        root = server.service.coordinator.checkpoints.root
        files, digests = [], []
        for manifest in sorted(root.glob(f"*/{MANIFEST_NAME}")):
            folder = manifest.parent.name
            listed = json.loads(manifest.read_text())["sha256"]
            files += [f"{folder}/{manifest.name}", *(f"{folder}/{name}" for name in listed)]
            digests += listed.values()
        for tier in server.service.coordinator.config.tiers.allowed:
            index = Request("index", "GET", f"/updates?since_round=0&tier={tier}")
            answer = exchange(server.http_port, index.raw(), index.method, HTTP_TIMEOUT_S)
            digests += [u["sha256"] for u in json.loads(answer.body)["updates"]]
        return cls(client_ids=tuple(client_ids), digests=tuple(digests), files=tuple(files),
                   static=tuple(p.name for p in sorted(STATIC.iterdir())),
                   file_digests=_digests(p for p in root.rglob("*") if p.name != CANARY),
                   static_digests=_digests(STATIC.rglob("*")))


def _digests(paths: Iterable[Path]) -> frozenset[str]:
    return frozenset(hashlib.sha256(p.read_bytes()).hexdigest() for p in paths if p.is_file())


def plant_canaries(server: RunningServer) -> None:
    """A canary beside run.toml, in the run directory, in the checkpoints folder and in a
    checkpoint: no manifest lists them, so no answer may hold their contents."""
    c = server.service.coordinator
    for folder in (c.dir.parent, c.dir, c.checkpoints.root, c.checkpoints.root / "round-0"):
        (folder / CANARY).write_bytes(CANARY_TEXT)


# -- strategies -----------------------------------------------------------------------------

PRINTABLE = st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=60)
NUMBERS = st.sampled_from(
    ["-1", "0", "1", "3", "64", "65", "-9223372036854775809", "9223372036854775807",
     "18446744073709551616", "1e308", "-1e308", "1e-320", "NaN", "nan", "inf", "-Infinity",
     "abc", "", "0x10", "1.5", " 1", "1_000", "\u0661", "%00", "true"]
) | st.integers(-2**70, 2**70).map(str)
QUERY_VALUES = st.integers(0, 3).map(str) | st.one_of(NUMBERS, ASCII_TOKEN, TEXT)  # valid half
# a valid wait holds the answer up to MAX_WAIT_S, on purpose: waits are short, or invalid
WAITS = st.sampled_from(["-1", "0", "0.01", "0.05", "NaN", "-inf", "abc", ""])
# one step up and out of a folder, as a server might fail to see it
UP = ["../", "..%2f", "%2e%2e/", "%2e%2e%2f", "..%5c", "..\\", "....//", "%252e%252e%252f",
      ".%2e/", "..;/", "./../", "//"]
AIMS = [CANARY, f"round-0/{CANARY}", f"run/{CANARY}", "run.toml", "state.json",
        "run/state.json", "etc/passwd", "/etc/passwd", "%2fetc%2fpasswd"]
FOLDERS = ["/files/", "/files/round-0/", "/static/", "/blobs/sha256/", "/", "/api/"]
RANGES = st.sampled_from(
    ["bytes=0-0", "bytes=0-9", "bytes=-5", "bytes=5-", "bytes=9-0", "bytes=-0", "bytes=0-",
     "bytes=99999999999999999999999-", "bytes=0-1,3-4", "bytes=--", "bytes=a-b", "items=0-1",
     ""]
) | st.tuples(st.integers(-5, 2**70), st.integers(-5, 2**70)).map(
    lambda span: f"bytes={span[0]}-{span[1]}")
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=10), inner,
                                                                max_size=3),
    max_leaves=8)
BODIES = TEXT.map(lambda reason: json.dumps({"reason": reason}).encode()) | st.one_of(
    st.sampled_from([b"", b"{", b"null", b"[]", b'{"reason": null}', b'{"reason": 1e999}',
                     b'{"reason": "' + b"x" * 201 + b'"}', b'{"reason": "\\ud800"}',
                     b"\xff\xfe{}", b"[" * 100_000, b'{"a":' * 5000 + b"1" + b"}" * 5000,
                     b"NaN"]),
    JSON_VALUES.map(lambda value: json.dumps(value).encode()),
    st.binary(max_size=200))


@st.composite
def climbs(draw: st.DrawFn) -> str:
    """A path that climbs out of the folder it starts in, towards a file outside it."""
    return "".join(draw(st.lists(st.sampled_from(UP), max_size=5))) + draw(st.sampled_from(AIMS))


def path_values(name: str, served: Served) -> st.SearchStrategy[str]:
    """Path parameter ``name``: what the run serves there, a near miss of a digest, a climb,
    or random text."""
    known = {"client_id": served.client_ids, "digest": served.digests,
             "path": (*served.files, *served.static)}.get(name) or served.files
    near = st.sampled_from(served.digests).flatmap(lambda digest: st.sampled_from(
        [digest.upper(), digest[:-1], digest + "0", digest[::-1], f"{digest}/x"]))
    return st.sampled_from(known) | st.one_of(near, climbs(),
                                              st.text("0123456789abcdef", max_size=80), TEXT)


AUTHORIZATION = st.just(f"Bearer {OPERATOR_TOKEN}") | st.one_of(
    st.sampled_from([f"bearer {OPERATOR_TOKEN}", "Bearer wrong", "Bearer", "Bearer  ", "",
                     "Basic Zm9vOmJhcg==", f"Bearer {OPERATOR_TOKEN}x"]),
    PRINTABLE)


@st.composite
def headers(draw: st.DrawFn, served: Served) -> tuple[tuple[str, str], ...]:
    """Authorization half the time (the operator's token half of those), and up to three
    of the other headers the routes read (or should ignore), each drawn at its edges."""
    etags = st.sampled_from(served.digests).map(lambda digest: f'"{digest}"')
    choices = {
        "Range": RANGES,
        "If-None-Match": etags | st.sampled_from(["*", 'W/"x"', '"', ""]) | PRINTABLE,
        "If-Range": etags | PRINTABLE,
        "Content-Type": st.sampled_from(
            ["application/json", "text/plain", "application/x-www-form-urlencoded",
             "multipart/form-data; boundary=x", "application/json; charset=utf-32"]) | PRINTABLE,
        "Accept-Encoding": st.sampled_from(["gzip", "br", "identity", "*"]),
        # one header up to past h11's limit on a request's head (16 KiB)
        "X-Fuzz": st.sampled_from([100, 8_000, 20_000, 70_000]).map(lambda n: "a" * n),
    }
    names = draw(st.lists(st.sampled_from(sorted(choices)), unique=True, max_size=3))
    authorization = draw(st.none() | AUTHORIZATION)
    return (*((name, draw(choices[name])) for name in names),
            *([] if authorization is None else [("Authorization", authorization)]))


@st.composite
def route_requests(draw: st.DrawFn, routes: list[Route], served: Served) -> Request:
    route = draw(st.sampled_from(routes))
    method = draw(st.sampled_from(route.methods if draw(st.integers(0, 3)) else METHODS))
    path = re.sub(r"\{(\w+)\}", lambda found: quote(draw(path_values(found[1], served)),
                                                       safe=SAFE), route.path)
    pairs = []
    for name in route.query:  # given (half the time), left out, or given twice
        values = WAITS if name == "wait_s" else QUERY_VALUES
        pairs += [(name, draw(values)) for _ in range(draw(st.sampled_from((1, 1, 0, 2))))]
    pairs += draw(st.lists(st.tuples(PRINTABLE, QUERY_VALUES), max_size=2))  # undocumented
    query = urlencode(pairs)
    bodiless = method in ("GET", "HEAD") and draw(st.integers(0, 9)) > 0  # a GET's body, rarely
    return Request(route.path, method, path + (f"?{query}" if query else ""),
                   draw(headers(served)), b"" if bodiless else draw(BODIES))


@st.composite
def traversals(draw: st.DrawFn) -> Request:
    return Request("traversal", draw(st.sampled_from(["GET", "HEAD"])),
                   draw(st.sampled_from(FOLDERS)) + draw(climbs()))


# -- running one case -----------------------------------------------------------------------

class HttpFuzzer:
    """Cases against ``server``'s HTTP side; what it finds goes into ``report``."""

    def __init__(self, server: RunningServer, report: FuzzReport, errors: ErrorLog,
                 served: Served) -> None:
        self.server, self.report, self.errors, self.served = server, report, errors, served
        self.port = server.http_port
        self.routes = route_table(server.http_server.config.app)

    def step(self, data: st.DataObject) -> None:
        """One case, made the next way of ``KINDS``. It draws one of each, so that what it
        draws does not depend on whose turn it is (hypothesis would take draws that depend
        on the report for a flaky strategy, and start over)."""
        kind = KINDS[self.report.tried % len(KINDS)]
        routed = data.draw(route_requests(self.routes, self.served), label="route")
        climbing = data.draw(traversals(), label="traversal")
        garbled = data.draw(mutated(routed.raw()), label="mutated")
        request = climbing if kind == "traversal" else routed
        raw = garbled if kind == "mutated" else request.raw()
        self.report.hows[request.called, kind] += 1
        before = snapshot(self.server)
        seen_errors = len(self.errors.records)
        answer = exchange(self.port, raw, request.method,
                          MUTATED_WAIT_S if kind == "mutated" else HTTP_TIMEOUT_S)
        self.record(kind, request, answer, before, seen_errors)

    def served_once(self) -> int:
        """Each checkpoint file and blob the run serves, asked for plainly once, as a member
        or a cache would: the leak check sees real answers of the served folders whatever
        the cases draw. How many requests that was."""
        requests = [*(Request("/files/{path}", "GET", f"/files/{quote(path, safe=SAFE)}")
                      for path in self.served.files),
                    *(Request("/blobs/sha256/{digest}", "GET", f"/blobs/sha256/{digest}")
                      for digest in dict.fromkeys(self.served.digests))]
        for request in requests:
            self.report.hows["served", "route"] += 1
            before, seen_errors = snapshot(self.server), len(self.errors.records)
            answer = exchange(self.port, request.raw(), request.method, HTTP_TIMEOUT_S)
            self.record("route", request, answer, before, seen_errors)
        return len(requests)

    def record(self, kind: str, request: Request, answer: Answer, before: dict[str, str],
               seen_errors: int) -> None:
        """Count the request and check what it did (see the module docstring)."""
        report = self.report
        report.tried += 1
        report.codes[request.called if kind == "route" else kind, answer.status] += 1
        what = (f"{kind}: {request.method} {request.target[:200]!r}"
                f"{f' {request.headers!r:.200}' if request.headers else ''} → {answer.status}: "
                f"{answer.body[:300]!r}")
        status = answer.status
        if (status.startswith("5") and status != "503") or (
                status == "timeout" and kind != "mutated"):
            report.crashes.append(what)
        leak = self.leak(kind, request, answer)
        if leak is not None:
            report.crashes.append(f"{leak}: {what}")
        health = exchange(self.port, STATUS.raw(), STATUS.method, MAX_WAIT_S)
        if health.status != "200":
            report.crashes.append(f"GET /status answered {health.status} after {what}")
        report.crashes.extend(f"logged after {what}: {line}"
                              for line in self.errors.records[seen_errors:])
        if status[0] in "23":
            report.accepted += 1
            return
        report.rejected += 1
        if status.startswith("4"):
            report.check_unchanged(what, before, snapshot(self.server))

    def leak(self, kind: str, request: Request, answer: Answer) -> str | None:
        """What the answer served that it must not, None when nothing."""
        for secret in SECRETS:
            if secret in answer.body:
                return f"served {secret[:24]!r}"
        if kind == "mutated" or answer.status != "200" or request.method != "GET":
            return None  # a mutated request's path is not the one drawn
        path = unquote(request.target.partition("?")[0])
        digest = hashlib.sha256(answer.body).hexdigest()
        if path.startswith("/files/") and digest not in self.served.file_digests:
            return "served a file from outside the checkpoints folder"
        if path.startswith("/static/") and digest not in self.served.static_digests:
            return "served a file from outside the dashboard's folder"
        if path.startswith("/blobs/sha256/") and digest != path.removeprefix("/blobs/sha256/"):
            return "served bytes of another digest"
        return None


def fuzz_http(server: RunningServer, *, examples: int, seconds: float, seed: int = 0
              ) -> FuzzReport:
    """Up to ``examples`` cases against ``server``'s HTTP side, stopping after ``seconds``,
    with ``ROUNDS_BEFORE`` honest rounds before the first and one after the last; the same
    cases for a seed. Canaries are planted in the run's folders first, and every served file
    and blob is asked for once before the cases (``HttpFuzzer.served_once``)."""
    report = FuzzReport()
    stop_at = time.monotonic() + seconds
    with grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}", options=GRPC_OPTIONS) as channel:
        members = RpcFuzzer(RootTarget(server), channel, report, round_every=ROUND_EVERY)
        with watching(report, members.errors):
            with members.serving():  # a fresh run serves honest members: no case is to blame
                for _ in range(ROUNDS_BEFORE):
                    members.honest_round()
            if members.stopped or not server.wait_until_http_ready():
                return report
            bystanders = []
            for _ in range(BYSTANDERS):  # named afresh: a fuzzed exclusion keeps no name
                join = join_request(server, f"bystander-{uuid.uuid4().hex[:8]}")
                join.capabilities.tokens_per_second = 0.0  # no share of any round
                bystanders.append(members.stub.Join(join, timeout=CALL_TIMEOUT_S).client_id)
            plant_canaries(server)
            fuzzer = HttpFuzzer(server, report, members.errors, Served.of(server, bystanders))
            served = fuzzer.served_once()
            run_cases(fuzzer.step, report, examples=examples + served, stop_at=stop_at,
                      seed=seed, stopped=lambda: False)
            with members.serving():  # the run still serves its members
                members.honest_round()
            members.leave()
    return report

