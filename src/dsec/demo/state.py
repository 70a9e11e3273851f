"""What every scene of ``dsec demo`` gets: the demo run (its client, processes, notes, checks and state), the
processes it started, and the demo's pool and heartbeat."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console

from dsec.client import Client

POOL = "pool-0"
ACTOR_POOL = "pool-1"  # the actor-restart scene's job (two devices of its own: a device runs one worker)
MEMORY_POOL = "pool-2"  # the memory-drain scene's learner
ROOM_POOL = "pool-3"  # the room-for-a-burst scene's learner and actors (on devices of its own for the scene)
HEARTBEAT_S = 0.25


@dataclass
class Proc:
    name: str
    role: str
    popen: subprocess.Popen[bytes]
    log: Path


@dataclass
class DemoRun:
    console: Console
    client: Client
    procs: list[Proc]
    notes: list[str] = field(default_factory=list)
    checks: dict[str, bool] = field(default_factory=dict)
    state: dict[str, Any] = field(default_factory=dict)

    def worker_ids(self, role: str | None = None) -> list[dict[str, Any]]:
        """Workers of the demo pool (optionally of one role), as the API lists them."""
        return [w for w in self.client.workers(pool=POOL) if role is None or w["role"] == role]
