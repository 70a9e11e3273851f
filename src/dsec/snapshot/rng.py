"""The process's RNG states (Python, NumPy when imported, torch, CUDA when initialized): captured with every snapshot
so that a restored run draws the same numbers, and set back on restore."""

from __future__ import annotations

import random
import sys
from typing import Any

import numpy as np


def rng_state() -> dict[str, Any]:
    import torch

    version, internal, gauss = random.getstate()
    out: dict[str, Any] = {"python": [version, list(internal), gauss], "torch": torch.get_rng_state()}
    if "numpy" in sys.modules:
        state: Any = np.random.get_state(legacy=True)
        name, keys, pos, has_gauss, cached = state
        out["numpy"] = [name, keys.tolist(), int(pos), int(has_gauss), float(cached)]
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        out["cuda"] = torch.cuda.get_rng_state_all()
    return out


def set_rng_state(rng: dict[str, Any]) -> None:
    import torch

    if "python" in rng:
        version, internal, gauss = rng["python"]
        random.setstate((version, tuple(internal), gauss))
    if "numpy" in rng:
        name, keys, pos, has_gauss, cached = rng["numpy"]
        np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    if "torch" in rng:
        torch.set_rng_state(rng["torch"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])
