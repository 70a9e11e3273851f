"""Serving the node agent: its sockets (loopback TCP, a 0600 unix socket), the uvicorn server, a thread for tests
and embedding, and the foreground run of ``dsec agent``."""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time

import httpx
import uvicorn

from dsec.agent.core import AgentConfig, NodeAgent

log = logging.getLogger(__name__)


def _sockets(config: AgentConfig) -> list[socket.socket]:
    socks = []
    if config.listen_tcp:
        s = socket.socket(socket.AF_INET6 if ":" in config.host else socket.AF_INET)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((config.host, config.port))
        socks.append(s)
    if config.uds:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(config.uds)  # a socket file left by an agent that died
        u = socket.socket(socket.AF_UNIX)
        u.bind(config.uds)
        os.chmod(config.uds, 0o600)  # the machine's probes run as the same user
        socks.append(u)
    return socks


def uvicorn_server(agent: NodeAgent, log_level: str = "warning") -> uvicorn.Server:
    return uvicorn.Server(
        uvicorn.Config(
            agent,
            log_level=log_level,
            lifespan="on",
            access_log=False,
            server_header=False,
            date_header=False,
            timeout_keep_alive=75,  # probes keep their connection between beats
            timeout_graceful_shutdown=2,
        )
    )


class AgentThread:
    """The agent on a background thread (tests, embedding): ``url`` to point probes at; ``close()`` stops it."""

    def __init__(self, config: AgentConfig, transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.agent = NodeAgent(config, transport)
        self._socks = _sockets(config)
        self.port = int(self._socks[0].getsockname()[1]) if config.listen_tcp else None
        self.host = config.host
        self.server = uvicorn_server(self.agent)
        self._thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": self._socks}, name="dsec-agent", daemon=True
        )
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self._thread.is_alive():
                raise RuntimeError("the node agent failed to start (see log)")
            if time.monotonic() > deadline:
                raise TimeoutError("the node agent did not start within 30 s")
            time.sleep(0.01)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def close(self) -> None:
        self.server.should_exit = True
        self._thread.join(timeout=30)
        for s in self._socks:
            s.close()

    def __enter__(self) -> AgentThread:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def run_agent(config: AgentConfig, log_level: str = "info") -> None:
    """Serve in the foreground until interrupted (``dsec agent``)."""
    uvicorn_server(NodeAgent(config), log_level=log_level).run(sockets=_sockets(config))
