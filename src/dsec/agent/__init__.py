"""``dsec agent``: one per machine, between that machine's probes and the control plane (``core``: the batching
proxy; ``serve``: its sockets, server and thread). See ``dsec.agent.core`` and docs/protocol.md."""

from dsec.agent.core import AgentConfig, AgentStats, NodeAgent
from dsec.agent.serve import AgentThread, run_agent, uvicorn_server

__all__ = ["AgentConfig", "AgentStats", "AgentThread", "NodeAgent", "run_agent", "uvicorn_server"]
