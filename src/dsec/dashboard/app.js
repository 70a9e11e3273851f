// DSec dashboard: a read-only view over the control plane's read API. No framework, no build step.
// Every value shown comes from GET /v1/status, /v1/events (keyset cursor), /v1/devices, /v1/policies and /metrics.
// Text from the server (worker ids, hosts, event data) is only ever set as textContent, never parsed as HTML.
"use strict";

(() => {
  const POLL_MS = 1000; // status, new events and the headline gauges
  const SLOW_EVERY = 5; // devices and rules every 5th poll
  const HISTORY = 90; // points per worker sparkline (one per new beat seen)
  const SPARK_MIN = 20;
  const EVENTS_KEPT = 500;
  const EVENTS_BACK_S = 3600; // the first load shows the last hour
  const TOKEN_KEY = "dsec.readToken";
  const ADMIN_PREFIX = "dsa_";

  const S = {
    token: null,
    cursor: 0,
    loadedEvents: false,
    events: [],
    history: new Map(), // worker id -> [{beat, lat, cap, ret}]
    tick: 0,
    timer: null,
    devices: null,
    rules: null,
  };

  const $ = (id) => document.getElementById(id);

  function el(tag, attrs, ...children) {
    const e = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (v === undefined || v === null || v === false) continue;
      if (k === "class") e.className = v;
      else if (k === "title") e.title = v;
      else e.setAttribute(k, String(v));
    }
    for (const c of children) {
      if (c === undefined || c === null) continue;
      e.append(c instanceof Node ? c : document.createTextNode(String(c)));
    }
    return e;
  }

  const SVG = "http://www.w3.org/2000/svg";
  function svg(tag, attrs) {
    const e = document.createElementNS(SVG, tag);
    for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, String(v));
    return e;
  }

  // -- formatting -------------------------------------------------------------------------------------------------
  const isNum = (x) => typeof x === "number" && Number.isFinite(x);
  function fmt(x, digits = 2) {
    if (!isNum(x)) return "–";
    const a = Math.abs(x);
    if (a !== 0 && (a >= 1e5 || a < 1e-3)) return x.toExponential(1);
    return Number(x.toFixed(digits)).toString();
  }
  function bytes(n) {
    const units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let i = 0;
    while (n >= 1024 && i < units.length - 1) {
      n /= 1024;
      i++;
    }
    return `${fmt(n, 1)} ${units[i]}`;
  }
  const pct = (x, digits = 2) => (isNum(x) ? `${(x * 100).toFixed(digits)}%` : "–");
  const pad = (n) => String(n).padStart(2, "0");
  function clock(ts) {
    const d = new Date(ts * 1000);
    return `${pad(d.getHours())}:${pad(d.getMinutes())}:${pad(d.getSeconds())}`;
  }
  function badge(text, cls, attrs) {
    return el("span", { class: `badge ${cls || "muted"}`, ...(attrs || {}) }, text);
  }

  // -- token --------------------------------------------------------------------------------------------------------
  function tokenFromHash() {
    const m = /(?:^#|&)token=([^&]+)/.exec(location.hash);
    if (!m) return null;
    // The fragment never reaches a server; drop it from the address bar and the history all the same.
    history.replaceState(null, "", location.pathname + location.search);
    return decodeURIComponent(m[1]);
  }

  function useToken(token) {
    token = (token || "").trim();
    if (!token) return false;
    if (token.startsWith(ADMIN_PREFIX)) {
      showLogin("That is an admin token. This page needs a read-only one: dsec token create --read");
      return false;
    }
    S.token = token;
    sessionStorage.setItem(TOKEN_KEY, token);
    $("login").hidden = true;
    $("board").hidden = false;
    $("logout").hidden = false;
    schedule(0);
    return true;
  }

  function showLogin(message) {
    S.token = null;
    sessionStorage.removeItem(TOKEN_KEY);
    clearTimeout(S.timer);
    $("login").hidden = false;
    $("board").hidden = true;
    $("logout").hidden = true;
    $("login-error").textContent = message || "";
    setConn("idle", "not connected");
  }

  function setConn(state, text) {
    const c = $("conn");
    c.dataset.state = state;
    c.className = `badge ${{ live: "ok", stale: "warn", idle: "muted" }[state] || "muted"}`;
    c.textContent = text;
  }

  // -- requests -----------------------------------------------------------------------------------------------------
  class Refused extends Error {}

  async function api(path) {
    const r = await fetch(path, { headers: { Authorization: `Bearer ${S.token}` }, cache: "no-store" });
    if (r.status === 401 || r.status === 403) {
      let message = `HTTP ${r.status}`;
      try {
        message = (await r.json()).message || message;
      } catch (_) {
        /* keep the status */
      }
      throw new Refused(message);
    }
    if (!r.ok) throw new Error(`${path}: HTTP ${r.status}`);
    return r.json();
  }

  async function newEvents(serverTime) {
    // Keyset pagination: `cursor` is the last id seen; a full page means there may be more.
    const limit = 500;
    for (let page = 0; page < 20; page++) {
      let q = `/v1/events?cursor=${S.cursor}&limit=${limit}`;
      if (!S.loadedEvents) q += `&since=${Math.max(0, serverTime - EVENTS_BACK_S)}`;
      const ans = await api(q);
      for (const e of ans.items) S.events.push(e);
      if (ans.items.length) S.cursor = ans.items[ans.items.length - 1].id;
      if (ans.next_cursor === null || ans.next_cursor === undefined) break;
    }
    S.loadedEvents = true;
    if (S.events.length > EVENTS_KEPT) S.events.splice(0, S.events.length - EVENTS_KEPT);
  }

  // The four headline gauges per pool, as Prometheus scrapes them (GET /metrics needs no token).
  const SAMPLE = /^(dsec_[a-z_]+)\{([^}]*)\}\s+(\S+)$/;
  const LABEL = /([a-zA-Z_]+)="((?:[^"\\]|\\.)*)"/g;
  async function headline() {
    const r = await fetch("/metrics", { cache: "no-store" });
    if (!r.ok) throw new Error(`/metrics: HTTP ${r.status}`);
    const out = {};
    for (const line of (await r.text()).split("\n")) {
      const m = SAMPLE.exec(line);
      if (!m) continue;
      const labels = {};
      for (const l of m[2].matchAll(LABEL)) labels[l[1]] = l[2];
      if (labels.pool === undefined || labels.worker !== undefined) continue;
      const pool = (out[labels.pool] = out[labels.pool] || {});
      const key = labels.kind ? `${m[1]}:${labels.kind}` : labels.state ? `${m[1]}:${labels.state}` : m[1];
      pool[key] = Number(m[3]);
    }
    return out;
  }

  // -- the loop -----------------------------------------------------------------------------------------------------
  function schedule(ms) {
    clearTimeout(S.timer);
    S.timer = setTimeout(poll, ms);
  }

  async function poll() {
    if (!S.token) return;
    try {
      const slow = S.tick % SLOW_EVERY === 0;
      const [status, gauges, devices, rules] = await Promise.all([
        api("/v1/status"),
        headline(),
        slow ? api("/v1/devices") : null,
        slow ? api("/v1/policies") : null,
      ]);
      if (devices) S.devices = devices.items;
      if (rules) S.rules = rules;
      await newEvents(status.server_time);
      S.tick++;
      render(status, gauges);
      setConn("live", `live · ${clock(status.server_time)}`);
    } catch (err) {
      if (err instanceof Refused) {
        showLogin(`The control plane refused this token: ${err.message}`);
        return;
      }
      setConn("stale", `stale · ${err.message}`);
    }
    schedule(POLL_MS);
  }

  // -- rendering ----------------------------------------------------------------------------------------------------
  function render(status, gauges) {
    const active = status.workers.filter((w) => w.state === "active").length;
    $("summary").textContent =
      `${status.pools.length} pools · ${active}/${status.workers.length} workers active · ` +
      `${status.heartbeats} heartbeats · up ${fmt(status.uptime_s / 60, 1)} min`;
    renderPools(status.pools, gauges);
    renderWorkers(status.workers);
    renderEvents();
    if (S.devices) renderDevices(S.devices);
  }

  function replaceBody(table, rows) {
    const body = $(table).tBodies[0];
    // Each cell names its column: the narrow layout shows rows as cards, with the header hidden.
    const labels = [...$(table).tHead.rows[0].cells].map((c) => c.textContent);
    for (const row of rows) [...row.cells].forEach((c, i) => c.setAttribute("data-label", labels[i] || ""));
    body.replaceChildren(...rows);
    if (!rows.length) {
      const cols = $(table).tHead.rows[0].cells.length;
      body.append(el("tr", {}, el("td", { colspan: cols, class: "muted" }, "none")));
    }
  }

  function renderPools(pools, gauges) {
    replaceBody(
      "pools",
      pools.map((p) => {
        const g = gauges[p.name] || {};
        const mem = p.memory || {};
        const sync = g.dsec_gradient_sync_success_rate;
        const melt = g.dsec_melt_down_count ?? p.meltdowns;
        const workers = p.workers || {};
        return el(
          "tr",
          { "data-pool": p.name, class: melt > 0 || p.sync_slowdown ? "trouble" : "" },
          el("td", { class: "mono" }, p.name),
          el("td", {}, `${workers.active || 0} active`, workers.lost ? badge(`${workers.lost} lost`, "bad") : null),
          el("td", { class: "num" }, pct(g.dsec_sandbox_utilization_rate, 1)),
          el("td", { class: `num ${isNum(sync) && sync < 0.9995 ? "bad" : ""}` }, pct(sync)),
          el("td", { class: "num" }, fmt(g.dsec_snapshot_recovery_time)),
          el("td", { class: `num ${melt > 0 ? "bad" : ""}` }, fmt(melt, 0)),
          el("td", { class: "num" }, `${fmt(p.thresholds.latency_cap_ms)} ms`),
          el("td", { class: "num" }, `${fmt(p.thresholds.bandwidth_cap_mbps)} Mb/s`),
          el("td", { class: "num" }, `${fmt(mem.used_gb)} / ${fmt(mem.granted_gb)} / ${fmt(mem.capacity_gb)} GB`),
          el("td", { class: "num" }, p.directives_pending, p.sync_slowdown ? badge("slowdown", "warn") : null),
        );
      }),
    );
  }

  const latencyOf = (m) => (isNum(m.sync_cost_ms_p50) ? m.sync_cost_ms_p50 : m.sync_latency_ms_p50);

  function remember(w) {
    let h = S.history.get(w.id);
    if (!h) S.history.set(w.id, (h = []));
    if (h.length && h[h.length - 1].beat === w.last_seq) return h;
    h.push({ beat: w.last_seq, lat: latencyOf(w.metrics), cap: w.caps.latency_ms, ret: w.metrics.episode_return_mean });
    if (h.length > HISTORY) h.splice(0, h.length - HISTORY);
    return h;
  }

  function sparkline(points, key, cap, label, unit) {
    const W = 120;
    const H = 28;
    const vals = points.map((p) => p[key]).filter(isNum);
    const caps = cap ? points.map((p) => p.cap).filter(isNum) : [];
    const s = svg("svg", { class: "spark", width: W, height: H, viewBox: `0 0 ${W} ${H}`, role: "img" });
    const last = vals.length ? vals[vals.length - 1] : null;
    const capNow = caps.length ? caps[caps.length - 1] : null;
    const t = svg("title");
    t.textContent = `${label}: ${fmt(last)}${unit}` + (capNow !== null ? ` (cap ${fmt(capNow)}${unit})` : "");
    s.append(t);
    if (!vals.length) return el("span", { class: "muted" }, "–");
    let lo = Math.min(...vals, ...(cap ? [0] : []));
    let hi = Math.max(...vals, ...caps);
    if (hi === lo) {
      hi += 1;
      lo -= cap ? 0 : 1;
    }
    const y = (v) => H - 2 - ((v - lo) / (hi - lo)) * (H - 4);
    // Newest point at the right edge; the line fills the width once SPARK_MIN points are in.
    const slots = Math.max(points.length, SPARK_MIN);
    const x = (i, n) => 2 + ((slots - n + i) * (W - 4)) / (slots - 1);
    if (capNow !== null) s.append(svg("line", { class: "cap", x1: 0, x2: W, y1: y(capNow), y2: y(capNow) }));
    const pts = [];
    points.forEach((p, i) => {
      if (isNum(p[key])) pts.push(`${x(i, points.length).toFixed(1)},${y(p[key]).toFixed(1)}`);
    });
    s.append(svg("polyline", { class: "v", points: pts.join(" ") }));
    return el("span", { class: "spark-cell" }, s, el("span", { class: "muted" }, ` ${fmt(last, 1)}${unit}`));
  }

  const PHASE_CLASS = { closed: "ok", open: "bad", half_open: "warn" };
  function trouble(w) {
    return (w.state === "lost" ? 100 : 0) + (w.breaker.level || 0) * 10 + (w.breaker.phase !== "closed" ? 5 : 0) +
      (w.directive.in_sync ? 0 : 1) + (w.fleet_outlier.length ? 2 : 0);
  }

  function features(m, w) {
    const parts = [];
    const add = (name, v, unit = "") => isNum(v) && parts.push(`${name} ${fmt(v)}${unit}`);
    add("sync p95", m.sync_latency_ms_p95, " ms");
    add("p99", m.sync_latency_ms_p99, " ms");
    add("len cv", m.episode_length_cv);
    add("reward var shift", m.reward_variance_shift);
    add("grad-norm slope", m.grad_norm_slope);
    if (isNum(m.memory_used_gb)) {
      const quota = w.directive.desired.memory_quota_gb;
      parts.push(`mem ${fmt(m.memory_used_gb)}${isNum(quota) ? ` / ${fmt(quota)}` : ""} GB`);
    }
    if (w.fleet_outlier.length) parts.push(`fleet outlier: ${w.fleet_outlier.join(", ")}`);
    return parts.join(" · ") || "–";
  }

  function directiveCell(d) {
    const want = d.desired;
    const knobs = [];
    if (want.compression_bits) knobs.push(`${want.compression_bits}-bit`);
    if (want.grad_accum_steps > 1) knobs.push(`accum ×${want.grad_accum_steps}`);
    if (want.async_sampling === false) knobs.push("sampling paused");
    if (want.precision && want.precision !== "fp32") knobs.push(want.precision);
    return el(
      "td",
      {},
      `v${d.desired_version} / v${d.acked_version ?? "–"} `,
      d.in_sync ? badge("acked", "ok") : badge("pending", "warn"),
      knobs.length ? el("div", { class: "muted" }, knobs.join(", ")) : null,
    );
  }

  function renderWorkers(workers) {
    const seen = new Set();
    const rows = workers
      .map((w) => {
        seen.add(w.id);
        return { w, h: remember(w), t: trouble(w) };
      })
      .sort((a, b) => b.t - a.t || a.w.pool.localeCompare(b.w.pool) || a.w.rank - b.w.rank)
      .map(({ w, h }) => {
        const b = w.breaker;
        const stateCls = { active: "ok", lost: "bad" }[w.state] || "muted";
        return el(
          "tr",
          {
            "data-worker": w.id,
            "data-level": b.level,
            "data-phase": b.phase,
            class: b.level > 0 || w.state === "lost" ? "trouble" : "",
          },
          el("td", { class: "mono", title: `${w.host || ""} pid ${w.pid}` }, w.id),
          el("td", { class: "mono" }, w.pool),
          el("td", {}, w.role),
          el("td", { class: "num" }, `${w.group}/${w.rank}`),
          el("td", {}, badge(w.state, stateCls)),
          el(
            "td",
            {},
            badge(`L${b.level} ${b.phase.replace("_", "-")}`, b.level > 0 ? "bad" : PHASE_CLASS[b.phase], {
              class: `badge breaker ${b.level > 0 ? "bad" : PHASE_CLASS[b.phase] || "muted"}`,
            }),
            b.causes && b.causes.length ? el("div", { class: "muted" }, b.causes.join(", ")) : null,
          ),
          directiveCell(w.directive),
          el("td", { class: "features" }, features(w.metrics, w)),
          el("td", {}, sparkline(h, "lat", true, "sync latency", " ms")),
          el("td", {}, sparkline(h, "ret", false, "episode return", "")),
        );
      });
    for (const id of S.history.keys()) if (!seen.has(id)) S.history.delete(id);
    replaceBody("workers", rows);
  }

  // -- events -------------------------------------------------------------------------------------------------------
  const TYPE_CLASS = {
    meltdown: "bad", lost: "bad", alert: "bad", anomaly: "warn", breaker: "warn", recovered: "ok",
    rejoined: "ok", registered: "info", policy_action: "info", recovery: "info", restore: "info",
    snapshot: "muted", webhook: "info", device: "warn",
  };
  const QUIET = new Set(["directive_acked", "log", "snapshot"]); // acks, logs and periodic snapshots: not in the timeline

  function seconds(d) {
    return Object.entries(d)
      .filter(([k, v]) => k.endsWith("_s") && isNum(v))
      .map(([k, v]) => `${k.slice(0, -2)} ${fmt(v, 3)} s`)
      .join(", ");
  }

  function compact(v) {
    if (v === null || typeof v !== "object") return String(v);
    return Object.entries(v)
      .map(([k, x]) => `${k} ${x !== null && typeof x === "object" ? JSON.stringify(x) : isNum(x) ? fmt(x) : x}`)
      .join("; ");
  }

  function describe(e) {
    const d = e.data || {};
    switch (e.type) {
      case "meltdown":
      case "breaker":
      case "recovered": {
        const over = d.evidence && d.evidence.over ? Object.keys(d.evidence.over).join(", ") : "";
        const moved = isNum(d.level_from) && d.level_from !== d.level_to;
        const lv = isNum(d.level_from) ? (moved ? ` L${d.level_from}→L${d.level_to}` : ` at L${d.level_to}`) : "";
        const what = d.action && d.action !== "none" ? d.action : d.trigger || e.type;
        return `${what}${lv}${d.from && d.to && d.from !== d.to ? ` (${d.from}→${d.to})` : ""}` +
          `${over ? `, over: ${over}` : ""}`;
      }
      case "alert":
        return `${d.severity || ""} ${d.name || ""}: ${d.summary || ""}`.trim();
      case "policy_action":
        return (
          `rule ${d.rule} ${d.outcome}: ${d.knob} of ${d.scope} ${fmt(d.old)} → ${fmt(d.new)}` +
          (d.evidence ? ` because ${compact(d.evidence)}` : "") +
          (d.detail ? ` (${d.detail})` : "")
        );
      case "policy":
        return `rule ${d.rule} ${d.phase} on ${d.scope}${isNum(d.value) ? ` (value ${fmt(d.value)})` : ""}`;
      case "webhook":
        return `delivery ${d.delivery} to ${d.runtime}: ${d.status} after ${d.attempts} attempt(s)` +
          (d.last && d.last.status_code ? ` (HTTP ${d.last.status_code})` : "");
      case "recovery":
        return `${d.job ? `job ${d.job} ` : ""}${d.mode ? `${d.mode} ` : ""}${seconds(d) || JSON.stringify(d)}`;
      case "snapshot":
      case "restore": {
        const parts = [d.status, d.step !== undefined ? `step ${d.step}` : null, d.kind, d.mode,
          isNum(d.bytes) ? bytes(d.bytes) : null, seconds(d)];
        return parts.filter((p) => p !== undefined && p !== null && p !== "").join(" · ") || JSON.stringify(d);
      }
      case "directive_set": {
        const changes = Object.entries(d.changes || {}).map(([k, v]) => `${k}=${v}`).join(", ");
        return `v${d.version ?? "?"} by ${d.by || "?"}: ${changes}`;
      }
      case "pool_changed": {
        if (d.deleted) return `deleted by ${d.by || "?"}`;
        const spec = d.spec || {};
        const th = spec.thresholds || {};
        return `${d.created ? "created" : "changed"} by ${d.by || "?"}: latency cap ${fmt(th.latency_cap_ms)} ms, ` +
          `bandwidth cap ${fmt(th.bandwidth_cap_mbps)} Mb/s, gpu quota ${spec.gpu_quota ?? "–"}`;
      }
      case "registered":
        return `${d.role || ""} ${d.group || ""}/${d.rank ?? ""}${d.host ? ` on ${d.host}` : ""}`.trim();
      default: {
        const text = d.reason || d.message || d.summary || (Object.keys(d).length ? JSON.stringify(d) : "");
        return String(text).slice(0, 300);
      }
    }
  }

  function eventItem(e) {
    const who = e.worker_id || e.pool || "";
    return el(
      "li",
      { "data-type": e.type, "data-id": e.id },
      el("span", { class: "muted mono" }, clock(e.ts)),
      el("span", {}, badge(e.type, TYPE_CLASS[e.type] || "muted")),
      el("span", { class: "text" }, who ? el("span", { class: "mono muted" }, `${who} `) : null, describe(e)),
    );
  }

  function fill(id, events, max) {
    const items = events.slice(-max).reverse().map(eventItem);
    $(id).replaceChildren(...(items.length ? items : [el("li", { class: "empty" }, "none yet")]));
  }

  function renderEvents() {
    const ev = S.events;
    fill("timeline", ev.filter((e) => !QUIET.has(e.type)), 150);
    fill("recoveries", ev.filter((e) => ["snapshot", "restore", "recovery", "heal"].includes(e.type)), 40);
    const rules = S.rules && S.rules.rules ? S.rules.rules.length : null;
    fill("policy-actions", ev.filter((e) => e.type === "policy_action"), 40);
    if (rules !== null) $("policy-actions").prepend(el("li", { class: "empty" }, `${rules} rule(s) in force`));
    fill("webhooks", ev.filter((e) => e.type === "webhook"), 40);
  }

  const HEALTH_CLASS = { healthy: "ok", degraded: "bad", drained: "muted", probation: "warn" };
  function renderDevices(devices) {
    replaceBody(
      "devices",
      devices.map((d) =>
        el(
          "tr",
          { "data-device": d.id, class: d.health === "healthy" ? "" : "trouble" },
          el("td", { class: "mono" }, d.id),
          el("td", { class: "mono" }, d.node),
          el("td", {}, d.model),
          el("td", { class: "mono" }, d.pool || "–"),
          el("td", {}, badge(d.health, HEALTH_CLASS[d.health])),
          el("td", { class: "num" }, fmt(d.memory_gb, 0)),
          el("td", { class: "num" }, d.numa_node < 0 ? "–" : d.numa_node),
          el("td", { class: "mono" }, d.nvlink_peers.join(", ") || "–"),
        ),
      ),
    );
  }

  // -- start --------------------------------------------------------------------------------------------------------
  function start() {
    $("login-form").addEventListener("submit", (ev) => {
      ev.preventDefault();
      const input = $("token");
      if (useToken(input.value)) input.value = "";
    });
    $("logout").addEventListener("click", () => showLogin(""));
    const token = tokenFromHash() || sessionStorage.getItem(TOKEN_KEY);
    if (!token || !useToken(token)) {
      if ($("login").hidden) showLogin("");
    }
  }

  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", start);
  else start();
})();
