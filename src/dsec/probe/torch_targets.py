"""What torch_hooks.py patches and the small pieces it needs: the collectives torch.distributed offers (and where each
takes its group), the unpatched originals for DSec's own traffic, byte counting, the gradient norm, and
``init_process_group`` under healing."""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dsec.probe.runtime import Probe

# Where each collective takes its ``group`` argument positionally (under healing, collectives on the default group
# are carried by the elastic group; see healing.py).
GROUP_ARG = {
    "all_reduce": 2,
    "all_gather": 2,
    "all_gather_into_tensor": 2,
    "reduce_scatter": 3,
    "reduce_scatter_tensor": 3,
    "broadcast": 2,
    "barrier": 0,
    "all_to_all": 2,
    "all_to_all_single": 4,
    "reduce": 3,
    "gather": 3,
    "scatter": 3,
}
POINT_TO_POINT = ("send", "recv", "isend", "irecv")

COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "broadcast",
    "barrier",
    "all_to_all",
    "all_to_all_single",
    "reduce",
    "gather",
    "scatter",
)


def tensor_bytes(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    """Bytes of the tensors handed to a collective (input side; lists summed)."""
    import torch

    total = 0
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            total += value.numel() * value.element_size()
        elif isinstance(value, (list, tuple)):
            total += sum(t.numel() * t.element_size() for t in value if isinstance(t, torch.Tensor))
    return total


class Originals:
    """Unpatched torch.distributed collectives, for the comm hook's own traffic."""

    def __init__(self, dist: ModuleType) -> None:
        for name in COLLECTIVES:
            fn = getattr(dist, name, None)
            if fn is not None:
                setattr(self, name, getattr(fn, "__wrapped__", fn))


def unannotated(fn: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
    """DDP checks a comm hook's annotations against the real GradBucket/Future types; under
    ``from __future__ import annotations`` ours are strings, so hand DDP a plain unannotated function."""

    def hook(state, bucket):  # type: ignore[no-untyped-def]
        return fn(state, bucket)

    return hook


def grad_norm(opt: Any) -> float | None:
    import torch

    grads = [p.grad for group in opt.param_groups for p in group["params"] if p.grad is not None]
    if not grads:
        return None
    norms = torch._foreach_norm(grads)
    return float(torch.linalg.vector_norm(torch.stack(norms)).item())


def init_healing(fn: Callable[..., Any], probe: Probe, kwargs: dict[str, Any]) -> Any:
    """``init_process_group`` under healing: a placeholder default group with the script's rank and world size
    (torch's ``fake`` backend), then the first epoch of the elastic group (blocks until every rank has joined)."""
    import os

    from torch.testing._internal.distributed.fake_pg import FakeStore

    rank = int(kwargs.get("rank", -1))
    world = int(kwargs.get("world_size", -1))
    rank = rank if rank >= 0 else int(os.environ.get("RANK", "0"))
    world = world if world >= 1 else int(os.environ.get("WORLD_SIZE", "1"))
    result = fn("fake", rank=rank, world_size=world, store=FakeStore())
    probe.on_distributed(rank, world)
    healing = probe.healing
    assert healing is not None
    healing.start(rank, world)
    return result
