// The Tessera dashboard: polls the JSON API (/api/cluster, /api/job, /api/timeline, /api/waits,
// /api/logs) once a second and draws the tables, the job's plots and the timeline on canvases,
// and the end of the log picked (/api/logs/NAME). No
// libraries; the token travels in the HttpOnly cookie the server set when the page was opened
// with ?token=.
'use strict';

const KIND_COLOURS = {
  forward: '#3b7dd8', backward: '#e07b39', backward_input: '#f0a04b', backward_weight: '#c0562a',
  optimizer: '#2e9e5b', collective: '#9b59b6', transfer: '#d4ac0d', other: '#95a5a6',
};

function el(tag, text, cls) {
  const e = document.createElement(tag);
  if (text !== undefined) e.textContent = text;
  if (cls) e.className = cls;
  return e;
}

function bytes(n) {
  if (n === null || n === undefined) return '-';
  const units = ['B', 'KiB', 'MiB', 'GiB', 'TiB'];
  let i = 0;
  while (Math.abs(n) >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return (i === 0 ? n.toFixed(0) : n.toFixed(1)) + ' ' + units[i];
}

// A task's name without the graph and instance ids it starts with ("<graph>.<instance>/"): the
// plan's rank, layer and op ("rank1/block0/attention_forward").
function taskLabel(name) { return String(name).replace(/(^|\s)\d+\.\d+\//g, '$1'); }

// The driver a graph id belongs to: ids are (driver << 40) | sequence.
function driverOfGraph(graph) { return Math.floor(Number(graph) / 2 ** 40); }

function num(x, digits) { return x === null || x === undefined ? '-' : Number(x).toFixed(digits); }

async function getJson(path) {
  const response = await fetch(path, { credentials: 'same-origin', cache: 'no-store' });
  if (!response.ok) throw new Error(path + ': HTTP ' + response.status);
  return response.json();
}

function memoryCell(used, capacity) {
  const td = el('td');
  const bar = el('span', undefined, 'bar');
  const fill = el('span');
  fill.style.width = (capacity > 0 ? Math.min(100, 100 * used / capacity) : 0) + '%';
  bar.appendChild(fill);
  td.appendChild(bar);
  td.appendChild(document.createTextNode(bytes(used) + ' / ' + bytes(capacity)));
  td.className = 'memory';
  return td;
}

function renderCluster(c) {
  const alive = c.workers.filter(w => w.alive).length;
  document.getElementById('summary').textContent =
    alive + ' of ' + c.workers.length + ' workers alive, ' + c.drivers + ' driver(s), ' +
    c.objects + ' objects, up ' + num(c.uptime_s, 0) + ' s';
  const nodes = {};
  for (const w of c.workers) {
    const n = nodes[w.hostname] || (nodes[w.hostname] = { alive: 0, total: 0, used: 0, capacity: 0, spilled: 0 });
    n.total++; n.alive += w.alive ? 1 : 0;
    n.used += w.memory.host_used; n.capacity += w.memory.host_capacity; n.spilled += w.memory.spilled;
  }
  const nodesDiv = document.getElementById('nodes');
  nodesDiv.replaceChildren();
  for (const [host, n] of Object.entries(nodes)) {
    nodesDiv.appendChild(el('div', 'node ' + host + ': ' + n.alive + ' of ' + n.total +
      ' workers alive, host memory ' + bytes(n.used) + ' / ' + bytes(n.capacity) +
      ', spilled ' + bytes(n.spilled), 'node'));
  }
  const body = document.querySelector('#workers tbody');
  body.replaceChildren();
  for (const w of c.workers) {
    const tr = el('tr');
    tr.dataset.worker = w.id;
    tr.appendChild(el('td', 'worker' + w.id));
    tr.appendChild(el('td', w.hostname));
    tr.appendChild(el('td', String(w.pid)));
    tr.appendChild(el('td', w.alive ? 'alive' : 'dead', w.alive ? 'alive' : 'dead'));
    const gpuName = el('td', w.gpu || '-', 'gpu-name');
    if (w.gpu) gpuName.title = w.gpu;  // the cell shows its start
    tr.appendChild(gpuName);
    // Busy cores over threads, then the CPUs it may run on (one of its own when bound to cores).
    const cpu = el('td', w.alive ? num(w.cpu.utilization, 2) + ' / ' + (w.cpu_threads || '-') +
      (w.cpus ? ' on ' + w.cpus : '') : '-', 'num cpu');
    cpu.title = num(w.cpu.seconds, 1) + ' CPU seconds so far' + (w.cpus ? '; runs on CPUs ' + w.cpus : '');
    tr.appendChild(cpu);
    // The GPU's own figures (NVML: every process on the device), as of the last heartbeat.
    const g = w.alive ? w.gpu_use : null;
    const gpuUse = el('td', g ? Math.round(g.utilization * 100) + '%, ' + bytes(g.memory_used) +
      ' / ' + bytes(g.memory_total) : '-', 'num gpu-use');
    if (g) gpuUse.title = 'a kernel ran ' + num(g.utilization * 100, 1) + '% of the last sample period';
    tr.appendChild(gpuUse);
    tr.appendChild(memoryCell(w.memory.host_used, w.memory.host_capacity));
    tr.appendChild(el('td', bytes(w.memory.spilled), 'num'));
    tr.appendChild(el('td', String(w.tasks.in_flight), 'num'));
    tr.appendChild(el('td', String(w.tasks.done), 'num tasks-done'));
    tr.appendChild(el('td', bytes(w.bytes.pulled), 'num'));
    tr.appendChild(el('td', bytes(w.bytes.served), 'num'));
    tr.appendChild(el('td', bytes(w.bytes.pushed), 'num'));
    body.appendChild(tr);
  }
  const store = document.querySelector('#store tbody');
  store.replaceChildren();
  for (const w of c.workers) {
    const tr = el('tr', undefined, w.alive ? undefined : 'dead');
    tr.dataset.worker = w.id;
    tr.appendChild(el('td', 'worker' + w.id + (w.alive ? '' : ' (dead)')));
    tr.appendChild(el('td', String(w.store.objects), 'num objects'));
    tr.appendChild(el('td', bytes(w.memory.host_used), 'num'));
    tr.appendChild(el('td', w.gpu ? bytes(w.memory.device) : '-', 'num'));
    tr.appendChild(el('td', bytes(w.memory.spilled), 'num'));
    tr.appendChild(el('td', bytes(w.memory.spilled_total), 'num'));
    tr.appendChild(el('td', String(w.store.restores), 'num'));
    store.appendChild(tr);
  }
  document.getElementById('tasks').textContent =
    'dynamic tasks: ' + c.tasks.queued + ' queued, ' + c.tasks.running + ' running, ' +
    c.tasks.done + ' done';
  const ranks = document.querySelector('#ranks tbody');
  ranks.replaceChildren();
  for (const w of c.workers) {
    if (!w.last_run) continue;
    // Only the shown job's steps: a worker's report from an earlier job is not this job's row.
    if (shownDriver !== null && driverOfGraph(w.last_run.graph) !== shownDriver) continue;
    const r = w.last_run;
    const tr = el('tr');
    tr.dataset.worker = w.id;
    tr.appendChild(el('td', 'worker' + w.id));
    tr.appendChild(el('td', bytes(r.model_state_peak), 'num'));
    tr.appendChild(el('td', bytes(r.transient_peak), 'num'));
    tr.appendChild(el('td', bytes(r.total_peak), 'num'));
    tr.appendChild(el('td', bytes(r.allocator_peak), 'num'));
    tr.appendChild(el('td', bytes(r.collective_bytes_sent), 'num'));
    tr.appendChild(el('td', bytes(r.pushed_bytes), 'num'));
    tr.appendChild(el('td', num(r.wall_ms, 1) + ' ms', 'num'));
    ranks.appendChild(tr);
  }
}

// A line plot of (x, y) points on a canvas, with the axes' ranges written at the corners; `dots`
// (optional) another series drawn as points in `dotColour` (the validation loss).
function plot(canvas, points, colour, dots = [], dotColour = '#1d2330') {
  const ctx = canvas.getContext('2d');
  const w = canvas.width, h = canvas.height, pad = 34;
  ctx.clearRect(0, 0, w, h);
  const data = points.filter(p => p[1] !== null && Number.isFinite(p[1]));
  const marks = dots.filter(p => p[1] !== null && Number.isFinite(p[1]));
  canvas.dataset.points = String(data.length);
  canvas.dataset.dots = String(marks.length);
  ctx.fillStyle = '#8a90a0';
  ctx.font = '11px system-ui, sans-serif';
  if (data.length === 0) { ctx.fillText('no data yet', pad, h / 2); return; }
  let x0 = data[0][0], x1 = data[data.length - 1][0];
  const all = data.concat(marks);
  let y0 = Math.min(...all.map(p => p[1])), y1 = Math.max(...all.map(p => p[1]));
  if (x1 === x0) x1 = x0 + 1;
  if (y1 === y0) { y1 += Math.abs(y1) * 0.05 + 1e-9; y0 -= Math.abs(y0) * 0.05 + 1e-9; }
  const sx = x => pad + (x - x0) / (x1 - x0) * (w - 2 * pad);
  const sy = y => h - pad / 2 - (y - y0) / (y1 - y0) * (h - pad);
  ctx.strokeStyle = '#d0d3da';
  ctx.strokeRect(pad, pad / 2, w - 2 * pad, h - pad);
  ctx.fillText(y1.toPrecision(4), 2, pad / 2 + 10);
  ctx.fillText(y0.toPrecision(4), 2, h - pad / 2);
  ctx.fillText('step ' + x0, pad, h - 3);
  ctx.fillText('step ' + x1, w - pad - 50, h - 3);
  ctx.strokeStyle = colour;
  ctx.lineWidth = 1.5;
  ctx.beginPath();
  data.forEach((p, i) => (i === 0 ? ctx.moveTo(sx(p[0]), sy(p[1])) : ctx.lineTo(sx(p[0]), sy(p[1]))));
  ctx.stroke();
  ctx.fillStyle = dotColour;
  for (const p of marks) {
    ctx.beginPath();
    ctx.arc(sx(p[0]), sy(p[1]), 3, 0, 2 * Math.PI);
    ctx.fill();
  }
  const last = data[data.length - 1];
  canvas.dataset.last = String(last[1]);
  canvas.dataset.lastStep = String(last[0]);
}

// Every job the scheduler kept (oldest first): a row each; the one picked (by default the latest
// that reported a step) is plotted, with its plan and its validation losses (dots on the loss).
let pickedJob = null;    // "driver/name" of the job picked by a click; null: the latest
let shownDriver = null;  // the driver of the job plotted (the per-rank table shows its rows)
function renderJobs(j) {
  const jobs = j.jobs.filter(job => job.points.length > 0);
  const key = job => job.driver + '/' + job.name;
  let job = jobs.find(x => key(x) === pickedJob) || (jobs.length ? jobs[jobs.length - 1] : null);
  shownDriver = job ? job.driver : null;
  const tbody = document.querySelector('#jobs tbody');
  tbody.replaceChildren();
  for (const x of [...jobs].reverse()) {
    const last = x.points[x.points.length - 1];
    const evaluated = x.points.filter(p => p.validation_loss !== null);
    const tr = el('tr', undefined, job && key(x) === key(job) ? 'picked' : undefined);
    tr.dataset.job = key(x);
    tr.appendChild(el('td', x.name));
    tr.appendChild(el('td', 'driver ' + x.driver));
    tr.appendChild(el('td', x.connected ? 'running' : 'finished', x.connected ? 'alive' : 'muted'));
    tr.appendChild(el('td', String(last.step), 'num'));
    tr.appendChild(el('td', num(last.loss, 4), 'num'));
    tr.appendChild(el('td', evaluated.length ? num(evaluated[evaluated.length - 1].validation_loss, 4) : '-', 'num'));
    tr.appendChild(el('td', x.plan || '-'));
    tr.addEventListener('click', () => { pickedJob = key(x); renderJobs(j); });
    tbody.appendChild(tr);
  }
  document.getElementById('job-name').textContent = job
    ? job.name + ' (driver ' + job.driver + (job.connected ? '' : ', finished') + ', step ' +
      job.points[job.points.length - 1].step + ')'
    : '(no job has reported a step yet)';
  document.getElementById('job-plan').textContent = job && job.plan ? 'plan: ' + job.plan : '';
  const pts = job ? job.points : [];
  plot(document.getElementById('plot-loss'), pts.map(p => [p.step, p.loss]), '#b03a2e',
       pts.map(p => [p.step, p.validation_loss]));
  plot(document.getElementById('plot-step'), pts.map(p => [p.step, p.step_ms]), '#3b7dd8');
  const tokens = pts.some(p => p.tokens_per_second !== null);
  document.getElementById('throughput-caption').textContent = tokens ? 'tokens/s' : 'samples/s';
  plot(document.getElementById('plot-throughput'),
    pts.map(p => [p.step, tokens ? p.tokens_per_second : p.samples_per_second]), '#2e9e5b');
}

function renderLegend() {
  const legend = document.getElementById('legend');
  for (const [kind, colour] of Object.entries(KIND_COLOURS)) {
    const item = el('span');
    const swatch = el('i');
    swatch.style.background = colour;
    item.appendChild(swatch);
    item.appendChild(document.createTextNode(kind));
    legend.appendChild(item);
  }
}

// One row per worker and stream (compute slots, transfer, collective), time left to right over
// the instances the scheduler kept (up to now).
// While the pointer is on the timeline it stays still (the spans under it keep their place for the
// hover); the latest data is drawn when the pointer leaves.
let timelinePointed = false;
let pendingTimeline = null;
function renderTimeline(t) {
  if (timelinePointed) { pendingTimeline = t; return; }
  const canvas = document.getElementById('timeline');
  const rowKey = s => s.worker + ' ' + s.stream;
  const rows = [...new Set(t.spans.map(rowKey))].sort((a, b) => {
    const [wa, ...sa] = a.split(' '), [wb, ...sb] = b.split(' ');
    return Number(wa) - Number(wb) || sa.join(' ').localeCompare(sb.join(' '));
  });
  const rowH = 18, top = 6, left = 150;
  canvas.height = Math.max(60, top * 2 + rowH * Math.max(1, rows.length) + 16);
  const ctx = canvas.getContext('2d');
  ctx.clearRect(0, 0, canvas.width, canvas.height);
  canvas.dataset.spans = String(t.spans.length);
  ctx.font = '11px system-ui, sans-serif';
  document.getElementById('timeline-granularity').textContent =
    t.spans.length ? '(' + new Set(t.spans.map(s => s.graph + '/' + s.instance)).size +
      ' latest graph instances, ' + t.spans.length + ' spans)' : '';
  if (t.spans.length === 0) { ctx.fillStyle = '#8a90a0'; ctx.fillText('no work recorded yet', left, 30); return; }
  const t0 = Math.min(...t.spans.map(s => s.start_ms));
  const t1 = Math.max(...t.spans.map(s => s.end_ms));
  const scale = (canvas.width - left - 10) / Math.max(1, t1 - t0);
  rows.forEach((key, row) => {
    const [worker, ...stream] = key.split(' ');
    ctx.fillStyle = '#555d6e';
    ctx.fillText('worker' + worker + ' ' + stream.join(' '), 4, top + row * rowH + 13);
  });
  drawnSpans = [];
  for (const s of t.spans) {
    const row = rows.indexOf(rowKey(s));
    ctx.fillStyle = KIND_COLOURS[s.kind] || KIND_COLOURS.other;
    const x = left + (s.start_ms - t0) * scale;
    const width = Math.max(1, (s.end_ms - s.start_ms) * scale);
    ctx.fillRect(x, top + row * rowH + 2, width, rowH - 4);
    drawnSpans.push({ x, y: top + row * rowH + 2, w: width, h: rowH - 4, span: s, t0 });
  }
  ctx.fillStyle = '#8a90a0';
  ctx.fillText((t1 - t0).toFixed(1) + ' ms shown', left, canvas.height - 4);
  canvas.dataset.lastEnd = String(t1);
  canvas.dataset.kinds = [...new Set(t.spans.map(s => s.kind))].sort().join(',');
}

// The timeline's spans as drawn, for the hover: what is under the pointer, named by its rank,
// layer and op, with its kind, where it ran, when and for how long, and the bytes it moved.
let drawnSpans = [];
function describeSpan(d) {
  const s = d.span;
  return taskLabel(s.name) + '\n' + s.kind + ' on worker' + s.worker + ' ' + s.stream +
    '\nstarts at ' + (s.start_ms - d.t0).toFixed(2) + ' ms, takes ' +
    (s.end_ms - s.start_ms).toFixed(3) + ' ms' + (s.bytes ? ', ' + bytes(s.bytes) : '') +
    '\ngraph ' + s.graph + ', instance ' + s.instance;
}
function hoverTimeline(event) {
  const canvas = document.getElementById('timeline');
  const tip = document.getElementById('timeline-tip');
  const box = canvas.getBoundingClientRect();
  const x = (event.clientX - box.left) * canvas.width / box.width;
  const y = (event.clientY - box.top) * canvas.height / box.height;
  // The narrowest span under the pointer (a short task drawn over a long one stays reachable).
  let hit = null;
  for (const d of drawnSpans) {
    if (x >= d.x - 1 && x <= d.x + d.w + 1 && y >= d.y && y <= d.y + d.h && (!hit || d.w < hit.w)) hit = d;
  }
  if (!hit) { tip.hidden = true; return; }
  tip.textContent = describeSpan(hit);
  tip.dataset.name = taskLabel(hit.span.name);
  tip.style.left = (event.pageX + 12) + 'px';
  tip.style.top = (event.pageY + 12) + 'px';
  tip.hidden = false;
}

// One row per worker: what it runs or waits for; a row blocked on a silent or absent worker is
// marked, and so is the row of a worker others are blocked on.
function renderWaits(w) {
  const blockers = new Set(w.workers.flatMap(x => x.blocked_on));
  const tbody = document.querySelector('#waits tbody');
  tbody.replaceChildren();
  for (const x of w.workers) {
    const tr = el('tr');
    if (x.blocked_on.length > 0) tr.className = 'blocked';
    if (blockers.has(x.id)) tr.className = 'blocker';
    tr.appendChild(el('td', 'worker' + x.id + ' (' + x.hostname + ':' + x.pid + ')'));
    tr.appendChild(el('td', x.alive ? taskLabel(x.waits || 'no report') : 'dead'));
    tbody.appendChild(tr);
  }
}

// The session's logs (the scheduler's host): a button per log; the one picked is shown, its end
// fetched again each refresh (kept scrolled to the bottom when it was there).
let pickedLog = null;
function renderLogs(l) {
  document.getElementById('logs-session').textContent = l.session_dir;
  const div = document.getElementById('logs');
  div.replaceChildren();
  for (const log of l.logs) {
    const button = el('button', log.name + ' (' + bytes(log.bytes) + ')',
                      log.name === pickedLog ? 'selected' : undefined);
    button.dataset.name = log.name;
    button.addEventListener('click', () => {
      pickedLog = log.name;
      for (const b of div.children) b.className = b.dataset.name === pickedLog ? 'selected' : '';
      showLog().catch(() => {});
    });
    div.appendChild(button);
  }
}

async function showLog() {
  if (pickedLog === null) return;
  const name = pickedLog;
  const response = await fetch('/api/logs/' + encodeURIComponent(name) + '?lines=200',
                               { credentials: 'same-origin', cache: 'no-store' });
  const text = await response.text();
  if (name !== pickedLog) return;  // another was picked meanwhile
  const pre = document.getElementById('log-text');
  const atBottom = pre.scrollTop + pre.clientHeight >= pre.scrollHeight - 4;
  pre.textContent = response.ok ? text : name + ': ' + text;
  pre.dataset.name = name;
  if (atBottom || pre.dataset.scrolled !== name) {
    pre.scrollTop = pre.scrollHeight;
    pre.dataset.scrolled = name;
  }
}

async function refresh() {
  const status = document.getElementById('status');
  try {
    const [cluster, jobs, timeline, waits, logs] = await Promise.all(
      [getJson('/api/cluster'), getJson('/api/job'), getJson('/api/timeline'),
       getJson('/api/waits'), getJson('/api/logs')]);
    renderJobs(jobs);  // first: the job shown decides the per-rank rows
    renderCluster(cluster);
    renderWaits(waits);
    renderTimeline(timeline);
    renderLogs(logs);
    await showLog();
    status.textContent = '';
    document.body.dataset.updates = String(Number(document.body.dataset.updates || 0) + 1);
  } catch (error) {
    status.textContent = 'cannot reach the scheduler (' + error.message + ')';
  }
}

renderLegend();
document.getElementById('timeline').addEventListener('mousemove', event => {
  timelinePointed = true;
  hoverTimeline(event);
});
document.getElementById('timeline').addEventListener('mouseleave', () => {
  timelinePointed = false;
  document.getElementById('timeline-tip').hidden = true;
  if (pendingTimeline) { renderTimeline(pendingTimeline); pendingTimeline = null; }
});
refresh();
setInterval(refresh, 1000);
