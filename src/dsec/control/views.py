"""Live worker records -> the decision core's immutable views."""

from __future__ import annotations

from typing import TYPE_CHECKING

from dsec.control.state import AgedMetrics
from dsec.decide import WorkerView

if TYPE_CHECKING:
    from dsec.control.state import LiveWorker


def view_of(w: LiveWorker) -> WorkerView:
    """What a decision may know of a live worker, frozen at this moment. The view is kept on the record and handed
    out again while the record's parts are the same objects: a live worker's info, directive and metrics are
    swapped when they change, never mutated (beats.py), so the same objects mean the same view. The periodic
    judgments take a view of every active worker (10,000 on a large pool, several passes a second), and most did not
    beat since the last pass; building a view cost ~3 µs each (as a frozen dataclass; less as the named tuple it is
    now)."""
    i, fields, metrics, state = w.info, w.directive.fields, w.metrics, w.state
    kept = w.view_cache
    if kept is not None and kept[0] is i and kept[1] is fields and kept[2] is metrics and kept[3] is state:
        return kept[4]
    # The view reads the metrics' plain dict: the decisions look up names of every worker on every pass.
    plain = metrics.as_dict() if isinstance(metrics, AgedMetrics) else metrics
    view = WorkerView(w.id, i.pool, i.role.value, i.group, i.rank, state, fields, plain, i.device)
    w.view_cache = (i, fields, metrics, state, view)
    return view


def beat_view(w: LiveWorker) -> WorkerView:
    """The view a beat's judgment takes (``dsec.decide.BeatInputs.worker``): who the worker is, its state and the
    directive in force. That judgment reads the beat's own metrics (``BeatInputs.metrics``), never the view's, so a
    kept view is handed out while the worker's info, directive fields and state are the ones it was made from, even
    when its metrics are older: every beat swaps the metrics, so a view as of the beat was a new one for every beat
    (~3 µs of a batch item's ~29, measured while views were frozen dataclasses). Without a good kept view, one is
    built and kept (rare: the first beat, or the first after a new directive or a state change). Views built for
    every beat and not kept (as before) only lived long enough, with the metrics they held, for the garbage collector
    to move them to its oldest generation, whose full collections (~170 ms over 10,000 workers' records) then came
    sooner."""
    kept = w.view_cache
    if kept is not None and kept[0] is w.info and kept[1] is w.directive.fields and kept[3] is w.state:
        return kept[4]
    return view_of(w)
