// The hsx dashboard: plain JavaScript against the same API and the same bearer token as the CLI.
// Every value from the API goes into the page through textContent, never as HTML.
"use strict";

const REFRESH_MS = 2000;
const TOKEN_KEY = "hsx-token";
const SKEW_MS = 2000;  // the browser's clock is trusted unless it is this far from the API's
let selectedJob = null;
let verifying = false;
// Refreshes may overlap (a click refreshes at once, a slow API outlasts the interval): each takes a number,
// and a part of the page is drawn only from a refresh newer than the one that drew it last.
let refreshSeq = 0;
let refreshesInFlight = 0;
let refreshesDone = 0;
const drawnBy = { jobs: 0, job: 0, engines: 0 };

function fresh(part, seq) {
  if (seq < drawnBy[part]) return false;
  drawnBy[part] = seq;
  return true;
}

function token() { return sessionStorage.getItem(TOKEN_KEY) || ""; }

async function api(method, path, body) {
  const headers = { "Accept": "application/json" };
  if (token()) headers["Authorization"] = "Bearer " + token();
  if (body !== undefined) headers["Content-Type"] = "application/json";
  const resp = await fetch(path, { method, headers, body: body === undefined ? undefined : JSON.stringify(body) });
  let doc = null;
  try { doc = await resp.json(); } catch (_) { doc = null; }
  return { status: resp.status, ok: resp.ok, doc, date: resp.headers.get("Date") };
}

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "class") node.className = v;
    else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
    else node.setAttribute(k, v);
  }
  for (const child of children) {
    if (child === null || child === undefined) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

const NOTICE_MS = 8000;
let noticeUntil = 0;

function setStatus(text, bad) {
  const s = document.getElementById("status");
  s.textContent = text;
  s.className = bad ? "bad" : "muted";
}

// What an action did (or why it failed) stays up for a while instead of the next refresh's timestamp.
function notice(text, bad) {
  setStatus(text, bad);
  noticeUntil = Date.now() + NOTICE_MS;
}

function fmtSeconds(s) {
  if (s === null || s === undefined) return "";
  if (s < 90) return Math.round(s) + " s";
  if (s < 5400) return Math.round(s / 60) + " min";
  return (s / 3600).toFixed(1) + " h";
}

function fmtBytes(n) {
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return n.toFixed(i ? 1 : 0) + " " + units[i];
}

function bar(fraction) {
  const pct = Math.max(0, Math.min(1, fraction || 0)) * 100;
  const fill = el("span", {});
  fill.style.width = pct + "%";  // CSSOM, not a style attribute: the page's CSP allows no inline styles
  return el("span", { class: "bar", title: pct.toFixed(1) + "%" }, fill);
}

function failed(what, resp) {
  const detail = resp.doc && resp.doc.detail ? resp.doc.detail : "HTTP " + resp.status;
  notice(what + ": " + detail, true);
}

// --- jobs -------------------------------------------------------------------------------------------------

async function cancelJob(id) {
  const resp = await api("POST", "/jobs/" + encodeURIComponent(id) + "/cancel");
  if (!resp.ok) return failed("cancel", resp);
  notice("job " + id.slice(0, 8) + " cancelled");
  refresh();
}

async function retryJob(id) {
  // A retry is the same request again: a new job over the same dataset with the same options.
  const job = await api("GET", "/jobs/" + encodeURIComponent(id));
  if (!job.ok) return failed("retry", job);
  const resp = await api("POST", "/jobs", { dataset_uri: job.doc.dataset_uri, options: job.doc.options });
  if (!resp.ok) return failed("retry", resp);
  notice("job " + id.slice(0, 8) + " resubmitted as " + resp.doc.id.slice(0, 8));
  selectedJob = resp.doc.id;
  refresh();
}

function jobRow(job) {
  const p = job.progress;
  const active = job.state === "queued" || job.state === "running";
  const actions = el("td", {});
  if (active) {
    actions.append(el("button", { "data-testid": "cancel-" + job.id, onclick: (e) => { e.stopPropagation(); cancelJob(job.id); } }, "cancel"));
  } else if (job.state !== "succeeded") {
    actions.append(el("button", { "data-testid": "retry-" + job.id, onclick: (e) => { e.stopPropagation(); retryJob(job.id); } }, "retry"));
  }
  const row = el("tr", { class: "job" + (job.id === selectedJob ? " selected" : ""), "data-job": job.id, "data-state": job.state,
                         onclick: () => { selectedJob = job.id; refresh(); } },
    el("td", { class: "mono", title: job.id }, job.id.slice(0, 8)),
    el("td", { class: "mono", title: job.dataset_uri }, job.dataset_uri.split("/").pop()),
    el("td", {}, el("span", { class: "state " + job.state, "data-testid": "state-" + job.id }, job.state)),
    el("td", {}, bar(p.fraction), " ", (p.fraction * 100).toFixed(0) + "%"),
    el("td", {}, p.samples_done + " / " + p.samples_total),
    el("td", {}, p.samples_rejected),
    el("td", {}, p.tokens_per_second === null ? "" : p.tokens_per_second.toFixed(1)),
    el("td", {}, fmtSeconds(p.eta_seconds)),
    el("td", { class: "muted" }, new Date(job.created_at).toLocaleString()),
    actions);
  return row;
}

async function loadJobs(seq) {
  const resp = await api("GET", "/jobs?limit=50");
  if (!resp.ok) { failed("jobs", resp); return false; }
  if (!fresh("jobs", seq)) return true;
  const body = document.getElementById("jobs");
  body.replaceChildren(...resp.doc.items.map(jobRow));
  document.getElementById("jobs-total").textContent = resp.doc.total + " in all";
  if (!selectedJob && resp.doc.items.length) selectedJob = resp.doc.items[0].id;
  return true;
}

// The API's clock now, from a response's Date header (whole seconds), or the browser's when they agree.
function serverNow(resp) {
  const local = Date.now();
  const remote = resp.date ? Date.parse(resp.date) : NaN;
  return Number.isFinite(remote) && Math.abs(remote - local) > SKEW_MS ? remote : local;
}

async function loadJob(seq) {
  const panel = document.getElementById("job-panel");
  if (!selectedJob) { panel.hidden = true; return; }
  const wanted = selectedJob;
  const id = encodeURIComponent(wanted);
  const [job, units] = await Promise.all([api("GET", "/jobs/" + id), api("GET", "/jobs/" + id + "/units")]);
  if (wanted !== selectedJob) return;  // another job was picked meanwhile: a later refresh draws it
  if (!fresh("job", seq)) return;  // a newer refresh drew this panel already
  if (!job.ok) { panel.hidden = true; return; }
  panel.hidden = false;
  const doc = job.doc;
  document.getElementById("job-id").textContent = doc.id;
  const state = document.getElementById("job-state");
  state.textContent = doc.state;
  state.className = "state " + doc.state;
  document.getElementById("job-error").textContent = doc.error || "";
  drawStream(doc.stream);
  drawThroughput(document.getElementById("throughput-plot"), document.getElementById("throughput-summary"),
    doc, units.ok ? units.doc.items : [], serverNow(job));
  const reasons = Object.entries(doc.rejections).sort((a, b) => b[1] - a[1]);
  document.getElementById("job-rejections").replaceChildren(
    ...(reasons.length ? reasons.map(([r, n]) => el("tr", {}, el("td", { class: "mono" }, r), el("td", {}, n)))
                       : [el("tr", {}, el("td", { class: "muted" }, "none"))]));
  // The job document shows the first shards; the rest are a page away (doc.shards.href).
  const more = doc.shards.total - doc.shards.items.length;
  document.getElementById("job-shards").replaceChildren(...doc.shards.items.map((s) => el("tr", {},
    el("td", { class: "mono", title: s.path }, s.path.split("/").pop()), el("td", {}, s.samples), el("td", {}, s.tokens),
    el("td", {}, fmtBytes(s.bytes)), el("td", { class: "mono", title: s.sha256 }, s.sha256.slice(0, 12)))),
    ...(more > 0 ? [el("tr", {}, el("td", { class: "muted" }, `… and ${more} more (${doc.shards.href})`))] : []));
  const unitRows = units.ok ? units.doc.items : [];
  document.getElementById("job-units").replaceChildren(...unitRows.map((u) => el("tr", {},
    el("td", {}, u.unit_index), el("td", { class: "state " + (u.state === "done" ? "succeeded" : "running") }, u.state),
    el("td", {}, u.attempt), el("td", {}, u.sample_start + "–" + (u.sample_end - 1)), el("td", {}, u.samples_done),
    el("td", {}, u.samples_rejected), el("td", { class: "mono", title: (u.worker || "") + "@" + (u.engine || "") }, u.worker || ""),
    el("td", {}, u.lease_seconds_left === null ? "" : fmtSeconds(u.lease_seconds_left)))));
}

// A consume job (or one with consumers): bytes on disk (as the cap counts them) against the cap, and who holds what.
function drawStream(stream) {
  const panel = document.getElementById("job-stream");
  panel.hidden = !stream;
  if (!stream) return;
  const held = stream.stored_bytes + stream.in_flight_bytes;
  const cap = stream.cap_bytes;
  const fraction = cap ? Math.min(held / cap, 1) : 0;
  const meter = document.getElementById("stream-buffer");
  meter.style.width = (fraction * 100).toFixed(1) + "%";
  meter.className = stream.waiting_on_consumers ? "full" : "";
  const pct = cap ? held / cap * 100 : null;
  document.getElementById("stream-buffer-label").textContent = cap
    ? fmtBytes(held) + " of " + fmtBytes(cap) + " cap (" + (pct > 999 ? ">999" : pct.toFixed(0)) + "%)"
    : fmtBytes(held) + " held, no cap (keep)";
  document.getElementById("stream-summary").textContent =
    stream.retention + " · buffered " + fmtBytes(stream.buffered_bytes) + " + in flight " + fmtBytes(stream.in_flight_bytes) +
    (cap ? " of " + fmtBytes(cap) + " cap" : "") + " · lag " + fmtBytes(stream.lag_bytes) +
    " (" + stream.items_ready + " shards ready, " + stream.items_leased + " leased, " + stream.items_acked + " acked)" +
    (stream.waiting_on_consumers ? " · waiting on consumers" : "");
  document.getElementById("stream-consumers").replaceChildren(...(stream.consumers.length
    ? stream.consumers.map((c) => el("tr", { "data-consumer": c.id },
        el("td", { class: "mono", title: c.id }, c.name),
        el("td", { "data-testid": "leased-items" }, c.leased_items),
        el("td", { "data-testid": "leased-bytes", title: c.leased_bytes + " bytes" }, fmtBytes(c.leased_bytes)),
        el("td", { "data-testid": "acked" }, c.items_acked),
        el("td", { "data-testid": "idle", title: "since its last lease or acknowledgement" }, fmtSeconds(c.idle_seconds))))
    : [el("tr", {}, el("td", { class: "muted" }, "no consumer yet"))]));
}

// --- engines and verify -------------------------------------------------------------------------------------

async function verify(button) {
  // The engines table is redrawn while verify runs: the flag keeps the redrawn button disabled too.
  verifying = true;
  button.disabled = true;
  const out = document.getElementById("verify-result");
  out.replaceChildren(el("span", { class: "muted" }, "verifying…"));
  let resp;
  try {
    resp = await api("POST", "/verify");
  } finally {
    verifying = false;
    for (const b of document.querySelectorAll("[data-testid=verify]")) b.disabled = false;
  }
  if (!resp.doc || !Array.isArray(resp.doc.checks)) { out.replaceChildren(); return failed("verify", resp); }
  const failedChecks = resp.doc.checks.filter((c) => !c.ok);
  out.replaceChildren(
    el("p", { class: resp.doc.ok ? "ok" : "bad", "data-testid": "verify-verdict" },
      resp.doc.ok ? "verify passed: " + resp.doc.checks.length + " checks ok"
                  : "verify FAILED: " + failedChecks.length + " of " + resp.doc.checks.length + " checks",
      el("span", { class: "muted" }, "  (" + new Date().toLocaleTimeString() + ")")),
    el("table", {}, el("tbody", {}, ...(resp.doc.ok ? resp.doc.checks.slice(0, 6) : failedChecks).map((c) => el("tr", {},
      el("td", { class: "mono" }, c.name), el("td", { class: c.ok ? "ok" : "bad" }, c.ok ? "ok" : "failed"),
      el("td", { class: "muted" }, "expected " + JSON.stringify(c.expected) + ", got " + JSON.stringify(c.actual)
        + (c.reason ? " (" + c.reason + ": " + c.detail + ")" : "")))))));
}

async function loadEngines(seq) {
  const resp = await api("GET", "/engines");
  if (!resp.ok || !fresh("engines", seq)) return;
  document.getElementById("engines").replaceChildren(...resp.doc.map((e) => {
    const model = e.info && e.info.model_path ? String(e.info.model_path).split("/").pop() : "";
    const health = e.healthy === null ? el("span", { class: "muted" }, "not probed")
      : el("span", { class: e.healthy ? "ok" : "bad" }, e.healthy ? "healthy" : "down");
    const action = e.configured
      ? el("button", { "data-testid": "verify", onclick: (ev) => verify(ev.target) }, "verify") : "";
    if (action && verifying) action.disabled = true;
    return el("tr", {}, el("td", { class: "mono" }, e.url), el("td", {}, health), el("td", { class: "mono" }, model),
      el("td", {}, e.live_leases), el("td", {}, e.units_done_last_hour), el("td", {}, action));
  }));
}

async function refresh() {
  const seq = ++refreshSeq;
  document.body.dataset.inFlight = String(++refreshesInFlight);
  try {
    if (await loadJobs(seq)) {
      if (Date.now() > noticeUntil) setStatus("updated " + new Date().toLocaleTimeString());
      await Promise.all([loadJob(seq), loadEngines(seq)]);
    }
  } catch (err) {
    setStatus("API unreachable: " + err, true);
  } finally {
    // Tests wait on these, not on the clock.
    document.body.dataset.inFlight = String(--refreshesInFlight);
    document.body.dataset.refreshes = String(++refreshesDone);
  }
}

document.getElementById("token-form").addEventListener("submit", (e) => {
  e.preventDefault();
  sessionStorage.setItem(TOKEN_KEY, document.getElementById("token").value.trim());
  document.getElementById("token").value = "";
  noticeUntil = 0;
  refresh();
});
refresh();
// A tick while a refresh is still out is skipped rather than piling requests on a slow API.
setInterval(() => { if (!refreshesInFlight) refresh(); }, REFRESH_MS);
