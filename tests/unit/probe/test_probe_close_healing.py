"""How a probed process's end reaches its healing group: a clean end leaves the group (its later exit is no
failure, even a crash in teardown), an uncaught exception does not (the supervisor reports it as a failure), SIGTERM
does not either (the process did not finish)."""

from __future__ import annotations

import pytest

from dsec.probe.runtime import Probe


class HealingMember:
    """Stands in for dsec.probe.healing.Healing: records how it was closed."""

    def __init__(self) -> None:
        self.closed: list[bool] = []

    def close(self, leave: bool = True) -> None:
        self.closed.append(leave)


@pytest.fixture
def probe(offline_probe: Probe) -> Probe:
    return offline_probe


@pytest.mark.parametrize(("reason", "closed"), [("exit", [True]), ("error", [False]), ("sigterm", [])])
def test_only_a_clean_end_leaves_the_healing_group(probe: Probe, reason: str, closed: list[bool]) -> None:
    member = HealingMember()
    probe.healing = member  # type: ignore[assignment]
    probe.close(reason)
    assert member.closed == closed
