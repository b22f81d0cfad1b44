"""The dashboard end to end: a small real run (a server and two clients at tiers 0 and 1 as
processes on loopback, local_testnet's machinery) watched in headless Chromium; the page's
numbers must equal the status API's, and every /api/ response must validate against the
API's own OpenAPI schema. Needs Debian's chromium and chromium-driver (.ci/run installs
them and sets MATFORMER_REQUIRE_BROWSER=1, which turns a missing browser into a failure)."""

from __future__ import annotations

import json
import math
import os
import re
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from support.helpers import local_testnet_toml
from support.openapi import api_paths, response_errors

from matformer.local_testnet import testnet
from matformer.local_testnet.main import token_env
from matformer.local_testnet.processes import free_port
from matformer.modeling.mdat import build_default_mdat
from matformer.server.held_out_log import HeldOutLog

STATIC = Path(__file__).resolve().parents[1] / "server" / "static"
CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
REQUIRE_BROWSER = "MATFORMER_REQUIRE_BROWSER"
# Read at import: conftest.py clears every MATFORMER_* variable before each test runs.
BROWSER_REQUIRED = os.environ.get(REQUIRE_BROWSER) == "1"
CHROMIUM_FLAGS = ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                  "--disable-quic", "--no-first-run", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--window-size=1400,2200"]
API_PATHS = ["/api/run", "/api/clients", "/api/loss", "/api/held_out", "/api/rounds",
             "/api/events", "/api/dashboard"]
ROUNDS = 20
LATENCY_MS = 100.0  # on every client call: rounds of most of a second, long enough to watch
ROUNDS_SHOWN = 12  # rows of the recent-rounds table (dashboard.js ROUNDS_SHOWN)
DEPARTED_SHOWN = 10  # rows of the left-the-run list (dashboard.js DEPARTED_SHOWN)
WAIT_S = 60.0
AGREE_S = 20.0  # the page may be one poll behind the API; it must catch up within this
LAST_SEEN_TOLERANCE_S = 5.0  # heartbeats move last_seen between the page's poll and ours
CLIENTS = [testnet.ClientSpec(name="client-0", tier=0), testnet.ClientSpec(name="client-1", tier=1)]
# A visitor joins with markup for its device and leaves with markup for its reason (names
# may hold none): shown as text, they prove the page escapes the API's strings.
MARKUP = "<img src=x onerror=window.__xss=1>"


# One consistent read of everything the page shows.
READ_PAGE = """
const q = (s) => document.querySelector(s);
const val = (el) => el === null ? null
  : { value: el.getAttribute("data-value"), text: el.textContent.trim() };
const fields = (row) => Object.fromEntries(
  [...row.querySelectorAll("[data-field]")].map((c) => [c.dataset.field, val(c)]));
const series = (chart) => Object.fromEntries(
  [...document.querySelectorAll(`${chart} polyline[data-series]`)]
    .map((p) => [p.dataset.series, p.getAttribute("data-points")]));
return {
  server_time: q("#dashboard").dataset.serverTime,
  run_id: val(q("#run-id")), phase: val(q("#phase")), round: val(q("#round")),
  rounds_planned: val(q("#rounds-planned")), tokens: val(q("#tokens")),
  open_round: val(q("#open-round-index")), assigned: val(q("#open-assigned")),
  submitted: val(q("#open-submitted")),
  clients: [...document.querySelectorAll("#clients tbody tr[data-client-id]")]
    .map((r) => ({ client_id: r.dataset.clientId, ...fields(r) })),
  departed: [...document.querySelectorAll("#departed li[data-client-id]")]
    .map((r) => ({ client_id: r.dataset.clientId, ...fields(r) })),
  departed_more: val(q('#departed [data-field="more"]')),
  story: { phase: q("#story").dataset.phase, text: q("#story").textContent.trim(),
           ...fields(q("#story")) },
  no_members: q("#clients tbody tr.empty")?.textContent.trim() ?? null,
  excluded: [...document.querySelectorAll("#excluded li[data-client-id]")]
    .map((r) => ({ client_id: r.dataset.clientId, ...fields(r) })),
  loss: series("#loss-chart"), bytes: series("#bytes-chart"),
  durations: series("#duration-chart"),
  ratio: val(q("#bytes-ratio")), slowest_name: val(q("#slowest-name")),
  slowest_s: val(q("#slowest-s")),
  rounds: [...document.querySelectorAll("#rounds-table tbody tr[data-round]")].map(fields),
  events: [...document.querySelectorAll("#events tbody tr[data-seq]")]
    .map((r) => ({ seq: r.dataset.seq, ...fields(r) })),
  conn: q("#conn").dataset.state,
  marker: window.__marker ?? null, xss: window.__xss ?? null,
};
"""


def test_static_files_load_nothing_from_elsewhere():
    for path in STATIC.iterdir():
        text = path.read_text(encoding="utf-8")
        assert not re.search(r"https?:|(src|href)=[\"']//|url\(", text), path.name
    html = (STATIC / "index.html").read_text(encoding="utf-8")
    assert all(ref.startswith("/static/") for ref in re.findall(r'(?:src|href)="([^"]*)"', html))
    scripts = "".join(p.read_text(encoding="utf-8") for p in STATIC.glob("*.js"))
    paths = re.findall(r"[`\"'](/[^`\"']*)", scripts)  # every same-origin URL they spell
    assert any(p.startswith("/api/dashboard") for p in paths)
    assert all(p.startswith(("/api/", "/static/")) for p in paths), paths


# -- the run and the browser -----------------------------------------------------------------

class LiveRun:
    """Testnet.run() on a thread: the server and clients run while the test watches; the
    server stays up after the run finishes until ``stop``."""

    def __init__(self, tmp_path: Path) -> None:
        build_default_mdat(tmp_path / "d.mdat", limit=150).close()
        config = local_testnet_toml(tmp_path / "run.toml", deadline=20.0, rounds=ROUNDS)
        grpc_port, http_port = free_port(), free_port()
        while http_port == grpc_port:
            http_port = free_port()
        self.net = testnet.Testnet(testnet.TestnetPlan(
            config=config, run_dir=tmp_path / "run", clients=CLIENTS,
            env=token_env(config, relays=0)[0],
            grpc_port=grpc_port, http_port=http_port, latency_ms=LATENCY_MS,
            overrides=[f"server.grpc_port={grpc_port}", f"server.http_port={http_port}",
                       'server.host="127.0.0.1"',
                       "server.stay_after_finish=true"]))  # the page is read after the end
        self.base = self.net.http_base
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="testnet", daemon=True)

    def visit(self) -> str:
        """A member that joins with markup in its strings and leaves at once; its name."""
        import grpc

        from matformer.protocol.auth import session_metadata
        from matformer.protocol.matformer.v1 import coordinator_pb2 as pb
        from matformer.protocol.matformer.v1 import coordinator_pb2_grpc as pb_grpc

        token = next(iter(self.net.plan.env.values()), "")
        with grpc.insecure_channel(f"127.0.0.1:{self.net.plan.grpc_port}") as channel:
            stub = pb_grpc.CoordinatorStub(channel)
            reply = stub.Join(pb.JoinRequest(
                run_id="t", join_token=token, client_name="visitor",
                capabilities=pb.Capabilities(device_kind="cpu", device_name=MARKUP,
                                             memory_bytes=2**34, tokens_per_second=1.0)),
                timeout=10)
            stub.Leave(pb.LeaveRequest(reason=MARKUP), timeout=10,
                       metadata=session_metadata(reply.session_token))
        return "visitor"

    def _run(self) -> None:
        try:
            self.net.run()
        except BaseException as err:  # reported by the test thread
            self.error = err

    def get(self, path: str) -> Any:
        with urllib.request.urlopen(self.base + path, timeout=10) as reply:
            return json.load(reply)

    def check(self) -> None:
        if self.error is not None:
            raise AssertionError(f"the run failed: {self.error}")


@pytest.fixture
def live_run(tmp_path):
    run = LiveRun(tmp_path)
    run.thread.start()
    yield run
    run.net.stop()
    run.thread.join(timeout=30)


@pytest.fixture
def browser(tmp_path):
    missing = [str(p) for p in (CHROMIUM, CHROMEDRIVER) if not p.exists()]
    if missing:
        message = (f"{', '.join(missing)} not found: install Debian's chromium and "
                   "chromium-driver (apt-get install chromium chromium-driver)")
        if BROWSER_REQUIRED:
            pytest.fail(f"{REQUIRE_BROWSER}=1 but {message}")
        pytest.skip(message)
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for flag in [*CHROMIUM_FLAGS, f"--user-data-dir={tmp_path / 'chromium'}"]:
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(str(CHROMEDRIVER)), options=options)
    try:
        yield driver
    finally:
        driver.quit()


def wait_for(condition: Callable[[], Any], timeout_s: float, what: str,
             run: LiveRun | None = None) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if run is not None:
            run.check()
        try:
            result = condition()
        except OSError:
            result = None  # the server is not up yet
        if result:
            return result
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")


# -- page against API ------------------------------------------------------------------------

def number(text: str) -> float:
    """The first number in a displayed text: '1,234.5 GiB' → 1234.5."""
    match = re.search(r"-?[\d,]*\.?\d+", text)
    assert match is not None, f"no number in {text!r}"
    return float(match.group().replace(",", ""))


def _number(value: str | None) -> float | None:
    """A cell's data-value as a number; None when it holds none (yet)."""
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def shows(cell: dict | None, value: float | int, digits: int, label: str, *,
          scale: float = 1.0) -> list[str]:
    """Differences between a number cell and the API value: its data-value must be the value
    exactly, its text the value (times ``scale``) to ``digits`` decimals."""
    if cell is None:
        return [f"{label}: not on the page"]
    errors = []
    if _number(cell["value"]) != value:  # a cell not yet filled is a difference, retried
        errors.append(f"{label}: data-value {cell['value']!r}, the API says {value!r}")
    decimals = re.search(r"\d+(?:\.(\d+))?", cell["text"].replace(",", ""))
    if decimals is None or len(decimals.group(1) or "") != digits:
        errors.append(f"{label}: {cell['text']!r} should show {digits} decimals")
    elif abs(number(cell["text"]) - value * scale) > 0.5 * 10 ** -digits + 1e-9:
        errors.append(f"{label}: shows {cell['text']!r}, the API says {value * scale!r}")
    return errors


def text_is(cell: dict | None, expected: str, label: str) -> list[str]:
    shown = None if cell is None else cell["text"]
    return [] if shown == expected else [f"{label}: shows {shown!r}, the API says {expected!r}"]


def points(attr: str | None) -> list[tuple[int, float]]:
    return [(int(r), float(v)) for r, v in
            (p.split(":") for p in (attr or "").split(",") if p)]


def compare(page: dict, api: dict) -> list[str]:
    """Every difference between what the page shows and the API's full /api/dashboard."""
    run, members, rounds = api["run"], api["clients"]["members"], api["rounds"]
    errors = text_is(page["phase"], run["phase"], "phase")
    errors += text_is(page["run_id"], run["run_id"], "run id")
    errors += shows(page["round"], run["round"], 0, "round")
    errors += shows(page["rounds_planned"], run["rounds_planned"], 0, "rounds planned")
    errors += shows(page["tokens"], run["tokens"], 0, "tokens")
    opened = run["open_round"]
    if opened is None:
        errors += text_is(page["open_round"], "none", "open round")
    else:
        errors += shows(page["open_round"], opened["round"], 0, "open round")
        errors += shows(page["assigned"], len(opened["assigned"]), 0, "assigned")
        errors += shows(page["submitted"], len(opened["submitted"]), 0, "submitted")

    rows = {row["client_id"]: row for row in page["clients"]}
    if sorted(rows) != sorted(m["client_id"] for m in members):
        errors.append(f"client rows {sorted(rows)}, the API's members "
                      f"{sorted(m['client_id'] for m in members)}")
    for m in members:
        row = rows.get(m["client_id"])
        if row is None:
            continue
        who = f"client {m['name']!r}"
        for field in ("name", "device_kind", "device_name", "tier_reason", "state"):
            errors += text_is(row.get(field), m[field], f"{who} {field}")
        errors += shows(row.get("tier"), m["tier"], 0, f"{who} tier")
        errors += shows(row.get("memory_bytes"), m["memory_bytes"], 2, f"{who} memory",
                        scale=2 ** -30)
        errors += shows(row.get("tokens_per_second"), m["tokens_per_second"], 0,
                        f"{who} tokens/s")
        errors += shows(row.get("last_round_share"), m["last_round_share"], 1, f"{who} share",
                        scale=100)
        errors += shows(row.get("rejections"), m["rejections"], 0, f"{who} rejections")
        if m["score_mean"] is not None:
            errors += shows(row.get("score_mean"), m["score_mean"], 2, f"{who} agreement")
        errors += shows(row.get("longest_silence_s"), m["longest_silence_s"], 1,
                        f"{who} longest silence")
        seen = row.get("last_seen_s_ago")
        shown = _number(seen["value"]) if seen is not None else None
        if shown is None:
            errors.append(f"{who} last seen: not on the page")
            continue
        errors += shows(seen, shown, 1, f"{who} last seen")
        if abs(shown - m["last_seen_s_ago"]) > LAST_SEEN_TOLERANCE_S:
            errors.append(f"{who} last seen {seen['value']} s ago, the API says "
                          f"{m['last_seen_s_ago']}")
    excluded = {e["client_id"]: e["reason"] for e in api["clients"]["excluded"]}
    if {e["client_id"]: e["reason"]["text"] for e in page["excluded"]} != excluded:
        errors.append(f"excluded {page['excluded']}, the API says {excluded}")
    clients = api["clients"]
    departed = [(d["client_id"], d["name"], d["tier"], d["round"], d["reason"], d["leaves"])
                for d in reversed(clients["departed"])]  # the page: newest first
    shown = [(d["client_id"], d["name"]["text"], int(d["tier"]["value"]),
              int(d["round"]["value"]), d["reason"]["text"],
              int(d["leaves"]["value"]) if "leaves" in d else 1) for d in page["departed"]]
    if shown != departed[:DEPARTED_SHOWN]:
        errors.append(f"departed {shown}, the API says {departed}")
    more = len(departed) - len(shown) + clients["departed_beyond"]
    if (int(page["departed_more"]["value"]) if page["departed_more"] else 0) != more:
        errors.append(f"departed: {page['departed_more']} more, the API says {more}")
    took = page["story"].get("took_part")
    if took is None or took["value"] != str(clients["took_part"]):
        errors.append(f"took part: {took}, the API says {clients['took_part']}")

    for tier, loss in api["loss"].items():
        expected = [(p["round"], p["loss"]) for p in loss]
        if points(page["loss"].get(tier)) != expected:
            errors.append(f"tier {tier} loss: the chart has {points(page['loss'].get(tier))}, "
                          f"the API {expected}")
    for tier, held_out in api["held_out"].items():
        expected = [(p["round"], p["loss"]) for p in held_out]
        if points(page["loss"].get(f"held-out-{tier}")) != expected:
            errors.append(f"tier {tier} held-out: the chart has "
                          f"{points(page['loss'].get(f'held-out-{tier}'))}, the API {expected}")
    if len(page["loss"]) != len(api["loss"]) + len(api["held_out"]):
        errors.append(f"the loss chart draws {sorted(page['loss'])}, the API has training "
                      f"{sorted(api['loss'])} and held-out {sorted(api['held_out'])}")
    for chart, keys in (("bytes", ("bytes_sent", "bytes_dense")),
                        ("durations", ("duration_s", "slowest_s"))):
        for key in keys:
            if points(page[chart].get(key)) != [(r["round"], r[key]) for r in rounds]:
                errors.append(f"{chart} chart: its {key} points differ from /api/rounds")
    errors += compare_rounds(page, rounds)
    errors += compare_events(page, api)
    return errors


def compare_rounds(page: dict, rounds: list[dict]) -> list[str]:
    errors = []
    sent, dense = sum(r["bytes_sent"] for r in rounds), sum(r["bytes_dense"] for r in rounds)
    if sent:
        ratio = page["ratio"]
        if not math.isclose(float(ratio["value"] or "nan"), dense / sent, rel_tol=1e-12):
            errors.append(f"bytes ratio {ratio['value']}, the API's {dense / sent}")
        elif abs(number(ratio["text"]) - dense / sent) > 0.05 + 1e-9:
            errors.append(f"bytes ratio shows {ratio['text']!r}, the API's {dense / sent}")
    if rounds:
        last = rounds[-1]
        errors += shows(page["slowest_s"], last["slowest_s"], 2, "slowest seconds")
        errors += text_is(page["slowest_name"], last["slowest_name"], "slowest client")
        if page["slowest_name"]["value"] != last["slowest_client_id"]:
            errors.append(f"slowest client id {page['slowest_name']['value']!r}, the API's "
                          f"{last['slowest_client_id']!r}")
    expected = rounds[-ROUNDS_SHOWN:][::-1]
    if [int(r["round"]["value"]) for r in page["rounds"]] != [r["round"] for r in expected]:
        return [*errors, f"rounds table rows {[r['round']['value'] for r in page['rounds']]}, "
                         f"the API's newest {[r['round'] for r in expected]}"]
    for row, r in zip(page["rounds"], expected, strict=True):
        at = f"round {r['round']}"
        errors += shows(row["duration_s"], r["duration_s"], 2, f"{at} duration")
        errors += shows(row["slowest_s"], r["slowest_s"], 2, f"{at} slowest seconds")
        errors += shows(row["bytes_sent"], r["bytes_sent"], 0, f"{at} bytes sent")
        errors += shows(row["bytes_dense"], r["bytes_dense"], 0, f"{at} dense bytes")
        errors += text_is(row["slowest_name"], r["slowest_name"], f"{at} slowest client")
        dropped = "; ".join(f"{d['name']}: {d['reason']}" for d in r["dropped"]) or "–"
        errors += text_is(row["dropped"], dropped, f"{at} dropped")
    return errors


def compare_events(page: dict, api: dict) -> list[str]:
    names = {m["client_id"]: m["name"] for m in api["clients"]["members"]}
    names.update({d["client_id"]: d["name"] for d in api["clients"]["departed"]})
    names.update({e["client_id"]: e["name"] for e in api["clients"]["excluded"] if e["name"]})
    for r in api["rounds"]:
        names.setdefault(r["slowest_client_id"], r["slowest_name"])
    expected = api["events"][::-1]  # newest first
    if [int(e["seq"]) for e in page["events"]] != [e["seq"] for e in expected]:
        return [f"events shown {[e['seq'] for e in page['events']]}, the API's "
                f"{[e['seq'] for e in expected]}"]
    errors = []
    for row, e in zip(page["events"], expected, strict=True):
        at = f"event {e['seq']}"
        if float(row["time"]["value"]) != e["time"]:
            errors.append(f"{at} time {row['time']['value']}, the API's {e['time']}")
        errors += text_is(row["time"], time.strftime("%H:%M:%S", time.localtime(e["time"])),
                          f"{at} time")
        errors += shows(row["round"], e["round"], 0, f"{at} round")
        errors += text_is(row["kind"], e["kind"], f"{at} kind")
        errors += text_is(row["detail"], e["detail"], f"{at} detail")
        client = e["client_id"]
        if row["client"]["value"] != (client or ""):
            errors.append(f"{at} client {row['client']['value']!r}, the API's {client!r}")
        if row["client"]["text"] not in ({"–"} if client is None else
                                         {client, names.get(client)}):
            errors.append(f"{at} shows client {row['client']['text']!r} for {client!r}")
    return errors


def page_agrees(driver, run: LiveRun, timeout_s: float = AGREE_S) -> tuple[dict, dict]:
    """(page, API) once they agree: right after each poll lands, read the page and fetch
    the API; AssertionError with the last differences when they never do."""
    deadline = time.monotonic() + timeout_s
    errors: list[str] = ["the page never rendered a snapshot"]
    seen = None
    while time.monotonic() < deadline:
        page = driver.execute_script(READ_PAGE)
        if page["server_time"] and page["server_time"] != seen:
            seen = page["server_time"]
            api = run.get("/api/dashboard?since_round=0&events_after=-1")
            errors = compare(page, api)
            if not errors:
                return page, api
        time.sleep(0.05)
    raise AssertionError("the page never agreed with /api/dashboard; the last differences:\n"
                         + "\n".join(errors[:40]))


READ_HOVER = """
const layer = document.querySelector(arguments[0] + " g.hover");
return layer === null ? null : { round: layer.dataset.round, values: Object.fromEntries(
  [...layer.querySelectorAll("text[data-series]")].map(
    (t) => [t.dataset.series, [Number(t.dataset.value), t.textContent]])) };
"""


def pointer_to(driver, selector: str) -> None:
    """Move the real pointer onto the element ``selector`` names."""
    from selenium.webdriver.common.action_chains import ActionChains

    ActionChains(driver).move_to_element(driver.find_element("css selector", selector)).perform()


def hover(driver, selector: str) -> dict:
    """Point at ``selector``; the hover box that opens."""
    pointer_to(driver, selector)
    chart = "#" + selector.split()[0].lstrip("#")
    return wait_for(lambda: driver.execute_script(READ_HOVER, chart), AGREE_S,
                    f"the hover box over {selector}")


def test_dashboard_follows_a_live_run(browser, live_run, tmp_path):
    # browser first: without one the test skips before starting the run
    html = wait_for(lambda: urllib.request.urlopen(live_run.base + "/", timeout=5).read(),
                    WAIT_S, "the HTTP side", live_run).decode()
    assert html == (STATIC / "index.html").read_text(encoding="utf-8")

    browser.get(live_run.base + "/")
    browser.execute_script("window.__marker = 1")
    names = {c.name for c in CLIENTS}

    def live() -> dict | None:
        page = browser.execute_script(READ_PAGE)
        tiers = set(live_run.get("/api/loss"))
        trained = tiers and all(points(page["loss"].get(t)) for t in tiers)
        shown = {c["name"]["text"] for c in page["clients"]}
        return page if names <= shown and trained else None

    first = wait_for(live, WAIT_S, "the clients table and the loss chart", live_run)
    assert set(first["loss"]) >= {"0", "1"}
    names.add(live_run.visit())

    openapi = live_run.get("/openapi.json")
    assert set(API_PATHS) <= api_paths(openapi)
    responses = {path: live_run.get(path) for path in API_PATHS}
    assert responses["/api/run"]["phase"] != "finished", "the run ended before it was watched"
    assert responses["/api/rounds"] and responses["/api/clients"]["members"]
    for path, value in responses.items():
        assert response_errors(openapi, path, value) == []

    page, api = page_agrees(browser, live_run)
    browser.save_screenshot(str(tmp_path / "dashboard.png"))  # for a look when it fails
    assert api["run"]["phase"] != "finished", "the page agreed with the API only once finished"
    assert page["xss"] is None and page["conn"] in ("live", "finished")
    wait_for(lambda: int(browser.execute_script(READ_PAGE)["round"]["value"])
             > int(first["round"]["value"]), WAIT_S, "the page to show a newer round", live_run)
    assert browser.execute_script("return window.__marker") == 1, "the page reloaded"

    live_run.thread.join(timeout=WAIT_S * 2)
    live_run.check()
    assert not live_run.thread.is_alive(), "the run did not finish"
    wait_for(lambda: browser.execute_script(READ_PAGE)["phase"]["text"] == "finished",
             WAIT_S, "the page to show the run finished")
    page, api = page_agrees(browser, live_run)
    assert api["run"]["phase"] == "finished" and api["run"]["round"] == ROUNDS
    # every client left when the run finished: the page lists them with what they said
    assert {d["name"]["text"] for d in page["departed"]} == names
    assert int(page["round"]["value"]) == ROUNDS and page["conn"] == "finished"
    # and tells the run's story: how it ended, who took part, each tier's final loss
    story = page["story"]
    assert story["phase"] == "finished" and story["summary"]["text"] == (
        f"The run finished after {ROUNDS} rounds and {api['run']['tokens']:,} tokens.")
    assert story["took_part"]["text"].startswith(f"{len(names)} members took part: ")
    assert set(story["took_part"]["text"].split(": ", 1)[1].rstrip(".").split(", ")) == names
    final = " · ".join(f"tier {t} {p['loss']:.3f}" for t, p in api["run"]["last_loss"].items())
    assert set(api["run"]["last_loss"]) == {"0", "1"}
    assert story["final_loss"]["text"] == f"Final training loss: {final}."
    assert page["no_members"] == f"no members now: {len(names)} members took part (see below)"

    assert api["held_out"] == {} and "held_out" not in story

    # held-out figures that come after the run (the testnet's report) join the chart and the
    # story while the page is open; hovering a round lists every series' value there
    log = HeldOutLog(live_run.net.plan.run_dir)
    log.record(0, {0: 5.25, 1: 5.5}, sequences=16)
    log.record(ROUNDS, {0: 4.5, 1: 4.75}, sequences=16)
    log.record(ROUNDS, {0: 4.25, 1: 4.625}, sequences=16)  # evaluated again: replaces
    page = wait_for(lambda: (p := browser.execute_script(READ_PAGE))["story"].get("held_out")
                    and p, WAIT_S, "the held-out figures on the page")
    page, api = page_agrees(browser, live_run)
    assert api["held_out"]["0"] == [{"round": 0, "loss": 5.25, "sequences": 16},
                                    {"round": ROUNDS, "loss": 4.25, "sequences": 16}]
    assert points(page["loss"]["held-out-1"]) == [(0, 5.5), (ROUNDS, 4.625)]
    assert page["story"]["held_out"] == {
        "value": str(ROUNDS),
        "text": f"Held-out loss of round-{ROUNDS} (16 sequences): tier 0 4.250 · tier 1 4.625."}
    hovered = hover(browser, "#loss-chart circle.marker[data-series='held-out-0'][data-round='0']")
    browser.save_screenshot(str(tmp_path / "held_out.png"))  # for a look when it fails
    training = {t: dict((p["round"], p["loss"]) for p in api["loss"][t]) for t in ("0", "1")}
    assert hovered == {"round": "0", "values": {
        "0": [training["0"][0], f"tier 0: {training['0'][0]:.3f}"],
        "1": [training["1"][0], f"tier 1: {training['1'][0]:.3f}"],
        "held-out-0": [5.25, "tier 0 held-out: 5.250"],
        "held-out-1": [5.5, "tier 1 held-out: 5.500"]}}
    hovered = hover(browser, f"#duration-chart circle[data-round='{ROUNDS - 1}']")
    last = api["rounds"][-1]
    assert hovered["round"] == str(ROUNDS - 1)
    assert {k: v[0] for k, v in hovered["values"].items()} == {
        "duration_s": last["duration_s"], "slowest_s": last["slowest_s"]}
    pointer_to(browser, "#story")
    wait_for(lambda: not browser.find_elements("css selector", "#loss-chart g.hover"), WAIT_S,
             "the hover box to go when the pointer leaves the chart")

    live_run.net.stop()  # the server goes away: the page keeps its data and says so
    wait_for(lambda: browser.execute_script(READ_PAGE)["conn"] == "disconnected", WAIT_S,
             "the page to notice the server is gone")
    page = browser.execute_script(READ_PAGE)
    assert page["phase"]["text"] == "finished" and int(page["round"]["value"]) == ROUNDS
    assert "disconnected" in browser.find_element("id", "conn").text
