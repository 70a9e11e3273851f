"""Healing in a probed process (``DSEC_HEAL_RUN`` set, by ``dsec launch`` with ``heal: true`` or ``dsec run
--heal``): the script's ``init_process_group`` gives it a placeholder default group (torch's ``fake`` backend, its
rank and world size unchanged) and DSec's elastic group (elastic.py) carries every collective; DDP wrappers get
DSec's initial broadcast and the healing comm hook (heal_sync.py); the optimizer-step gate applies a received
state and the group's optimizer settings.

Scope (checked, refused with a clear message otherwise): gloo (CPU) process groups, DDP without
``find_unused_parameters``, the collectives listed in heal_ops.py on the default group. Environment:

=====================  =======================================================================  ==============
DSEC_HEAL_RUN          the healing run (one launch of a group): turns healing on               -
DSEC_HEAL_REPLACEMENT  1: this process replaces a dead rank (it joins at its first collective)  0
DSEC_HEAL_TIMEOUT_S    collective and rendezvous timeout of each epoch's gloo group             60
DSEC_HEAL_GIVE_UP_S    how long a member retries an unreachable control plane                   60
DSEC_HEAL_HOST         the address peers reach this process at                                  route to master
DSEC_HEAL_JOURNAL      a directory: one file per process, a line per op, watch view, admission  -
                       vote and lost period (debugging a group that does not heal)
=====================  =======================================================================  ==============
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import uuid
import weakref
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

from dsec.heal.membership import Plan
from dsec.jsonsafe import json_safe as _json_safe
from dsec.probe import heal_ops
from dsec.probe.elastic import ElasticGroup
from dsec.probe.epoch import advertised_host
from dsec.probe.heal_client import HealClient, Identity
from dsec.probe.replica_state import ReplicaState, apply, capture

if TYPE_CHECKING:
    from dsec.probe.heal_sync import HealingSync
    from dsec.probe.runtime import Probe

log = logging.getLogger(__name__)

# Accumulation syncs every N-th backward pass: the group's sequence of collectives changes (PPO's 32 gradient syncs
# per update become 8), its period is lost for good (heal/sequence.py) and no replacement could ever be admitted —
# the group would wait for its admission timeout, then restart from its snapshots. Compression keeps one sync per
# backward pass and stays available.
ACCUM_REASON = (
    "healing group: accumulation would change the number of gradient syncs per loop, and a replacement could no "
    "longer be admitted"
)

PARAM_GROUPS_BYTES = 1 << 16  # optimizer settings broadcast for alignment (JSON), padded to this size


class Healing:
    def __init__(self, probe: Probe, run: str, replacement: bool, env: Mapping[str, str]) -> None:
        self.probe = probe
        self.run = run
        self.replacement = replacement
        self.timeout_s = float(env.get("DSEC_HEAL_TIMEOUT_S") or 60.0)
        self.give_up_s = float(env.get("DSEC_HEAL_GIVE_UP_S") or 60.0)
        self.host = env.get("DSEC_HEAL_HOST") or advertised_host(env.get("MASTER_ADDR"))
        self.incarnation = f"{os.getpid()}-{uuid.uuid4().hex[:12]}"
        self.elastic: ElasticGroup | None = None
        self.syncs: list[HealingSync] = []
        self._schedulers: list[weakref.ref[Any]] = []
        self._received: ReplicaState | None = None
        self.applied_state = False
        self._local = threading.local()
        self._aligned_reported: set[tuple[int, tuple[str, ...]]] = set()
        self.aligned = 0  # optimizer-settings alignments applied (for reports)

    @classmethod
    def from_env(cls, probe: Probe, env: Mapping[str, str] | None = None) -> Healing | None:
        env = os.environ if env is None else env
        run = env.get("DSEC_HEAL_RUN")
        if not run:
            return None
        return cls(probe, run, env.get("DSEC_HEAL_REPLACEMENT") == "1", env)

    # -- process group ---------------------------------------------------------------------------------------
    def start(self, rank: int, world: int) -> None:
        cfg = self.probe.config.reporter
        me = Identity(self.run, cfg.pool, cfg.group, world, rank, self.incarnation, cfg.device)
        client = HealClient(cfg.endpoint, cfg.token, me, give_up_s=self.give_up_s)
        self.elastic = ElasticGroup(
            client,
            rank,
            world,
            replacement=self.replacement,
            host=self.host,
            timeout_s=self.timeout_s,
            on_event=self._event,
            capture_state=self._capture,
            receive_state=self._receive,
        )
        self.elastic.start()

    def _event(self, what: str, data: dict[str, Any]) -> None:
        if what == "healed":
            self.probe.replicas.force_check()  # replicas are compared at the first step after every heal
        self.probe.event("log", urgent=what != "formed", kind="heal", what=what, run=self.run, **data)

    def close(self, leave: bool = True) -> None:
        """Stop this member's healing threads; ``leave``: tell the group it finished cleanly (its exit: no failure)."""
        if self.elastic is not None:
            self.elastic.close(leave=leave)

    # -- the script's collectives ----------------------------------------------------------------------------------
    @contextlib.contextmanager
    def internal(self) -> Iterator[None]:
        """Collectives DSec makes on the script's behalf (the agreed restore's exchanges): not part of the script's
        sequence, so they do not hide its period from admission (a replacement does not make them)."""
        self._local.internal = True
        try:
            yield
        finally:
            self._local.internal = False

    def collective(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Run one of the script's collectives on the default group through the elastic group."""
        elastic = self.elastic
        if elastic is None:
            raise RuntimeError("dsec healing: a collective before init_process_group")
        if name in heal_ops.REFUSED:
            raise heal_ops.NotHealable(
                f"dsec healing carries {', '.join(heal_ops.SUPPORTED)} on the default group; {name} is not supported"
            )
        op = _build(name, args, kwargs)
        if getattr(self._local, "internal", False):
            op.sig = None
        value = elastic.run(op)
        if kwargs.get("async_op"):
            return _DoneWork()
        return value

    # -- DDP ------------------------------------------------------------------------------------------------------
    def after_ddp_init(self, ddp: Any) -> None:
        if getattr(ddp, "find_unused_parameters", False):
            raise heal_ops.NotHealable("dsec healing does not support DDP(find_unused_parameters=True)")
        elastic = self.elastic
        assert elastic is not None
        if not self.replacement:
            inner = getattr(ddp, "module", ddp)
            tensors = [p for p in inner.parameters()] + [b for b in inner.buffers()]
            elastic.run(heal_ops.InitialBroadcast(tensors))

        def broadcast_buffers(tensors: list[Any], _size: int, authoritative_rank: int = 0) -> None:
            for t in tensors:
                elastic.run(heal_ops.Broadcast(t, authoritative_rank))

        # DDP broadcasts its buffers through its (placeholder) group before each forward: carry them instead.
        ddp._distributed_broadcast_coalesced = broadcast_buffers

    def coordinator(self, ddp: Any, **kwargs: Any) -> HealingSync:
        from dsec.probe.heal_sync import HealingSync

        assert self.elastic is not None
        # The header rides every step under healing (admission and the contributor count depend on it).
        kwargs["header_every"] = 1
        self.probe.actuators.refuse("grad_accum_steps", ACCUM_REASON)
        sync = HealingSync(elastic=self.elastic, params=list(ddp.parameters()), **kwargs)
        self.syncs.append(sync)
        return sync

    def add_scheduler(self, sched: Any) -> None:
        self._schedulers.append(weakref.ref(sched))

    def schedulers(self) -> list[Any]:
        return [s for s in (r() for r in self._schedulers) if s is not None]

    # -- state ------------------------------------------------------------------------------------------------------
    def _capture(self) -> ReplicaState:
        guard = self.probe.replicas
        sync = self.syncs[0] if self.syncs else None
        snaps = self.probe.snapshots
        counters = {
            "syncs": sync.syncs if sync else 0,
            "peer_bits": list(sync.peer_bits) if sync else [],
            "accum": sync.accum if sync else 1,
            "steps": snaps.steps if snaps is not None else self.probe.telemetry.updates_total,
        }
        return capture(guard.modules(), guard.optimizers(), self.schedulers(), counters)

    def _receive(self, state: ReplicaState, plan: Plan) -> None:
        """On the heal thread, during the replacement's first collective: keep it for the next optimizer step."""
        self._received = state
        counters = state.meta["counters"]
        for sync in self.syncs[:1]:
            sync.syncs = int(counters.get("syncs", 0))
            bits = counters.get("peer_bits") or []
            if len(bits) == len(sync.peer_bits):
                sync.peer_bits = [int(b) for b in bits]
            sync.accum = int(counters.get("accum", 1))
        if self.probe.snapshots is not None:
            self.probe.snapshots.steps = int(counters.get("steps", 0))

    def before_step(self) -> None:
        """At the optimizer step (training thread): a replacement loads the state it received; every member takes
        the group's optimizer settings when the last sync header showed them differing."""
        state, self._received = self._received, None
        if state is not None:
            guard = self.probe.replicas
            apply(state, guard.modules(), guard.optimizers(), self.schedulers())
            self.applied_state = True
            self.probe.replicas.force_check()
        for sync in self.syncs[:1]:
            ref, sync.hyper_reference = sync.hyper_reference, None
            if ref is not None:
                self._align_settings(ref)

    def _align_settings(self, reference: int) -> None:
        elastic = self.elastic
        assert elastic is not None
        optimizers = self.probe.replicas.optimizers()
        mine = [[{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups] for opt in optimizers]
        payload = json.dumps(_json_safe(mine)).encode() if elastic.rank == reference else None
        if payload is not None and len(payload) > PARAM_GROUPS_BYTES:
            payload = b"null"  # too large to align: report, keep own settings everywhere
        got = elastic.run(heal_ops.BroadcastBytes(payload, reference, PARAM_GROUPS_BYTES))
        settings = json.loads(got or b"null")
        if not isinstance(settings, list) or elastic.rank == reference:
            return
        changed = []
        for opt, groups in zip(optimizers, settings, strict=False):
            for group, ref in zip(opt.param_groups, groups, strict=False):
                for key, value in ref.items():
                    if key in group and value is not None and _json_safe(group[key]) != value:
                        changed.append(key)
                        self.aligned += 1
                        group[key] = tuple(value) if isinstance(group[key], tuple) else value
        key = (reference, tuple(sorted(set(changed))))
        if changed and key not in self._aligned_reported:
            # Once per pattern: a script that recomputes its settings from its own counters differs every update.
            self._aligned_reported.add(key)
            self.probe.event(
                "anomaly",
                urgent=True,
                kind="hyperparameter_mismatch",
                aligned_to=reference,
                keys=sorted(set(changed)),
                message=f"this rank's optimizer settings differed from the group's; rank {reference}'s applied",
            )


class _DoneWork:
    """What an ``async_op=True`` collective returns under healing: it has already run."""

    def wait(self, timeout: Any = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True

    def exception(self) -> None:
        return None

    def get_future(self) -> Any:
        import torch

        fut: Any = torch.futures.Future()
        fut.set_result(None)
        return fut


def _arg(args: tuple[Any, ...], kwargs: dict[str, Any], i: int, name: str, default: Any = None) -> Any:
    return args[i] if len(args) > i else kwargs.get(name, default)


def _build(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    if name == "all_reduce":
        return heal_ops.AllReduce(_arg(args, kwargs, 0, "tensor"), _arg(args, kwargs, 1, "op"))
    if name == "reduce":
        return heal_ops.AllReduce(
            _arg(args, kwargs, 0, "tensor"), _arg(args, kwargs, 2, "op"), dst=_arg(args, kwargs, 1, "dst", 0)
        )
    if name == "broadcast":
        return heal_ops.Broadcast(_arg(args, kwargs, 0, "tensor"), int(_arg(args, kwargs, 1, "src", 0)))
    if name == "all_gather":
        return heal_ops.AllGather(_arg(args, kwargs, 0, "tensor_list"), _arg(args, kwargs, 1, "tensor"))
    if name == "all_gather_into_tensor":
        return heal_ops.AllGather(_arg(args, kwargs, 0, "output_tensor"), _arg(args, kwargs, 1, "input_tensor"))
    if name == "barrier":
        return heal_ops.Barrier()
    raise heal_ops.NotHealable(f"dsec healing: {name} is not supported on the default group")
