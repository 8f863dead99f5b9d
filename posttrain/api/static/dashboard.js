// posttrain dashboard: polls the read-only /v1/dashboard/ JSON and draws tables and SVG charts.
// No framework and no CDN: the page must work offline, served by `posttrain serve` itself.
"use strict";

const REFRESH_MS = 2000;
const KEY_STORAGE = "posttrain.apiKey";
const MAX_CHARTS = 9;
const SVG_NS = "http://www.w3.org/2000/svg";
const LOSS_MODE_STORAGE = "posttrain.lossMode";
const MIN_TICK_GAP = 24;
// Readable titles for the metrics the built-in losses report; the key stays on the y axis.
const METRIC_TITLES = {
  "valid_tokens:sum": "tokens the loss counted",
  "loss/ratio/mean": "policy / sampler probability ratio (mean)",
  "loss/kl_policy/mean": "KL from the sampler policy (mean per token)",
  "loss/sampler_mismatch/mean": "|trainer - sampler| logprob (mean per token)",
  "loss/kl_ref/mean": "KL from the reference policy (mean per token)",
  "loss/clip/high_fraction": "share of tokens clipped high",
  "loss/clip/low_fraction": "share of tokens clipped low",
  "loss/clip/clipped_ratio/mean": "clipped probability ratio (mean)",
};

// A server without --api-key/--keys-file accepts any non-empty bearer key, so start with a
// placeholder and ask for a real key only when the server answers 401.
let apiKey = localStorage.getItem(KEY_STORAGE) || "local";
let selected = new URLSearchParams(location.search).get("session");
// The loss chart shows the loss per token (what an SDK loop prints) or the summed loss.
// `?loss=sum` in the address picks it too (a link to the summed view).
const askedLossMode = new URLSearchParams(location.search).get("loss") || localStorage.getItem(LOSS_MODE_STORAGE);
let lossMode = askedLossMode === "sum" ? "sum" : "per-token";
let lastSeries = null;

class AuthError extends Error {}

async function getJson(path) {
  const response = await fetch(path, { headers: { Authorization: `Bearer ${apiKey}` } });
  if (response.status === 401) {
    document.getElementById("key-form").hidden = false;
    throw new AuthError("the server wants an API key");
  }
  if (!response.ok) {
    throw new Error(`${path}: HTTP ${response.status}`);
  }
  return response.json();
}

function shortStatus(status) {
  const parts = (status || "").split("_STATUS_");
  return parts[parts.length - 1];
}

function statusClass(status) {
  const s = shortStatus(status);
  if (["READY", "RUNNING", "COMPLETED"].includes(s)) return "status status-ok";
  if (["PENDING", "CREATING", "STOPPING"].includes(s)) return "status status-busy";
  if (["FAILED", "ERROR"].includes(s)) return "status status-bad";
  return "status status-idle";
}

function time(seconds) {
  return seconds ? new Date(seconds * 1000).toLocaleTimeString() : "";
}

function cell(text, className) {
  const td = document.createElement("td");
  td.textContent = text === null || text === undefined ? "" : String(text);
  if (className) td.className = className;
  return td;
}

function codeCell(text) {
  const td = document.createElement("td");
  const code = document.createElement("code");
  code.textContent = text;
  td.appendChild(code);
  return td;
}

function plural(count, noun) {
  return `${count} ${noun}${count === 1 ? "" : "s"}`;
}

// Rows, then every column whose cells are all empty is hidden (a name nobody set, a resource
// that never expires): an empty column only pushes the others apart.
function fillTable(id, rows) {
  const table = document.getElementById(id);
  table.tBodies[0].replaceChildren(...rows);
  const headers = [...table.tHead.rows[0].cells];
  headers.forEach((th, index) => {
    const cells = rows.map((tr) => tr.cells[index]);
    const isEmpty = cells.length > 0 && cells.every((td) => td.textContent === "");
    th.hidden = isEmpty;
    for (const td of cells) td.hidden = isEmpty;
  });
}

function formatLoss(value) {
  return value === null || value === undefined ? "" : value.toFixed(4);
}

function renderResources(resources) {
  fillTable("resources", resources.map((r) => {
    const tr = document.createElement("tr");
    tr.append(codeCell(r.id), cell(r.base_model), cell(shortStatus(r.status), statusClass(r.status)),
      cell(time(r.created_at)), cell(time(r.expires_at)));
    return tr;
  }));
}

function renderSessions(sessions) {
  fillTable("sessions", sessions.map((s) => {
    const tr = document.createElement("tr");
    tr.className = "selectable" + (s.id === selected ? " selected" : "");
    tr.dataset.session = s.id;
    tr.append(codeCell(s.id), cell(s.display_name), codeCell(s.model_resources_id),
      cell(shortStatus(s.status), statusClass(s.status)), cell(s.step), cell(s.weights_version),
      cell(s.lora_rank), cell(time(s.updated_at)));
    tr.addEventListener("click", () => {
      selected = s.id;
      history.replaceState(null, "", `?session=${encodeURIComponent(s.id)}`);
      refresh();
    });
    return tr;
  }));
}

function renderOperations(operations) {
  fillTable("operations", operations.map((op) => {
    const tr = document.createElement("tr");
    const finished = ["COMPLETED", "FAILED"].includes(shortStatus(op.status));
    const took = finished ? `${(op.updated_at - op.created_at).toFixed(2)}s` : "";
    // Per token, as an SDK loop prints it; the summed loss the operation returned on hover.
    const hasPerToken = op.loss_per_token !== null && op.loss_per_token !== undefined;
    const loss = cell(hasPerToken ? formatLoss(op.loss_per_token) : formatLoss(op.loss));
    if (op.loss !== null && op.loss !== undefined) loss.title = `summed: ${op.loss.toPrecision(6)}`;
    const code = (op.error_code || "").split("_ERROR_CODE_").pop();
    const error = op.error_code ? `${code}: ${op.error_message || ""}` : "";
    tr.append(cell(time(op.created_at)), codeCell(op.session_id), cell(op.kind),
      cell(shortStatus(op.status), statusClass(op.status)), cell(took), loss,
      cell(error, "error"));
    return tr;
  }));
}

// ---------------------------------------------------------------- charts

function niceStep(span) {
  const raw = span / 5;
  const power = Math.pow(10, Math.floor(Math.log10(raw)));
  for (const m of [1, 2, 5, 10]) {
    if (m * power >= raw * 0.999) return m * power;
  }
  return 10 * power;
}

function ticks(low, high) {
  const step = niceStep(high - low);
  const values = [];
  for (let k = Math.ceil(low / step - 1e-9); k <= Math.floor(high / step + 1e-9); k++) {
    values.push(k * step);
  }
  const decimals = Math.max(0, -Math.floor(Math.log10(step) + 1e-9));
  // Tiny steps (a metric that is 0 up to float noise) in exponent form: "4e-8", not 10 digits.
  const label = (v) => (decimals > 4 ? v.toExponential(1) : v.toFixed(decimals));
  return values.map((v) => [v, Math.abs(v) < Math.pow(10, -(decimals + 1)) ? "0" : label(v)]);
}

function svg(tag, attrs, text) {
  const el = document.createElementNS(SVG_NS, tag);
  for (const [k, v] of Object.entries(attrs)) el.setAttribute(k, v);
  if (text !== undefined) el.textContent = text;
  return el;
}

// Whole-step ticks that always include the first step, none closer than MIN_TICK_GAP units.
function stepTicks(low, high, px) {
  const values = ticks(low, high).map(([v]) => v).filter(Number.isInteger);
  if (Number.isInteger(low)) values.unshift(low);
  const kept = [];
  for (const v of values) {
    if (kept.every((k) => Math.abs(px(v) - px(k)) >= MIN_TICK_GAP)) kept.push(v);
  }
  return kept;
}

// One chart of y over optimizer step; points at one step (gradient accumulation) are averaged.
// points: [step, y, tooltip]; labels: {x, y} axis titles.
function chart(title, points, labels, metric = title) {
  const byStep = new Map();
  for (const [x, y, tip] of points) {
    if (!Number.isFinite(y)) continue;
    const entry = byStep.get(x) || [0, 0, []];
    byStep.set(x, [entry[0] + y, entry[1] + 1, [...entry[2], tip || ""]]);
  }
  const series = [...byStep.entries()].sort((a, b) => a[0] - b[0])
    .map(([x, [sum, n, tips]]) => [x, sum / n, tips.filter(Boolean).join("\n")]);
  const box = document.createElement("div");
  box.className = "chart";
  box.dataset.metric = metric;
  box.dataset.points = String(series.length);
  const heading = document.createElement("h3");
  heading.textContent = title;
  box.appendChild(heading);
  const W = 400, H = 200, left = 64, right = 12, top = 8, bottom = 38;
  const plot = svg("svg", { viewBox: `0 0 ${W} ${H}`, role: "img", "aria-label": title });
  box.appendChild(plot);
  plot.appendChild(svg("text", { class: "axis-label", x: left + (W - left - right) / 2, y: H - 4,
    "text-anchor": "middle" }, labels.x));
  const yMid = top + (H - top - bottom) / 2;
  plot.appendChild(svg("text", { class: "axis-label", x: 12, y: yMid, "text-anchor": "middle",
    transform: `rotate(-90 12 ${yMid})` }, labels.y));
  if (series.length === 0) return box;
  box.dataset.steps = `${series[0][0]}-${series[series.length - 1][0]}`;
  let xLow = series[0][0], xHigh = series[series.length - 1][0];
  if (xLow === xHigh) { xLow -= 1; xHigh += 1; }
  let yLow = Math.min(...series.map((p) => p[1])), yHigh = Math.max(...series.map((p) => p[1]));
  // A span under a thousandth of the values' size is float noise around a constant (a ratio
  // of 1 +- 4e-9): widen it so the axis shows the constant, not ten-digit tick labels.
  const minSpan = 1e-3 * Math.max(Math.abs(yLow), Math.abs(yHigh));
  if (yHigh - yLow < minSpan) {
    const middle = (yLow + yHigh) / 2;
    yLow = middle - minSpan / 2; yHigh = middle + minSpan / 2;
  }
  if (yLow === yHigh) { yLow -= 0.5; yHigh += 0.5; }
  const pad = 0.05 * (yHigh - yLow);
  yLow -= pad; yHigh += pad;
  const px = (x) => left + ((x - xLow) / (xHigh - xLow)) * (W - left - right);
  const py = (y) => H - bottom - ((y - yLow) / (yHigh - yLow)) * (H - top - bottom);
  for (const [v, label] of ticks(yLow, yHigh)) {
    plot.appendChild(svg("line", { class: "grid", x1: left, x2: W - right, y1: py(v), y2: py(v) }));
    plot.appendChild(svg("text", { class: "tick", x: left - 4, y: py(v) + 3, "text-anchor": "end" }, label));
  }
  const xFirst = series[0][0], xLast = series[series.length - 1][0];
  for (const v of stepTicks(xFirst, xLast, px)) {
    plot.appendChild(svg("text", { class: "tick", x: px(v), y: H - bottom + 13, "text-anchor": "middle" }, String(v)));
  }
  plot.appendChild(svg("line", { class: "axis", x1: left, x2: left, y1: top, y2: H - bottom }));
  plot.appendChild(svg("line", { class: "axis", x1: left, x2: W - right, y1: H - bottom, y2: H - bottom }));
  const coords = series.map(([x, y]) => `${px(x).toFixed(1)},${py(y).toFixed(1)}`).join(" ");
  plot.appendChild(svg("polyline", { class: "series", points: coords }));
  // A dot per step (drawn while few enough to see), each with its numbers as a hover tooltip.
  const className = series.length < 40 ? "dot" : "dot hit";
  for (const [x, y, tip] of series) {
    const dot = svg("circle", { class: className, cx: px(x), cy: py(y), r: 3 });
    dot.appendChild(svg("title", {}, tip || `step ${x}: ${y.toPrecision(5)}`));
    plot.appendChild(dot);
  }
  return box;
}

function lossChart(points) {
  // A loss that reports no token count (valid_tokens:sum) has only its summed loss to show.
  const hasPerToken = points.some((p) => p.loss_per_token !== null && p.loss_per_token !== undefined);
  const perToken = lossMode === "per-token" && hasPerToken;
  const tip = (p) => `step ${p.step}: loss/token ${formatLoss(p.loss_per_token)}, ` +
    `summed ${p.loss.toPrecision(6)} over ${p.metrics["valid_tokens:sum"] ?? "?"} tokens`;
  const values = points.map((p) => [p.step, perToken ? p.loss_per_token ?? NaN : p.loss, tip(p)]);
  const title = perToken ? "loss per token"
    : `loss (summed over tokens${hasPerToken ? "" : "; no token count reported"})`;
  const box = chart(title, values, {
    x: "optimizer step",
    y: perToken ? "loss per token" : "loss, summed over tokens",
  }, "loss");
  box.dataset.mode = perToken ? "per-token" : "sum";
  markLossButtons(box.dataset.mode, hasPerToken);
  return box;
}

function renderSeries(data) {
  lastSeries = data;
  const title = document.getElementById("session-title");
  title.textContent = `Session ${data.session.id}` +
    (data.session.display_name ? ` (${data.session.display_name})` : "") +
    ` - ${plural(data.session.step, "optimizer step")}, ` +
    `${plural(data.points.length, "forward-backward result")}`;
  document.getElementById("session-hint").hidden = data.points.length > 0;
  document.getElementById("loss-mode").hidden = data.points.length === 0;
  if (data.points.length === 0) {
    document.getElementById("session-hint").textContent = "No forward-backward results yet.";
  }
  const keys = new Set();
  for (const p of data.points) for (const k of Object.keys(p.metrics || {})) keys.add(k);
  keys.delete("loss:sum");  // the summed loss: the loss chart's other mode
  const charts = [lossChart(data.points)];
  for (const key of [...keys].sort().slice(0, MAX_CHARTS - 1)) {
    charts.push(chart(METRIC_TITLES[key] || key, data.points.map((p) => [p.step, p.metrics[key]]),
      { x: "optimizer step", y: key }, key));
  }
  document.getElementById("charts").replaceChildren(...charts);
}

// The pressed button is the mode the chart shows (summed when per token is not reported).
function markLossButtons(shown, hasPerToken) {
  for (const button of document.querySelectorAll("#loss-mode button")) {
    button.setAttribute("aria-pressed", String(button.dataset.mode === shown));
    if (button.dataset.mode === "per-token") button.disabled = !hasPerToken;
  }
}

function setLossMode(mode) {
  lossMode = mode;
  localStorage.setItem(LOSS_MODE_STORAGE, mode);
  markLossButtons(mode, true);
  if (lastSeries) renderSeries(lastSeries);
}

// ---------------------------------------------------------------- refresh loop

async function refresh() {
  const status = document.getElementById("status");
  try {
    const view = await getJson("/v1/dashboard/overview");
    if (!selected || !view.sessions.some((s) => s.id === selected)) {
      // Default to the running session furthest along (else any session furthest along).
      const running = view.sessions.filter((s) => shortStatus(s.status) === "RUNNING");
      const pool = running.length ? running : view.sessions;
      const best = pool.reduce((a, b) => (b.step > a.step ? b : a), pool[0] || {});
      selected = best.id || null;
    }
    renderResources(view.model_resources);
    renderSessions(view.sessions);
    renderOperations(view.operations);
    if (selected) {
      renderSeries(await getJson(`/v1/dashboard/sessions/${encodeURIComponent(selected)}/series`));
    }
    status.textContent = `${plural(view.sessions.length, "session")}, ` +
      `${plural(view.queue_depth, "operation")} queued, ` +
      `refreshed ${new Date().toLocaleTimeString()}`;
    status.className = "muted";
  } catch (error) {
    status.textContent = error.message;
    status.className = "status status-bad";
  }
}

document.getElementById("key-form").addEventListener("submit", (event) => {
  event.preventDefault();
  apiKey = document.getElementById("key-input").value.trim() || "local";
  localStorage.setItem(KEY_STORAGE, apiKey);
  document.getElementById("key-form").hidden = true;
  refresh();
});

for (const button of document.querySelectorAll("#loss-mode button")) {
  button.addEventListener("click", () => setLossMode(button.dataset.mode));
}
setLossMode(lossMode);

async function loop() {
  await refresh();
  setTimeout(loop, REFRESH_MS);
}

loop();
