"""Publishing the simulator's plots for the dashboard (dsec.plots) and the hand-written SVG chart (dsec.sim.svg)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from xml.etree import ElementTree

import pytest

from dsec import plots
from dsec.sim.svg import Series, line_chart, rates, ticks

SVG = "{http://www.w3.org/2000/svg}"


def _report(tmp_path: Path, *names: str) -> Path:
    report = tmp_path / "report"
    report.mkdir(exist_ok=True)
    for name in names:
        (report / name).write_bytes(f"<{name}>".encode())
    return report


def test_publish_copies_known_plots_indexes_the_run_and_drops_a_stale_one(tmp_path: Path) -> None:
    target = tmp_path / "plots"
    first = _report(tmp_path, "goodput.svg", "sweep.png", "notes.txt")
    assert plots.publish(first, target, {"scenario": "a", "seed": 1}) == ["goodput.svg", "sweep.png"]
    assert not (target / "notes.txt").exists()  # not a known plot: never copied
    (first / "sweep.png").unlink()
    assert plots.publish(first, target, {"scenario": "b", "seed": 2}) == ["goodput.svg"]
    assert not (target / "sweep.png").exists()  # the earlier run's sweep is not this run's
    listing = plots.latest(target)
    assert listing["run"]["scenario"] == "b" and listing["run"]["report"] == str(first.resolve())
    assert listing["plots"] == [
        {"name": "goodput.svg", "media_type": "image/svg+xml", "title": plots.PLOTS["goodput.svg"][1], "bytes": 13}
    ]
    assert plots.read(target, "goodput.svg") == (b"<goodput.svg>", "image/svg+xml")


def test_read_serves_only_known_regular_files(tmp_path: Path) -> None:
    target = tmp_path / "plots"
    target.mkdir()
    (target / "plots.json").write_text("{}")
    assert plots.read(target, "plots.json") is None  # the index is not a plot
    assert plots.read(target, "../plots/goodput.svg") is None
    assert plots.read(target, "goodput.svg") is None  # not published
    secret = tmp_path / "secret"
    secret.write_text("token")
    os.symlink(secret, target / "goodput.svg")
    assert plots.read(target, "goodput.svg") is None  # a link is not a published plot
    assert plots.latest(target)["plots"] == []


def test_latest_without_an_index_lists_what_is_there(tmp_path: Path) -> None:
    target = tmp_path / "plots"
    assert plots.latest(target) == {"run": None, "plots": []}
    target.mkdir()
    (target / "progress.png").write_bytes(b"png")
    (target / "plots.json").write_text("not json")
    assert [p["name"] for p in plots.latest(target)["plots"]] == ["progress.png"]
    (target / "plots.json").write_text(json.dumps({"plots": ["../x", "progress.png"]}))
    assert [p["name"] for p in plots.latest(target)["plots"]] == ["progress.png"]


def test_plots_dir_follows_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DSEC_HOME", str(tmp_path / "home"))
    assert plots.plots_dir() == tmp_path / "home" / "plots"
    monkeypatch.setenv("DSEC_PLOTS_DIR", str(tmp_path / "elsewhere"))
    assert plots.plots_dir() == tmp_path / "elsewhere"


def test_ticks_are_round_and_cover_the_range() -> None:
    assert ticks(0, 24) == [0, 5, 10, 15, 20, 25]
    assert ticks(0, 1.2) == [0, 0.5, 1.0, 1.5]
    assert ticks(0.5, 11.2) == [0, 5, 10, 15]
    assert ticks(3, 3) == [3]


def test_rates_are_steps_per_second_of_each_interval() -> None:
    assert rates([(600.0, 60.0), (1200.0, 60.0), (1800.0, 240.0)]) == [(600 / 3600, 0.1), (1 / 3, 0.0), (0.5, 0.3)]


def test_line_chart_is_svg_with_a_polyline_per_series_and_escaped_text() -> None:
    doc = line_chart(
        "a <b> & c", "hours", "steps/s", [Series("x & y", "#123456", [(0, 1), (1, 2)]), Series("z", "#654321", [])]
    )
    root = ElementTree.fromstring(doc)
    assert root.tag == f"{SVG}svg" and root.find(f"{SVG}title").text == "a <b> & c"  # type: ignore[union-attr]
    assert len(root.findall(f"{SVG}polyline")) == 2
    assert "x & y" in [t.text for t in root.iter(f"{SVG}text")]
    assert "<script" not in doc


def test_the_demos_simulator_scene_publishes_its_plots(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("numpy")
    from dsec.demo import simulation

    monkeypatch.setattr(simulation, "HOURS", 0.2)  # the scene's scenario, shorter
    result = simulation.simulate_cluster(tmp_path / "report", tmp_path / "plots")
    assert result["headline"]["workers"] == 128
    listing = plots.latest(tmp_path / "plots")
    assert listing["run"]["scenario"] == "rl-128" and listing["run"]["simulated_h"] == 0.2
    assert "goodput.svg" in [p["name"] for p in listing["plots"]]
    assert (tmp_path / "report" / "report.md").exists()
