"""The small interfaces the control plane's parts are given instead of the whole ``ControlPlane``.

Each part (policies, scheduling, gauges, beats, reconcile) depends on the few operations it uses; the composition
root (``service.ControlPlane``, built by ``app.create_app``) wires the implementations. A part can be driven in a
test with any object that has these methods.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Protocol

from dsec.model import Device, Directive, Event, EventType, Pool

if TYPE_CHECKING:
    from dsec.control.schemas import Beat
    from dsec.control.state import LiveWorker
    from dsec.control.store import WriteBatch
    from dsec.decide import PoolGauges, WorkerGauges


class Clock(Protocol):
    def __call__(self) -> float: ...


class EventLog(Protocol):
    """Durable events: recorded before they are acted on, read back in id order."""

    async def record_events(self, events: list[Event]) -> list[int]: ...

    async def commit(self, batch: WriteBatch) -> list[int]:
        """A change and the events recording it, in one transaction (through the group-commit writer)."""
        ...

    def observe(self, events: Iterable[Event]) -> None:
        """What committed events change in the hot state (``commit`` leaves that to the caller)."""
        ...

    def iter_events(self, *etypes: EventType, since: float | None = None) -> Iterable[Event]: ...


class DirectiveWriter(Protocol):
    async def set_directive(
        self, w: LiveWorker, patch: Mapping[str, Any], actor: str, extra_events: Sequence[Event] = ()
    ) -> Directive: ...


class PoolWriter(Protocol):
    async def put_pool(self, pool: Pool, actor: str = "api", events: Sequence[Event] = ()) -> Pool: ...


class DeviceWriter(Protocol):
    async def put_device(self, device: Device, events: Sequence[Event] = ()) -> Device: ...


class FleetView(Protocol):
    """What the last fleet judgment found: workers it could judge on speed, and each worker's outlier features."""

    judged: set[str]
    flags: dict[str, set[str]]


class GaugeSource(Protocol):
    def pool_gauges(self) -> dict[str, PoolGauges]: ...

    def worker_gauges(self) -> list[WorkerGauges]: ...


class HeartbeatEndpoint(Protocol):
    """What the heartbeat hot path (``ingest.handle_heartbeat``, ``ingest.handle_batch``) calls."""

    def worker_for(self, worker_id: str, token: str | None, read: bool = False) -> LiveWorker: ...

    def batch_sender(self, token: str | None) -> None: ...

    def commits_together(self) -> AbstractContextManager[None]: ...

    async def heartbeat(self, w: LiveWorker, req: Beat) -> dict[str, Any]: ...
