"""The control plane's hot state: every worker, directive and pool in memory.

Heartbeats read and update this, never the database. ``dirty`` rows are written back in batches by
``GroupCommitWriter``; what must be durable before an answer (registrations, events, directives) is
committed through the writer first and applied here after the commit succeeded.

All mutation happens on the event loop thread, so no lock is needed for the dicts themselves; the
writer thread only calls ``take_dirty`` / ``mark_dirty`` which swap a set under a lock.
"""

from __future__ import annotations

import asyncio
import math
import threading
from collections import Counter
from collections.abc import ItemsView, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from dsec.control.store import HotRow, WorkerRow
from dsec.model import Device, Directive, DirectiveFields, Pool, Role, WorkerInfo, WorkerState

if TYPE_CHECKING:
    from dsec.breaker import Caps
    from dsec.decide import WorkerView


class AgedMetrics(Mapping[str, float]):
    """A worker's current metrics: each name with the beat (the worker's own beat count) it was last sent in.

    Only fresh names are held, so reading it as a Mapping (what the judge, the gauges and the API do) sees
    nothing stale: ``merged`` drops a name not sent for more than ``max_age`` beats. Without this a name a
    worker stopped sending (a restarted probe, a gauge only reported while something is true) would steer
    decisions forever. Immutable: the writer thread may be copying one while the next beat builds another.
    """

    __slots__ = ("_oldest", "_seen", "_values")

    def __init__(self, values: Mapping[str, float] | None = None, seen: Mapping[str, int] | None = None) -> None:
        self._values: dict[str, float] = dict(values or {})
        self._seen: dict[str, int] = {k: (seen or {}).get(k, 0) for k in self._values}
        # The oldest beat in ``_seen`` (None: empty), kept with it: every beat's ``merged`` asks whether any name aged.
        self._oldest: int | None = min(self._seen.values(), default=None)

    def __getitem__(self, name: str) -> float:
        return self._values[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def get(self, name: str, default: Any = None) -> Any:
        # Mapping.get goes through __getitem__ and a caught KeyError: ~5x slower, and the decisions read
        # a handful of names of every worker on every beat and every reconcile pass.
        return self._values.get(name, default)

    def __contains__(self, name: object) -> bool:
        return name in self._values

    def items(self) -> ItemsView[str, float]:
        return self._values.items()

    def __repr__(self) -> str:
        return f"AgedMetrics({self._values!r})"

    def as_dict(self) -> Mapping[str, float]:
        """The names and values as the plain dict this holds, for readers that look up many names: ``dict.get`` is
        C, this class's ``get`` a Python call (the periodic judgments read ~7 names of each of 10,000 workers several
        times a second). Safe to share: nothing mutates it once built (``merged`` builds new dicts)."""
        return self._values

    def last_beat(self, name: str) -> int:
        """The beat ``name`` was last sent in (KeyError when it is not held)."""
        return self._seen[name]

    def merged(self, new: Mapping[str, float], beat: int, max_age: int) -> AgedMetrics:
        """These metrics after beat number ``beat`` carrying ``new``: names older than ``max_age`` beats dropped."""
        out = AgedMetrics.__new__(AgedMetrics)  # its three slots are set below (__init__ would build empty dicts)
        oldest = beat - max_age
        if new.keys() >= self._values.keys() and (self._oldest is None or self._oldest >= oldest):
            # The common beat: every name held is sent again and none was too old to keep. The same dicts (names in
            # the same order) as the general case below, from C-level copies instead of two comprehensions per beat.
            out._values = dict(self._values)
            out._values.update(new)
            out._seen = dict.fromkeys(out._values, beat)
            out._oldest = beat if out._seen else None
            return out
        out._seen = {k: b for k, b in self._seen.items() if b >= oldest}
        out._values = {k: self._values[k] for k in out._seen}
        out._values.update(new)
        out._seen.update(dict.fromkeys(new, beat))
        out._oldest = min(out._seen.values(), default=None)
        return out


@dataclass
class LiveWorker:
    id: str
    info: WorkerInfo
    state: WorkerState
    token_hash: str
    registered_at: float
    last_beat_at: float
    last_seq: int
    acked_version: int
    beats: int
    # Read it as a Mapping; it is an ``AgedMetrics`` once the worker beats (``merged_metrics``).
    metrics: Mapping[str, float]
    directive: Directive
    # The id of the pool token that registered it (None: an admin token), for per-token quotas; persisted in
    # ``info``. ``ended_at``: when it deregistered (in memory; after a restart its last beat stands in).
    token_id: str | None = None
    ended_at: float | None = None
    # Directive fields the worker said it cannot carry out (``directive_unappliable`` events): field -> the
    # event's version, requested value and reason. In memory only (the events stay in the store).
    unappliable: dict[str, dict[str, Any]] = field(default_factory=dict)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock, repr=False, compare=False)
    # The caps in force and the pool, directive fields and cap safety floor they were made from (Judge.caps_for).
    caps_cache: tuple[Pool | None, DirectiveFields, float | None, Caps] | None = field(
        default=None, repr=False, compare=False
    )
    # The decision view built from this record and the parts it was built from (views.view_of).
    view_cache: tuple[WorkerInfo, DirectiveFields, Mapping[str, float], WorkerState, WorkerView] | None = field(
        default=None, repr=False, compare=False
    )

    @property
    def pool(self) -> str:
        return self.info.pool

    @property
    def worker_id(self) -> str:  # liveness.Beating
        return self.id

    @property
    def interval_s(self) -> float:  # liveness.Beating: its own heartbeat interval
        return self.info.heartbeat_interval_s

    def merged_metrics(self, new: Mapping[str, float], max_age: int) -> AgedMetrics:
        """The metrics after the worker's next beat carries ``new`` (see ``AgedMetrics.merged``). Metrics loaded
        from the store or set as a plain mapping count as sent in the latest beat."""
        held = self.metrics
        if not isinstance(held, AgedMetrics):
            held = AgedMetrics(held, dict.fromkeys(held, self.beats))
        return held.merged(new, self.beats + 1, max_age)

    def row(self) -> WorkerRow:
        info = info_to_dict(self.info)
        if self.token_id is not None:
            info["token_id"] = self.token_id
        return WorkerRow(
            id=self.id,
            pool=self.info.pool,
            info=info,
            state=self.state.value,
            token_hash=self.token_hash,
            registered_at=self.registered_at,
            last_beat_at=self.last_beat_at,
            last_seq=self.last_seq,
            acked_version=self.acked_version,
            beats=self.beats,
            metrics=dict(self.metrics),
        )

    def hot_row(self) -> HotRow:
        """What a beat without events changed of the stored row (the metrics are immutable: no copy here)."""
        return HotRow(self.id, self.last_beat_at, self.last_seq, self.acked_version, self.beats, self.metrics)

    @classmethod
    def from_row(cls, row: WorkerRow, directive: Directive) -> LiveWorker:
        return cls(
            id=row.id,
            info=info_from_dict(row.info),
            state=WorkerState(row.state),
            token_hash=row.token_hash,
            registered_at=row.registered_at,
            last_beat_at=row.last_beat_at,
            last_seq=row.last_seq,
            acked_version=row.acked_version,
            beats=row.beats,
            metrics=dict(row.metrics),
            directive=directive,
            token_id=row.info.get("token_id"),
        )

    def to_api(self) -> dict[str, Any]:
        return {
            "id": self.id,
            **info_to_dict(self.info),
            "state": self.state.value,
            "registered_at": self.registered_at,
            "last_beat_at": self.last_beat_at,
            "last_seq": self.last_seq,
            "beats": self.beats,
            "metrics": dict(self.metrics),
            "directive": {
                "desired_version": self.directive.version,
                "acked_version": self.acked_version,
                "in_sync": self.acked_version == self.directive.version,
                "desired": self.directive.to_dict(),
                # Fields of the desired version the worker answered as unappliable (it will never ack it).
                "unappliable": {
                    name: {"requested": u.get("requested"), "reason": u.get("reason")}
                    for name, u in self.unappliable.items()
                    if u.get("version") == self.directive.version
                },
            },
        }


def info_to_dict(info: WorkerInfo) -> dict[str, Any]:
    return {
        "pool": info.pool,
        "role": info.role.value,
        "group": info.group,
        "rank": info.rank,
        "host": info.host,
        "pid": info.pid,
        "device": info.device,
        "heartbeat_interval_s": info.heartbeat_interval_s,
    }


def info_from_dict(d: dict[str, Any] | Any) -> WorkerInfo:
    return WorkerInfo(
        pool=d["pool"],
        role=Role(d["role"]),
        group=d["group"],
        rank=int(d["rank"]),
        host=d["host"],
        pid=int(d["pid"]),
        device=d.get("device"),
        heartbeat_interval_s=float(d["heartbeat_interval_s"]),
    )


@dataclass
class HotState:
    pools: dict[str, Pool] = field(default_factory=dict)
    devices: dict[str, Device] = field(default_factory=dict)
    workers: dict[str, LiveWorker] = field(default_factory=dict)
    pool_token_hashes: dict[str, str] = field(default_factory=dict)  # hash -> pool
    admin_token_hashes: set[str] = field(default_factory=set)
    read_token_hashes: set[str] = field(default_factory=set)
    # Workers registered with each pool token (by token id) and not deregistered: the per-token quota.
    workers_by_token: Counter[str] = field(default_factory=Counter)
    worker_token_hashes: dict[str, str] = field(default_factory=dict)  # hash -> worker id
    # Observed from events, per pool: what the four headline gauges are computed from.
    meltdowns: Counter[str] = field(default_factory=Counter)
    worker_meltdowns: Counter[str] = field(default_factory=Counter)
    # Restore times reported by workers, per pool: worker id -> its latest restore_s (gauges.pool_recovery_s).
    restore_reports: dict[str, dict[str, float]] = field(default_factory=dict)
    # Pools recovering from a device failure (until this time): policy actions on them are held back.
    pool_recovering_until: dict[str, float] = field(default_factory=dict)
    # Cards holding room made for a burst (dsec.quota.room), until this time: placement puts no new worker there.
    # Each is a ``room`` event's ``until``: a restarted control plane reads them back (Scheduler.load).
    room_until: dict[str, float] = field(default_factory=dict)
    # No active worker can be overdue before this time (a lower bound of their deadlines, liveness.scan): the reconcile
    # pass sets it from its scan, and whatever makes a worker active lowers it (``may_lose_at``). -inf: unknown.
    quiet_until: float = -math.inf
    _dirty: set[str] = field(default_factory=set)
    _writing: Counter[str] = field(default_factory=Counter)  # workers a request is committing a row of
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def may_lose_at(self, deadline: float) -> None:
        """A worker became active (registered, or back from lost) and is overdue after ``deadline`` unless it beats:
        the reconcile pass looks again by then."""
        if deadline < self.quiet_until:
            self.quiet_until = deadline

    def mark_dirty(self, *worker_ids: str) -> None:
        with self._lock:
            self._dirty.update(worker_ids)

    def mark_dirty_one(self, worker_id: str) -> None:
        """``mark_dirty(worker_id)``, for the beat path (once per beat without events): no argument tuple."""
        with self._lock:
            self._dirty.add(worker_id)

    @contextmanager
    def writing(self, *worker_ids: str) -> Iterator[None]:
        """Around a request that commits rows of ``worker_ids`` and then applies the change here: meanwhile the
        writer takes no dirty copy of them. A copy taken after the commit but before the apply is older than the
        committed row, and a flush wrote it over that row: its beat columns went back to the values before. (While
        the write-back carried whole rows, the state went back too — a worker that deregistered read ``active`` in
        the store, for good, and ``lost`` after a restart.)"""
        with self._lock:
            self._writing.update(worker_ids)
        try:
            yield
        finally:
            with self._lock:
                self._writing.subtract(worker_ids)
                for wid in worker_ids:
                    if self._writing[wid] <= 0:
                        del self._writing[wid]

    def take_dirty(self) -> list[HotRow]:
        """What beats changed, to write back now; the caller re-marks them with ``mark_dirty`` if the write fails.
        Workers a request is writing stay dirty for the next flush (``writing``)."""
        with self._lock:
            ids, self._dirty = self._dirty, set()
            held = ids & self._writing.keys() if self._writing else set()  # keys: counts > 0 only
            self._dirty |= held
        workers = self.workers
        return [workers[i].hot_row() for i in ids - held if i in workers]

    def directive_for_new_worker(self, worker_id: str, pool: Pool, now: float) -> Directive:
        return Directive(worker_id=worker_id, version=1, fields=DirectiveFields.for_pool(pool), updated_at=now)
