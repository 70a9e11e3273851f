"""Reading snapshots back (snapshot/reader.py) and the per-tensor codec (snapshot/codec.py), decision by decision: each
way a manifest, a chain or a chunk can be wrong and the message that names it, the boundaries of the chain walk and of
``load_latest``, and the codec's thresholds, modes and encodings. No subprocess: these run under mutation testing
(docs/testing.md), and each pins something a one-token change of those modules would alter."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import zstandard  # noqa: E402

from dsec import quant  # noqa: E402
from dsec.snapshot import CorruptSnapshot, LocalDirStore, Snapshotter, codec, load, load_latest, reader  # noqa: E402
from dsec.snapshot.manifest import seal, unseal  # noqa: E402

W = "w"


def _store(tmp_path: Path, snapshots: int = 3, base_every: int = 10) -> LocalDirStore:
    """``snapshots`` snapshots of a small model (seq 1 a base, the rest deltas on it), each after a change."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    store = LocalDirStore(tmp_path)
    with Snapshotter(store, W, level=0, base_every=base_every) as snap:
        snap.register("m", model)
        for step in range(snapshots):
            with torch.no_grad():
                model.weight[step % 4].add_(1.0)
            snap.take(step=step, wait=True)
    return store


def _manifest(store: LocalDirStore, seq: int) -> dict[str, Any]:
    return unseal((store.root / "manifests" / W / f"{seq:08d}.json").read_bytes())


def _write(store: LocalDirStore, seq: int, m: dict[str, Any]) -> None:
    (store.root / "manifests" / W / f"{seq:08d}.json").write_bytes(seal(m))


def _put_chunk(store: LocalDirStore, data: bytes) -> str:
    chunk_id = codec.digest(data)
    store.put_chunk(chunk_id, data)
    return chunk_id


def _corrupt(store: LocalDirStore, seq: int, match: str) -> None:
    with pytest.raises(CorruptSnapshot) as err:
        load(store, W, seq)
    assert err.match(match), str(err.value)


# -- manifests ------------------------------------------------------------------------------------------------
def test_a_manifest_filed_under_another_seq_or_worker_is_refused(tmp_path: Path) -> None:
    store = _store(tmp_path, snapshots=1)
    m = _manifest(store, 1)
    _write(store, 5, m)
    _corrupt(store, 5, r"^snapshot w/5: manifest names w/1$")
    _write(store, 6, {**m, "seq": 6, "worker": "other"})
    _corrupt(store, 6, r"^snapshot w/6: manifest names other/6$")


@pytest.mark.parametrize(
    ("tensors", "message"),
    [
        ([], r"^snapshot w/1: no tensor table$"),
        ({"m/weight": [1]}, r"^snapshot w/1: tensor m/weight: not an object$"),
        ({"m/weight": {"dtype": "float32", "enc": "raw", "shape": [True]}}, r"shape \[True\] is not a list of sizes$"),
        ({"m/weight": {"dtype": "float32", "enc": "raw", "shape": [2.0]}}, r"shape \[2.0\] is not a list of sizes$"),
        ({"m/weight": {"dtype": "float32", "enc": "raw", "shape": [4, -1]}}, r"shape \[4, -1\] is not"),
        ({"m/weight": {"dtype": "float32", "enc": "raw"}}, r"shape None is not a list of sizes$"),
        ({"m/weight": {"dtype": "float32", "enc": "q2", "shape": [1]}}, r"tensor m/weight: encoding 'q2' is unknown$"),
        ({"m/weight": {"enc": "raw", "shape": [1]}}, r"tensor m/weight: dtype None is not a tensor dtype$"),
    ],
)
def test_each_malformed_tensor_table_is_named(tmp_path: Path, tensors: object, message: str) -> None:
    store = _store(tmp_path, snapshots=1)
    _write(store, 1, {**_manifest(store, 1), "tensors": tensors})
    _corrupt(store, 1, message)


def test_a_zero_size_is_a_size(tmp_path: Path) -> None:
    store = _store(tmp_path, snapshots=1)
    m = _manifest(store, 1)
    empty = b""
    m["tensors"]["m/empty"] = {"dtype": "float32", "shape": [0, 3], "enc": "raw", "nbytes": 0,
                               "sha": codec.digest(empty), "chunk": _put_chunk(store, zstandard.compress(empty)),
                               "stored": 9, "delta": False, "from_parent": False}  # fmt: skip
    _write(store, 1, m)
    assert load(store, W, 1).tensor("m/empty").shape == (0, 3)


# -- chains ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("parent", "shown"), [("1", "'1'"), (3, "3"), (4, "4"), (None, "None")])
def test_a_parent_link_that_does_not_lead_back_is_refused(tmp_path: Path, parent: object, shown: str) -> None:
    store = _store(tmp_path)
    _write(store, 3, {**_manifest(store, 3), "parent": parent})
    reads: list[int] = []
    get_manifest = store.get_manifest

    def counted(worker: str, seq: int) -> bytes:
        reads.append(seq)
        return get_manifest(worker, seq)

    store.get_manifest = counted  # type: ignore[method-assign]
    _corrupt(store, 3, rf"^snapshot w/3: broken parent link {shown}$")
    assert reads == [3]  # refused at the first link, not after MAX_CHAIN reads of a loop


def test_a_damaged_link_in_the_chain_is_named(tmp_path: Path) -> None:
    store = _store(tmp_path)
    (store.root / "manifests" / W / f"{2:08d}.json").unlink()
    _corrupt(store, 3, r"^snapshot w/3: its chain is damaged: ")
    assert load(store, W, 1).seq == 1


def test_the_chain_walk_stops_past_max_chain(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = _store(tmp_path)
    monkeypatch.setattr(reader, "MAX_CHAIN", 1)
    assert load(store, W, 2).seq == 2  # two manifests: within the bound
    _corrupt(store, 3, r"^snapshot w/3: broken parent link 1$")


# -- chunks ---------------------------------------------------------------------------------------------------
def _edit_entry(store: LocalDirStore, seq: int, name: str, **edit: Any) -> None:
    m = _manifest(store, seq)
    m["tensors"][name] = {**m["tensors"][name], **edit}
    _write(store, seq, m)


def test_an_entry_without_a_chunk_is_named(tmp_path: Path) -> None:
    store = _store(tmp_path, snapshots=1)
    _edit_entry(store, 1, "m/weight", chunk=None)
    _corrupt(store, 1, r"^snapshot w/1: tensor m/weight: no chunk$")


def test_a_chunk_that_is_not_zstd_is_named(tmp_path: Path) -> None:
    store = _store(tmp_path, snapshots=1)
    _edit_entry(store, 1, "m/weight", chunk=_put_chunk(store, b"not zstd at all"))
    _corrupt(store, 1, r"^snapshot w/1: tensor m/weight: chunk [0-9a-f]{12} does not decompress")


def test_a_chunk_shorter_than_the_manifest_says_is_named(tmp_path: Path) -> None:
    store = _store(tmp_path, snapshots=1)
    nbytes = _manifest(store, 1)["tensors"]["m/weight"]["nbytes"]
    _edit_entry(store, 1, "m/weight", nbytes=nbytes + 4)
    _corrupt(store, 1, rf"^snapshot w/1: tensor m/weight: chunk holds {nbytes} bytes, manifest says {nbytes + 4}$")


def test_a_damaged_chunk_is_named_with_its_id(tmp_path: Path) -> None:
    store = _store(tmp_path, snapshots=1)
    chunk_id = _manifest(store, 1)["tensors"]["m/weight"]["chunk"]
    path = store.root / "chunks" / chunk_id[:2] / chunk_id
    path.write_bytes(path.read_bytes() + b"\0")
    _corrupt(store, 1, rf"^snapshot w/1: tensor m/weight: chunk {chunk_id[:12]} is damaged \(checksum mismatch\)$")


def test_a_missing_chunk_is_named(tmp_path: Path) -> None:
    store = _store(tmp_path, snapshots=1)
    chunk_id = _manifest(store, 1)["tensors"]["m/weight"]["chunk"]
    (store.root / "chunks" / chunk_id[:2] / chunk_id).unlink()
    _corrupt(store, 1, rf"^snapshot w/1: tensor m/weight: chunk {chunk_id[:12]} is missing$")


def test_a_delta_on_a_parent_of_another_length_is_refused(tmp_path: Path) -> None:
    store = _store(tmp_path)
    entry = _manifest(store, 2)["tensors"]["m/weight"]
    assert entry["delta"]
    longer = bytes(entry["nbytes"] + 4)
    _edit_entry(store, 2, "m/weight", chunk=_put_chunk(store, zstandard.compress(longer)), nbytes=len(longer))
    _corrupt(store, 2, r"^snapshot w/2: delta of m/weight has no matching parent$")


def test_a_tensor_the_parent_lacks_is_named(tmp_path: Path) -> None:
    store = _store(tmp_path)
    m = _manifest(store, 2)
    m["tensors"]["m/extra"] = {**m["tensors"]["m/weight"]}
    _write(store, 2, m)
    _corrupt(store, 2, r"^snapshot w/1: tensor m/extra refers to a missing parent$")


def test_a_chain_without_a_full_chunk_is_refused(tmp_path: Path) -> None:
    store = _store(tmp_path)
    _edit_entry(store, 1, "m/weight", delta=True)
    _corrupt(store, 2, r"^snapshot w/2: tensor m/weight has no full chunk in its chain$")


def test_a_tensor_carried_from_the_parent_is_read_from_there(tmp_path: Path) -> None:
    store = _store(tmp_path)
    bias_entry = _manifest(store, 1)["tensors"]["m/bias"]
    _edit_entry(store, 3, "m/bias", from_parent=True, chunk=None, delta=False, sha=bias_entry["sha"])
    _edit_entry(store, 2, "m/bias", from_parent=True, chunk=None, delta=False)
    assert torch.equal(load(store, W, 3).tensor("m/bias"), load(store, W, 1).tensor("m/bias"))


# -- loading --------------------------------------------------------------------------------------------------
def test_loaded_lists_decodes_and_times(tmp_path: Path) -> None:
    store = _store(tmp_path)
    loaded = load(store, W, 3)
    assert loaded.seq == 3 and 0 < loaded.read_s < 60  # seconds this load took
    assert [n for n, _ in loaded.tensors("m/w")] == ["m/weight"]
    assert [n for n, _ in loaded.tensors()] == list(loaded.manifest["tensors"])
    every = loaded.decode_all()
    assert {"m/weight", "m/bias"} <= set(every) == set(loaded.manifest["tensors"])
    assert all(torch.equal(every[n], t) for n, t in loaded.tensors())
    assert reader._workers() == max(1, min(4, os.cpu_count() or 1))


def test_load_latest_bounds_and_fallback(tmp_path: Path) -> None:
    store = _store(tmp_path)
    latest = load_latest(store, W, at_most=2)
    assert latest is not None and latest.seq == 2  # at_most is inclusive
    assert load_latest(store, W, at_most=0) is None
    assert load_latest(store, "nobody") is None
    _edit_entry(store, 3, "m/weight", chunk=None)
    fallback = reader.Fallback()
    latest = load_latest(store, W, fallback=fallback)
    assert latest is not None and latest.seq == 2
    assert fallback.skipped == [(3, "snapshot w/3: tensor m/weight: no chunk")]
    again = load_latest(store, W)  # without a Fallback to fill in
    assert again is not None and again.seq == 2


def test_verify_names_each_snapshot(tmp_path: Path) -> None:
    store = _store(tmp_path)
    _edit_entry(store, 2, "m/weight", chunk=None)
    assert reader.verify(store, W) == [
        (1, None),
        (2, "snapshot w/2: tensor m/weight: no chunk"),
        (3, "snapshot w/3: tensor m/weight: no chunk"),  # 3's delta of m/weight applies on 2's
    ]


# -- codec ----------------------------------------------------------------------------------------------------
def test_torch_dtype_knows_the_listed_names_only() -> None:
    assert codec.torch_dtype("bfloat16") is torch.bfloat16
    assert codec.torch_dtype("bool") is torch.bool
    for name in ("float", "Tensor", "float32 "):
        with pytest.raises(ValueError, match=rf"^dtype {name!r} is not a tensor dtype this torch knows$"):
            codec.torch_dtype(name)


def test_modes_and_their_overrides() -> None:
    assert codec.MODES[2].as_dict() == {"level": 2, "name": "q8-lite", "weight_bits": 8, "optimizer": "quantize",
                                        "optimizer_bits": 4, "optimizer_in_deltas": False}  # fmt: skip
    assert codec.mode_for(0) is codec.MODES[0] and codec.mode_for(0, "keep") is codec.MODES[0]
    drop = codec.mode_for(0, "drop")
    assert (drop.name, drop.optimizer_bits, drop.optimizer_in_deltas, drop.lossless) == (
        "lossless+optim-drop", 8, True, False)  # fmt: skip
    keep = codec.mode_for(3, "keep")
    assert (keep.name, keep.weight_bits, keep.optimizer_bits, keep.optimizer_in_deltas, keep.lossless) == (
        "q4-lite+optim-keep", 4, 32, True, False)  # fmt: skip
    d2 = codec.mode_for(2, "drop")
    assert (d2.level, d2.optimizer, d2.optimizer_bits, d2.optimizer_in_deltas) == (2, "drop", 4, False)
    with pytest.raises(ValueError, match=r"^snapshot_compression_level=-1 is invalid: expected one of \[0, 1, 2, 3\]"):
        codec.mode_for(-1)
    with pytest.raises(ValueError, match=r"^optimizer policy 'x' is invalid: expected one of \('keep'"):
        codec.mode_for(1, "x")


def test_stage_quantizes_from_quantize_min_elements() -> None:
    g = torch.Generator().manual_seed(1)
    at = codec.stage(torch.randn(codec.QUANTIZE_MIN, generator=g), 8)
    below = codec.stage(torch.randn(codec.QUANTIZE_MIN - 1, generator=g), 8)
    assert (at.enc, below.enc) == ("q8", "raw")
    assert codec.stage(torch.randn(codec.QUANTIZE_MIN, generator=g), 32).enc == "raw"
    ints = codec.stage(torch.arange(codec.QUANTIZE_MIN * 2), 4)
    assert (ints.enc, ints.dtype, ints.shape) == ("raw", "int64", (codec.QUANTIZE_MIN * 2,))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("bits", [8, 4])
def test_each_float_dtype_quantizes_and_comes_back_in_its_dtype(dtype: Any, bits: int) -> None:
    t = torch.randn(64, 80, generator=torch.Generator().manual_seed(bits)).to(dtype)
    staged = codec.stage(t, bits)
    assert (staged.enc, staged.dtype, staged.shape) == (f"q{bits}", str(dtype)[6:], (64, 80))
    spec = {"dtype": staged.dtype, "shape": [64, 80], "enc": staged.enc, "sqrt": False, "block": None}
    back = codec.decode(staged.encoded(), spec)
    assert back.dtype == dtype and back.shape == t.shape
    step = t.double().abs().max() / quant.QMAX[bits]
    rounding = t.double().abs().max() * torch.finfo(dtype).eps  # the decoded value is rounded to the dtype
    assert (back.double() - t.double()).abs().max() <= step * 0.51 + rounding


def test_sqrt_is_used_for_a_tensor_whose_least_value_is_zero() -> None:
    t = torch.rand(codec.QUANTIZE_MIN, generator=torch.Generator().manual_seed(2))
    t[0] = 0.0
    assert codec.stage(t, 8, nonneg_sqrt=True).sqrt
    assert not codec.stage(t, 8).sqrt  # only when asked
    t[0] = -1e-12
    assert not codec.stage(t, 8, nonneg_sqrt=True).sqrt


def test_decode_uses_the_block_size_of_the_manifest() -> None:
    t = torch.randn(5000, generator=torch.Generator().manual_seed(3))
    q = quant.quantize(t, 8, block=64)
    enc = quant.to_bytes(q).numpy()
    spec = {"dtype": "float32", "shape": [5000], "enc": "q8", "block": 64}
    assert torch.equal(codec.decode(enc, spec), quant.dequantize(q, torch.float32))
    default = quant.quantize(t, 8)
    spec_default = {"dtype": "float32", "shape": [5000], "enc": "q8", "block": None}
    assert torch.equal(codec.decode(quant.to_bytes(default).numpy(), spec_default), quant.dequantize(default))


def test_a_quantized_scalar_decodes_to_one_value() -> None:
    q = quant.quantize(torch.tensor([0.5]), 8)
    back = codec.decode(quant.to_bytes(q).numpy(), {"dtype": "float32", "shape": [], "enc": "q8"})
    assert back.shape == () and back.item() == pytest.approx(0.5, rel=1e-2)


def test_decoding_copies_raw_bytes_and_read_only_quantized_bytes() -> None:
    raw = np.arange(16, dtype=np.uint8)
    t = codec.decode(raw, {"dtype": "int32", "shape": [4], "enc": "raw"})
    before = t.clone()
    raw[:] = 0
    assert torch.equal(t, before)
    staged = codec.stage(torch.randn(codec.QUANTIZE_MIN), 8)
    ro = staged.encoded().copy()
    ro.flags.writeable = False
    spec = {"dtype": "float32", "shape": [codec.QUANTIZE_MIN], "enc": "q8"}
    assert torch.equal(codec.decode(ro, spec), codec.decode(staged.encoded(), spec))


@pytest.mark.parametrize("bits", [8, 4])
def test_a_sqrt_tensor_with_a_zero_block_and_a_half_step_floor(bits: int) -> None:
    block, n = quant.DEFAULT_BLOCK, codec.QUANTIZE_MIN
    t = torch.full((n,), 4.0)
    t[:block] = 0.0  # block 0 all zero: decodes to exactly 0
    t[block] = 0.0  # a zero in a nonzero block: half a step, squared
    staged = codec.stage(t, bits, nonneg_sqrt=True)
    assert staged.sqrt
    spec = {"dtype": "float32", "shape": [n], "enc": staged.enc, "sqrt": True}
    back = codec.decode(staged.encoded(), spec)
    assert torch.equal(back[:block], torch.zeros(block))
    half_step = 2.0 / quant.QMAX[bits] / 2  # sqrt(4) = 2 is the block's absmax
    assert back[block].item() == pytest.approx(half_step**2, rel=1e-5)
    assert back[block + 1 :].tolist() == pytest.approx([4.0] * (n - block - 1), rel=1e-5)


def test_host_copy_and_digest() -> None:
    t = torch.ones(3)
    c = codec.host_copy(t)
    t.add_(1)
    assert c.tolist() == [1.0, 1.0, 1.0] and c.device.type == "cpu"
    data = b"abc"
    assert codec.digest(data) == codec.digest(np.frombuffer(data, dtype=np.uint8))
    assert codec.digest(data) == "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"


def test_restore_threads_follow_the_cpus_from_one_to_four(monkeypatch: pytest.MonkeyPatch) -> None:
    for cpus, workers in ((None, 1), (1, 1), (3, 3), (4, 4), (64, 4)):
        monkeypatch.setattr(os, "cpu_count", lambda cpus=cpus: cpus)
        assert reader._workers() == workers, cpus


def test_a_chunk_written_without_its_content_size_still_reads(tmp_path: Path) -> None:
    # A streaming compressor does not record the size in the frame: the manifest's nbytes bounds the output.
    store = _store(tmp_path, snapshots=1)
    loaded = load(store, W, 1)
    raw = loaded.encoded["m/weight"].tobytes()
    data = zstandard.ZstdCompressor(write_content_size=False).compress(raw)
    _edit_entry(store, 1, "m/weight", chunk=_put_chunk(store, data))
    assert torch.equal(load(store, W, 1).tensor("m/weight"), loaded.tensor("m/weight"))


@pytest.mark.parametrize("dtype", ["float64", "float16"])
def test_a_sqrt_tensor_comes_back_in_its_dtype(dtype: str) -> None:
    t = torch.rand(codec.QUANTIZE_MIN, generator=torch.Generator().manual_seed(4)).to(getattr(torch, dtype))
    staged = codec.stage(t, 8, nonneg_sqrt=True)
    spec = {"dtype": dtype, "shape": [codec.QUANTIZE_MIN], "enc": "q8", "sqrt": True}
    assert staged.sqrt and codec.decode(staged.encoded(), spec).dtype == t.dtype


def test_the_bytes_of_a_strided_tensor_are_its_elements_in_order() -> None:
    every_other = torch.arange(10, dtype=torch.float32)[::2]  # a 1-D view that reshape(-1) leaves strided
    assert codec._tensor_bytes(every_other).view(np.float32).tolist() == [0.0, 2.0, 4.0, 6.0, 8.0]


def test_a_manifest_that_cannot_be_read_is_named(tmp_path: Path) -> None:
    store = _store(tmp_path, snapshots=1)
    _corrupt(store, 9, r"^snapshot w/9 does not exist$")
    path = store.root / "manifests" / W / f"{1:08d}.json"
    path.write_bytes(path.read_bytes()[:10])
    _corrupt(store, 1, r"^snapshot w/1: not valid JSON")


def test_stage_says_sqrt_false_for_a_tensor_stored_as_it_is() -> None:
    assert codec.stage(torch.randn(codec.QUANTIZE_MIN), 8, nonneg_sqrt=True).sqrt is False
