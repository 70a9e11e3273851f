"""What a decision returns: directive patches with the events that explain them, and alert events."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from dsec.alerts.model import Severity
from dsec.model import Event, EventType

SOURCE = "control_plane"  # data.source of the alert events DSec raises (a worker's own alerts say "worker")


@dataclass
class Verdict:
    """What one beat changes: a directive patch (merged into one new version) and events to record."""

    patch: dict[str, Any] = field(default_factory=dict)
    events: list[Event] = field(default_factory=list)
    actors: list[str] = field(default_factory=list)
    breaker_issued: bool = False  # the patch carries a breaker level: issue a new version even if unchanged
    breaker_moved: bool = False  # the breaker made a transition (its owner may undo it if nothing is committed)

    def add(self, actor: str, patch: Mapping[str, Any]) -> None:
        self.patch.update(patch)
        if actor not in self.actors:
            self.actors.append(actor)


@dataclass(frozen=True)
class Change:
    """A periodic decision about one worker: a directive patch by ``actor``, recorded with ``events``."""

    worker_id: str
    patch: dict[str, Any]
    actor: str
    events: list[Event]


def alert_event(
    now: float,
    name: str,
    severity: Severity,
    summary: str,
    data: Mapping[str, Any],
    worker_id: str | None = None,
    pool: str | None = None,
) -> Event:
    """An ``alert`` event raised by DSec (routed to the alert sinks once committed)."""
    return Event(
        ts=now,
        type=EventType.ALERT,
        worker_id=worker_id,
        pool=pool,
        # source last: data copied from a worker's event must not carry the worker's attribution (or a forged one)
        data={"name": name, "severity": severity.value, "summary": summary, **data, "source": SOURCE},
    )
