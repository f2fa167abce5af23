// The Metrics page: poll /ui/metrics.json, keep the last points of each series, draw SVG
// lines by hand. Quantiles and rates come windowed (since this tab's previous poll) from the
// daemon; a window in which no request finished leaves no point. Names go in with textContent.
"use strict";
const POINTS = 90;
const SVG = "http://www.w3.org/2000/svg";
const COLORS = ["#2a5bd7", "#d7452a", "#17803d", "#a86400", "#7a3bd7", "#0f8a8a"];
const CHARTS = ["tokens", "ttft", "tpot", "queue", "kv", "dev-tokens", "dev-ttft", "dev-tpot",
                "prio-queued", "prio-wait", "prio-rate"];
const TAB = (crypto.randomUUID ? crypto.randomUUID() : String(Math.random()).slice(2)).slice(0, 64);
const history = {};  // chart -> series name -> [[t, value], ...]

const scaled = (v, k) => (v === null || v === undefined ? null : v * k);

function push(chart, name, t, value) {
  if (value === null || value === undefined || !isFinite(value)) return;
  const charts = (history[chart] = history[chart] || {});
  const points = (charts[name] = charts[name] || []);
  points.push([t, value]);
  if (points.length > POINTS) points.shift();
}

function draw(chart) {
  const svg = document.getElementById("chart-" + chart);
  while (svg.firstChild) svg.removeChild(svg.firstChild);
  const series = history[chart] || {};
  const all = Object.values(series).flat();
  if (!all.length) return;
  const t0 = Math.min(...all.map((p) => p[0])), t1 = Math.max(...all.map((p) => p[0]));
  const top = Math.max(...all.map((p) => p[1])) || 1;
  const x = (t) => 30 + (t1 > t0 ? ((t - t0) / (t1 - t0)) * 360 : 360);
  const y = (v) => 150 - (v / top) * 135;
  const label = document.createElementNS(SVG, "text");
  label.setAttribute("x", "2"); label.setAttribute("y", "12");
  label.textContent = top.toPrecision(3);
  svg.appendChild(label);
  Object.keys(series).sort().forEach((name, i) => {
    const line = document.createElementNS(SVG, "polyline");
    line.setAttribute("points", series[name].map((p) => `${x(p[0]).toFixed(1)},${y(p[1]).toFixed(1)}`).join(" "));
    line.setAttribute("fill", "none");
    line.setAttribute("stroke", COLORS[i % COLORS.length]);
    line.setAttribute("stroke-width", "2");
    line.dataset.series = name;
    line.dataset.points = String(series[name].length);
    const title = document.createElementNS(SVG, "title");
    title.textContent = name;
    line.appendChild(title);
    svg.appendChild(line);
    const key = document.createElementNS(SVG, "text");  // the series' name, in its colour
    key.setAttribute("x", "398"); key.setAttribute("y", String(12 + i * 11));
    key.setAttribute("text-anchor", "end");
    key.setAttribute("fill", COLORS[i % COLORS.length]);
    key.textContent = name;
    svg.appendChild(key);
  });
}

function quantiles(chart, name, t, row, figure) {
  for (const q of ["p50", "p99"]) push(chart, `${name} ${q}`, t, scaled(row[`${figure}_${q}_s`], 1000));
}

async function poll() {
  const resp = await fetch("/ui/metrics.json?tab=" + encodeURIComponent(TAB));
  const error = document.getElementById("metrics-error");
  if (!resp.ok) {
    const body = await resp.json().catch(() => ({}));
    error.textContent = (body.error && (body.error.message || body.error)) || `HTTP ${resp.status}`;
    error.hidden = false;
    return;
  }
  error.hidden = true;
  const now = await resp.json();
  const t = now.ts;
  const legend = document.getElementById("legend");
  while (legend.firstChild) legend.removeChild(legend.firstChild);
  for (const [id, r] of Object.entries(now.replicas)) {
    const name = `${id} (${r.model || "?"})`;
    const item = document.createElement("li");
    item.textContent = `${name} on ${r.device || "?"}`;
    legend.appendChild(item);
    push("tokens", name, t, r.tokens_per_s);
    quantiles("ttft", name, t, r, "ttft");
    quantiles("tpot", name, t, r, "tpot");
    push("queue", name, t, r.queue_depth);
    push("kv", name, t, scaled(r.kv_cache_usage, 100));
  }
  for (const [device, d] of Object.entries(now.devices)) {
    push("dev-tokens", device, t, d.tokens_per_s);
    quantiles("dev-ttft", device, t, d, "ttft");
    quantiles("dev-tpot", device, t, d, "tpot");
  }
  for (const [priority, p] of Object.entries(now.priorities)) {
    push("prio-queued", priority, t, p.queued);
    quantiles("prio-wait", priority, t, p, "wait");
    push("prio-rate", priority, t, p.requests_per_s);
  }
  const span = document.getElementById("window");
  span.textContent = now.window_s == null ? "first poll: no window yet" : `last window ${now.window_s.toFixed(1)} s`;
  for (const chart of CHARTS) draw(chart);
}

document.addEventListener("DOMContentLoaded", () => {
  poll();
  setInterval(poll, 2000);
});
