"""What every launcher backend gets and reports: one :class:`WorkerLaunch` per placed worker, and exits.

A backend starts worker processes where the placement put them and tells its supervisor when one exits; the
supervisor (supervisor.py) decides what to do (restart the group from its newest snapshot). Backends are chosen by
name (:data:`BACKENDS`): ``local`` (subprocesses on this machine) and ``ray`` (Ray placement groups, multi-node).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol


@dataclass(frozen=True)
class WorkerLaunch:
    worker: str  # unique in the job
    group: str
    role: str
    rank: int  # within its group
    world_size: int  # of its group
    command: tuple[str, ...]
    env: Mapping[str, str] = field(default_factory=dict)
    device: str | None = None  # placement's device id
    node: str | None = None  # placement's node (a Ray node label value, or this machine)
    cpus: tuple[int, ...] = ()  # CPU affinity (NUMA-local CPUs)
    gpu_index: int | None = None  # index on its node -> CUDA_VISIBLE_DEVICES


@dataclass(frozen=True)
class Exit:
    worker: str
    group: str
    code: int | None  # exit status; None when the backend lost the process (node gone)
    at: float  # time.time() when the exit was noticed
    pid: int | None = None  # the process that exited, when the backend knows it (local)


class Launcher(Protocol):
    name: str
    # Whether start() takes one worker of a group whose other workers run (a heal's replacement, a worker restarted
    # alone); when False the supervisor restarts the whole group instead.
    starts_single_workers: bool

    def start(self, workers: list[WorkerLaunch]) -> None: ...

    def poll(self) -> list[Exit]:
        """Workers that exited since the last poll (never blocks)."""
        ...

    def stop_group(self, group: str) -> None:
        """Stop every worker of ``group`` (SIGKILL after a grace period); returns when they are gone."""
        ...

    def stop(self) -> None: ...
