"""`dsec snapshots ls | show | verify | restore | compact` on a real store written by a Snapshotter."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dsec.cli import app

torch = pytest.importorskip("torch")

from dsec.snapshot import LocalDirStore, Snapshotter  # noqa: E402


@pytest.fixture
def store(tmp_path: Path) -> tuple[Path, torch.nn.Module]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Tanh(), torch.nn.Linear(256, 4))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with Snapshotter(LocalDirStore(tmp_path / "s"), "learner-0", level=0, base_every=3) as snap:
        snap.register("model", model)
        snap.register("adam", opt)
        for i in range(4):
            model(torch.randn(8, 64)).sum().backward()
            opt.step()
            snap.take(step=i, wait=True)
    return tmp_path / "s", model


def _cli(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(app, list(args), env={"COLUMNS": "200"})
    return result.exit_code, result.output


def test_ls_show_verify(store: tuple[Path, torch.nn.Module]) -> None:
    root, _ = store
    code, out = _cli("snapshots", "ls", "--dir", str(root), "--json")
    assert code == 0, out
    rows = [json.loads(line) for line in out.splitlines()]
    assert [r["id"] for r in rows] == [f"learner-0/{n}" for n in (1, 2, 3, 4)]
    assert [r["kind"] for r in rows] == ["base", "delta", "delta", "base"]
    assert all(r["mode"] == "lossless" and r["lossless"] for r in rows)
    code, out = _cli("snapshots", "ls", "--dir", str(root))
    assert code == 0 and "learner-0/4" in out
    code, out = _cli("snapshots", "show", "learner-0/2", "--dir", str(root))
    assert code == 0, out
    shown = json.loads(out)
    assert shown["kind"] == "delta" and shown["parent"] == 1 and "model/0.weight" in shown["tensors"]
    code, out = _cli("snapshots", "verify", "--dir", str(root))
    assert code == 0 and out.count("ok") == 4


def test_verify_fails_on_damage_and_restore_falls_back(store: tuple[Path, torch.nn.Module], tmp_path: Path) -> None:
    root, _ = store
    newest = json.loads((root / "manifests" / "learner-0" / "00000004.json").read_text())
    chunk = newest["tensors"]["model/0.weight"]["chunk"]
    path = root / "chunks" / chunk[:2] / chunk
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    code, out = _cli("snapshots", "verify", "learner-0", "--dir", str(root))
    assert code == 1 and "damaged learner-0/4" in out and "checksum mismatch" in out
    code, out = _cli("snapshots", "restore", "learner-0", "-o", str(tmp_path / "state.pt"), "--dir", str(root))
    assert code == 0, out
    assert "skipped learner-0/4" in out and "restored learner-0/3" in out
    saved = torch.load(tmp_path / "state.pt", weights_only=True)
    assert saved["manifest"]["seq"] == 3 and saved["tensors"]["model/0.weight"].shape == (256, 64)
    code, out = _cli("snapshots", "restore", "learner-0/4", "-o", str(tmp_path / "x.pt"), "--dir", str(root))
    assert code == 1 and "learner-0/4" in out


def test_restore_matches_model_and_compact(store: tuple[Path, torch.nn.Module], tmp_path: Path) -> None:
    root, model = store
    code, out = _cli("snapshots", "restore", "learner-0/4", "-o", str(tmp_path / "s.pt"), "--dir", str(root))
    assert code == 0, out
    saved = torch.load(tmp_path / "s.pt", weights_only=True)
    for name, p in model.state_dict().items():
        assert torch.equal(saved["tensors"][f"model/{name}"], p)
    code, out = _cli("snapshots", "compact", "learner-0/3", "--dir", str(root))
    assert code == 0 and "-> learner-0/5" in out
    code, out = _cli("snapshots", "show", "learner-0/5", "--dir", str(root))
    assert json.loads(out)["kind"] == "base" and json.loads(out)["compacted_from"] == 3


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("snapshots", "ls", "--dir", "/nonexistent/x"), "not a snapshot store"),
        (("snapshots", "show", "nobody", "--dir", "{root}"), "no snapshots for worker 'nobody'"),
        (("snapshots", "show", "learner-0/x", "--dir", "{root}"), "expected WORKER or WORKER/NUMBER"),
        (("snapshots", "show", "learner-0/99", "--dir", "{root}"), "does not exist"),
    ],
)
def test_bad_input_is_a_clear_error(store: tuple[Path, torch.nn.Module], args: tuple[str, ...], message: str) -> None:
    root, _ = store
    code, out = _cli(*(a.format(root=root) for a in args))
    assert code in (1, 2) and message in out, out


LONG_WORKER = "default-ppo-cartpole-learners-rank-0"  # piped through `| less`, ids used to print as `defaul…`


@pytest.fixture
def long_named(tmp_path: Path) -> Path:
    model = torch.nn.Linear(8, 8)
    with Snapshotter(LocalDirStore(tmp_path / "s"), LONG_WORKER, level=0, base_every=2) as snap:
        snap.register("model", model)
        for i in range(3):
            snap.take(step=i, wait=True)
    return tmp_path / "s"


def test_ls_piped_keeps_ids_whole_in_100_columns(long_named: Path) -> None:
    """The real command on a pipe (no terminal, no $COLUMNS): 100 columns, every id on one line, uncut."""
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    proc = subprocess.run(
        [sys.executable, "-m", "dsec.cli", "snapshots", "ls", "--dir", str(long_named)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert all(len(line) <= 100 for line in lines), proc.stdout
    for n in (1, 2, 3):
        assert any(f"{LONG_WORKER}/{n} " in line for line in lines), proc.stdout
    assert "…" not in proc.stdout
    assert "stored MiB" in proc.stdout and "full MiB" not in proc.stdout  # the detail is behind --wide


def test_ls_wide_has_every_column_and_80_columns_keep_ids(long_named: Path) -> None:
    result = CliRunner().invoke(app, ["snapshots", "ls", "--dir", str(long_named), "--wide"], env={"COLUMNS": "100"})
    assert result.exit_code == 0, result.output
    for header in ("base", "full MiB", "stored MiB", "blocking ms", "total ms"):
        assert header in result.output
    result = CliRunner().invoke(app, ["snapshots", "ls", "--dir", str(long_named)], env={"COLUMNS": "80"})
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert all(len(line) <= 80 for line in lines) and any(f"{LONG_WORKER}/3 " in line for line in lines)


def test_ls_prints_an_unreadable_manifest_error_whole(long_named: Path) -> None:
    (long_named / "manifests" / LONG_WORKER / "00000009.json").write_text("{not json")
    result = CliRunner().invoke(app, ["snapshots", "ls", "--dir", str(long_named)], env={"COLUMNS": "100"})
    assert result.exit_code == 0, result.output
    row = next(line for line in result.output.splitlines() if f"{LONG_WORKER}/9 " in line)
    assert "unreadable" in row
    text = " ".join(result.output.split())  # the message wraps below the table, uncut
    assert f"snapshot {LONG_WORKER}/9: not valid JSON" in text and "(char 1))" in text
