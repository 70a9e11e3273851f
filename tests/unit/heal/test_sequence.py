"""Admission points in a group's sequence of collectives: the period, its confirmation, and what a joiner
inherits."""

from __future__ import annotations

from dsec.heal.sequence import Sequence

PPO_UPDATE = ["grad"] * 32 + ["all_reduce:float64:sum"]


def test_ppo_update_is_the_period_and_admission_is_at_each_update_start() -> None:
    s = Sequence()
    for sig in PPO_UPDATE[:20]:
        s.add(sig)
    assert s.period == 1 and not s.confirmed()  # the inner run of syncs is no period yet
    for sig in PPO_UPDATE[20:] + PPO_UPDATE:
        s.add(sig)
    assert s.period == 33 and not s.confirmed()  # two repetitions, but not min_history past the first
    for sig in PPO_UPDATE:
        s.add(sig)
    assert s.confirmed() and s.pattern() == PPO_UPDATE
    assert s.admission_point(99) and s.admission_point(132) and not s.admission_point(100)
    assert s.next_admission(100) == 132 and s.next_admission(132) == 132 and s.position == 99


def test_one_sync_per_step_admits_anywhere_once_the_history_is_long_enough() -> None:
    s = Sequence(min_history=8)
    for _ in range(8):
        s.add("grad")
    assert not s.confirmed()
    s.add("grad")
    assert s.confirmed() and s.period == 1 and s.admission_point(57)


def test_a_prefix_that_never_repeats_means_no_admission() -> None:
    s = Sequence()
    for sig in ["broadcast:float32:"] + ["grad"] * 50:
        s.add(sig)
    assert not s.confirmed()


def test_a_confirmed_period_that_breaks_disables_admission_for_good() -> None:
    s = Sequence(min_history=3)
    for _ in range(3):
        for sig in ["grad", "grad", "all_reduce:float32:sum"]:
            s.add(sig)
    assert s.confirmed()
    s.add("all_gather:float32:")
    assert s.period is None and not s.admission_point(12)
    s.add("grad")
    assert s.period is None


def test_a_joiner_inherits_the_pattern_and_shares_the_admission_points() -> None:
    old = Sequence(min_history=33)
    for _ in range(2):
        for sig in PPO_UPDATE:
            old.add(sig)
    joiner = Sequence.inherit(old.pattern(), base=old.position)
    assert joiner.confirmed() and joiner.position == old.position == 66
    # Admission points in the group's numbering agree: the joiner counts from its base.
    assert joiner.base + joiner.next_admission(1) == old.next_admission(old.count + 1) == 99
    for sig in PPO_UPDATE:
        joiner.add(sig)
        old.add(sig)
    assert joiner.period == old.period == 33 and joiner.position == old.position
    # A joiner whose first collective differs from the pattern: no admission point is trusted any more.
    bad = Sequence.inherit(old.pattern(), base=66)
    bad.add("all_reduce:float64:sum")
    assert bad.period is None
