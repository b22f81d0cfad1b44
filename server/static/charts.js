// Line charts drawn as SVG by hand: axes with ticks, a legend, one polyline per series.
// Each polyline carries all its points as data-points="round:value,..." (the raw values,
// for tests) while it draws at most a few points per pixel, so 10,000 rounds stay cheap.
// Hovering a chart marks the nearest round and lists each series' value there.

// The namespace of the page's own <svg> elements, so that no URL is spelled out here.
const SVG_NS = document.querySelector("svg").namespaceURI;
const MARGIN = { top: 26, right: 16, bottom: 34, left: 64 };
const POINTS_PER_PIXEL = 2; // beyond this a series is drawn as min/max per pixel column

function el(name, attrs, text) {
  const node = document.createElementNS(SVG_NS, name);
  for (const [key, value] of Object.entries(attrs || {})) node.setAttribute(key, String(value));
  if (text !== undefined) node.textContent = text;
  return node;
}

// About `count` round numbers (1, 2 or 5 times a power of ten) spanning [lo, hi].
export function niceTicks(lo, hi, count) {
  if (!(hi > lo)) return [lo];
  const raw = (hi - lo) / Math.max(count, 1);
  const power = 10 ** Math.floor(Math.log10(raw));
  const step = [1, 2, 5, 10].map((m) => m * power).find((s) => s >= raw);
  const ticks = [];
  for (let t = Math.ceil(lo / step) * step; t <= hi + step * 1e-9; t += step) {
    ticks.push(Number(t.toPrecision(12)));
  }
  return ticks;
}

function logTicks(lo, hi) {
  const first = Math.floor(Math.log10(lo));
  const last = Math.ceil(Math.log10(hi));
  const mantissas = last - first <= 2 ? [1, 2, 5] : [1];
  const ticks = [];
  for (let e = first; e <= last; e += 1) {
    for (const m of mantissas) {
      const t = m * 10 ** e;
      if (t >= lo && t <= hi) ticks.push(t);
    }
  }
  return ticks.length ? ticks : [lo, hi];
}

// At most POINTS_PER_PIXEL points per pixel column: each column's first, min, max and last.
function thin(points, toX, width) {
  if (points.length <= width * POINTS_PER_PIXEL) return points;
  const kept = [];
  let column = null;
  let group = [];
  const flush = () => {
    if (!group.length) return;
    let lo = group[0];
    let hi = group[0];
    for (const p of group) {
      if (p[1] < lo[1]) lo = p;
      if (p[1] > hi[1]) hi = p;
    }
    const picked = new Set([group[0], lo, hi, group[group.length - 1]]);
    for (const p of group) if (picked.has(p)) kept.push(p);
  };
  for (const p of points) {
    const c = Math.floor(toX(p[0]));
    if (c !== column) {
      flush();
      column = c;
      group = [];
    }
    group.push(p);
  }
  flush();
  return kept;
}

// "round:value,..." of a series; series only grow, so the text of the points seen before
// is kept and only the new ones are appended.
const pointsTexts = new Map(); // chart id/series key → {count, last, text}
function pointsText(key, points) {
  const kept = pointsTexts.get(key);
  const reusable = kept && points.length >= kept.count && kept.count > 0
    && points[kept.count - 1] === kept.last;
  const from = reusable ? kept.count : 0;
  const added = points.slice(from).map(([x, y]) => `${x}:${y}`).join(",");
  const text = reusable && added ? `${kept.text},${added}` : reusable ? kept.text : added;
  pointsTexts.set(key, { count: points.length, last: points[points.length - 1], text });
  return text;
}

// series: [{key, label, color, dashed?, markers? (a dot at every point), points: [[round,
// value], ...] in round order}]
// options: {logY, yFormat(value, decimals the ticks need) → text, hoverDigits (decimals a
// hovered value shows; default 3), legend ([{label, color, dashed?}] in place of one entry
// per series)}
export function drawLineChart(svg, series, options) {
  const width = Math.max(svg.clientWidth || 600, 200);
  const height = Math.max(svg.clientHeight || 220, 120);
  svg.setAttribute("viewBox", `0 0 ${width} ${height}`);
  svg.replaceChildren();
  const plotW = width - MARGIN.left - MARGIN.right;
  const plotH = height - MARGIN.top - MARGIN.bottom;
  const all = series.flatMap((s) => s.points).filter((p) => !options.logY || p[1] > 0);
  if (!all.length) {
    svg.append(el("text", { x: width / 2, y: height / 2, class: "empty" }, "no rounds yet"));
    return;
  }
  let [xLo, xHi] = [Infinity, -Infinity];
  let [yLo, yHi] = [Infinity, -Infinity];
  for (const [x, y] of all) {
    xLo = Math.min(xLo, x);
    xHi = Math.max(xHi, x);
    yLo = Math.min(yLo, y);
    yHi = Math.max(yHi, y);
  }
  if (xHi === xLo) xHi = xLo + 1;
  if (options.logY) {
    yLo = 10 ** Math.floor(Math.log10(yLo));
    yHi = 10 ** Math.ceil(Math.log10(yHi));
    if (yHi === yLo) yHi = yLo * 10;
  } else {
    const pad = (yHi - yLo) * 0.05 || Math.abs(yHi) * 0.05 || 1;
    yLo -= pad;
    yHi += pad;
  }
  const toX = (x) => MARGIN.left + ((x - xLo) / (xHi - xLo)) * plotW;
  const scaleY = options.logY
    ? (y) => (Math.log10(y) - Math.log10(yLo)) / (Math.log10(yHi) - Math.log10(yLo))
    : (y) => (y - yLo) / (yHi - yLo);
  const toY = (y) => MARGIN.top + plotH - scaleY(y) * plotH;

  const axes = el("g", { class: "axes" });
  const yTicks = options.logY ? logTicks(yLo, yHi) : niceTicks(yLo, yHi, 5);
  // as many decimals as the step between ticks needs
  const step = yTicks.length > 1 ? yTicks[1] - yTicks[0] : 1;
  const digits = Math.min(Math.max(-Math.floor(Math.log10(step) + 1e-9), 0), 6);
  for (const t of yTicks) {
    const y = toY(t).toFixed(1);
    axes.append(el("line", { x1: MARGIN.left, x2: width - MARGIN.right, y1: y, y2: y,
                             class: "grid" }));
    axes.append(el("text", { x: MARGIN.left - 6, y, class: "tick y" },
                   options.yFormat(t, digits)));
  }
  const xTicks = niceTicks(xLo, xHi, Math.max(Math.floor(plotW / 80), 2))
    .filter((t) => Number.isInteger(t));
  for (const t of xTicks) {
    const x = toX(t).toFixed(1);
    axes.append(el("line", { x1: x, x2: x, y1: MARGIN.top + plotH, y2: MARGIN.top + plotH + 4,
                             class: "tickmark" }));
    axes.append(el("text", { x, y: MARGIN.top + plotH + 16, class: "tick x" }, String(t)));
  }
  axes.append(el("line", { x1: MARGIN.left, x2: width - MARGIN.right, y1: MARGIN.top + plotH,
                           y2: MARGIN.top + plotH, class: "axis" }));
  axes.append(el("line", { x1: MARGIN.left, x2: MARGIN.left, y1: MARGIN.top,
                           y2: MARGIN.top + plotH, class: "axis" }));
  axes.append(el("text", { x: MARGIN.left + plotW / 2, y: height - 4, class: "label" }, "round"));
  svg.append(axes);

  const legend = el("g", { class: "legend" });
  let lx = width - MARGIN.right;
  for (const s of [...(options.legend || series)].reverse()) {
    const text = el("text", { x: lx, y: 14, class: "legend-text" }, s.label);
    legend.append(text);
    lx -= s.label.length * 6.5 + 6;
    legend.append(s.dashed
      ? el("line", { x1: lx - 12, x2: lx, y1: 10, y2: 10, stroke: s.color,
                     class: "series dashed" })
      : el("rect", { x: lx - 10, y: 5, width: 10, height: 10, fill: s.color, rx: 2 }));
    lx -= 22;
  }

  for (const s of series) {
    const points = options.logY ? s.points.filter((p) => p[1] > 0) : s.points;
    const drawn = thin(points, toX, plotW)
      .map(([x, y]) => `${toX(x).toFixed(1)},${toY(y).toFixed(1)}`).join(" ");
    const line = el("polyline", { points: drawn, stroke: s.color,
                                  class: s.dashed ? "series dashed" : "series",
                                  "data-series": s.key });
    line.setAttribute("data-points", pointsText(`${svg.id}/${s.key}`, s.points));
    svg.append(line);
    if (s.markers) {
      for (const [x, y] of points) {
        svg.append(el("circle", { cx: toX(x).toFixed(1), cy: toY(y).toFixed(1), r: 3.5,
                                  fill: "white", stroke: s.color, class: "marker",
                                  "data-series": s.key, "data-round": x, "data-value": y }));
      }
      continue;
    }
    const last = points[points.length - 1];
    if (last) {
      svg.append(el("circle", { cx: toX(last[0]).toFixed(1), cy: toY(last[1]).toFixed(1), r: 3,
                                fill: s.color, "data-series": s.key, "data-round": last[0],
                                "data-value": last[1] }));
    }
  }
  svg.append(legend);
  const fromX = (px) => xLo + ((px - MARGIN.left) / plotW) * (xHi - xLo);
  followHover(svg, { series, toX, toY, fromX, logY: options.logY, yFormat: options.yFormat,
                     digits: options.hoverDigits ?? 3, plot: { x: MARGIN.left, y: MARGIN.top,
                                                               w: plotW, h: plotH } });
}

// -- hover ------------------------------------------------------------------------------------

// The rounds any series has a point at, sorted, for the nearest-round search.
function roundsOf(series) {
  const all = new Set();
  for (const s of series) for (const [x] of s.points) all.add(x);
  return [...all].sort((a, b) => a - b);
}

function nearest(sorted, x) {
  let lo = 0;
  let hi = sorted.length - 1;
  while (lo < hi) {
    const mid = (lo + hi) >> 1;
    if (sorted[mid] < x) lo = mid + 1;
    else hi = mid;
  }
  return lo > 0 && x - sorted[lo - 1] < sorted[lo] - x ? sorted[lo - 1] : sorted[lo];
}

// Each series' value at exactly `round` (binary search: points are in round order).
function valueAt(points, round) {
  let lo = 0;
  let hi = points.length - 1;
  while (lo <= hi) {
    const mid = (lo + hi) >> 1;
    if (points[mid][0] === round) return points[mid][1];
    if (points[mid][0] < round) lo = mid + 1;
    else hi = mid - 1;
  }
  return undefined;
}

// The hover layer: a guide line at the nearest round and a box listing every series' value
// there (raw values in data-value). The chart's state is replaced at each redraw; the
// listeners are added once per <svg>, and a redraw under the pointer shows the box again.
function followHover(svg, state) {
  state.rounds = roundsOf(state.series);
  svg.__hover = state;
  if (!svg.__hoverBound) {
    svg.__hoverBound = true;
    svg.addEventListener("pointermove", (event) => {
      const box = svg.getBoundingClientRect();
      const scale = box.width ? svg.viewBox.baseVal.width / box.width : 1;
      svg.__pointerX = (event.clientX - box.left) * scale;
      showHover(svg);
    });
    svg.addEventListener("pointerleave", () => {
      svg.__pointerX = null;
      svg.querySelector("g.hover")?.remove();
    });
  }
  if (svg.__pointerX !== null && svg.__pointerX !== undefined) showHover(svg);
}

function showHover(svg) {
  const h = svg.__hover;
  svg.querySelector("g.hover")?.remove();
  const px = svg.__pointerX;
  const slack = 8; // pixels beside the plot that still point at its first or last round
  if (!h || !h.rounds.length || px < h.plot.x - slack || px > h.plot.x + h.plot.w + slack) return;
  const round = nearest(h.rounds, h.fromX(px)); // the round drawn nearest the pointer
  const rows = [];
  for (const s of h.series) {
    const value = valueAt(s.points, round);
    if (value !== undefined && (!h.logY || value > 0)) rows.push([s, value]);
  }
  const x = h.toX(round);
  const layer = el("g", { class: "hover", "data-round": round });
  layer.append(el("line", { x1: x.toFixed(1), x2: x.toFixed(1), y1: h.plot.y,
                            y2: h.plot.y + h.plot.h, class: "guide" }));
  for (const [s, value] of rows) {
    layer.append(el("circle", { cx: x.toFixed(1), cy: h.toY(value).toFixed(1), r: 3.5,
                                fill: s.color, class: "hover-dot" }));
  }
  const lines = [[null, `round ${round}`],
                 ...rows.map(([s, v]) => [s, `${s.label}: ${h.yFormat(v, h.digits)}`])];
  const width = Math.max(...lines.map(([, text]) => text.length)) * 6.4 + 28;
  const height = lines.length * 15 + 8;
  const left = x + 10 + width > h.plot.x + h.plot.w ? x - 10 - width : x + 10;
  const box = el("g", { class: "hover-box",
                         transform: `translate(${left.toFixed(1)},${h.plot.y + 4})` });
  box.append(el("rect", { width: width.toFixed(0), height, rx: 4 }));
  lines.forEach(([s, text], i) => {
    const y = 16 + i * 15;
    if (!s) {
      box.append(el("text", { x: 8, y, class: "hover-round" }, text));
      return;
    }
    box.append(el("rect", { x: 8, y: y - 8, width: 8, height: 8, rx: 2, fill: s.color }));
    box.append(el("text", { x: 20, y, class: "hover-value", "data-series": s.key,
                            "data-value": rows[i - 1][1] }, text));
  });
  layer.append(box);
  svg.append(layer);
}
