"""The dashboard page: one self-contained HTML document (inline CSS and plain JavaScript).

No external assets, no build step: machines running a training may have no internet. The script
loads /api/history once (so curves appear at once), then polls /api/state every second, keeps the
series client-side (bandwidth rates are computed from successive snapshots) and draws the plots as
SVG with its own small line-plot function. Text from the syncer (learner ids, regions, reasons) is
only ever inserted as text nodes, never as HTML. Elements tests rely on have stable ids:
outer-steps, tokens-merged, work-merged, heldout-loss (each with a raw `data-value`),
contributors-per-merge, learners, fragments, merges, plot-heldout, plot-work-merged, plot-bandwidth,
plot-inner, conn.

"Work merged" is tokens merged / (P x tokens processed): the share of the learners' work that reached
the global model (not the paper's goodput, which is a share of wall time).
"""

HTML = r"""<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>ddiloco dashboard</title>
<style>
  :root { --bg:#f4f6f9; --panel:#fff; --ink:#1d2733; --muted:#6b7785; --line:#e3e8ee; --accent:#2563eb;
          --ok:#16a34a; --warn:#d97706; --bad:#dc2626; }
  * { box-sizing: border-box; }
  body { margin:0; background:var(--bg); color:var(--ink);
         font:13px/1.4 system-ui,-apple-system,"Segoe UI",Roboto,"DejaVu Sans",sans-serif; }
  header { display:flex; align-items:center; gap:16px; padding:10px 20px; background:#111827; color:#e5e7eb; }
  header .brand { font-weight:700; font-size:16px; letter-spacing:.3px; }
  header .brand span { color:#93c5fd; font-weight:500; }
  header .meta { color:#9ca3af; flex:1; white-space:nowrap; overflow:hidden; text-overflow:ellipsis; }
  header .meta b { color:#f3f4f6; font-weight:600; }
  .badge { padding:2px 10px; border-radius:999px; font-weight:600; font-size:12px; background:#374151; }
  .badge.ok { background:#14532d; color:#bbf7d0; } .badge.bad { background:#7f1d1d; color:#fecaca; }
  .banner { margin:10px 20px 0; padding:8px 12px; border-radius:6px; background:#fef2f2; color:#991b1b;
            border:1px solid #fecaca; font-weight:600; }
  .hidden { display:none !important; }
  main { padding:12px 20px 20px; display:flex; flex-direction:column; gap:12px; }
  main.stale { opacity:.55; }
  .kpis { display:grid; grid-template-columns:repeat(8, minmax(0,1fr)); gap:10px; }
  .kpi { background:var(--panel); border:1px solid var(--line); border-radius:8px; padding:8px 12px; }
  .kpi .label { color:var(--muted); font-size:11px; text-transform:uppercase; letter-spacing:.4px; }
  .kpi .value { font-size:21px; font-weight:650; font-variant-numeric:tabular-nums; white-space:nowrap; }
  .kpi .sub { color:var(--muted); font-size:11.5px; white-space:nowrap; overflow:hidden; text-overflow:ellipsis; }
  .grid4 { display:grid; grid-template-columns:repeat(4, minmax(0,1fr)); gap:10px; }
  .grid2 { display:grid; grid-template-columns:minmax(0,7fr) minmax(0,3fr); gap:10px; align-items:start; }
  .panel { background:var(--panel); border:1px solid var(--line); border-radius:8px; padding:8px 12px 10px; min-width:0;
          overflow-x:auto; }
  .panel h2 { margin:0 0 6px; font-size:13px; font-weight:650; }
  .panel h2 small { color:var(--muted); font-weight:400; margin-left:6px; }
  svg.plot { width:100%; height:auto; display:block; }
  svg.plot text { font-size:11px; fill:#6b7785; font-family:inherit; }
  svg.plot .grid { stroke:#eef1f5; } svg.plot .axis { stroke:#cbd3dc; }
  svg.plot .empty { font-size:13px; fill:#9aa4b0; }
  table { width:100%; border-collapse:collapse; font-variant-numeric:tabular-nums; }
  th { text-align:left; color:var(--muted); font-weight:600; font-size:11.5px; border-bottom:1px solid var(--line);
       padding:4px 6px; white-space:nowrap; }
  td { padding:4px 6px; border-bottom:1px solid #f1f4f7; white-space:nowrap; }
  td.num, th.num { text-align:right; }
  td.wrap { white-space:normal; }
  td.who { white-space:normal; width:60%; }
  tbody tr:last-child td { border-bottom:none; }
  .pill { display:inline-block; padding:0 8px; border-radius:999px; font-size:11.5px; font-weight:600; }
  .pill.active { background:#dcfce7; color:#166534; } .pill.silent { background:#fef3c7; color:#92400e; }
  .pill.left { background:#e5e7eb; color:#4b5563; }
  .swatch { display:inline-block; width:9px; height:9px; border-radius:2px; margin-right:6px; vertical-align:0; }
  .chip { display:inline-flex; align-items:center; gap:5px; margin:1px 8px 1px 0; }
  .bar { display:inline-block; width:46px; height:7px; background:#e8edf3; border-radius:4px; overflow:hidden; }
  .bar i { display:block; height:100%; background:var(--accent); }
  .muted { color:var(--muted); }
  .mono { font-family:ui-monospace,"DejaVu Sans Mono",monospace; font-size:12px; }
  .uploads span { margin-right:14px; }
  footer { color:var(--muted); padding:0 20px 14px; font-size:11.5px; }
</style>
</head>
<body data-updates="0">
<header>
  <div class="brand">ddiloco <span>dashboard</span></div>
  <div id="conn" class="badge">connecting&hellip;</div>
  <div class="meta">run <b id="run-id">-</b> &middot; syncer instance <b id="syncer-instance">-</b>
    at <b id="target">-</b><span id="shards"></span> &middot; updated <span id="updated">-</span></div>
</header>
<div id="banner" class="banner hidden"></div>
<main id="main">
  <section class="kpis">
    <div class="kpi"><div class="label">outer steps</div><div class="value" id="outer-steps">-</div>
      <div class="sub" id="merge-rate">-</div></div>
    <div class="kpi"><div class="label">tokens merged</div><div class="value" id="tokens-merged">-</div>
      <div class="sub" id="tokens-processed">-</div></div>
    <div class="kpi" title="tokens merged / (P fragments x tokens processed by every life of every learner): the share of the learners' work that reached the global model. Below: contributors per merge of the learners each round waited for (recent merges)"><div class="label">work merged</div><div class="value" id="work-merged">-</div>
      <div class="sub" id="contributors-per-merge">-</div></div>
    <div class="kpi"><div class="label">held-out loss</div><div class="value" id="heldout-loss">-</div>
      <div class="sub" id="heldout-first">-</div></div>
    <div class="kpi"><div class="label">bytes in (uploads)</div><div class="value" id="bytes-in">-</div>
      <div class="sub" id="rate-in">-</div></div>
    <div class="kpi"><div class="label">bytes out (global)</div><div class="value" id="bytes-out">-</div>
      <div class="sub" id="rate-out">-</div></div>
    <div class="kpi"><div class="label">learners</div><div class="value" id="learner-count">-</div>
      <div class="sub" id="learner-sub">-</div></div>
    <div class="kpi" title="adaptive grace window after quorum; smoothed learner step time; last checkpoint (outer step)"><div class="label">grace window</div><div class="value" id="grace">-</div>
      <div class="sub" id="checkpoint">-</div></div>
  </section>
  <section class="grid4">
    <div class="panel"><h2>Held-out loss<small>global model, vs tokens merged</small></h2>
      <svg class="plot" id="plot-heldout"></svg></div>
    <div class="panel"><h2>Work merged<small>tokens merged / (P&middot;processed), over time</small></h2><svg class="plot" id="plot-work-merged"></svg></div>
    <div class="panel"><h2>Bandwidth<small>bytes/s, in and out</small></h2><svg class="plot" id="plot-bandwidth"></svg></div>
    <div class="panel"><h2>Inner loss<small>per learner, over time</small></h2><svg class="plot" id="plot-inner"></svg></div>
  </section>
  <section class="grid2">
    <div class="panel"><h2>Learners</h2>
      <table id="learners"><thead><tr><th>learner</th><th>region</th><th>status</th><th class="num">last seen</th>
        <th class="num">steps</th><th class="num">tokens</th><th class="num">inner loss</th><th class="num">step time</th>
        <th class="num" title="uploads accepted">accepted</th><th class="num" title="uploads rejected">rejected</th>
        <th class="num">joins</th><th class="num">bytes in / out</th></tr></thead><tbody></tbody></table></div>
    <div class="panel"><h2>Fragments<small>versions of the global fragments</small></h2>
      <table id="fragments"><thead><tr><th>fragment</th><th class="num">version</th>
        <th class="num" title="rounds the syncer has opened for this fragment; open: its learners were called and it merges at quorum plus grace">round</th><th class="num">params</th>
        <th class="num">pending</th><th>sha256</th></tr></thead><tbody></tbody></table>
      <div class="uploads" id="uploads" style="margin-top:8px"></div></div>
  </section>
  <section class="panel"><h2>Recent merges<small>newest first; contributors with their share of the merge weight (tokens&sup2; / steps)</small></h2>
    <table id="merges"><thead><tr><th>fragment</th><th class="num">version</th><th class="num">round</th><th class="num">ago</th>
      <th class="num" title="contributors / live learners the round waited for">held / expected</th>
      <th>contributors (share of weight, weight)</th><th class="num">quorum wait</th>
      <th class="num">grace used / window</th><th>reason</th></tr></thead><tbody></tbody></table>
  </section>
</main>
<footer>Polls <span class="mono">/api/state</span> every second; history from <span class="mono">/api/history</span>.
  Work merged: the share of the learners' work (tokens &times; fragments) that was merged into the global model.</footer>
<script>
"use strict";
const COLORS = ["#2563eb", "#dc2626", "#16a34a", "#d97706", "#7c3aed", "#0891b2", "#db2777", "#65a30d"];
const S = { samples: [], evals: new Map(), max: 3600, updates: 0, colors: new Map(), runId: null };
const $ = (id) => document.getElementById(id);
const num = (v) => (v === null || v === undefined || v === "" ? NaN : Number(v));

function el(tag, props, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(props || {})) {
    if (k === "class") e.className = v; else if (k === "style") e.style.cssText = v; else e.setAttribute(k, v);
  }
  for (const c of children) e.append(c instanceof Node ? c : document.createTextNode(String(c)));
  return e;
}
function svgEl(tag, attrs, text) {
  const e = document.createElementNS("http://www.w3.org/2000/svg", tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
  if (text !== undefined) e.textContent = text;
  return e;
}
function fmtInt(v) { return Number.isFinite(v) ? Math.round(v).toLocaleString("en-US") : "-"; }
function fmtSI(v, digits = 3) {
  if (!Number.isFinite(v)) return "-";
  const a = Math.abs(v);
  for (const [d, s] of [[1e12, "T"], [1e9, "G"], [1e6, "M"], [1e3, "k"]]) if (a >= d) return parseFloat((v / d).toPrecision(digits)) + s;
  return a >= 1 || a === 0 ? String(Math.round(v * 100) / 100) : v.toPrecision(2);
}
function fmtBytes(v) {
  if (!Number.isFinite(v)) return "-";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0; while (Math.abs(v) >= 1024 && i < units.length - 1) { v /= 1024; i++; }
  return (i === 0 ? Math.round(v) : v.toFixed(1)) + " " + units[i];
}
function fmtAgo(s) {
  if (!Number.isFinite(s)) return "-";
  s = Math.max(0, s);
  if (s < 60) return s.toFixed(1) + " s ago";
  if (s < 3600) return (s / 60).toFixed(1) + " min ago";
  return (s / 3600).toFixed(1) + " h ago";
}
function fmtClock(t) { const d = new Date(t * 1000); return d.toTimeString().slice(0, 8); }
function colorOf(name) {
  if (!S.colors.has(name)) S.colors.set(name, COLORS[S.colors.size % COLORS.length]);
  return S.colors.get(name);
}
function setKpi(id, text, value) { const e = $(id); e.textContent = text; e.dataset.value = Number.isFinite(value) ? String(value) : ""; }

// --- a small line plot --------------------------------------------------------------------------
const TIME_STEPS = [1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 14400, 43200, 86400];
function niceTicks(lo, hi, n, time) {
  const span = hi - lo, raw = span / n, mag = Math.pow(10, Math.floor(Math.log10(raw)));
  const steps = time && span >= 3 ? TIME_STEPS : [1, 2, 2.5, 5, 10, 20].map((m) => m * mag);
  const step = steps.find((s) => span / s <= n + 1) || steps[steps.length - 1];
  const out = []; for (let v = Math.ceil(lo / step) * step; v <= hi + step * 1e-9; v += step) out.push(v);
  return out;
}
function plot(svg, series, o) {
  const legend = series.length > 1 || o.legend;
  const W = 420, H = 230, L = 62, R = 26, T = legend ? 26 : 10, B = 24;
  svg.setAttribute("viewBox", `0 0 ${W} ${H}`);
  svg.replaceChildren();
  const pts = series.flatMap((s) => s.pts).filter((p) => Number.isFinite(p[0]) && Number.isFinite(p[1]));
  svg.dataset.points = String(pts.length);
  if (!pts.length) {
    svg.append(svgEl("text", { x: W / 2, y: H / 2, "text-anchor": "middle", class: "empty" }, o.empty || "no data yet"));
    return;
  }
  let [x0, x1] = [Math.min(...pts.map((p) => p[0])), Math.max(...pts.map((p) => p[0]))];
  let [y0, y1] = [Math.min(...pts.map((p) => p[1])), Math.max(...pts.map((p) => p[1]))];
  if (o.y0 !== undefined) y0 = Math.min(y0, o.y0);
  if (o.y1 !== undefined) y1 = Math.max(y1, o.y1);
  if (x1 === x0) { x0 -= 1; x1 += 1; }
  if (y1 === y0) { const d = Math.abs(y0) * 0.1 || 1; y0 -= d; y1 += d; }
  const pad = (y1 - y0) * 0.06; if (o.y0 === undefined || y0 < o.y0) y0 -= pad; y1 += pad;
  const X = (x) => L + (x - x0) / (x1 - x0) * (W - L - R), Y = (y) => T + (1 - (y - y0) / (y1 - y0)) * (H - T - B);
  for (const v of niceTicks(y0, y1, 5)) {
    svg.append(svgEl("line", { x1: L, x2: W - R, y1: Y(v), y2: Y(v), class: "grid" }));
    svg.append(svgEl("text", { x: L - 6, y: Y(v) + 4, "text-anchor": "end" }, o.yfmt(v)));
  }
  const xt = niceTicks(x0, x1, o.xticks || 4, o.time);
  for (const v of xt) {
    svg.append(svgEl("line", { x1: X(v), x2: X(v), y1: T, y2: H - B, class: "grid" }));
    svg.append(svgEl("text", { x: X(v), y: H - B + 15, "text-anchor": "middle" }, o.xfmt(v)));
  }
  svg.append(svgEl("line", { x1: L, x2: L, y1: T, y2: H - B, class: "axis" }));
  svg.append(svgEl("line", { x1: L, x2: W - R, y1: H - B, y2: H - B, class: "axis" }));
  series.forEach((s) => {
    // Gaps (null values, e.g. while the syncer was down or its counters restarted) break the line.
    let run = [];
    const flush = () => {
      if (run.length > 1) svg.append(svgEl("polyline", { points: run.join(" "), fill: "none", stroke: s.color,
        "stroke-width": 1.8, "stroke-linejoin": "round", class: "series", "data-series": s.name }));
      run = [];
    };
    for (const p of s.pts) {
      if (Number.isFinite(p[0]) && Number.isFinite(p[1])) run.push(X(p[0]).toFixed(1) + "," + Y(p[1]).toFixed(1));
      else flush();
    }
    flush();
    const last = s.pts.filter((p) => Number.isFinite(p[1])).slice(-1)[0];
    if (last) svg.append(svgEl("circle", { cx: X(last[0]), cy: Y(last[1]), r: 2.8, fill: s.color }));
  });
  if (legend) {
    let lx = L;
    series.forEach((s) => {
      svg.append(svgEl("rect", { x: lx, y: 4, width: 9, height: 9, rx: 2, fill: s.color }));
      const t = svgEl("text", { x: lx + 13, y: 12 }, s.name); svg.append(t);
      lx += 22 + 6.2 * s.name.length;
    });
  }
}

// --- series -------------------------------------------------------------------------------------
function addSample(s) {
  const last = S.samples[S.samples.length - 1];
  if (!s || (last && s.t <= last.t)) return;
  S.samples.push(s);
  if (S.samples.length > S.max) S.samples.splice(0, S.samples.length - S.max);
}
function addEvals(list) { for (const e of list || []) { const t = num(e.t ?? e.at_unix_s); if (!S.evals.has(t)) S.evals.set(t, { t, heldout_loss: num(e.heldout_loss), tokens_merged: num(e.tokens_merged) }); } }
function rates(key, windowS) {
  // Bytes/s over a trailing window of about windowS seconds; a counter that went backwards (a
  // restarted syncer) or a change of syncer instance starts a new segment.
  const out = []; let j = 0;
  for (let i = 0; i < S.samples.length; i++) {
    const si = S.samples[i];
    while (j < i && (si.t - S.samples[j].t > windowS || S.samples[j].syncer_instance !== si.syncer_instance)) j++;
    const sj = S.samples[j], dt = si.t - sj.t, db = num(si[key]) - num(sj[key]);
    out.push([si.t, j < i && dt > 0 && db >= 0 ? db / dt : null]);
  }
  return out;
}

// --- rendering ----------------------------------------------------------------------------------
function renderConn(st) {
  const conn = $("conn"), banner = $("banner");
  if (st === null) {
    conn.className = "badge bad"; conn.textContent = "dashboard unreachable";
    banner.textContent = "The dashboard server does not answer; retrying."; banner.classList.remove("hidden");
    $("main").classList.add("stale"); return;
  }
  $("target").textContent = st.target || "-";
  $("updated").textContent = st.fetched_at ? fmtClock(st.fetched_at) : "-";
  if (st.available) {
    conn.className = "badge ok"; conn.textContent = "live"; banner.classList.add("hidden"); $("main").classList.remove("stale");
  } else {
    conn.className = "badge bad"; conn.textContent = "syncer unavailable";
    banner.textContent = "syncer unavailable at " + (st.target || "?") + " (" + (st.error || "no answer") + "); retrying"
      + (st.last_ok_at ? ". Showing the state last seen at " + fmtClock(st.last_ok_at) + "." : ".");
    banner.classList.remove("hidden"); $("main").classList.add("stale");
  }
}

function renderState(st) {
  if (!st.run_id && !st.syncer_instance) return;  // never reached the syncer yet
  const now = num(st.now_unix_s);
  $("run-id").textContent = st.run_id || "-";
  $("syncer-instance").textContent = (st.syncer_instance || "-").slice(0, 12);
  // Fragment shards: one word per shard, "i up" or "i DOWN" (shard_status; absent when unsharded).
  const shards = st.shard_status || [];
  $("shards").textContent = shards.length ? " \u00b7 " + shards.length + " shards: "
    + shards.map((s) => (s.index || 0) + (s.up ? " up" : " DOWN")).join(", ") : "";
  const outer = num(st.outer_steps), merged = num(st.tokens_merged), d = st.derived || {};
  setKpi("outer-steps", fmtInt(outer), outer);
  const up = now - num(st.started_at_unix_s);
  $("merge-rate").textContent = up > 0 ? (outer / up * 60).toFixed(1) + " merges/min" : "-";
  setKpi("tokens-merged", fmtSI(merged), merged);
  const budget = num(st.token_budget);
  $("tokens-processed").textContent = fmtSI(num(d.tokens_processed)) + " processed"
    + (budget > 0 ? " of a " + fmtSI(budget) + " budget" : "") + ", P=" + (d.num_fragments || "?");
  const g = num(d.work_merged);
  setKpi("work-merged", Number.isFinite(g) ? (100 * g).toFixed(1) + " %" : "-", g);
  const mp = d.merge_participation || {}, held = num(mp.contributors_mean), expd = num(mp.expected_contributors_mean);
  $("contributors-per-merge").textContent = !Number.isFinite(held) ? "no merge yet"
    : Number.isFinite(expd) ? held.toFixed(1) + " of " + expd.toFixed(1) + " learners per merge ("
      + (100 * num(mp.contributors_per_expected)).toFixed(0) + " %)"
    : held.toFixed(1) + " contributors per merge";
  const evals = [...S.evals.values()].sort((a, b) => a.t - b.t);
  const lastEval = evals[evals.length - 1];
  setKpi("heldout-loss", lastEval ? lastEval.heldout_loss.toFixed(4) : "-", lastEval ? lastEval.heldout_loss : NaN);
  $("heldout-first").textContent = evals.length ? "first " + evals[0].heldout_loss.toFixed(4) + ", " + evals.length + " evals" : "no evaluations yet";
  const rin = rates("bytes_in", 5), rout = rates("bytes_out", 5);
  const lastRate = (r) => { const v = r.length ? r[r.length - 1][1] : null; return v === null ? "-" : fmtBytes(v) + "/s"; };
  setKpi("bytes-in", fmtBytes(num(st.bytes_in)), num(st.bytes_in)); $("rate-in").textContent = lastRate(rin);
  setKpi("bytes-out", fmtBytes(num(st.bytes_out)), num(st.bytes_out)); $("rate-out").textContent = lastRate(rout);
  const members = st.members || [];
  const active = members.filter((m) => m.status === "STATUS_ACTIVE").length;
  setKpi("learner-count", String(members.length), members.length);
  $("learner-sub").textContent = active + " active, " + (members.length - active) + " silent or left";
  $("grace").textContent = num(st.grace_window_s).toFixed(2) + " s";
  $("checkpoint").textContent = "step " + num(st.step_time_s).toFixed(2) + " s, ckpt @ " + fmtInt(num(st.last_checkpoint_outer_step))
    + (st.restored_from_checkpoint ? " (restored)" : "");

  // learners
  const lb = $("learners").tBodies[0]; lb.replaceChildren();
  for (const m of members) {
    const status = String(m.status || "").replace("STATUS_", "").toLowerCase() || "?";
    const loss = num(m.inner_loss);
    lb.append(el("tr", { "data-learner": m.learner_id },
      el("td", {}, el("span", { class: "swatch", style: "background:" + colorOf(m.learner_id) }), m.learner_id),
      el("td", {}, m.region || "-"), el("td", {}, el("span", { class: "pill " + status }, status)),
      el("td", { class: "num" }, num(m.last_seen_unix_s) ? fmtAgo(now - num(m.last_seen_unix_s)) : "-"),
      el("td", { class: "num" }, fmtInt(num(m.local_step))), el("td", { class: "num" }, fmtSI(num(m.tokens_total))),
      el("td", { class: "num" }, num(m.local_step) > 0 && Number.isFinite(loss) ? loss.toFixed(3) : "-"),
      el("td", { class: "num" }, (1000 * num(m.step_time_s)).toFixed(0) + " ms"),
      el("td", { class: "num" }, fmtInt(num(m.uploads_accepted))), el("td", { class: "num" }, fmtInt(num(m.uploads_rejected))),
      el("td", { class: "num" }, fmtInt(num(m.joins))),
      el("td", { class: "num" }, fmtBytes(num(m.bytes_in)) + " / " + fmtBytes(num(m.bytes_out)))));
  }
  if (!members.length) lb.append(el("tr", {}, el("td", { colspan: 12, class: "muted" }, "no learner has joined yet")));

  // fragments and uploads
  const fb = $("fragments").tBodies[0]; fb.replaceChildren();
  for (const f of st.fragments || []) {
    fb.append(el("tr", { "data-fragment": f.fragment_id }, el("td", {}, String(f.fragment_id)),
      el("td", { class: "num" }, fmtInt(num(f.version))),
      el("td", { class: "num", "data-open": f.round_open ? "1" : "0" }, fmtInt(num(f.round)) + (f.round_open ? " open" : "")),
      el("td", { class: "num" }, fmtInt(num(f.numel))),
      el("td", { class: "num" }, fmtInt(num(f.pending_contributions))),
      el("td", { class: "mono muted" }, (f.params_sha256 || "").slice(0, 12))));
  }
  const ups = $("uploads"); ups.replaceChildren(el("b", {}, "uploads: "));
  const entries = Object.entries(st.uploads || {}).sort((a, b) => (a[0] === "accepted" ? -1 : b[0] === "accepted" ? 1 : a[0].localeCompare(b[0])));
  for (const [k, v] of entries) ups.append(el("span", {}, k.replace(/_/g, " ") + " ", el("b", {}, fmtInt(num(v)))));
  if (!entries.length) ups.append(el("span", { class: "muted" }, "none yet"));

  // merges, newest first
  const mb = $("merges").tBodies[0]; mb.replaceChildren();
  const merges = (st.recent_merges || []).slice(-8).reverse();
  for (const r of merges) {
    const cs = r.contributors || [], total = cs.reduce((a, c) => a + num(c.weight), 0);
    const who = el("td", { class: "who" });
    for (const c of cs) {
      const share = total > 0 ? num(c.weight) / total : 0;
      who.append(el("span", { class: "chip", "data-learner": c.learner_id },
        el("span", { class: "swatch", style: "background:" + colorOf(c.learner_id) }), c.learner_id,
        el("span", { class: "bar" }, el("i", { style: "width:" + (100 * share).toFixed(0) + "%" })),
        el("span", { class: "muted" }, (100 * share).toFixed(0) + "%, w " + fmtSI(num(c.weight)))));
    }
    const expected = num(r.expected_contributors);
    mb.append(el("tr", {}, el("td", {}, String(r.fragment_id)), el("td", { class: "num" }, fmtInt(num(r.version))),
      el("td", { class: "num" }, num(r.round) > 0 ? fmtInt(num(r.round)) : "-"),
      el("td", { class: "num" }, fmtAgo(now - num(r.merged_at_unix_s)).replace(" ago", "")),
      el("td", { class: "num held" }, expected > 0 ? cs.length + " / " + expected : String(cs.length)), who,
      el("td", { class: "num" }, num(r.quorum_wait_s).toFixed(2) + " s"),
      el("td", { class: "num" }, num(r.grace_used_s).toFixed(2) + " / " + num(r.grace_window_s).toFixed(2) + " s"),
      el("td", { class: "muted" }, (r.reason || "-").replace(/_/g, " "))));
  }
  if (!merges.length) mb.append(el("tr", {}, el("td", { colspan: 9, class: "muted" }, "no merge yet")));
  renderPlots(evals, rin, rout);
}

function renderPlots(evals, rin, rout) {
  const tfmt = (t) => fmtClock(t);
  plot($("plot-heldout"), [{ name: "held-out loss", color: COLORS[0], pts: evals.map((e) => [e.tokens_merged, e.heldout_loss]) }],
    { xfmt: fmtSI, yfmt: (v) => v.toFixed(2), empty: "no held-out evaluation yet (start an evaluator)" });
  plot($("plot-work-merged"), [{ name: "work merged", color: COLORS[2], pts: S.samples.map((s) => [s.t, s.work_merged === null ? NaN : 100 * num(s.work_merged)]) }],
    { xfmt: tfmt, yfmt: (v) => v.toFixed(0) + " %", y0: 0, y1: 100, xticks: 3, time: true });
  const peak = Math.max(0, ...rin.concat(rout).map((p) => p[1]).filter(Number.isFinite));
  const [unit, div] = peak >= 2 ** 30 ? ["GiB", 2 ** 30] : peak >= 2 ** 20 ? ["MiB", 2 ** 20] : peak >= 2 ** 10 ? ["KiB", 2 ** 10] : ["B", 1];
  const scaled = (r) => r.map((p) => [p[0], p[1] === null ? NaN : p[1] / div]);
  plot($("plot-bandwidth"), [{ name: "in", color: COLORS[0], pts: scaled(rin) }, { name: "out", color: COLORS[3], pts: scaled(rout) }],
    { xfmt: tfmt, yfmt: (v) => (Math.round(v * 10) / 10) + " " + unit + "/s", y0: 0, xticks: 3, time: true });
  const names = [...new Set(S.samples.flatMap((s) => Object.keys(s.inner_loss || {})))].sort();
  plot($("plot-inner"), names.map((n) => ({ name: n, color: colorOf(n),
    pts: S.samples.map((s) => [s.t, s.inner_loss && n in s.inner_loss ? num(s.inner_loss[n]) : NaN]) })),
    { xfmt: tfmt, yfmt: (v) => v.toFixed(2), xticks: 3, time: true });
}

async function getJSON(path) {
  const ctl = new AbortController(); const timer = setTimeout(() => ctl.abort(), 5000);
  try { const r = await fetch(path, { cache: "no-store", signal: ctl.signal }); if (!r.ok) throw new Error(r.status); return await r.json(); }
  finally { clearTimeout(timer); }
}
async function loadHistory() {
  try {
    const h = await getJSON("/api/history");
    S.max = h.max_samples || S.max;
    S.runId = h.run_id || null;
    for (const s of h.samples || []) addSample(s);
    addEvals(h.evals);
    return true;
  } catch (e) { return false; }
}
let haveHistory = false;
async function tick() {
  let st = null;
  try { if (!haveHistory) haveHistory = await loadHistory(); st = await getJSON("/api/state"); } catch (e) { st = null; }
  renderConn(st);
  if (st) {
    if (st.run_id && S.runId && st.run_id !== S.runId) { S.samples = []; S.evals.clear(); }  // another run
    if (st.run_id) S.runId = st.run_id;
    if (st.available) addSample(st.sample);
    addEvals(st.evals);
    try { renderState(st); } catch (e) { console.error(e); }
    document.body.dataset.updates = String(++S.updates);
  }
}
async function loop() { await tick(); setTimeout(loop, 1000); }
loop();
</script>
</body>
</html>
"""
