"""Zero-touch snapshots in a probed process: find what to snapshot, carry out the directive, restore at start.

What is captured: every ``DistributedDataParallel`` module's inner module (parameters and buffers) and every
optimizer the user builds (its parameters, even without DDP, and its state), plus RNG states. With
``DSEC_RESTORE=latest`` (or a snapshot number) a verified snapshot is loaded into them as they are built, before
any training: weights, buffers and RNG when the DDP wrapper is built (or, without DDP, when the first optimizer is),
each optimizer's state as it is built. So the first rollout already uses the restored policy and the random streams
continue where the snapshot left them. A step counter kept in a user's own variables is not restorable zero-touch;
the snapshot's ``step`` (optimizer steps of the run, continued across restores) is reported instead.

**Ranks of a DDP group snapshot and restore together.** Their snapshots are *group snapshots*: a rank whose period
is due (or that was asked for one) says so in the sync header, and every rank snapshots right after the same
optimizer step (probe/replicas.py), so the ranks' snapshots share steps. A restore is agreed when the DDP wrapper is
built (every rank builds it at the same point of the script): the ranks restore the newest step that verifies on
some rank, the ranks that lack it receiving a verified copy from one that has it (probe/agreed_restore.py).
Nothing verifies anywhere: nothing is restored and a ``restore`` event with status ``none`` says why. Replicas
never resume at different steps.

Environment: DSEC_SNAPSHOT_DIR (off when unset), DSEC_RESTORE (latest | N), DSEC_SNAPSHOT_NAME (default
``<group>-<role>-<rank>``, stable across restarts so a restarted worker finds its own snapshots; under ``--role auto``
the role in it is ``learner``),
DSEC_SNAPSHOT_INTERVAL_S (a job's own period; it wins over the directive's ``snapshot_interval_s``),
DSEC_SNAPSHOT_CADENCE / DSEC_SNAPSHOT_HISTORY (that period adapted to the group's failure history: probe/cadence.py).
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

from dsec.probe.cadence import SnapshotCadence

if TYPE_CHECKING:
    from dsec.probe.runtime import Probe
    from dsec.snapshot import Snapshotter

log = logging.getLogger(__name__)


class ProbeSnapshots:
    def __init__(
        self,
        probe: Probe,
        root: str,
        restore: str | None = None,
        name: str | None = None,
        interval_s: float | None = None,
        cadence: SnapshotCadence | None = None,
    ) -> None:
        self.probe = probe
        self.interval_s = interval_s  # the job's own period (DSEC_SNAPSHOT_INTERVAL_S) wins over the directive's
        self.cadence = cadence  # None: the period as configured
        self.root = root
        self.name = name
        self.restore_request = (restore or "").strip() or None
        if self.restore_request not in (None, "latest") and not str(self.restore_request).isdigit():
            log.error("dsec: DSEC_RESTORE=%r is invalid (expected latest or a snapshot number); ignored", restore)
            self.restore_request = None
        self.snapshotter: Snapshotter | None = None
        self.steps = 0  # optimizer steps of the run (continued from the restored snapshot's step)
        self._modules = 0
        self._optimizers = 0
        self._last_request: str | None = None
        self._requests: list[str] = []  # asked for by the directive, not yet in a snapshot
        self._trained = False  # an optimizer step ran in this process
        self._failed = False
        self.restored: dict[str, Any] | None = None

    @classmethod
    def from_env(cls, probe: Probe, env: Any = None) -> ProbeSnapshots | None:
        env = os.environ if env is None else env
        root = env.get("DSEC_SNAPSHOT_DIR")
        if not root:
            return None
        raw = env.get("DSEC_SNAPSHOT_INTERVAL_S")
        try:
            interval = float(raw) if raw else None
        except ValueError:
            log.error("dsec: DSEC_SNAPSHOT_INTERVAL_S=%r is not a number; the directive's period applies", raw)
            interval = None
        cadence = SnapshotCadence.from_env(env)
        return cls(probe, root, env.get("DSEC_RESTORE"), env.get("DSEC_SNAPSHOT_NAME") or None, interval, cadence)

    # -- discovery -------------------------------------------------------------------------------------
    def _ensure(self) -> Snapshotter | None:
        if self.snapshotter is not None or self._failed:
            return self.snapshotter
        try:
            from dsec.snapshot import LocalDirStore, Snapshotter

            cfg = self.probe.config.reporter
            rank = self.probe.rank
            # Under --role auto the role is not known yet when the first model or optimizer is built; a process with
            # something to snapshot trains it, and an optimizer step makes it a learner (probe/roles.py). Naming it
            # so keeps the name stable across restarts and launchers (`dsec launch` groups are learners by default).
            role = "learner" if self.probe.config.infer_role else cfg.role
            name = self.name or f"{cfg.group}-{role}-{rank}"
            level = self.probe.actuators.snapshot_compression_level
            self.snapshotter = Snapshotter(
                LocalDirStore(self.root), name, level=2 if level is None else int(level), on_event=self._event
            )
        except Exception:
            self._failed = True
            log.exception("dsec: snapshots disabled: cannot open the snapshot store %s", self.root)
        return self.snapshotter

    def on_module(self, ddp: Any) -> None:
        snap = self._ensure()
        if snap is not None:
            snap.register(f"model{self._modules}", ddp)
            self._modules += 1
            if self.restore_request is not None:
                pg = _group_of(ddp)
                if pg is not None:
                    with self.probe.internal_collectives():
                        self._agreed_restore(pg)
                else:
                    self._restore()

    def on_optimizer(self, opt: Any) -> None:
        snap = self._ensure()
        if snap is None:
            return
        name = f"optim{self._optimizers}"
        snap.register(name, opt)
        self._optimizers += 1
        if self.restore_request is not None:
            self._restore()  # no DDP module: the first optimizer brings the parameters
        elif snap.restored is not None and not self._trained:
            snap.catch_up(name)  # built after the restore, before training: its state comes from the snapshot

    # -- training-thread hooks -----------------------------------------------------------------------------
    def before_step(self) -> bool:
        """True when this optimizer step must be skipped: a restore that could not happen earlier just replaced
        the weights whose gradient this step would apply."""
        if self.restore_request is not None:
            return self._restore()
        return False

    def request(self, name: str) -> None:
        """A snapshot at the end of the current optimizer step (in a DDP group: when the ranks agree on it), as the
        control plane's ``snapshot_now`` asks; ``name`` is its request, recorded with it."""
        self._requests.append(name)

    def _poll_request(self) -> None:
        act = self.probe.actuators
        if act.snapshot_now and act.snapshot_now != self._last_request:
            self._last_request = act.snapshot_now
            self._requests.append(act.snapshot_now)

    def _interval(self) -> float | None:
        interval = self.interval_s or self.probe.actuators.snapshot_interval_s
        configured = float(interval) if interval else None
        return self.cadence.interval(configured) if self.cadence is not None else configured

    def group_status(self) -> tuple[bool, bool]:
        """(wanted, busy) for this rank's sync header: a snapshot is due or was asked for; the previous one is still
        being written (then the group waits: a snapshot some rank cannot take would share no step)."""
        snap = self.snapshotter
        if snap is None:
            return False, False
        self._poll_request()
        busy = snap.busy()
        return (not busy and (bool(self._requests) or snap.due(self._interval()))), busy

    def after_step(self, agreed: bool | None = None) -> None:
        """After an optimizer step. ``agreed``: None when this process snapshots on its own timer; else whether the
        ranks of its DDP group agreed (in this step's sync header) to snapshot now."""
        self.steps += 1
        self._trained = True
        snap = self.snapshotter
        if snap is None:
            return
        act = self.probe.actuators
        if act.snapshot_compression_level is not None:
            snap.set_level(int(act.snapshot_compression_level))
        self._poll_request()
        if agreed is None:
            request = self._requests.pop(0) if self._requests else None
            snap.poll(step=self.steps, interval_s=self._interval(), request=request)
            for extra in self._requests:
                snap.poll(step=self.steps, request=extra)
            self._requests.clear()
        elif agreed:
            requests, self._requests = tuple(self._requests), []
            snap.take(step=self.steps, requests=requests)

    def take_final(self, request: str, timeout_s: float = 60.0) -> int | None:
        """A snapshot of the state after the last optimizer step, published before this returns (the process is about
        to stop: nothing would take a queued one later). Its sequence number; None when nothing was trained here, there
        is no snapshot store, or it was not published within ``timeout_s``."""
        snap = self.snapshotter
        if snap is None or not self._trained or not snap.wait_idle(timeout_s):
            return None
        ticket = snap.take(step=self.steps, request=request)
        if not ticket.wait(timeout_s) or ticket.error is not None:
            return None
        return ticket.seq

    def _restore(self) -> bool:
        request, self.restore_request = self.restore_request, None
        snap = self.snapshotter
        if snap is None:
            return False
        at_most = None if request == "latest" else int(str(request))
        try:
            report = snap.restore_latest(at_most=at_most)
        except Exception as exc:
            log.exception("dsec: restore failed; training continues from its own initial state")
            self.probe.event("restore", urgent=True, status="failed", error=f"{type(exc).__name__}: {exc}")
            return False
        if report is None:
            self.probe.event("restore", urgent=True, status="none", message=f"no usable snapshot in {self.root}")
            return False
        self._restored(report.as_event(snap.worker), report.step)
        return True

    def _restored(self, event: dict[str, Any], step: int | None) -> None:
        self.restored = event
        if step is not None:
            self.steps = step
        self.probe.replicas.force_check()

    def _agreed_restore(self, pg: Any) -> bool:
        """Restore the step the ranks of ``pg`` agree on (probe/agreed_restore.py); all ranks call it at the same
        point, the DDP wrapper's construction, before any training step."""
        from dsec.probe.agreed_restore import agree

        request, self.restore_request = self.restore_request, None
        snap = self.snapshotter
        if snap is None:
            return False
        at_most = None if request == "latest" else int(str(request))

        def skipped(seq: int, reason: str) -> None:
            self._event("snapshot_skipped", {"id": f"{snap.worker}/{seq}", "reason": reason})

        outcome = agree(snap, pg, at_most, skipped, self.root)
        if outcome.loaded is None:
            self.probe.event("restore", urgent=True, status="none", message=outcome.message, **outcome.note)
            return False
        report = snap.restore(outcome.loaded, outcome.skipped, note=outcome.note)
        self._restored({**report.as_event(snap.worker), **outcome.note}, report.step)
        return True

    def _event(self, kind: str, data: dict[str, Any]) -> None:
        if kind == "restore":
            self.probe.event("restore", urgent=True, status="ok", **data)
        elif kind == "snapshot":
            if self.cadence is not None:
                self.cadence.observe(data)
                interval = self._interval()
                if interval is not None:
                    data = {**data, "interval_s": round(interval, 1)}  # the period from now on (dsec events shows it)
            self.probe.event("snapshot", status="ok", **data)
        else:  # snapshot_failed, snapshot_skipped
            self.probe.event("snapshot", urgent=True, status=kind.removeprefix("snapshot_"), **data)

    def close(self) -> None:
        if self.snapshotter is not None:
            self.snapshotter.close()


def _group_of(ddp: Any) -> Any:
    """The DDP wrapper's process group when it spans more than one rank (else None: restore on its own)."""
    try:
        import torch.distributed as dist

        pg = getattr(ddp, "process_group", None)
        if pg is not None and dist.is_initialized() and dist.get_world_size(pg) > 1:
            return pg
    except Exception:
        log.debug("dsec: no process group for the agreed restore", exc_info=True)
    return None
