// mla_watch status page: polls v1/status and draws routing entropy, alerts, policies and re-tuning.
// No framework and no build step: this file is served as written.
//
// The URL anchor (#router=...&layer=...&business_line=..., the link in every alert) selects the
// business line and highlights the router's row. ?refresh=SECONDS sets the polling period and
// ?window=SECONDS the time the heat map spans (default: the shortest of 5 min, 15 min, 1 h, ...
// that holds all the history the sidecar has, so a young sidecar's history is not a sliver).
// Past the live span, 24 h / 7 d / 30 d read the durable history (v1/history) at about COLUMNS
// columns: fetched when chosen, and again once a column's worth of time has passed.
"use strict";

const QUERY = new URLSearchParams(typeof location === "undefined" ? "" : location.search);
const REFRESH_MS = 1000 * (Number(QUERY.get("refresh")) || 5);
const WINDOWS = [[300, "5 min"], [900, "15 min"], [3600, "1 h"], [21600, "6 h"], [86400, "24 h"]];
const RANGES = [[86400, "24 h"], [604800, "7 d"], [2592000, "30 d"]];
const COLUMNS = 720;
const ROW_HEIGHT = 18;
const COLOURS = { fire: "#e0463e", warn: "#e8a33d", ok: "#3fae6a", high: "#9b6ad6", none: "#2b303b" };

const view = { history: null, status: null, line: null, focus: null, scrolled: false, updates: 0,
               window: Number(QUERY.get("window")) || null, windowChosen: Boolean(Number(QUERY.get("window"))),
               range: null }; // range: {seconds, data, fetched} while a durable-history range is shown

// ---------------------------------------------------------------- small helpers
const $ = (id) => document.getElementById(id);

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs)) {
    if (value === null || value === undefined) continue;
    if (key === "class") node.className = value;
    else if (key === "dataset") Object.assign(node.dataset, value);
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
function historyUrl(seconds, now, interval, line) {
  const step = Math.max(interval, Math.ceil(seconds / COLUMNS));
  const until = Math.floor(now);
  const only = line ? `&business_line=${encodeURIComponent(line)}` : "";
  return `v1/history?since=${until - seconds}&until=${until}&step=${step}${only}`;
}

function isRange(seconds) {
  return RANGES.some(([s]) => s === seconds) && seconds > (view.history ? view.history.span_seconds : 0);
}

async function fetchRange(seconds) {
  const now = Date.now() / 1000;
  const line = view.line;
  const held = view.range && view.range.seconds === seconds && view.range.line === line ? view.range : null;
  if (held && now - held.fetched < Math.max(60, held.data.step_seconds)) return;
  const url = historyUrl(seconds, now, view.history.interval_seconds, line);
  const response = await fetch(url, { cache: "no-store" });
  if (!response.ok) throw new Error(`${url}: HTTP ${response.status}`);
  const data = await response.json();
  if (view.window === seconds && view.line === line) view.range = { seconds, line, data, fetched: now };
}

function readAnchor() {
  const params = new URLSearchParams(location.hash.slice(1));
  view.focus = params.get("router") ? { router: params.get("router"), layer: params.get("layer") } : null;
  if (params.get("business_line")) view.line = params.get("business_line");
  view.scrolled = false;
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
    if (status.history_store && isRange(view.window)) await fetchRange(view.window);
    render();
    view.updates += 1;
    document.body.dataset.updates = String(view.updates);
    $("updated").dataset.state = "live";
    $("updated").textContent = `live · updated ${clock(status.generated_at)}`;
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
  $("model").textContent = served + (status.ready ? "" : ` · ${status.load_error || "loading"}`);
  const problems = status.engine ? status.engine.problems || [] : [];
  $("problems").hidden = !problems.length;
  $("problems").replaceChildren(...problems.map((text) => el("p", { class: "fail" }, `⚠ ${text}`)));
  $("summary").textContent = `${firing.length} firing · ${status.rules} rule${status.rules === 1 ? "" : "s"} · ` +
    `${status.notifications_pending} notifications queued` +
    (status.retune ? ` · router version ${status.retune.live}` : "");
  renderLines(firing);
  renderWindows();
  renderHeatmap();
  renderOverview();
  renderAlerts(status.alerts);
  renderPolicies(status.policies);
  renderRetune(status.retune, status.engine);
}

function businessLines() {
  // A range holds the shown line only: the lines to choose from are the live hour's, and the range's.
  const lines = [...new Set([...view.history.series, ...shownHistory().series].map((s) => s.business_line))];
  return lines.sort((a, b) => (a === "all" ? -1 : b === "all" ? 1 : a.localeCompare(b)));
}

function renderLines(firing) {
  const lines = businessLines();
  if (view.line === null || !lines.includes(view.line)) view.line = lines.includes("all") ? "all" : lines[0] ?? null;
  const alerting = new Set(firing.map((a) => a.labels.business_line));
  $("lines").replaceChildren(...lines.map((line) => el("button", {
    type: "button", "aria-pressed": String(line === view.line), class: alerting.has(line) ? "alerting" : null,
    dataset: { line }, onclick: () => { view.line = line; if (isRange(view.window)) choose(view.window); else render(); },
  }, line)));
}

function renderWindows() {
  const span = view.history.span_seconds;
  const times = view.history.times;
  const ranges = view.status.history_store ? RANGES.filter(([seconds]) => seconds > span) : [];
  if (!view.windowChosen) {
    const held = times.length ? times[times.length - 1] - times[0] : 0;
    view.window = (WINDOWS.find(([seconds]) => seconds >= held && seconds < span) || [span])[0];
  }
  const isShownRange = ranges.some(([seconds]) => seconds === view.window);
  if (!view.window || (view.window > span && !isShownRange)) view.window = span;
  if (!isShownRange) view.range = null;
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
  if (!isRange(seconds)) return;
  try {
    await fetchRange(seconds);
    render();
  } catch (error) {
    $("updated").dataset.state = "error";
    $("updated").textContent = `the history range did not load: ${error.message}`;
  }
}

// What the heat map draws: the durable history's range when one is chosen and loaded, else the live hour.
function shownHistory() {
  return view.range && view.range.seconds === view.window && view.range.line === view.line ? view.range.data
    : view.history;
}

function shownSeries(history) {
  return history.series.filter((s) => s.business_line === view.line)
    .sort((a, b) => a.layer - b.layer || a.router.localeCompare(b.router));
}

function isFocused(series) {
  return view.focus !== null && series.router === view.focus.router;
}

function renderHeatmap() {
  const history = shownHistory();
  const rows = shownSeries(history);
  const span = history === view.history ? Math.min(view.window, history.span_seconds) : view.window;
  const end = history.times.length ? history.times[history.times.length - 1] : Date.now() / 1000;
  const start = end - span;

  $("heatmap-rows").replaceChildren(...rows.map((s) => {
    const latest = s.values[s.values.length - 1];
    return el("div", {
      class: `row${isFocused(s) ? " focus" : ""}`, title: s.router,
      dataset: { router: s.router, layer: String(s.layer), line: s.business_line, kind: s.kind,
                 value: latest === null ? "" : String(latest), state: stateOf(latest, s.band) },
    }, el("span", { class: "name" }, `layer ${s.layer} · ${s.router}`), el("span", { class: "value" }, bits(latest)));
  }));

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
  const cell = Math.max(1, (history.interval_seconds / span) * width);
  rows.forEach((s, row) => {
    s.values.forEach((value, i) => {
      if (value === null) return;
      const x = ((history.times[i] - start) / span) * width;
      context.globalAlpha = s.too_small[i] ? 0.45 : 1; // a window below its trusted minimum reads low
      context.fillStyle = colourOf(value, s);
      context.fillRect(x - cell, row * ROW_HEIGHT + 1, cell + 0.5, ROW_HEIGHT - 2);
    });
    if (isFocused(s)) {
      context.globalAlpha = 1;
      context.strokeStyle = "#f5d142";
      context.strokeRect(0.5, row * ROW_HEIGHT + 0.5, width - 1, ROW_HEIGHT - 1);
    }
  });
  context.globalAlpha = 1;
  canvas.dataset.rows = String(rows.length);
  canvas.dataset.source = history === view.history ? "live" : "history";
  canvas.dataset.span = String(span);
  canvas.dataset.columns = String(history.times.filter((t) => t >= start).length);
  const box = canvas.getBoundingClientRect(); // where the cells are, for tests reading a screenshot
  canvas.dataset.box = [box.left, box.top, box.width, box.height].map(Math.round).join(",");
  canvas.onmousemove = (event) => showTooltip(event, history, rows, start, span, width);
  canvas.onmouseleave = () => { $("tooltip").hidden = true; };

  const before = (seconds) => (seconds >= 172800 ? `−${+(seconds / 86400).toFixed(1)} d`
    : seconds >= 3600 ? `−${+(seconds / 3600).toFixed(1)} h` : `−${+(seconds / 60).toFixed(1)} min`);
  $("heatmap-axis").replaceChildren(...[0, 0.25, 0.5, 0.75, 1].map((f) => el("span", { style: `left:${f * 100}%` },
    f === 1 ? "now" : before(span * (1 - f)))));
  $("legend").replaceChildren(...[["fire", "past a firing threshold"], ["warn", "not yet back past the resolve threshold"],
    ["ok", "in band (brighter: nearer the ceiling)"], ["high", "above an upper threshold"], ["none", "no traffic"]]
    .map(([state, text]) => el("span", {}, el("i", { style: `background:${COLOURS[state]}` }), text)));

  const focused = document.querySelector(".row.focus");
  if (focused && !view.scrolled) {
    focused.scrollIntoView({ block: "center" });
    view.scrolled = true;
  }
}

function showTooltip(event, history, rows, start, span, width) {
  const box = event.target.getBoundingClientRect();
  const series = rows[Math.floor((event.clientY - box.top) / ROW_HEIGHT)];
  if (!series) return;
  const t = start + ((event.clientX - box.left) / width) * span;
  let index = -1;
  history.times.forEach((time, i) => { if (time <= t + history.interval_seconds) index = i; });
  const value = index >= 0 ? series.values[index] : null;
  const band = series.band;
  const limits = [band.fire_below !== null ? `fires below ${band.fire_below}` : null,
    band.resolve_above !== null ? `resolves at ${band.resolve_above}` : null,
    band.fire_above !== null ? `fires above ${band.fire_above}` : null].filter(Boolean).join(", ");
  const tooltip = $("tooltip");
  tooltip.textContent = `${series.router} (layer ${series.layer}, ${series.business_line})\n` +
    `${index >= 0 ? clock(history.times[index]) : "–"}: ${bits(value)} bits\n` +
    `floor ${bits(series.floor_bits)} · ceiling ${bits(series.ceiling_bits)}${limits ? ` · ${limits}` : ""}`;
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
        return el("td", { class: "cell", dataset: { router, line, state: s ? stateOf(latest, s.band) : "none" },
                          title: `${router}, ${line}`, onclick: () => { view.line = line; render(); } }, bits(latest));
      })))));
}

// Links come from rule annotations: only http(s) ones become links (never javascript: or data:).
function safeHref(url) {
  return typeof url === "string" && /^https?:\/\//i.test(url.trim()) ? url.trim() : null;
}

function anchorOf(labels) {
  return "#" + new URLSearchParams({ router: labels.router || "", layer: labels.layer || "",
                                     business_line: labels.business_line || "" }).toString();
}

function renderAlerts(alerts) {
  const order = { firing: 0, pending: 1, resolved: 2 };
  const shown = [...alerts].sort((a, b) => (order[a.state] ?? 3) - (order[b.state] ?? 3) ||
                                          (b.firing_since || b.active_since || 0) - (a.firing_since || a.active_since || 0));
  if (!shown.length) {
    $("alerts-body").replaceChildren(el("p", { class: "empty" }, "No alerts: every watched router is in band."));
    return;
  }
  const extra = (labels) => Object.entries(labels)
    .filter(([key]) => !["alertname", "severity", "router", "layer", "business_line", "kind"].includes(key))
    .map(([key, value]) => `${key}=${value}`).join(" ");
  $("alerts-body").replaceChildren(table(
    ["state", "alert", "severity", "router", "layer", "business line", "value", "since", "summary", "links"],
    shown.map((a) => el("tr", { dataset: { alertname: a.labels.alertname, state: a.state, router: a.labels.router || "",
                                           line: a.labels.business_line || "" } },
      el("td", {}, el("span", { class: `state ${a.state}` }, a.state)),
      el("td", {}, a.labels.alertname, el("div", { class: "muted" }, extra(a.labels))),
      el("td", {}, a.labels.severity),
      el("td", {}, a.labels.router),
      el("td", { class: "num" }, a.labels.layer),
      el("td", {}, a.labels.business_line),
      el("td", { class: "num" }, a.value === null ? "–" : Number(a.value).toFixed(3)),
      el("td", {}, ago(a.state === "resolved" ? a.resolved_at : a.firing_since || a.active_since)),
      el("td", {}, a.annotations.summary || ""),
      el("td", {}, safeHref(a.annotations.runbook_url)
        ? el("a", { href: safeHref(a.annotations.runbook_url), class: "runbook" }, "runbook") : null,
         " ", el("a", { href: anchorOf(a.labels), class: "show" }, "show")),
    ))));
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
        el("td", {}, Object.entries(task.params).map(([name, rule]) => el("div", {}, `${name}: ${range(rule)}`))),
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
  window.addEventListener("hashchange", () => { readAnchor(); if (view.status) render(); });
  window.addEventListener("resize", () => { if (view.status) renderHeatmap(); });
  readAnchor();
  refresh();
} else if (typeof module !== "undefined") {
  module.exports = { mergeHistory, stateOf, colourOf, safeHref, historyUrl }; // the pure parts, for tests under Node.js
}
