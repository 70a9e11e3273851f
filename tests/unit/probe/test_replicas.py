"""The sync header's two encodings, the replica fingerprint, the hyper-parameter digest, the replica guard's
verdicts (drift by majority, group snapshots only when no rank is busy), and the comm hook's header fast path
(ddp.py ``_headers_arrived``): a step whose header fields repeat the last ones reads only the arrival stamps, and must
decide exactly what a full decode decides — agreed levels, the guard's votes (fingerprint checks, drift, group
snapshots, hyper-parameter mismatch), the fingerprint schedule and the arrival costs — whatever the sequence of
headers; the optimizers' hyper-parameters are read once per HYPER_EVERY agreed steps, at the same steps on every
rank."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from dsec.probe import sync_header as sh  # noqa: E402
from dsec.probe.actuators import Actuators  # noqa: E402
from dsec.probe.ddp import SyncCoordinator  # noqa: E402
from dsec.probe.replicas import HYPER_EVERY, MASK24, ReplicaGuard, fingerprint, hyper_digest  # noqa: E402
from dsec.probe.telemetry import Telemetry  # noqa: E402


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


# -- the comm hook's header fast path ---------------------------------------------------------------------------
WORLD, RANK = 3, 1


def _coordinator() -> tuple[SyncCoordinator, ReplicaGuard, _Probe, Telemetry]:
    probe = _Probe()
    guard = ReplicaGuard(probe, check_every=3)  # type: ignore[arg-type]
    telemetry = Telemetry()
    coord = SyncCoordinator(Actuators(default_bits=32), telemetry, guard=guard)
    # Rank 1 of a 3-rank group, decoding headers summed by hand (no collective runs here).
    coord.world, coord.rank, coord._no_stamps = WORLD, RANK, [0.0] * WORLD
    return coord, guard, probe, telemetry


def _headers(rng: random.Random, last: list[sh.Header] | None) -> list[sh.Header]:
    """Mostly the last step's fields again; sometimes a fingerprint (agreeing or not), a snapshot wish or a busy
    snapshotter, a level change, a hyper-parameter digest that differs."""
    if last is not None and rng.random() < 0.7:
        return last
    out = []
    for _ in range(WORLD):
        flags = int(sh.Flag.PRESENT | sh.Flag.CONTRIBUTES)
        fp = 0
        if rng.random() < 0.06:
            flags |= sh.Flag.FINGERPRINT
            fp = rng.choice((0xAB, 0xAB, 0xCD))
        if rng.random() < 0.06:
            flags |= sh.Flag.SNAPSHOT_WANTED
        if rng.random() < 0.1:
            flags |= sh.Flag.SNAPSHOT_BUSY
        bits = rng.choice((32, 32, 32, 16, 4))
        out.append(sh.Header(bits, rng.choice((1, 1, 2)), 0.0, flags, fp, rng.choice((7, 7, 7, 9))))
    return out


def _slots(headers: list[sh.Header], stamps: list[float]) -> torch.Tensor:
    return sum(  # type: ignore[return-value]
        sh.encode_slots(h, r, WORLD, 32, torch.float32, stamps[r]) for r, h in enumerate(headers)
    )


def _state(coord: SyncCoordinator, guard: ReplicaGuard, probe: _Probe, telemetry: Telemetry) -> dict[str, Any]:
    return {
        "seen": list(coord._seen or []),
        "syncs": coord.syncs,
        "since_header": coord._since_header,
        "snapshot_agreed": guard.snapshot_agreed,
        "fp_due": guard._fp_due,
        "checks": guard.checks,
        "drifts": guard.drifts,
        "drifted": guard.drifted,
        "last_check": guard.last_check,
        "events": [(k, d.get("kind"), d.get("step")) for k, d in probe.events],
        "lag": list(telemetry._sync_lag._values),
        "cost": list(telemetry._sync_cost._values),
    }


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_fast_path_decides_what_a_full_decode_decides(one_rank_group: None, seed: int) -> None:
    fast, full = _coordinator(), _coordinator()
    rng = random.Random(seed)
    decoded = 0
    real_decode = sh.decode_slots

    def counting(*args: Any) -> list[sh.Header]:
        nonlocal decoded
        decoded += 1
        return real_decode(*args)

    headers: list[sh.Header] | None = None
    steps = 200
    period = sh.STAMP_PERIOD_MS[32]
    for step in range(steps):
        headers = _headers(rng, headers)
        stamps = [float(rng.randrange(0, 2**20)) for _ in range(WORLD)]
        slots = _slots(headers, stamps)
        latency = rng.uniform(0.001, 0.05)
        sh.decode_slots = counting  # type: ignore[assignment]
        try:
            fast[0]._headers_arrived(slots.clone(), 32, period, latency)
        finally:
            sh.decode_slots = real_decode  # type: ignore[assignment]
        full[0]._repeat = None  # the reference always decodes and reads every header
        full[0]._headers_arrived(slots.clone(), 32, period, latency)
        assert _state(*fast) == _state(*full), f"step {step}"
        # What the optimizer hook does after each step: consume the group snapshot agreement and take a due
        # fingerprint (after_step).
        fast[1].snapshot_agreed = full[1].snapshot_agreed = False
        fast[1]._fp_due = full[1]._fp_due = False
    assert decoded < steps * 0.75  # the fast path ran (most repeated headers carry no vote)
    assert fast[1].checks > 0 and fast[2].events  # the sequence had checks and reports to agree on


def test_a_repeated_header_with_a_vote_is_read_again(one_rank_group: None) -> None:
    # Two identical headers in a row asking for a group snapshot: the second is a new agreement (the step consumed
    # the first), not a repeat to skip.
    coord, guard, _, _ = _coordinator()
    want = int(sh.Flag.PRESENT | sh.Flag.CONTRIBUTES | sh.Flag.SNAPSHOT_WANTED)
    headers = [sh.Header(32, 1, 0.0, want)] * WORLD
    for _ in range(2):
        coord._headers_arrived(_slots(headers, [1.0, 2.0, 3.0]), 32, sh.STAMP_PERIOD_MS[32], 0.01)
        assert guard.snapshot_agreed is True
        guard.snapshot_agreed = False


def test_hyper_parameters_are_read_once_per_hyper_every_agreed_steps() -> None:
    opt = torch.optim.Adam(torch.nn.Linear(2, 2).parameters(), lr=1e-3)
    g = ReplicaGuard(_Probe(), check_every=0)  # type: ignore[arg-type]
    g.add_optimizer(opt)
    first = g.extras(0)[2]
    assert first == hyper_digest([opt])
    opt.param_groups[0]["lr"] = 5e-4
    assert g.extras(HYPER_EVERY - 1)[2] == first  # not read again before the next multiple
    assert g.extras(HYPER_EVERY)[2] == hyper_digest([opt]) != first
    # A rank that starts later (its first call at step 13) reads at once, then at the same steps as the others.
    late = ReplicaGuard(_Probe(), check_every=0)  # type: ignore[arg-type]
    late.add_optimizer(opt)
    assert late.extras(HYPER_EVERY + 5)[2] == g.extras(HYPER_EVERY + 5)[2]
    opt.param_groups[0]["lr"] = 1e-4
    assert late.extras(2 * HYPER_EVERY)[2] == g.extras(2 * HYPER_EVERY)[2] == hyper_digest([opt])
    # Without a step (healing's coordinator): read every time.
    opt.param_groups[0]["lr"] = 2e-4
    assert g.extras()[2] == hyper_digest([opt])
