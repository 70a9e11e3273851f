"""Zero-touch snapshots in a probed process: find what to snapshot, carry out the directive, restore at start.

What is captured: every ``DistributedDataParallel`` module's inner module (parameters and buffers) and every
optimizer the user builds (its parameters, even without DDP, and its state), plus RNG states. With
``DSEC_RESTORE=latest`` (or a snapshot number) the newest verified snapshot is loaded into them as they are built,
before any training: weights, buffers and RNG when the DDP wrapper is built (or, without DDP, when the first
optimizer is), each optimizer's state as it is built. So the first rollout already uses the restored policy and
the random streams continue where the snapshot left them. A step counter kept in a user's own variables is not
restorable zero-touch; the snapshot's ``step`` (optimizer steps this process made) is reported instead.

Environment: DSEC_SNAPSHOT_DIR (off when unset), DSEC_RESTORE (latest | N), DSEC_SNAPSHOT_NAME (default
``<group>-<role>-<rank>``, stable across restarts so a restarted worker finds its own snapshots),
DSEC_SNAPSHOT_INTERVAL_S (a job's own period; it wins over the directive's ``snapshot_interval_s``).
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

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
    ) -> None:
        self.probe = probe
        self.interval_s = interval_s  # the job's own period (DSEC_SNAPSHOT_INTERVAL_S) wins over the directive's
        self.root = root
        self.name = name
        self.restore_request = (restore or "").strip() or None
        if self.restore_request not in (None, "latest") and not str(self.restore_request).isdigit():
            log.error("dsec: DSEC_RESTORE=%r is invalid (expected latest or a snapshot number); ignored", restore)
            self.restore_request = None
        self.snapshotter: Snapshotter | None = None
        self.steps = 0
        self._modules = 0
        self._optimizers = 0
        self._last_request: str | None = None
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
        return cls(probe, root, env.get("DSEC_RESTORE"), env.get("DSEC_SNAPSHOT_NAME") or None, interval)

    # -- discovery -------------------------------------------------------------------------------------
    def _ensure(self) -> Snapshotter | None:
        if self.snapshotter is not None or self._failed:
            return self.snapshotter
        try:
            from dsec.snapshot import LocalDirStore, Snapshotter

            cfg = self.probe.config.reporter
            rank = self.probe.rank
            name = self.name or f"{cfg.group}-{cfg.role}-{rank}"
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
        elif snap.restored is not None and self.steps == 0:
            snap.catch_up(name)  # built after the restore, before training: its state comes from the snapshot

    # -- training-thread hooks -----------------------------------------------------------------------------
    def before_step(self) -> bool:
        """True when this optimizer step must be skipped: a restore that could not happen earlier just replaced
        the weights whose gradient this step would apply."""
        if self.restore_request is not None:
            return self._restore()
        return False

    def after_step(self) -> None:
        self.steps += 1
        snap = self.snapshotter
        if snap is None:
            return
        act = self.probe.actuators
        if act.snapshot_compression_level is not None:
            snap.set_level(int(act.snapshot_compression_level))
        request = act.snapshot_now if act.snapshot_now and act.snapshot_now != self._last_request else None
        if request is not None:
            self._last_request = request
        interval = self.interval_s or act.snapshot_interval_s
        snap.poll(step=self.steps, interval_s=float(interval) if interval else None, request=request)

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
        self.restored = report.as_event(snap.worker)
        return True

    def _event(self, kind: str, data: dict[str, Any]) -> None:
        if kind == "restore":
            self.probe.event("restore", urgent=True, status="ok", **data)
        elif kind == "snapshot":
            self.probe.event("snapshot", status="ok", **data)
        else:  # snapshot_failed, snapshot_skipped
            self.probe.event("snapshot", urgent=True, status=kind.removeprefix("snapshot_"), **data)

    def close(self) -> None:
        if self.snapshotter is not None:
            self.snapshotter.close()
