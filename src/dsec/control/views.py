"""Live worker records -> the decision core's immutable views."""

from __future__ import annotations

from typing import TYPE_CHECKING

from dsec.control.state import AgedMetrics
from dsec.decide import WorkerView

if TYPE_CHECKING:
    from dsec.control.state import LiveWorker


def view_of(w: LiveWorker, keep: bool = True) -> WorkerView:
    """What a decision may know of a live worker, frozen at this moment. The view is kept on the record and handed
    out again while the record's parts are the same objects: a live worker's info, directive and metrics are
    swapped when they change, never mutated (beats.py), so the same objects mean the same view. The periodic
    judgments take a view of every active worker (10,000 on a large pool, several passes a second), and most did not
    beat since the last pass; building a frozen view cost ~3 µs each.

    ``keep=False`` (a beat's judgment): the kept view if it is still good, else a new one that is not kept. A beat
    swaps the metrics right after its judgment, so a view kept then could never be handed out again; keeping it
    only kept it (and the metrics it was made from) alive long enough for the garbage collector to move them to the
    oldest generation, whose full collections (~170 ms each over 10,000 workers' records) came that much sooner."""
    i, fields, metrics, state = w.info, w.directive.fields, w.metrics, w.state
    kept = w.view_cache
    if kept is not None and kept[0] is i and kept[1] is fields and kept[2] is metrics and kept[3] is state:
        return kept[4]
    # The view reads the metrics' plain dict: the decisions look up names of every worker on every pass.
    plain = metrics.as_dict() if isinstance(metrics, AgedMetrics) else metrics
    view = WorkerView(w.id, i.pool, i.role.value, i.group, i.rank, state, fields, plain, i.device)
    if keep:
        w.view_cache = (i, fields, metrics, state, view)
    return view
