"""The ``dsec_monitor`` plugin for the Hermes agent framework (hermes-agent), against a real control plane.

Two kinds of test:

* fast ones (default run) drive :class:`dsec.integrations.hermes.HermesMonitor` in this process with the
  keyword arguments Hermes' call sites pass (hermes-agent 0.19: agent/conversation_loop.py,
  agent/turn_context.py, agent/turn_finalizer.py, model_tools.py, run_agent.py);
* slow ones (``-m slow``) install hermes-agent into its own virtualenv (``.cache/hermes-venv``, reused
  while it works; hermes-agent pins many exact versions, so never into the project's .venv), let
  Hermes' own loader (``hermes_cli.plugins``) find the plugin through the ``hermes_agent.plugins`` entry
  point, and run a real ``AIAgent`` against a scripted OpenAI-compatible server standing in for the LLM:
  every hook fires from Hermes' own code. They skip, with pip's error, when hermes-agent cannot be
  installed (no network, no wheel for this Python, resolver failure).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import math
import os
import shutil
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from conftest import Harness, make_settings, wait_for
from dsec.integrations.hermes import plugin as hermes_plugin
from dsec.integrations.hermes.plugin import EpisodeResult, HermesMonitor, HermesSettings, load_settings
from dsec.probe.reporter import ReporterConfig
from dsec.yamlconf import ConfigError

ROOT = Path(__file__).resolve().parents[2]
HERMES_SPEC = os.environ.get("DSEC_HERMES_AGENT_SPEC", "hermes-agent==0.19.0")
VENV = Path(os.environ.get("DSEC_HERMES_VENV", str(ROOT / ".cache" / "hermes-venv")))
# What dsec.probe.reporter / dsec.probe.config import at runtime (dsec itself goes in with --no-deps).
RUNTIME_DEPS = ("httpx", "pydantic", "pyyaml")


def _harness_file(path: Path, endpoint: str, interval: float = 0.2, extra: str = "") -> Path:
    path.write_text(
        "# harness plugin file\n"
        "plugins:\n"
        "  - name: other_plugin\n"
        "    config: {x: 1}\n"
        "  - name: dsec_monitor\n"
        "    config:\n"
        f'      endpoint: "{endpoint}"\n'
        f"      heartbeat_interval: {interval}\n" + extra
    )
    return path


# ================================================================================================
# Fast: the monitor in this process, with the keyword arguments Hermes passes
# ================================================================================================
def test_settings_from_the_harness_file_and_the_environment(tmp_path: Path) -> None:
    cfg = _harness_file(tmp_path / "harness.yaml", "http://127.0.0.1:9", interval=0.5)
    env = {"DSEC_CONFIG": str(cfg), "DSEC_SANDBOX_ID": "pool-a", "DSEC_TOKEN": "dsp_x", "DSEC_STUCK_EPISODES": "2"}
    s = load_settings(env, hermes_home=tmp_path / "nohome")
    assert s is not None
    r = s.reporter
    assert (r.endpoint, r.pool, r.token, r.role, r.group, r.heartbeat_interval_s) == (
        "http://127.0.0.1:9",
        "pool-a",
        "dsp_x",
        "actor",
        "hermes",
        0.5,
    )
    assert s.stuck_episode_threshold == 2 and s.source == str(cfg)

    # The file wins over ambient variables, as with `dsec run --config`.
    env2 = {**env, "DSEC_ENDPOINT": "http://elsewhere:1"}
    s2 = load_settings(env2, hermes_home=tmp_path / "nohome")
    assert s2 is not None and s2.reporter.endpoint == "http://127.0.0.1:9"

    # Without DSEC_CONFIG: $HERMES_HOME/dsec_monitor.yaml, else the environment alone, else off.
    home = tmp_path / "home"
    home.mkdir()
    _harness_file(home / "dsec_monitor.yaml", "http://127.0.0.1:7")
    s3 = load_settings({"DSEC_SANDBOX_ID": "pool-b"}, hermes_home=home)
    assert s3 is not None and (s3.reporter.endpoint, s3.reporter.pool) == ("http://127.0.0.1:7", "pool-b")
    s4 = load_settings({"DSEC_ENDPOINT": "http://h:1", "DSEC_SANDBOX_ID": "p"}, hermes_home=tmp_path / "nohome")
    assert s4 is not None and s4.source == "environment" and s4.reporter.heartbeat_interval_s == 5.0
    assert load_settings({"DSEC_CONFIG": str(cfg)}, hermes_home=tmp_path / "nohome") is None  # no sandbox
    assert load_settings({}, hermes_home=tmp_path / "nohome") is None


def test_an_invalid_harness_file_names_file_line_and_column(tmp_path: Path) -> None:
    cfg = _harness_file(tmp_path / "harness.yaml", "http://127.0.0.1:9", extra="      colour: blue\n")
    with pytest.raises(ConfigError) as err:
        load_settings({"DSEC_CONFIG": str(cfg), "DSEC_SANDBOX_ID": "p"})
    assert f"{cfg}:9:7: plugins[1].config.colour" in str(err.value)


class _Ctx:
    """Hermes' PluginContext as far as register() uses it: register_hook into the manager's table."""

    def __init__(self) -> None:
        self._manager = type("M", (), {"_hooks": {}})()

    def register_hook(self, name: str, callback: Callable[..., Any]) -> None:
        self._manager._hooks.setdefault(name, []).append(callback)

    @property
    def hooks(self) -> dict[str, list[Callable[..., Any]]]:
        return dict(self._manager._hooks)


@pytest.fixture
def fresh_plugin(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """register() keeps one monitor per process: start each test without one and close what it made."""
    monkeypatch.setattr(hermes_plugin, "_monitor", None)
    yield
    m = hermes_plugin.get_monitor()
    if m is not None:
        m.close()


def test_register_without_configuration_registers_nothing(
    fresh_plugin: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("HERMES_HOME", str(tmp_path))
    ctx = _Ctx()
    hermes_plugin.register(ctx)
    assert ctx.hooks == {} and hermes_plugin.get_monitor() is None
    assert "DSec reporting is off" in caplog.text

    # An invalid file: logged with its location, nothing registered, nothing raised.
    cfg = _harness_file(tmp_path / "bad.yaml", "ftp://nope")
    monkeypatch.setenv("DSEC_CONFIG", str(cfg))
    monkeypatch.setenv("DSEC_SANDBOX_ID", "pool-a")
    hermes_plugin.register(ctx)
    assert ctx.hooks == {} and f"{cfg}:7:" in caplog.text


def test_register_twice_keeps_one_monitor_and_one_callback_per_hook(
    fresh_plugin: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DSEC_CONFIG", str(_harness_file(tmp_path / "h.yaml", "http://127.0.0.1:9")))
    monkeypatch.setenv("DSEC_SANDBOX_ID", "pool-a")
    ctx = _Ctx()
    hermes_plugin.register(ctx)  # e.g. entry point ...
    hermes_plugin.register(ctx)  # ... and directory plugin in the same manager
    assert sorted(ctx.hooks) == sorted(HermesMonitor.HOOKS)
    assert all(len(cbs) == 1 for cbs in ctx.hooks.values())
    monitor = hermes_plugin.get_monitor()
    assert monitor is not None and monitor.reporter is None  # nothing registers before the agent runs
    other = _Ctx()  # a rediscovery (fresh manager) gets the same callbacks again
    hermes_plugin.register(other)
    assert hermes_plugin.get_monitor() is monitor
    assert other.hooks["post_tool_call"][0] is ctx.hooks["post_tool_call"][0]


@pytest.fixture
def server(server_factory: Callable[..., Harness], tmp_path: Path) -> Harness:
    """The control plane for the in-process monitor tests, with a liveness window of 20 beats (2 s at 0.1 s).

    The monitor's reporter beats every 0.1 s from a thread of this process, sharing the GIL with the server
    thread; a beat carrying events waits for its group commit, and one slow fsync on a shared CI disk held
    a beat past the default 3 x 0.1 s, so the worker read ``lost`` (a CI failure). These tests are about what
    the monitor reports; liveness has its own tests (test_restart_durability, test_probe_lifecycle).
    """
    return server_factory(settings=make_settings(tmp_path / "home", lost_after_beats=20), pools=True)


def _settings(h: Harness, interval: float = 0.1, stuck: int = 2, abandon_after: float = 600) -> HermesSettings:
    return HermesSettings(
        reporter=ReporterConfig(
            endpoint=h.url,
            pool="pool-a",
            token=h.pool_tokens["pool-a"],
            role="actor",
            group="hermes",
            heartbeat_interval_s=interval,
        ),
        stuck_episode_threshold=stuck,
        abandon_after_s=abandon_after,
    )


class _Run:
    """One agent run, calling the hooks with what Hermes' call sites pass."""

    n = 0

    def __init__(self, hooks: dict[str, Callable[..., Any]], session_id: str = "20260101_000000_abcdef") -> None:
        _Run.n += 1
        self.hooks = hooks
        self.common = {
            "session_id": session_id,
            "task_id": f"task-{_Run.n}",
            "turn_id": f"{session_id}:task-{_Run.n}:0",
            "model": "m",
            "platform": "",
            "telemetry_schema_version": "hermes.observer.v1",
        }
        self.calls = 0

    def start(self, user: str) -> _Run:
        assert self.hooks["pre_llm_call"](**self.common, user_message=user, conversation_history=[]) is None
        return self

    def llm(self, seconds: float = 0.0, error: bool = False) -> _Run:
        self.calls += 1
        rid = f"req-{self.calls}"
        self.hooks["pre_api_request"](**self.common, api_request_id=rid, api_call_count=self.calls)
        time.sleep(seconds)
        if error:
            self.hooks["api_request_error"](**self.common, api_request_id=rid, api_duration=seconds, status_code=500)
        else:
            usage = {"input_tokens": 100, "output_tokens": 10, "prompt_tokens": 100, "total_tokens": 110}
            self.hooks["post_api_request"](**self.common, api_request_id=rid, api_duration=seconds, usage=usage)
        return self

    def tool(self, ok: bool = True) -> _Run:
        status = "ok" if ok else "error"
        self.hooks["post_tool_call"](
            **self.common, tool_name="read_file", args={}, result="{}", duration_ms=12, status=status
        )
        return self

    def end(self, completed: bool = True, interrupted: bool = False, answer: str = "done") -> None:
        if completed:
            self.hooks["post_llm_call"](**self.common, user_message="", assistant_response=answer)
        self.hooks["on_session_end"](**self.common, completed=completed, interrupted=interrupted)


def _worker(h: Harness) -> dict[str, Any]:
    workers = h.admin.workers(pool="pool-a")
    assert len(workers) == 1, workers
    return workers[0]


def _metrics(h: Harness) -> dict[str, Any]:
    """The pool's one worker's latest metrics ({} before it registered)."""
    workers = h.admin.workers(pool="pool-a")
    assert len(workers) <= 1, workers
    return dict(workers[0]["metrics"]) if workers else {}


def test_episodes_latency_tool_failures_and_stuck_alert(server: Harness) -> None:
    scored: list[EpisodeResult] = []

    def scorer(result: EpisodeResult) -> float | None:
        scored.append(result)
        return 0.25 if result.user_message == "graded task" else None

    monitor = HermesMonitor(_settings(server))
    monitor.set_scorer(scorer)
    hooks = monitor.callbacks
    try:
        hooks["on_session_start"](session_id="20260101_000000_abcdef", model="m", platform="")
        _Run(hooks).start("graded task").llm(0.03).tool().llm(0.01).end()  # return 0.25 (scorer)
        _Run(hooks).start("plain task").llm(0.01).tool().llm().end()  # 1.0
        _Run(hooks).start("out of budget").llm().tool().llm().tool().llm().end(completed=False)  # 0.0, truncated
        _Run(hooks).start("broken tool").llm().tool(ok=False).llm().end()  # interrupted 1
        _Run(hooks).start("broken again").llm(error=True).llm().tool(ok=False).llm().end()  # interrupted 2: stuck

        def settled() -> dict[str, Any] | None:
            m = _metrics(server)
            return m if m.get("episodes_total") == 5 and m.get("tool_failures_total") == 2 else None

        m = wait_for(settled, what="five episodes reported")
        assert (m["terminated_total"], m["truncated_total"], m["interrupted_total"]) == (4, 1, 2)
        assert m["consecutive_interrupted"] == 2
        assert m["tool_calls_total"] == 6 and m["llm_calls_total"] == 11 and m["llm_errors_total"] == 1
        assert m["llm_input_tokens_total"] == 1100 and m["llm_output_tokens_total"] == 110
        assert m["llm_call_ms_max"] >= 25  # the 30 ms request, measured between pre and post_api_request
        assert m["tool_call_ms_max"] == 12 and "llm_turn_ms_max" in m
        assert m["async_sampling"] == 1 and m["memory_used_gb"] > 0
        w = _worker(server)
        assert (w["role"], w["group"], w["state"]) == ("actor", "hermes", "active")

        stuck = wait_for(
            lambda: [e for e in server.admin.all_events(worker_id=w["id"], types=["anomaly"])],
            what="episode_stuck anomaly",
        )
        assert [(e["data"]["kind"], e["data"]["reason"], e["data"]["count"]) for e in stuck] == [
            ("episode_stuck", "tool_failure", 2)
        ]
        alerts = wait_for(lambda: server.admin.all_events(worker_id=w["id"], types=["alert"]), what="stuck alert")
        assert alerts[0]["data"]["name"] == "hermes.actor0_episode_stuck_tool_failure_2x"

        assert [(r.user_message, r.completed, r.llm_calls, r.tool_calls, r.tool_failures) for r in scored] == [
            ("graded task", True, 2, 1, 0),
            ("plain task", True, 2, 1, 0),
            ("out of budget", False, 3, 2, 0),
            ("broken tool", True, 2, 1, 1),
            ("broken again", True, 2, 1, 1),
        ]
        assert scored[4].llm_errors == 1 and scored[0].final_response == "done"
    finally:
        monitor.close()
    assert wait_for(lambda: _worker(server)["state"] == "deregistered", what="deregistered on close")


def test_returns_and_lengths_of_one_interval(server: Harness) -> None:
    # A long interval: everything goes out in the final beat at close(), so the interval means are exact.
    monitor = HermesMonitor(_settings(server, interval=60))
    monitor.set_scorer(lambda r: 0.5 if r.user_message == "half" else None)
    hooks = monitor.callbacks
    hooks["on_session_start"](session_id="s1")
    wait_for(lambda: monitor.reporter is not None and monitor.reporter.registered, what="registration")
    _Run(hooks).start("half").llm().end()  # 0.5, length 1
    _Run(hooks).start("ok").llm().tool().llm().llm().end()  # 1.0, length 3
    _Run(hooks).start("fail").llm().llm().end(completed=False)  # 0.0, length 2
    # Hermes returns without on_session_end when the LLM API fails for good: the next run of the same
    # session (or close) reports that run as an unsuccessful episode.
    abandoned = _Run(hooks, session_id="s2").start("api down").llm(error=True).llm(error=True)
    _Run(hooks, session_id="s2").start("next").llm().end()  # 1.0, length 1
    abandoned.end(completed=False)  # a late on_session_end of an abandoned run counts nothing more
    monitor.close()
    m = wait_for(lambda: _worker(server)["state"] == "deregistered" and _metrics(server), what="flush")
    assert m["episodes_total"] == 5 and m["truncated_total"] == 2
    assert math.isclose(m["episode_return_mean"], (0.5 + 1 + 0 + 0 + 1) / 5)
    assert math.isclose(m["episode_length_mean"], (1 + 3 + 2 + 0 + 1) / 5)


def test_a_run_hermes_never_closes_ends_after_the_idle_limit(server: Harness) -> None:
    monitor = HermesMonitor(_settings(server, interval=0.05, abandon_after=0.3))
    try:
        run = _Run(monitor.callbacks).start("left open").llm()
        m = wait_for(lambda: _metrics(server).get("episodes_total") == 1 and _metrics(server))
        assert (m["truncated_total"], m["episodes_active"]) == (1, 0)
        run.tool().end()  # its late hooks count nothing more
        _Run(monitor.callbacks).start("next").llm().end()
        m = wait_for(lambda: _metrics(server).get("episodes_total") == 2 and _metrics(server))
        assert (m["terminated_total"], m["tool_calls_total"]) == (1, 1)
    finally:
        monitor.close()


def test_a_paused_actor_waits_before_its_next_llm_request(server: Harness) -> None:
    monitor = HermesMonitor(_settings(server, interval=0.05))
    hooks = monitor.callbacks
    try:
        run = _Run(hooks).start("task").llm()
        w = wait_for(lambda: server.admin.workers(pool="pool-a"), what="registration")[0]
        server.admin.set_directive(w["id"], async_sampling=False)
        wait_for(lambda: server.admin.directive(w["id"])["in_sync"], what="pause acked")
        done = threading.Event()
        t = threading.Thread(target=lambda: (run.llm(), done.set()), name="test-agent")
        t.start()
        assert not done.wait(0.5), "the LLM request went out while sampling was paused"
        assert wait_for(lambda: _metrics(server).get("async_sampling") == 0, what="paused gauge")
        server.admin.set_directive(w["id"], async_sampling=True)
        assert done.wait(10), "the agent did not resume"
        t.join(5)
        run.end()
    finally:
        monitor.close()


def test_hooks_never_raise(server: Harness, caplog: pytest.LogCaptureFixture) -> None:
    def bad_scorer(result: EpisodeResult) -> float:
        raise RuntimeError("grader crashed")

    monitor = HermesMonitor(_settings(server))
    monitor.set_scorer(bad_scorer)
    hooks = monitor.callbacks
    try:
        # Garbage of every kind in place of Hermes' arguments.
        for cb in hooks.values():
            assert cb() is None
            assert cb(session_id=123, task_id=object(), usage="x", duration_ms="slow", api_duration=math.nan) is None
        hooks["post_tool_call"](task_id="t", status="error", duration_ms=float("inf"))
        hooks["on_session_end"](task_id="t", completed="yes")  # the bad scorer: the default return is used
        assert "grader crashed" in caplog.text
        m = wait_for(lambda: _metrics(server).get("tool_failures_total") == 1 and _metrics(server))
        assert m["episodes_total"] == 3  # twice every hook (a run keyed "default" each time), and run "t"
    finally:
        monitor.close()
    # A hook that fails inside (here: the reporter is gone) logs and returns.
    monitor._reporter = None
    monitor._closed = False
    monitor._reporter_factory = _explode
    assert hooks["post_api_request"](task_id="t2") is None
    assert "post_api_request hook failed" in caplog.text


def _explode(*a: Any, **k: Any) -> Any:
    raise RuntimeError("cannot start")


def test_an_unreachable_control_plane_costs_the_agent_nothing(tmp_path: Path) -> None:
    settings = HermesSettings(
        reporter=ReporterConfig(endpoint="http://127.0.0.1:9", pool="p", heartbeat_interval_s=0.05, close_timeout_s=1)
    )
    monitor = HermesMonitor(settings)
    t0 = time.monotonic()
    for _ in range(50):
        _Run(monitor.callbacks).start("x").llm().tool(ok=False).llm().end()
    assert time.monotonic() - t0 < 2
    monitor.close()


# ================================================================================================
# Slow: hermes-agent in its own virtualenv, its own loader, a real AIAgent run
# ================================================================================================
_CHECK = textwrap.dedent(
    """
    import importlib.metadata as md, json
    out = {"hermes": None, "dsec": None, "eps": []}
    try:
        import hermes_cli.plugins, run_agent
        out["hermes"] = md.version("hermes-agent")
    except Exception:
        pass
    try:
        import dsec, dsec.integrations.hermes
        out["dsec"] = dsec.__file__
        out["eps"] = [e.value for e in md.entry_points(group="hermes_agent.plugins") if e.name == "dsec_monitor"]
    except Exception:
        pass
    print(json.dumps(out))
    """
)


def _tail(text: str, n: int = 25) -> str:
    return "\n".join(text.strip().splitlines()[-n:])


def _check_venv(python: Path) -> tuple[bool, bool]:
    """(hermes usable, dsec installed from this checkout with its entry point)."""
    if not python.exists():
        return False, False
    proc = subprocess.run([str(python), "-c", _CHECK], capture_output=True, text=True, timeout=120, check=False)
    if proc.returncode != 0:
        return False, False
    info = json.loads(proc.stdout.strip().splitlines()[-1])
    wanted = HERMES_SPEC.partition("==")[2]
    hermes_ok = info["hermes"] is not None and (not wanted or info["hermes"] == wanted)
    dsec_ok = (
        info["dsec"] is not None
        and Path(info["dsec"]).resolve().is_relative_to(ROOT / "src")
        and info["eps"] == ["dsec.integrations.hermes"]
    )
    return hermes_ok, dsec_ok


def _run_step(cmd: list[str], what: str, timeout: float) -> None:
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired as exc:
        out = (exc.stdout or b"").decode() if isinstance(exc.stdout, bytes) else exc.stdout or ""
        pytest.skip(f"{what} timed out after {timeout:.0f} s:\n{_tail(out)}")
    if proc.returncode != 0:
        pytest.skip(f"{what} failed (exit {proc.returncode}):\n{_tail(proc.stdout + proc.stderr)}")


@pytest.fixture(scope="session")
def hermes_python() -> Path:
    """The interpreter of a virtualenv with hermes-agent and this checkout of dsec (``--no-deps -e``)."""
    if sys.version_info < (3, 11):
        pytest.skip("hermes-agent needs Python >= 3.11")
    VENV.parent.mkdir(parents=True, exist_ok=True)
    python = VENV / "bin" / "python"
    pip = [str(python), "-m", "pip", "--disable-pip-version-check", "--retries", "1", "--timeout", "30"]
    with open(VENV.parent / ".hermes-venv.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one builder at a time (parallel sessions)
        hermes_ok, dsec_ok = _check_venv(python)
        if not hermes_ok:
            if VENV.exists() and not (VENV / "pyvenv.cfg").exists():
                pytest.skip(f"{VENV} exists and is not a virtualenv: not replacing it")
            shutil.rmtree(VENV, ignore_errors=True)
            _run_step([sys.executable, "-m", "venv", str(VENV)], "creating the virtualenv", 300)
            _run_step([*pip, "install", HERMES_SPEC, *RUNTIME_DEPS], f"pip install {HERMES_SPEC}", 900)
            dsec_ok = False
        if not dsec_ok:
            _run_step([*pip, "install", "--no-deps", "-e", str(ROOT)], "pip install --no-deps -e .", 300)
        hermes_ok, dsec_ok = _check_venv(python)
        if not (hermes_ok and dsec_ok):
            pytest.skip(f"the hermes virtualenv at {VENV} does not work after setup")
    return python


# A scripted OpenAI-compatible chat-completions server standing in for the LLM (streamed or not). The
# task in the first user message decides: read the notes and answer; "BROKEN": read a missing file;
# "LOOP": read forever (the iteration budget ends the run).
FAKE_LLM = r"""
import json, threading, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

NOTES = ""


def user_text(messages):
    for m in messages:
        if m.get("role") == "user":
            c = m.get("content")
            if isinstance(c, list):
                c = " ".join(p.get("text", "") for p in c if isinstance(p, dict))
            return c or ""
    return ""


def answer(body):
    messages = body.get("messages") or []
    task = user_text(messages)
    tools_done = sum(1 for m in messages if m.get("role") == "tool")
    if "LOOP" in task or tools_done == 0:
        path = NOTES + ".missing" if "BROKEN" in task else NOTES
        # A new offset per call: Hermes' read_file blocks a third identical read of an unchanged file.
        args = json.dumps({"path": path, "offset": tools_done + 1})
        call = {"id": f"call_{tools_done}", "type": "function", "function": {"name": "read_file", "arguments": args}}
        return {"role": "assistant", "content": None, "tool_calls": [call]}, "tool_calls"
    return {"role": "assistant", "content": f"Finished: {task[:40]}"}, "stop"


class LLM(BaseHTTPRequestHandler):
    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
        msg, finish = answer(body)
        usage = {"prompt_tokens": 100, "completion_tokens": 10, "total_tokens": 110}
        head = {"id": "chatcmpl-1", "created": int(time.time()), "model": body.get("model", "fake-model")}
        if body.get("stream"):
            delta = {"role": "assistant"}
            if msg.get("content"):
                delta["content"] = msg["content"]
            if msg.get("tool_calls"):
                delta["tool_calls"] = [dict(tc, index=i) for i, tc in enumerate(msg["tool_calls"])]
            first = {"index": 0, "delta": delta, "finish_reason": None}
            last = {"index": 0, "delta": {}, "finish_reason": finish}
            chunks = [
                dict(head, object="chat.completion.chunk", choices=[first]),
                dict(head, object="chat.completion.chunk", choices=[last], usage=usage),
            ]
            data = b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks) + b"data: [DONE]\n\n"
            ctype = "text/event-stream"
        else:
            out = dict(head, object="chat.completion", usage=usage,
                       choices=[{"index": 0, "message": msg, "finish_reason": finish}])
            data, ctype = json.dumps(out).encode(), "application/json"
        self.send_response(200)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):  # model listings / probes Hermes makes for a custom endpoint
        data = json.dumps({"object": "list", "data": [{"id": "fake-model", "object": "model", "owned_by": "t"}]})
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data.encode())

    def log_message(self, *args):
        pass


def start(notes):
    global NOTES
    NOTES = notes
    server = ThreadingHTTPServer(("127.0.0.1", 0), LLM)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, name="test-fake-llm")
    thread.daemon = True
    thread.start()
    return server, f"http://127.0.0.1:{server.server_address[1]}/v1"
"""

# Runs in the hermes virtualenv: Hermes' plugin discovery and real AIAgent runs against the fake LLM.
# Prints one JSON array per line: ("plugins" | "run" | "directory" | "threads", data).
DRIVER = r"""
import json, os, sys, threading, time

import fake_llm

server, url = fake_llm.start(os.environ["TEST_NOTES"])


def emit(kind, data):
    print(json.dumps([kind, data], default=str), flush=True)


# Hermes' own loader: config.yaml enables dsec_monitor; discovery finds it through the entry point.
from hermes_cli import plugins as hermes_plugins

hermes_plugins.discover_plugins()
emit("plugins", [p for p in hermes_plugins.get_plugin_manager().list_plugins() if p["key"] == "dsec_monitor"])

from run_agent import AIAgent
from dsec.integrations.hermes import get_monitor

monitor = get_monitor()


def next_beats(n=2):
    r = monitor.reporter
    target, deadline = r.beats_ok + n, time.monotonic() + 20
    while r.beats_ok < target and time.monotonic() < deadline:
        time.sleep(0.02)


agent = AIAgent(base_url=url, api_key="sk-test", model="fake-model", quiet_mode=True, enabled_toolsets=["file"],
                skip_context_files=True, skip_memory=True, max_iterations=3)
for i, task in enumerate(["Read the notes.", "LOOP: keep reading the notes.", "BROKEN: read the old notes.",
                          "BROKEN: read the old notes again.", "GRADED: read the notes."]):
    if i == 4:
        next_beats()  # the graded run alone in the last interval: its return is the interval's mean
    r = agent.run_conversation(task)
    emit("run", {k: r.get(k) for k in ("completed", "interrupted", "failed", "api_calls", "final_response")})
next_beats()

# The directory form (plugin.yaml + __init__.py) through the loader's directory scan, in a second manager.
import shutil
from pathlib import Path
import dsec.integrations.hermes as pkg

plugins_dir = Path(os.environ["HERMES_HOME"]) / "dir-plugins"
shutil.copytree(Path(pkg.__file__).parent, plugins_dir / "dsec_monitor")
manager = hermes_plugins.PluginManager()
manifests = manager._scan_directory(plugins_dir, source="user")
for manifest in manifests:
    manager._load_plugin(manifest)
emit("directory", {"manifests": [(m.name, m.kind, m.provides_hooks) for m in manifests],
                   "plugins": manager.list_plugins(), "same_monitor": get_monitor() is monitor})
emit("threads", sorted(t.name for t in threading.enumerate() if t.name.startswith("dsec-")))
server.shutdown()
"""

SCORER = """
import json, os

def score(result):
    with open(os.environ["TEST_SCORES"], "a") as f:
        f.write(json.dumps([result.user_message, result.completed, result.llm_calls, result.tool_calls,
                            result.tool_failures, result.ended_by]) + "\\n")
    return 0.25 if result.user_message.startswith("GRADED") else None
"""


def _notes(tmp_path: Path) -> Path:
    notes = tmp_path / "notes.txt"
    notes.write_text("".join(f"The notes say hello ({i}).\n" for i in range(10)))
    return notes


def _hermes_env(h: Harness, home: Path, **extra: str) -> dict[str, str]:
    """The environment of a Hermes process: its own HERMES_HOME, the pool's sandbox id and token."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DSEC_", "HERMES_", "VIRTUAL_ENV", "PYTHON"))}
    env.update(
        HERMES_HOME=str(home),
        DSEC_SANDBOX_ID="pool-a",
        DSEC_TOKEN=h.pool_tokens["pool-a"],
        NO_PROXY="127.0.0.1,localhost",
        no_proxy="127.0.0.1,localhost",
    )
    env.update(extra)
    return env


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_hermes_agent_runs_reported_through_hermes_own_plugin_loader(
    hermes_python: Path, server_factory: Callable[..., Harness], tmp_path: Path
) -> None:
    h = server_factory(pools=True)
    home = tmp_path / "hermes-home"
    home.mkdir()
    (home / "config.yaml").write_text("plugins:\n  enabled: [dsec_monitor]\n")
    harness = _harness_file(tmp_path / "harness.yaml", h.url, interval=0.2)
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "grader.py").write_text(SCORER)
    (tmp_path / "lib" / "fake_llm.py").write_text(FAKE_LLM)
    (tmp_path / "driver.py").write_text(DRIVER)
    env = _hermes_env(
        h,
        home,
        DSEC_CONFIG=str(harness),
        DSEC_STUCK_EPISODES="2",
        DSEC_HERMES_SCORER="grader:score",
        PYTHONPATH=str(tmp_path / "lib"),
        TEST_NOTES=str(_notes(tmp_path)),
        TEST_SCORES=str(tmp_path / "scores.jsonl"),
    )
    t0 = time.monotonic()
    proc = subprocess.run(
        [str(hermes_python), str(tmp_path / "driver.py")],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    elapsed = time.monotonic() - t0
    assert proc.returncode == 0, f"driver failed after {elapsed:.1f} s:\n{_tail(proc.stdout + proc.stderr, 60)}"
    out: dict[str, list[Any]] = {}
    for line in proc.stdout.splitlines():
        with contextlib.suppress(ValueError):
            kind, data = json.loads(line)
            out.setdefault(kind, []).append(data)

    # Hermes loaded the plugin itself, from the entry point, with all its hooks.
    [listing] = out["plugins"]
    assert [(p["key"], p["source"], p["enabled"], p["hooks"], p["error"]) for p in listing] == [
        ("dsec_monitor", "entrypoint", True, len(HermesMonitor.HOOKS), None)
    ]
    runs = out["run"]
    assert [(r["completed"], r["failed"]) for r in runs] == [(True, False), (False, False)] + [(True, False)] * 3

    # The control plane saw one actor worker, its five runs as episodes, LLM latency and tool failures.
    w = _worker(h)
    assert (w["role"], w["group"], w["state"]) == ("actor", "hermes", "deregistered")
    m = w["metrics"]
    assert m["episodes_total"] == 5
    assert (m["terminated_total"], m["truncated_total"], m["interrupted_total"]) == (4, 1, 2)
    assert m["consecutive_interrupted"] == 0  # the graded run after the two broken ones succeeded
    assert m["episode_return_mean"] == 0.25 and m["episode_length_mean"] == 2
    assert m["tool_failures_total"] == 2 and m["tool_calls_total"] == 1 + 3 + 1 + 1 + 1
    assert m["llm_calls_total"] == sum(r["api_calls"] for r in runs) == 2 + 3 + 2 + 2 + 2
    assert m["llm_input_tokens_total"] == 100 * m["llm_calls_total"]
    assert m["llm_call_ms_max"] > 0 and m["llm_call_ms_count"] >= 1 and m["llm_turn_ms_max"] > 0
    assert w["beats"] >= 3  # periodic heartbeats, not only the final flush

    events = h.admin.all_events(worker_id=w["id"])
    stuck = [e["data"] for e in events if e["type"] == "anomaly"]
    assert stuck == [{"kind": "episode_stuck", "reason": "tool_failure", "count": 2, "source": "worker"}]
    alerts = [e["data"]["name"] for e in events if e["type"] == "alert"]
    assert "hermes.actor0_episode_stuck_tool_failure_2x" in alerts
    assert events[0]["type"] == "registered" and events[-1]["type"] == "deregistered"

    scores = [json.loads(line) for line in (tmp_path / "scores.jsonl").read_text().splitlines()]
    assert scores == [
        ["Read the notes.", True, 2, 1, 0, "session_end"],
        ["LOOP: keep reading the notes.", False, 3, 3, 0, "session_end"],
        ["BROKEN: read the old notes.", True, 2, 1, 1, "session_end"],
        ["BROKEN: read the old notes again.", True, 2, 1, 1, "session_end"],
        ["GRADED: read the notes.", True, 2, 1, 0, "session_end"],
    ]

    # The directory form loads through the loader's directory scan too, onto the same monitor.
    [directory] = out["directory"]
    assert [m[:2] for m in directory["manifests"]] == [["dsec_monitor", "standalone"]]
    assert sorted(directory["manifests"][0][2]) == sorted(HermesMonitor.HOOKS)
    assert [(p["key"], p["enabled"], p["error"]) for p in directory["plugins"]] == [("dsec_monitor", True, None)]
    assert directory["same_monitor"] is True
    assert out["threads"] == [["dsec-reporter"]]  # one reporter, whatever loaded the plugin


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_hermes_chat_one_shot_reports_and_deregisters_at_exit(
    hermes_python: Path, server_factory: Callable[..., Harness], tmp_path: Path
) -> None:
    """The `hermes chat -q` CLI, configured by files in HERMES_HOME only (no DSEC_CONFIG): the plugin
    reports the run and deregisters when the process exits (atexit)."""
    h = server_factory(pools=True)
    fake: dict[str, Any] = {}
    exec(compile(FAKE_LLM, "fake_llm", "exec"), fake)
    llm, url = fake["start"](str(_notes(tmp_path)))
    try:
        home = tmp_path / "hermes-home"
        home.mkdir()
        (home / "config.yaml").write_text(
            f"model:\n  default: fake-model\n  provider: custom\n  base_url: {url}\n  api_key: sk-test\n"
            "plugins:\n  enabled: [dsec_monitor]\n"
        )
        _harness_file(home / "dsec_monitor.yaml", h.url, interval=0.5)
        proc = subprocess.run(
            [str(hermes_python.with_name("hermes")), "chat", "-Q", "--yolo", "-q", "BROKEN: read the old notes."],
            cwd=tmp_path,
            env=_hermes_env(h, home),
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
    finally:
        llm.shutdown()
        llm.server_close()
    assert proc.returncode == 0, _tail(proc.stdout + proc.stderr, 60)
    assert "Finished: BROKEN: read the old notes." in proc.stdout
    w = _worker(h)
    assert (w["role"], w["group"], w["state"]) == ("actor", "hermes", "deregistered")
    m = w["metrics"]
    assert (m["episodes_total"], m["terminated_total"], m["interrupted_total"]) == (1, 1, 1)
    assert (m["tool_calls_total"], m["tool_failures_total"], m["llm_calls_total"]) == (1, 1, 2)
    assert m["llm_call_ms_max"] > 0 and m["episode_return_mean"] == 1.0
