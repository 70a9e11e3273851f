"""The per-pool and per-worker gauge values of the live control plane (``dsec.decide.gauges`` computes them).

One computation for two readers: the Prometheus collector (at scrape time) and the policy engine's sampler
(on its own interval), so a rule and a dashboard always see the same numbers.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from dsec.control.views import view_of
from dsec.decide import PoolGauges, WorkerGauges, latency_signal, pool_gauges_of, pool_recovery_s
from dsec.model import WorkerState
from dsec.quota import PoolMemory

if TYPE_CHECKING:
    from dsec.breaker import Breaker, Caps
    from dsec.control.state import HotState, LiveWorker

__all__ = ["Gauges", "PoolGauges", "WorkerGauges", "pool_recovery_s"]


class Gauges:
    """Gauges over the hot state, the judge's pool memory accounting and its breakers (read at call time)."""

    def __init__(
        self,
        state: HotState,
        pool_memory: Mapping[str, PoolMemory],
        breakers: Mapping[str, Breaker],
        restore_min_reporters: int,
        caps_for: Callable[[LiveWorker], Caps] | None = None,
    ) -> None:
        self.state = state
        self.pool_memory = pool_memory
        self.breakers = breakers
        self.restore_min_reporters = restore_min_reporters
        self.caps_for = caps_for

    def pool_gauges(self) -> dict[str, PoolGauges]:
        st = self.state
        by_pool: dict[str, list[LiveWorker]] = {name: [] for name in st.pools}
        for w in list(st.workers.values()):
            by_pool.setdefault(w.pool, []).append(w)
        out: dict[str, PoolGauges] = {}
        for pool, ws in sorted(by_pool.items()):
            pending = sum(1 for w in ws if w.state is WorkerState.ACTIVE and w.acked_version != w.directive.version)
            out[pool] = pool_gauges_of(
                [view_of(w) for w in ws],
                pending,
                float(st.meltdowns.get(pool, 0)),
                st.restore_reports.get(pool, {}),
                self.restore_min_reporters,
                self.pool_memory.get(pool),
            )
        return out

    def worker_gauges(self) -> list[WorkerGauges]:
        st = self.state
        out = []
        for w in list(st.workers.values()):
            b = self.breakers.get(w.id)
            active = w.state is WorkerState.ACTIVE
            latency = cap = math.nan
            if active:
                signal = latency_signal(view_of(w).metrics)
                latency = math.nan if signal is None else float(signal)
                if self.caps_for is not None:
                    cap = float(self.caps_for(w).latency_ms)
            out.append(
                WorkerGauges(
                    pool=w.pool,
                    worker=w.id,
                    role=w.info.role.value,
                    active=active,
                    meltdowns=float(st.worker_meltdowns.get(w.id, 0)),
                    level=float(b.level if b else 0),
                    sync_latency_ms=latency,
                    latency_cap_ms=cap,
                )
            )
        return out
