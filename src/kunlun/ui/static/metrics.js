// The Metrics page: the daemon's sampled history (/ui/metrics.json), then every new sample,
// drawn as SVG lines on a time axis by hand. Quantiles and rates come windowed (between two
// samples) from the daemon; a window in which no request finished leaves no point. Names go in
// with textContent.
"use strict";
const SVG = "http://www.w3.org/2000/svg";
const COLORS = ["#2a5bd7", "#d7452a", "#17803d", "#a86400", "#7a3bd7", "#0f8a8a"];
const LEFT = 46, RIGHT = 392, TOP = 22, BOTTOM = 136;
const MIN_SPAN_S = 60;
let points = [];
let interval = 5, keep = 900;

const scaled = (v, k) => (v === null || v === undefined ? null : v * k);

function el(name, attrs, text) {
  const node = document.createElementNS(SVG, name);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, String(v));
  if (text !== undefined) node.textContent = text;
  return node;
}

function niceTop(value) {  // 1, 2 or 5 times a power of ten, at least value
  if (!(value > 0)) return 1;
  const step = Math.pow(10, Math.floor(Math.log10(value)));
  for (const m of [1, 2, 5, 10]) if (m * step >= value) return m * step;
  return 10 * step;
}

function number(v) {
  if (v >= 1000) return (v / 1000).toPrecision(3).replace(/\.?0+$/, "") + "k";
  return Number(v.toPrecision(3)).toString();
}

const clock = (t) => new Date(t * 1000).toTimeString().slice(0, 8);

// chart -> series name -> [[t, value], ...], from every point kept
function series() {
  const out = {};
  const push = (chart, name, t, value) => {
    if (value === null || value === undefined || !isFinite(value)) return;
    ((out[chart] = out[chart] || {})[name] = out[chart][name] || []).push([t, value]);
  };
  const quantiles = (chart, name, t, row, figure) => {
    for (const q of ["p50", "p99"]) push(chart, `${name} ${q}`, t, scaled(row[`${figure}_${q}_s`], 1000));
  };
  for (const p of points) {
    const t = p.ts;
    for (const [id, r] of Object.entries(p.replicas)) {
      const name = `${id} (${r.model || "?"})`;
      push("tokens", name, t, r.tokens_per_s);
      quantiles("ttft", name, t, r, "ttft");
      quantiles("tpot", name, t, r, "tpot");
      push("queue", name, t, r.queue_depth);
      push("kv", name, t, scaled(r.kv_cache_usage, 100));
    }
    for (const [device, d] of Object.entries(p.devices)) {
      push("dev-tokens", device, t, d.tokens_per_s);
      quantiles("dev-ttft", device, t, d, "ttft");
      quantiles("dev-tpot", device, t, d, "tpot");
    }
    for (const [priority, c] of Object.entries(p.priorities)) {
      push("prio-queued", priority, t, c.queued);
      quantiles("prio-wait", priority, t, c, "wait");
      push("prio-rate", priority, t, c.requests_per_s);
    }
  }
  return out;
}

function draw(svg, lines) {
  while (svg.firstChild) svg.removeChild(svg.firstChild);
  const unit = svg.dataset.unit || "";
  if (!points.length) {
    svg.dataset.empty = "1";
    svg.appendChild(el("text", { x: 200, y: 80, "text-anchor": "middle", class: "empty" },
                       `waiting for data (a sample every ${interval} s)`));
    return;
  }
  const t1 = points[points.length - 1].ts;
  const t0 = Math.min(points[0].ts, t1 - MIN_SPAN_S);
  const values = Object.values(lines).flat();
  const top = niceTop(Math.max(0, ...values.map((p) => p[1])));
  const x = (t) => LEFT + ((t - t0) / (t1 - t0)) * (RIGHT - LEFT);
  const y = (v) => BOTTOM - (v / top) * (BOTTOM - TOP);
  for (const v of [0, top / 2, top]) {  // the value axis: grid lines and their figures
    svg.appendChild(el("line", { x1: LEFT, x2: RIGHT, y1: y(v), y2: y(v), class: "grid" }));
    svg.appendChild(el("text", { x: LEFT - 4, y: y(v) + 4, "text-anchor": "end", class: "tick" }, number(v)));
  }
  svg.appendChild(el("text", { x: 2, y: 10, class: "unit" }, unit));
  for (let i = 0; i <= 3; i++) {  // the time axis
    const t = t0 + ((t1 - t0) * i) / 3;
    svg.appendChild(el("text", { x: x(t), y: BOTTOM + 16, "text-anchor": i === 0 ? "start" : i === 3 ? "end" : "middle",
                                 class: "tick time" }, clock(t)));
  }
  svg.appendChild(el("line", { x1: LEFT, x2: RIGHT, y1: BOTTOM, y2: BOTTOM, class: "axis" }));
  svg.dataset.empty = values.length ? "0" : "1";
  if (!values.length) {
    svg.appendChild(el("text", { x: (LEFT + RIGHT) / 2, y: 75, "text-anchor": "middle", class: "empty" },
                       "no requests finished in this span"));
    return;
  }
  Object.keys(lines).sort().forEach((name, i) => {
    const color = COLORS[i % COLORS.length];
    const line = el("polyline", {
      points: lines[name].map((p) => `${x(p[0]).toFixed(1)},${y(p[1]).toFixed(1)}`).join(" "),
      fill: "none", stroke: color, "stroke-width": 2,
    });
    line.dataset.series = name;
    line.dataset.points = String(lines[name].length);
    line.appendChild(el("title", {}, name));
    svg.appendChild(line);
    svg.appendChild(el("text", { x: RIGHT, y: 10 + i * 11, "text-anchor": "end", fill: color, class: "key" }, name));
  });
}

function render() {
  const all = series();
  for (const svg of document.querySelectorAll("svg.chart")) draw(svg, all[svg.id.slice(6)] || {});
  const legend = document.getElementById("legend");
  while (legend.firstChild) legend.removeChild(legend.firstChild);
  const last = points[points.length - 1];
  for (const [id, r] of Object.entries(last ? last.replicas : {})) {
    const item = document.createElement("li");
    item.textContent = `${id} (${r.model || "?"}) ` + (r.device ? `on ${r.device}` : "not running");
    legend.appendChild(item);
  }
  const span = document.getElementById("window");
  span.textContent = !last ? "no sample yet"
    : `${points.length} samples from ${clock(points[0].ts)} to ${clock(last.ts)}` +
      (last.window_s == null ? "" : `, last window ${last.window_s.toFixed(1)} s`);
}

async function poll() {
  const after = points.length ? `?after=${points[points.length - 1].ts}` : "";
  const error = document.getElementById("metrics-error");
  let body;
  try {
    const resp = await fetch("/ui/metrics.json" + after);
    body = await resp.json();
    if (!resp.ok) throw new Error((body.error && (body.error.message || body.error)) || `HTTP ${resp.status}`);
  } catch (e) {
    error.textContent = String(e.message || e);
    error.hidden = false;
    return;
  }
  error.hidden = true;
  interval = body.interval_s;
  keep = body.keep_s;
  points = points.concat(body.points);
  const last = points.length ? points[points.length - 1].ts : 0;
  points = points.filter((p) => p.ts > last - keep);
  render();
}

async function loop() {
  await poll();
  setTimeout(loop, interval * 1000);
}

document.addEventListener("DOMContentLoaded", () => { render(); loop(); });
