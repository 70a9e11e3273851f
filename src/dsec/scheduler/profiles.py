"""Device personalities: what each device has done to each kind of load, learned from history.

Every finished run of a worker on a device (it left, was lost, or was moved) is a :class:`RunRecord`: the load
class, whether it ran out of memory or failed, whether the device throttled, the memory-leak rate and the sync
jitter it showed. :class:`Profiles` accumulates them per (device, load class) and per (worker, device model), and
turns them into a *risk* in [0, 1] with a prior (a device nobody has used yet is neither trusted nor feared), so
placement can prefer devices where this kind of load ran stably and steer a worker that ran out of memory towards
device models where it did not.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

LOAD_CLASSES = ("long-episode", "short-episode", "sync-heavy")
PRIOR_RUNS = 3.0  # pseudo-runs of average behaviour: one bad run moves the risk, it does not decide it
PRIOR_RISK = 0.1


@dataclass(frozen=True)
class RunRecord:
    device: str
    model: str
    load_class: str
    worker_key: str
    oom: bool = False
    failed: bool = False
    throttled: bool = False
    leak_gb_per_h: float = 0.0
    sync_jitter_ms: float = 0.0
    hours: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> RunRecord:
        return cls(
            device=str(d["device"]),
            model=str(d.get("model", "unknown")),
            load_class=str(d.get("load_class", "short-episode")),
            worker_key=str(d.get("worker_key", "")),
            oom=bool(d.get("oom", False)),
            failed=bool(d.get("failed", False)),
            throttled=bool(d.get("throttled", False)),
            leak_gb_per_h=float(d.get("leak_gb_per_h", 0.0)),
            sync_jitter_ms=float(d.get("sync_jitter_ms", 0.0)),
            hours=float(d.get("hours", 0.0)),
        )


@dataclass
class ProfileStats:
    runs: int = 0
    ooms: int = 0
    failures: int = 0
    throttles: int = 0
    leak_gb_per_h: float = 0.0  # mean over runs
    sync_jitter_ms: float = 0.0  # mean over runs

    def add(self, r: RunRecord) -> None:
        self.runs += 1
        self.ooms += int(r.oom)
        self.failures += int(r.failed and not r.oom)
        self.throttles += int(r.throttled)
        self.leak_gb_per_h += (r.leak_gb_per_h - self.leak_gb_per_h) / self.runs
        self.sync_jitter_ms += (r.sync_jitter_ms - self.sync_jitter_ms) / self.runs

    def risk(self) -> float:
        """0 (ran everything stably) .. 1 (breaks what it is given). Bad outcomes weighted by what they cost:
        an OOM kills a node group, a failure restarts one, throttling slows it; leaks and sync jitter add a little."""
        bad = 1.0 * self.ooms + 0.7 * self.failures + 0.3 * self.throttles
        rate = (bad + PRIOR_RISK * PRIOR_RUNS) / (self.runs + PRIOR_RUNS)
        rate += min(0.2, 0.05 * max(0.0, self.leak_gb_per_h)) + min(0.2, max(0.0, self.sync_jitter_ms) / 500.0)
        return min(1.0, max(0.0, rate))


@dataclass
class Profiles:
    devices: dict[tuple[str, str], ProfileStats] = field(default_factory=dict)  # (device, load class)
    # worker key -> model -> stats; by worker first: placement asks per (worker, device) candidate.
    worker_models: dict[str, dict[str, ProfileStats]] = field(default_factory=dict)

    def observe(self, r: RunRecord) -> None:
        self.devices.setdefault((r.device, r.load_class), ProfileStats()).add(r)
        self.worker_models.setdefault(r.worker_key, {}).setdefault(r.model, ProfileStats()).add(r)

    @classmethod
    def learn(cls, records: Iterable[RunRecord]) -> Profiles:
        p = cls()
        for r in records:
            p.observe(r)
        return p

    def device_risk(self, device: str, load_class: str) -> float:
        stats = self.devices.get((device, load_class))
        return stats.risk() if stats else PRIOR_RISK

    def worker_model_affinity(self, worker_key: str, model: str) -> float:
        """For a worker with an OOM history: +1 towards models where it ran without OOM, -1 towards models where
        it ran out of memory (scaled by the evidence); 0 for workers that never ran out of memory."""
        mine = self.worker_models.get(worker_key, {})
        if not any(s.ooms for s in mine.values()):
            return 0.0
        s = mine.get(model)
        if s is None or s.runs == 0:
            return 0.0
        stable = (s.runs - s.ooms) / s.runs
        confidence = s.runs / (s.runs + 1.0)
        return (2.0 * stable - 1.0) * confidence

    def to_dict(self) -> dict[str, Any]:
        return {
            "devices": [
                {"device": d, "load_class": lc, **asdict(s), "risk": round(s.risk(), 4)}
                for (d, lc), s in sorted(self.devices.items())
            ],
            "worker_models": [
                {"worker": w, "model": m, **asdict(s)}
                for w in sorted(self.worker_models)
                for m, s in sorted(self.worker_models[w].items())
            ],
        }


def classify_load(metrics: Mapping[str, float]) -> str:
    """The load class of a worker from what its probe reported: sync-heavy when gradient sync dominates its step,
    long-episode when its episodes run long, short-episode otherwise."""
    sync_ms = metrics.get("sync_latency_ms_p50", 0.0)
    step_ms = metrics.get("step_ms_mean", 0.0)
    if sync_ms > 0 and (step_ms <= 0 or sync_ms >= 0.3 * step_ms):
        return "sync-heavy"
    if metrics.get("episode_length_mean", 0.0) >= 500:
        return "long-episode"
    return "short-episode"
