"""AlertGrouper with a hand-driven clock: batching, group interval, repeat suppression, forgetting."""

from __future__ import annotations

from collections import defaultdict
from itertools import pairwise

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dsec.alerts import Alert, AlertGrouper, Notification, Severity


def alert(worker: str = "w-1", name: str = "episode_stuck", pool: str | None = "pool-a", ts: float = 0.0) -> Alert:
    return Alert(name, Severity.WARNING, ts=ts, pool=pool, worker_id=worker)


def workers(note: Notification) -> list[str | None]:
    return [a.worker_id for a in note.alerts]


def test_group_wait_batches_alerts_arriving_together() -> None:
    g = AlertGrouper(group_wait_s=1.0, group_interval_s=5.0, repeat_interval_s=300.0)
    for t, w in [(0.0, "w-1"), (0.3, "w-2"), (0.9, "w-3")]:
        g.add(alert(w), now=t)
        assert g.due(t) == []
    assert g.next_due(0.9) == 1.0
    assert g.due(0.99) == []
    [note] = g.due(1.0)
    assert note.group == ("pool-a", "episode_stuck")
    assert workers(note) == ["w-1", "w-2", "w-3"]
    assert (note.first_seen, note.count, note.at) == (0.0, 0, 1.0)
    assert g.due(1.0) == [] and g.pending == 0


def test_groups_are_per_pool_and_name() -> None:
    g = AlertGrouper(group_wait_s=1.0)
    g.add(alert("w-1"), 0)
    g.add(alert("w-2", pool="pool-b"), 0)
    g.add(alert("w-3", name="oom"), 0)
    g.add(alert("w-4", pool=None), 0)
    notes = g.due(1.0)
    assert {n.group: workers(n) for n in notes} == {
        ("pool-a", "episode_stuck"): ["w-1"],
        ("pool-b", "episode_stuck"): ["w-2"],
        ("pool-a", "oom"): ["w-3"],
        (None, "episode_stuck"): ["w-4"],
    }


def test_new_alerts_joining_a_notified_group_wait_for_group_interval() -> None:
    g = AlertGrouper(group_wait_s=1.0, group_interval_s=5.0, repeat_interval_s=300.0)
    g.add(alert("w-1"), 0.0)
    assert workers(g.due(1.0)[0]) == ["w-1"]
    g.add(alert("w-2"), 2.0)
    g.add(alert("w-3"), 4.0)
    assert g.next_due(4.0) == 6.0
    assert g.due(5.99) == []
    [note] = g.due(6.0)
    assert workers(note) == ["w-2", "w-3"]
    assert note.first_seen == 0.0
    g.add(alert("w-4"), 20.0)  # the interval is long over: sent at the next due()
    assert workers(g.due(20.0)[0]) == ["w-4"]


def test_repeats_are_suppressed_until_repeat_interval_then_sent_newest_with_count() -> None:
    g = AlertGrouper(group_wait_s=1.0, group_interval_s=5.0, repeat_interval_s=300.0)
    g.add(alert("w-1", ts=0.0), 0.0)
    g.due(1.0)
    for t in (2.0, 3.0, 4.0):
        g.add(alert("w-1", ts=t), t)
    assert g.due(6.0) == [] and g.due(300.99) == []
    assert g.pending == 1 and g.suppressed == 2
    assert g.next_due(10.0) == 301.0
    [note] = g.due(301.0)
    assert [a.ts for a in note.alerts] == [4.0]  # the newest instance
    assert note.count == 2  # the two older repeats it stands for
    assert g.received == 4


def test_a_repeat_rides_along_with_a_new_alert_only_once_its_interval_is_over() -> None:
    g = AlertGrouper(group_wait_s=0.0, group_interval_s=5.0, repeat_interval_s=12.0)
    g.add(alert("w-1"), 0.0)
    g.due(0.0)
    g.add(alert("w-1"), 1.0)
    g.add(alert("w-2"), 1.0)
    assert workers(g.due(5.0)[0]) == ["w-2"]  # w-1 is still inside its repeat interval
    g.add(alert("w-2"), 6.0)
    assert g.due(10.0) == []
    [note] = g.due(12.0)
    assert workers(note) == ["w-1"] and note.count == 0
    [note] = g.due(17.0)
    assert workers(note) == ["w-2"]


def test_flapping_worker_100_alerts_in_10_s_gives_one_notification_then_one_per_repeat() -> None:
    g = AlertGrouper(group_wait_s=1.0, group_interval_s=5.0, repeat_interval_s=300.0)
    notes: list[Notification] = []
    for i in range(100):  # every 100 ms for 10 s, due() polled at every arrival
        t = i / 10
        g.add(alert("w-flap", ts=t), t)
        notes += g.due(t)
    notes += g.due(10.0)
    # One notification at 1.0 s: the 11 arrivals of 0.0..1.0 s as one alert with count 10.
    assert [(n.at, len(n.alerts), n.count) for n in notes] == [(1.0, 1, 10)]
    notes += g.due(300.99)
    assert len(notes) == 1
    notes += g.due(301.0)
    # Then one at 301 s: the newest of the remaining 89 arrivals, the other 88 counted.
    assert [(n.at, len(n.alerts), n.count) for n in notes] == [(1.0, 1, 10), (301.0, 1, 88)]
    assert notes[1].alerts[0].ts == 9.9
    assert sum(len(n.alerts) + n.count for n in notes) == 100


def test_quiet_groups_are_forgotten_and_start_over_with_group_wait() -> None:
    g = AlertGrouper(group_wait_s=1.0, group_interval_s=5.0, repeat_interval_s=30.0)
    g.add(alert("w-1"), 0.0)
    g.due(1.0)
    g.due(30.99)
    assert g.groups == 1
    g.due(31.0)
    assert g.groups == 0 and g.next_due(31.0) is None
    g.add(alert("w-1"), 40.0)
    assert g.due(40.5) == []
    [note] = g.due(41.0)
    assert note.first_seen == 40.0


def test_flush_ignores_group_timers_but_not_repeat_interval() -> None:
    g = AlertGrouper(group_wait_s=10.0, group_interval_s=10.0, repeat_interval_s=100.0)
    g.add(alert("w-1"), 0.0)
    [note] = g.flush(0.0)
    assert workers(note) == ["w-1"]
    g.add(alert("w-1"), 1.0)
    g.add(alert("w-2"), 1.0)
    [note] = g.flush(1.0)
    assert workers(note) == ["w-2"]
    assert g.pending == 1


@pytest.mark.parametrize("name", ["group_wait_s", "group_interval_s", "repeat_interval_s"])
@pytest.mark.parametrize("value", [-1.0, float("inf"), True])
def test_bad_intervals_name_the_parameter(name: str, value: float) -> None:
    with pytest.raises(ValueError, match=f"{name}="):
        AlertGrouper(**{name: value})


# -- properties --------------------------------------------------------------------------------------
QUARTER = 0.25  # times are multiples of 1/4 s: exact in binary, so the comparisons below are exact

arrival = st.tuples(
    # quarters of a second since the previous step: mostly bursts, sometimes long quiet spells
    st.one_of(st.integers(0, 4), st.integers(0, 200)),
    st.booleans(),  # True: add an alert; False: poll due()
    st.sampled_from(["pool-a", "pool-b"]),
    st.sampled_from(["stuck", "oom"]),
    st.sampled_from(["w-1", "w-2", "w-3"]),
)


@settings(max_examples=200, deadline=None)
@given(
    gw=st.integers(0, 8),
    gi=st.integers(1, 40),
    ri=st.integers(0, 160),
    steps=st.lists(arrival, min_size=10, max_size=120),
)
def test_group_interval_and_repeat_interval_hold_and_no_alert_is_lost(
    gw: int, gi: int, ri: int, steps: list[tuple[int, bool, str, str, str]]
) -> None:
    g = AlertGrouper(group_wait_s=gw * QUARTER, group_interval_s=gi * QUARTER, repeat_interval_s=ri * QUARTER)
    now = 0.0
    added = 0
    first_arrival: dict[tuple[str | None, str], float] = {}
    notes: list[Notification] = []
    for dt, add, pool, name, worker in steps:
        now += dt * QUARTER
        if add:
            g.add(alert(worker, name=name, pool=pool, ts=now), now)
            first_arrival.setdefault((pool, name), now)
            added += 1
        else:
            notes += g.due(now)
    notes += g.due(now + (gw + gi + ri + 1) * QUARTER)  # long enough for everything still held

    by_group: dict[tuple[str | None, str], list[float]] = defaultdict(list)
    sent_at: dict[tuple[str, str | None, str | None], list[float]] = defaultdict(list)
    for n in notes:
        assert n.alerts, "a notification always carries at least one alert"
        assert len({a.key for a in n.alerts}) == len(n.alerts)
        assert all((a.pool, a.name) == n.group for a in n.alerts)
        by_group[n.group].append(n.at)
        for a in n.alerts:
            sent_at[a.key].append(n.at)
    for group, times in by_group.items():
        assert times[0] >= first_arrival[group] + gw * QUARTER
        assert all(b - a >= gi * QUARTER for a, b in pairwise(times)), (group, times)
    for key, times in sent_at.items():
        assert all(b - a >= ri * QUARTER for a, b in pairwise(times)), (key, times)
    # Every arrival was either sent or counted in a notification.
    assert g.pending == 0
    assert sum(len(n.alerts) + n.count for n in notes) == added == g.received
    assert sum(n.count for n in notes) == g.suppressed
