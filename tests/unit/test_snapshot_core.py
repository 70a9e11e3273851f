"""dsec.snapshot: codec, store, chains, corruption fallback, crash consistency, coalescing, step gate, retention.

Every Snapshotter is closed by its test (``with`` or try/finally): the conftest fails a test that leaks a
``dsec-*`` thread. Models are small (the largest tensor is 512x512) except in the crash test, whose child
process snapshots a 2048x2048 layer so that a kill lands mid-write.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn import functional as F  # noqa: E402

from dsec import quant  # noqa: E402
from dsec.snapshot import (  # noqa: E402
    MODES,
    CorruptSnapshot,
    LocalDirStore,
    Snapshotter,
    StoreError,
    collect_garbage,
    compact,
    listing,
    load,
    load_latest,
    mode_for,
    replay_metadata,
    verify,
)
from dsec.snapshot import codec as snapcodec  # noqa: E402
from dsec.snapshot.manifest import seal  # noqa: E402
from dsec.snapshot.reader import Loaded, read_manifest  # noqa: E402

BLOCK = quant.DEFAULT_BLOCK
# Tensor names of make_model() under the registered name "m": the two large weights are quantized in levels 1-3.
QUANTIZED = ("m/0.weight", "m/2.weight")
RAW_MODEL = (
    "m/0.bias",
    "m/2.bias",
    "m/3.weight",
    "m/3.bias",
    "m/3.running_mean",
    "m/3.running_var",
    "m/3.num_batches_tracked",
    "m/4.weight",  # 2048 elements < QUANTIZE_MIN: raw in every level
    "m/4.bias",
)
QUANTIZED_PARAM_IDX = (0, 2)  # Adam state indices of the two quantized weights


# -- helpers --------------------------------------------------------------------------------------------------
def make_model(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 512), nn.BatchNorm1d(512), nn.Linear(512, 4))


def train(model: nn.Module, opt: torch.optim.Optimizer, steps: int, seed: int) -> None:
    """A few Adam steps on random data from a private generator (the global torch RNG is left alone)."""
    g = torch.Generator().manual_seed(seed)
    model.train()
    for _ in range(steps):
        x = torch.randn(32, 64, generator=g)
        y = torch.randn(32, 4, generator=g)
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()


def nudge(model: nn.Sequential, row: int, amount: float = 0.25) -> None:
    """Change one row of the 512x512 weight and one bias entry: a small, delta-friendly change."""
    with torch.no_grad():
        model[2].weight[row].add_(amount)
        model[0].bias[row % 512].add_(amount)


def model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {f"m/{k}": v.detach().clone() for k, v in model.state_dict().items()}


def opt_state(opt: torch.optim.Optimizer) -> dict[int, dict[str, torch.Tensor]]:
    return {i: {k: v.detach().clone() for k, v in s.items()} for i, s in opt.state_dict()["state"].items()}


def assert_model_equal(model: nn.Module, expected: dict[str, torch.Tensor]) -> None:
    got = model_state(model)
    assert got.keys() == expected.keys()
    for name, value in expected.items():
        assert torch.equal(got[name], value), name


def assert_block_bound(true: torch.Tensor, got: torch.Tensor, bits: int, *, sqrt: bool = False) -> None:
    """|true - got| <= absmax(block)/(2*qmax) per 256-element block (in the square-root domain when ``sqrt``),
    and therefore also <= absmax(tensor)/(2*qmax)."""
    x = true.detach().reshape(-1).double()
    y = got.detach().reshape(-1).double()
    assert x.shape == y.shape
    if sqrt:
        assert torch.all(y >= 0)
        x, y = x.sqrt(), y.sqrt()
    qmax = quant.QMAX[bits]
    n = x.numel()
    absmax = F.pad(x, (0, -n % BLOCK)).view(-1, BLOCK).abs().amax(dim=1)
    bound = (absmax / (2 * qmax)).repeat_interleave(BLOCK)[:n]
    err = (x - y).abs()
    slack = 1e-3 if sqrt else 1e-4  # float32 rounding of the scale, the product and (sqrt) the square
    worst = int(torch.argmax(err - bound))
    assert torch.all(err <= bound * (1 + slack) + 1e-12), (
        f"element {worst}: error {err[worst].item():.3g} > bound {bound[worst].item():.3g}"
    )
    assert err.max() <= x.abs().max() / (2 * qmax) * (1 + slack) + 1e-12


def spec_of(staged: snapcodec.Staged) -> dict[str, Any]:
    return {
        "dtype": staged.dtype,
        "shape": list(staged.shape),
        "enc": staged.enc,
        "sqrt": staged.sqrt,
        "block": staged.q.block if staged.q is not None else None,
    }


def chunk_file(store: LocalDirStore, chunk_id: str) -> Path:
    return store.root / "chunks" / chunk_id[:2] / chunk_id


def chunks_of(store: LocalDirStore, worker: str, seq: int) -> set[str]:
    return {e["chunk"] for e in read_manifest(store, worker, seq)["tensors"].values() if e.get("chunk")}


def flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def bad_seqs(store: LocalDirStore, worker: str) -> list[int]:
    return [seq for seq, reason in verify(store, worker) if reason is not None]


class GatedStore(LocalDirStore):
    """A local store whose put_manifest waits for ``gate``: holds a snapshot 'in flight' deterministically."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()

    def put_manifest(self, worker: str, seq: int, data: bytes) -> None:
        self.entered.set()
        if not self.gate.wait(30):
            raise TimeoutError("test gate never opened")
        super().put_manifest(worker, seq, data)


class Events:
    def __init__(self) -> None:
        self.items: list[tuple[str, dict[str, Any]]] = []
        self._lock = threading.Lock()

    def __call__(self, kind: str, data: dict[str, Any]) -> None:
        with self._lock:
            self.items.append((kind, data))

    def of(self, kind: str) -> list[dict[str, Any]]:
        with self._lock:
            return [d for k, d in self.items if k == kind]


# -- 1. round trip per level ----------------------------------------------------------------------------------
EXPECTED_ENC = {0: ("raw", "raw"), 1: ("q8", "q8"), 2: ("q8", "q4"), 3: ("q4", "q4")}


@pytest.mark.parametrize("level", sorted(MODES))
def test_round_trip_every_level(tmp_path: Path, level: int) -> None:
    model = make_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    train(model, opt, 3, seed=1)
    store = LocalDirStore(tmp_path / "store")
    with Snapshotter(store, "w", level=level) as snap:
        snap.register("m", model)
        snap.register("adam", opt)
        ticket = snap.take(step=3, wait=True)
        assert ticket.error is None and ticket.seq == 1
        want_model, want_opt = model_state(model), opt_state(opt)
        train(model, opt, 2, seed=2)  # move away from the snapshot
        report = snap.restore_latest()
    assert report is not None and report.seq == 1 and report.step == 3 and report.skipped == []
    assert report.lossless is (level == 0)

    manifest = read_manifest(store, "w", 1)
    assert manifest["mode"]["level"] == level
    wenc, oenc = EXPECTED_ENC[level]
    for name in QUANTIZED:
        assert manifest["tensors"][name]["enc"] == wenc
    for idx in QUANTIZED_PARAM_IDX:
        assert manifest["tensors"][f"adam/state/{idx}/exp_avg"]["enc"] == oenc
        assert manifest["tensors"][f"adam/state/{idx}/exp_avg_sq"]["enc"] == oenc
    for name in RAW_MODEL:
        assert manifest["tensors"][name]["enc"] == "raw"

    got_model, got_opt = model_state(model), opt_state(opt)
    assert got_opt.keys() == want_opt.keys()
    if level == 0:
        assert_model_equal(model, want_model)
        for idx, state in want_opt.items():
            for key, value in state.items():
                assert torch.equal(got_opt[idx][key], value), (idx, key)
        return

    wbits = MODES[level].weight_bits
    obits = MODES[level].optimizer_bits
    for name in QUANTIZED:
        assert not torch.equal(got_model[name], want_model[name]), f"{name} was not quantized"
        assert_block_bound(want_model[name], got_model[name], wbits)
    for name in RAW_MODEL:  # biases, BatchNorm statistics, small weights: exact in every level
        assert torch.equal(got_model[name], want_model[name]), name
    for idx, state in want_opt.items():
        assert torch.equal(got_opt[idx]["step"], state["step"]), idx  # Adam's step counter is exact
        for key in ("exp_avg", "exp_avg_sq"):
            if idx in QUANTIZED_PARAM_IDX:
                assert_block_bound(state[key], got_opt[idx][key], obits, sqrt=key == "exp_avg_sq")
            else:
                assert torch.equal(got_opt[idx][key], state[key]), (idx, key)
    for idx in QUANTIZED_PARAM_IDX:  # the half-step floor: a restored second moment is never 0
        assert got_opt[idx]["exp_avg_sq"].min() > 0


# -- 2. codec -------------------------------------------------------------------------------------------------
def test_codec_raw_is_exact_for_every_kind_of_tensor() -> None:
    torch.manual_seed(0)
    cases = [
        torch.randn(100),  # small float: raw even when 8 bits are asked for
        torch.randn(64, 128).t(),  # non-contiguous (transposed) float, large
        torch.arange(5000, dtype=torch.int64),  # integer: never quantized
        torch.randn(4096).to(torch.bfloat16),
        torch.tensor(7.0),  # 0-dim (Adam's step)
        torch.zeros(0, dtype=torch.uint8),
        torch.rand(70) > 0.5,
    ]
    for t in cases:
        for bits in (32, 8, 4):
            if bits < 32 and t.is_floating_point() and t.numel() >= snapcodec.QUANTIZE_MIN:
                continue
            staged = snapcodec.stage(t, bits)
            assert staged.enc == "raw"
            enc = staged.encoded()
            assert enc.dtype == np.uint8 and enc.nbytes == t.numel() * t.element_size()
            back = snapcodec.decode(enc, spec_of(staged))
            assert back.dtype == t.dtype and back.shape == t.shape
            assert torch.equal(back, t)


def test_empty_tensor_round_trips(tmp_path: Path) -> None:
    model = make_model()
    model.register_buffer("empty", torch.zeros(0))
    with Snapshotter(LocalDirStore(tmp_path), "w", level=0) as snap:
        snap.register("m", model)
        snap.take(wait=True)
        report = snap.restore_latest()
    assert report is not None and model.empty.shape == (0,)


def test_codec_stage_copies_raw_tensors() -> None:
    t = torch.randn(10)
    staged = snapcodec.stage(t, 32)
    before = staged.encoded().copy()
    t.add_(1.0)
    assert np.array_equal(staged.encoded(), before)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("shape", [(4096,), (5000,), (96, 77), (64, 128, 2)])
def test_codec_quantized_round_trip_within_block_bound(bits: int, shape: tuple[int, ...]) -> None:
    g = torch.Generator().manual_seed(bits * 1000 + len(shape))
    n = int(np.prod(shape))
    t = (torch.randn(n, generator=g) * torch.logspace(-4, 2, n)).reshape(shape)
    staged = snapcodec.stage(t, bits)
    assert staged.enc == f"q{bits}" and not staged.sqrt
    enc = staged.encoded()
    code_bytes, nblocks = quant.encoded_size(n, bits)
    assert enc.nbytes == code_bytes + 4 * nblocks
    back = snapcodec.decode(enc, spec_of(staged))
    assert back.shape == t.shape and back.dtype == t.dtype
    assert_block_bound(t, back, bits)
    # Decoding the same bytes twice gives the same tensor (what a delta chain relies on).
    assert torch.equal(back, snapcodec.decode(enc.copy(), spec_of(staged)))


def test_codec_quantized_non_contiguous_matches_contiguous() -> None:
    torch.manual_seed(3)
    t = torch.randn(128, 96).t()
    a = snapcodec.stage(t, 8)
    b = snapcodec.stage(t.contiguous(), 8)
    assert np.array_equal(a.encoded(), b.encoded())
    assert_block_bound(t, snapcodec.decode(a.encoded(), spec_of(a)), 8)


@pytest.mark.parametrize("bits", [8, 4])
def test_codec_sqrt_for_nonneg_tensors_never_decodes_to_zero(bits: int) -> None:
    g = torch.Generator().manual_seed(bits)
    t = torch.rand(6000, generator=g) * 1e-8  # Adam second moments: tiny and non-negative
    t[::7] = 0.0
    t[5] = 3e-8  # a few larger values so that most codes of their block are 0
    staged = snapcodec.stage(t, bits, nonneg_sqrt=True)
    assert staged.sqrt and staged.enc == f"q{bits}"
    back = snapcodec.decode(staged.encoded(), spec_of(staged))
    assert back.min() > 0, "a zero code must decode to half a step squared, never 0"
    assert_block_bound(t, back, bits, sqrt=True)
    # The zero-code value is exactly (scale/2)^2 of its block.
    root_absmax = t.sqrt()[:BLOCK].abs().max()
    half_step_sq = (root_absmax / quant.QMAX[bits] / 2) ** 2
    assert back[0].item() == pytest.approx(half_step_sq.item(), rel=1e-5)

    signed = torch.randn(5000, generator=g)
    staged = snapcodec.stage(signed, bits, nonneg_sqrt=True)
    assert not staged.sqrt  # a tensor with negative entries is quantized directly
    assert_block_bound(signed, snapcodec.decode(staged.encoded(), spec_of(staged)), bits)


@pytest.mark.parametrize("bits", [8, 4])
def test_codec_sqrt_all_zero_block_stays_small(bits: int) -> None:
    t = torch.rand(4096, generator=torch.Generator().manual_seed(0)) * 1e-6
    t[:BLOCK] = 0.0  # e.g. exp_avg_sq of weights that never received a gradient
    staged = snapcodec.stage(t, bits, nonneg_sqrt=True)
    back = snapcodec.decode(staged.encoded(), spec_of(staged))
    assert back[:BLOCK].max() <= t.max()


def test_codec_decode_rejects_wrong_length() -> None:
    staged = snapcodec.stage(torch.randn(5000), 8)
    with pytest.raises(ValueError, match="does not encode"):
        snapcodec.decode(staged.encoded()[:-1], spec_of(staged))


@settings(max_examples=200, deadline=None)
@given(st.binary(min_size=0, max_size=300), st.binary(min_size=0, max_size=300), st.sampled_from(["xor", "sub"]))
def test_codec_delta_is_invertible(a: bytes, b: bytes, op: str) -> None:
    n = min(len(a), len(b))
    new = np.frombuffer(a[:n], dtype=np.uint8)
    old = np.frombuffer(b[:n], dtype=np.uint8)
    d = snapcodec.delta(new, old, op)
    assert d.dtype == np.uint8 and d.shape == new.shape
    assert np.array_equal(snapcodec.undelta(d, old, op), new)
    assert not snapcodec.delta(old, old, op).any()  # no change -> all zero bytes


def test_codec_delta_op_and_sub_wraps() -> None:
    assert snapcodec.delta_op("raw") == "xor"
    assert snapcodec.delta_op("q8") == snapcodec.delta_op("q4") == "sub"
    old = np.array([0, 255, 10], dtype=np.uint8)
    new = np.array([255, 0, 11], dtype=np.uint8)
    d = snapcodec.delta(new, old, "sub")
    assert d.tolist() == [255, 1, 1]
    assert np.array_equal(snapcodec.undelta(d, old, "sub"), new)


def test_mode_for_levels_and_overrides() -> None:
    assert [MODES[i].level for i in range(4)] == [0, 1, 2, 3]
    assert MODES[0].lossless and not any(MODES[i].lossless for i in (1, 2, 3))
    with pytest.raises(ValueError, match="snapshot_compression_level=7"):
        mode_for(7)
    with pytest.raises(ValueError, match="optimizer policy 'bogus'"):
        mode_for(2, "bogus")
    keep = mode_for(2, "keep")
    assert keep.optimizer_bits == 32 and keep.optimizer_in_deltas and keep.weight_bits == 8
    q0 = mode_for(0, "quantize")
    assert q0.optimizer_bits == 8 and not q0.lossless
    assert mode_for(3, "drop").optimizer == "drop"
    assert mode_for(1, "quantize") is MODES[1]


# -- 3. incremental chain -------------------------------------------------------------------------------------
def test_incremental_chain_kinds_deltas_and_middle_restore(tmp_path: Path) -> None:
    model = make_model()
    store = LocalDirStore(tmp_path)
    expected: dict[int, dict[str, torch.Tensor]] = {}
    with Snapshotter(store, "w", level=0, base_every=4) as snap:
        snap.register("m", model)
        for i in range(6):
            if i:
                nudge(model, row=i)
            t = snap.take(step=i, wait=True)
            assert t.error is None
            expected[t.seq] = model_state(model)
        seqs = sorted(expected)
        assert seqs == [1, 2, 3, 4, 5, 6]
        kinds = [read_manifest(store, "w", s)["kind"] for s in seqs]
        assert kinds == ["base", "delta", "delta", "delta", "base", "delta"]
        for s in seqs:
            m = read_manifest(store, "w", s)
            assert m["base"] == (1 if s <= 4 else 5)
            assert m["parent"] == (None if s in (1, 5) else s - 1)
        # A changed row of a 1 MiB tensor is stored as a small byte delta.
        entry = read_manifest(store, "w", 2)["tensors"]["m/2.weight"]
        assert entry["delta"] and not entry["from_parent"]
        assert entry["stored"] < entry["nbytes"] / 20

        # Unchanged model -> a delta of nothing but from_parent entries and no stored bytes.
        t = snap.take(step=99, wait=True)
        assert t.seq == 7
        expected[7] = model_state(model)
        m7 = read_manifest(store, "w", 7)
        assert m7["kind"] == "delta"
        assert all(e["from_parent"] and e.get("chunk") is None for e in m7["tensors"].values())
        assert m7["stats"]["stored_bytes"] == 0 and t.stats["stored_bytes"] == 0

        # Any snapshot of the chain loads as it was taken.
        for s in (3, 6):
            loaded = load(store, "w", s)
            assert loaded.seq == s
            for name, value in loaded.tensors("m/"):
                assert torch.equal(value, expected[s][name]), (s, name)

        nudge(model, row=300, amount=5.0)
        report = snap.restore_latest(at_most=3)
        assert report is not None and report.seq == 3 and report.step == 2
        assert_model_equal(model, expected[3])
        report = snap.restore_latest()
        assert report is not None and report.seq == 7
        assert_model_equal(model, expected[7])
        assert snap.restore_latest(at_most=0) is None
    assert bad_seqs(store, "w") == []
    assert [row["kind"] for row in listing(store, "w")] == [*kinds, "delta"]


def test_new_snapshotter_on_existing_store_continues_numbering_with_a_base(tmp_path: Path) -> None:
    model = make_model()
    store = LocalDirStore(tmp_path)
    with Snapshotter(store, "w", level=0, base_every=4) as snap:
        snap.register("m", model)
        snap.take(wait=True)
        nudge(model, 1)
        snap.take(wait=True)
    want = model_state(model)
    nudge(model, 2, 3.0)
    with Snapshotter(store, "w", level=0, base_every=4) as snap:
        snap.register("m", model)
        report = snap.restore_latest()
        assert report is not None and report.seq == 2
        assert_model_equal(model, want)
        t = snap.take(wait=True)
    assert t.seq == 3 and read_manifest(store, "w", 3)["kind"] == "base"


def test_restore_latest_empty_store_returns_none(tmp_path: Path) -> None:
    with Snapshotter(LocalDirStore(tmp_path), "w") as snap:
        snap.register("m", make_model())
        assert snap.restore_latest() is None
    assert load_latest(LocalDirStore(tmp_path), "w") is None


# -- 4. level 2: optimizer state from the base ---------------------------------------------------------------
def test_level2_delta_carries_optimizer_state_from_base(tmp_path: Path) -> None:
    model = make_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    train(model, opt, 3, seed=1)
    store = LocalDirStore(tmp_path)
    with Snapshotter(store, "w", level=2, base_every=4) as snap:
        snap.register("m", model)
        snap.register("adam", opt)
        assert snap.take(step=3, wait=True).seq == 1
        live_base_opt = opt_state(opt)
        train(model, opt, 2, seed=2)
        assert snap.take(step=5, wait=True).seq == 2
        live_delta_model = model_state(model)
        train(model, opt, 2, seed=3)

        m2 = read_manifest(store, "w", 2)
        assert m2["kind"] == "delta"
        opt_entries = {k: v for k, v in m2["tensors"].items() if k.startswith("adam/state/")}
        assert len(opt_entries) == 3 * 8  # step, exp_avg, exp_avg_sq for 8 parameters
        assert all(e["from_parent"] and e["chunk"] is None and e["stored"] == 0 for e in opt_entries.values())
        assert m2["meta"]["optimizers"]["adam"]["carried_from"] == 1
        assert "carried_from" not in read_manifest(store, "w", 1)["meta"]["optimizers"]["adam"]
        # The weights of the delta are its own (they changed), not the base's.
        assert not m2["tensors"]["m/2.weight"]["from_parent"]

        base = load(store, "w", 1)
        report = snap.restore_latest()
    assert report is not None and report.seq == 2 and not report.lossless
    got = opt_state(opt)
    for idx, state in got.items():
        for key, value in state.items():
            assert torch.equal(value, base.tensor(f"adam/state/{idx}/{key}")), (idx, key)
        assert state["step"].item() == 3.0  # the base's step count, not the delta's 5
        assert torch.equal(state["step"], live_base_opt[idx]["step"])
    for idx in QUANTIZED_PARAM_IDX:
        assert_block_bound(live_base_opt[idx]["exp_avg"], got[idx]["exp_avg"], 4)
    restored = model_state(model)
    for name in QUANTIZED:
        assert_block_bound(live_delta_model[name], restored[name], 8)
    for name in RAW_MODEL:
        assert torch.equal(restored[name], live_delta_model[name]), name


# -- 5. corruption --------------------------------------------------------------------------------------------
def _three_snapshots(store: LocalDirStore, events: Events, **kw: Any) -> dict[int, dict[str, torch.Tensor]]:
    model = make_model()
    expected = {}
    with Snapshotter(store, "w", level=0, on_event=events, **kw) as snap:
        snap.register("m", model)
        for i in range(3):
            nudge(model, row=10 + i)
            t = snap.take(step=i, wait=True)
            expected[t.seq] = model_state(model)
    return expected


def test_corrupt_chunk_of_newest_snapshot_is_skipped(tmp_path: Path) -> None:
    store = LocalDirStore(tmp_path)
    events = Events()
    expected = _three_snapshots(store, events, base_every=4)
    own = read_manifest(store, "w", 3)["tensors"]["m/2.weight"]["chunk"]
    assert own not in chunks_of(store, "w", 1) | chunks_of(store, "w", 2)
    flip_byte(chunk_file(store, own))

    assert bad_seqs(store, "w") == [3]
    model = make_model(seed=5)
    with Snapshotter(store, "w", level=0, on_event=events) as snap:
        snap.register("m", model)
        report = snap.restore_latest()
    assert report is not None and report.seq == 2
    assert [s for s, _ in report.skipped] == [3]
    assert "damaged" in report.skipped[0][1]
    assert [e["id"] for e in events.of("snapshot_skipped")] == ["w/3"]
    restore_events = events.of("restore")
    assert restore_events and restore_events[-1]["id"] == "w/2"
    assert restore_events[-1]["skipped"][0]["id"] == "w/3"
    assert_model_equal(model, expected[2])


def test_truncated_manifest_is_skipped(tmp_path: Path) -> None:
    store = LocalDirStore(tmp_path)
    events = Events()
    expected = _three_snapshots(store, events, base_every=4)
    path = store.root / "manifests" / "w" / f"{3:08d}.json"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])

    assert bad_seqs(store, "w") == [3]
    assert "error" in listing(store, "w")[-1]
    with pytest.raises(CorruptSnapshot, match="not valid JSON"):
        load(store, "w", 3)
    model = make_model(seed=5)
    with Snapshotter(store, "w", level=0, on_event=events) as snap:
        snap.register("m", model)
        report = snap.restore_latest()
    assert report is not None and report.seq == 2 and [s for s, _ in report.skipped] == [3]
    assert [e["id"] for e in events.of("snapshot_skipped")] == ["w/3"]
    assert_model_equal(model, expected[2])


def test_tampered_manifest_fails_its_checksum(tmp_path: Path) -> None:
    store = LocalDirStore(tmp_path)
    _three_snapshots(store, Events(), base_every=4)
    path = store.root / "manifests" / "w" / f"{2:08d}.json"
    path.write_bytes(path.read_bytes().replace(b'"step": 1', b'"step": 9'))
    with pytest.raises(CorruptSnapshot, match="checksum mismatch"):
        load(store, "w", 2)
    # 3 is a delta on top of 2: its chain is damaged too.
    assert bad_seqs(store, "w") == [2, 3]
    loaded = load_latest(store, "w")
    assert loaded is not None and loaded.seq == 1


def test_corrupt_base_of_newest_chain_falls_back_to_previous_chain(tmp_path: Path) -> None:
    store = LocalDirStore(tmp_path)
    events = Events()
    model = make_model()
    expected = {}
    with Snapshotter(store, "w", level=0, base_every=2, keep_chains=2, gc_grace_s=0, on_event=events) as snap:
        snap.register("m", model)
        for i in range(4):
            nudge(model, row=20 + i)
            t = snap.take(step=i, wait=True)
            expected[t.seq] = model_state(model)
    assert [read_manifest(store, "w", s)["kind"] for s in (1, 2, 3, 4)] == ["base", "delta", "base", "delta"]
    base_chunk = read_manifest(store, "w", 3)["tensors"]["m/2.weight"]["chunk"]
    assert base_chunk not in chunks_of(store, "w", 1) | chunks_of(store, "w", 2) | chunks_of(store, "w", 4)
    flip_byte(chunk_file(store, base_chunk))

    assert bad_seqs(store, "w") == [3, 4]
    model2 = make_model(seed=9)
    with Snapshotter(store, "w", level=0, on_event=events) as snap:
        snap.register("m", model2)
        report = snap.restore_latest()
    assert report is not None and report.seq == 2
    assert [s for s, _ in report.skipped] == [4, 3]
    assert [e["id"] for e in events.of("snapshot_skipped")] == ["w/4", "w/3"]
    assert_model_equal(model2, expected[2])


def test_missing_chunk_is_reported(tmp_path: Path) -> None:
    store = LocalDirStore(tmp_path)
    _three_snapshots(store, Events(), base_every=4)
    own = read_manifest(store, "w", 2)["tensors"]["m/2.weight"]["chunk"]
    chunk_file(store, own).unlink()
    with pytest.raises(CorruptSnapshot, match="missing"):
        load(store, "w", 2)
    assert bad_seqs(store, "w") == [2, 3]


def test_intact_chunk_rebuilding_other_bytes_fails_the_tensor_checksum(tmp_path: Path) -> None:
    # Snapshot 3's delta of m/2.weight is replaced by snapshot 2's: a real chunk (its name is its hash) of the
    # right length, in a manifest sealed again. Every check up to the rebuilt bytes passes; only the tensor's
    # own checksum (the sha of the encoded bytes it must rebuild to) tells that the weights are wrong.
    store = LocalDirStore(tmp_path)
    events = Events()
    expected = _three_snapshots(store, events, base_every=4)
    m3 = read_manifest(store, "w", 3)
    e2, e3 = read_manifest(store, "w", 2)["tensors"]["m/2.weight"], m3["tensors"]["m/2.weight"]
    assert e2["delta"] and e3["delta"] and e2["nbytes"] == e3["nbytes"] and e2["chunk"] != e3["chunk"]
    m3["tensors"]["m/2.weight"] = {**e3, "chunk": e2["chunk"], "stored": e2["stored"]}
    (store.root / "manifests" / "w" / f"{3:08d}.json").write_bytes(seal(m3))

    with pytest.raises(CorruptSnapshot, match=r"tensor m/2.weight does not match its checksum"):
        load(store, "w", 3)
    assert bad_seqs(store, "w") == [3]
    model = make_model(seed=5)
    with Snapshotter(store, "w", level=0, on_event=events) as snap:
        snap.register("m", model)
        report = snap.restore_latest()
    assert report is not None and report.seq == 2 and [s for s, _ in report.skipped] == [3]
    assert_model_equal(model, expected[2])


# -- 6. crash consistency -------------------------------------------------------------------------------------
CHILD = textwrap.dedent(
    """
    import sys
    import torch
    from dsec.snapshot import LocalDirStore, Snapshotter


    class Tracing(LocalDirStore):
        # Announces each write before it starts, so that the test can kill the process in the middle of it.
        def put_chunk(self, chunk_id, data):
            print("chunk", flush=True)
            super().put_chunk(chunk_id, data)

        def put_manifest(self, worker, seq, data):
            print("manifest", flush=True)
            super().put_manifest(worker, seq, data)


    torch.manual_seed(int(sys.argv[2]))
    torch.set_num_threads(1)
    model = torch.nn.Linear(2048, 2048)  # 16 MiB of float32: a chunk write takes milliseconds
    with Snapshotter(Tracing(sys.argv[1]), "crash", level=0, base_every=2, keep_chains=2, gc_grace_s=0) as snap:
        snap.register("m", model)
        while True:
            with torch.no_grad():
                model.weight.add_(torch.randn_like(model.weight), alpha=1e-3)
            ticket = snap.take(step=0, wait=True)
            assert ticket.error is None, ticket.error
            print("published", ticket.seq, flush=True)
    """
)


def _tmp_files(root: Path) -> list[Path]:
    return [Path(d) / f for d, _, files in os.walk(root) for f in files if f.startswith(".tmp-")]


def _unreferenced_chunks(store: LocalDirStore, worker: str) -> set[str]:
    referenced = set().union(set(), *(chunks_of(store, worker, s) for s in store.manifests(worker)))
    return {cid for cid, _ in store.chunks()} - referenced


def test_kill_during_writes_leaves_only_complete_snapshots(tmp_path: Path) -> None:
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    root = tmp_path / "store"
    last_printed = 0
    evidence = []  # (temp files, unreferenced chunks) found after each kill
    # Once >= 2 snapshots are published, kill on the next `marker` line after `delay` seconds: at the start of
    # the 16 MiB chunk write, a few ms into it, while the manifest is written, and between snapshots.
    for attempt, (marker, delay) in enumerate(
        [("chunk", 0.0), ("chunk", 0.004), ("manifest", 0.0), ("published", 0.03)]
    ):
        proc = subprocess.Popen(
            [sys.executable, str(script), str(root), str(attempt)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            seqs: list[int] = []
            assert proc.stdout is not None
            while True:
                line = proc.stdout.readline()
                if not line:
                    proc.wait(10)
                    pytest.fail(f"child exited early: {proc.stderr.read() if proc.stderr else ''}")
                ready = len(seqs) >= 2
                word, *rest = line.split()
                if word == "published":
                    seqs.append(int(rest[0]))
                if ready and word == marker:
                    break
            if delay:
                time.sleep(delay)
            proc.send_signal(signal.SIGKILL)
            proc.wait(10)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
            for stream in (proc.stdout, proc.stderr):
                if stream is not None:
                    stream.close()
        assert proc.returncode == -signal.SIGKILL
        assert seqs[0] > last_printed  # a new incarnation continues the numbering
        last_printed = seqs[-1]

        store = LocalDirStore(root)
        loaded = load_latest(store, "crash")
        assert loaded is not None and loaded.seq >= last_printed
        # Manifests are written last, after their chunks are durable: every listed snapshot verifies.
        assert verify(store, "crash") == [(s, None) for s in store.manifests("crash")]
        leftovers = len(_tmp_files(root))
        evidence.append((leftovers, len(_unreferenced_chunks(store, "crash"))))
        assert store.sweep(older_than_s=0) == leftovers
        assert _tmp_files(root) == []
    # At least one kill landed inside a write (a temp file or a chunk that no manifest lists yet).
    assert any(tmp or orphans for tmp, orphans in evidence), evidence

    # The store stays usable: a new snapshotter restores the newest and continues from it.
    model = torch.nn.Linear(2048, 2048)
    with Snapshotter(LocalDirStore(root), "crash", level=0) as snap:
        snap.register("m", model)
        report = snap.restore_latest()
        assert report is not None and report.skipped == [] and report.lossless
        t = snap.take(wait=True)
    assert t.error is None and t.seq is not None and t.seq > report.seq


# -- 7. RNG continuation --------------------------------------------------------------------------------------
def _draw() -> tuple[Any, ...]:
    return (
        torch.rand(8),
        torch.randn(3),
        random.random(),
        random.gauss(0.0, 1.0),
        np.random.rand(4),
        np.random.randn(3),
    )


def _same(a: tuple[Any, ...], b: tuple[Any, ...]) -> bool:
    return (
        torch.equal(a[0], b[0])
        and torch.equal(a[1], b[1])
        and a[2] == b[2]
        and a[3] == b[3]
        and np.array_equal(a[4], b[4])
        and np.array_equal(a[5], b[5])
    )


@pytest.mark.parametrize("level", [0, 2])
def test_rng_continues_after_restore(tmp_path: Path, level: int) -> None:
    model = make_model()
    opt = torch.optim.Adam(model.parameters())
    with Snapshotter(LocalDirStore(tmp_path), "w", level=level) as snap:
        snap.register("m", model)
        snap.register("adam", opt)
        torch.manual_seed(1234)
        random.seed(1234)
        np.random.seed(1234)
        random.gauss(0.0, 1.0)  # leave a cached gaussian in both Python's and numpy's state
        np.random.randn(1)
        snap.take(wait=True)
        expected = _draw()
        other = _draw()
        assert not _same(expected, other)
        report = snap.restore_latest()
        assert report is not None
        assert _same(_draw(), expected)
        assert _same(_draw(), other)


# -- 8. coalescing --------------------------------------------------------------------------------------------
def test_requests_during_flight_coalesce_into_one_followup(tmp_path: Path) -> None:
    store = GatedStore(tmp_path)
    model = make_model()
    with Snapshotter(store, "w", level=0) as snap:
        snap.register("m", model)
        try:
            store.gate.clear()
            t1 = snap.take(step=1, request="r0")
            assert store.entered.wait(10)
            t2 = snap.take(step=2, request="a")
            t3 = snap.take(step=3, request="b")
            snap.poll(step=3, request="c")  # while in flight: merged too, nothing started
            assert t2 is t3 and t2 is not t1
            assert t2.requests == ["a", "b", "c"]
            assert not t1.done.is_set() and not t2.done.is_set()
        finally:
            store.gate.set()
        assert t1.wait(10) and t1.seq == 1 and t1.error is None
        assert snap.wait_idle(10)
        assert store.manifests("w") == [1]  # the follow-up waits for the next poll()
        assert not t2.done.is_set() and t2.seq is None
        snap.poll(step=4)
        assert t2.wait(10) and t2.seq == 2 and t2.error is None
        snap.poll(step=5)  # nothing pending, no interval: no snapshot
        assert snap.wait_idle(10)
        assert store.manifests("w") == [1, 2]
    m1, m2 = read_manifest(store, "w", 1), read_manifest(store, "w", 2)
    assert m1["requests"] == ["r0"]
    assert m2["requests"] == ["a", "b", "c"] and m2["step"] == 4


def test_close_flushes_pending_followup(tmp_path: Path) -> None:
    store = GatedStore(tmp_path)
    events = Events()
    snap = Snapshotter(store, "w", level=0, on_event=events)
    try:
        snap.register("m", make_model())
        store.gate.clear()
        t1 = snap.take()
        assert store.entered.wait(10)
        t2 = snap.take(request="late")
        assert t2 is not t1
    finally:
        store.gate.set()
        snap.close()
    assert t1.seq == 1 and t2.done.is_set() and t2.seq == 2 and t2.error is None
    assert read_manifest(store, "w", 2)["requests"] == ["late"]
    assert [e["id"] for e in events.of("snapshot")] == ["w/1", "w/2"]
    assert [p["id"] for p in snap.published] == ["w/1", "w/2"]
    with pytest.raises(RuntimeError, match="closed"):
        snap.take()


def test_poll_interval(tmp_path: Path) -> None:
    store = LocalDirStore(tmp_path)
    with Snapshotter(store, "w", level=0) as snap:
        snap.register("m", make_model())
        snap.poll(step=1, interval_s=3600)  # the first periodic snapshot comes one interval after start
        assert snap.wait_idle(10)
        assert store.manifests("w") == []
        snap.poll(step=2, interval_s=0)  # due
        assert snap.wait_idle(10)
        assert store.manifests("w") == [1]
        snap.poll(step=3, interval_s=3600)  # just taken: not due
        assert snap.wait_idle(10)
        assert store.manifests("w") == [1]
        assert read_manifest(store, "w", 1)["step"] == 2


# -- 9. the step gate -----------------------------------------------------------------------------------------
def test_step_gate_snapshot_holds_pre_step_values(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = make_model()
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    train(model, opt, 2, seed=1)
    real_copy = snapcodec.host_copy
    calls = []

    def slow_copy(t: torch.Tensor) -> torch.Tensor:
        calls.append(t.numel())
        if len(calls) == 1:
            time.sleep(0.3)  # the background read is still going when the training thread steps
        return real_copy(t)

    monkeypatch.setattr(snapcodec, "host_copy", slow_copy)
    store = LocalDirStore(tmp_path)
    with Snapshotter(store, "w", level=0) as snap:
        snap.register("m", model)
        snap.register("adam", opt)
        g = torch.Generator().manual_seed(7)
        opt.zero_grad()
        F.mse_loss(model(torch.randn(32, 64, generator=g)), torch.randn(32, 4, generator=g)).backward()
        pre_model, pre_opt = model_state(model), opt_state(opt)
        t0 = time.perf_counter()
        ticket = snap.take(step=2)
        assert not ticket.done.is_set()  # take() returned before the large tensors were read
        opt.step()  # must wait at the gate
        waited = time.perf_counter() - t0
        assert ticket.wait(30) and ticket.error is None
        post = model_state(model)
        assert not torch.equal(post["m/2.weight"], pre_model["m/2.weight"])  # the step did happen
        assert waited >= 0.2 and ticket.blocking_s >= 0.2
        snap.restore_latest()
    assert_model_equal(model, pre_model)
    got = opt_state(opt)
    for idx, state in pre_opt.items():
        for key, value in state.items():
            assert torch.equal(got[idx][key], value), (idx, key)


# -- 10. retention and garbage collection ---------------------------------------------------------------------
def test_retention_keeps_newest_chains_and_collects_chunks(tmp_path: Path) -> None:
    store = LocalDirStore(tmp_path)
    other = make_model(seed=42)
    with Snapshotter(store, "other", level=0) as snap:
        snap.register("m", other)
        snap.take(wait=True)
    other_chunks = chunks_of(store, "other", 1)

    model = make_model()
    with Snapshotter(store, "w", level=0, base_every=2, keep_chains=2, gc_grace_s=0) as snap:
        snap.register("m", model)
        snap.take(wait=True)
        first_chunks = chunks_of(store, "w", 1)
        for i in range(9):
            nudge(model, row=30 + i, amount=1.0)
            with torch.no_grad():
                model[0].weight.mul_(1.01)  # every snapshot has some fresh full chunks
            snap.take(wait=True)
    seqs = store.manifests("w")
    assert seqs == [7, 8, 9, 10]
    assert [read_manifest(store, "w", s)["base"] for s in seqs] == [7, 7, 9, 9]
    referenced = set().union(*(chunks_of(store, w, s) for w in store.workers() for s in store.manifests(w)))
    on_disk = {cid for cid, _ in store.chunks()}
    assert on_disk == referenced  # grace 0: nothing unreferenced survives
    assert first_chunks - referenced and not (first_chunks - referenced) & on_disk
    assert other_chunks <= on_disk  # another worker's chunks are never collected
    assert bad_seqs(store, "w") == [] and bad_seqs(store, "other") == []


def test_collect_garbage_respects_grace(tmp_path: Path) -> None:
    store = LocalDirStore(tmp_path)
    model = make_model()
    with Snapshotter(store, "w", level=0, base_every=1, keep_chains=3, gc_grace_s=3600) as snap:
        snap.register("m", model)
        for i in range(3):
            nudge(model, row=i, amount=1.0)
            snap.take(wait=True)
    old = chunks_of(store, "w", 1) - chunks_of(store, "w", 2) - chunks_of(store, "w", 3)
    assert old
    result = collect_garbage(store, "w", keep_chains=1, grace_s=3600)
    assert result == {"manifests_removed": 2, "chunks_removed": 0}
    assert store.manifests("w") == [3]
    assert old <= {cid for cid, _ in store.chunks()}  # too young to collect


def test_collect_garbage_collects_orphans_when_no_chain_is_dropped(tmp_path: Path) -> None:
    store = LocalDirStore(tmp_path)
    model = make_model()
    with Snapshotter(store, "w", level=0, base_every=1, keep_chains=3, gc_grace_s=3600) as snap:
        snap.register("m", model)
        for i in range(2):
            nudge(model, row=i, amount=1.0)
            snap.take(wait=True)
    orphans = chunks_of(store, "w", 1) - chunks_of(store, "w", 2)
    store.delete_manifest("w", 1)  # as a killed writer or an earlier collection with a long grace leaves it
    result = collect_garbage(store, "w", keep_chains=2, grace_s=0)
    assert result["manifests_removed"] == 0
    assert not orphans & {cid for cid, _ in store.chunks()}


# -- 11. compaction -------------------------------------------------------------------------------------------
def test_compact_produces_equivalent_base(tmp_path: Path) -> None:
    model = make_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    store = LocalDirStore(tmp_path)
    with Snapshotter(store, "w", level=2, base_every=8) as snap:
        snap.register("m", model)
        snap.register("adam", opt)
        for i in range(3):
            train(model, opt, 1, seed=i)
            snap.take(step=i, wait=True)
        original = load(store, "w", 3)
        assert original.manifest["kind"] == "delta"
        new_seq = compact(store, "w", 3)
        assert new_seq == 4
        # The live snapshotter's next number is taken by the compaction: it moves on.
        train(model, opt, 1, seed=9)
        t = snap.take(wait=True)
        assert t.error is None and t.seq == 5
    compacted = load(store, "w", 4)
    m = compacted.manifest
    assert m["kind"] == "base" and m["parent"] is None and m["base"] == 4 and m["compacted_from"] == 3
    assert all(not e["delta"] and not e["from_parent"] and e["chunk"] for e in m["tensors"].values())
    assert m["tensors"].keys() == original.manifest["tensors"].keys()
    for name, data in original.encoded.items():
        assert np.array_equal(compacted.encoded[name], data), name
        assert m["tensors"][name]["sha"] == original.manifest["tensors"][name]["sha"]
    assert m["meta"] == original.manifest["meta"] and m["step"] == original.manifest["step"]
    assert bad_seqs(store, "w") == []


def test_gc_after_compaction_never_orphans_deltas(tmp_path: Path) -> None:
    model = make_model()
    store = LocalDirStore(tmp_path)
    with Snapshotter(store, "w", level=0, base_every=4, keep_chains=2, gc_grace_s=0) as snap:
        snap.register("m", model)
        for i in range(6):
            nudge(model, row=i, amount=1.0)
            t = snap.take(wait=True)
            if i == 1:
                assert compact(store, "w", t.seq) == 3
    # 1 base, 2 delta, 3 compacted base, 4-5 deltas of chain 1 (parent 2), 6 base: GC at 6 drops 1-2.
    assert bad_seqs(store, "w") == []


# -- set_level ------------------------------------------------------------------------------------------------
def test_set_level_starts_new_chain(tmp_path: Path) -> None:
    model = make_model()
    store = LocalDirStore(tmp_path)
    with Snapshotter(store, "w", level=2, base_every=8) as snap:
        snap.register("m", model)
        snap.take(wait=True)
        nudge(model, 1)
        snap.take(wait=True)
        with pytest.raises(ValueError, match="snapshot_compression_level=9"):
            snap.set_level(9)
        snap.set_level(0)
        nudge(model, 2)
        snap.take(wait=True)
        want = model_state(model)
        report = snap.restore_latest()
    m3 = read_manifest(store, "w", 3)
    assert m3["kind"] == "base" and m3["mode"]["level"] == 0
    assert report is not None and report.lossless
    assert_model_equal(model, want)


def test_set_level_while_in_flight_still_starts_new_chain(tmp_path: Path) -> None:
    store = GatedStore(tmp_path)
    model = make_model()
    with Snapshotter(store, "w", level=2, base_every=8) as snap:
        snap.register("m", model)
        try:
            store.gate.clear()
            t1 = snap.take()
            assert store.entered.wait(10)
            snap.set_level(0)
        finally:
            store.gate.set()
        assert t1.wait(10)
        nudge(model, 3)
        t2 = snap.take(wait=True)
    assert read_manifest(store, "w", t2.seq)["kind"] == "base"


def test_set_level_during_staging_keeps_manifest_mode_honest(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = make_model()
    opt = torch.optim.Adam(model.parameters())
    train(model, opt, 1, seed=0)
    real_stage = snapcodec.stage
    entered, release = threading.Event(), threading.Event()

    def blocking_stage(t: torch.Tensor, bits: int, **kw: Any) -> snapcodec.Staged:
        if not entered.is_set():
            entered.set()
            release.wait(10)
        return real_stage(t, bits, **kw)

    monkeypatch.setattr(snapcodec, "stage", blocking_stage)
    store = LocalDirStore(tmp_path)
    with Snapshotter(store, "w", level=2) as snap:
        snap.register("m", model)
        snap.register("adam", opt)  # take() does not wait for staging
        try:
            t = snap.take()
            assert entered.wait(10)
            snap.set_level(0)
        finally:
            release.set()
        assert t.wait(10) and t.error is None
    m = read_manifest(store, "w", t.seq)
    assert m["tensors"]["m/2.weight"]["enc"] == "q8"
    assert m["mode"]["level"] == 2 and not m["mode"]["lossless"]


# -- apply() must not alias the loaded buffers ------------------------------------------------------------------
def test_apply_does_not_alias_loaded_buffers(tmp_path: Path) -> None:
    model = make_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    train(model, opt, 2, seed=0)
    store = LocalDirStore(tmp_path)
    with Snapshotter(store, "w", level=0) as snap:
        snap.register("m", model)
        snap.register("adam", opt)
        snap.take(wait=True)
        disk = load(store, "w", 1)
        # load() returns writeable arrays for tensors rebuilt through a delta chain; use that form for all.
        loaded = Loaded(disk.manifest, {k: v.copy() for k, v in disk.encoded.items()})
        snap.apply(loaded)
        train(model, opt, 2, seed=1)
    for name, data in disk.encoded.items():
        assert np.array_equal(loaded.encoded[name], data), f"{name} changed by training after apply()"


# -- 12. registration and configuration errors ---------------------------------------------------------------
def test_register_errors(tmp_path: Path) -> None:
    store = LocalDirStore(tmp_path)
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with Snapshotter(store, "w") as snap:
        with pytest.raises(ValueError, match=r"name 'a/b' is invalid.*no '/'"):
            snap.register("a/b", model)
        with pytest.raises(ValueError, match="name '' is invalid"):
            snap.register("", model)
        snap.register("m", model)
        with pytest.raises(ValueError, match="name 'm' is already registered"):
            snap.register("m", make_model())
        with pytest.raises(ValueError, match="name 'm' is already registered"):
            snap.register("m", opt)
        with pytest.raises(TypeError, match="cannot snapshot object"):
            snap.register("x", object())
        with pytest.raises(TypeError, match=r"cannot snapshot Tensor.*register_state"):
            snap.register("x", torch.zeros(3))
        snap.register("sgd", opt)
        snap.register_state("env", lambda: {"seed": 1}, lambda v: None)
        with pytest.raises(ValueError, match="state name 'env' is invalid or already registered"):
            snap.register_state("env", lambda: 1, lambda v: None)
        with pytest.raises(ValueError, match="state name 'a/b'"):
            snap.register_state("a/b", lambda: 1, lambda v: None)
        with pytest.raises(ValueError, match="name 'env' is already registered"):
            snap.register("env", make_model())
    with pytest.raises(ValueError, match="base_every=0 is invalid"):
        Snapshotter(store, "w", base_every=0)
    with pytest.raises(ValueError, match="keep_chains=0 is invalid"):
        Snapshotter(store, "w", keep_chains=0)
    for level in (-1, 4, 2.5):
        with pytest.raises(ValueError, match="snapshot_compression_level"):
            Snapshotter(store, "w", level=level)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="optimizer policy"):
        Snapshotter(store, "w", optimizer="zip")
    for bad in ("", "a/b", "../x", ".hidden", "x" * 129, "sp ace"):
        with pytest.raises(ValueError, match="worker name"):
            Snapshotter(store, bad)


def test_store_validation(tmp_path: Path) -> None:
    store = LocalDirStore(tmp_path)
    for bad in ("a/b", "..", ""):
        with pytest.raises(ValueError, match="worker name"):
            store.manifests(bad)
        with pytest.raises(ValueError, match="worker name"):
            store.put_manifest(bad, 1, b"{}")
    with pytest.raises(StoreError, match="sha256"):
        store.get_chunk("../../etc/passwd")
    with pytest.raises(StoreError, match="missing"):
        store.get_chunk("0" * 64)
    with pytest.raises(StoreError, match="does not exist"):
        store.get_manifest("w", 1)
    store.put_manifest("w", 1, b"{}")
    with pytest.raises(FileExistsError):
        store.put_manifest("w", 1, b"{}")  # published manifests are never replaced
    assert store.get_manifest("w", 1) == b"{}"
    assert store.manifests("w") == [1] and store.workers() == ["w"]
    with pytest.raises(CorruptSnapshot, match="format"):
        load(store, "w", 1)
    (store.root / "manifests" / "w" / ".tmp-1-deadbeef").write_bytes(b"x")
    assert store.manifests("w") == [1]
    assert store.sweep(older_than_s=3600) == 0
    assert store.sweep(older_than_s=0) == 1
    assert _tmp_files(store.root) == []


# -- 13. user state and replay metadata -----------------------------------------------------------------------
def test_replay_metadata_hash_tracks_content() -> None:
    buf = np.arange(100, dtype=np.float32)
    a = replay_metadata(buf, 50, 50)
    assert a["size"] == 50 and a["pointer"] == 50 and isinstance(a["hash"], str)
    assert replay_metadata(buf.copy(), 50, 50) == a
    changed = buf.copy()
    changed[10] += 1
    assert replay_metadata(changed, 50, 50)["hash"] != a["hash"]
    beyond = buf.copy()
    beyond[80] += 1  # outside the first `size` entries: not part of the hash
    assert replay_metadata(beyond, 50, 50)["hash"] == a["hash"]
    assert replay_metadata(buf, 51, 51)["hash"] != a["hash"]
    t = torch.arange(100, dtype=torch.float32)
    assert replay_metadata(t, 50, 7)["hash"] == a["hash"]
    t[3] = -1
    assert replay_metadata(t, 50, 7)["hash"] != a["hash"]


def test_registered_state_round_trips(tmp_path: Path) -> None:
    buf = np.arange(64, dtype=np.float32)
    state: dict[str, Any] = {"head": 17, "meta": replay_metadata(buf, 32, 17)}
    got: list[Any] = []
    with Snapshotter(LocalDirStore(tmp_path), "w", level=0) as snap:
        snap.register("m", make_model())
        snap.register_state("replay", lambda: dict(state), got.append)
        snap.take(wait=True)
        state["head"] = 99
        snap.restore_latest()
    assert got == [{"head": 17, "meta": replay_metadata(buf, 32, 17)}]


def test_an_optimizer_built_after_the_restore_catches_up(tmp_path: Path) -> None:
    torch.manual_seed(0)
    actor, critic = torch.nn.Linear(64, 64), torch.nn.Linear(64, 1)
    opt_a, opt_c = torch.optim.Adam(actor.parameters(), lr=0.01), torch.optim.Adam(critic.parameters(), lr=0.01)
    for _ in range(3):
        x = torch.randn(8, 64)
        (actor(x).pow(2).mean() + critic(x).mean()).backward()
        opt_a.step()
        opt_c.step()
    with Snapshotter(LocalDirStore(tmp_path), "w", level=0) as snap:
        snap.register("adam_a", opt_a)
        snap.register("adam_c", opt_c)
        snap.take(wait=True)
    want_c = {k: v.clone() for k, v in opt_c.state[critic.weight].items()}
    want_w = critic.weight.detach().clone()
    # A restarted process: the actor's optimizer exists when the restore happens, the critic's is built after.
    torch.manual_seed(1)
    actor2, critic2 = torch.nn.Linear(64, 64), torch.nn.Linear(64, 1)
    with Snapshotter(LocalDirStore(tmp_path), "w", level=0) as snap:
        snap.register("adam_a", torch.optim.Adam(actor2.parameters(), lr=0.01))
        assert snap.restore_latest() is not None
        assert torch.equal(actor2.weight, actor.weight)
        opt_c2 = torch.optim.Adam(critic2.parameters(), lr=0.01)
        snap.register("adam_c", opt_c2)
        snap.catch_up("adam_c")
    assert torch.equal(critic2.weight, want_w)
    for key, value in want_c.items():
        assert torch.equal(opt_c2.state[critic2.weight][key], value), key
