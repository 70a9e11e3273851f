"""Running the app under uvicorn: in the foreground (``dsec serve``) or in a thread (demo, tests)."""

from __future__ import annotations

import gc
import socket
import threading
import time
from typing import Any

import uvicorn
from fastapi import FastAPI


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


#: The cyclic collector's thresholds for a control plane process (CPython's defaults: 700, 10, 10). A control plane
#: holds a large, long-lived heap (every worker's record, breaker, trend) and allocates per beat; at the defaults
#: the collector ran young collections every 700 allocations and old ones often enough to cost a third of the
#: ingest capacity at 10,000 workers (benchmarks/ingest.py: 3,750 -> 5,400 batched beats/s with these;
#: docs/benchmarks.md). Reference counting still frees everything without cycles at once: only cyclic garbage
#: waits longer, and the old generation is still collected.
GC_THRESHOLDS = (50_000, 20, 100)


def tune_gc() -> None:
    """Set :data:`GC_THRESHOLDS` for this process; for a process that runs a control plane in the foreground
    (``dsec serve``), not for one that embeds it among other work (tests, the demo)."""
    gc.set_threshold(*GC_THRESHOLDS)


def uvicorn_config(app: FastAPI, host: str, port: int, **kw: Any) -> uvicorn.Config:
    # httptools + uvloop when installed (uvicorn[standard]); keep-alive long enough that reporters
    # reuse their connection between beats.
    from dsec.control.app import serve_target

    return uvicorn.Config(
        serve_target(app),
        host=host,
        port=port,
        log_level=kw.pop("log_level", "warning"),
        timeout_keep_alive=kw.pop("timeout_keep_alive", 75),
        # Loopback / behind a load balancer: no proxy-header rewriting, no Server and Date headers
        # (each costs per request at thousands of beats per second).
        proxy_headers=kw.pop("proxy_headers", False),
        server_header=False,
        date_header=False,
        lifespan="on",
        access_log=kw.pop("access_log", False),
        # Long-polls (heal join/watch) are held up to 20 s; a shutdown cuts them after this instead of waiting
        # (members ask again, on the next control plane).
        timeout_graceful_shutdown=kw.pop("timeout_graceful_shutdown", 2),
        **kw,
    )


class ServerThread:
    """A real uvicorn server on a background thread. ``close()`` shuts it down (lifespan included). With
    ``ssl_certfile`` and ``ssl_keyfile`` it serves HTTPS."""

    def __init__(
        self,
        app: FastAPI,
        host: str = "127.0.0.1",
        port: int | None = None,
        ssl_certfile: str | None = None,
        ssl_keyfile: str | None = None,
    ) -> None:
        self.host = host
        # Without a port the server listens on a socket bound here to port 0 and handed to uvicorn: asking the OS
        # for a free port, closing it and binding it again later lets another process take it in between.
        self._sock: socket.socket | None = None
        if not port:
            self._sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
            # As uvicorn's own bind does: a server started again on this port must not wait out TIME_WAIT.
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self._sock.bind((host, 0))
            port = int(self._sock.getsockname()[1])
        self.port = port
        self.scheme = "https" if ssl_certfile else "http"
        tls = {"ssl_certfile": ssl_certfile, "ssl_keyfile": ssl_keyfile} if ssl_certfile else {}
        self.server = uvicorn.Server(uvicorn_config(app, self.host, self.port, **tls))
        run = {"sockets": [self._sock]} if self._sock is not None else {}
        self._thread = threading.Thread(target=self.server.run, kwargs=run, name="dsec-server", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self._thread.is_alive():
                raise RuntimeError("control plane failed to start (see log)")
            if time.monotonic() > deadline:
                raise TimeoutError("control plane did not start within 30 s")
            time.sleep(0.01)

    @property
    def url(self) -> str:
        return f"{self.scheme}://{self.host}:{self.port}"

    def close(self) -> None:
        self.server.should_exit = True
        self._thread.join(timeout=30)
        if self._sock is not None:
            self._sock.close()

    def __enter__(self) -> ServerThread:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
