"""What the API shows of the control plane's state: status, workers with their judgment, directives with caps."""

from __future__ import annotations

from typing import Any

from dsec.control.beats import Beats
from dsec.control.judge import Judge
from dsec.control.ports import Clock
from dsec.control.state import HotState, LiveWorker
from dsec.model import WorkerState


class ReadModels:
    def __init__(self, state: HotState, judge: Judge, beats: Beats, clock: Clock, started_at: float) -> None:
        self.state = state
        self.judge = judge
        self.beats = beats
        self.clock = clock
        self.started_at = started_at

    def status(self) -> dict[str, Any]:
        pools = []
        for p in sorted(self.state.pools.values(), key=lambda p: p.name):
            ws = [w for w in self.state.workers.values() if w.pool == p.name]
            pools.append(
                {
                    **p.to_dict(),
                    "workers": {s.value: sum(1 for w in ws if w.state is s) for s in WorkerState},
                    "directives_pending": sum(
                        1 for w in ws if w.state is WorkerState.ACTIVE and w.acked_version != w.directive.version
                    ),
                    "meltdowns": self.state.meltdowns.get(p.name, 0),
                    "memory": mem.to_dict() if (mem := self.judge.pool_memory.get(p.name)) else None,
                    "sync_slowdown": p.name in self.judge.slow_pools,
                }
            )
        return {
            "server_time": self.clock(),
            "uptime_s": self.clock() - self.started_at,
            "heartbeats": self.beats.heartbeats,
            "pools": pools,
            "workers": [
                self.worker_api(w)
                for w in sorted(self.state.workers.values(), key=lambda w: (w.pool, w.info.group, w.info.rank, w.id))
            ],
        }

    def directive_api(self, w: LiveWorker) -> dict[str, Any]:
        """Desired vs acked directive, with the breaker caps in force for the worker (its own overrides, else its
        pool's thresholds, which policies may change)."""
        return {**w.to_api()["directive"], "caps": self.judge.caps_for(w).limits()}

    def worker_api(self, w: LiveWorker) -> dict[str, Any]:
        """A worker as the API shows it: its row, directive, and what the judgment thinks of it."""
        return {
            **w.to_api(),
            "breaker": self.judge.breaker_state(w, self.clock()),
            "meltdowns": self.state.worker_meltdowns.get(w.id, 0),
            "fleet_outlier": sorted(self.judge.flags.get(w.id, ())),
            "caps": self.judge.caps_for(w).limits(),
        }
