"""The drain and the burst snapshot on a CUDA device (dsec.probe.device_memory): the probe reads what the caching
allocator has reserved and the card's free memory, against the allocator cap it applied.

No GPU here: ``StandInCuda`` stands in for ``torch.cuda`` behind the four calls ``CudaMemory`` makes
(``memory_reserved``, ``mem_get_info``, ``is_initialized``, ``current_device``), over a card whose memory this
process's allocator and other processes hold; the training loop raises ``torch.OutOfMemoryError`` where a real
allocation past the cap or the card would fail. The same readings on a real device: benchmarks/gpu_check.py."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from dsec.probe.device_memory import GIB, CudaMemory
from dsec.probe.recycle import MemoryRecycle
from dsec.probe.runtime import Probe
from dsec.snapshot import LocalDirStore
from dsec.snapshot.reader import read_manifest


class StandInCuda:
    """``torch.cuda`` for one device of ``total_gb``: this process's allocator has reserved ``reserved_gb`` of it,
    other processes hold ``others_gb``; ``reads`` counts the allocator-statistics reads."""

    def __init__(self, total_gb: float, reserved_gb: float, others_gb: float = 0.0, initialized: bool = True) -> None:
        self.total_gb, self.reserved_gb, self.others_gb, self.initialized = (
            total_gb,
            reserved_gb,
            others_gb,
            initialized,
        )
        self.reads = 0

    def is_initialized(self) -> bool:
        return self.initialized

    def current_device(self) -> int:
        return 0

    def memory_reserved(self, device: int) -> int:
        assert device == 0
        self.reads += 1
        return int(self.reserved_gb * GIB)

    def mem_get_info(self, device: int) -> tuple[int, int]:
        free = self.total_gb - self.reserved_gb - self.others_gb
        return int(free * GIB), int(self.total_gb * GIB)


def test_held_is_the_reserved_memory_and_room_adds_the_cards_free_memory_read_at_most_every_interval() -> None:
    cuda = StandInCuda(total_gb=80.0, reserved_gb=20.0, others_gb=30.0)
    now = [0.0]
    mem = CudaMemory(cuda, 0, min_interval_s=0.05, clock=lambda: now[0])
    assert mem.read() == pytest.approx((20.0, 50.0))  # 20 held + 30 free: the card-mates' 30 are not room
    cuda.reserved_gb, cuda.others_gb = 25.0, 40.0
    now[0] = 0.01
    assert mem.read() == pytest.approx((20.0, 50.0)) and cuda.reads == 1  # within the interval: the last reading
    now[0] = 0.06
    assert mem.read() == pytest.approx((25.0, 40.0)) and cuda.reads == 2


def test_a_process_that_did_not_initialise_cuda_is_not_read(monkeypatch: pytest.MonkeyPatch) -> None:
    assert not torch.cuda.is_initialized()  # this machine: a CPU build, nothing initialised it
    assert CudaMemory.of_training() is None
    monkeypatch.setattr(torch, "cuda", StandInCuda(80.0, 1.0, initialized=False))
    assert CudaMemory.of_training() is None
    monkeypatch.setattr(torch, "cuda", StandInCuda(80.0, 1.0))
    mem = CudaMemory.of_training()
    assert mem is not None and mem.device == 0


def _probe_on(make: Callable[[dict[str, str | None]], Probe], cuda: StandInCuda, tmp_path: Path) -> Probe:
    probe = make({"DSEC_SNAPSHOT_DIR": str(tmp_path / "snaps"), "DSEC_FAKE_CARD": None})
    probe.cuda_memory = CudaMemory(cuda, 0, min_interval_s=0.0)
    return probe


def _train(probe: Probe, cuda: StandInCuda, gb_per_s: float, cap_gb: float, seconds: float) -> BaseException | None:
    """Optimizer steps every 50 ms while the allocator's reserved memory grows ``gb_per_s``; an allocation past the
    cap or the card fails as CUDA's would (``torch.OutOfMemoryError`` in the training code)."""
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    start, last = time.monotonic(), time.monotonic()
    try:
        while time.monotonic() - start < seconds:
            now = time.monotonic()
            cuda.reserved_gb += gb_per_s * (now - last)
            last = now
            if cuda.reserved_gb > min(cap_gb, cuda.total_gb - cuda.others_gb):
                raise torch.OutOfMemoryError(f"CUDA out of memory (stand-in): {cuda.reserved_gb:.2f} GB reserved")
            opt.zero_grad()
            model(torch.ones(1, 2)).sum().backward()
            opt.step()
            time.sleep(0.05)
    except BaseException as exc:
        return exc
    return None


def _requests(tmp_path: Path) -> list[list[str]]:
    store = LocalDirStore(tmp_path / "snaps")
    return [read_manifest(store, w, s).get("requests") or [] for w in store.workers() for s in store.manifests(w)]


@pytest.mark.parametrize("binds", ["limit", "card"])
def test_a_burst_on_cuda_is_snapshotted_as_it_rises_before_its_oom(
    torch_probe: Callable[[dict[str, str | None]], Probe], tmp_path: Path, binds: str
) -> None:
    # A 0.4 GB/s burst from 4 GB: into an 5 GB allocator cap, or into a card that others leave 5.5 GB of.
    cuda = StandInCuda(total_gb=16.0, reserved_gb=4.0, others_gb=10.5 if binds == "card" else 0.0)
    probe = _probe_on(torch_probe, cuda, tmp_path)
    a = probe.actuators
    a.memory_quota_gb, a.memory_limit_gb, a.memory_ceiling_gb = 4.0, 5.0 if binds == "limit" else 8.0, 4.5
    a.memory_fraction_applied = a.allocator_limit_gb() / cuda.total_gb  # what _apply_memory_quota sets on CUDA
    stopped = _train(probe, cuda, gb_per_s=0.4, cap_gb=a.allocator_limit_gb(), seconds=10.0)
    assert isinstance(stopped, torch.OutOfMemoryError), stopped
    snaps = probe.snapshots
    assert snaps is not None and snaps.snapshotter is not None
    snaps.snapshotter.wait_idle(30.0)
    assert ["memory_burst"] in _requests(tmp_path)  # taken as it rose, for the burst (no periodic one here)
    report = snaps.snapshotter.restore_latest()
    assert report is not None and 0 < snaps.steps - report.step <= 40, (snaps.steps, report.step)


def test_a_slow_climb_on_cuda_into_its_final_limit_is_drained_not_oomed(
    torch_probe: Callable[[dict[str, str | None]], Probe], tmp_path: Path
) -> None:
    cuda = StandInCuda(total_gb=16.0, reserved_gb=4.0)
    probe = _probe_on(torch_probe, cuda, tmp_path)
    a = probe.actuators
    a.memory_quota_gb, a.memory_limit_gb, a.memory_ceiling_gb = 4.0, 4.15, 4.15  # the limit at the ceiling: final
    a.memory_fraction_applied = 4.15 / 16.0
    stopped = _train(probe, cuda, gb_per_s=0.045, cap_gb=4.15, seconds=10.0)
    assert isinstance(stopped, MemoryRecycle), stopped
    assert ["memory_recycle"] in _requests(tmp_path)


def test_without_an_applied_cap_a_slow_climb_is_not_drained(
    torch_probe: Callable[[dict[str, str | None]], Probe], tmp_path: Path
) -> None:
    """The quota is only reported against where the probe did not cap the allocator (no fraction applied): there is
    no limit to drain before; the process runs into the card as before."""
    cuda = StandInCuda(total_gb=4.1, reserved_gb=4.0)
    probe = _probe_on(torch_probe, cuda, tmp_path)
    a = probe.actuators
    a.memory_quota_gb, a.memory_limit_gb, a.memory_ceiling_gb = 4.0, 4.15, 4.15
    stopped = _train(probe, cuda, gb_per_s=0.045, cap_gb=float("inf"), seconds=10.0)
    assert isinstance(stopped, torch.OutOfMemoryError), stopped
    assert ["memory_recycle"] not in _requests(tmp_path)
