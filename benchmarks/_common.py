"""Shared benchmark plumbing: a real control plane in a child process, and a py-spy summariser.

As a script::

    python benchmarks/_common.py serve --home DIR --port P --admin-token T [--cprofile OUT]
    python benchmarks/_common.py pyspy-summary PROFILE.txt [--top 40]

``serve`` runs ``create_app(Settings.from_env(...))`` under ``uvicorn.Server`` with the same config
``dsec serve`` uses (``uvicorn_config``: httptools + uvloop when installed). With ``--cprofile`` the
event-loop thread runs under cProfile and the stats are dumped when the server exits (SIGINT/SIGTERM).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


# -- the server side (runs in the child) ---------------------------------------------------------
def parse_setting(text: str) -> tuple[str, Any]:
    """``KEY=VALUE`` for a ``Settings`` field, the value converted to the field's default's type."""
    from dsec.control.settings import Settings

    key, sep, raw = text.partition("=")
    fields = {f.name: f for f in dataclasses.fields(Settings)}
    if not sep or key not in fields or key in ("home", "database_url", "admin_token"):
        raise ValueError(
            f"--server-setting {text!r}: expected KEY=VALUE with KEY one of "
            f"{sorted(set(fields) - {'home', 'database_url', 'admin_token'})}"
        )
    default = fields[key].default
    if isinstance(default, bool):
        if raw.lower() not in ("1", "true", "yes", "on", "0", "false", "no", "off"):
            raise ValueError(f"--server-setting {text!r}: expected a boolean (true/false)")
        return key, raw.lower() in ("1", "true", "yes", "on")
    conv = type(default) if isinstance(default, (int, float, str)) else str
    return key, conv(raw)


def serve(
    home: str,
    port: int,
    admin_token: str,
    host: str = "127.0.0.1",
    cprofile_out: str | None = None,
    settings_kv: list[str] | None = None,
    wrap: str | None = None,
) -> None:
    import importlib

    import uvicorn

    from dsec.control.app import create_app
    from dsec.control.server import tune_gc, uvicorn_config
    from dsec.control.settings import Settings

    overrides = dict(parse_setting(kv) for kv in settings_kv or ())
    settings = Settings.from_env(home=home, admin_token=admin_token, **overrides)
    app = create_app(settings)
    if wrap:
        # A prototype to A/B without touching src/: "module:callable" taking the app, returning an
        # ASGI app (its lifespan must still reach the wrapped app).
        mod, _, fn = wrap.partition(":")
        app = getattr(importlib.import_module(mod), fn)(app)
    tune_gc()  # as ``dsec serve`` does
    server = uvicorn.Server(uvicorn_config(app, host, port))
    # uvicorn installs its own SIGINT/SIGTERM handlers (graceful shutdown, lifespan included).
    if cprofile_out is None:
        server.run()
        return
    import cProfile

    prof = cProfile.Profile()
    prof.enable()
    try:
        server.run()
    finally:
        prof.disable()
        prof.dump_stats(cprofile_out)


# -- the benchmark side --------------------------------------------------------------------------
class ServerProcess:
    """A control plane in a child process with its own temporary home (SQLite store, or ``database_url``).

    Use as a context manager; ``stop()`` is idempotent and always reaps the child (SIGINT, then
    SIGKILL after a grace period), so Ctrl-C or an exception in the benchmark never leaves it behind.
    """

    def __init__(
        self,
        admin_token: str = "dsa_bench_admin_token",
        cprofile_out: str | None = None,
        settings: list[str] | None = None,
        wrap: str | None = None,
        startup_timeout_s: float = 30.0,
        python: str = sys.executable,
        database_url: str | None = None,
    ) -> None:
        from dsec.control.server import free_port

        self.database_url = database_url  # None: a temporary SQLite file in the home
        self.admin_token = admin_token
        self.host = "127.0.0.1"
        self.port = free_port(self.host)
        self.home = tempfile.mkdtemp(prefix="dsec-bench-")
        cmd = [
            python,
            str(HERE / "_common.py"),
            "serve",
            "--home",
            self.home,
            "--port",
            str(self.port),
            "--admin-token",
            admin_token,
        ]
        if cprofile_out:
            cmd += ["--cprofile", str(Path(cprofile_out).resolve())]
        for kv in settings or ():
            parse_setting(kv)  # fail here, not in the child
            cmd += ["--setting", kv]
        if wrap:
            cmd += ["--wrap", wrap]
        self._cmd = cmd
        self._startup_timeout_s = startup_timeout_s
        self.proc: subprocess.Popen[bytes] | None = None
        self._spawn()

    def _spawn(self) -> None:
        env = dict(os.environ)
        env.pop("DSEC_DATABASE_URL", None)  # the temporary SQLite store unless the benchmark names one
        # The control plane of this checkout, whichever the interpreter's editable install points at: a benchmark
        # run from another worktree (the "before" of an A/B pair) otherwise served the main checkout's code.
        own_src_first(env)
        if self.database_url is not None:
            env["DSEC_DATABASE_URL"] = self.database_url
        # The child's stdout goes to our stderr: our stdout's last line is the JSON result.
        self.proc = subprocess.Popen(self._cmd, stdout=sys.stderr, env=env)
        try:
            self._wait_healthy(self._startup_timeout_s)
        except BaseException:
            self.stop()
            raise

    def kill_and_restart(self) -> float:
        """SIGKILL the control plane (no shutdown, no flush: a crash) and start it again on the same store and
        port; answers the seconds from the kill until the new one answers /healthz."""
        assert self.proc is not None
        t0 = time.monotonic()
        self.proc.kill()
        self.proc.wait()
        self._spawn()
        return time.monotonic() - t0

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def _wait_healthy(self, timeout_s: float) -> None:
        assert self.proc is not None
        wait_healthy(self.proc, self.url, timeout_s)

    def stop(self, grace_s: float = 20.0) -> int | None:
        proc, self.proc = self.proc, None
        rc = None
        if proc is not None:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(signal.SIGINT)
                try:
                    proc.wait(timeout=grace_s)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
            rc = proc.returncode
        shutil.rmtree(self.home, ignore_errors=True)
        return rc

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def wait_healthy(
    proc: subprocess.Popen[bytes],
    url: str,
    timeout_s: float,
    what: str = "control plane",
    detail: Callable[[], str] = lambda: "",
    poll_s: float = 0.05,
) -> None:
    """Until the control plane ``proc`` at ``url`` answers /healthz; ``detail`` (e.g. its log's tail) is added to
    the error when it exits first."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode} before answering /healthz{detail()}")
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(url + "/healthz", timeout=1.0).status_code == 200:
                return
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} did not answer /healthz within {timeout_s:.0f} s")
        time.sleep(poll_s)


def dsec_run_env(**extra: str) -> dict[str, str]:
    """The environment for a ``python -m dsec.cli run`` child: this one without its ``DSEC_*`` settings (the run
    sets its own), this checkout's ``src`` first on ``PYTHONPATH``, then ``extra``."""
    env = own_src_first({k: v for k, v in os.environ.items() if not k.startswith("DSEC_")})
    env.update(extra)
    return env


def own_src_first(env: dict[str, str]) -> dict[str, str]:
    """``env`` (changed in place) with this checkout's ``src`` first on ``PYTHONPATH``."""
    rest = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join([str(HERE.parent / "src"), *rest])
    return env


def add_run_record_options(ap: argparse.ArgumentParser) -> None:
    """``--runs-out`` and ``--summarize``: a calibration's run records as JSON lines, so that several sittings' seeds
    can be summarized together (read_run_records / append_run_record)."""
    ap.add_argument("--runs-out", default=None, help="also append every run record here (JSON lines)")
    ap.add_argument(
        "--summarize",
        default=None,
        metavar="RUNS.jsonl",
        help="run nothing: summarize run records written by --runs-out (e.g. two sittings' seeds together)",
    )


def append_run_record(path: str | None, record: dict[str, Any]) -> None:
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")


def read_run_records(path: str) -> list[dict[str, Any]]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def admin_client(server: ServerProcess) -> Any:
    from dsec.client import Client

    return Client(server.url, token=server.admin_token, timeout=30.0)


def percentile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile of an already sorted list (q in 0..100); NaN when empty."""
    if not sorted_values:
        return float("nan")
    k = max(0, min(len(sorted_values) - 1, math.ceil(q / 100.0 * len(sorted_values)) - 1))
    return sorted_values[k]


class PySpy:
    """``py-spy record`` attached to a running process for a fixed time (raw collapsed stacks)."""

    def __init__(self, pid: int, out: str, duration_s: float, rate: int = 200) -> None:
        exe = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
        if not Path(exe).exists():
            raise RuntimeError("py-spy not found: .venv/bin/pip install py-spy")
        self.out = out
        cmd = [
            exe,
            "record",
            "--pid",
            str(pid),
            "--duration",
            str(max(1, round(duration_s))),
            "--rate",
            str(rate),
            "--format",
            "raw",
            "--threads",
            "--nonblocking",
            "-o",
            out,
        ]
        self.proc = subprocess.Popen(cmd, stdout=sys.stderr, stderr=subprocess.STDOUT)

    def wait(self, timeout_s: float = 30.0) -> None:
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


# -- py-spy raw ("collapsed") output -> where the time goes --------------------------------------
# A sample goes to the bucket of its innermost frame that matches any pattern (frames look like
# "function (path/file.py:line)"); within one frame the first matching bucket wins.
BUCKETS: list[tuple[str, tuple[str, ...]]] = [
    ("sqlite/sqlalchemy write", ("sqlalchemy/", "sqlite3", "store/sql.py")),
    ("writer: take_dirty/row copies", ("take_dirty", "LiveWorker.row", "info_to_dict")),
    ("writer thread other", ("control/writer.py", "queue.py", "threading.py")),
    ("auth: sha256 + compare_digest", ("control/auth.py",)),
    ("prometheus_client", ("prometheus_client/",)),
    ("orjson response render", ("JSON.render",)),
    ("stdlib json decode (FastAPI body)", ("json/decoder.py", "loads (json/")),
    ("stdlib json encode (SQLAlchemy JSON)", ("json/encoder.py", "dumps (json/")),
    ("pydantic validation", ("pydantic/", "pydantic_core", "TypeAdapter", "model_validate")),
    ("fastapi params/dependencies", ("fastapi/dependencies", "fastapi/_compat", "fastapi/encoders", "fastapi/params")),
    ("fastapi routing/middleware", ("fastapi/", "contextlib.py")),
    ("reconcile pass (every 0.25 s)", ("ControlPlane.reconcile", "liveness.py", "_reconcile_forever")),
    ("ControlPlane.heartbeat/worker_for", ("control/service.py",)),
    ("hot state mark_dirty", ("control/state.py",)),
    (
        "route handler (app.py, *_routes.py)",
        (
            "control/app.py",
            "control/worker_routes.py",
            "control/directive_routes.py",
            "control/inventory_routes.py",
            "control/event_routes.py",
            "control/report_routes.py",
            "control/policy_routes.py",
            "control/placement_routes.py",
            "control/token_routes.py",
            "control/ops_routes.py",
        ),
    ),
    ("dsec middleware (http.py)", ("control/http.py",)),
    ("starlette request/response/routing", ("starlette/",)),
    ("uvicorn send: transport.write syscalls", ("RequestResponseCycle.send ",)),
    ("uvicorn httptools parse/protocol", ("uvicorn/protocols",)),
    ("uvicorn other", ("uvicorn/",)),
    ("event loop (uvloop C, non-idle)", ("asyncio/", "uvloop", "run_forever", "Runner.run")),
]


def _bucket(frames: list[str]) -> str:
    for f in reversed(frames):
        for name, pats in BUCKETS:
            if any(p in f for p in pats):
                return name
    return "other"


def pyspy_summary(path: str, top: int = 30, thread_filter: str | None = None) -> str:
    """Per-thread share, then self-time buckets and top frames of a py-spy ``--format raw --threads``
    file (idle samples are not recorded, so percentages are of busy samples)."""
    per_thread: dict[str, dict[str, collections.Counter[str]]] = {}
    for line in Path(path).read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if not stack or not n.isdigit():
            continue
        frames = stack.split(";")
        thread = "?"
        while frames and frames[0].startswith(("process ", "thread ")):
            if frames[0].startswith("thread "):
                thread = frames[0].split(": ", 1)[-1]
            frames = frames[1:]
        if thread_filter and thread_filter not in thread:
            continue
        c = per_thread.setdefault(
            thread,
            {
                "self": collections.Counter(),
                "incl": collections.Counter(),
                "bucket": collections.Counter(),
                "n": collections.Counter(),
            },
        )
        count = int(n)
        c["n"]["n"] += count
        if frames:
            c["self"][frames[-1]] += count
        for f in set(frames):
            c["incl"][f] += count
        c["bucket"][_bucket(frames)] += count
    total = sum(c["n"]["n"] for c in per_thread.values())
    out = [
        f"busy samples: {total}; by thread: "
        + ", ".join(f"{t} {c['n']['n']} ({100 * c['n']['n'] / max(total, 1):.1f}%)" for t, c in per_thread.items())
    ]
    for thread, c in sorted(per_thread.items(), key=lambda kv: -kv[1]["n"]["n"]):
        samples = c["n"]["n"]
        out.append(f"\n==== {thread}: {samples} samples; self time by bucket ====")
        out += [f"{100 * v / samples:6.1f}%  {b}" for b, v in c["bucket"].most_common()]
        out.append(f"-- top {top} inclusive --")
        out += [f"{100 * v / samples:6.1f}%  {f}" for f, v in c["incl"].most_common(top)]
        out.append(f"-- top {top} self --")
        out += [f"{100 * v / samples:6.1f}%  {f}" for f, v in c["self"].most_common(top)]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve", help="run a control plane (what ServerProcess spawns)")
    s.add_argument("--home", required=True)
    s.add_argument("--port", type=int, required=True)
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--admin-token", required=True)
    s.add_argument("--cprofile", default=None, help="dump cProfile stats of the event-loop thread here")
    s.add_argument("--setting", action="append", default=[], help="Settings override KEY=VALUE (repeatable)")
    s.add_argument("--wrap", default=None, help="module:callable wrapping the app (prototype A/B)")
    p = sub.add_parser("pyspy-summary", help="summarise a py-spy --format raw profile")
    p.add_argument("path")
    p.add_argument("--top", type=int, default=30)
    p.add_argument("--thread", default=None, help="only stacks whose thread label contains this")
    args = ap.parse_args(argv)
    if args.cmd == "serve":
        # uvicorn re-raises the SIGINT it handled once it has shut down: that is a clean exit here.
        with contextlib.suppress(KeyboardInterrupt):
            serve(args.home, args.port, args.admin_token, args.host, args.cprofile, args.setting, args.wrap)
    else:
        print(pyspy_summary(args.path, args.top, args.thread))


if __name__ == "__main__":
    main()
