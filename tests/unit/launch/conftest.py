"""The supervisor writes the job's history file into the job's snapshot directory (``.dsec/snapshots`` by default,
relative to the working directory): these tests run in a directory of their own."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(autouse=True)
def _own_working_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
