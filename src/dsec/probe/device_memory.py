"""What a CUDA process holds on its card and how far it could grow there, for the drain and the burst snapshot.

The drain before the cap and the snapshot ahead of a burst (dsec.probe.recycle) watch one reading per optimizer
step: the memory the process holds, against what binds first — its allocator cap (the limit the probe set with
``torch.cuda.set_per_process_memory_fraction``) or the card's room (what it holds plus the card's free memory:
card-mates' allocations count against it, as they do against a real allocation).

On CUDA the process holds what its caching allocator has reserved (``torch.cuda.memory_reserved``: the allocator's
segments, what the per-process fraction caps and what ``cudaMalloc`` fails on), and the card's free memory is
``cudaMemGetInfo`` (``torch.cuda.mem_get_info``). Both are read at most every ``min_interval_s``:
``memory_reserved`` builds the allocator's whole statistics dictionary (tens of microseconds) and an RL learner can
step hundreds of times a second, while memory moves on the scale of the watch's quarter-second readings.

Only a process whose training code initialised CUDA is read (``torch.cuda.is_initialized``): the probe never
initialises CUDA itself, so a CPU job stays a CPU job. Where no GPU is, the fake card (dsec.probe.fake_card) stands
in for the same two readings.
"""

from __future__ import annotations

import sys
import time
from typing import Any

GIB = float(2**30)


class CudaMemory:
    """Readings of one CUDA device through ``cuda`` (``torch.cuda``, or a stand-in with the same four calls:
    ``memory_reserved``, ``mem_get_info``, ``is_initialized``, ``current_device``)."""

    def __init__(self, cuda: Any, device: int, min_interval_s: float = 0.05, clock: Any = time.monotonic) -> None:
        self.cuda = cuda
        self.device = device
        self.min_interval_s = min_interval_s
        self.clock = clock
        self._read_at = -float("inf")
        self._held = 0.0
        self._room = 0.0

    @classmethod
    def of_training(cls) -> CudaMemory | None:
        """The device the training code uses, once it has initialised CUDA (None before, and without torch)."""
        torch = sys.modules.get("torch")
        cuda = getattr(torch, "cuda", None)
        if cuda is None or not cuda.is_initialized():
            return None
        return cls(cuda, int(cuda.current_device()))

    def read(self) -> tuple[float, float]:
        """(held GB, room GB): what the allocator holds, and what it could hold were the card's free memory added."""
        now = self.clock()
        if now - self._read_at >= self.min_interval_s:
            self._read_at = now
            self._held = float(self.cuda.memory_reserved(self.device)) / GIB
            free, _total = self.cuda.mem_get_info(self.device)
            self._room = self._held + float(free) / GIB
        return self._held, self._room
