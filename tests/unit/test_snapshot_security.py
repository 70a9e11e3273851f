"""Snapshot files are data, not instructions (docs/security.md, finding 11): a manifest naming something that is not
a tensor dtype is refused (and a restore falls back past it), odd folders do not break `dsec snapshots ls`, and names
cannot leave the store's directory."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from dsec.cli import app

torch = pytest.importorskip("torch")

from dsec.snapshot import (  # noqa: E402
    CorruptSnapshot,
    LocalDirStore,
    Snapshotter,
    StoreError,
    codec,
    load,
    load_latest,
)
from dsec.snapshot.manifest import seal, unseal  # noqa: E402

WORKER = "learner-0"


@pytest.fixture
def root(tmp_path: Path) -> Path:
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    with Snapshotter(LocalDirStore(tmp_path / "s"), WORKER, level=0, base_every=1) as snap:
        snap.register("model", model)
        for step in range(2):
            snap.take(step=step, wait=True)
    return tmp_path / "s"


def _reseal(store: LocalDirStore, seq: int, edit: dict[str, object]) -> None:
    """Rewrite a manifest the way anyone with write access to the directory can: edit, seal again (the checksum is
    not keyed, so it verifies)."""
    path = store.root / "manifests" / WORKER / f"{seq:08d}.json"
    m = unseal(path.read_bytes())
    for entry in m["tensors"].values():
        entry.update(edit)
    path.write_bytes(seal(m))


def test_a_manifest_naming_a_non_dtype_is_refused_and_skipped(root: Path) -> None:
    store = LocalDirStore(root)
    newest = store.manifests(WORKER)[-1]
    _reseal(store, newest, {"dtype": "load"})
    with pytest.raises(CorruptSnapshot, match="dtype 'load' is not a tensor dtype"):
        load(store, WORKER, newest)
    fallback = load_latest(store, WORKER)
    assert fallback is not None and fallback.seq < newest
    assert {"model/weight", "model/bias"} <= set(fallback.decode_all())


@pytest.mark.parametrize("edit", [{"enc": "pickle"}, {"shape": [-1]}, {"shape": "4x8"}, {"dtype": "__class__"}])
def test_other_malformed_tensor_entries_are_refused(root: Path, edit: dict[str, object]) -> None:
    store = LocalDirStore(root)
    newest = store.manifests(WORKER)[-1]
    _reseal(store, newest, edit)
    with pytest.raises(CorruptSnapshot):
        load(store, WORKER, newest)


def test_the_codec_looks_up_only_allowed_dtypes() -> None:
    raw = np.zeros(4, dtype=np.uint8)
    for name in ("load", "save", "nn", "float"):  # torch.float is a dtype alias, but not a name manifests use
        with pytest.raises(ValueError, match="not a tensor dtype"):
            codec.decode(raw, {"dtype": name, "shape": [1], "enc": "raw"})
    assert codec.decode(raw, {"dtype": "float32", "shape": [1], "enc": "raw"}).dtype == torch.float32


def test_snapshots_ls_skips_folders_that_are_not_workers(root: Path) -> None:
    (root / "manifests" / "not a worker").mkdir()
    (root / "manifests" / "not a worker" / "00000001.json").write_text("{}")
    result = CliRunner().invoke(app, ["snapshots", "ls", "--dir", str(root), "--json"])
    assert result.exit_code == 0, result.output
    assert {json.loads(line)["worker"] for line in result.output.splitlines()} == {WORKER}
    result = CliRunner().invoke(app, ["snapshots", "ls", "not a worker", "--dir", str(root)])
    assert result.exit_code == 2 and "invalid" in result.output


def test_names_cannot_leave_the_store(root: Path) -> None:
    store = LocalDirStore(root)
    for bad in ("../outside", "/etc", "a/b", ".hidden"):
        with pytest.raises(ValueError):
            store.put_manifest(bad, 1, b"{}")
    for bad in ("../../etc/passwd", "0" * 63 + "/", "A" * 64):
        with pytest.raises(StoreError):
            store.get_chunk(bad)
    assert sorted(p.name for p in root.iterdir()) == ["chunks", "manifests"]
