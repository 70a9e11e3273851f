// DSec dashboard: the simulator's latest plots, as `dsec simulate` published them (GET /dashboard/plots). Each plot is
// fetched with the page's read-only token and shown from memory (a blob: URL), so no plot is readable without one.
// The token is the one app.js keeps in this tab; nothing is fetched before the board shows (a token was accepted).
// Text from the server (scenario names) is only ever set as textContent.
"use strict";

(() => {
  const TICK_MS = 2000; // how often the board's state is looked at
  const REFRESH_MS = 10000; // how often the listing is fetched once shown
  const TOKEN_KEY = "dsec.readToken";

  const S = { key: null, urls: [], last: 0, busy: false };
  const $ = (id) => document.getElementById(id);

  function el(tag, attrs, ...children) {
    const e = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, String(v));
    for (const c of children) e.append(c instanceof Node ? c : document.createTextNode(String(c)));
    return e;
  }

  async function get(path, token) {
    const r = await fetch(path, { headers: { Authorization: `Bearer ${token}` }, cache: "no-store" });
    if (!r.ok) throw new Error(`${path}: HTTP ${r.status}`);
    return r;
  }

  function describe(run) {
    if (!run) return "";
    const when = typeof run.published_at === "number" ? new Date(run.published_at * 1000).toLocaleString() : "?";
    return `${run.scenario ?? "?"}: ${run.workers ?? "?"} workers, ${run.simulated_h ?? "?"} simulated hours, ` +
      `seed ${run.seed ?? "?"}; published ${when}`;
  }

  function figure(p, url) {
    return el(
      "figure",
      { "data-plot": p.name },
      el("a", { href: url, target: "_blank", rel: "noopener", title: `open ${p.name}` },
        el("img", { src: url, alt: p.title })),
      el("figcaption", {}, `${p.title} `, el("span", { class: "mono muted" }, p.name)),
    );
  }

  async function show(listing, token) {
    const figures = [];
    const urls = [];
    try {
      for (const p of listing.plots) {
        const r = await get(`/dashboard/plots/${encodeURIComponent(p.name)}`, token);
        const url = URL.createObjectURL(await r.blob());
        urls.push(url);
        figures.push(figure(p, url));
      }
    } catch (err) {
      for (const u of urls) URL.revokeObjectURL(u);
      throw err;
    }
    for (const u of S.urls) URL.revokeObjectURL(u);
    S.urls = urls;
    $("plots-run").textContent = describe(listing.run);
    $("plots").replaceChildren(
      ...(figures.length ? figures : [el("p", { class: "empty muted" },
        "No simulator plots yet: dsec simulate SCENARIO.yaml publishes its plots here " +
        "($DSEC_PLOTS_DIR, else $DSEC_HOME/plots, as this server sees them).")]),
    );
  }

  async function refresh() {
    const token = sessionStorage.getItem(TOKEN_KEY);
    if (!token || $("board").hidden || S.busy) return;
    if (S.key !== null && Date.now() - S.last < REFRESH_MS) return;
    S.busy = true;
    S.last = Date.now();
    try {
      const listing = await (await get("/dashboard/plots", token)).json();
      const key = JSON.stringify([listing.run, listing.plots]);
      if (key !== S.key) {
        await show(listing, token);
        S.key = key;
      }
    } catch (_) {
      // The main loop (app.js) reports the connection and a refused token; try again at the next refresh.
    } finally {
      S.busy = false;
    }
  }

  function start() {
    refresh();
    setInterval(refresh, TICK_MS);
  }

  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", start);
  else start();
})();
