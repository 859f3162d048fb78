// Tokens per second over a job's run, drawn as SVG. The series comes from what the API records, each
// unit's commit time and tokens (GET /jobs/{id}/units), so a page opened mid-job shows the whole run, not
// only what it watched. Loaded before app.js; the page's CSP allows no inline script or style, so every
// node is made here and coloured by style.css classes.
"use strict";

const SVG_NS = "http://www.w3.org/2000/svg";
const PLOT = { width: 720, height: 200, left: 64, right: 16, top: 14, bottom: 38 };
const MAX_BUCKETS = 40;

function svgEl(tag, attrs, ...children) {
  const node = document.createElementNS(SVG_NS, tag);
  for (const [k, v] of Object.entries(attrs || {})) if (v !== null && v !== undefined) node.setAttribute(k, String(v));
  for (const child of children) node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  return node;
}

// A unit's tokens land at the instant it commits, but were made over its whole run, and each worker
// process runs its units one after another: a unit's tokens are spread from its worker's previous commit
// to its own, so the rate holds between commits instead of being a comb of instants. A worker's first
// unit, with no commit before it, is given the median span of the others (from the job's start at most).
// Time a worker waited on consumers counts as slow work. The tokens of units at work (in flight) are
// spread from where the oldest of them began to now. So the buckets add up to the job's progress.tokens,
// and their mean is its tokens_per_second.
function workSpans(startMs, endMs, units, inFlightTokens) {
  const done = units.filter((u) => u.state === "done" && u.finished_at)
    .map((u) => ({ worker: u.worker || "", to: Date.parse(u.finished_at), tokens: u.tokens }))
    .sort((a, b) => a.to - b.to);
  const lastCommit = new Map();
  for (const c of done) {
    c.from = lastCommit.has(c.worker) ? lastCommit.get(c.worker) : null;
    lastCommit.set(c.worker, c.to);
  }
  const known = done.filter((c) => c.from !== null).map((c) => c.to - c.from).sort((a, b) => a - b);
  const typical = known.length ? known[Math.floor(known.length / 2)] : Infinity;
  const began = (worker, to) => lastCommit.has(worker) ? lastCommit.get(worker) : Math.max(startMs, to - typical);
  for (const c of done) if (c.from === null) c.from = Math.max(startMs, c.to - typical);
  const spans = done.map((c) => ({ from: c.from, to: c.to, tokens: c.tokens }));
  if (inFlightTokens) {
    const atWork = units.filter((u) => u.lease_seconds_left !== null).map((u) => began(u.worker || "", endMs));
    spans.push({ from: atWork.length ? Math.min(...atWork) : endMs, to: endMs, tokens: inFlightTokens });
  }
  return { spans, commits: done.length };
}

// Tokens per bucket over [startMs, endMs]: about one bucket a second, 2 to MAX_BUCKETS of them.
function throughputSeries(startMs, endMs, spans) {
  const span = Math.max(endMs - startMs, 1);
  const n = Math.max(2, Math.min(MAX_BUCKETS, Math.round(span / 1000)));
  const width = span / n;
  const tokens = new Array(n).fill(0);
  const bucket = (ms) => Math.min(n - 1, Math.max(0, Math.floor((ms - startMs) / width)));
  for (const s of spans) {
    const from = Math.max(startMs, Math.min(s.from, s.to)), to = Math.min(endMs, Math.max(s.to, startMs));
    if (to - from <= 0) { tokens[bucket(to)] += s.tokens; continue; }
    for (let i = bucket(from); i <= bucket(to) && i < n; i++) {
      const overlap = Math.min(to, startMs + (i + 1) * width) - Math.max(from, startMs + i * width);
      if (overlap > 0) tokens[i] += s.tokens * overlap / (to - from);
    }
  }
  return tokens.map((t, i) => ({ start: startMs + i * width, end: startMs + (i + 1) * width, tokens: t, rate: t / (width / 1000) }));
}

// The smallest of 1, 2, 2.5, 5 times a power of ten at or above x: a y-axis top that reads well.
function niceCeil(x) {
  if (!(x > 0)) return 1;
  const power = Math.pow(10, Math.floor(Math.log10(x)));
  for (const step of [1, 2, 2.5, 5, 10]) if (step * power >= x) return step * power;
  return 10 * power;
}

function fmtRate(r) {
  if (r >= 1e6) return (r / 1e6).toFixed(r >= 1e7 ? 0 : 1) + "M";
  if (r >= 1e3) return (r / 1e3).toFixed(r >= 1e4 ? 0 : 1) + "k";
  return r >= 10 || r === 0 ? r.toFixed(0) : r.toFixed(1);
}

function fmtElapsed(s) {
  if (s < 90) return Math.round(s) + " s";
  if (s < 5400) return (s / 60).toFixed(s < 600 ? 1 : 0) + " min";
  return (s / 3600).toFixed(1) + " h";
}

// The job document, its units, and the server's clock (from the response's Date header; the browser's
// own clock may be off) give the plot; a job not started yet has none.
function drawThroughput(box, caption, doc, units, serverNowMs) {
  if (!doc.started_at) {
    box.replaceChildren();
    caption.textContent = "not started";
    return;
  }
  const startMs = Date.parse(doc.started_at);
  const running = doc.state === "running";
  let endMs = doc.finished_at ? Date.parse(doc.finished_at) : serverNowMs;
  for (const u of units) if (u.finished_at) endMs = Math.max(endMs, Date.parse(u.finished_at));
  const inFlight = running && doc.progress.in_flight ? doc.progress.in_flight.tokens : 0;
  const { spans, commits } = workSpans(startMs, endMs, units, inFlight);
  const series = throughputSeries(startMs, endMs, spans);
  const total = Math.round(series.reduce((sum, b) => sum + b.tokens, 0));
  const spanS = (series[series.length - 1].end - startMs) / 1000;
  const mean = total / spanS;
  const peak = Math.max(...series.map((b) => b.rate));
  const ymax = niceCeil(Math.max(peak, mean));

  const P = PLOT, innerW = P.width - P.left - P.right, innerH = P.height - P.top - P.bottom;
  const x = (ms) => P.left + ((ms - startMs) / 1000 / spanS) * innerW;
  const y = (rate) => P.top + innerH - (rate / ymax) * innerH;
  const xy = (v) => v.toFixed(1);
  const points = series.map((b) => [x((b.start + b.end) / 2), y(b.rate)]);
  const line = points.map(([px, py]) => xy(px) + "," + xy(py)).join(" ");
  const area = xy(points[0][0]) + "," + xy(y(0)) + " " + line + " " + xy(points[points.length - 1][0]) + "," + xy(y(0));

  const plot = svgEl("svg", {
    class: "plot", viewBox: `0 0 ${P.width} ${P.height}`, role: "img", "data-testid": "throughput-plot",
    "data-points": series.length, "data-ymax": ymax, "data-tokens": total, "data-mean": mean.toFixed(1),
    "aria-label": `tokens per second over ${fmtElapsed(spanS)}: mean ${fmtRate(mean)}, peak ${fmtRate(peak)}`,
  });
  for (const frac of [0, 0.5, 1]) {  // y grid and ticks
    const rate = ymax * frac;
    plot.append(svgEl("line", { class: "grid", x1: P.left, x2: P.width - P.right, y1: xy(y(rate)), y2: xy(y(rate)) }),
      svgEl("text", { class: "tick", x: P.left - 6, y: xy(y(rate) + 4), "text-anchor": "end", "data-testid": frac === 1 ? "plot-ymax" : null }, fmtRate(rate)));
  }
  for (const frac of [0, 0.5, 1]) {  // x ticks: time since the job started
    const label = frac === 1 && running ? "now" : fmtElapsed(spanS * frac);
    plot.append(svgEl("text", { class: "tick", x: xy(P.left + innerW * frac), y: P.top + innerH + 15,
      "text-anchor": frac === 0 ? "start" : frac === 1 ? "end" : "middle" }, label));
  }
  plot.append(
    svgEl("text", { class: "axis", x: 14, y: P.top + innerH / 2, "text-anchor": "middle",
      transform: `rotate(-90 14 ${P.top + innerH / 2})` }, "tok/s"),
    svgEl("text", { class: "axis", x: P.left + innerW / 2, y: P.height - 4, "text-anchor": "middle" },
      "time since start (" + new Date(startMs).toLocaleTimeString() + ")"),
    svgEl("line", { class: "frame", x1: P.left, x2: P.left, y1: P.top, y2: P.top + innerH }),
    svgEl("line", { class: "frame", x1: P.left, x2: P.width - P.right, y1: P.top + innerH, y2: P.top + innerH }),
    svgEl("polygon", { class: "area", points: area }),
    svgEl("line", { class: "mean", x1: P.left, x2: P.width - P.right, y1: xy(y(mean)), y2: xy(y(mean)) },
      svgEl("title", {}, "mean " + fmtRate(mean) + " tok/s")),
    svgEl("polyline", { class: "rate", points: line, "data-testid": "throughput-line" }));
  series.forEach((b, i) => {  // a point a bucket, its numbers on hover
    const when = fmtElapsed((b.start - startMs) / 1000) + "–" + fmtElapsed((b.end - startMs) / 1000);
    plot.append(svgEl("circle", { class: "point", cx: xy(points[i][0]), cy: xy(points[i][1]), r: 2.5,
      "data-rate": b.rate.toFixed(1), "data-tokens": b.tokens.toFixed(3) },
    svgEl("title", {}, `${when}: ${fmtRate(b.rate)} tok/s (${Math.round(b.tokens)} tokens)`)));
  });
  box.replaceChildren(plot);
  caption.textContent = `mean ${fmtRate(mean)} tok/s · peak ${fmtRate(peak)} · last ${fmtRate(series[series.length - 1].rate)}` +
    ` · ${commits} unit${commits === 1 ? "" : "s"} committed` + (inFlight ? ` · ${inFlight} tokens of units at work` : "");
}
