"""DSEC_CHAOS: the fault-injection spec parser (every fault kind, every error) and the ``Chaos`` runtime
(windows on an injected clock, rank filtering, start/stop events at the scheduled wall-clock times, and
memory growth that really grows and then releases the process's resident memory)."""

from __future__ import annotations

import gc
import math
import re
from typing import Any

import psutil
import pytest

from dsec.probe.chaos import KINDS, Chaos, ChaosError, Fault, parse

WALL0 = 1_700_000_000.0


class FakeClock:
    """A monotonic clock the test advances by hand."""

    def __init__(self) -> None:
        self.t = 100.0  # any origin: Chaos measures from its own start

    def __call__(self) -> float:
        return self.t

    def advance(self, dt: float) -> None:
        self.t += dt


def make(spec: str, rank: int | None = None) -> tuple[Chaos, FakeClock, list[dict[str, Any]]]:
    clock = FakeClock()
    chaos = Chaos(parse(spec), rank=lambda: rank, clock=clock, wall=lambda: WALL0)
    return chaos, clock, []


# -- parsing -----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("spec", "kind", "value"),
    [
        ("sync_delay_ms=200", "sync_delay_ms", 200.0),
        ("memory_growth_mb_per_s=50", "memory_growth_mb_per_s", 50.0),
        ("interrupt_episodes=collision", "interrupt_episodes", "collision"),
        ("interrupt_episodes=sim_crash", "interrupt_episodes", "sim_crash"),
        ("grad_spike=1e3", "grad_spike", 1000.0),
        ("grad_spike=0.5", "grad_spike", 0.5),
    ],
)
def test_each_fault_kind_parses_with_default_window(spec: str, kind: str, value: float | str) -> None:
    (f,) = parse(spec)
    assert f == Fault(kind=kind, value=value)
    assert (f.rank, f.after_s, f.for_s, f.every_s, f.max_mb) == (None, 0.0, math.inf, None, 1024.0)
    assert f.kind in KINDS


def test_window_keys_whitespace_and_several_clauses() -> None:
    faults = parse(
        " sync_delay_ms = 150 , rank=1, after_s=20,for_s=30 ;"
        "memory_growth_mb_per_s=50,max_mb=64,after_s=5,every_s=10,for_s=4;  ;"
        "interrupt_episodes=collision,rank=0;"
    )
    assert faults == (
        Fault("sync_delay_ms", 150.0, rank=1, after_s=20.0, for_s=30.0),
        Fault("memory_growth_mb_per_s", 50.0, after_s=5.0, for_s=4.0, every_s=10.0, max_mb=64.0),
        Fault("interrupt_episodes", "collision", rank=0),
    )
    assert faults[0].describe() == "sync_delay_ms=150.0,rank=1"
    assert faults[1].describe() == "memory_growth_mb_per_s=50.0"


def test_empty_spec_means_no_faults() -> None:
    assert parse("") == ()
    assert parse(" ; ;") == ()
    assert Chaos.from_env(None, rank=lambda: 0) is None
    assert Chaos.from_env("   ", rank=lambda: 0) is None
    chaos = Chaos.from_env("grad_spike=3", rank=lambda: 0)
    assert chaos is not None and chaos.grad_factor() == 3.0


def test_for_s_equal_to_every_s_is_allowed() -> None:
    (f,) = parse("grad_spike=2,every_s=5,for_s=5")
    assert (f.every_s, f.for_s) == (5.0, 5.0)


def _raises(spec: str, *fragments: str) -> str:
    with pytest.raises(ChaosError) as info:
        parse(spec)
    msg = str(info.value)
    for fragment in fragments:
        assert fragment in msg, msg
    return msg


@pytest.mark.parametrize(
    ("spec", "fragments"),
    [
        # unknown key, named with the clause and the accepted keys
        ("sync_delay_ms=5,delay=3", ["clause 'sync_delay_ms=5,delay=3'", "unknown key 'delay'", "'max_mb'"]),
        # missing '=' / empty key
        ("sync_delay_ms=5,rank", ["'rank' is not key=value"]),
        ("sync_delay_ms", ["'sync_delay_ms' is not key=value"]),
        ("=5", ["'=5' is not key=value"]),
        # two kinds in one clause, and no kind at all
        ("sync_delay_ms=5,grad_spike=2", ["expected exactly one fault kind", "'grad_spike'"]),
        ("rank=1,after_s=3", ["clause 'rank=1,after_s=3'", "expected exactly one fault kind"]),
        # bad numbers
        ("sync_delay_ms=fast", ["sync_delay_ms='fast' is not a number"]),
        ("grad_spike=2,after_s=soon", ["after_s='soon' is not a number"]),
        ("sync_delay_ms=nan", ["sync_delay_ms='nan' must be a finite number >= 0"]),
        ("sync_delay_ms=inf", ["must be a finite number >= 0"]),
        # negative
        ("sync_delay_ms=-5", ["sync_delay_ms='-5' must be a finite number >= 0"]),
        ("grad_spike=2,after_s=-1", ["after_s='-1' must be a finite number >= 0"]),
        ("memory_growth_mb_per_s=1,max_mb=-1", ["max_mb='-1' must be a finite number >= 0"]),
        ("grad_spike=2,for_s=0", ["for_s='0' must be a finite number >= 0.001"]),
        ("grad_spike=2,every_s=0,for_s=0.001", ["every_s='0' must be a finite number >= 0.001"]),
        # rank not an int
        ("sync_delay_ms=5,rank=1.5", ["rank='1.5' must be a non-negative integer"]),
        ("sync_delay_ms=5,rank=-1", ["rank='-1' must be a non-negative integer"]),
        ("sync_delay_ms=5,rank=one", ["rank='one' must be a non-negative integer"]),
        ("sync_delay_ms=5,rank=", ["rank='' must be a non-negative integer"]),
        # for_s > every_s
        ("grad_spike=2,every_s=5,for_s=6", ["for_s=6 must not exceed every_s=5"]),
        # duplicate key
        ("sync_delay_ms=5,rank=1,rank=2", ["'rank' given twice"]),
        ("sync_delay_ms=5,sync_delay_ms=6", ["'sync_delay_ms' given twice"]),
        # syncs: a positive integer, for sync_delay_ms without every_s
        ("sync_delay_ms=5,syncs=0", ["syncs='0' must be a positive integer"]),
        ("sync_delay_ms=5,syncs=2.5", ["syncs='2.5' must be a positive integer"]),
        ("grad_spike=2,syncs=3", ["syncs applies to sync_delay_ms without every_s (not grad_spike)"]),
        ("sync_delay_ms=5,syncs=3,for_s=1,every_s=2", ["syncs applies to sync_delay_ms without every_s"]),
        # bad interrupt reason
        ("interrupt_episodes=sim-crash", ["interrupt_episodes='sim-crash' must be a word"]),
        ("interrupt_episodes=", ["interrupt_episodes='' must be a word"]),
        ("interrupt_episodes=a b", ["must be a word"]),
    ],
)
def test_every_error_names_the_clause_and_the_problem(spec: str, fragments: list[str]) -> None:
    msg = _raises(spec, *fragments)
    assert msg.startswith("DSEC_CHAOS clause "), msg


def test_the_error_names_the_offending_clause_not_a_valid_one() -> None:
    _raises("grad_spike=2; sync_delay_ms=oops,rank=1", "clause 'sync_delay_ms=oops,rank=1'")


def test_a_rank_of_unicode_digits_is_a_chaos_error() -> None:
    # '²'.isdigit() is True but int('²') raises: it must still be a ChaosError naming the clause (the
    # probe and the CLI only catch ChaosError), not a bare int() ValueError.
    _raises("sync_delay_ms=5,rank=²", "rank='²' must be a non-negative integer")


def test_every_s_without_for_s_says_that_for_s_is_needed() -> None:
    msg = _raises("grad_spike=2,every_s=10", "every_s=10", "for_s")
    assert "inf" not in msg, msg  # the user never wrote for_s=inf


def test_chaos_error_is_a_value_error() -> None:
    assert issubclass(ChaosError, ValueError)


# -- windows -------------------------------------------------------------------------------------------
def test_window_index_with_after_for_and_every() -> None:
    f = Fault("grad_spike", 2.0, after_s=10.0, for_s=2.0, every_s=5.0)
    expected = {0.0: None, 9.99: None, 10.0: 0, 11.99: 0, 12.0: None, 14.99: None, 15.0: 1, 16.5: 1, 17.5: None}
    assert {t: f.window_index(t) for t in expected} == expected
    once = Fault("grad_spike", 2.0, after_s=1.0, for_s=2.0)
    assert [once.window_index(t) for t in (0.5, 1.0, 2.9, 3.0, 100.0)] == [None, 0, 0, None, None]
    forever = Fault("grad_spike", 2.0, after_s=1.0)
    assert [forever.window_index(t) for t in (0.0, 1.0, 1e6)] == [None, 0, 0]


def test_hooks_follow_the_window_on_the_injected_clock() -> None:
    chaos, clock, _ = make(
        "sync_delay_ms=200,after_s=2,for_s=3; grad_spike=50,after_s=1,for_s=1,every_s=4; "
        "interrupt_episodes=collision,after_s=5"
    )
    seen = []
    for _ in range(12):  # t = 0 .. 5.5 in steps of 0.5
        seen.append((clock.t - 100.0, chaos.sync_delay_s(), chaos.grad_factor(), chaos.interrupt_reason()))
        clock.advance(0.5)
    by_t = {t: rest for t, *rest in seen}
    assert by_t[0.0] == [0.0, 1.0, None]
    assert by_t[1.0] == [0.0, 50.0, None]
    assert by_t[1.5] == [0.0, 50.0, None]
    assert by_t[2.0] == [pytest.approx(0.2), 1.0, None]
    assert by_t[4.5] == [pytest.approx(0.2), 1.0, None]
    assert by_t[5.0] == [0.0, 50.0, "collision"]  # second grad_spike window (1 + 4), sync delay over
    assert by_t[5.5] == [0.0, 50.0, "collision"]


def test_a_window_with_syncs_lasts_until_that_many_syncs_were_delayed() -> None:
    # A learner whose update phase comes after the scheduled window (a slow rollout on a loaded machine) still
    # gets its delayed syncs; one that syncs often inside the window keeps the scheduled length.
    late, clock, events = make("sync_delay_ms=150,after_s=1,for_s=2,syncs=3")
    clock.advance(10)  # the window [1, 3) passed without a sync
    assert [late.sync_delay_s() for _ in range(4)] == [pytest.approx(0.15)] * 3 + [0.0]
    late.poll(events.append)
    assert events == []  # started and ended between two polls: nothing announced
    busy, clock, _ = make("sync_delay_ms=150,after_s=1,for_s=2,syncs=3")
    clock.advance(1)
    assert [busy.sync_delay_s() for _ in range(5)] == [pytest.approx(0.15)] * 5  # inside: every sync
    clock.advance(2)
    assert busy.sync_delay_s() == 0.0  # owed nothing: the scheduled end holds
    plain, clock, _ = make("sync_delay_ms=150,after_s=1,for_s=2")
    clock.advance(10)
    assert plain.sync_delay_s() == 0.0  # without syncs: the schedule alone


def test_a_stretched_window_reports_its_end_at_its_last_delayed_sync() -> None:
    chaos, clock, events = make("sync_delay_ms=150,after_s=1,for_s=2,syncs=2")
    clock.advance(1.5)
    chaos.poll(events.append)
    assert chaos.sync_delay_s() == pytest.approx(0.15)
    clock.advance(4)  # t = 5.5: past the schedule, one sync still owed
    chaos.poll(events.append)
    assert len(events) == 1  # still open
    assert chaos.sync_delay_s() == pytest.approx(0.15)
    clock.advance(1)
    chaos.poll(events.append)
    assert events == [
        {"chaos": "start", "fault": "sync_delay_ms=150.0", "window": 0, "at": WALL0 + 1.0},
        {"chaos": "stop", "fault": "sync_delay_ms=150.0", "window": 0, "at": WALL0 + 5.5},
    ]


def test_rank_filter() -> None:
    spec = "sync_delay_ms=100,rank=1; grad_spike=7,rank=0; interrupt_episodes=reset"
    rank1, _, _ = make(spec, rank=1)
    rank0, _, _ = make(spec, rank=0)
    unknown, _, _ = make(spec, rank=None)
    assert (rank1.sync_delay_s(), rank1.grad_factor(), rank1.interrupt_reason()) == (0.1, 1.0, "reset")
    assert (rank0.sync_delay_s(), rank0.grad_factor(), rank0.interrupt_reason()) == (0.0, 7.0, "reset")
    # A rank-bound fault does not fire on a process that does not know its rank; a rank-free one does.
    assert (unknown.sync_delay_s(), unknown.grad_factor(), unknown.interrupt_reason()) == (0.0, 1.0, "reset")


def test_rank_given_by_the_hook_is_used_when_the_probe_does_not_know_its_rank() -> None:
    # probe/ddp.py calls sync_delay_s(self.rank): the collective knows its rank even before the probe does.
    chaos, _, _ = make("sync_delay_ms=100,rank=1", rank=None)
    assert chaos.sync_delay_s(1) == pytest.approx(0.1)
    assert chaos.sync_delay_s(0) == 0.0
    # When the probe knows its rank, that rank decides.
    known, _, _ = make("sync_delay_ms=100,rank=1", rank=0)
    assert known.sync_delay_s(1) == 0.0


def test_rank_is_asked_each_time() -> None:
    rank: list[int | None] = [None]
    clock = FakeClock()
    chaos = Chaos(parse("grad_spike=4,rank=2"), rank=lambda: rank[0], clock=clock, wall=lambda: WALL0)
    assert chaos.grad_factor() == 1.0
    rank[0] = 2  # torch.distributed initialised later
    assert chaos.grad_factor() == 4.0


# -- poll: start/stop events ---------------------------------------------------------------------------
def test_poll_emits_start_and_stop_with_the_scheduled_wall_clock_time() -> None:
    chaos, clock, events = make("sync_delay_ms=150,rank=1,after_s=20,for_s=30", rank=1)
    chaos.poll(events.append)
    assert events == []
    clock.advance(21.3)  # polled late: the event still says when the window was scheduled to start
    chaos.poll(events.append)
    assert events == [{"chaos": "start", "fault": "sync_delay_ms=150.0,rank=1", "window": 0, "at": WALL0 + 20.0}]
    clock.advance(5)
    chaos.poll(events.append)
    assert len(events) == 1  # nothing new inside the window
    clock.advance(30)
    chaos.poll(events.append)
    assert events[1] == {"chaos": "stop", "fault": "sync_delay_ms=150.0,rank=1", "window": 0, "at": WALL0 + 50.0}
    clock.advance(100)
    chaos.poll(events.append)
    assert len(events) == 2


def test_poll_reports_each_repetition() -> None:
    chaos, clock, events = make("grad_spike=3,after_s=1,for_s=1,every_s=3")
    for _ in range(9):  # t = 0 .. 8 step 1: windows [1,2), [4,5), [7,8)
        chaos.poll(events.append)
        clock.advance(1.0)
    assert [(e["chaos"], e["window"], e["at"] - WALL0) for e in events] == [
        ("start", 0, 1.0),
        ("stop", 0, 2.0),
        ("start", 1, 4.0),
        ("stop", 1, 5.0),
        ("start", 2, 7.0),
        ("stop", 2, 8.0),
    ]


def test_back_to_back_windows_emit_stop_then_start() -> None:
    chaos, clock, events = make("grad_spike=3,for_s=2,every_s=2")
    chaos.poll(events.append)
    clock.advance(2.5)
    chaos.poll(events.append)
    assert [(e["chaos"], e["window"], e["at"] - WALL0) for e in events] == [
        ("start", 0, 0.0),
        ("stop", 0, 2.0),
        ("start", 1, 2.0),
    ]


def test_poll_skips_faults_for_other_ranks() -> None:
    chaos, _, events = make("sync_delay_ms=100,rank=1; grad_spike=2", rank=0)
    chaos.poll(events.append)
    assert [e["fault"] for e in events] == ["grad_spike=2.0"]


# -- memory growth -------------------------------------------------------------------------------------
def _rss_mb() -> float:
    return float(psutil.Process().memory_info().rss) / 2**20


def test_memory_growth_really_grows_rss_and_releases_it_when_the_window_ends() -> None:
    chaos, clock, events = make("memory_growth_mb_per_s=50,max_mb=64,after_s=1,for_s=3")
    gc.collect()
    before = _rss_mb()
    chaos.poll(events.append)
    assert chaos.ballast_mb == 0  # not started yet
    clock.advance(1.0)
    chaos.poll(events.append)  # window starts: growth is measured from here
    assert chaos.ballast_mb == 0
    clock.advance(1.0)
    chaos.poll(events.append)
    assert chaos.ballast_mb == pytest.approx(50, abs=1)
    grown = _rss_mb()
    assert grown - before >= 40, (before, grown)
    clock.advance(1.0)
    chaos.poll(events.append)
    assert chaos.ballast_mb == 64  # capped at max_mb
    peak = _rss_mb()
    assert peak >= grown - 1
    clock.advance(1.5)  # t = 4.5: the window [1, 4) is over
    chaos.poll(events.append)
    assert chaos.ballast_mb == 0
    gc.collect()
    after = _rss_mb()
    assert peak - after >= 40, (before, peak, after)
    assert [e["chaos"] for e in events] == ["start", "stop"]


def test_memory_growth_is_not_lost_to_frequent_polls() -> None:
    # 50 MB/s polled every 10 ms adds 0.5 MB per poll: the fractions must add up, not be truncated away.
    chaos, clock, events = make("memory_growth_mb_per_s=50,max_mb=64")
    for _ in range(101):
        chaos.poll(events.append)
        clock.advance(0.01)
    assert chaos.ballast_mb == pytest.approx(50, abs=1.5)
    clock.advance(10)
    chaos.poll(events.append)
    assert chaos.ballast_mb == 64


def test_memory_growth_only_on_the_faulty_rank() -> None:
    chaos, clock, events = make("memory_growth_mb_per_s=50,max_mb=8,rank=3", rank=0)
    for _ in range(3):
        chaos.poll(events.append)
        clock.advance(1.0)
    assert chaos.ballast_mb == 0 and events == []


def test_other_kinds_do_not_grow_memory() -> None:
    chaos, clock, events = make("sync_delay_ms=100; grad_spike=2; interrupt_episodes=collision")
    for _ in range(3):
        chaos.poll(events.append)
        clock.advance(1.0)
    assert chaos.ballast_mb == 0
    assert sorted(e["fault"] for e in events) == [
        "grad_spike=2.0",
        "interrupt_episodes=collision",
        "sync_delay_ms=100.0",
    ]


# -- hooks outside windows -----------------------------------------------------------------------------
def test_neutral_values_outside_every_window() -> None:
    chaos, clock, _ = make("sync_delay_ms=100,after_s=5; grad_spike=9,after_s=5; interrupt_episodes=x,after_s=5")
    assert (chaos.sync_delay_s(), chaos.grad_factor(), chaos.interrupt_reason()) == (0.0, 1.0, None)
    clock.advance(5)
    assert (chaos.sync_delay_s(), chaos.grad_factor(), chaos.interrupt_reason()) == (0.1, 9.0, "x")


def test_describe_is_what_the_events_carry() -> None:
    (f,) = parse("interrupt_episodes=collision,rank=2")
    assert re.fullmatch(r"interrupt_episodes=collision,rank=2", f.describe())
