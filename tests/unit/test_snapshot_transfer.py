"""A snapshot packed for another rank arrives verified or not at all (snapshot/transfer.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from dsec.snapshot import LocalDirStore, Snapshotter  # noqa: E402
from dsec.snapshot.manifest import CorruptSnapshot  # noqa: E402
from dsec.snapshot.reader import Loaded  # noqa: E402
from dsec.snapshot.transfer import pack, unpack, without_rng  # noqa: E402


def _loaded(tmp_path: Path) -> Loaded:
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 8)
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 16)).sum().backward()
    opt.step()
    with Snapshotter(LocalDirStore(tmp_path), "w", level=0) as snap:
        snap.register("model0", model)
        snap.register("optim0", opt)
        seq = snap.take(step=7, wait=True).seq
        assert seq is not None
        return snap.load(seq)


def test_a_packed_snapshot_unpacks_to_the_same_bytes(tmp_path: Path) -> None:
    loaded = _loaded(tmp_path)
    sealed, flat = pack(loaded)
    got = unpack(sealed, flat.copy())
    assert got.manifest == loaded.manifest
    assert set(got.encoded) == set(loaded.encoded)
    for name, data in loaded.encoded.items():
        assert np.array_equal(got.encoded[name], data)
        assert torch.equal(got.tensor(name), loaded.tensor(name))


def test_one_flipped_bit_anywhere_is_refused(tmp_path: Path) -> None:
    sealed, flat = pack(_loaded(tmp_path))
    for at in (0, flat.size // 2, flat.size - 1):
        damaged = flat.copy()
        damaged[at] ^= 0x10
        with pytest.raises(CorruptSnapshot, match="does not match its checksum"):
            unpack(sealed, damaged)
    manifest = bytearray(sealed)
    manifest[len(manifest) // 2] ^= 0x01
    with pytest.raises(CorruptSnapshot):
        unpack(bytes(manifest), flat)


def test_short_or_long_bodies_are_refused(tmp_path: Path) -> None:
    sealed, flat = pack(_loaded(tmp_path))
    with pytest.raises(CorruptSnapshot, match="bytes received"):
        unpack(sealed, flat[:-1])
    with pytest.raises(CorruptSnapshot, match="bytes more than"):
        unpack(sealed, np.concatenate([flat, np.zeros(3, dtype=np.uint8)]))


def test_without_rng_keeps_the_receivers_own_random_streams(tmp_path: Path) -> None:
    loaded = _loaded(tmp_path)
    assert any(n.startswith("rng/") for n in loaded.manifest["tensors"]) and loaded.manifest["meta"]["rng"]
    stripped = without_rng(loaded)
    assert not any(n.startswith("rng/") for n in stripped.manifest["tensors"]) and stripped.encoded.keys() == {
        n for n in loaded.encoded if not n.startswith("rng/")
    }
    assert stripped.manifest["meta"]["rng"] == {}
    # Applying it leaves the process's generator where it was.
    model = torch.nn.Linear(16, 8)
    opt = torch.optim.Adam(model.parameters())
    with Snapshotter(LocalDirStore(tmp_path / "other"), "r", level=0) as snap:
        snap.register("model0", model)
        snap.register("optim0", opt)
        torch.manual_seed(1234)
        before = torch.get_rng_state()
        snap.apply(stripped)
        assert torch.equal(torch.get_rng_state(), before)
        assert torch.equal(model.weight, loaded.tensor("model0/weight"))
