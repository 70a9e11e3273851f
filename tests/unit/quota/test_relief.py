"""Memory relief (dsec.quota.relief): who gets gradient accumulation when a card's projected usage overflows it, and
when it is released."""

from __future__ import annotations

from dsec.quota.relief import CardWorker, Relief, relief


def w(wid: str, used: float, ramp: float = 0.0, accumulating: bool = False, relieved: bool = False,
      bursting: bool = False) -> CardWorker:  # fmt: skip
    return CardWorker(wid, used, ramp, accumulating, relieved, bursting)


def test_the_steepest_ramping_worker_of_an_overflowing_card_is_relieved_alone() -> None:
    card = [w("a", 20.0, 0.2, bursting=True), w("b", 20.0, 0.5, bursting=True), w("c", 30.0)]
    # projected: 20 + 0.2 x 20 + 20 + 0.5 x 20 + 30 = 84 > 80
    assert relief(80.0, card, horizon_s=20.0) == Relief(relieve=("b",))


def test_no_relief_while_the_projection_fits_exactly() -> None:
    card = [w("a", 20.0, 0.5, bursting=True), w("b", 50.0)]  # 20 + 10 + 50 = 80: fits
    assert relief(80.0, card, horizon_s=20.0) == Relief()
    assert relief(79.9, card, horizon_s=20.0) == Relief(relieve=("a",))


def test_a_worker_accumulating_already_or_not_ramping_is_no_candidate() -> None:
    card = [w("a", 40.0, 0.5, accumulating=True, bursting=True), w("b", 45.0)]  # 40 + 10 + 45 > 80
    assert relief(80.0, card, horizon_s=20.0) == Relief()


def test_a_relieved_worker_is_released_once_its_burst_is_over_and_its_ramp_is_zero() -> None:
    card = [
        w("held", 30.0, 0.0, accumulating=True, relieved=True, bursting=True),  # burst hold not over
        w("ramping", 20.0, 0.1, accumulating=True, relieved=True),  # still growing
        w("done", 14.0, 0.0, accumulating=True, relieved=True),
        w("breaker", 14.0, 0.0, accumulating=True),  # accumulating for the breaker: not relief's to release
    ]
    assert relief(80.0, card, horizon_s=20.0) == Relief(release=("done",))
