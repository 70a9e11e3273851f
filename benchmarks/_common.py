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
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


# -- the server side (runs in the child) ---------------------------------------------------------
def serve(home: str, port: int, admin_token: str, host: str = "127.0.0.1", cprofile_out: str | None = None) -> None:
    import uvicorn

    from dsec.control.app import create_app
    from dsec.control.server import uvicorn_config
    from dsec.control.settings import Settings

    settings = Settings.from_env(home=home, admin_token=admin_token)
    app = create_app(settings)
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
    """A control plane in a child process with its own temporary home (SQLite store).

    Use as a context manager; ``stop()`` is idempotent and always reaps the child (SIGINT, then
    SIGKILL after a grace period), so Ctrl-C or an exception in the benchmark never leaves it behind.
    """

    def __init__(self, admin_token: str = "dsa_bench_admin_token", cprofile_out: str | None = None,
                 startup_timeout_s: float = 30.0, python: str = sys.executable) -> None:
        from dsec.control.server import free_port

        self.admin_token = admin_token
        self.host = "127.0.0.1"
        self.port = free_port(self.host)
        self.home = tempfile.mkdtemp(prefix="dsec-bench-")
        cmd = [python, str(HERE / "_common.py"), "serve", "--home", self.home, "--port", str(self.port),
               "--admin-token", admin_token]
        if cprofile_out:
            cmd += ["--cprofile", str(Path(cprofile_out).resolve())]
        env = dict(os.environ)
        env.pop("DSEC_DATABASE_URL", None)  # always the temporary SQLite store
        # The child's stdout goes to our stderr: our stdout's last line is the JSON result.
        self.proc: subprocess.Popen[bytes] | None = subprocess.Popen(cmd, stdout=sys.stderr, env=env)
        try:
            self._wait_healthy(startup_timeout_s)
        except BaseException:
            self.stop()
            raise

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def _wait_healthy(self, timeout_s: float) -> None:
        import httpx

        deadline = time.monotonic() + timeout_s
        while True:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(f"control plane exited with {self.proc.returncode} before answering /healthz")
            try:
                if httpx.get(self.url + "/healthz", timeout=1.0).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"control plane did not answer /healthz within {timeout_s:.0f} s")
            time.sleep(0.05)

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
        cmd = [exe, "record", "--pid", str(pid), "--duration", str(max(1, round(duration_s))),
               "--rate", str(rate), "--format", "raw", "--threads", "--nonblocking", "-o", out]
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
# Buckets are checked in order against every frame of a stack (innermost first wins), so put the
# narrow ones before the broad ones. The patterns match "function (file.py:line)" frame strings.
BUCKETS: list[tuple[str, tuple[str, ...]]] = [
    ("sqlite/sqlalchemy (writer)", ("sqlalchemy/", "sqlite3", "store/sql.py")),
    ("hot-state rows (take_dirty/row)", ("take_dirty", "(state.py")),
    ("auth sha256/compare", ("control/auth.py",)),
    ("prometheus_client", ("prometheus_client/",)),
    ("orjson / JSON render", ("http.py:26", "render (")),
    ("pydantic validation", ("pydantic/", "pydantic_core", "validate_python", "validate_json")),
    ("fastapi params/deps", ("fastapi/dependencies", "fastapi/_compat", "fastapi/encoders")),
    ("fastapi routing", ("fastapi/routing",)),
    ("ControlPlane (service.py)", ("control/service.py",)),
    ("reconcile/liveness", ("liveness.py", "_reconcile_forever")),
    ("middleware (http.py)", ("control/http.py",)),
    ("starlette routing/request", ("starlette/routing", "starlette/requests", "starlette/_exception_handler",
                                   "starlette/middleware")),
    ("starlette response", ("starlette/responses",)),
    ("uvicorn httptools protocol", ("uvicorn/protocols",)),
    ("uvicorn other", ("uvicorn/",)),
    ("asyncio/uvloop loop", ("asyncio/", "uvloop", "<module>", "run_forever")),
]


def pyspy_summary(path: str, top: int = 40, thread_filter: str | None = None) -> str:
    """Self-time buckets and the top inclusive/self frames of a py-spy ``--format raw`` file."""
    self_t: collections.Counter[str] = collections.Counter()
    incl: collections.Counter[str] = collections.Counter()
    buckets: collections.Counter[str] = collections.Counter()
    threads: collections.Counter[str] = collections.Counter()
    total = 0
    for line in Path(path).read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if not stack or not n.isdigit():
            continue
        count = int(n)
        frames = stack.split(";")
        thread = frames[0] if frames and frames[0].startswith(("thread", "process")) else "?"
        if frames and frames[0].startswith("process"):
            frames = frames[1:]
            thread = frames[0] if frames and frames[0].startswith("thread") else thread
        if frames and frames[0].startswith("thread"):
            frames = frames[1:]
        threads[thread] += count
        if thread_filter and thread_filter not in thread:
            continue
        total += count
        if frames:
            self_t[frames[-1]] += count
        for f in set(frames):
            incl[f] += count
        label = "other"
        for f in reversed(frames):
            hit = next((name for name, pats in BUCKETS if any(p in f for p in pats)), None)
            if hit:
                label = hit
                break
        buckets[label] += count
    out = [f"samples: {total}  threads: " + ", ".join(f"{t} {c}" for t, c in threads.most_common())]
    out.append("\n== self time by bucket (innermost matching frame) ==")
    out += [f"{100 * c / total:6.1f}%  {b}" for b, c in buckets.most_common()] if total else []
    out.append(f"\n== top {top} inclusive ==")
    out += [f"{100 * c / total:6.1f}%  {f}" for f, c in incl.most_common(top)] if total else []
    out.append(f"\n== top {top} self ==")
    out += [f"{100 * c / total:6.1f}%  {f}" for f, c in self_t.most_common(top)] if total else []
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
    p = sub.add_parser("pyspy-summary", help="summarise a py-spy --format raw profile")
    p.add_argument("path")
    p.add_argument("--top", type=int, default=40)
    p.add_argument("--thread", default=None, help="only stacks whose thread label contains this")
    args = ap.parse_args(argv)
    if args.cmd == "serve":
        # uvicorn re-raises the SIGINT it handled once it has shut down: that is a clean exit here.
        with contextlib.suppress(KeyboardInterrupt):
            serve(args.home, args.port, args.admin_token, args.host, args.cprofile)
    else:
        print(pyspy_summary(args.path, args.top, args.thread))


if __name__ == "__main__":
    main()
