// The run dashboard: polls /api/dashboard about once a second, appends the new rounds,
// loss points and events to what it holds, and redraws. Every text from the API goes in
// through textContent; every number shown carries its raw API value in data-value.

import { drawLineChart } from "/static/charts.js";

const POLL_MS = 1000;
const FINISHED_POLL_MS = 5000; // a finished run changes only if it is resumed
const FETCH_TIMEOUT_MS = 5000;
const ROUNDS_SHOWN = 12; // rows of the recent-rounds table
const EVENTS_KEPT = 200; // rows of the events table
const DEPARTED_SHOWN = 10; // rows of the left-the-run list; the rest are counted
const NAMES_SHOWN = 12; // names in the run's story; the rest are counted
const TIER_COLORS = ["#2563eb", "#ea580c", "#16a34a", "#9333ea", "#db2777", "#0891b2",
                     "#ca8a04", "#4b5563"];
const GIB = 2 ** 30;
const MIB = 2 ** 20;

const ROUND_SERIES = ["bytes_sent", "bytes_dense", "duration_s", "slowest_s"];

// What the polls brought so far; the charts' series only grow (charts.js relies on it).
const held = { runId: null, loss: {}, heldOut: {}, heldOutText: "", rounds: [],
               perRound: emptyPerRound(), events: [], names: {}, lastRound: -1, lastSeq: -1,
               snapshot: null, updatedAt: null };

function emptyPerRound() {
  return Object.fromEntries(ROUND_SERIES.map((key) => [key, []]));
}

const tierColor = (tier) => TIER_COLORS[Number(tier) % TIER_COLORS.length];

const $ = (selector) => document.querySelector(selector);

// Fixed en-US formats, so what is shown reads back the same way everywhere.
function fmt(value, digits) {
  return value.toLocaleString("en-US", { minimumFractionDigits: digits,
                                         maximumFractionDigits: digits });
}

// Decimal units, for a log axis whose ticks are powers of ten.
function fmtDecimalBytes(bytes) {
  const units = ["B", "kB", "MB", "GB", "TB"];
  const unit = Math.min(Math.max(Math.floor(Math.log10(bytes) / 3), 0), units.length - 1);
  return `${fmt(bytes / 1000 ** unit, 0)} ${units[unit]}`;
}

function fmtClock(seconds) {
  return new Date(seconds * 1000).toLocaleTimeString("en-GB", { hour12: false });
}

function node(tag, attrs, text) {
  const el = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs || {})) {
    if (value !== null && value !== undefined) el.setAttribute(key, String(value));
  }
  if (text !== undefined) el.textContent = text;
  return el;
}

// A cell for a number: the raw value in data-value, the formatted one as text.
function numCell(field, value, text) {
  return node("td", { "data-field": field, "data-value": value, class: "num" }, text);
}

function setValue(selector, value, text) {
  const el = $(selector);
  el.dataset.value = value === null || value === undefined ? "" : String(value);
  el.textContent = text;
}

function nameOf(clientId) {
  return held.names[clientId] || clientId;
}

function tierBadge(tier) {
  const badge = node("span", { class: "tier", "data-field": "tier", "data-value": tier },
                     `tier ${tier}`);
  badge.style.setProperty("--tier-color", tierColor(tier));
  return badge;
}

// -- holding what the polls bring -----------------------------------------------------------

function absorb(snap) {
  const run = snap.run;
  const restarted = held.runId !== null && (run.run_id !== held.runId
                                            || held.lastRound >= run.round);
  if (restarted) return false; // a different or rewound run: start over with a full fetch
  held.runId = run.run_id;
  for (const m of snap.clients.members) held.names[m.client_id] = m.name;
  for (const e of snap.clients.excluded) if (e.name) held.names[e.client_id] = e.name;
  for (const d of snap.clients.departed) held.names[d.client_id] ||= d.name;
  for (const [tier, points] of Object.entries(snap.loss)) {
    const series = (held.loss[tier] ||= []);
    const last = series.length ? series[series.length - 1][0] : -1;
    for (const p of points) if (p.round > last) series.push([p.round, p.loss]);
    if (series.length) held.lastRound = Math.max(held.lastRound, series[series.length - 1][0]);
  }
  for (const r of snap.rounds) {
    if (held.rounds.length && r.round <= held.rounds[held.rounds.length - 1].round) continue;
    held.rounds.push(r);
    for (const key of ROUND_SERIES) held.perRound[key].push([r.round, r[key]]);
    held.names[r.slowest_client_id] ||= r.slowest_name;
    for (const d of r.dropped) held.names[d.client_id] ||= d.name;
    held.lastRound = Math.max(held.lastRound, r.round);
  }
  for (const e of snap.events) {
    if (e.seq > held.lastSeq) {
      held.events.push(e);
      held.lastSeq = e.seq;
    }
  }
  held.events.splice(0, Math.max(held.events.length - EVENTS_KEPT, 0));
  // the held-out figures come whole each time (a few points per tier) and may be replaced
  const heldOutText = JSON.stringify(snap.held_out);
  held.heldOutChanged = heldOutText !== held.heldOutText;
  held.heldOutText = heldOutText;
  held.heldOut = Object.fromEntries(Object.entries(snap.held_out).map(
    ([tier, points]) => [tier, points.map((p) => [p.round, p.loss, p.sequences])]));
  held.snapshot = snap;
  return true;
}

function forget() {
  Object.assign(held, { runId: null, loss: {}, heldOut: {}, heldOutText: "", rounds: [],
                        perRound: emptyPerRound(), events: [], names: {}, lastRound: -1,
                        lastSeq: -1 });
  $("#events tbody").replaceChildren(); // a rewound run numbers its events anew
}

// -- rendering ------------------------------------------------------------------------------

function renderRun(run) {
  document.title = `Matformer run ${run.run_id}`;
  setValue("#run-id", run.run_id, run.run_id);
  setValue("#phase", run.phase, run.phase);
  $("#phase").className = `phase phase-${run.phase}`;
  setValue("#round", run.round, fmt(run.round, 0));
  setValue("#rounds-planned", run.rounds_planned,
           run.rounds_planned === null ? "–" : fmt(run.rounds_planned, 0));
  setValue("#tokens", run.tokens, fmt(run.tokens, 0));
  setValue("#tokens-planned", run.tokens_planned,
           run.tokens_planned === null ? "no token target" : `of ${fmt(run.tokens_planned, 0)}`);
  const open = run.open_round;
  setValue("#open-round-index", open ? open.round : null,
           open ? `round ${fmt(open.round, 0)}` : "none");
  setValue("#open-submitted", open ? open.submitted.length : 0,
           String(open ? open.submitted.length : 0));
  setValue("#open-assigned", open ? open.assigned.length : 0,
           String(open ? open.assigned.length : 0));
  const left = open ? open.deadline - run.server_time : null;
  setValue("#open-deadline", left, left === null ? "no deadline"
           : `${fmt(Math.max(left, 0), 0)} s to the deadline`);
}

function clientRow(m) {
  const row = node("tr", { "data-client-id": m.client_id, "data-state": m.state });
  const name = node("td", { "data-field": "name" }, m.name);
  if (m.behind.length) {  // a relay: the members it serves, under its name
    name.append(node("span", { "data-field": "behind", "data-value": m.behind.length,
                               class: "sub" },
      `behind it: ${m.behind.map((b) => `${b.name} (tier ${b.tier}, `
        + `${fmt(b.tokens_per_second, 0)} tok/s)`).join(", ")}`));
  }
  row.append(name);
  const device = node("td", { "data-field": "device" });
  device.append(node("span", { "data-field": "device_kind", class: "kind" }, m.device_kind),
                node("span", { "data-field": "device_name", class: "sub" }, m.device_name));
  row.append(device);
  row.append(numCell("memory_bytes", m.memory_bytes, `${fmt(m.memory_bytes / GIB, 2)} GiB`));
  const tier = node("td", { class: "tier-cell", title: m.tier_reason });
  tier.append(tierBadge(m.tier));
  if (m.requested_tier !== null && m.requested_tier !== m.tier) {
    tier.append(node("span", { "data-field": "requested_tier", "data-value": m.requested_tier,
                               class: "asked" }, `asked ${m.requested_tier}`));
  }
  tier.append(node("span", { "data-field": "tier_reason", class: "sub reason" }, m.tier_reason));
  row.append(tier);
  const speed = numCell("tokens_per_second", m.tokens_per_second, fmt(m.tokens_per_second, 0));
  if (!m.speed_measured) speed.title = "reported by the client, not yet measured in a round";
  speed.classList.toggle("estimate", !m.speed_measured);
  row.append(speed);
  row.append(numCell("last_round_share", m.last_round_share,
                     `${fmt(m.last_round_share * 100, 1)} %`));
  const moved = m.bytes_up + m.bytes_down;
  const below = moved ? (m.dense_bytes_up + m.dense_bytes_down) / moved : null;
  row.append(numCell("bytes_moved", moved,
                     `${fmt(m.bytes_up / MIB, 1)} / ${fmt(m.bytes_down / MIB, 1)} MiB` +
                     (below === null ? "" : ` (${fmt(below, 1)}×)`)));
  row.append(numCell("compute_utilization", m.compute_utilization,
                     m.compute_utilization === null ? "–"
                       : `${fmt(m.compute_utilization * 100, 0)} %`));
  const seen = numCell("last_seen_s_ago", m.last_seen_s_ago,
                       `${fmt(m.last_seen_s_ago, 1)} s ago`);
  seen.append(node("span", { "data-field": "longest_silence_s",
                             "data-value": m.longest_silence_s, class: "sub" },
                   `longest silence ${fmt(m.longest_silence_s, 1)} s`));
  row.append(seen);
  // agreement with its peers (server/scores.py): the window's mean, the last round's under it
  const agreement = numCell("score_mean", m.score_mean,
                            m.score_mean === null ? "–" : fmt(m.score_mean, 2));
  agreement.classList.toggle("against", m.score_mean !== null && m.score_mean < 0);
  if (m.score !== null) {
    agreement.append(node("span", { "data-field": "score", "data-value": m.score,
                                    class: "sub" }, `last ${fmt(m.score, 2)}`));
  }
  row.append(agreement);
  row.append(numCell("rejections", m.rejections, fmt(m.rejections, 0)));
  row.append(node("td", { "data-field": "state", class: `state state-${m.state}` }, m.state));
  return row;
}

const count = (n, noun) => `${fmt(n, 0)} ${noun}${n === 1 ? "" : "s"}`; // "1 member"

// What the run came to, in a few sentences: where it is (or how it ended), who took part,
// and (once finished) each tier's final loss.
function renderStory(run, clients) {
  const summary = run.phase === "finished"
    ? `The run finished after ${count(run.round, "round")} and ${count(run.tokens, "token")}.`
    : `${run.phase === "waiting" ? "Waiting" : "Training"}: ${count(run.round, "round")}`
      + (run.rounds_planned === null ? "" : ` of ${fmt(run.rounds_planned, 0)}`)
      + ` done, ${count(clients.members.length, "member")} in the run now.`;
  // every name once, those here first, then those that left (newest first), the excluded
  const names = [...new Set([...clients.members.map((m) => m.name),
                             ...[...clients.departed].reverse().map((d) => d.name),
                             ...clients.excluded.map((e) => e.name || e.client_id)])];
  const rest = clients.took_part - Math.min(names.length, NAMES_SHOWN); // counted, not named
  const who = clients.took_part === 0 ? "No member has joined yet."
    : `${count(clients.took_part, "member")} took part: ${names.slice(0, NAMES_SHOWN).join(", ")}`
      + `${rest > 0 ? ` and ${fmt(rest, 0)} more` : ""}.`;
  const parts = [node("span", { "data-field": "summary" }, summary), " ",
                 node("span", { "data-field": "took_part", "data-value": clients.took_part },
                      who)];
  const losses = Object.entries(run.last_loss);
  if (run.phase === "finished" && losses.length) {
    parts.push(" ", node("span", { "data-field": "final_loss" }, "Final training loss: "
      + losses.map(([tier, p]) => `tier ${tier} ${fmt(p.loss, 3)}`).join(" · ") + "."));
  }
  // the newest checkpoint evaluated on held-out sequences, at every tier evaluated there
  const evaluated = Object.entries(held.heldOut).map(([tier, points]) => [tier, points.at(-1)]);
  const newest = Math.max(...evaluated.map(([, p]) => p[0]));
  const atNewest = evaluated.filter(([, p]) => p[0] === newest);
  if (atNewest.length) {
    parts.push(" ", node("span", { "data-field": "held_out", "data-value": newest },
      `Held-out loss of round-${newest} (${count(atNewest[0][1][2], "sequence")}): `
      + atNewest.map(([tier, p]) => `tier ${tier} ${fmt(p[1], 3)}`).join(" · ") + "."));
  }
  $("#story").dataset.phase = run.phase;
  $("#story").replaceChildren(...parts);
}

function renderClients(clients) {
  const rows = [...clients.members]
    .sort((a, b) => a.tier - b.tier || a.name.localeCompare(b.name)).map(clientRow);
  if (!rows.length) rows.push(emptyRow(11, clients.took_part === 0 ? "no clients have joined"
    : `no members now: ${count(clients.took_part, "member")} took part (see below)`));
  $("#clients tbody").replaceChildren(...rows);
  const excluded = clients.excluded.map((e) => {
    const item = node("li", { "data-client-id": e.client_id });
    item.append(node("b", { "data-field": "name" }, e.name || e.client_id), ": ",
                node("span", { "data-field": "reason" }, e.reason));
    return item;
  });
  if (!excluded.length) excluded.push(node("li", { class: "muted" }, "none"));
  $("#excluded").replaceChildren(...excluded);
  const departed = [...clients.departed].reverse().slice(0, DEPARTED_SHOWN).map((d) => {
    const item = node("li", { "data-client-id": d.client_id });
    item.append(node("b", { "data-field": "name" }, d.name), " ", tierBadge(d.tier),
                " left in round ",
                node("span", { "data-field": "round", "data-value": d.round }, fmt(d.round, 0)),
                ": ", node("span", { "data-field": "reason" }, d.reason));
    if (d.leaves > 1) {
      item.append(node("span", { "data-field": "leaves", "data-value": d.leaves,
                                 class: "leaves" }, `(left ${fmt(d.leaves, 0)} times)`));
    }
    return item;
  });
  const more = clients.departed.length - departed.length + clients.departed_beyond;
  if (more > 0) {
    departed.push(node("li", { "data-field": "more", "data-value": more, class: "muted" },
                       `and ${count(more, "member")} more that left earlier`));
  }
  if (!departed.length) departed.push(node("li", { class: "muted" }, "none"));
  $("#departed").replaceChildren(...departed);
}

function emptyRow(columns, text) {
  const row = node("tr", { class: "empty" });
  row.append(node("td", { colspan: columns }, text));
  return row;
}

function renderCharts() {
  const lossSeries = Object.keys(held.loss).sort((a, b) => a - b).map((tier) => ({
    key: tier, label: `tier ${tier}`, color: tierColor(tier), points: held.loss[tier] }));
  for (const tier of Object.keys(held.heldOut).sort((a, b) => a - b)) {
    lossSeries.push({ key: `held-out-${tier}`, label: `tier ${tier} held-out`,
                      color: tierColor(tier), dashed: true, markers: true,
                      points: held.heldOut[tier].map(([round, loss]) => [round, loss]) });
  }
  const legend = lossSeries.filter((s) => !s.dashed);
  if (legend.length < lossSeries.length) {
    legend.push({ label: "held-out", color: "#6b7280", dashed: true });
  }
  drawLineChart($("#loss-chart"), lossSeries, { yFormat: fmt, legend });
  drawLineChart($("#bytes-chart"), [
    { key: "bytes_sent", label: "sent (compressed)", color: "#2563eb",
      points: held.perRound.bytes_sent },
    { key: "bytes_dense", label: "dense float32", color: "#9ca3af",
      points: held.perRound.bytes_dense },
  ], { logY: true, yFormat: fmtDecimalBytes });
  drawLineChart($("#duration-chart"), [
    { key: "duration_s", label: "round", color: "#0f766e",
      points: held.perRound.duration_s },
    { key: "slowest_s", label: "slowest client", color: "#f59e0b", dashed: true,
      points: held.perRound.slowest_s },
  ], { yFormat: (v, digits) => `${fmt(v, digits)} s` });
}

function renderRounds() {
  const rounds = held.rounds;
  let sent = 0;
  let dense = 0;
  for (const r of rounds) {
    sent += r.bytes_sent;
    dense += r.bytes_dense;
  }
  const ratio = sent ? dense / sent : null;
  setValue("#bytes-ratio", ratio, ratio === null ? "–" : `${fmt(ratio, 1)}×`);
  const latest = rounds[rounds.length - 1];
  setValue("#slowest-name", latest ? latest.slowest_client_id : null,
           latest ? latest.slowest_name : "–");
  setValue("#slowest-s", latest ? latest.slowest_s : null,
           latest ? `${fmt(latest.slowest_s, 2)} s` : "");
  const rows = rounds.slice(-ROUNDS_SHOWN).reverse().map((r) => {
    const row = node("tr", { "data-round": r.round });
    row.append(numCell("round", r.round, fmt(r.round, 0)));
    row.append(numCell("duration_s", r.duration_s, `${fmt(r.duration_s, 2)} s`));
    row.append(node("td", { "data-field": "slowest_name", "data-value": r.slowest_client_id },
                    r.slowest_name));
    row.append(numCell("slowest_s", r.slowest_s, `${fmt(r.slowest_s, 2)} s`));
    row.append(numCell("bytes_sent", r.bytes_sent, fmt(r.bytes_sent, 0)));
    row.append(numCell("bytes_dense", r.bytes_dense, fmt(r.bytes_dense, 0)));
    const dropped = node("td", { "data-field": "dropped", "data-value": r.dropped.length });
    dropped.textContent = r.dropped.length
      ? r.dropped.map((d) => `${d.name}: ${d.reason}`).join("; ") : "–";
    row.append(dropped);
    return row;
  });
  if (!rows.length) rows.push(emptyRow(7, "no round has completed yet"));
  $("#rounds-table tbody").replaceChildren(...rows);
}

function eventRow(e) {
  const row = node("tr", { "data-seq": e.seq, "data-kind": e.kind });
  row.append(node("td", { "data-field": "time", "data-value": e.time }, fmtClock(e.time)));
  row.append(numCell("round", e.round, fmt(e.round, 0)));
  row.append(node("td", { "data-field": "kind", class: `kind-${e.kind}` }, e.kind));
  row.append(node("td", { "data-field": "client", "data-value": e.client_id ?? "" },
                  e.client_id === null ? "–" : nameOf(e.client_id)));
  row.append(node("td", { "data-field": "detail" }, e.detail));
  return row;
}

// Newest first: the new events go on top, the oldest beyond EVENTS_KEPT fall off.
function renderEvents() {
  const body = $("#events tbody");
  const newest = body.querySelector("tr[data-seq]");
  const shown = newest ? Number(newest.dataset.seq) : -1;
  const rows = held.events.filter((e) => e.seq > shown).reverse().map(eventRow);
  if (!newest) body.replaceChildren();
  body.prepend(...rows);
  while (body.rows.length > EVENTS_KEPT) body.lastElementChild.remove();
  if (!body.rows.length) body.append(emptyRow(5, "no events yet"));
}

function render(snap, grew) {
  renderRun(snap.run);
  renderStory(snap.run, snap.clients);
  renderClients(snap.clients);
  if (grew.rounds || held.heldOutChanged) renderCharts();
  if (grew.rounds) renderRounds();
  if (grew.events) renderEvents();
  $("#dashboard").dataset.serverTime = String(snap.run.server_time);
  $("#dashboard").dataset.round = String(snap.run.round);
}

// -- polling --------------------------------------------------------------------------------

function showConnection() {
  const conn = $("#conn");
  const age = held.updatedAt === null ? null : (Date.now() - held.updatedAt) / 1000;
  const ago = age === null ? "never" : `${fmt(age, 0)} s ago`;
  if (conn.dataset.state === "disconnected") {
    conn.textContent = `disconnected · last update ${ago}`;
  } else if (conn.dataset.state === "finished") {
    conn.textContent = `run finished · updated ${ago}`;
  } else if (conn.dataset.state === "live") {
    conn.textContent = `live · updated ${ago}`;
  }
}

async function poll() {
  const url = `/api/dashboard?since_round=${held.lastRound + 1}&events_after=${held.lastSeq}`;
  const controller = new AbortController();
  const timer = setTimeout(() => controller.abort(), FETCH_TIMEOUT_MS);
  let finished = held.snapshot !== null && held.snapshot.run.phase === "finished";
  try {
    const reply = await fetch(url, { cache: "no-store", signal: controller.signal });
    if (!reply.ok) throw new Error(`HTTP ${reply.status}`);
    const snap = await reply.json();
    const before = { lastRound: held.lastRound, seq: held.lastSeq };
    if (!absorb(snap)) {
      forget();
      setTimeout(poll, 0);
      return;
    }
    const first = held.updatedAt === null;
    held.updatedAt = Date.now();
    render(snap, { rounds: first || held.lastRound !== before.lastRound,
                   events: first || held.lastSeq !== before.seq });
    finished = snap.run.phase === "finished";
    $("#conn").dataset.state = finished ? "finished" : "live";
  } catch (err) {
    $("#conn").dataset.state = "disconnected";
    $("#conn").title = String(err);
  } finally {
    clearTimeout(timer);
  }
  showConnection();
  setTimeout(poll, finished ? FINISHED_POLL_MS : POLL_MS);
}

let resizeTimer = null;
window.addEventListener("resize", () => {
  clearTimeout(resizeTimer);
  resizeTimer = setTimeout(() => { if (held.snapshot) renderCharts(); }, 150);
});
setInterval(showConnection, 1000);
poll();
