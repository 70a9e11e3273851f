"""The comm hook's header fast path (ddp.py ``_headers_arrived``): a step whose header fields repeat the last ones
reads only the arrival stamps. It must decide exactly what a full decode decides — agreed levels, the replica guard's
votes (fingerprint checks, drift, group snapshots, hyper-parameter mismatch), the fingerprint schedule and the arrival
costs — whatever the sequence of headers. And the optimizers' hyper-parameters are read once per HYPER_EVERY agreed
steps, at the same steps on every rank."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

from dsec.probe import sync_header as sh  # noqa: E402
from dsec.probe.actuators import Actuators  # noqa: E402
from dsec.probe.ddp import SyncCoordinator  # noqa: E402
from dsec.probe.replicas import HYPER_EVERY, ReplicaGuard, hyper_digest  # noqa: E402
from dsec.probe.telemetry import Telemetry  # noqa: E402

WORLD, RANK = 3, 1


@dataclass
class _Probe:
    snapshots: Any = None
    events: list[tuple[str, dict[str, Any]]] = field(default_factory=list)

    def event(self, kind: str, /, urgent: bool = False, **data: Any) -> None:
        self.events.append((kind, data))


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
        full[0]._seen_again = None  # the reference always decodes and reads every header
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
