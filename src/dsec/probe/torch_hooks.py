"""Instrumentation of torch, installed right after ``import torch`` finishes (see importhook.py).

- ``torch.distributed`` collectives (sync and async forms): bytes and latency to completion, errors.
- ``DistributedDataParallel``: our comm hook (ddp.py) is registered before the first forward unless the
  user registers one, in which case theirs is wrapped for measurement and keeps control.
- Optimizers: step time and gradient norm through torch's global step hooks; while a gradient-
  accumulation cycle is open, ``step``/``zero_grad``/``clip_grad_norm_`` and LR-scheduler ``step``
  are skipped so the accumulated gradient is neither applied early, wiped, nor clipped piecewise,
  and learning-rate schedules advance once per optimizer update (not per micro-step).
- Every patched function keeps its original as ``__wrapped__``; ``uninstall()`` restores them.
"""

from __future__ import annotations

import functools
import logging
import time
import types
from collections.abc import Callable
from types import ModuleType
from typing import TYPE_CHECKING, Any

from dsec.probe.ddp import SyncCoordinator
from dsec.probe.ddp_patch import patch_ddp
from dsec.probe.manual_sync import ManualSync
from dsec.probe.torch_targets import (
    COLLECTIVES,
    GROUP_ARG,
    POINT_TO_POINT,
    Originals,
    grad_norm,
    init_healing,
    tensor_bytes,
)

if TYPE_CHECKING:
    from dsec.probe.runtime import Probe

log = logging.getLogger(__name__)


class TorchInstrumentation:
    def __init__(self, probe: Probe) -> None:
        self.probe = probe
        self.coordinators: list[SyncCoordinator] = []
        self._restore: list[tuple[Any, str, Any]] = []
        self._hook_handles: list[Any] = []
        self.originals: Originals | None = None
        self.manual: ManualSync | None = None  # hand-written gradient all-reduces (manual_sync.py)

    # -- install / uninstall --------------------------------------------------------------------------
    def install(self, torch: ModuleType) -> None:
        import os

        import torch.distributed as dist

        trace_dir = os.environ.get("DSEC_STEP_TRACE")
        if trace_dir:
            os.makedirs(trace_dir, exist_ok=True)
            self._trace = open(os.path.join(trace_dir, f"steps-{os.getpid()}.jsonl"), "a", buffering=1)  # noqa: SIM115

        self.originals = Originals(dist)
        if dist.is_available() and self.probe.healing is None:
            self.manual = ManualSync(self.probe, self.originals)
            self._patch(torch.autograd, "backward", self._wrap_backward(torch.autograd.backward))
        if dist.is_available():
            import torch.distributed.distributed_c10d as c10d

            # Under healing the script's collectives must reach the elastic group even when torch's own helpers
            # (all_gather_object, broadcast_object_list, ...) call them inside distributed_c10d.
            owners = (dist, c10d) if self.probe.healing is not None else (dist,)
            for owner in owners:
                for name in COLLECTIVES:
                    if hasattr(owner, name):
                        self._patch(owner, name, self._wrap_collective(name, getattr(owner, name)))
            if self.probe.healing is not None:
                for owner in owners:
                    for name in (*POINT_TO_POINT, "new_group"):
                        if hasattr(owner, name):
                            self._patch(owner, name, self._refuse(name, getattr(owner, name)))
                self._patch(dist, "destroy_process_group", self._wrap_destroy(dist.destroy_process_group))
            self._patch(dist, "init_process_group", self._wrap_init(dist.init_process_group))
            from torch.nn.parallel import DistributedDataParallel as DDP

            patch_ddp(self, DDP)
        import torch.optim.optimizer as optim_mod

        self._patch(torch.optim.Optimizer, "__init__", self._wrap_optimizer_init(torch.optim.Optimizer.__init__))
        self._hook_handles.append(optim_mod.register_optimizer_step_pre_hook(self._pre_step))
        self._hook_handles.append(optim_mod.register_optimizer_step_post_hook(self._post_step))
        import torch.optim.lr_scheduler as sched

        # Learning-rate schedules advance per optimizer update, not per accumulated micro-step.
        self._patch(sched.LRScheduler, "step", self._gate(sched.LRScheduler.step, "scheduler"))
        if self.probe.healing is not None:
            self._patch(sched.LRScheduler, "__init__", self._wrap_scheduler_init(sched.LRScheduler.__init__))
        if not issubclass(sched.ReduceLROnPlateau, sched.LRScheduler):
            self._patch(sched.ReduceLROnPlateau, "step", self._gate(sched.ReduceLROnPlateau.step, "scheduler"))
        import torch.nn.utils as nn_utils

        self._patch(nn_utils, "clip_grad_norm_", self._wrap_clip(nn_utils.clip_grad_norm_))

    def uninstall(self) -> None:
        if self._trace is not None:
            self._trace.close()
            self._trace = None
        for owner, name, original in reversed(self._restore):
            setattr(owner, name, original)
        self._restore.clear()
        for h in self._hook_handles:
            h.remove()
        self._hook_handles.clear()

    def _patch(self, owner: Any, name: str, replacement: Callable[..., Any]) -> None:
        original = getattr(owner, name)
        replacement.__wrapped__ = original  # type: ignore[attr-defined]
        self._restore.append((owner, name, original))
        setattr(owner, name, replacement)

    # -- collectives ----------------------------------------------------------------------------------
    def _healed(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        """True when this call must go through the elastic group (healing on, the default group)."""
        healing = self.probe.healing
        if healing is None or healing.elastic is None:
            return False
        import torch.distributed as dist

        pos = GROUP_ARG.get(name)
        group = kwargs.get("group", args[pos] if pos is not None and len(args) > pos else None)
        return group is None or group is dist.GroupMember.WORLD

    def _wrap_collective(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        telemetry = self.probe.telemetry
        inst = self

        manual = self.manual if name == "all_reduce" else None

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if manual is not None and manual.after_backward and not inst.coordinators:
                try:
                    recognised = manual.recognise(args, kwargs) is not None
                except Exception:
                    log.debug("dsec: could not classify an all_reduce", exc_info=True)
                    recognised = False
                if recognised:
                    return manual.all_reduce(fn, args, kwargs)  # gradient sync, measured (and compressed) as such
            nbytes = tensor_bytes(args, kwargs)
            start = time.perf_counter()
            healing = inst.probe.healing
            try:
                if healing is not None and inst._healed(name, args, kwargs):
                    result = healing.collective(name, args, kwargs)
                else:
                    result = fn(*args, **kwargs)
            except Exception:
                telemetry.record_collective(name, nbytes, time.perf_counter() - start, False)
                raise
            if result is None or not kwargs.get("async_op", False):
                telemetry.record_collective(name, nbytes, time.perf_counter() - start, True)
                return result

            def done(fut: Any) -> Any:
                try:
                    value = fut.value()
                except Exception:
                    telemetry.record_collective(name, nbytes, time.perf_counter() - start, False)
                    raise
                telemetry.record_collective(name, nbytes, time.perf_counter() - start, True)
                return value

            try:
                result.get_future().then(done)
            except Exception:  # a backend without futures: count at issue time
                telemetry.record_collective(name, nbytes, time.perf_counter() - start, True)
            return result

        return wrapper

    def _wrap_backward(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        manual = self.manual

        @functools.wraps(fn)
        def backward(*args: Any, **kwargs: Any) -> Any:
            result = fn(*args, **kwargs)
            if manual is not None:
                manual.on_backward()  # gradients are ready: an all_reduce of them until the step is gradient sync
            return result

        return backward

    def _refuse(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def refused(*args: Any, **kwargs: Any) -> Any:
            from dsec.probe.heal_ops import NotHealable

            raise NotHealable(f"dsec healing cannot carry torch.distributed.{name} (turn healing off for this job)")

        return refused

    def _wrap_destroy(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        probe = self.probe

        @functools.wraps(fn)
        def destroy(*args: Any, **kwargs: Any) -> Any:
            result = fn(*args, **kwargs)
            if probe.healing is not None and (args[0] if args else kwargs.get("group")) is None:
                probe.healing.close()  # a clean end: this member leaves the healing group
            return result

        return destroy

    def _wrap_scheduler_init(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        probe = self.probe

        @functools.wraps(fn)
        def init(sched: Any, *args: Any, **kwargs: Any) -> None:
            fn(sched, *args, **kwargs)
            if probe.healing is not None:
                probe.healing.add_scheduler(sched)  # its state travels to a replacement

        return init

    def _wrap_init(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        probe = self.probe

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            healing = probe.healing
            if healing is not None:
                backend = str(args[0] if args else kwargs.get("backend") or "gloo").lower()
                if "gloo" not in backend:
                    log.warning("dsec: healing needs gloo process groups (got %r): healing is off", backend)
                    probe.event("log", urgent=True, kind="heal", what="off", reason=f"backend {backend}")
                    probe.healing = None
                else:
                    return init_healing(fn, probe, kwargs)
            result = fn(*args, **kwargs)
            try:
                import torch.distributed as dist

                probe.on_distributed(dist.get_rank(), dist.get_world_size())
            except Exception:
                log.debug("dsec: could not read rank after init_process_group", exc_info=True)
            return result

        return wrapper

    # -- DDP --------------------------------------------------------------------------------------------
    # -- optimizer and accumulation gating --------------------------------------------------------------
    def accumulating(self) -> bool:
        """True while a gradient-accumulation cycle is open (the last backward did not synchronize)."""
        # A loop, not any() over a generator (a generator's frame costs microseconds inside a training step, where
        # this is called 2-3 times).
        for c in self.coordinators:  # noqa: SIM110
            if not c.last_backward_synced:
                return True
        return False

    def _gate(self, fn: Callable[..., Any], what: str) -> Callable[..., Any]:
        inst = self

        @functools.wraps(fn)
        def gated(*args: Any, **kwargs: Any) -> Any:
            if inst.accumulating():
                if what == "step":
                    inst.probe.telemetry.record_skipped_update()
                return None
            if what == "step":
                inst.probe.device_memory_step()  # a fake card's allocation; its OOM reaches the training code
            if what == "step" and inst._snapshots("before_step"):
                return None  # restored just now: this step's gradient belongs to the weights before the restore
            if what == "step" and inst.probe.healing is not None:
                inst.probe.healing.before_step()
            return fn(*args, **kwargs)

        return gated

    def _wrap_optimizer_init(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        inst = self

        @functools.wraps(fn)
        def init(opt: Any, *args: Any, **kwargs: Any) -> None:
            fn(opt, *args, **kwargs)
            inst.probe.replicas.add_optimizer(opt)
            if inst.manual is not None:
                inst.manual.add_optimizer(opt)
            inst._snapshots("on_optimizer", opt)
            # Instance attributes shadow the class's step/zero_grad: only while accumulating do they
            # skip. They stay bound methods because LR schedulers re-wrap ``opt.step.__func__``.
            for name, what in (("step", "step"), ("zero_grad", "zero_grad")):
                setattr(opt, name, types.MethodType(inst._gate_method(getattr(opt, name), what), opt))
            inst.probe.activity("optimizer")

        return init

    def _gate_method(self, bound: Callable[..., Any], what: str) -> Callable[..., Any]:
        gated = self._gate(bound, what)

        @functools.wraps(bound)
        def method(_self: Any, *args: Any, **kwargs: Any) -> Any:
            return gated(*args, **kwargs)

        return method

    def _pre_step(self, opt: Any, args: Any, kwargs: Any) -> None:
        opt._dsec_step_start = time.perf_counter()

    def _post_step(self, opt: Any, args: Any, kwargs: Any) -> None:
        if self.manual is not None:
            self.manual.on_step()
        start = getattr(opt, "_dsec_step_start", None)
        if start is None:
            return
        norm = None
        synced = [c.grad_norm for c in self.coordinators if c.grad_norm is not None]
        clipped = self._clip_norm is not None
        if clipped:
            # The training code clipped the synchronized gradient: clip_grad_norm_ returned its norm, so the comm
            # hooks need not compute it (from the next step on; they are told below).
            norm = self._clip_norm
        elif synced:
            # The comm hook already computed the synchronized gradient's norm: no extra pass.
            norm = float(sum(n * n for n in synced) ** 0.5)
        else:
            norm = grad_norm(opt)
        for c in self.coordinators:
            c.norm_from_clip = clipped  # a step without clipping: the hooks compute the norm again
        self._clip_norm = None
        # Backward passes per optimizer step: the group's agreed accumulation (1 without a comm hook of ours).
        micro = max((c.accum for c in self.coordinators), default=1)
        self.probe.telemetry.record_update(time.perf_counter() - start, norm, micro_steps=micro)
        if self._trace is not None:
            self._trace_step()
        self.probe.replicas.after_step()
        self._snapshots("after_step", self._group_snapshot_agreed())
        self.probe.after_optimizer_step()  # may stop the process after a snapshot (dsec.probe.recycle)

    def _group_snapshot_agreed(self) -> bool | None:
        """None when no multi-rank comm hook of ours carries the group's agreement (snapshots on a timer); else
        whether the group agreed in the last sync header to snapshot at this step (consumed)."""
        guard = next((c.guard for c in self.coordinators if c.guard is not None and c.world > 1), None)
        if guard is None:
            return None
        agreed, guard.snapshot_agreed = guard.snapshot_agreed, False
        return agreed

    def _snapshots(self, hook: str, *args: Any) -> Any:
        """Call a snapshot hook; a failure there is logged and never reaches the training code."""
        snaps = self.probe.snapshots
        if snaps is None:
            return None
        try:
            return getattr(snaps, hook)(*args)
        except Exception:
            log.exception("dsec: snapshot hook %s failed", hook)
            return None

    _clip_norm: float | None = None
    _trace: Any = None
    _traced = 0

    def _trace_step(self) -> None:
        """DSEC_STEP_TRACE=DIR: one JSON line per optimizer step in DIR/steps-<pid>.jsonl (benchmarks time pauses)."""
        self._traced += 1
        snaps = self.probe.snapshots
        step = snaps.steps + 1 if snaps is not None else self._traced  # the run's step, continued across restores
        self._trace.write(f'{{"t": {time.time():.6f}, "rank": {self.probe.rank}, "step": {step}}}\n')

    def _wrap_clip(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        inst = self

        import torch

        @functools.wraps(fn)
        def clip(parameters: Any, max_norm: float, *args: Any, **kwargs: Any) -> Any:
            if inst.accumulating():
                # Clipping a partial sum would distort the accumulated gradient: clip once, at the sync.
                return torch.tensor(float("nan"))
            total = fn(parameters, max_norm, *args, **kwargs)
            norm_type = args[0] if args else kwargs.get("norm_type", 2.0)
            # Only the Euclidean norm is the gradient norm DSec reports (grad_norm, its trend).
            euclidean = isinstance(norm_type, (int, float)) and float(norm_type) == 2.0
            inst._clip_norm = float(total) if euclidean and isinstance(total, torch.Tensor) else None
            return total

        return clip
