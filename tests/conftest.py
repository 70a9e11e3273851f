"""Shared fixtures: a clean environment for every test, and a real control plane on 127.0.0.1.

``server`` is a real uvicorn server (``ServerThread``) over a fresh SQLite file in ``tmp_path``, with
pools ``pool-a`` and ``pool-b`` created through the API and one pool token each. ``server_factory``
starts more servers (e.g. a second one on the same file, to test restarts); everything it starts is
stopped at teardown, and the autouse ``_no_leaked_threads`` check fails a test that leaves a DSec
thread (server, writer, reporter) running.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import ModuleType
from typing import Any

import httpx
import psutil
import pytest

from dsec.client import Client
from dsec.control.app import create_app
from dsec.control.server import ServerThread
from dsec.control.service import ControlPlane
from dsec.control.settings import Settings
from dsec.control.store import open_store
from dsec.model import Pool
from pg_cluster import postgres_url  # noqa: F401  (the fixture, for every test that asks for it)

ADMIN_TOKEN = "dsa_test-admin-token-0123456789"
POOLS = ("pool-a", "pool-b")
# Small enough that an oversized body fits in the socket buffers (the server answers 413 without
# reading it), large enough for every legitimate request the tests send.
MAX_BODY_BYTES = 64 * 1024


# -- environment hygiene ---------------------------------------------------------------------------
@pytest.fixture(autouse=True)
def _clean_environ() -> Iterator[None]:
    """Snapshot os.environ, drop every DSEC_* variable for the test, restore the snapshot afterwards."""
    saved = dict(os.environ)
    for key in [k for k in os.environ if k.startswith("DSEC_")]:
        del os.environ[key]
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _dsec_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("dsec-") and t.is_alive()}


@pytest.fixture(autouse=True)
def _no_leaked_threads() -> Iterator[None]:
    """Every server, writer and reporter thread a test starts must be stopped by its teardown."""
    before = _dsec_threads()
    yield
    deadline = time.monotonic() + 10
    leaked = _dsec_threads() - before
    while leaked and time.monotonic() < deadline:
        time.sleep(0.02)
        leaked = _dsec_threads() - before
    assert not leaked, f"test left threads running: {sorted(t.name for t in leaked)}"


def _live_children() -> dict[int, psutil.Process]:
    out = {}
    for p in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if p.status() != psutil.STATUS_ZOMBIE:  # exited, only not reaped yet: nothing runs
                out[p.pid] = p
    return out


def _started_by(p: psutil.Process, services: set[int]) -> bool:
    """Whether ``p`` descends from one of ``services``: processes that a longer-lived fixture's service started for
    itself (Ray's raylet and its worker pool) are that fixture's to stop, not the test's."""
    with contextlib.suppress(psutil.Error):
        return any(a.pid in services for a in p.parents())
    return False


def _kill_leftovers(procs: list[psutil.Process]) -> None:
    """SIGKILL each leftover that leads its own process group with that group (a `dsec run` started with
    start_new_session and its ranks go together); any other leftover alone (its group may hold processes that are
    not this test's)."""
    for p in procs:
        with contextlib.suppress(ProcessLookupError, psutil.Error):
            if os.getpgid(p.pid) == p.pid:
                os.killpg(p.pid, signal.SIGKILL)
            else:
                p.kill()
    psutil.wait_procs(procs, timeout=10)


#: CPython's default switch interval, which the tests of a finer one start from.
DEFAULT_SWITCH_S = 0.005


@pytest.fixture
def default_switch_interval() -> Iterator[float]:
    """The interpreter's GIL switch interval at CPython's default for the test (control/cpu_thread.py lowers it),
    whatever it was before; put back after."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(DEFAULT_SWITCH_S)
    yield DEFAULT_SWITCH_S
    sys.setswitchinterval(before)


@pytest.fixture(autouse=True)
def _no_leaked_processes(request: pytest.FixtureRequest) -> Iterator[None]:
    """A test must stop every process it started, children of its children included (but not those of a process that
    was already running: a module fixture's service, see _started_by). Leftovers get a grace period
    (a process told to stop may take a moment), then are killed — so that one leak fails one test, not the next
    ones too — and the test fails naming them."""
    if request.node.get_closest_marker("shared_processes") is not None:
        yield
        return
    before = set(_live_children())
    yield
    leaked = [p for pid, p in _live_children().items() if pid not in before and not _started_by(p, before)]
    if not leaked:
        return
    _, alive = psutil.wait_procs(leaked, timeout=10)
    alive = [p for p in alive if p.pid in _live_children()]
    if not alive:
        return
    names = []
    for p in alive:
        with contextlib.suppress(psutil.Error):
            names.append(f"{p.pid} {' '.join(p.cmdline())[:200]}")
    _kill_leftovers(alive)
    pytest.fail(f"test left processes running (killed now): {names}")


def stop_process_group(proc: subprocess.Popen[Any], timeout: float = 30.0) -> None:
    """Wait up to ``timeout`` for ``proc`` (started with ``start_new_session=True``) to exit, then SIGKILL its whole
    process group: killing only the parent of a `dsec run` or an ``mp.spawn`` job leaves its ranks running."""
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=timeout)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)  # also after a clean exit: ranks it left behind
    proc.wait()


# -- polling ------------------------------------------------------------------------------------------
def wait_for(
    predicate: Callable[[], Any], timeout: float = 10.0, interval: float = 0.02, what: str = "condition"
) -> Any:
    """Poll ``predicate`` until it returns a truthy value (returned) or fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(interval)


# -- the control plane ----------------------------------------------------------------------------
class VirtualClock:
    """A control plane's clock that a test moves by hand (``clock.now += 2.5``)."""

    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def make_settings(home: Path, **overrides: Any) -> Settings:
    """Test settings: a SQLite file under ``home``, the test admin token, short intervals."""
    opts: dict[str, Any] = {
        "home": home,
        "admin_token": ADMIN_TOKEN,
        "flush_interval_s": 0.05,
        "reconcile_interval_s": 0.05,
        "max_body_bytes": MAX_BODY_BYTES,
    }
    opts.update(overrides)
    return Settings.from_env(**opts)


def load_module(name: str, path: Path) -> ModuleType:
    """The Python file ``path`` (a script, a benchmark, an example: not on ``sys.path``) loaded as module ``name``."""
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@contextlib.asynccontextmanager
async def control_plane_with_pool(home: Path, **overrides: Any) -> AsyncIterator[ControlPlane]:
    """A real ``ControlPlane`` (no HTTP) over a SQLite file under ``home`` (``make_settings`` with ``overrides``),
    with pool ``pool-a`` (4-12 GB); closed, with its store, when the block ends."""
    settings = make_settings(home, **overrides)
    store = open_store(settings.database_url)
    plane = ControlPlane(settings, store)
    try:
        await plane.put_pool(Pool("pool-a", memory_base_gb=4.0, memory_ceiling_gb=12.0))
        yield plane
    finally:
        plane.close()
        store.close()


@dataclass
class Worker:
    """A registered worker: its id, its own token and the register answer."""

    id: str
    token: str
    pool: str
    answer: dict[str, Any]


@dataclass
class Harness:
    """One running control plane and what the tests need to talk to it."""

    settings: Settings
    server: ServerThread
    admin: Client
    pool_tokens: dict[str, str] = field(default_factory=dict)
    _clients: list[Client] = field(default_factory=list)
    _closed: bool = False

    @property
    def url(self) -> str:
        return self.server.url

    @property
    def port(self) -> int:
        return self.server.port

    @property
    def admin_token(self) -> str:
        assert self.settings.admin_token is not None
        return self.settings.admin_token

    @property
    def database_url(self) -> str:
        return self.settings.database_url

    def client(self, token: str | None = None) -> Client:
        """A ``dsec.client.Client`` closed with the harness."""
        c = Client(self.url, token=token)
        self._clients.append(c)
        return c

    def http(self) -> httpx.Client:
        """A raw httpx client (the caller closes it; prefer a ``with`` block)."""
        return httpx.Client(base_url=self.url, timeout=10.0)

    def create_pools(self, names: tuple[str, ...] = POOLS) -> None:
        for name in names:
            self.admin.put_pool(name)
            self.pool_tokens[name] = self.admin.create_token(name, label=f"test {name}")

    def register(self, pool: str = "pool-a", token: str | None = None, **kw: Any) -> Worker:
        """Register a worker with the pool's token; answers its id and worker token."""
        answer = self.admin.register(pool, token=token or self.pool_tokens[pool], **kw)
        return Worker(answer["worker_id"], answer["worker_token"], pool, answer)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for c in self._clients:
            c.close()
        self.admin.close()
        self.server.close()
        assert not self.server._thread.is_alive(), "server thread did not stop"


def start_harness(settings: Settings, port: int | None = None, pools: bool = False) -> Harness:
    """Start a real server for ``settings`` (on ``port`` if given); optionally create the two pools."""
    server = ServerThread(create_app(settings), port=port)
    h = Harness(settings=settings, server=server, admin=Client(server.url, token=settings.admin_token))
    if pools:
        try:
            h.create_pools()
        except BaseException:
            h.close()
            raise
    return h


@pytest.fixture
def server_factory(tmp_path: Path) -> Iterator[Callable[..., Harness]]:
    """``start(settings=None, port=None, pools=False) -> Harness``; every harness is closed at teardown."""
    started: list[Harness] = []
    home = tmp_path / "home"
    os.environ["DSEC_HOME"] = str(home)  # restored by _clean_environ

    def start(settings: Settings | None = None, port: int | None = None, pools: bool = False) -> Harness:
        h = start_harness(settings or make_settings(home), port=port, pools=pools)
        started.append(h)
        return h

    yield start
    for h in reversed(started):
        h.close()


@pytest.fixture
def server(server_factory: Callable[..., Harness]) -> Harness:
    """A running control plane over a fresh SQLite file with pools ``pool-a`` and ``pool-b``."""
    return server_factory(pools=True)


@pytest.fixture
def register_worker(server: Harness) -> Callable[..., Worker]:
    """``register_worker(pool="pool-a", **fields) -> Worker`` on the ``server`` fixture."""
    return server.register


HttpHandler = Callable[[dict[str, str], bytes], tuple[int, Mapping[str, str], bytes]]


@contextlib.contextmanager
def http_receiver(handle: HttpHandler, path: str = "/hook") -> Iterator[str]:
    """A real HTTP server on 127.0.0.1 answering every POST with ``handle(headers, body) -> (status,
    extra headers, body)``; yields its URL and is shut down (thread joined) on exit."""

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            status, extra, payload = handle(dict(self.headers.items()), body)
            self.send_response(status)
            for k, v in extra.items():
                self.send_header(k, v)
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def log_message(self, format: str, *args: Any) -> None:  # keep test output clean
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, name="dsec-test-receiver")
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}{path}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)
        assert not thread.is_alive()


@pytest.fixture
def offline_probe() -> Iterator[Any]:
    """A probe whose control plane is unreachable (nothing listens on port 9): it never registers. (Here, not in a
    conftest.py of its own: tests import this module as ``conftest``, and a second one would shadow it.)"""
    from dsec.probe.config import ProbeConfig
    from dsec.probe.runtime import Probe

    cfg = ProbeConfig.from_env({"DSEC_ENDPOINT": "http://127.0.0.1:9", "DSEC_SANDBOX_ID": "p"})
    assert cfg is not None
    p = Probe(cfg)
    yield p
    p.healing = None  # a test's stand-in is not closed again
    p.close()


@pytest.fixture
def one_rank_group() -> Iterator[None]:
    """A one-rank gloo default group in this process (the DDP comm hook's unit tests), destroyed after the test."""
    dist = pytest.importorskip("torch.distributed")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.fixture
def torch_probe(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[dict[str, str | None]], Any]]:
    """Makes probes with torch instrumented, from environment settings (None: unset); each is closed and its hooks
    removed at the end of the test."""
    import torch

    from dsec.probe.config import ProbeConfig
    from dsec.probe.runtime import Probe
    from dsec.probe.torch_hooks import TorchInstrumentation

    made: list[Probe] = []

    def make(env: dict[str, str | None]) -> Probe:
        for key, value in env.items():
            if value is None:
                monkeypatch.delenv(key, raising=False)
            else:
                monkeypatch.setenv(key, value)
        # Nothing listens on port 9: the reporter retries in the background, the hooks work regardless.
        cfg = ProbeConfig.from_env({"DSEC_ENDPOINT": "http://127.0.0.1:9", "DSEC_SANDBOX_ID": "p"})
        assert cfg is not None
        p = Probe(cfg)
        inst = TorchInstrumentation(p)
        inst.install(torch)
        p.torch = inst
        made.append(p)
        return p

    yield make
    for p in made:
        p.close()
        p.uninstall()
