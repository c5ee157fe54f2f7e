// mla_watch status page: polls v1/status (and v1/routing for the shown line) and draws each router's
// routing health, its routing by position bucket, alerts, policies and re-tuning. No framework and no build
// step: this file is served as written.
//
// The URL anchor (#router=...&layer=...&business_line=...&metric=...&alertname=..., the link in every
// alert) selects the business line and the metric the rows show, and highlights the router's row and the
// alert; an anchor without metric (older links) shows entropy. ?refresh=SECONDS sets the polling period and
// ?window=SECONDS the time the heat map spans (default: the shortest of 5 min, 15 min, 1 h, ...
// that holds all the history the sidecar has, so a young sidecar's history is not a sliver).
// Past the live span, 24 h / 7 d / 30 d read the durable history (v1/history) at about COLUMNS
// columns: fetched when chosen, and again once a column's worth of time has passed.
//
// The metric selector: entropy (bits) by default, or any other statistic of GET /v1/routing. The rows
// show the chosen metric's value now (from v1/routing), "healthy X" where the record carries a learned
// baseline, and its history where there is one: the live hour of v1/status holds entropy only, so the
// other metrics are drawn from the durable history (v1/history?metric=...), and the page says so where
// there is none. A row's state is the worst of the alerts firing or pending on its router and line,
// whatever their metric; a window whose figures say nothing (`no_signal`) is greyed with the reason.
// Beside "healthy X" a row says whose traffic its baseline was (its clients, the largest share), and the
// line's baselines note says what is not learned and why (one client's window), and which baselines were
// found not to be the line's traffic and are learned again (v1/status `baselines`).
"use strict";

const QUERY = new URLSearchParams(typeof location === "undefined" ? "" : location.search);
const REFRESH_MS = 1000 * (Number(QUERY.get("refresh")) || 5);
const WINDOWS = [[300, "5 min"], [900, "15 min"], [3600, "1 h"], [21600, "6 h"], [86400, "24 h"]];
const RANGES = [[86400, "24 h"], [604800, "7 d"], [2592000, "30 d"]];
const COLUMNS = 720;
const ROW_HEIGHT = 18;
const COLOURS = { fire: "#e0463e", warn: "#e8a33d", ok: "#3fae6a", high: "#9b6ad6", none: "#2b303b",
                  nosignal: "#4a505c" };
const ENTROPY = "entropy_bits";
// The metrics a row can show: [key in the routing record, label, decimals, unit].
const METRICS = [[ENTROPY, "entropy", 2, "bits"], ["normalized_entropy", "normalized entropy", 3, ""],
  ["max_violation", "MaxVio", 2, ""], ["dead_slots", "dead slots", 0, ""], ["js_divergence", "JS divergence", 3, ""],
  ["locality", "locality", 2, ""]];
const RAMP = ["#1c2b45", "#9cc3ff"]; // a metric drawn without thresholds: darker lower, brighter higher

const view = { history: null, status: null, line: null, focus: null, scrolled: false, updates: 0,
               window: Number(QUERY.get("window")) || null, windowChosen: Boolean(Number(QUERY.get("window"))),
               metric: ENTROPY,
               routing: null, // {line, records: Map(router -> v1/routing record)} of the shown line
               range: null, // {seconds, line, metric, data, fetched} while the durable history is shown
               rangeError: null, // why the durable history of the shown metric did not load
               openIncidents: new Set() }; // the incidents (keys) on-call opened in the alerts table

// ---------------------------------------------------------------- small helpers
const $ = (id) => document.getElementById(id);

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs)) {
    if (value === null || value === undefined) continue;
    if (key === "class") node.className = value;
    else if (key === "dataset") {
      for (const [name, item] of Object.entries(value)) if (item !== null && item !== undefined) node.dataset[name] = item;
    }
    else if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
    else node.setAttribute(key, value);
  }
  for (const child of children.flat()) {
    if (child === null || child === undefined) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

function table(headers, rows) {
  return el("table", {}, el("thead", {}, el("tr", {}, headers.map((h) => el("th", {}, h)))), el("tbody", {}, rows));
}

function bits(value) {
  return value === null || value === undefined ? "–" : Number(value).toFixed(2);
}

function clock(seconds) {
  return seconds ? new Date(seconds * 1000).toLocaleTimeString([], { hour12: false }) : "–";
}

function ago(seconds) {
  if (!seconds) return "–";
  const delta = Math.max(0, Date.now() / 1000 - seconds);
  if (delta < 90) return `${Math.round(delta)} s ago`;
  if (delta < 5400) return `${Math.round(delta / 60)} min ago`;
  return `${(delta / 3600).toFixed(1)} h ago`;
}

function seriesKey(series) {
  return `${series.business_line}|${series.router}`;
}

// ---------------------------------------------------------------- metrics
function metricInfo(metric) {
  const found = METRICS.find(([key]) => key === metric) || METRICS[0];
  return { key: found[0], label: found[1], decimals: found[2], unit: found[3] };
}

function isMetric(metric) {
  return METRICS.some(([key]) => key === metric);
}

function formatMetric(value, metric) {
  if (value === null || value === undefined || !Number.isFinite(Number(value))) return "–";
  return Number(value).toFixed(metricInfo(metric).decimals);
}

// A record's value of a metric (null where it has none: js_divergence without a baseline, an expert's locality).
function metricValue(record, metric) {
  if (!record) return null;
  const value = record[metric];
  return value === null || value === undefined || !Number.isFinite(Number(value)) ? null : Number(value);
}

// "healthy X": the baseline's value of the metric, when the record carries a baseline that has it.
function healthyText(record, metric) {
  const baseline = record && record.baseline;
  if (!baseline || typeof baseline !== "object") return null;
  const value = metricValue(baseline, metric);
  return value === null ? null : `healthy ${formatMetric(value, metric)}`;
}

function percent(share) {
  return `${Math.round(100 * Number(share))}%`;
}

// Whose traffic a baseline was: "4 clients, largest app-1 31%"; null where not recorded (before clients were, or a
// worker's routing, whose clients this sidecar does not see).
function baselineClients(baseline) {
  const mix = baseline && baseline.clients;
  if (!mix || !Array.isArray(mix.clients)) return null;
  if (!mix.count || !mix.clients.length) return "no client";
  const [largest] = mix.clients;
  return `${mix.count} client${mix.count === 1 ? "" : "s"}, largest ${largest.client} ${percent(largest.share)}`;
}

// What the page says of one line's baselines (v1/status `baselines`): why nothing is learned, what of the line is
// not learned and why, and the baselines found not to be its traffic (grouped by line and reason). Every line's
// for "all".
function baselineNotes(summary, line) {
  if (!summary) return [];
  if (!summary.learning) return summary.not_learning ? [`No healthy baselines are learned: ${summary.not_learning}`] : [];
  const ours = (entry) => line === "all" || entry.business_line === line;
  const notes = (summary.waiting || []).filter(ours).map((entry) => `No healthy baseline for ${entry.business_line} ` +
    `(${entry.routers.length} router${entry.routers.length === 1 ? "" : "s"}): ${entry.reason}.`);
  const found = new Map();
  for (const entry of (summary.unrepresentative || []).filter(ours)) {
    const key = `${entry.business_line}|${entry.reason}`;
    const group = found.get(key) || { line: entry.business_line, routers: new Set(), why: entry.why, at: 0 };
    group.routers.add(entry.router);
    group.at = Math.max(group.at, entry.found_at || 0);
    found.set(key, group);
  }
  for (const group of found.values()) {
    notes.push(`${group.routers.size} healthy baseline${group.routers.size === 1 ? "" : "s"} of ${group.line} ` +
      `found not to be the line's traffic at ${clock(group.at)}, and learned again: ${group.why}.`);
  }
  return notes;
}

// Whose traffic a line is (v1/status `clients`: token shares of its window): "clients: app-1 62% · app-2 30% · 3
// more"; what the page says where no client's tokens are counted here (routing that workers report, or an
// engine's recorder: their clients are not seen). At most `top` named.
function clientsText(shares, top = 4) {
  const clients = (shares && Array.isArray(shares.clients)) ? shares.clients : [];
  if (!clients.length) return "clients: none counted here for this line";
  const named = clients.slice(0, top).map((c) => `${c.client} ${percent(c.share)}`);
  const more = clients.length - named.length;
  return `clients: ${named.join(" · ")}${more > 0 ? ` · ${more} more` : ""}`;
}

function renderClients() {
  const shares = (view.status.clients || {})[view.line || "all"]; // no line yet: every line's
  const clients = (shares && Array.isArray(shares.clients)) ? shares.clients : [];
  $("clients-note").textContent = clientsText(shares);
  $("clients-note").title = clients.map((c) => `${c.client}: ${percent(c.share)} of the window, ` +
    `${percent(c.long_run_share)} over the long run`).join("\n");
}

function renderBaselines() {
  const notes = baselineNotes(view.status.baselines, view.line);
  $("baselines-note").hidden = !notes.length;
  $("baselines-note").replaceChildren(...notes.map((text) => el("p", {}, text)));
}

// The metric an alert judges: its own field (v1/alerts, v1/status), else a `metric` label, else unknown.
function alertMetric(alert) {
  const metric = alert.metric ?? (alert.labels || {}).metric ?? null;
  return isMetric(metric) || metric === "bits_below_ceiling" ? metric : null;
}

// The alerts of one router and line that are firing or pending, and the worst of their states
// (fire for firing, warn for pending, null for none).
function alertsOn(alerts, router, line) {
  const on = (alerts || []).filter((a) => (a.state === "firing" || a.state === "pending") && a.labels
    && a.labels.router === router && (a.labels.business_line || "all") === line);
  const state = on.some((a) => a.state === "firing") ? "fire" : on.length ? "warn" : null;
  return { alerts: on, state };
}

// The entropy band (bits) in normalized entropy: (bits - floor) / (ceiling - floor).
function normalizedBand(band, floor, ceiling) {
  const none = { fire_below: null, resolve_above: null, fire_above: null, resolve_below: null };
  if (!band || floor === null || floor === undefined || ceiling === null || ceiling === undefined
      || !(ceiling > floor)) return none;
  const to = (bits) => (bits === null || bits === undefined ? null : +((bits - floor) / (ceiling - floor)).toFixed(4));
  return { fire_below: to(band.fire_below), resolve_above: to(band.resolve_above), fire_above: to(band.fire_above),
           resolve_below: to(band.resolve_below) };
}

// A row's state: an alert on it first (fire / warn), then no signal, then where the value lies:
// against the entropy band for entropy and normalized entropy, "ok" for a metric the page has no
// thresholds of (its rules judge it, and their alerts colour the row), "none" without a value.
function rowState({ metric, value, band, floor, ceiling, record, alertState }) {
  if (alertState) return alertState;
  if (record && record.no_signal) return "nosignal";
  if (value === null || value === undefined) return "none";
  if (metric === ENTROPY && band) return stateOf(value, band);
  if (metric === "normalized_entropy" && band) return stateOf(value, normalizedBand(band, floor, ceiling));
  return "ok";
}

// Where a value of a metric without thresholds lies on the page's ramp: 0 (low) to 1 (high).
function rampPosition(value, metric, numSlots) {
  const v = Math.max(0, Number(value));
  if (metric === "max_violation") return v / (v + 1); // 1 (twice the mean load) at the middle
  if (metric === "dead_slots") return Math.min(1, (4 * v) / Math.max(1, numSlots || 64)); // a quarter dead: the top
  if (metric === "js_divergence") return v / (v + 0.05);
  return Math.min(1, v); // locality, normalized entropy: 0..1 already
}

// The colour of a heat-map cell of any metric: the band's for entropy (and normalized entropy,
// its band converted), else the ramp.
function metricColour(value, metric, series) {
  if (metric === ENTROPY) return colourOf(value, series);
  if (metric === "normalized_entropy" && series.band && series.band.rules && series.band.rules.length) {
    const state = stateOf(value, normalizedBand(series.band, series.floor_bits, series.ceiling_bits));
    if (state !== "ok") return COLOURS[state];
    return mix("#1f5c38", COLOURS.ok, Math.max(0, Math.min(1, value)));
  }
  return mix(RAMP[0], RAMP[1], rampPosition(value, metric, series.num_slots));
}

// What the page reads from the anchor: the router to highlight, the line, the metric, the alert.
function parseAnchor(hash) {
  const params = new URLSearchParams(String(hash || "").replace(/^#/, ""));
  const router = params.get("router");
  const metric = params.get("metric");
  // bits_below_ceiling is entropy counted down from the ceiling: its alerts open the entropy view.
  return { focus: router ? { router, layer: params.get("layer"), alertname: params.get("alertname") || null } : null,
           line: params.get("business_line") || null, metric: isMetric(metric) ? metric : ENTROPY };
}

// The anchor of an alert's link, as the alert engine writes it (mla_watch/alerting/engine.py, _router_url).
function anchorOf(alert) {
  const labels = alert.labels || {};
  return "#" + new URLSearchParams({ router: labels.router || "", layer: labels.layer || "",
                                     business_line: labels.business_line || "", metric: alertMetric(alert) || "",
                                     alertname: labels.alertname || "" }).toString();
}

function routingUrl(line) {
  return line && line !== "all" ? `v1/routing?business_line=${encodeURIComponent(line)}` : "v1/routing";
}

// Where a value lies against its band: fire (past a firing threshold), warn (fired side of the
// resolve threshold), high (above an upper threshold), ok, or none (no value).
function stateOf(value, band) {
  if (value === null || value === undefined) return "none";
  if (band.fire_below !== null && value < band.fire_below) return "fire";
  if (band.fire_above !== null && value > band.fire_above) return "high";
  if (band.resolve_above !== null && value < band.resolve_above) return "warn";
  if (band.resolve_below !== null && value > band.resolve_below) return "warn";
  return "ok";
}

// The cell colour: the state's hue, darker the closer the value is to the edge of the band.
function colourOf(value, series) {
  const state = stateOf(value, series.band);
  if (state !== "ok" && state !== "fire") return COLOURS[state];
  const floor = series.floor_bits ?? 0;
  const ceiling = series.ceiling_bits ?? floor + 1;
  if (state === "fire") {
    const depth = Math.min(1, (series.band.fire_below - value) / Math.max(1e-6, series.band.fire_below - floor));
    return mix("#7a2420", COLOURS.fire, 1 - depth);
  }
  const low = series.band.resolve_above ?? floor;
  const position = Math.max(0, Math.min(1, (value - low) / Math.max(1e-6, ceiling - low)));
  return mix("#1f5c38", COLOURS.ok, position);
}

function mix(from, to, t) {
  const parse = (hex) => [1, 3, 5].map((i) => parseInt(hex.slice(i, i + 2), 16));
  const [a, b] = [parse(from), parse(to)];
  return `rgb(${a.map((v, i) => Math.round(v + (b[i] - v) * t)).join(",")})`;
}

// ---------------------------------------------------------------- routing by position
// v1/routing's `positions` (PositionCounts.as_dict in mla_watch/routing/positions.py): per expert router its
// position buckets, each with its JS divergence from the line's in-range routing. The threshold is the
// document's own `drift_bits`: the one its edges are found with, and the one the shipped LongContextDrift rule
// fires past, so the page never carries a copy that could disagree with the sidecar.

// A bucket's JS divergence in bits, or null where it has none (the first bucket, nothing in range to compare).
function driftOf(bucket) {
  const value = bucket ? bucket.js_divergence : null;
  return value === null || value === undefined || !Number.isFinite(Number(value)) ? null : Number(value);
}

// The index of the first bucket that leaves in-range routing (-1: none): judged (enough tokens, not the
// prompts' openings) and past driftBits. A bucket below its minimum reads sampling noise, so it is no edge.
function firstDeparture(buckets, driftBits) {
  return (buckets || []).findIndex((b) => b.judged === true && driftOf(b) !== null && driftOf(b) > driftBits);
}

// A cell's state and colour: "none" without tokens or a divergence (neutral), "ok" within driftBits (brighter:
// nearer in-range routing), "fire" past it (darker: deeper), as the heat map's cells.
function driftColour(js, tokens, driftBits) {
  if (js === null || !(tokens > 0)) return { state: "none", colour: COLOURS.none };
  if (js <= driftBits) return { state: "ok", colour: mix("#1f5c38", COLOURS.ok, 1 - js / Math.max(1e-9, driftBits)) };
  const depth = Math.min(1, (js - driftBits) / Math.max(1e-9, 3 * driftBits));
  return { state: "fire", colour: mix("#7a2420", COLOURS.fire, 1 - depth) };
}

// One strip cell: its numbers, state, colour and title (bucket, tokens, entropy and JS bits).
function positionCell(bucket, index, driftBits, minTokens, isEdge) {
  const js = driftOf(bucket);
  const tokens = Number(bucket.tokens) || 0;
  // A bucket under its minimum tokens is not judged: its divergence is noise, greyed rather than red or green.
  const thin = !bucket.judged && index > 0 && js !== null && tokens > 0;
  const { state, colour } = thin ? { state: "unjudged", colour: COLOURS.nosignal } : driftColour(js, tokens, driftBits);
  const why = index === 0 ? "the prompts' openings: shown, not judged"
    : !bucket.judged && tokens > 0 ? `not judged: fewer than ${minTokens} tokens` : null;
  const title = `${bucket.bucket}: ${tokens} tokens · entropy ${bits(bucket.entropy_bits)} bits · ` +
    `JS ${js === null ? "–" : js.toFixed(4)} bits from in-range routing` + (why ? `\n${why}` : "") +
    (isEdge ? `\npast ${driftBits} bits: leaves in-range routing here` : "");
  return { bucket: bucket.bucket, tokens, entropy_bits: bucket.entropy_bits, js, judged: Boolean(bucket.judged),
           state, colour, edge: isEdge, title };
}

// The strips of a positions document, by layer: each expert router's cells in bucket order, the first bucket
// that leaves in-range routing (or null) and the line said beside the strip.
function positionStrips(positions) {
  const driftBits = Number(positions.drift_bits);
  const minTokens = positions.min_tokens;
  return [...(positions.routers || [])].sort((a, b) => a.layer - b.layer || a.name.localeCompare(b.name))
    .map((router) => {
      const buckets = router.buckets || [];
      const edge = firstDeparture(buckets, driftBits);
      const cells = buckets.map((bucket, index) => positionCell(bucket, index, driftBits, minTokens, index === edge));
      const judged = buckets.some((b) => b.judged);
      const text = edge >= 0 ? `leaves in-range routing at ${buckets[edge].bucket}`
        : judged ? `in range where judged (within ${driftBits} bits)`
          : `too few tokens to judge (a bucket needs ${minTokens})`;
      return { router: router.name, layer: router.layer, edge: edge >= 0 ? buckets[edge].bucket : null, cells, text };
    });
}

// What the section says instead of strips (null: draw the strips): the routing not loaded, the line unknown,
// or an answer without `positions`.
function positionsNote(routing) {
  if (!routing) return "Loading the routing by position…";
  if (routing.missing) return "No routing counts for this business line yet.";
  if (!routing.positions) {
    return "No routing by position here: counting by position is off (serve --no-routing-by-position), or the " +
      "routing source cannot tell positions apart (SGLang's expert-distribution recorder).";
  }
  if (!(routing.positions.routers || []).length) return "No expert router is counted by position.";
  return null;
}

// ---------------------------------------------------------------- data
// Appends the points of an incremental reply (v1/status?since=...) to what is shown, and drops
// the points older than the span.
function mergeHistory(old, fresh) {
  if (!old) return fresh;
  const times = old.times.concat(fresh.times);
  const series = new Map(old.series.map((s) => [seriesKey(s), s]));
  for (const s of fresh.series) {
    const previous = series.get(seriesKey(s));
    if (previous) {
      previous.values = previous.values.concat(s.values);
      previous.too_small = previous.too_small.concat(s.too_small);
      previous.band = s.band;
      previous.no_signal = s.no_signal;
      previous.floor_bits = s.floor_bits;
      previous.ceiling_bits = s.ceiling_bits;
    } else {
      const pad = old.times.length;
      series.set(seriesKey(s), { ...s, values: Array(pad).fill(null).concat(s.values),
                                 too_small: Array(pad).fill(false).concat(s.too_small) });
    }
  }
  for (const s of series.values()) {
    while (s.values.length < times.length) { s.values.push(null); s.too_small.push(false); }
  }
  const cutoff = times.length ? times[times.length - 1] - fresh.span_seconds : 0;
  let drop = 0;
  while (drop < times.length && times[drop] < cutoff) drop += 1;
  const kept = [...series.values()].map((s) => ({ ...s, values: s.values.slice(drop), too_small: s.too_small.slice(drop) }))
    .filter((s) => s.values.some((v) => v !== null));
  return { ...fresh, times: times.slice(drop), series: kept };
}

// The v1/history request for the last `seconds`: a step giving at most COLUMNS columns, never
// finer than the sampling interval.
// One business line, the one shown: every line of a wide fleet at COLUMNS columns is past the
// answer's bound.
// A metric other than entropy is asked for by name (entropy is the default, left out).
function historyUrl(seconds, now, interval, line, metric) {
  const step = Math.max(interval, Math.ceil(seconds / COLUMNS));
  const until = Math.floor(now);
  const only = line ? `&business_line=${encodeURIComponent(line)}` : "";
  const which = metric && metric !== ENTROPY ? `&metric=${encodeURIComponent(metric)}` : "";
  return `v1/history?since=${until - seconds}&until=${until}&step=${step}${only}${which}`;
}

function isRange(seconds) {
  return RANGES.some(([s]) => s === seconds) && seconds > (view.history ? view.history.span_seconds : 0);
}

// The durable history is drawn for a range past the live hour, and for any metric but entropy
// (the live hour holds entropy only).
function needsDurable(seconds) {
  return isRange(seconds) || view.metric !== ENTROPY;
}

async function fetchRange(seconds) {
  const now = Date.now() / 1000;
  const { line, metric } = view;
  const held = view.range && view.range.seconds === seconds && view.range.line === line
    && view.range.metric === metric ? view.range : null;
  // A range past the live hour: again once a column's worth of time has passed; a live window: every poll.
  const fresh = isRange(seconds) ? Math.max(60, held ? held.data.step_seconds : 0) : REFRESH_MS / 1000 - 0.5;
  if (held && now - held.fetched < fresh) return;
  if (!held) view.rangeError = null; // a new choice: an older failure is not its own
  const url = historyUrl(seconds, now, view.history.interval_seconds, line, metric);
  const response = await fetch(url, { cache: "no-store" });
  if (!response.ok) throw new Error(`${url}: HTTP ${response.status}`);
  const data = await response.json();
  if (view.window === seconds && view.line === line && view.metric === metric) {
    view.range = { seconds, line, metric, data, fetched: now };
    view.rangeError = null;
  }
}

// The routing records of the shown line, now (a line nobody reported yet: none).
async function fetchRouting() {
  const line = view.line;
  const url = routingUrl(line);
  const response = await fetch(url, { cache: "no-store" });
  if (response.status === 404) {
    view.routing = { line, records: new Map(), positions: null, missing: true };
    return;
  }
  if (!response.ok) throw new Error(`${url}: HTTP ${response.status}`);
  const data = await response.json();
  if (view.line === line) {
    view.routing = { line, records: new Map(data.routers.map((r) => [r.name, r])), positions: data.positions || null,
                     missing: false };
  }
}

// What the shown line and metric need beside v1/status: its routing records and, where drawn from it,
// the durable history. A failure of either is said on the page; the rest is still drawn.
async function fetchShown() {
  try {
    await fetchRouting();
  } catch (error) {
    view.routing = null;
    $("updated").dataset.state = "error";
    $("updated").textContent = `the routing records did not load: ${error.message}`;
  }
  if (!view.status.history_store || !needsDurable(view.window)) return;
  try {
    await fetchRange(view.window);
  } catch (error) {
    view.rangeError = error.message;
  }
}

function readAnchor() {
  const anchor = parseAnchor(location.hash);
  view.focus = anchor.focus;
  if (anchor.line) view.line = anchor.line;
  view.metric = anchor.metric;
  view.scrolled = false;
}

// The chosen metric goes into the anchor (without a hashchange), so that a reload or a copied link keeps it.
function chooseMetric(metric) {
  view.metric = metric;
  const params = new URLSearchParams(location.hash.slice(1));
  if (metric === ENTROPY) params.delete("metric");
  else params.set("metric", metric);
  window.history.replaceState(null, "", `${location.pathname}${location.search}${params.toString() ? `#${params}` : ""}`);
  reshow();
}

// Drawn at once with what is held, then again once what the new choice needs has loaded.
async function reshow() {
  render();
  await fetchShown();
  render();
}

async function refresh() {
  const since = view.history && view.history.times.length ? view.history.times[view.history.times.length - 1] : null;
  const url = since === null ? "v1/status" : `v1/status?since=${since}`;
  try {
    const response = await fetch(url, { cache: "no-store" });
    if (!response.ok) throw new Error(`${url}: HTTP ${response.status}`);
    const status = await response.json();
    view.history = mergeHistory(view.history, status.history);
    view.status = status;
    if (view.line === null) pickLine(); // the anchor's line stands until the lines drawn are known
    pickWindow(); // what fetchShown asks the durable history for
    $("updated").dataset.state = "live";
    $("updated").textContent = `live · updated ${clock(status.generated_at)}`;
    await fetchShown();
    render();
    view.updates += 1;
    document.body.dataset.updates = String(view.updates);
  } catch (error) {
    $("updated").dataset.state = "error";
    $("updated").textContent = `not updating: ${error.message} (showing the last data)`;
  } finally {
    setTimeout(refresh, REFRESH_MS);
  }
}

// ---------------------------------------------------------------- rendering
function render() {
  const status = view.status;
  const firing = status.alerts.filter((a) => a.state === "firing");
  // Beside an engine the model is the engine's, not the embedded one this sidecar would load.
  const served = status.engine ? `${status.engine.engine} engine at ${status.upstream} (${status.engine.routers})`
    : status.upstream ? `upstream ${status.upstream}` : `model ${status.model}`;
  $("model").textContent = served + (status.ready ? ""
    : ` · ${status.load_error || status.upstream_problem || "loading"}`);
  const problems = status.engine ? status.engine.problems || [] : [];
  $("problems").hidden = !problems.length;
  $("problems").replaceChildren(...problems.map((text) => el("p", { class: "fail" }, `⚠ ${text}`)));
  $("summary").textContent = `${firing.length} firing · ${status.rules} rule${status.rules === 1 ? "" : "s"} · ` +
    `${status.notifications_pending} notifications queued` +
    (status.retune ? ` · router version ${status.retune.live}` : "");
  renderLines(firing);
  renderMetrics();
  renderWindows();
  renderBaselines();
  renderClients();
  renderHeatmap();
  renderOverview();
  renderPositions();
  renderAlerts(status.alerts);
  renderPolicies(status.policies);
  renderRetune(status.retune, status.engine);
}

function businessLines() {
  // A range holds the shown line only: the lines to choose from are the live hour's, and the range's.
  const lines = [...new Set([...view.history.series, ...(shownHistory() || view.history).series].map((s) => s.business_line))];
  return lines.sort((a, b) => (a === "all" ? -1 : b === "all" ? 1 : a.localeCompare(b)));
}

function pickLine() {
  const lines = businessLines();
  if (!lines.length) return; // nothing known yet (a range not loaded, no traffic): the anchor's line stands
  if (view.line === null || !lines.includes(view.line)) view.line = lines.includes("all") ? "all" : lines[0];
}

function renderLines(firing) {
  pickLine();
  const lines = businessLines();
  const alerting = new Set(firing.map((a) => a.labels.business_line));
  $("lines").replaceChildren(...lines.map((line) => el("button", {
    type: "button", "aria-pressed": String(line === view.line), class: alerting.has(line) ? "alerting" : null,
    dataset: { line }, onclick: () => { view.line = line; reshow(); },
  }, line)));
}

// The metric selector; a metric an alert fires on (on the shown line) is marked.
function renderMetrics() {
  const alerting = new Set(view.status.alerts.filter((a) => a.state === "firing"
    && (a.labels.business_line || "all") === view.line).map(alertMetric));
  $("metrics").replaceChildren(...METRICS.map(([metric, label]) => el("button", {
    type: "button", "aria-pressed": String(metric === view.metric), class: alerting.has(metric) ? "alerting" : null,
    dataset: { metric }, onclick: () => chooseMetric(metric),
  }, label)));
}

// The window shown: the one chosen, else the shortest that holds all the live history there is.
function pickWindow() {
  const span = view.history.span_seconds;
  const times = view.history.times;
  const ranges = view.status.history_store ? RANGES.filter(([seconds]) => seconds > span) : [];
  if (!view.windowChosen) {
    const held = times.length ? times[times.length - 1] - times[0] : 0;
    view.window = (WINDOWS.find(([seconds]) => seconds >= held && seconds < span) || [span])[0];
  }
  const isShownRange = ranges.some(([seconds]) => seconds === view.window);
  if (!view.window || (view.window > span && !isShownRange)) view.window = span;
  if (!isShownRange && view.metric === ENTROPY) view.range = null;
  return ranges;
}

function renderWindows() {
  const span = view.history.span_seconds;
  const ranges = pickWindow();
  const named = WINDOWS.find(([seconds]) => seconds === span);
  const choices = WINDOWS.filter(([seconds]) => seconds < span).concat([[span, named ? named[1] : "all kept"]], ranges);
  $("windows").replaceChildren(...choices.map(([seconds, label]) => el("button", {
    type: "button", "aria-pressed": String(seconds === view.window), dataset: { seconds: String(seconds) },
    class: seconds > span ? "range" : null, onclick: () => choose(seconds),
  }, label)));
}

// A live window is drawn at once; a range once v1/history has answered (the live view until then).
async function choose(seconds) {
  view.window = seconds;
  view.windowChosen = true;
  render();
  if (!needsDurable(seconds) || !view.status.history_store) return;
  try {
    await fetchRange(seconds);
  } catch (error) {
    view.rangeError = error.message;
  }
  render();
}

function heldRange() {
  return view.range && view.range.seconds === view.window && view.range.line === view.line
    && view.range.metric === view.metric ? view.range.data : null;
}

// What the heat map draws: the durable history's range or metric when chosen and loaded, else the
// live hour for entropy; null for another metric until (or unless) the durable history has it.
function shownHistory() {
  const held = heldRange();
  if (held) return held;
  return view.metric === ENTROPY ? view.history : null;
}

// The rows of the shown line: every router of its routing records and of the drawn history, each with
// its drawn series (or null), its record now (or null), its entropy band (from the live hour) and its alerts.
function shownRows(history) {
  const line = view.line;
  const live = new Map(view.history.series.filter((s) => s.business_line === line).map((s) => [s.router, s]));
  const records = view.routing && view.routing.line === line ? view.routing.records : new Map();
  const rows = new Map();
  const add = (router, layer, kind) => {
    if (!rows.has(router)) rows.set(router, { router, layer, kind, series: null, record: records.get(router) || null });
    return rows.get(router);
  };
  for (const s of history ? history.series.filter((x) => x.business_line === line) : []) {
    add(s.router, s.layer, s.kind).series = s;
  }
  for (const s of live.values()) add(s.router, s.layer, s.kind);
  for (const r of records.values()) add(r.name, r.layer, r.kind);
  return [...rows.values()].map((row) => {
    const band = (live.get(row.router) || row.series || {}).band || null;
    const info = row.record || live.get(row.router) || row.series || {};
    const latest = row.series && row.series.values.length ? row.series.values[row.series.values.length - 1] : null;
    const value = row.record ? metricValue(row.record, view.metric) : latest;
    const { alerts, state } = alertsOn(view.status.alerts, row.router, line);
    return { ...row, band, value, alerts, floor: info.floor_bits ?? null, ceiling: info.ceiling_bits ?? null,
             num_slots: info.num_slots ?? null,
             state: rowState({ metric: view.metric, value, band, floor: info.floor_bits, ceiling: info.ceiling_bits,
                               record: row.record, alertState: state }) };
  }).sort((a, b) => a.layer - b.layer || a.router.localeCompare(b.router));
}

function isFocused(row) {
  return view.focus !== null && row.router === view.focus.router;
}

// What the heat map draws of the chosen metric, and why it draws no history where it has none:
// `durable` (the choice is drawn from v1/history), `held` (its answer is here), `store` (the sidecar
// keeps one), `error` (why it did not load), `rows` (each with its drawn `series` or null).
function historyNote({ metric, durable, held, store, error, rows }) {
  const label = metricInfo(metric).label;
  if (durable && !held) {
    const now = metric === ENTROPY ? "the live hour is drawn instead" : "the rows show its value now";
    if (!store) {
      return `No history of ${label} here: the live hour holds entropy only and the durable history is off ` +
        `(serve --history-retention); ${now}.`;
    }
    return error ? `The history of ${label} did not load (${error}); ${now}.` : `Loading the history of ${label}…`;
  }
  const without = rows.filter((row) => !row.series || row.series.values.every((v) => v === null));
  const source = durable ? "durable history" : "live";
  if (!without.length) return metric === ENTROPY ? "" : `${label}: value now, and its history (${source}).`;
  return `${label} (${source}): no history for ${without.length} of ${rows.length} routers ` +
    `(${without.map((row) => `layer ${row.layer} ${row.kind}`).join(", ")}): no value in this span.`;
}

function renderRow(row) {
  const metric = view.metric;
  const healthy = healthyText(row.record, metric);
  const who = healthy ? baselineClients(row.record.baseline) : null;
  const noSignal = row.record && row.record.no_signal;
  const alertNames = row.alerts.map((a) => a.labels.alertname);
  const marked = view.focus && view.focus.alertname && isFocused(row) && alertNames.includes(view.focus.alertname);
  const title = [row.router, noSignal ? `no signal: ${noSignal}` : null,
    who ? `healthy baseline (${row.record.baseline.source}): ${who}` : null,
    ...row.alerts.map((a) => `${a.state}: ${a.labels.alertname} (${alertMetric(a) || "?"} ${formatMetric(a.value,
      alertMetric(a) || metric)})`)].filter(Boolean).join("\n");
  return el("div", {
    class: `row${isFocused(row) ? " focus" : ""}${marked ? " alerted" : ""}`, title,
    dataset: { router: row.router, layer: String(row.layer), line: view.line, kind: row.kind, metric,
               value: row.value === null ? "" : String(row.value), state: row.state,
               alerts: alertNames.join(","), noSignal: noSignal || null, baselineClients: who },
  }, el("span", { class: "name" }, `layer ${row.layer} · ${row.router}`),
  row.alerts.length ? el("span", { class: `alert ${row.state}`, title: alertNames.join(", ") },
    `⚠ ${row.alerts.length === 1 ? alertNames[0] : `${row.alerts.length} alerts`}`) : null,
  noSignal ? el("span", { class: "value nosignal" }, `no signal: ${noSignal}`)
    : el("span", { class: "value" }, formatMetric(row.value, metric)),
  healthy && !noSignal ? el("span", { class: "healthy" }, who ? `${healthy} · ${who}` : healthy) : null);
}

function renderHeatmap() {
  const history = shownHistory();
  const rows = shownRows(history);
  const metric = view.metric;
  const span = history === view.history ? Math.min(view.window, history.span_seconds) : view.window;
  const end = history && history.times.length ? history.times[history.times.length - 1] : Date.now() / 1000;
  const start = end - span;

  $("heatmap-rows").replaceChildren(...rows.map(renderRow));
  const note = historyNote({ metric, durable: needsDurable(view.window), held: Boolean(heldRange()),
                              store: Boolean(view.status.history_store), error: view.rangeError, rows });
  $("metric-note").textContent = note;
  $("metric-note").hidden = !note;
  $("metric-note").dataset.metric = metric;
  $("metric-note").dataset.history = history ? "yes" : "no";

  const canvas = $("heatmap-canvas");
  const width = Math.max(200, canvas.parentElement.clientWidth);
  const height = Math.max(ROW_HEIGHT, rows.length * ROW_HEIGHT);
  const ratio = window.devicePixelRatio || 1;
  canvas.width = Math.round(width * ratio);
  canvas.height = Math.round(height * ratio);
  canvas.style.height = `${height}px`;
  const context = canvas.getContext("2d");
  context.setTransform(ratio, 0, 0, ratio, 0, 0);
  context.fillStyle = COLOURS.none;
  context.fillRect(0, 0, width, height);
  const interval = history ? history.interval_seconds : view.history.interval_seconds;
  const cell = Math.max(1, (interval / span) * width);
  rows.forEach((row, index) => {
    const s = row.series;
    const noSignal = row.record && row.record.no_signal;
    if (s) {
      const drawn = { ...s, band: row.band || s.band, floor_bits: s.floor_bits ?? row.floor,
                      ceiling_bits: s.ceiling_bits ?? row.ceiling, num_slots: s.num_slots ?? row.num_slots };
      s.values.forEach((value, i) => {
        if (value === null) return;
        const x = ((history.times[i] - start) / span) * width;
        context.globalAlpha = s.too_small[i] ? 0.45 : 1; // a window below its trusted minimum reads low
        // A router whose window says nothing now is greyed: its figures are no reading of its health.
        context.fillStyle = noSignal ? COLOURS.nosignal : metricColour(value, metric, drawn);
        context.fillRect(x - cell, index * ROW_HEIGHT + 1, cell + 0.5, ROW_HEIGHT - 2);
      });
    }
    context.globalAlpha = 1;
    if (noSignal) {
      context.fillStyle = "#c3c8d2";
      context.font = "11px system-ui, sans-serif";
      context.textBaseline = "middle";
      context.fillText(`no signal: ${noSignal}`, 6, index * ROW_HEIGHT + ROW_HEIGHT / 2, width - 12);
    }
    if (row.alerts.length) { // a firing (pending) alert on the row: a red (amber) mark at its right end
      context.fillStyle = COLOURS[row.state] || COLOURS.fire;
      context.fillRect(width - 4, index * ROW_HEIGHT + 1, 4, ROW_HEIGHT - 2);
    }
    if (isFocused(row)) {
      context.strokeStyle = "#f5d142";
      context.strokeRect(0.5, index * ROW_HEIGHT + 0.5, width - 1, ROW_HEIGHT - 1);
    }
  });
  context.globalAlpha = 1;
  canvas.dataset.rows = String(rows.length);
  canvas.dataset.source = !history ? "none" : history === view.history ? "live" : "history";
  canvas.dataset.metric = metric;
  canvas.dataset.span = String(span);
  canvas.dataset.columns = String(history ? history.times.filter((t) => t >= start).length : 0);
  const box = canvas.getBoundingClientRect(); // where the cells are, for tests reading a screenshot
  canvas.dataset.box = [box.left, box.top, box.width, box.height].map(Math.round).join(",");
  canvas.onmousemove = (event) => showTooltip(event, history, rows, start, span, width);
  canvas.onmouseleave = () => { $("tooltip").hidden = true; };

  const before = (seconds) => (seconds >= 172800 ? `−${+(seconds / 86400).toFixed(1)} d`
    : seconds >= 3600 ? `−${+(seconds / 3600).toFixed(1)} h` : `−${+(seconds / 60).toFixed(1)} min`);
  $("heatmap-axis").replaceChildren(...[0, 0.25, 0.5, 0.75, 1].map((f) => el("span", { style: `left:${f * 100}%` },
    f === 1 ? "now" : before(span * (1 - f)))));
  const banded = metric === ENTROPY || metric === "normalized_entropy";
  const legend = banded ? [["fire", "past a firing threshold"], ["warn", "not yet back past the resolve threshold"],
    ["ok", "in band (brighter: nearer the ceiling)"], ["high", "above an upper threshold"]]
    : [[RAMP[0], `low ${metricInfo(metric).label}`], [RAMP[1], `high ${metricInfo(metric).label} (no thresholds ` +
      "drawn: its rules judge it)"], ["fire", "an alert fires on the row"]];
  $("legend").replaceChildren(...legend.concat([["nosignal", "no signal (the reason is shown)"], ["none", "no value"]])
    .map(([state, text]) => el("span", {}, el("i", { style: `background:${COLOURS[state] || state}` }), text)));

  const focused = document.querySelector(".row.focus");
  if (focused && !view.scrolled) {
    focused.scrollIntoView({ block: "center" });
    view.scrolled = true;
  }
}

function showTooltip(event, history, rows, start, span, width) {
  const box = event.target.getBoundingClientRect();
  const row = rows[Math.floor((event.clientY - box.top) / ROW_HEIGHT)];
  if (!row) return;
  const series = row.series;
  const metric = metricInfo(view.metric);
  const t = start + ((event.clientX - box.left) / width) * span;
  let index = -1;
  if (history && series) history.times.forEach((time, i) => { if (time <= t + history.interval_seconds) index = i; });
  const value = index >= 0 ? series.values[index] : null;
  const band = row.band || {};
  const limits = metric.key !== ENTROPY ? "" : [band.fire_below !== null && band.fire_below !== undefined
    ? `fires below ${band.fire_below}` : null,
  band.resolve_above !== null && band.resolve_above !== undefined ? `resolves at ${band.resolve_above}` : null,
  band.fire_above !== null && band.fire_above !== undefined ? `fires above ${band.fire_above}` : null]
    .filter(Boolean).join(", ");
  const tooltip = $("tooltip");
  tooltip.textContent = `${row.router} (layer ${row.layer}, ${view.line})\n` +
    `${index >= 0 ? clock(history.times[index]) : "–"}: ${formatMetric(value, metric.key)}` +
    `${metric.unit ? ` ${metric.unit}` : ` ${metric.label}`}\n` +
    `floor ${bits(row.floor)} · ceiling ${bits(row.ceiling)} bits${limits ? ` · ${limits}` : ""}` +
    (row.record && row.record.no_signal ? `\nno signal now: ${row.record.no_signal}` : "");
  tooltip.style.left = `${event.clientX + 14}px`;
  tooltip.style.top = `${event.clientY + 10}px`;
  tooltip.hidden = false;
}

function renderOverview() {
  const lines = businessLines();
  const routers = new Map();
  for (const s of view.history.series) {
    if (!routers.has(s.router)) routers.set(s.router, { layer: s.layer, byLine: {} });
    routers.get(s.router).byLine[s.business_line] = s;
  }
  const ordered = [...routers.entries()].sort((a, b) => a[1].layer - b[1].layer || a[0].localeCompare(b[0]));
  $("overview").replaceChildren(
    el("thead", {}, el("tr", {}, el("th", {}, "router"), lines.map((line) => el("th", {}, line)))),
    el("tbody", {}, ordered.map(([router, info]) => el("tr", { class: view.focus?.router === router ? "focus" : null },
      el("td", {}, `layer ${info.layer} · ${router}`),
      lines.map((line) => {
        const s = info.byLine[line];
        const latest = s ? s.values[s.values.length - 1] : null;
        const alerted = alertsOn(view.status.alerts, router, line);
        // As the rows above: an alert first, then a window that says nothing now (greyed, the reason in its title).
        const noSignal = s ? s.no_signal : null;
        const state = alerted.state || (noSignal ? "nosignal" : s ? stateOf(latest, s.band) : "none");
        const names = alerted.alerts.map((a) => a.labels.alertname).join(", ");
        return el("td", { class: "cell", dataset: { router, line, state, noSignal: noSignal || null },
                          title: `${router}, ${line}${names ? `: ${names}` : ""}${noSignal ? `\nno signal: ${noSignal}` : ""}`,
                          onclick: () => { view.line = line; reshow(); } }, bits(latest));
      })))));
}

// Routing by position of the shown line: one strip per expert router, its first departing bucket outlined.
function renderPositions() {
  const routing = view.routing && view.routing.line === view.line ? view.routing : null;
  const note = positionsNote(routing);
  const body = $("positions-body");
  body.dataset.line = view.line || "";
  if (note) {
    body.replaceChildren(el("p", { class: "empty" }, note));
    return;
  }
  const positions = routing.positions;
  const strips = positionStrips(positions);
  body.replaceChildren(
    el("p", { class: "muted" }, `JS divergence of each position bucket from the line's in-range routing; outlined: ` +
      `the first bucket past ${positions.drift_bits} bits (the edge LongContextDrift judges), context length ` +
      `${positions.context_length}.`),
    ...strips.map((strip) => el("div", { class: "strip", dataset: { router: strip.router, layer: String(strip.layer),
                                                                     edge: strip.edge } },
      el("span", { class: "name" }, `layer ${strip.layer} · ${strip.router}`),
      el("span", { class: "cells" }, strip.cells.map((cell) => el("span", {
        class: `cell${cell.edge ? " edge" : ""}${cell.judged ? "" : " unjudged"}`, title: cell.title,
        style: `background:${cell.colour}`,
        dataset: { bucket: cell.bucket, tokens: String(cell.tokens), js: cell.js === null ? "" : String(cell.js),
                   state: cell.state, judged: String(cell.judged) } }, cell.bucket))),
      el("span", { class: `edge-text${strip.edge ? " fail" : " muted"}` }, strip.text))),
    el("div", { class: "legend" }, [["ok", `within ${positions.drift_bits} bits (brighter: nearer in-range routing)`],
      ["fire", `past ${positions.drift_bits} bits (darker: further)`], ["none", "no tokens, or nothing to compare"]]
      .map(([state, text]) => el("span", {}, el("i", { style: `background:${COLOURS[state]}` }), text)),
    el("span", {}, el("i", { style: `background:${COLOURS.nosignal}` }),
       `grey, faded: fewer than ${positions.min_tokens} tokens, not judged`)));
}

// Links come from rule annotations: only http(s) ones become links (never javascript: or data:).
function safeHref(url) {
  return typeof url === "string" && /^https?:\/\//i.test(url.trim()) ? url.trim() : null;
}

// The alert the link named: its name, router and line.
function isFocusedAlert(alert) {
  const focus = view.focus;
  return Boolean(focus && focus.alertname && alert.labels.alertname === focus.alertname
    && alert.labels.router === focus.router && (alert.labels.business_line || "all") === view.line);
}

// What an alert's cause says: the model changed, the traffic did, or neither can be told (yet: while pending).
function causeText(alert) {
  const cause = (alert.labels || {}).cause;
  if (!cause && alert.state === "pending") {
    // cause_due_at: by when the reading decides the cause (or the alert fires "undetermined" without one)
    return alert.cause_due_at ? `reading… due by ${clock(alert.cause_due_at)}` : "reading…";
  }
  if (!cause) return "–";
  return { model: "model", traffic: "traffic", undetermined: "undetermined" }[cause] || cause;
}

// ---------------------------------------------------------------- incidents
// The alerts as their notifications group them: v1/status gives each alert its `incident` (the receiver and the
// groupKey of its notification group), and the page shows each incident as one row that opens into its alerts,
// the way the receiver heard of it. An alert no receiver takes is an incident of its own.
const STATE_ORDER = { firing: 0, pending: 1, resolved: 2 };
const SEVERITY_ORDER = { critical: 0, warning: 1, info: 2 };

function alertSince(alert) {
  return alert.state === "resolved" ? alert.resolved_at || 0 : alert.firing_since || alert.active_since || 0;
}

// The incidents of `alerts`, worst state first, then the newest: each {key, receiver, labels, notified_at,
// alerts (worst state first, then the newest), state (its worst alert's), cause (the one its alerts share,
// "mixed", or "" before any is known), severity (the worst), since (its oldest alert's)}.
function incidentsOf(alerts) {
  const groups = new Map();
  for (const alert of alerts || []) {
    const incident = alert.incident || null;
    const key = incident ? `${incident.receiver}|${incident.key}` : `alert|${alert.fingerprint}`;
    if (!groups.has(key)) {
      groups.set(key, { key, receiver: incident ? incident.receiver : null, labels: incident ? incident.labels : {},
                        notified_at: null, alerts: [] });
    }
    const group = groups.get(key);
    group.alerts.push(alert);
    if (incident && incident.notified_at) group.notified_at = Math.max(group.notified_at || 0, incident.notified_at);
  }
  const byState = (a, b) => (STATE_ORDER[a.state] ?? 3) - (STATE_ORDER[b.state] ?? 3);
  const incidents = [...groups.values()].map((group) => {
    group.alerts.sort((a, b) => byState(a, b) || alertSince(b) - alertSince(a));
    const causes = [...new Set(group.alerts.map((a) => (a.labels || {}).cause).filter(Boolean))];
    const severities = group.alerts.map((a) => (a.labels || {}).severity || "")
      .sort((a, b) => (SEVERITY_ORDER[a] ?? 3) - (SEVERITY_ORDER[b] ?? 3));
    const times = group.alerts.map(alertSince).filter(Boolean);
    return { ...group, state: group.alerts[0].state, cause: causes.length > 1 ? "mixed" : causes[0] || "",
             severity: severities[0] || "", since: times.length ? Math.min(...times) : null,
             latest: times.length ? Math.max(...times) : 0 };
  });
  return incidents.sort((a, b) => byState(a, b) || b.latest - a.latest);
}

// "ExpertHotspot ×3, LongContextDrift ×3": what an incident holds, by alert name.
function incidentNames(incident) {
  const counts = new Map();
  for (const alert of incident.alerts) counts.set(alert.labels.alertname, (counts.get(alert.labels.alertname) || 0) + 1);
  return [...counts].map(([name, n]) => (n > 1 ? `${name} ×${n}` : name)).join(", ");
}

// What the incident's alerts have: one value, or "N <what>" when they differ.
function shared(incident, valueOf, what) {
  const values = [...new Set(incident.alerts.map(valueOf).filter((v) => v !== "" && v !== null && v !== undefined))];
  return values.length === 1 ? String(values[0]) : values.length ? `${values.length} ${what}` : "–";
}

function renderAlerts(alerts) {
  const incidents = incidentsOf(alerts);
  if (!incidents.length) {
    $("alerts-body").replaceChildren(el("p", { class: "empty" }, "No alerts: every watched router is in band."));
    return;
  }
  const rows = [];
  for (const incident of incidents) {
    if (incident.alerts.length === 1) {
      rows.push(alertRow(incident.alerts[0], null, false));
      continue;
    }
    // Closed unless on-call opened it, or the alert the link names is in it.
    const open = view.openIncidents.has(incident.key) || incident.alerts.some(isFocusedAlert);
    rows.push(incidentRow(incident, open), ...incident.alerts.map((a) => alertRow(a, incident.key, !open)));
  }
  $("alerts-body").replaceChildren(table(
    ["state", "cause", "alert", "severity", "router", "layer", "business line", "metric", "value", "since", "summary",
     "links"], rows));
}

function incidentRow(incident, open) {
  const toggle = () => {
    if (view.openIncidents.has(incident.key)) view.openIncidents.delete(incident.key);
    else view.openIncidents.add(incident.key);
    renderAlerts(view.status.alerts);
  };
  const grouped = Object.entries(incident.labels || {}).map(([key, value]) => `${key}=${value}`).join(" ");
  const told = incident.receiver ? `one notification to ${incident.receiver}` +
    (incident.notified_at ? `, sent ${ago(incident.notified_at)}` : "") : "";
  return el("tr", { class: "incident", dataset: { incident: incident.key, state: incident.state, cause: incident.cause,
                                                  count: String(incident.alerts.length), open: String(open) } },
    el("td", {}, el("span", { class: `state ${incident.state}` }, incident.state)),
    el("td", {}, el("span", { class: `cause ${incident.cause || "pending"}` }, incident.cause || "–")),
    el("td", {}, el("button", { type: "button", class: "toggle", "aria-expanded": String(open), onclick: toggle },
                    `${open ? "▾" : "▸"} ${incident.alerts.length} alerts`), " ", incidentNames(incident),
       el("div", { class: "muted" }, grouped)),
    el("td", {}, incident.severity),
    el("td", {}, shared(incident, (a) => a.labels.router, "routers")),
    el("td", { class: "num" }, shared(incident, (a) => a.labels.layer, "layers")),
    el("td", {}, shared(incident, (a) => a.labels.business_line, "lines")),
    el("td", {}, shared(incident, (a) => (alertMetric(a) ? metricInfo(alertMetric(a)).label : ""), "metrics")),
    el("td", { class: "num" }, "–"),
    el("td", {}, ago(incident.since)),
    el("td", {}, told),
    el("td", {}));
}

// One alert's row; `incident`: the key of the incident it belongs to when shown under that incident's row.
function alertRow(a, incident, hidden) {
  const extra = (labels) => Object.entries(labels)
    .filter(([key]) => !["alertname", "severity", "router", "layer", "business_line", "kind", "cause"].includes(key))
    .map(([key, value]) => `${key}=${value}`).join(" ");
  const classes = [incident ? "member" : null, isFocusedAlert(a) ? "focus" : null].filter(Boolean).join(" ");
  return el("tr", { class: classes || null, hidden: hidden ? "" : null,
                    dataset: { alertname: a.labels.alertname, state: a.state, router: a.labels.router || "",
                               line: a.labels.business_line || "", metric: alertMetric(a) || "",
                               cause: a.labels.cause || "", incident } },
    el("td", {}, el("span", { class: `state ${a.state}` }, a.state)),
    el("td", { title: a.annotations.cause || "" },
       el("span", { class: `cause ${a.labels.cause || "pending"}` }, causeText(a))),
    el("td", {}, a.labels.alertname, el("div", { class: "muted" }, extra(a.labels))),
    el("td", {}, a.labels.severity),
    el("td", {}, a.labels.router),
    el("td", { class: "num" }, a.labels.layer),
    el("td", {}, a.labels.business_line),
    el("td", {}, alertMetric(a) ? metricInfo(alertMetric(a)).label : "–"),
    el("td", { class: "num" }, a.value === null ? "–" : Number(a.value).toFixed(3)),
    el("td", {}, ago(alertSince(a))),
    el("td", {}, a.annotations.summary || ""),
    el("td", {}, safeHref(a.annotations.runbook_url)
      ? el("a", { href: safeHref(a.annotations.runbook_url), class: "runbook" }, "runbook") : null,
       " ", el("a", { href: anchorOf(a), class: "show" }, "show")));
}

function renderPolicies(policies) {
  const body = [];
  if (policies.last_reload_error) {
    body.push(el("p", { class: "fail" }, `The last reload was refused; the policies below stay in force: ` +
                                         policies.last_reload_error.join("; ")));
  }
  const range = (rule) => [rule.min !== null ? `≥ ${rule.min}` : null, rule.max !== null ? `≤ ${rule.max}` : null,
    rule.default !== null && rule.default !== undefined ? `default ${rule.default}` : null].filter(Boolean).join(", ");
  const counts = (map) => Object.entries(map).map(([param, n]) => `${param} ${n}`).join(", ") || "0";
  for (const line of policies.lines) {
    body.push(el("div", { class: "policy", dataset: { line: line.business_line } },
      el("h3", {}, line.business_line, " ", el("span", { class: "muted" }, line.description || "")),
      table(["task", "on violation", "parameters", "clamped", "refused", "defaults filled in"],
            line.tasks.map((task) => el("tr", {
        dataset: { line: line.business_line, task: task.task,
                   adjustments: String(Object.values(task.adjustments).reduce((a, b) => a + b, 0)),
                   defaults: String(Object.values(task.defaults).reduce((a, b) => a + b, 0)),
                   rejections: String(Object.values(task.rejections).reduce((a, b) => a + b, 0)) } },
        el("td", {}, task.task + (task.task === line.default_task ? " (default)" : "")),
        el("td", {}, task.on_violation),
        el("td", {}, Object.entries(task.params).map(([name, rule]) => el("div", {}, `${name}: ${range(rule)}`)),
           task.max_prompt_tokens ? el("div", { class: "prompt-limit" },
             `max_prompt_tokens: ≤ ${task.max_prompt_tokens} (longer prompts refused)`) : null),
        el("td", { class: "adjusted" }, counts(task.adjustments)),
        el("td", { class: "refused" }, counts(task.rejections)),
        el("td", { class: "muted" }, counts(task.defaults)),
      )))));
  }
  body.push(el("p", { class: "muted" }, `policy version ${policies.version}`));
  $("policies-body").replaceChildren(...body);
}

// Each gate check with the live model's figure before the job -> the candidate's, and the limit.
function renderGates(result) {
  const attempts = (result && result.attempts) || [];
  return attempts.map((attempt) => {
    const gates = attempt.gates || {};
    const before = gates.before || {};
    const was = (check) => (check.gate === "perplexity" ? before.perplexity
      : ((gates.band && before[gates.band.metric]) || {})[check.router]);
    return el("div", { class: "attempt" },
      el("b", {}, attempt.strategy), `: ${attempt.outcome || "–"}`,
      (gates.checks || []).map((check) => el("div", { class: check.passed ? "pass" : "fail" },
        `${check.passed ? "✓" : "✗"} ${check.gate}${check.router ? ` ${check.router}` : ""}: ` +
        `${was(check) !== undefined && was(check) !== null ? `${was(check)} → ` : ""}${check.value} (limit ${check.limit})` +
        (check.binding === false ? " (not binding)" : ""))),
      attempt.swap ? el("div", {}, `swapped into the engine: paused ${attempt.swap.paused_seconds} s, live ` +
        `${attempt.live_seconds ?? "–"} s before the gate decided${attempt.rolled_back ? ", rolled back" : ""}`) : null,
      attempt.command ? el("div", {}, el("code", {}, attempt.command)) : null,
      attempt.reason && !gates.checks ? el("div", { class: "fail" }, attempt.reason) : null);
  });
}

function renderRetune(retune, engine) {
  if (!retune) {
    $("retune-body").replaceChildren(el("p", { class: "empty" }, engine ? `The routers of the ${engine.engine} engine: ` +
      engine.retune : "Re-tuning needs a local model (this sidecar forwards to an upstream server, or the model is loading)."));
    return;
  }
  const jobs = retune.jobs.length ? table(["job", "status", "strategies", "trigger", "created", "gates", "version"],
    retune.jobs.map((job) => el("tr", { dataset: { job: job.id, status: job.status } },
      el("td", {}, job.id),
      el("td", {}, el("span", { class: `state ${job.status}` }, job.status)),
      el("td", {}, job.spec.strategies.join(" → ")),
      el("td", {}, [job.spec.trigger.alertname || job.spec.trigger.source, job.spec.routers.join(", ")].filter(Boolean).join(": ")),
      el("td", {}, ago(job.created_at)),
      el("td", {}, renderGates(job.result)),
      el("td", { class: "num" }, job.result && job.result.version !== null && job.result.version !== undefined
        ? String(job.result.version) : "–"),
    ))) : el("p", { class: "empty" }, "No re-tuning job yet.");
  const history = [...retune.promotions].reverse();
  $("retune-body").replaceChildren(
    el("p", {}, `live router version ${retune.live} · last known-good version ${retune.last_good ?? "none (restore needs --reference-model or mark-good)"}`),
    jobs,
    el("h3", {}, "Promote / rollback history"),
    history.length ? table(["at", "change", "version", "previous"], history.map((entry) => el("tr", {
      dataset: { kind: entry.kind, version: String(entry.version) } },
      el("td", {}, entry.at || "–"), el("td", {}, entry.kind), el("td", { class: "num" }, String(entry.version)),
      el("td", { class: "num" }, entry.previous === null || entry.previous === undefined ? "–" : String(entry.previous)))))
      : el("p", { class: "empty" }, "Nothing promoted yet."));
}

if (typeof window !== "undefined") {
  window.addEventListener("hashchange", () => { readAnchor(); if (view.status) reshow(); });
  window.addEventListener("resize", () => { if (view.status) renderHeatmap(); });
  readAnchor();
  refresh();
} else if (typeof module !== "undefined") {
  module.exports = { mergeHistory, stateOf, colourOf, safeHref, historyUrl, // the pure parts, for tests under Node.js
                     parseAnchor, anchorOf, alertMetric, alertsOn, rowState, metricValue, formatMetric, healthyText,
                     baselineClients, baselineNotes, clientsText,
                     normalizedBand, metricColour, rampPosition, routingUrl, historyNote, causeText, METRICS,
                     firstDeparture, positionCell, positionStrips, positionsNote, incidentsOf, incidentNames };
}
