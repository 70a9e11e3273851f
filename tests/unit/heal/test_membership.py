"""The healing group's membership state machine: forming, failure and quorum, the interrupted collective's
resolution, admission of replacements, fencing, the join timeout, and rebuilding after an executor restart."""

from __future__ import annotations

import pytest

from dsec.heal.membership import Fenced, Group, Invalid, Join, Phase, Plan


def _join(rank: int, completed: int = 0, epoch: int = 0, inc: str | None = None, **kw: object) -> Join:
    return Join(rank, inc or f"p{rank}", f"127.0.0.1:{9000 + rank}", completed=completed, epoch=epoch, **kw)  # type: ignore[arg-type]


def _formed(notes: list[dict[str, object]]) -> Plan:
    (note,) = [n for n in notes if n["what"] == "formed"]
    return Plan.from_dict(note)  # type: ignore[arg-type]


def _started(world: int = 4) -> Group:
    g = Group(world=world, join_timeout_s=2.0)
    for r in range(world - 1):
        assert g.join(_join(r), now=0.0) == []
    plan = _formed(g.join(_join(world - 1), now=0.0))
    assert plan.epoch == 1 and plan.members == tuple(range(world)) and plan.reason == "start"
    assert plan.source == 0 and plan.store == "127.0.0.1:9000" and g.phase is Phase.STABLE
    return g


def test_the_first_epoch_forms_when_every_rank_joined() -> None:
    _started()


def test_a_known_dead_rank_is_not_waited_for() -> None:
    g = _started()
    notes = g.fail(1, now=10.0, dead_rank=2, reason="exit -9")
    assert notes[0]["what"] == "broken" and g.phase is Phase.BROKEN
    assert g.join(_join(0, completed=40, epoch=1), now=10.1) == []
    assert g.join(_join(1, completed=40, epoch=1), now=10.1) == []
    plan = _formed(g.join(_join(3, completed=40, epoch=1), now=10.2))
    assert plan.epoch == 2 and plan.members == (0, 1, 3) and plan.dead == (2,) and plan.reason == "failure"
    assert plan.behind == () and plan.completed == 40


def test_a_member_that_finished_the_interrupted_collective_is_the_source_for_the_others() -> None:
    g = _started()
    g.fail(1, now=5.0, dead_rank=0)
    g.join(_join(1, completed=7, epoch=1), now=5.0)
    g.join(_join(2, completed=8, epoch=1), now=5.0)  # its collective 7 completed before the death
    plan = _formed(g.join(_join(3, completed=7, epoch=1), now=5.0))
    assert plan.completed == 8 and plan.source == 2 and plan.behind == (1, 3)
    assert plan.store == "127.0.0.1:9002"


def test_a_member_joining_first_breaks_the_epoch_and_unknown_deaths_wait_for_the_timeout() -> None:
    g = _started(3)
    assert g.join(_join(0, completed=3, epoch=1), now=1.0)[0]["what"] == "broken"
    assert g.join(_join(1, completed=3, epoch=1), now=1.5) == []
    assert g.tick(now=2.9) == [] and g.deadline() == 3.0
    plan = _formed(g.tick(now=3.0))
    assert plan.members == (0, 1) and plan.dead == (2,)
    # The rank that never joined was declared dead: it is fenced if it shows up later.
    with pytest.raises(Fenced, match="declared dead"):
        g.join(_join(2, completed=3, epoch=1), now=4.0)


def test_a_replacement_waits_then_is_admitted_when_every_member_reached_the_point() -> None:
    g = _started(3)
    g.fail(1, now=1.0, dead_rank=1)
    g.join(_join(0, completed=10, epoch=1), now=1.0)
    _formed(g.join(_join(2, completed=10, epoch=1), now=1.0))
    notes = g.join(_join(1, inc="p1-new", replacement=True), now=3.0)
    assert notes[0]["what"] == "waiting" and g.view()["joiners"] == [1]
    assert g.admit(0, "p0", epoch=2, completed=33, now=3.5) == [] and g.phase is Phase.ADMITTING
    plan = _formed(g.admit(2, "p2", epoch=2, completed=33, now=3.6))
    assert plan.epoch == 3 and plan.members == (0, 1, 2) and plan.joiners == (1,) and plan.completed == 33
    assert plan.source == 0 and plan.behind == () and plan.reason == "admission"
    assert g.members[1].incarnation == "p1-new"


def test_an_admission_after_a_member_was_behind_is_no_divergence() -> None:
    # At the failure rank 2 was one behind, blocked at another collective than the source (it receives the source's
    # result). The admission that follows finds every member at the same agreed point: no divergence (the stale
    # pending of the failure read as one, and failed every rank of a healed group; seen in test_heal).
    g = _started(3)
    g.fail(1, now=1.0, dead_rank=1)
    g.join(_join(0, completed=244, epoch=1, pending="grad"), now=1.0)
    failure = _formed(g.join(_join(2, completed=243, epoch=1, pending="all_reduce:float32:max"), now=1.0))
    assert failure.behind == (2,) and not failure.diverged
    g.join(_join(1, inc="p1-new", replacement=True), now=2.0)
    g.admit(0, "p0", epoch=2, completed=316, now=3.0)
    plan = _formed(g.admit(2, "p2", epoch=2, completed=316, now=3.0))
    assert plan.reason == "admission" and plan.joiners == (1,) and not plan.diverged


def test_a_failure_during_admission_turns_it_into_a_reconfiguration() -> None:
    g = _started(3)
    g.fail(1, now=1.0, dead_rank=1)
    g.join(_join(0, completed=4, epoch=1), now=1.0)
    _formed(g.join(_join(2, completed=4, epoch=1), now=1.0))
    g.join(_join(1, inc="p1-new", replacement=True), now=2.0)
    g.admit(0, "p0", epoch=2, completed=33, now=3.0)
    g.fail(2, now=3.1, dead_rank=2)
    assert g.phase is Phase.BROKEN and g.admit(0, "p0", epoch=2, completed=33, now=3.2) == []
    plan = _formed(g.join(_join(0, completed=33, epoch=2), now=3.3))
    # The survivor forms alone; the replacement still waits for the next admission point.
    assert plan.members == (0,) and g.view()["joiners"] == [1]


def test_a_replacement_that_dies_while_waiting_is_forgotten() -> None:
    g = _started(2)
    g.fail(1, now=1.0, dead_rank=1)
    _formed(g.join(_join(0, completed=4, epoch=1), now=1.0))
    g.join(_join(1, inc="p1-new", replacement=True), now=2.0)
    assert g.fail(2, now=2.5, dead_rank=1, incarnation="p1-new")[0]["what"] == "joiner_lost"
    assert g.phase is Phase.STABLE and g.view()["joiners"] == []
    # Admission with nobody left to admit changes nothing.
    assert g.admit(0, "p0", epoch=2, completed=8, now=3.0)[0]["what"] == "admission_void"
    assert g.epoch == 2 and g.phase is Phase.STABLE


def test_fencing() -> None:
    g = _started(2)
    with pytest.raises(Fenced, match="held by another live process"):
        g.join(_join(1, inc="impostor", replacement=True), now=1.0)
    with pytest.raises(Invalid, match="world"):
        g.join(_join(0), now=1.0, world=3)
    with pytest.raises(Invalid, match="out of range"):
        g.join(_join(5), now=1.0)
    with pytest.raises(Invalid, match="not a member"):
        g.admit(0, "p0", epoch=7, completed=1, now=1.0)
    forming = Group(world=2)
    forming.join(_join(0), now=0.0)
    with pytest.raises(Fenced, match="already joined"):
        forming.join(_join(0, inc="other"), now=0.0)


def test_stale_failure_reports_change_nothing() -> None:
    g = _started(2)
    g.fail(1, now=1.0, dead_rank=1)
    _formed(g.join(_join(0, completed=4, epoch=1), now=1.0))
    assert g.fail(1, now=2.0, reason="late report of epoch 1") == [] and g.phase is Phase.STABLE


def test_a_lost_group_is_rebuilt_from_a_members_view() -> None:
    g = Group(world=3, epoch=5)  # the executor restarted; it only remembers the highest epoch
    notes = g.join(_join(0, completed=9, epoch=5, view=(0, 1, 2)), now=1.0)
    assert notes[0]["what"] == "broken"
    g.fail(5, now=1.0, dead_rank=2)
    plan = _formed(g.join(_join(1, completed=9, epoch=5, view=(0, 1, 2)), now=1.1))
    assert plan.epoch == 6 and plan.members == (0, 1)
    stale = Group(world=3, epoch=7)
    with pytest.raises(Fenced, match="epoch 7"):
        stale.join(_join(0, completed=1, epoch=5, view=(0, 1, 2)), now=1.0)


def test_after_a_rebuild_a_replacement_declares_its_rank_dead_and_a_member_left_behind_is_fenced() -> None:
    # The executor restarted while rank 1 died: rank 0's view rebuilds the group with ranks whose processes it
    # does not know. Rank 1's replacement joins first: it is not fenced by the unknown holder, the rank is dead.
    g = Group(world=3, epoch=4, join_timeout_s=2.0)
    assert g.join(_join(0, completed=9, epoch=4, view=(0, 1, 2)), now=1.0)[0]["what"] == "broken"
    notes = g.join(_join(1, inc="p1-new", replacement=True), now=1.1)
    assert notes[0]["what"] == "waiting" and g.view()["joiners"] == [1] and g.view()["dead"] == [1]
    # So the survivors form as soon as they are in, without the join timeout.
    plan = _formed(g.join(_join(2, completed=9, epoch=4, view=(0, 1, 2)), now=1.2))
    assert plan.epoch == 5 and plan.members == (0, 2) and plan.dead == (1,)
    # The replacement is admitted as usual.
    assert g.admit(0, "p0", epoch=5, completed=20, now=1.3) == []
    plan = _formed(g.admit(2, "p2", epoch=5, completed=20, now=1.3))
    assert plan.epoch == 6 and plan.members == (0, 1, 2) and plan.joiners == (1,)
    # A survivor too slow for the join timeout was declared dead without its incarnation: it is fenced by its epoch.
    g = Group(world=3, epoch=4, join_timeout_s=2.0)
    g.join(_join(0, completed=9, epoch=4, view=(0, 1, 2)), now=1.0)
    g.join(_join(1, completed=9, epoch=4, view=(0, 1, 2)), now=1.0)
    assert _formed(g.tick(now=3.0)).members == (0, 1)
    with pytest.raises(Fenced, match="reached epoch 5 without it"):
        g.join(_join(2, completed=9, epoch=4, view=(0, 1, 2)), now=4.0)
    # Its replacement is a joiner as usual.
    assert g.join(_join(2, inc="p2-new", replacement=True), now=4.5)[0]["what"] == "waiting"


def test_members_that_left_cleanly_are_not_waited_for() -> None:
    g = _started(3)
    assert g.leave(2, "p2")[0]["what"] == "left"
    g.fail(1, now=1.0, reason="a collective failed")
    g.join(_join(0, completed=3, epoch=1), now=1.0)
    plan = _formed(g.join(_join(1, completed=3, epoch=1), now=1.0))
    assert plan.members == (0, 1)


def test_members_level_with_each_other_at_different_collectives_have_diverged() -> None:
    g = _started(3)
    g.fail(1, now=1.0, dead_rank=2)
    g.join(_join(0, completed=40, epoch=1, pending="all_gather:float32"), now=1.0)
    plan = _formed(g.join(_join(1, completed=40, epoch=1, pending="grad"), now=1.0))
    assert plan.diverged
    g.fail(2, now=2.0, reason="again")
    g.join(_join(0, completed=41, epoch=2, pending="grad"), now=2.0)
    plan = _formed(g.join(_join(1, completed=40, epoch=2, pending="all_reduce:float64:sum"), now=2.0))
    assert not plan.diverged  # one behind: a different collective is expected
