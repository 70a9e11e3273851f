"""When the supervisor counts a dead rank's replacement as admitted (dsec.launch.recovery.rank_rejoined)."""

from __future__ import annotations

from typing import Any

from dsec.launch.recovery import Recovery, rank_rejoined


def _rec() -> Recovery:
    return Recovery("trainers", "trainers-1", -9, "exit", detected_at=100.0, detect_s=0.02, mode="heal")


def _state(
    epoch: int, phase: str, members: list[int], joiners: tuple[int, ...] = (), at: float = 0.0
) -> dict[str, Any]:
    plan = {"epoch": epoch, "members": members, "joiners": list(joiners)}
    return {"epoch": epoch, "phase": phase, "members": members, "formed_at": at, "plan": plan}


def test_the_usual_heal_survivors_reform_then_the_replacement_is_admitted() -> None:
    rec = _rec()
    assert not rank_rejoined(rec, 1, _state(1, "broken", [0, 1, 2]))
    assert not rank_rejoined(rec, 1, _state(2, "stable", [0, 2], at=101.0))
    assert rec.reconfigured_at == 101.0 and rec.without_epoch == 2
    assert not rank_rejoined(rec, 1, _state(2, "admitting", [0, 2]))
    assert rank_rejoined(rec, 1, _state(3, "stable", [0, 1, 2], joiners=(1,), at=104.0))


def test_an_admission_seen_without_the_survivors_epoch_counts_by_its_joiners() -> None:
    assert rank_rejoined(_rec(), 1, _state(3, "stable", [0, 1, 2], joiners=(1,)))


def test_a_group_rebuilt_after_a_control_plane_restart_is_not_an_admission() -> None:
    """The restarted control plane rebuilds epoch 1 from the survivors' views, which still list the dead rank: that is
    the old incarnation's membership, not the replacement's admission."""
    rec = _rec()
    assert not rank_rejoined(rec, 1, _state(1, "forming", [0]))  # rebuilding: members known so far
    assert not rank_rejoined(rec, 1, _state(1, "stable", [0, 1, 2]))  # rebuilt from views (the old rank 1)
    assert rec.without_epoch is None
    assert not rank_rejoined(rec, 1, _state(2, "stable", [0, 2], at=110.0))  # the survivors re-form
    assert rec.without_epoch == 2
    assert not rank_rejoined(rec, 1, _state(2, "stable", [0, 1, 2]))  # same epoch: not an admission
    assert rank_rejoined(rec, 1, _state(3, "stable", [0, 1, 2]))  # a later epoch with rank 1: admitted
