"""The script's own collectives on the default group, as ops of a healing member's elastic group (elastic.py).

Under healing the default process group is a placeholder (torch's ``fake`` backend: the script's ``get_rank()`` and
``get_world_size()`` keep their values, nothing travels through it); every collective the script makes on it is run
on the current epoch's gloo group instead, through these ops:

- ``all_reduce``, ``reduce``: over the members present — while a rank is dead and not yet replaced, a sum is a sum
  over the survivors;
- ``broadcast``: from ``src``, or from the epoch's source when ``src`` is dead (its data is replicated state on
  every member, or the script could not have relied on it);
- ``all_gather``, ``all_gather_into_tensor``: each member's tensor at its rank's place; a dead rank's place is zeros;
- ``barrier``.

Other collectives and point-to-point calls on the default group are refused with a clear error under healing.
Every op keeps its inputs so it can run again in the next epoch if this one breaks under it, and clones its result
so a member one collective behind can be sent it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from dsec.errors import HealingError
from dsec.probe.epoch import Epoch

if TYPE_CHECKING:
    import torch

SUPPORTED = ("all_reduce", "reduce", "broadcast", "all_gather", "all_gather_into_tensor", "barrier")
REFUSED = (
    "reduce_scatter",
    "reduce_scatter_tensor",
    "all_to_all",
    "all_to_all_single",
    "gather",
    "scatter",
    "send",
    "recv",
    "isend",
    "irecv",
)


class NotHealable(HealingError, RuntimeError):
    """A collective healing cannot carry."""


def _dtype(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def _op_name(op: Any) -> str:
    return str(getattr(op, "name", op)).rsplit(".", 1)[-1].lower()


class _InPlace:
    """An op that overwrites its tensor in place: the input is kept, so a re-run starts from it (a failed run may
    have left partial results behind); the result is cloned for a member one collective behind."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
        self._orig = tensor.detach().clone()
        self._issued = False

    def _restart(self) -> None:
        if self._issued:
            self.tensor.copy_(self._orig)
        self._issued = True

    def result(self) -> list[torch.Tensor]:
        return [self.tensor.detach().clone()]

    def accept(self, tensors: list[torch.Tensor]) -> None:
        self.tensor.copy_(tensors[0])

    def finish(self) -> Any:
        return None


class AllReduce(_InPlace):
    def __init__(self, tensor: torch.Tensor, op: Any = None, dst: int | None = None) -> None:
        import torch.distributed as dist

        super().__init__(tensor)
        self.op: Any = dist.ReduceOp.SUM if op is None else op
        self.dst = dst  # reduce: only dst's result is defined (we compute it everywhere: same cost on gloo)
        self.sig = f"{'reduce' if dst is not None else 'all_reduce'}:{_dtype(tensor)}:{_op_name(self.op)}"

    def issue(self, ep: Epoch) -> Any:
        import torch.distributed as dist

        self._restart()
        opts = dist.AllreduceOptions()
        opts.reduceOp = self.op
        return ep.pg.allreduce([self.tensor], opts)


class Broadcast(_InPlace):
    def __init__(self, tensor: torch.Tensor, src: int) -> None:
        super().__init__(tensor)
        self.src = src
        self.sig = f"broadcast:{_dtype(tensor)}"

    def issue(self, ep: Epoch) -> Any:
        import torch.distributed as dist

        self._restart()
        opts = dist.BroadcastOptions()
        opts.rootRank = ep.pg_rank_of(self.src, ep.source)
        opts.rootTensor = 0
        return ep.pg.broadcast([self.tensor], opts)


class AllGather:
    """``outputs``: one tensor per logical rank (the list form) or one tensor of ``world`` chunks (``into``)."""

    def __init__(self, outputs: list[torch.Tensor] | torch.Tensor, tensor: torch.Tensor) -> None:
        self.outputs, self.tensor = outputs, tensor
        into = not isinstance(outputs, list)
        self.sig = f"{'all_gather_into_tensor' if into else 'all_gather'}:{_dtype(tensor)}"
        self._gathered: list[torch.Tensor] = []
        self._members: tuple[int, ...] = ()
        self._world = len(outputs) if isinstance(outputs, list) else 0

    def _slots(self) -> list[torch.Tensor]:
        if isinstance(self.outputs, list):
            return self.outputs
        return list(self.outputs.view(self._world, *self.tensor.shape).unbind(0))

    def issue(self, ep: Epoch) -> Any:
        import torch

        self._members, self._world = ep.members, ep.world
        self._gathered = [torch.empty_like(self.tensor) for _ in ep.members]
        return ep.pg.allgather([self._gathered], [self.tensor.contiguous()])

    def result(self) -> list[torch.Tensor]:
        return [t.clone() for t in self._gathered]

    def accept(self, tensors: list[torch.Tensor]) -> None:
        self._gathered = tensors

    def finish(self) -> Any:
        for r, slot in enumerate(self._slots()):
            if r in self._members:
                slot.copy_(self._gathered[self._members.index(r)].reshape(slot.shape))
            else:
                slot.zero_()
        return None


class Barrier:
    sig: str | None = "barrier"

    def issue(self, ep: Epoch) -> Any:
        import torch.distributed as dist

        return ep.pg.barrier(dist.BarrierOptions())

    def result(self) -> list[torch.Tensor]:
        return []

    def accept(self, tensors: list[torch.Tensor]) -> None:
        pass

    def finish(self) -> Any:
        return None


class InitialBroadcast:
    """DSec's own: the model's parameters and buffers from the first epoch's source to every member when the DDP
    wrapper is built (DDP itself only talks to the placeholder group). One flat buffer; not part of the script's
    sequence (a replacement does not run it: it receives the live state instead)."""

    sig: str | None = None

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        import torch

        self.tensors = tensors
        self.flat = torch.cat([t.detach().reshape(-1).to(torch.float64) for t in tensors]) if tensors else None

    def issue(self, ep: Epoch) -> Any:
        import torch
        import torch.distributed as dist

        opts = dist.BroadcastOptions()
        opts.rootRank = ep.pg_rank_of(ep.source, ep.source)
        opts.rootTensor = 0
        if self.flat is None:
            return ep.pg.barrier(dist.BarrierOptions())
        self.flat = torch.cat([t.detach().reshape(-1).to(torch.float64) for t in self.tensors])
        return ep.pg.broadcast([self.flat], opts)

    def result(self) -> list[torch.Tensor]:
        return [] if self.flat is None else [self.flat.clone()]

    def accept(self, tensors: list[torch.Tensor]) -> None:
        if tensors:
            self.flat = tensors[0]

    def finish(self) -> Any:
        import torch

        if self.flat is None:
            return None
        at = 0
        with torch.no_grad():
            for t in self.tensors:
                n = t.numel()
                t.copy_(self.flat[at : at + n].view(t.shape).to(t.dtype))
                at += n
        return None


class BroadcastBytes:
    """DSec's own: bytes (JSON) from one member to all, e.g. the reference optimizer settings."""

    sig: str | None = None

    def __init__(self, payload: bytes | None, src: int, size: int) -> None:
        import torch

        self.src = src
        self.buf = torch.zeros(size, dtype=torch.uint8)
        if payload is not None:
            self.buf[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)

    def issue(self, ep: Epoch) -> Any:
        import torch.distributed as dist

        opts = dist.BroadcastOptions()
        opts.rootRank = ep.pg_rank_of(self.src, ep.source)
        opts.rootTensor = 0
        return ep.pg.broadcast([self.buf], opts)

    def result(self) -> list[torch.Tensor]:
        return [self.buf.clone()]

    def accept(self, tensors: list[torch.Tensor]) -> None:
        self.buf.copy_(tensors[0])

    def finish(self) -> bytes:
        return bytes(self.buf.numpy().tobytes()).rstrip(b"\x00")
