"""Room for a burst (dsec.quota.room): which card-mate moves off a card a learner's burst is about to fill."""

from __future__ import annotations

from dsec.quota.room import CardMate, make_room
from dsec.quota.trend import BURST_RAMP_GB_PER_S


def mate(wid: str, used: float, ramp: float = 0.0, movable: bool = True, restarts_group: bool = False) -> CardMate:
    return CardMate(wid, used, ramp, movable, restarts_group)


def learner(used: float, ramp: float) -> CardMate:
    return mate("learner", used, ramp, movable=False, restarts_group=True)


def test_the_largest_movable_card_mate_makes_room_for_a_learners_burst() -> None:
    card = [learner(30.0, 0.8), mate("a", 14.0), mate("b", 16.0), mate("c", 15.0)]
    # projected: 30 + 0.8 x 5 + 14 + 16 + 15 = 79 <= 80 fits; 0.8 x 6.25 = 5 more: 80 fits exactly, 81 does not
    assert make_room(80.0, card, horizon_s=5.0) is None
    assert make_room(80.0, card, horizon_s=6.25) is None
    assert make_room(80.0, card, horizon_s=7.5) == "b"


def test_ties_go_to_the_larger_id_so_the_choice_is_the_same_everywhere() -> None:
    card = [learner(40.0, 1.0), mate("a", 14.0), mate("b", 14.0), mate("c", 14.0)]
    assert make_room(80.0, card, horizon_s=5.0) == "c"


def test_nothing_moves_for_a_card_full_at_rest_or_a_slow_climb() -> None:
    at_rest = [learner(30.0, 0.0), mate("a", 20.0), mate("b", 20.0), mate("c", 20.0)]  # 90 > 80: placement's business
    assert make_room(80.0, at_rest, horizon_s=5.0) is None
    leaking = [learner(70.0, BURST_RAMP_GB_PER_S / 2), mate("a", 14.0)]  # 84 > 80: the limit's business (a leak)
    assert make_room(80.0, leaking, horizon_s=5.0) is None
    bursting = [learner(70.0, BURST_RAMP_GB_PER_S), mate("a", 14.0)]
    assert make_room(80.0, bursting, horizon_s=5.0) == "a"


def test_an_actors_burst_gets_no_room_it_fails_and_restarts_alone() -> None:
    card = [mate("bursting", 40.0, 1.0), mate("a", 14.0), mate("b", 14.0), mate("c", 14.0)]  # 82 + 5 > 80
    assert make_room(80.0, card, horizon_s=5.0) is None
    card[0] = mate("bursting", 40.0, 1.0, restarts_group=True)  # an actor of a group restarted whole: it does
    assert make_room(80.0, card, horizon_s=5.0) == "c"


def test_only_movable_card_mates_that_are_not_bursting_themselves_move() -> None:
    card = [learner(40.0, 1.0), mate("pinned", 20.0, movable=False), mate("rising", 18.0, ramp=0.2), mate("ok", 10.0)]
    assert make_room(80.0, card, horizon_s=5.0) == "ok"
    card = [learner(40.0, 1.0), mate("pinned", 30.0, movable=False), mate("rising", 18.0, ramp=0.2)]
    assert make_room(80.0, card, horizon_s=5.0) is None
