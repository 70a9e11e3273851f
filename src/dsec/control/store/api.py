"""The store contract: what the control plane persists, and the exceptions it raises.

Implementations are chosen by URL scheme from ``dsec.control.store.open_store`` (SQLite by default,
any SQLAlchemy URL via DSEC_DATABASE_URL). One contract test suite runs against every backend.

Exceptions::

    StoreError
     ├── StoreUnavailable    the database cannot be reached or opened
     └── StoreConflict       a write contradicts stored state (e.g. duplicate id)
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from dsec.errors import StorageError
from dsec.model import Device, Directive, Event, EventType, Pool


class StoreError(StorageError):
    """Base of all store errors."""


class StoreUnavailable(StoreError):
    """The database cannot be reached, opened or migrated."""


class StoreConflict(StoreError):
    """A write contradicts what is stored."""


@dataclass(frozen=True)
class WorkerRow:
    """The persisted view of one worker (the hot copy lives in memory and is flushed in batches)."""

    id: str
    pool: str
    info: Mapping[str, Any]
    state: str
    token_hash: str
    registered_at: float
    last_beat_at: float
    last_seq: int
    acked_version: int
    beats: int
    metrics: Mapping[str, float]


@dataclass(frozen=True, slots=True)
class HotRow:
    """What a heartbeat without events changes of a worker's stored row, written back on the writer's timer
    (``WriteBatch.hot``). Only these columns: everything else of the row (info, state, token) changes only through a
    committed request, which writes the whole row. The row exists (the registration committed it); the row of a
    worker forgotten meanwhile is not written back (an UPDATE, not an upsert: a late copy cannot bring it back)."""

    id: str
    last_beat_at: float
    last_seq: int
    acked_version: int
    beats: int
    metrics: Mapping[str, float]


@dataclass(frozen=True)
class TokenRow:
    token_hash: str
    pool: str | None  # None for admin tokens
    kind: str  # "admin" | "pool"
    label: str
    created_at: float


@dataclass(frozen=True)
class RuntimeRow:
    """An agent runtime (control/runtimes.py). ``secret`` signs its policy pushes, so it is kept here, in the store
    (0600 for SQLite, access-controlled for PostgreSQL), and never in a file of its own."""

    id: str
    name: str
    type: str
    callback_url: str
    secret: str
    token_hash: str
    pool: str | None
    registered_at: float
    report: Mapping[str, Any]
    reported_at: float | None


@dataclass(frozen=True)
class PlacementRow:
    """A job's placement (``Placement.to_dict()``): the devices it holds until it is released."""

    job: str
    pool: str | None
    placement: Mapping[str, Any]
    placed_at: float


@dataclass(frozen=True)
class PolicyRow:
    """One applied policy text. ``version`` is the previous one's + 1 (a version already stored: StoreConflict)."""

    version: int
    text: str
    source: str
    applied_at: float


@dataclass
class WriteBatch:
    """Everything written in one transaction (group commit): a change and the event that records it commit together
    or not at all. Deletions apply after the upserts of the same batch (the writer keeps only the last change of a
    key when it merges requests, so one merged batch never holds both for the same key)."""

    workers: list[WorkerRow] = field(default_factory=list)
    # Beat-only changes of existing workers (after ``workers``; a worker with a row in ``workers`` has none here).
    hot: list[HotRow] = field(default_factory=list)
    directives: list[Directive] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)
    # Workers to forget (with their directives; their events stay), after the upserts of the same batch.
    deleted_workers: list[str] = field(default_factory=list)
    pools: list[tuple[Pool, float]] = field(default_factory=list)  # (pool, updated_at)
    deleted_pools: list[str] = field(default_factory=list)  # with their pool tokens
    devices: list[tuple[Device, float]] = field(default_factory=list)  # (device, updated_at)
    placements: list[PlacementRow] = field(default_factory=list)
    released_placements: list[str] = field(default_factory=list)  # job names
    policies: list[PolicyRow] = field(default_factory=list)

    def __bool__(self) -> bool:
        return any(getattr(self, f) for f in _BATCH_FIELDS)


_BATCH_FIELDS = tuple(WriteBatch.__dataclass_fields__)


@dataclass(frozen=True)
class EventQuery:
    worker_id: str | None = None
    pool: str | None = None
    types: Sequence[EventType] = ()
    since: float | None = None
    until: float | None = None
    after_id: int = 0
    limit: int = 100


class Store(Protocol):
    """Synchronous persistence API; the control plane calls it from its writer thread and threadpool."""

    def migrate(self) -> None: ...
    def close(self) -> None: ...

    def put_pool(self, pool: Pool, now: float) -> None:
        """Outside the writer: start-up only (``--cluster``); changes go in a ``WriteBatch`` with their event."""
        ...

    def delete_pool(self, name: str) -> bool:
        """Delete the pool and, in the same transaction, revoke its pool tokens (``WriteBatch.deleted_pools`` too)."""
        ...

    def list_pools(self) -> list[Pool]: ...

    def put_devices(self, devices: Iterable[Device], now: float) -> None: ...
    def list_devices(self) -> list[Device]: ...

    def write(self, batch: WriteBatch) -> list[int]:
        """Write a batch atomically; returns the ids given to ``batch.events`` in order."""
        ...

    def list_workers(self) -> list[WorkerRow]: ...
    def list_directives(self) -> list[Directive]: ...
    def query_events(self, query: EventQuery) -> list[Event]: ...
    def count_events(self) -> int: ...
    def prune_events(self, before: float, keep: Sequence[EventType] = ()) -> int:
        """Delete events with ``ts < before`` except those of the ``keep`` types; returns how many."""
        ...

    def put_token(self, token: TokenRow) -> None: ...
    def list_tokens(self) -> list[TokenRow]: ...
    def delete_token(self, token_hash: str) -> bool: ...

    def put_runtime(self, runtime: RuntimeRow) -> None: ...
    def list_runtimes(self) -> list[RuntimeRow]: ...
    def delete_runtime(self, runtime_id: str) -> bool: ...

    def list_placements(self) -> list[PlacementRow]: ...
    def current_policy(self) -> PolicyRow | None:
        """The newest applied policy (None when none was ever applied)."""
        ...
