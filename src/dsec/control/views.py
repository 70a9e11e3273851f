"""Live worker records -> the decision core's immutable views."""

from __future__ import annotations

from typing import TYPE_CHECKING

from dsec.decide import WorkerView

if TYPE_CHECKING:
    from dsec.control.state import LiveWorker


def view_of(w: LiveWorker) -> WorkerView:
    """What a decision may know of a live worker, frozen at this moment."""
    i = w.info
    return WorkerView(w.id, w.pool, i.role.value, i.group, i.rank, w.state, w.directive.fields, w.metrics, i.device)
