"""The sync header's two encodings, the replica fingerprint, the hyper-parameter digest, and the replica guard's
verdicts (drift by majority, group snapshots only when no rank is busy)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from dsec.probe import sync_header as sh  # noqa: E402
from dsec.probe.replicas import MASK24, ReplicaGuard, fingerprint, hyper_digest  # noqa: E402


# -- header -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("bits", "dtype"), [(32, torch.float32), (16, torch.float16)])
def test_slot_headers_sum_to_every_ranks_exact_fields(bits: int, dtype: torch.dtype) -> None:
    world = 3
    headers = [
        sh.Header(bits=4, accum=1, flags=int(sh.Flag.SNAPSHOT_WANTED), fingerprint=MASK24, hyper=0x123456, admit=5),
        sh.Header(bits=32, accum=65535, flags=int(sh.Flag.FINGERPRINT | sh.Flag.SNAPSHOT_BUSY), fingerprint=1),
        sh.Header(bits=8, accum=7, flags=63, fingerprint=0xABCDEF, hyper=MASK24, admit=MASK24),
    ]
    stamps = [1_000_123.0, 1_000_456.0, 2_000_000.0]
    total = sum(sh.encode_slots(h, r, world, bits, dtype, stamps[r]) for r, h in enumerate(headers))
    assert total.dtype == dtype and total.numel() == world * sh.slots_per_rank(bits)
    out = sh.decode_slots(total, world, bits)
    for got, want, stamp in zip(out, headers, stamps, strict=True):
        assert (got.bits, got.accum, got.flags, got.fingerprint, got.hyper, got.admit) == (
            want.bits,
            want.accum,
            want.flags,
            want.fingerprint,
            want.hyper,
            want.admit,
        )
        assert got.stamp == stamp % sh.STAMP_PERIOD_MS[bits]


def test_a_field_too_wide_for_its_slots_is_refused() -> None:
    with pytest.raises(ValueError, match="fingerprint"):
        sh.encode_slots(sh.Header(bits=32, accum=1, fingerprint=1 << 24), 0, 1, 32, torch.float32, 0.0)


def test_byte_header_round_trip_and_size() -> None:
    h = sh.Header(bits=4, accum=3, stamp=1764551234.125, flags=5, fingerprint=0xFEDCBA, hyper=42, admit=77)
    raw = sh.encode_bytes(h)
    assert raw.dtype == torch.uint8 and raw.numel() == sh.HEADER_BYTES
    assert sh.decode_bytes(torch.cat((raw, torch.zeros(10, dtype=torch.uint8)))) == h


def test_stamps_on_the_circle() -> None:
    # 10 ms before and after the wrap of a 2048 ms circle are 20 ms apart, not 2028.
    d = sh.circle_deltas([2038.0, 10.0], 2038.0, 2048.0)
    assert d == pytest.approx([0.0, 0.020])


# -- fingerprint ----------------------------------------------------------------------------------------------
def _params(seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(300, 70, generator=g), torch.randn(70, generator=g), torch.randn(5, generator=g).half()]


def test_fingerprint_is_equal_for_identical_copies_and_tells_one_ulp_apart() -> None:
    a, b = _params(), [t.clone() for t in _params()]
    assert fingerprint(a) == fingerprint(b)
    # One element, one unit in the last place.
    b[0][17, 3] = torch.nextafter(b[0][17, 3], torch.tensor(float("inf")))
    assert fingerprint(a) != fingerprint(b)


def test_fingerprint_sees_swapped_elements_and_tensor_order() -> None:
    a = _params()
    swapped = [t.clone() for t in a]
    swapped[1][[0, 1]] = swapped[1][[1, 0]]
    assert fingerprint(a) != fingerprint(swapped)
    assert fingerprint(a) != fingerprint([a[1], a[0], a[2]])


def test_fingerprint_does_not_depend_on_the_thread_count() -> None:
    big = [torch.randn(3_000_000, generator=torch.Generator().manual_seed(1))]
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = fingerprint(big)
        torch.set_num_threads(max(2, before))
        many = fingerprint(big)
    finally:
        torch.set_num_threads(before)
    assert one == many


def test_hyper_digest_changes_with_the_learning_rate_only_when_it_changes() -> None:
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    same = torch.optim.Adam(torch.nn.Linear(3, 2).parameters(), lr=1e-3)
    assert hyper_digest([opt]) == hyper_digest([same])
    d0 = hyper_digest([opt])
    opt.param_groups[0]["lr"] = 5e-4
    assert hyper_digest([opt]) != d0 and 0 <= hyper_digest([opt]) <= MASK24


# -- the guard ------------------------------------------------------------------------------------------------
@dataclass
class _Snaps:
    wanted: bool = False
    busy: bool = False

    def group_status(self) -> tuple[bool, bool]:
        return self.wanted, self.busy


@dataclass
class _Probe:
    snapshots: Any = None
    events: list[tuple[str, dict[str, Any]]] = field(default_factory=list)

    def event(self, kind: str, /, urgent: bool = False, **data: Any) -> None:
        self.events.append((kind, data))


def _h(fp: int | None = None, flags: int = 0, hyper: int = 0) -> sh.Header:
    flags |= sh.Flag.PRESENT
    if fp is not None:
        flags |= sh.Flag.FINGERPRINT
    return sh.Header(bits=32, accum=1, flags=flags, fingerprint=fp or 0, hyper=hyper)


def test_drift_is_reported_by_the_rank_that_left_the_majority() -> None:
    probes = [_Probe() for _ in range(3)]
    guards = [ReplicaGuard(p, check_every=10) for p in probes]  # type: ignore[arg-type]
    headers = [_h(7), _h(9), _h(7)]
    for r, g in enumerate(guards):
        g.on_headers(headers, r, syncs=3)
    assert [len(p.events) for p in probes] == [0, 1, 0]
    kind, data = probes[1].events[0]
    assert kind == "anomaly" and data["kind"] == "replica_drift" and data["drifted_ranks"] == [1]
    assert guards[1].metrics() == {"replica_checks_total": 1.0, "replica_drift_total": 1.0, "replica_drift": 1.0}
    assert guards[0].metrics()["replica_drift"] == 0.0
    # Agreement afterwards clears this rank's health feature but keeps the count.
    guards[1].on_headers([_h(5), _h(5), _h(5)], 1, syncs=4)
    assert guards[1].metrics()["replica_drift"] == 0.0 and guards[1].metrics()["replica_drift_total"] == 1.0


def test_without_a_majority_every_disagreeing_rank_reports() -> None:
    probes = [_Probe(), _Probe()]
    for r, p in enumerate(probes):
        ReplicaGuard(p, check_every=10).on_headers([_h(1), _h(2)], r, syncs=1)  # type: ignore[arg-type]
    assert all(p.events and p.events[0][1]["majority"] is None for p in probes)


def test_headers_without_fingerprints_decide_nothing_about_drift() -> None:
    p = _Probe()
    g = ReplicaGuard(p, check_every=10)  # type: ignore[arg-type]
    g.on_headers([_h(), _h()], 0, syncs=1)
    assert p.events == [] and g.metrics() == {}


def test_absent_ranks_take_no_part_in_the_votes() -> None:
    p = _Probe()
    g = ReplicaGuard(p, check_every=10)  # type: ignore[arg-type]
    absent = sh.Header(bits=0, accum=0)  # a dead rank's slots: zeros
    g.on_headers([_h(7, hyper=3), absent, _h(7, hyper=3)], 0, syncs=1)
    assert p.events == [] and g.metrics()["replica_drift"] == 0.0


def test_fingerprint_is_due_at_the_first_step_then_every_check_every_syncs() -> None:
    model = torch.nn.Linear(4, 4)
    g = ReplicaGuard(_Probe(), check_every=5)  # type: ignore[arg-type]
    g.add_module(model)
    g.after_step()
    flags, fp, _ = g.extras()
    assert flags & sh.Flag.FINGERPRINT and fp == fingerprint(list(model.parameters())) & MASK24
    g.after_step()
    assert not g.extras()[0] & sh.Flag.FINGERPRINT  # not due again yet
    g.on_headers([_h()], 0, syncs=5)  # every rank sees sync 5: due after the next step
    g.after_step()
    assert g.extras()[0] & sh.Flag.FINGERPRINT


def test_with_a_header_every_few_steps_a_fingerprint_is_due_when_a_multiple_was_passed_in_between() -> None:
    # The comm hook carries the header every 8th sync: headers at syncs 1, 9, 17, ... (since = 8 each time).
    g = ReplicaGuard(_Probe(), check_every=5)  # type: ignore[arg-type]
    g.add_module(torch.nn.Linear(2, 2))
    g.after_step()
    g.extras()  # the start-up check, handed over
    g.on_headers([_h()], 0, syncs=1, since=1)
    g.after_step()
    assert not g.extras()[0] & sh.Flag.FINGERPRINT
    g.on_headers([_h()], 0, syncs=9, since=8)  # sync 5 lay in between: due (the old `syncs % 5` never saw it)
    g.after_step()
    assert g.extras()[0] & sh.Flag.FINGERPRINT
    g.on_headers([_h()], 0, syncs=17, since=8)  # 10 and 15 in between: due once
    g.after_step()
    assert g.extras()[0] & sh.Flag.FINGERPRINT
    g.on_headers([_h()], 0, syncs=19, since=2)  # no multiple of 5 in 18..19
    g.after_step()
    assert not g.extras()[0] & sh.Flag.FINGERPRINT


def test_group_snapshot_only_when_someone_wants_it_and_nobody_is_busy() -> None:
    g = ReplicaGuard(_Probe(snapshots=_Snaps(wanted=True)), check_every=0)  # type: ignore[arg-type]
    assert g.extras()[0] & sh.Flag.SNAPSHOT_WANTED
    want, busy = int(sh.Flag.SNAPSHOT_WANTED), int(sh.Flag.SNAPSHOT_BUSY)
    g.on_headers([_h(flags=want), _h()], 1, syncs=1)
    assert g.snapshot_agreed is True
    g.on_headers([_h(flags=want), _h(flags=busy)], 1, syncs=2)
    assert g.snapshot_agreed is False
    g.on_headers([_h(), _h()], 1, syncs=3)
    assert g.snapshot_agreed is False


def test_hyperparameter_mismatch_is_reported_once_per_pattern() -> None:
    p = _Probe()
    g = ReplicaGuard(p, check_every=0)  # type: ignore[arg-type]
    for s in range(3):
        g.on_headers([_h(hyper=1), _h(hyper=2)], 0, syncs=s)
    assert [d["kind"] for _, d in p.events] == ["hyperparameter_mismatch"]
