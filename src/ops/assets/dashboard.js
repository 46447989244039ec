// Polls /api/status and /api/timeline once a second and draws the cluster. Utilisation and shares
// come from the difference between two heartbeats' worth of the devices' busy-time counters; each
// device's timeline is its work over the last seconds as its trace ring recorded it, coloured by
// client (the last minute of utilisation instead when there is no timeline). Text from the
// status goes into the page as text (textContent), never as markup.
'use strict';

const POLL_MS = 1000;
const HISTORY = 60;  // polls kept per device
const token = new URLSearchParams(location.search).get('token');
const history = new Map();  // device id -> [utilisation in 0..1]
let previous = null;        // {time, devices: Map(id -> {busy, at, clients: Map(label -> busy)})}
let shareWindow = [];       // per poll: Map(client -> device micros), the last HISTORY polls
let timeline = null;        // the last /api/timeline: {now_us, window_us, devices: Map(id -> buckets)}
const PALETTE = ['#4a7bd0', '#d0784a', '#3f9f6b', '#a64a9c', '#b89a2a', '#3aa0b8', '#7a6ad0', '#c04a5a'];
const clientColours = new Map();  // client label -> colour, in order of first appearance
function colourOf(client) {
  if (!clientColours.has(client)) clientColours.set(client, PALETTE[clientColours.size % PALETTE.length]);
  return clientColours.get(client);
}

function el(tag, attrs = {}, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v);
  for (const c of children) e.append(c instanceof Node ? c : document.createTextNode(String(c)));
  return e;
}
function bytes(n) {
  const units = ['B', 'KiB', 'MiB', 'GiB', 'TiB'];
  let i = 0;
  n = Number(n);
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return (i === 0 ? n.toFixed(0) : n.toFixed(1)) + ' ' + units[i];
}
function bar(fraction, kind) {
  const inner = el('div');
  inner.style.width = (Math.max(0, Math.min(1, fraction)) * 100).toFixed(1) + '%';
  return el('div', {class: 'bar ' + kind}, inner);
}
function fillTable(id, rows) {
  const body = document.querySelector('#' + id + ' tbody');
  body.replaceChildren(...rows.map(cells => el('tr', {}, ...cells.map(c =>
    typeof c === 'number' ? el('td', {class: 'num'}, c) : el('td', {}, c)))));
}
function drawTimeline(canvas, values) {
  const w = canvas.width = canvas.clientWidth || 200, h = canvas.height = 22;
  const g = canvas.getContext('2d');
  g.clearRect(0, 0, w, h);
  g.fillStyle = '#4a7bd0';
  const step = w / HISTORY;
  values.forEach((v, i) => {
    const x = (HISTORY - values.length + i) * step;
    g.fillRect(x, h - v * h, Math.max(1, step - 1), v * h);
  });
}

// A device's work over the window ending at nowUs: a bar per bucket, as high as the bucket was
// busy, stacked by client, one colour per client.
function drawWork(canvas, buckets, nowUs, windowUs) {
  const w = canvas.width = canvas.clientWidth || 200, h = canvas.height = 22;
  const g = canvas.getContext('2d');
  g.clearRect(0, 0, w, h);
  const from = nowUs - windowUs;
  for (const b of buckets) {
    const start = Number(b.start_us), width = Number(b.end_us) - start;
    const x0 = Math.max(0, (start - from) / windowUs * w), x1 = Math.min(w, (start + width - from) / windowUs * w);
    if (x1 <= 0 || x0 >= w || width <= 0) continue;
    let y = h;
    for (const t of b.busy || []) {
      const bar = Math.min(y, Number(t.busy_micros) / width * h);
      g.fillStyle = colourOf(t.client_id);
      g.fillRect(x0, y - bar, Math.max(1, x1 - x0 - 0.5), Math.max(bar, 1));
      y -= bar;
    }
  }
}

function render(status, now) {
  const hosts = status.hosts || [];
  // Devices' counters change with their host's heartbeats, not with these polls: a sample is
  // timed by the heartbeat that carried it, and a device whose heartbeat has not moved since the
  // last poll keeps its last reading.
  const devices = new Map();
  const clientMicros = new Map();
  const seen = new Set();
  for (const h of hosts) for (const d of h.devices || []) {
    seen.add(d.device_id);
    const at = now - Number(h.millis_since_heartbeat);
    const clients = new Map((d.client_time || []).map(t => [t.client_id, Number(t.busy_micros)]));
    const before = previous && previous.devices.get(d.device_id);
    const hist = history.get(d.device_id) || [];
    if (before && at - before.at < 100) {  // the same heartbeat as last time
      devices.set(d.device_id, before);
      if (hist.length) hist.push(hist[hist.length - 1]);
    } else {
      devices.set(d.device_id, {busy: Number(d.busy_micros), at, clients});
      let util = 0;
      if (before) {
        const wallMicros = (at - before.at) * 1000;
        util = wallMicros > 0 ? (Number(d.busy_micros) - before.busy) / wallMicros : 0;
        for (const [c, micros] of clients) {
          const delta = micros - (before.clients.get(c) || 0);
          if (delta > 0) clientMicros.set(c, (clientMicros.get(c) || 0) + delta);
        }
      }
      hist.push(Math.max(0, Math.min(1, util)));
    }
    while (hist.length > HISTORY) hist.shift();
    history.set(d.device_id, hist);
  }
  for (const id of [...history.keys()]) if (!seen.has(id)) history.delete(id);
  previous = {time: now, devices};
  document.getElementById('summary').className = '';
  shareWindow.push(clientMicros);
  while (shareWindow.length > HISTORY) shareWindow.shift();

  // A host's traffic since its worker started (int64s come as strings; an old worker sends none).
  const traffic = c => {
    const n = k => Number(c[k] || 0);
    const calls = n('collectives');
    // The mean comes with the histogram: a host whose histogram was not kept shows none.
    const mean = calls && (c.latency_buckets || []).length ? ` (mean ${(n('latency_sum_us') / calls / 1000).toFixed(2)} ms)` : '';
    return `blocks out ${bytes(n('block_bytes_sent'))}, in ${bytes(n('block_bytes_received'))}; ` +
      `dataflow out ${bytes(n('dataflow_bytes_sent'))}, in ${bytes(n('dataflow_bytes_received'))}; ` +
      `${calls} collectives${mean}, ${n('collectives_failed')} failed`;
  };
  const islands = new Map();
  for (const h of hosts) {
    if (!islands.has(h.island)) islands.set(h.island, []);
    islands.get(h.island).push(h);
  }
  const alive = hosts.filter(h => h.alive).length;
  const deviceCount = hosts.reduce((n, h) => n + (h.devices || []).length, 0);
  document.getElementById('summary').textContent =
    `${islands.size} island(s), ${alive}/${hosts.length} hosts alive, ${deviceCount} devices, ` +
    `${status.live_clients} client(s), ${(status.slices || []).length} slice(s)`;
  document.getElementById('updated').textContent = 'updated ' + new Date(now).toLocaleTimeString();

  const islandsDiv = document.getElementById('islands');
  islandsDiv.replaceChildren(...[...islands.keys()].sort((a, b) => a - b).map(island => {
    const cards = islands.get(island).map(h => {
      const card = el('div', {class: 'host' + (h.alive ? '' : ' down'), 'data-host': h.address},
        el('div', {class: 'name'}, h.address),
        el('div', {class: 'state'}, h.alive ? `alive, heartbeat ${h.millis_since_heartbeat} ms ago`
                                            : `not heartbeating for ${h.millis_since_heartbeat} ms`),
        el('div', {class: 'traffic'}, traffic(h.counters || {})));
      for (const d of h.devices || []) {
        const hist = history.get(d.device_id) || [];
        const util = hist.length ? hist[hist.length - 1] : 0;
        const work = timeline && timeline.devices.get(d.device_id);
        const canvas = el('canvas', {class: 'timeline', 'data-device': d.device_id,
          title: work ? `work in the last ${Number(timeline.window_us) / 1e6} s, by client`
                      : 'utilisation, last minute'});
        card.append(el('div', {class: 'device'},
          el('span', {}, `${d.kind}:${d.local_index}`), bar(util, 'util'), el('span', {}, `${(util * 100).toFixed(0)}% busy`),
          el('span', {}, 'mem'), bar(Number(d.memory_used) / Math.max(1, Number(d.memory_capacity)), 'mem'),
          el('span', {}, `${bytes(d.memory_used)} / ${bytes(d.memory_capacity)}`), canvas));
        requestAnimationFrame(() => work ? drawWork(canvas, work, Number(timeline.now_us), Number(timeline.window_us))
                                         : drawTimeline(canvas, hist));
      }
      return card;
    });
    return el('div', {class: 'island'}, el('h3', {}, `island ${island}`), el('div', {class: 'hosts'}, ...cards));
  }));

  const totals = new Map();
  for (const m of shareWindow) for (const [c, v] of m) totals.set(c, (totals.get(c) || 0) + v);
  const sum = [...totals.values()].reduce((a, b) => a + b, 0);
  const failed = new Map();  // client label -> shards failed, over every host
  for (const h of hosts) for (const f of (h.counters || {}).failed_shards || []) {
    failed.set(f.client_id, (failed.get(f.client_id) || 0) + Number(f.count));
  }
  const rows = [];
  for (const s of status.schedulers || []) for (const c of s.clients || []) {
    const share = sum > 0 ? (totals.get(c.client_id) || 0) / sum : 0;
    const swatch = el('span', {class: 'swatch'});
    swatch.style.background = colourOf(c.client_id);
    rows.push([el('span', {}, swatch, c.client_id + (c.tenant ? ' (' + c.tenant + ')' : '')), s.island, Number(c.weight), (share * 100).toFixed(1) + '%',
               Number(c.queued_runs), Number(c.released_runs), failed.get(c.client_id) || 0]);
  }
  fillTable('clients', rows);
  for (const w of document.querySelectorAll('.window')) w.textContent = `${shareWindow.length} s`;
  fillTable('schedulers', (status.schedulers || []).map(s => {
    const queued = (s.clients || []).reduce((n, c) => n + Number(c.queued_runs), 0);
    const runs = Number(s.released_runs);
    const wait = runs > 0 ? (Number(s.release_wait_us_sum) / runs).toFixed(0) + ' µs' : '-';
    return [s.island, s.policy, queued, Number(s.runs_in_flight || 0), Number(s.rounds), runs, wait];
  }));
  fillTable('slices', (status.slices || []).map(s => [Number(s.slice_id), s.client_id,
    (s.mesh_shape || []).join('×'), s.device_kind, (s.device_ids || []).join(' ')]));
}

// A request to the server, with the token the page was opened with.
function api(path) {
  return fetch(path + (token ? '?token=' + encodeURIComponent(token) : ''),
               {headers: token ? {Authorization: 'Bearer ' + token} : {}});
}

async function poll() {
  try {
    const response = await api('api/status');
    if (!response.ok) throw new Error(`status ${response.status}: ${await response.text()}`);
    const status = await response.json();
    // The timeline is optional: without it the devices show their utilisation history.
    try {
      const t = await api('api/timeline');
      if (t.ok) {
        const body = await t.json();
        timeline = {now_us: body.now_us, window_us: body.window_us,
                    devices: new Map((body.devices || []).map(d => [d.device_id, d.buckets || []]))};
      } else {
        timeline = null;  // never an old one drawn as if it were now
      }
    } catch (e) {
      timeline = null;
    }
    render(status, Date.now());
  } catch (e) {
    const summary = document.getElementById('summary');
    summary.textContent = 'cannot read the cluster: ' + e.message;
    summary.className = 'error';
  }
  setTimeout(poll, POLL_MS);
}
poll();
