"""The start-up bar of `dsec launch --progress` (launch/startup.py): its last state is the truth at the end.

A short job's ranks can register and finish between two looks at the control plane; the bar must not end on the
count of up to a poll ago (it did once in a full test run: "1/2 ranks" for a job whose two ranks had both
registered)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from dsec.launch.startup import wait_for_ranks


class _Sup:
    """A supervisor whose job finishes after its first step (both ranks registered, ran and exited by then)."""

    def __init__(self) -> None:
        self.job = SimpleNamespace(pool="p", groups=[SimpleNamespace(name="g", world_size=2)])
        self.failed: str | None = None
        self.poll_s = 0.0
        self.steps = 0

    def finished(self) -> bool:
        return self.steps >= 1

    def step(self) -> None:
        self.steps += 1


class _Client:
    """The control plane's worker list: rank 0 at the first look, both ranks from then on."""

    def __init__(self) -> None:
        self.looks = 0

    def workers(self, pool: str | None = None) -> list[dict[str, Any]]:
        self.looks += 1
        ranks = [0] if self.looks == 1 else [0, 1]
        return [{"id": f"w{r}", "group": "g", "rank": r} for r in ranks]


def test_a_job_that_finished_between_two_looks_shows_every_rank_that_registered() -> None:
    seen: list[tuple[int, int]] = []
    assert wait_for_ranks(_Sup(), _Client(), set(), lambda done, total: seen.append((done, total)))
    assert seen[-1] == (2, 2)


def test_a_job_that_ends_short_of_its_ranks_says_so() -> None:
    sup, seen = _Sup(), []
    client = _Client()
    client.workers = lambda pool=None: [{"id": "w0", "group": "g", "rank": 0}]  # type: ignore[method-assign]
    assert not wait_for_ranks(sup, client, set(), lambda done, total: seen.append((done, total)))
    assert seen[-1] == (1, 2)
