"""dsec.job_history: the supervisor's file of its groups' failure history, as the learners read it back."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from dsec.job_history import GroupHistory, history_path, peers_of, write_history


def test_what_one_group_reads_is_the_others_history_running_ones_growing_since_the_write(tmp_path: Path) -> None:
    path = history_path(tmp_path / "snaps", "job-1")
    assert path == tmp_path / "snaps" / "history" / "job-1.json"
    groups = {
        "g": GroupHistory(100.0, 2, running=True),
        "h": GroupHistory(300.0, 0, running=True),
        "i": GroupHistory(50.0, 1, running=False),  # given up: its history stays, it no longer grows
    }
    write_history(path, groups, written_at=1_000.0)
    assert peers_of(path, "g", now=1_000.0) == (350.0, 1)
    assert peers_of(path, "g", now=1_010.0) == (360.0, 1)  # h trained 10 s more; i did not
    assert peers_of(path, "i", now=1_010.0) == (420.0, 2)
    assert peers_of(path, "g", now=990.0) == (350.0, 1)  # a clock behind the writer's adds nothing
    assert peers_of(path, "elsewhere", now=1_000.0) == (450.0, 3)


@pytest.mark.parametrize(
    "text",
    [
        "not json",
        json.dumps({"groups": {}}),  # no written_at
        json.dumps({"written_at": 1.0, "groups": []}),
        json.dumps({"written_at": 1.0, "groups": {"h": {"exposure_s": -1.0, "rollbacks": 0}}}),
        json.dumps({"written_at": 1.0, "groups": {"h": {"exposure_s": 1.0, "rollbacks": True}}}),
        json.dumps({"written_at": 1.0, "groups": {"h": {"exposure_s": 1.0, "rollbacks": 1.5}}}),
        '{"written_at": 1.0, "groups": {"h": {"exposure_s": NaN, "rollbacks": 0}}}',
    ],
)
def test_a_file_that_cannot_be_trusted_gives_no_peers(tmp_path: Path, text: str) -> None:
    path = tmp_path / "h.json"
    path.write_text(text)
    assert peers_of(path, "g", now=2.0) is None


def test_a_missing_file_gives_no_peers_and_is_logged_quietly(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.DEBUG, logger="dsec.job_history"):
        assert peers_of(tmp_path / "absent.json", "g", now=0.0) is None
    assert "unreadable" in caplog.text
