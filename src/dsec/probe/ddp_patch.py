"""The probe's patch of ``DistributedDataParallel`` (installed by torch_hooks.py): each DDP model built registers
with the probe, and gets the probe's gradient-sync comm hook (ddp.py, or healing's) before its first forward."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from dsec.probe.ddp import SyncCoordinator, measured_hook
from dsec.probe.torch_targets import unannotated

if TYPE_CHECKING:
    from dsec.probe.torch_hooks import TorchInstrumentation

log = logging.getLogger(__name__)


def patch_ddp(inst: TorchInstrumentation, ddp_cls: type) -> None:
    """Patch DistributedDataParallel: a wrapped DDP registers with the probe (replica check, healing, snapshots);
    before its first forward the probe's comm hook is installed unless the script registered its own (measured then,
    and compression/accumulation refused)."""
    original_register = ddp_cls.register_comm_hook  # type: ignore[attr-defined]
    original_forward = ddp_cls.forward  # type: ignore[attr-defined]

    def register_comm_hook(self: Any, state: Any, hook: Callable[..., Any]) -> Any:
        if getattr(self, "_dsec_hooked", False):
            raise RuntimeError("register_comm_hook must be called before the first forward under dsec")
        if inst.probe.healing is not None:
            from dsec.probe.heal_ops import NotHealable

            raise NotHealable("dsec healing carries the gradient sync itself: a user comm hook cannot be used")
        self._dsec_hooked = True
        inst.probe.actuators.collectives_locked = True
        for field in ("compression_bits", "grad_accum_steps"):
            inst.probe.actuators.refuse(field, "a user comm hook controls this DDP model's gradient sync")
        inst.probe.event(
            "alert",
            reason="user_comm_hook",
            message="a user comm hook is registered: dsec measures it but cannot compress "
            "or accumulate gradients for this model",
        )
        return original_register(self, state, unannotated(measured_hook(hook, inst.probe.telemetry)))

    def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not getattr(self, "_dsec_hooked", True):
            install_coordinator(inst, self, original_register)
        return original_forward(self, *args, **kwargs)

    original_init = ddp_cls.__init__  # type: ignore[misc]

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        original_init(self, *args, **kwargs)
        self._dsec_hooked = False
        inst.probe.activity("ddp")
        inst.probe.replicas.add_module(self)
        if inst.probe.healing is not None:
            inst.probe.healing.after_ddp_init(self)
        inst._snapshots("on_module", self)

    inst._patch(ddp_cls, "__init__", init)
    inst._patch(ddp_cls, "register_comm_hook", register_comm_hook)
    inst._patch(ddp_cls, "forward", forward)
    inst._patch(ddp_cls, "zero_grad", inst._gate(ddp_cls.zero_grad, "zero_grad"))  # type: ignore[attr-defined]


def install_coordinator(inst: TorchInstrumentation, ddp: Any, register: Callable[..., Any]) -> None:
    ddp._dsec_hooked = True
    healing = inst.probe.healing
    try:
        # Under healing the header rides every step (admission and the contributor count depend on it).
        make: Callable[..., SyncCoordinator] = (
            functools.partial(healing.coordinator, ddp)
            if healing is not None
            else functools.partial(SyncCoordinator, header_every=inst.probe.config.header_every)
        )
        coord = make(
            actuators=inst.probe.actuators,
            telemetry=inst.probe.telemetry,
            process_group=ddp.process_group,
            collectives=inst.originals,
            block=inst.probe.config.block_size,
            error_feedback=inst.probe.config.error_feedback,
            chaos=inst.probe.chaos,
            # One guard per process: it covers every DDP model and optimizer; the first model's header carries it.
            guard=None if inst.coordinators else inst.probe.replicas,
        )
        register(ddp, None, unannotated(coord.hook))
        inst.coordinators.append(coord)
    except Exception:
        log.warning("dsec: could not install the DDP comm hook; gradient sync is not measured", exc_info=True)
