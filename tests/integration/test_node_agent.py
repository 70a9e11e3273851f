"""The node agent (`dsec agent`) between real probes and a real control plane, all on loopback.

Two ``Reporter``s (the probe's own reporter class, unchanged) are pointed at the agent as their endpoint: they
register through it, their beats reach the control plane in batches (the control plane's request counters show
``POST /v1/heartbeats`` and no single beat), directives come back to them through it, and when the control plane
stops the agent answers 503 at once (the reporters keep their directives), holds each worker's newest beat, and
delivers again once a control plane is back on the same address. Every server, agent and reporter a test starts is
stopped by it (conftest's leak checks).
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from conftest import Harness, make_settings, wait_for
from dsec.agent import AgentConfig, AgentThread
from dsec.backoff import Backoff
from dsec.probe.reporter import Reporter, ReporterConfig


def requests_by_route(h: Harness) -> dict[str, float]:
    """POST answers counted by the control plane, per route template (all statuses)."""
    out: dict[str, float] = {}
    pattern = r'dsec_http_requests_total\{method="POST",route="([^"]+)",status="\d+"\} ([0-9.e+]+)'
    for route, n in re.findall(pattern, h.admin.metrics_text()):
        out[route] = out.get(route, 0.0) + float(n)
    return out


@pytest.fixture
def agent_for() -> Iterator[Callable[..., AgentThread]]:
    started: list[AgentThread] = []

    def start(upstream: str, **kw: Any) -> AgentThread:
        kw.setdefault("port", 0)
        kw.setdefault("flush_ms", 100.0)
        kw.setdefault("backoff", Backoff(initial_s=0.05, max_s=0.2))
        transport = kw.pop("transport", None)
        a = AgentThread(AgentConfig(upstream=upstream, **kw), transport=transport)
        started.append(a)
        return a

    yield start
    for a in reversed(started):
        a.close()


@pytest.fixture
def reporters() -> Iterator[list[Reporter]]:
    made: list[Reporter] = []
    yield made
    for r in made:
        r.close()


def probe(endpoint: str, token: str, rank: int, made: list[Reporter]) -> Reporter:
    cfg = ReporterConfig(endpoint=endpoint, pool="pool-a", token=token, rank=rank, heartbeat_interval_s=0.1,
                         max_backoff_s=0.3, request_timeout_s=2.0, close_timeout_s=2.0)  # fmt: skip
    r = Reporter(cfg)
    made.append(r)
    return r.start()


def agent_status(a: AgentThread) -> dict[str, Any]:
    with httpx.Client(base_url=a.url, timeout=5) as http:
        return dict(http.get("/agent/status").json())


def test_probes_report_through_the_agent_in_batches_and_get_their_directives(
    server: Harness, agent_for: Callable[..., AgentThread], reporters: list[Reporter]
) -> None:
    agent = agent_for(server.url, flush_ms=300.0)  # longer than the probes' interval: their beats share batches
    token = server.pool_tokens["pool-a"]
    r0, r1 = probe(agent.url, token, 0, reporters), probe(agent.url, token, 1, reporters)
    wait_for(lambda: r0.beats_ok >= 3 and r1.beats_ok >= 3, what="beats through the agent")
    assert server.admin.worker(r0.worker_id)["host"] == r0.config.host  # registered through the proxy
    # a directive reaches each worker through the agent, and is acked back
    server.admin.set_directive(r0.worker_id, compression_bits=8)
    server.admin.set_directive(r1.worker_id, grad_accum_steps=4)
    wait_for(lambda: r0.directive and r0.directive["compression_bits"] == 8, what="r0's directive")
    wait_for(lambda: r1.directive and r1.directive["grad_accum_steps"] == 4, what="r1's directive")
    wait_for(lambda: server.admin.directive(r0.worker_id)["in_sync"], what="r0's ack")
    wait_for(lambda: server.admin.directive(r1.worker_id)["in_sync"], what="r1's ack")
    # the control plane saw batches, never a single beat; two workers' beats share batches
    routes = requests_by_route(server)
    assert routes.get("/v1/heartbeats", 0) >= 3
    assert routes.get("/v1/workers/{worker_id}/heartbeat", 0) == 0
    shared = wait_for(lambda: (st := agent_status(agent))["beats_forwarded"] > st["batches_sent"] and st,
                      what="two workers' beats in one batch")  # fmt: skip
    assert shared["singles_sent"] == 0 and shared["upstream_up"]
    assert server.admin.worker(r1.worker_id)["last_seq"] >= 3


def test_the_agent_is_fail_static_and_recovers_when_the_control_plane_comes_back(
    server_factory: Callable[..., Harness],
    tmp_path: Path,
    agent_for: Callable[..., AgentThread],
    reporters: list[Reporter],
) -> None:
    settings = make_settings(tmp_path / "cp")
    first = server_factory(settings=settings, pools=True)
    port = first.port
    agent = agent_for(first.url)
    r0 = probe(agent.url, first.pool_tokens["pool-a"], 0, reporters)
    r1 = probe(agent.url, first.pool_tokens["pool-a"], 1, reporters)
    wait_for(lambda: r0.registered and r1.registered, what="registration through the agent")
    first.admin.set_directive(r0.worker_id, compression_bits=4)
    wait_for(lambda: r0.directive and r0.directive["compression_bits"] == 4, what="the directive")
    wait_for(lambda: r1.beats_ok >= 2, what="r1 beating")
    ids = (r0.worker_id, r1.worker_id)

    first.close()  # the control plane goes away
    wait_for(lambda: not agent_status(agent)["upstream_up"], what="the agent noticing")
    failed = (r0.beats_failed, r1.beats_failed)
    wait_for(lambda: r0.beats_failed > failed[0] + 2 and r1.beats_failed > failed[1] + 2, what="beats refused")
    assert r0.directive is not None and r0.directive["compression_bits"] == 4  # kept (fail-static)
    assert agent.server.started and not agent.server.should_exit  # the agent runs on
    st = agent_status(agent)
    assert st["waiting_workers"] <= 2 and st["upstream_failures"] >= 1  # each worker's newest beat, no more

    second = server_factory(settings=settings, port=port)  # same store, same address
    seqs = {w: second.admin.worker(w)["last_seq"] for w in ids}
    wait_for(lambda: all(second.admin.worker(w)["last_seq"] > seqs[w] + 2 for w in ids), timeout=20,
             what="beats through the agent after the restart")  # fmt: skip
    assert (r0.worker_id, r1.worker_id) == ids  # the same workers: no re-registration was needed
    assert agent_status(agent)["upstream_up"]
    second.admin.set_directive(r1.worker_id, precision="bf16")
    wait_for(lambda: r1.directive and r1.directive["precision"] == "bf16", what="a directive after the restart")
    assert requests_by_route(second).get("/v1/workers/{worker_id}/heartbeat", 0) == 0


def test_the_agent_holds_only_each_workers_newest_beat_within_its_bound(
    agent_for: Callable[..., AgentThread],
) -> None:
    """No control plane (a transport that fails, then answers): beats are refused at once, the agent keeps one beat
    per worker and at most max_workers of them, and delivers the newest ones when the control plane answers."""
    up = threading.Event()
    seen: list[dict[str, Any]] = []

    def upstream(request: httpx.Request) -> httpx.Response:
        if not up.is_set():
            raise httpx.ConnectError("refused", request=request)
        import orjson

        items = orjson.loads(request.content)["items"]
        seen.extend(items)
        answers = [{"status": 200, "seq": i["seq"], "duplicate": False, "server_time": 0.0, "directive": None}
                   for i in items]  # fmt: skip
        return httpx.Response(200, json={"items": answers})

    agent = agent_for("http://control-plane.invalid", max_workers=2, transport=httpx.MockTransport(upstream))
    with httpx.Client(base_url=agent.url, timeout=5) as http:

        def beat(worker: str, seq: int) -> httpx.Response:
            return http.post(f"/v1/workers/{worker}/heartbeat", json={"seq": seq},
                             headers={"Authorization": f"Bearer dsw_{worker}"})  # fmt: skip

        first = beat("w-a", 1)
        assert first.status_code == 503 and first.json()["error"] == "unavailable"
        wait_for(lambda: not agent_status(agent)["upstream_up"], what="the agent noticing")
        for worker, seq in (("w-a", 2), ("w-b", 1), ("w-a", 3), ("w-c", 1)):
            resp = beat(worker, seq)
            assert resp.status_code == 503, resp.text  # at once: the probe keeps its directive, resends later
        st = agent_status(agent)
        assert st["waiting_workers"] == 2 and st["evicted"] == 1 and st["replaced"] >= 2
        up.set()
        wait_for(lambda: agent_status(agent)["upstream_up"] and not agent_status(agent)["waiting_workers"],
                 what="the held beats delivered")  # fmt: skip
        assert sorted((i["worker_id"], i["seq"]) for i in seen) == [("w-a", 3), ("w-c", 1)]
        ok = beat("w-b", 2)
        assert ok.status_code == 200 and ok.json() == {"seq": 2, "duplicate": False, "server_time": 0.0,
                                                       "directive": None}  # fmt: skip
        # not a heartbeat: proxied (here to the fake control plane, which only knows batches)
        assert http.get("/agent/status").json()["batches_sent"] >= 2


def test_dsec_agent_runs_from_the_command_line(server: Harness, tmp_path: Path) -> None:
    import subprocess
    import sys

    from typer.testing import CliRunner

    from dsec.cli import app
    from dsec.control.server import free_port

    bad = CliRunner().invoke(app, ["agent", "--max-batch", "5000"])
    assert bad.exit_code == 2 and "max_batch=5000" in bad.output
    port = free_port()
    sock = str(tmp_path / "agent.sock")
    cmd = [sys.executable, "-m", "dsec.cli", "agent", "--upstream", server.url, "--port", str(port), "--uds", sock,
           "--log-level", "warning"]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        w = server.register("pool-a")

        def beat(http: httpx.Client, seq: int) -> int:
            resp = http.post(f"/v1/workers/{w.id}/heartbeat", json={"seq": seq},
                             headers={"Authorization": f"Bearer {w.token}"})  # fmt: skip
            return resp.status_code

        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=5) as http:
            wait_for(lambda: _answers(http), what="dsec agent listening")
            assert beat(http, 1) == 200
        with httpx.Client(base_url="http://agent", transport=httpx.HTTPTransport(uds=sock), timeout=5) as http:
            assert beat(http, 2) == 200  # the unix socket speaks the same protocol
        assert server.admin.worker(w.id)["last_seq"] == 2
    finally:
        proc.terminate()
        proc.wait(timeout=15)


def _answers(http: httpx.Client) -> bool:
    try:
        return http.get("/agent/status").status_code == 200
    except httpx.TransportError:
        return False
