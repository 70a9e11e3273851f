"""``dsec agent``: the node agent (one per machine) in the foreground — see ``dsec.agent``."""

from __future__ import annotations

from typing import Annotated

import typer

from dsec.cli_common import err, fail


def agent(
    upstream: Annotated[
        str, typer.Option(envvar="DSEC_AGENT_UPSTREAM", help="The control plane's URL (what the probes would use).")
    ] = "http://127.0.0.1:8080",
    host: Annotated[str, typer.Option(help="Bind address for the probes (keep it loopback).")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port the probes' DSEC_ENDPOINT points at; 0: no TCP port.")] = 8081,
    uds: Annotated[str | None, typer.Option(help="Also listen on this unix socket (0600).")] = None,
    flush_ms: Annotated[float, typer.Option(help="A heartbeat waits at most this long for its batch.")] = 50.0,
    max_batch: Annotated[int, typer.Option(help="Send a batch as soon as this many workers wait (max 1000).")] = 500,
    max_workers: Annotated[int, typer.Option(help="Workers whose newest beat the agent holds, at most.")] = 10_000,
    log_level: Annotated[str, typer.Option(help="uvicorn log level.")] = "info",
) -> None:
    """Run the node agent: probes on this machine report to it (DSEC_ENDPOINT=http://HOST:PORT); it batches their
    heartbeats to the control plane and proxies everything else."""
    from dsec.agent import AgentConfig, run_agent

    try:
        config = AgentConfig(
            upstream=upstream,
            host=host,
            port=port,
            uds=uds,
            listen_tcp=port != 0,
            flush_ms=flush_ms,
            max_batch=max_batch,
            max_workers=max_workers,
        )
    except ValueError as exc:
        raise fail(exc, 2) from None
    where = " and ".join(x for x in (f"http://{host}:{port}" if port else "", f"unix:{uds}" if uds else "") if x)
    err.print(f"DSec node agent on {where}, batching heartbeats to {upstream} every {flush_ms:g} ms", markup=False)
    run_agent(config, log_level=log_level)
