"""The web dashboard (``GET /``) in a real headless Chromium (Debian's ``chromium``, driven by Playwright through
``executable_path``; scripts/fetch-chromium.sh installs it): the page loads against a real control plane with
workers beating over HTTP, shows them, updates live (no reload) when a worker's breaker opens, and logs no console
error; it takes a read-only token and refuses an admin one. Screenshots at a desktop and a narrow width are written
to ``build/screenshots/`` (or ``$DSEC_SCREENSHOT_DIR``) and the test prints where."""

from __future__ import annotations

import os
import shutil
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from conftest import ADMIN_TOKEN, Harness, make_settings
from dsec.breaker import BreakerConfig
from dsec.client import Client
from dsec.control.judge import JudgeConfig

REPO = Path(__file__).resolve().parents[2]
# Read at import: the autouse _clean_environ fixture hides DSEC_* variables from the tests themselves.
SCREENSHOTS = Path(os.environ.get("DSEC_SCREENSHOT_DIR") or REPO / "build" / "screenshots")
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
# A rule that tightens the pool's latency cap after a meltdown: its action shows in the page with its audit text.
POLICY = """
policies:
  - name: tighten-latency-cap-on-meltdown
    when: dsec_melt_down_count > 0
    scope: {pools: ["pool-a"]}
    then:
      - knob: latency_cap_ms
        by: -10
    bounds:
      latency_cap_ms: {min: 60}
    cooldown: 1h
"""
FAST_BREAKER = BreakerConfig(window_s=1.0, min_samples=3, recovery_s=30.0, max_recovery_s=60.0)

sync_api = pytest.importorskip("playwright.sync_api", reason="playwright not installed (the dev extra installs it)")
if CHROMIUM is None:
    pytest.skip(
        "chromium not installed (scripts/fetch-chromium.sh installs Debian's package with apt-get as root)",
        allow_module_level=True,
    )


class Beats:
    """Workers' side of the protocol on a thread: a heartbeat per worker every 0.1 s with its own token, acking
    every directive it gets (as the probe does). ``slow(worker_id)`` makes that worker report 200 ms of sync cost."""

    def __init__(self, h: Harness, workers: list[dict[str, Any]]) -> None:
        self.workers = workers
        self.clients = {w["worker_id"]: h.client(w["worker_token"]) for w in workers}
        self.acked = {w["worker_id"]: int(w["directive"]["version"]) for w in workers}
        self.seq = dict.fromkeys(self.acked, 0)
        self.slow_ids: set[str] = set()
        self.errors: list[BaseException] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="dsec-test-beats", daemon=True)

    def slow(self, worker_id: str) -> None:
        self.slow_ids.add(worker_id)

    def metrics(self, worker_id: str, i: int) -> dict[str, float]:
        cost = 200.0 if worker_id in self.slow_ids else 8.0 + (i % 5)
        ops = 20.0 * i
        return {
            "sync_cost_ms_p50": cost,
            "sync_latency_ms_p50": cost + 4.0,
            "sync_latency_ms_p95": cost + 9.0,
            "sync_latency_ms_p99": cost + 12.0,
            "sync_ops_total": ops,
            "sync_ok_total": ops - (i // 10 if worker_id in self.slow_ids else 0),
            "episode_return_mean": 20.0 + 1.5 * i + (i % 3),
            "episode_length_cv": 0.12,
            "grad_norm_slope": -0.01,
            "memory_used_gb": 2.5,
        }

    def events(self, seq: int) -> list[dict[str, Any]]:
        """A restore at the start and a snapshot now and then, as the probe reports them."""
        if seq == 1:
            return [{"type": "restore", "data": {"status": "ok", "step": 0, "restore_s": 0.42}}]
        if seq % 40 == 0:
            return [{"type": "snapshot", "data": {"status": "ok", "step": seq, "blocking_s": 0.004, "write_s": 0.05}}]
        return []

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                for wid, client in self.clients.items():
                    self.seq[wid] += 1
                    answer = client.heartbeat(
                        wid,
                        self.seq[wid],
                        acked_directive_version=self.acked[wid],
                        metrics=self.metrics(wid, self.seq[wid]),
                        events=self.events(self.seq[wid]),
                    )
                    if answer.get("directive"):
                        self.acked[wid] = int(answer["directive"]["version"])
            except BaseException as exc:  # surfaced by close()
                self.errors.append(exc)
                return
            self._stop.wait(0.1)

    def __enter__(self) -> Beats:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)
        assert not self._thread.is_alive()
        assert not self.errors, self.errors


@pytest.fixture
def cp(server_factory: Callable[..., Harness], tmp_path: Path) -> Harness:
    settings = make_settings(tmp_path / "cp", judge=JudgeConfig(breaker=FAST_BREAKER), policy_interval_s=0.25)
    h: Harness = server_factory(settings=settings)
    h.create_pools()
    h.admin.request("PUT", "/v1/policies", json={"text": POLICY, "source": "dashboard-test.yaml"})
    for i, health in enumerate(("healthy", "probation")):
        body = {"id": f"gpu-{i}", "node": "node-0", "model": "A100-80GB", "memory_gb": 80, "numa_node": i,
                "nvlink_peers": [f"gpu-{1 - i}"], "health": health, "pool": "pool-a"}  # fmt: skip
        h.admin.request("PUT", f"/v1/devices/gpu-{i}", json=body)
    return h


@pytest.fixture
def browser() -> Iterator[Any]:
    pw = sync_api.sync_playwright().start()
    try:
        b = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox", "--disable-gpu"])
        try:
            yield b
        finally:
            b.close()
    finally:
        pw.stop()


class Console:
    """Every console error and uncaught page error of a page."""

    def __init__(self, page: Any) -> None:
        self.errors: list[str] = []
        page.on("console", lambda m: self.errors.append(f"console {m.type}: {m.text}") if m.type == "error" else None)
        page.on("pageerror", lambda e: self.errors.append(f"pageerror: {e}"))


def _register(h: Harness, rank: int) -> dict[str, Any]:
    return h.admin.register(
        "pool-a", token=h.pool_tokens["pool-a"], role="learner", rank=rank, heartbeat_interval_s=0.2
    )


def test_dashboard_shows_workers_and_updates_live_when_a_breaker_opens(cp: Harness, browser: Any) -> None:
    read_token = cp.admin.create_token(kind="read", label="dashboard test")
    workers = [_register(cp, 0), _register(cp, 1)]
    slow_id = workers[1]["worker_id"]
    with Beats(cp, workers) as beats:
        page = browser.new_page(viewport={"width": 1440, "height": 1000})
        console = Console(page)
        page.goto(f"{cp.url}/#token={read_token}")
        for w in workers:
            page.wait_for_selector(f'tr[data-worker="{w["worker_id"]}"][data-level="0"]', timeout=10_000)
        page.wait_for_selector('#conn[data-state="live"]', timeout=5_000)
        assert "token" not in page.url, "the token must leave the address bar"
        assert page.evaluate("sessionStorage.getItem('dsec.readToken')") == read_token
        # Pools with the headline gauges from /metrics; sparklines drawn once a few beats came in.
        page.wait_for_selector('#pools tr[data-pool="pool-a"]')
        page.wait_for_function(
            "() => document.querySelectorAll('tr[data-worker] svg.spark polyline').length >= 4"
            " && [...document.querySelectorAll('svg.spark polyline')]"
            ".every(p => p.getAttribute('points').split(' ').length >= 3)",
            timeout=10_000,
        )
        assert "100.00%" in page.inner_text('#pools tr[data-pool="pool-a"]')  # sync success of healthy workers
        assert page.inner_text(f'tr[data-worker="{slow_id}"]').count("learner") == 1

        page.evaluate("window.__sameDocument = true")  # gone if the page reloads
        beats.slow(slow_id)
        page.wait_for_selector(f'tr[data-worker="{slow_id}"]:not([data-level="0"])', timeout=15_000)
        page.wait_for_selector('#timeline li[data-type="meltdown"]', timeout=5_000)
        assert page.evaluate("window.__sameDocument === true"), "the page reloaded instead of updating"
        row = page.inner_text(f'tr[data-worker="{slow_id}"]')
        assert "4-bit" in row, row  # the desired directive of level 1
        assert page.get_attribute(f'tr[data-worker="{workers[0]["worker_id"]}"]', "data-level") == "0"
        # The troubled worker is listed first.
        assert page.get_attribute("#workers tbody tr:first-child", "data-worker") == slow_id
        assert "meltdown" in page.inner_text("#timeline")
        assert "probation" in page.inner_text('#devices tr[data-device="gpu-1"]')
        page.wait_for_selector('#policy-actions li[data-type="policy_action"]', timeout=10_000)
        assert "latency_cap_ms" in page.inner_text("#policy-actions")
        assert "restore" in page.inner_text("#recoveries")
        page.wait_for_timeout(1500)  # a few more polls: the sparkline shows the latency over the cap

        SCREENSHOTS.mkdir(parents=True, exist_ok=True)
        desktop = SCREENSHOTS / "dashboard-desktop.png"
        page.screenshot(path=str(desktop), full_page=True)
        page.set_viewport_size({"width": 390, "height": 844})
        page.wait_for_timeout(300)
        overflow = page.evaluate("document.documentElement.scrollWidth - window.innerWidth")
        assert overflow <= 1, f"the narrow layout scrolls sideways by {overflow} px"
        narrow = SCREENSHOTS / "dashboard-narrow.png"
        page.screenshot(path=str(narrow), full_page=True)
        page.close()
    assert desktop.stat().st_size > 10_000 and narrow.stat().st_size > 10_000
    print(f"\ndashboard screenshots: {desktop} {narrow}")
    assert console.errors == []


def test_dashboard_asks_for_a_read_only_token_and_refuses_an_admin_one(cp: Harness, browser: Any) -> None:
    read_token = cp.admin.create_token(kind="read")
    page = browser.new_page()
    console = Console(page)
    page.goto(cp.url + "/")
    page.wait_for_selector("#login-form", state="visible")
    assert page.is_hidden("#board")
    page.fill("#token", ADMIN_TOKEN)
    page.click("#login-form button")
    assert "admin token" in page.inner_text("#login-error")
    assert page.is_hidden("#board")
    page.fill("#token", read_token)
    page.click("#login-form button")
    page.wait_for_selector('#conn[data-state="live"]', timeout=5_000)
    page.wait_for_selector('#pools tr[data-pool="pool-b"]')
    page.close()
    assert console.errors == []


def test_the_page_holds_no_secret_and_forbids_framing_and_inline_script(cp: Harness) -> None:
    with httpx.Client(base_url=cp.url) as http:
        page = http.get("/")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert ADMIN_TOKEN not in page.text and "dsa_" not in page.text
        csp = page.headers["content-security-policy"]
        assert "script-src 'self'" in csp and "frame-ancestors 'none'" in csp
        for name, kind in (("app.js", "text/javascript"), ("style.css", "text/css")):
            r = http.get(f"/dashboard/{name}")
            assert r.status_code == 200 and r.headers["content-type"].startswith(kind)
            assert ADMIN_TOKEN not in r.text
        assert http.get("/dashboard/../control/app.py").status_code == 404
        assert http.get("/dashboard/nothing.js").status_code == 404
        # Not part of the API contract.
        paths = http.get("/openapi.json").json()["paths"]
        assert "/" not in paths and not any(p.startswith("/dashboard") for p in paths)
    with Client(cp.url) as anonymous:
        assert anonymous.metrics_text().startswith("#")  # the page's headline gauges need no token


def test_dashboard_shows_the_simulators_latest_plots(cp: Harness, browser: Any, tmp_path: Path) -> None:
    from dsec import plots
    from dsec.sim.svg import Series, line_chart

    report = tmp_path / "report"
    report.mkdir()
    chart = line_chart("demo: goodput over time", "simulated hours", "useful steps/s", [
        Series("tuned baseline", "#1f77b4", [(0, 10), (1, 8), (2, 9)]),
        Series("DSec", "#d62728", [(0, 10), (1, 10), (2, 9.5)]),
    ])  # fmt: skip
    (report / "goodput.svg").write_text(chart)
    plots.publish(report, cp.settings.plots, {"scenario": "demo", "seed": 1, "simulated_h": 2, "workers": 8})
    read_token = cp.admin.create_token(kind="read")
    page = browser.new_page(viewport={"width": 1440, "height": 1000})
    console = Console(page)
    page.goto(f"{cp.url}/#token={read_token}")
    img = '#plots figure[data-plot="goodput.svg"] img'
    page.wait_for_function(f"() => document.querySelector('{img}')?.naturalWidth > 0", timeout=10_000)
    assert page.get_attribute('#plots figure[data-plot="goodput.svg"] a', "href").startswith("blob:")
    assert "demo: 8 workers, 2 simulated hours, seed 1" in page.inner_text("#plots-run")
    assert "goodput over time" in page.inner_text("#plots")
    page.locator("#plots-section").scroll_into_view_if_needed()
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    shot = SCREENSHOTS / "dashboard-plots.png"
    page.locator("#plots-section").screenshot(path=str(shot))
    page.close()
    print(f"\ndashboard plots screenshot: {shot}")
    assert console.errors == []
