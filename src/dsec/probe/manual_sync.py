"""Gradient sync the training script writes itself: ``all_reduce`` of gradients without DDP.

Two patterns are recognised, each an ``all_reduce`` with ``op`` SUM or AVG issued after a ``backward()`` and
before the next optimizer step, on a floating-point tensor:

* per parameter: the tensor *is* a parameter's ``.grad`` (same storage and size; ``p.grad`` or ``p.grad.data``),
  sync or ``async_op=True`` then ``wait()`` — the pattern of hand-written A2C/PPO learners;
* one flat buffer: the tensor's size equals the trainable parameters' total (all optimizers', or one
  optimizer's) — CleanRL's multi-GPU PPO flattens the grads into one buffer, all-reduces it and copies back.

Such a call is counted as gradient sync (``sync_*``: bytes this rank hands to the backend, latency to completion)
instead of a user collective. The *first* gradient all-reduce after each backward carries the sync header
(sync_header.py) exactly as the last DDP bucket does: every rank's desired compression level and its arrival stamp,
so straggler attribution (``sync_lag``/``sync_cost``) works and all ranks switch levels together at the next
backward. The group's levels decide the path of every gradient all-reduce of the step:

* every rank at 32 bits: the user's ``all_reduce`` itself (the first one with the header slots appended, on a
  copy that is written back);
* otherwise: each rank's payload encoded at its own level (16-bit, or 8/4-bit block quantization with error
  feedback keyed by the parameter), one ``all_gather`` (same levels) or ``all_to_all_single`` (mixed), every
  payload decoded and summed in float32 in rank order on every rank — so every rank writes the same sum into the
  tensor (AVG: divided by the world size), and replicas stay identical.

Safe to compress: SUM/AVG of float32/float64 tensors. Not carried out (answered with ``directive_unappliable``):
``grad_accum_steps`` (the script averages and steps itself; skipping its all-reduce would change its arithmetic),
and compression of float16/bfloat16 gradients (the header cannot ride in them; they are measured only).

The assumption, the same the script's own correctness rests on: every rank issues the same sequence of backward
passes, gradient all-reduces and optimizer steps.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from dsec.probe import sync_header as sh
from dsec.probe.ddp import HEADER_BYTES, SyncCoordinator, chunk_bytes

if TYPE_CHECKING:
    import torch

    from dsec.probe.runtime import Probe

log = logging.getLogger(__name__)

ACCUM_REASON = (
    "hand-written gradient all-reduce: the script averages and steps itself, so accumulation cannot be "
    "carried out without changing its arithmetic"
)

# all_reduce(tensor, op=SUM, group=None, async_op=False)
_OP, _GROUP, _ASYNC = 1, 2, 3


def _arg(args: tuple[Any, ...], kwargs: dict[str, Any], pos: int, name: str, default: Any) -> Any:
    if name in kwargs:
        return kwargs[name]
    return args[pos] if len(args) > pos else default


class ManualSync:
    """Per process: recognises gradient all-reduces and routes them through a :class:`ManualCoordinator`."""

    def __init__(self, probe: Probe, collectives: Any) -> None:
        import torch
        import torch.distributed as dist

        self.probe = probe
        self._dist = dist
        self._c = collectives
        self._float = (torch.float32, torch.float64)
        self._floating = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
        self.after_backward = False
        self._optimizers: weakref.WeakSet[Any] = weakref.WeakSet()
        self._grads: dict[tuple[int, int], int] = {}  # (data_ptr, numel) of each param's .grad -> id(param)
        self._mapped = False  # the map was rebuilt in this backward phase
        self._totals: set[int] = set()
        self._totals_for = -1
        self.coordinators: dict[int, ManualCoordinator] = {}

    # -- phase -----------------------------------------------------------------------------------------
    def add_optimizer(self, opt: Any) -> None:
        self._optimizers.add(opt)
        self._totals_for = -1

    def on_backward(self) -> None:
        self.after_backward = True
        self._mapped = False
        for c in self.coordinators.values():
            c.new_phase()

    def on_step(self) -> None:
        self.after_backward = False

    # -- recognition -------------------------------------------------------------------------------------
    def _params(self) -> list[Any]:
        seen: dict[int, Any] = {}
        for opt in list(self._optimizers):
            for group in opt.param_groups:
                for p in group["params"]:
                    if p.requires_grad:
                        seen.setdefault(id(p), p)
        return list(seen.values())

    def _flat_totals(self) -> set[int]:
        opts = list(self._optimizers)
        if self._totals_for != len(opts):
            totals = {sum(p.numel() for g in o.param_groups for p in g["params"] if p.requires_grad) for o in opts}
            totals.add(sum(p.numel() for p in self._params()))
            self._totals, self._totals_for = totals - {0}, len(opts)
        return self._totals

    def _key(self, t: torch.Tensor) -> tuple[int, ...] | None:
        """The error-feedback key of a gradient tensor: (id(param),), (-numel,) for a flat buffer, or None."""
        k = (t.data_ptr(), t.numel())
        pid = self._grads.get(k)
        if pid is None and not self._mapped:
            self._mapped = True
            self._grads = {(p.grad.data_ptr(), p.grad.numel()): id(p) for p in self._params() if p.grad is not None}
            pid = self._grads.get(k)
        if pid is not None:
            return (pid,)
        if t.numel() in self._flat_totals():
            return (-t.numel(),)
        return None

    def recognise(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, tuple[int, ...], bool] | None:
        """(group, key, avg) when this all_reduce is a gradient sync, else None. Cheap when it is not."""
        if not self.after_backward or not self._optimizers:
            return None
        t = args[0] if args else kwargs.get("tensor")
        dist = self._dist
        if t is None or t.dtype not in self._floating or t.is_sparse:
            return None
        op = _arg(args, kwargs, _OP, "op", dist.ReduceOp.SUM)
        if op not in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
            return None
        key = self._key(t)
        if key is None:
            return None
        return _arg(args, kwargs, _GROUP, "group", None), key, op == dist.ReduceOp.AVG

    def coordinator(self, group: Any) -> ManualCoordinator:
        c = self.coordinators.get(id(group))
        if c is None:
            probe = self.probe
            c = ManualCoordinator(
                actuators=probe.actuators,
                telemetry=probe.telemetry,
                process_group=group,
                collectives=self._c,
                block=probe.config.block_size,
                error_feedback=probe.config.error_feedback,
                chaos=probe.chaos,
                # This path sends the header with the first all-reduce of every phase (reduce()); it does not
                # skip headers, so it must declare its wanted levels at every cycle start too.
                header_every=1,
            )
            c.new_phase()
            self.coordinators[id(group)] = c
            probe.actuators.refuse("grad_accum_steps", ACCUM_REASON)
            probe.event("log", kind="gradient_sync", what="hand-written all_reduce of gradients recognised")
        return c

    def all_reduce(self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Carry out a recognised gradient all-reduce (``fn``: the unpatched all_reduce)."""
        group, key, avg = self.recognise(args, kwargs) or (None, (), False)
        t = args[0] if args else kwargs["tensor"]
        async_op = bool(_arg(args, kwargs, _ASYNC, "async_op", False))
        coord = self.coordinator(group)
        if t.dtype not in self._float or not t.is_contiguous():
            self.probe.actuators.refuse(
                "compression_bits",
                f"gradients of dtype {str(t.dtype).replace('torch.', '')} or non-contiguous "
                "are measured, not compressed",
            )
            return coord.plain(fn, args, kwargs, async_op)
        return coord.reduce(fn, t, key, avg, async_op)


class _Pending:
    """What an ``async_op=True`` gradient all-reduce returns when the probe carries it out itself: ``wait()``
    (or the future) ends with the result written into the user's tensor."""

    def __init__(self, work: Any, finish: Callable[[], None], tensor: torch.Tensor) -> None:
        self._work = work
        self._finish = finish
        self._tensor = tensor

    def wait(self, timeout: Any = None) -> bool:
        if timeout is None:
            self._work.wait()
        else:
            self._work.wait(timeout)
        self._finish()
        return True

    def is_completed(self) -> bool:
        return bool(self._work.is_completed())

    def is_success(self) -> bool:
        return bool(self._work.is_success())

    def exception(self) -> Any:
        return self._work.exception()

    def get_future(self) -> Any:
        tensor = self._tensor

        def done(fut: Any) -> list[torch.Tensor]:
            fut.value()
            self._finish()
            return [tensor]

        return self._work.get_future().then(done)

    def synchronize(self) -> None:
        self.wait()


class ManualCoordinator(SyncCoordinator):
    """The sync header and compression of ddp.SyncCoordinator, for all-reduces the script issues itself."""

    def new_phase(self) -> None:
        self._header_sent = False

    def _record(self, nbytes: int, start: float, fut: Any) -> None:
        def done(f: Any) -> Any:
            try:
                value = f.value()
            except Exception:
                self.telemetry.record_sync(nbytes, time.perf_counter() - start, False)
                raise
            self.telemetry.record_sync(nbytes, time.perf_counter() - start, True)
            return value

        fut.then(done)

    def plain(self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], async_op: bool) -> Any:
        """Measured only: the user's call as it is."""
        t = args[0] if args else kwargs["tensor"]
        nbytes = t.numel() * t.element_size()
        start = time.perf_counter()
        try:
            result = fn(*args, **kwargs)
        except Exception:
            self.telemetry.record_sync(nbytes, time.perf_counter() - start, False)
            raise
        if result is None:
            self.telemetry.record_sync(nbytes, time.perf_counter() - start, True)
        else:
            self._record(nbytes, start, result.get_future())
        return result

    def reduce(self, fn: Callable[..., Any], t: torch.Tensor, key: tuple[int, ...], avg: bool, async_op: bool) -> Any:
        first = not self._header_sent
        if first:
            self._header_sent = True
            self._start_cycle()  # the levels the group agreed at the last header take effect now, on every rank
            self._late()
        bits = self.peer_bits
        start = time.perf_counter()
        if all(b == 32 for b in bits):
            if not first:  # the user's own call, in place
                work = fn(t, self._dist.ReduceOp.AVG if avg else self._dist.ReduceOp.SUM, self.pg, async_op=True)
                self._record(t.numel() * t.element_size(), start, work.get_future())
                if async_op:
                    return work
                work.wait()
                return None
            work, finish = self._with_header(fn, t, avg, start)
        else:
            work, finish = self._compressed(t, key, avg, first, start)
        if async_op:
            return _Pending(work, finish, t)
        work.wait()
        finish()
        return None

    def _finisher(self, body: Callable[[float], None], work: Any, nbytes: int, start: float) -> Callable[[], None]:
        """``finish()``: once, after completion — the result into the user's tensor, the sync recorded."""
        lock = threading.Lock()
        done: list[bool] = []
        at: list[float] = []  # completion time, set by the backend's thread

        def completed(f: Any) -> Any:
            at.append(time.perf_counter())
            return f.value()

        work.get_future().then(completed)

        def finish() -> None:
            with lock:
                if done:
                    return
                done.append(True)
                latency = (at[0] if at else time.perf_counter()) - start
                try:
                    body(latency)
                except Exception:
                    self.telemetry.record_sync(nbytes, latency, False)
                    raise
                self.telemetry.record_sync(nbytes, latency, True)

        return finish

    def _with_header(self, fn: Callable[..., Any], t: torch.Tensor, avg: bool, start: float) -> tuple[Any, Any]:
        import torch

        flat = t.view(-1)
        n = flat.numel()
        header = sh.encode_slots(
            self._my_header(0.0), self.rank, self.world, 32, t.dtype, sh.stamp_now_ms(time.time()), device=t.device
        )
        send = torch.cat((flat, header))
        nbytes = send.numel() * send.element_size()
        work = fn(send, self._dist.ReduceOp.SUM, self.pg, async_op=True)

        def body(latency: float) -> None:
            self._headers_seen(sh.decode_slots(send[n:], self.world, 32), sh.STAMP_PERIOD_MS[32], latency)
            out = send[:n]
            flat.copy_(out.div_(self.world) if avg else out)

        return work, self._finisher(body, work, nbytes, start)

    def _compressed(
        self, t: torch.Tensor, key: tuple[int, ...], avg: bool, first: bool, start: float
    ) -> tuple[Any, Any]:
        import torch

        flat = t.view(-1)
        n = flat.numel()
        bits = self.peer_bits
        mine = self._encode(flat, bits[self.rank], key)
        sizes = [HEADER_BYTES + chunk_bytes(n, b, self.block) for b in bits]
        nbytes = mine.numel()
        if len(set(bits)) == 1:
            outs = [torch.empty(sizes[0], dtype=torch.uint8, device=mine.device) for _ in range(self.world)]
            work = self._c.all_gather(outs, mine, group=self.pg, async_op=True)

            def chunks() -> list[torch.Tensor]:
                return outs
        else:
            out = torch.empty(sum(sizes), dtype=torch.uint8, device=mine.device)
            work = self._c.all_to_all_single(
                out,
                mine.repeat(self.world),
                output_split_sizes=sizes,
                input_split_sizes=[nbytes] * self.world,
                group=self.pg,
                async_op=True,
            )

            def chunks() -> list[torch.Tensor]:
                return list(torch.split(out, sizes))

        def body(latency: float) -> None:
            parts = chunks()
            total = torch.zeros(n, dtype=torch.float32, device=flat.device)
            for r, part in enumerate(parts):
                total += self._decode(part, n, bits[r])
            if first:
                self._headers_seen([sh.decode_bytes(part) for part in parts], None, latency)
            flat.copy_(total.div_(self.world) if avg else total)

        return work, self._finisher(body, work, nbytes, start)
