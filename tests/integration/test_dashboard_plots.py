"""The simulator's plots on the dashboard: ``dsec simulate`` publishes them, a real control plane serves the latest
ones at ``/dashboard/plots`` with a read token (only known names, correct types, no path), and the page links them."""

from __future__ import annotations

import json
import socket
from collections.abc import Callable
from pathlib import Path
from xml.etree import ElementTree

import httpx
import pytest
from typer.testing import CliRunner

from conftest import Harness, make_settings
from dsec.cli import app

pytest.importorskip("numpy")
SCENARIO = {
    "name": "dash",
    "seed": 2,
    "duration_h": 0.5,
    "cluster": {"nodes": 1, "gpus_per_node": 4, "workers_per_gpu": 2},
    "groups": {"count": 1, "actors": 4},
}


def simulate_into(home: Path, tmp_path: Path) -> Path:
    """Run `dsec simulate` as a user would, publishing into ``home``'s plots directory; returns that directory."""
    scenario = tmp_path / "dash.yaml"
    scenario.write_text(json.dumps(SCENARIO))
    args = ["simulate", str(scenario), "--report", str(tmp_path / "report"), "--no-progress"]
    r = CliRunner().invoke(app, args, env={"DSEC_HOME": str(home), "COLUMNS": "200"})
    assert r.exit_code == 0, r.output
    assert f"plots for the dashboard: {home / 'plots'}" in r.stdout
    return home / "plots"


@pytest.fixture
def cp(server_factory: Callable[..., Harness], tmp_path: Path) -> Harness:
    h: Harness = server_factory(settings=make_settings(tmp_path / "cp"))
    h.create_pools()
    return h


def raw_get(h: Harness, target: str, token: str) -> tuple[int, bytes]:
    """GET ``target`` exactly as written (an HTTP client would resolve ``..`` before sending it): status, body."""
    request = f"GET {target} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {token}\r\nConnection: close\r\n\r\n"
    with socket.create_connection(("127.0.0.1", h.port), timeout=10) as s:
        s.sendall(request.encode())
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), body


def test_latest_plots_are_served_with_a_read_token_and_the_page_links_them(cp: Harness, tmp_path: Path) -> None:
    read = cp.admin.create_token(kind="read")
    auth = {"Authorization": f"Bearer {read}"}
    with httpx.Client(base_url=cp.url, timeout=10) as http:
        assert http.get("/dashboard/plots", headers=auth).json() == {"run": None, "plots": []}
        published = simulate_into(cp.settings.home, tmp_path)
        assert published == cp.settings.plots
        listing = http.get("/dashboard/plots", headers=auth).json()
        assert listing["run"]["scenario"] == "dash" and listing["run"]["workers"] == 5
        names = [p["name"] for p in listing["plots"]]
        assert names[0] == "goodput.svg" and set(names) <= {"goodput.svg", "progress.png", "hours_lost.png"}
        r = http.get("/dashboard/plots/goodput.svg", headers=auth)
        assert r.status_code == 200 and r.headers["content-type"] == "image/svg+xml"
        assert r.content == (published / "goodput.svg").read_bytes()
        assert ElementTree.fromstring(r.content).tag == "{http://www.w3.org/2000/svg}svg"
        assert "sandbox" in r.headers["content-security-policy"] and r.headers["x-content-type-options"] == "nosniff"
        if "progress.png" in names:  # matplotlib installed
            png = http.get("/dashboard/plots/progress.png", headers=auth)
            assert png.headers["content-type"] == "image/png" and png.content[:4] == b"\x89PNG"
        # Like the rest of the page's data: no token, no plot.
        assert http.get("/dashboard/plots").status_code == 401
        assert http.get("/dashboard/plots/goodput.svg").status_code == 401
        # The page has the section and loads the script that fills it; the page allows images from memory.
        page = http.get("/")
        assert 'id="plots-section"' in page.text and '<script src="/dashboard/plots.js" defer>' in page.text
        assert "blob:" in page.headers["content-security-policy"]
        script = http.get("/dashboard/plots.js")
        assert script.status_code == 200 and script.headers["content-type"].startswith("text/javascript")
        assert "/dashboard/plots" in script.text


@pytest.mark.parametrize(
    ("target", "status", "message"),
    [
        ("/dashboard/plots/..%2F..%2Fdsec.db", 400, "a plot is named, not a path"),
        ("/dashboard/plots/../plots.json", 400, "a plot is named, not a path"),
        ("/dashboard/plots/%2e%2e", 400, "a plot is named, not a path"),
        ("/dashboard/plots/sub/goodput.svg", 400, "a plot is named, not a path"),
        ("/dashboard/plots/plots.json", 404, "no such plot published (plots: goodput.svg, "),
        ("/dashboard/plots/admin.token", 404, "no such plot published"),
        ("/dashboard/plots/sweep.png", 404, "`dsec simulate` publishes them"),  # known, not published
    ],
)
def test_a_path_or_an_unknown_name_is_refused_clearly(
    cp: Harness, tmp_path: Path, target: str, status: int, message: str
) -> None:
    read = cp.admin.create_token(kind="read")
    plots = cp.settings.plots
    plots.mkdir(parents=True)
    (plots / "plots.json").write_text(json.dumps({"plots": []}))
    code, body = raw_get(cp, target, read)
    assert code == status, body
    answer = json.loads(body)
    assert answer["field"] == "name" and message in answer["message"], answer
