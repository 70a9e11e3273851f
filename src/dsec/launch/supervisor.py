"""Supervision of a launched job: place it, start it, heal or restart a failed worker group.

**Healing groups** (``heal: true``): when a rank dies, its peers keep their processes. The supervisor reports the
dead rank to the control plane at once (the survivors re-form their process group without it, docs/healing.md)
and starts a replacement for that rank only (a warm standby when there is one); the replacement is admitted at the
next point where the group's sequence of collectives starts over and receives the live state from a peer. Timed
as a ``recovery`` event with ``mode: heal``: ``detect_s``, ``reconfigure_s`` (report -> the survivors' new epoch),
``rejoin_s`` (replacement spawned -> admitted), ``total_s``. When the replacement is not admitted within
``restart.admit_timeout_s``, or no rank of the group is left alive, the group falls back to a restart.

**Restarts**: the whole group is killed and started again with ``DSEC_RESTORE=latest``; the ranks restore one step
every rank holds a verified snapshot of (probe/snapshots.py). The recovery is timed in phases and recorded as a
``recovery`` event:

- ``detect_s``: the dead process's last sign of life (previous poll) to the supervisor noticing the exit;
- ``stop_s``: killing the rest of the group;
- ``restart_s``: spawn to the restarted workers' restores beginning (interpreter, imports, process group, model);
- ``restore_s``: the slowest rank's restore (from its ``restore`` event);
- ``total_s``: exit noticed to training resumed (every rank restored), plus ``detect_s``.

A device the control plane marks *degraded* makes the supervisor move the workers placed on it: wait (bounded) for
the snapshot the control plane asked for, place the job again with every worker not on a degraded device pinned
where it runs (degraded devices are excluded for the others), and restart from the snapshot on the new devices —
the whole group, or in a ``restart_scope: worker`` group only the moved workers, each alone.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dsec.client import ClientError
from dsec.job_history import GroupHistory, history_path, write_history
from dsec.launch.base import Exit, Launcher, WorkerLaunch
from dsec.launch.foreseen import foreseen_failure
from dsec.launch.jobfile import JobFile
from dsec.launch.launches import free_port, place_job, worker_launches
from dsec.launch.recovery import Recovery, rank_rejoined

# Re-exported: callers import them from here (cli_launch.py, runner.py, the demo, tests, benchmarks).
__all__ = ["Recovery", "Supervisor", "free_port", "place_job"]

log = logging.getLogger(__name__)

MOVE = "degraded-device"  # the reason of a recovery that moves workers off a degraded device (not a failure)
#: How far back the room requests are read (their times are the control plane's clock; requests are deduplicated by id).
ROOM_LOOKBACK_S = 60.0
ROOM = "make-room"  # the reason of a recovery that moves an actor off a card a burst is about to fill (not a failure)


class Supervisor:
    def __init__(
        self,
        job: JobFile,
        launcher: Launcher,
        *,
        client: Any = None,  # dsec.client.Client with an admin token, or None (offline: local placement, no timing)
        endpoint: str | None = None,
        pool_token: str | None = None,
        poll_s: float = 0.05,
        device_check_s: float = 1.0,
        unmovable_retry_s: float = 30.0,  # (the simulator mirrors it: dsec.sim.dsec_devices.UNMOVABLE_RETRY_S)
        on_recovery: Callable[[Recovery], None] | None = None,
        heal_client: Any = None,  # for the healing routes, when ``client`` is None (a pool token suffices)
        assign_devices: bool = True,  # False: no device per worker (dsec run: CUDA_VISIBLE_DEVICES left alone)
    ) -> None:
        self.assign_devices = assign_devices
        self.job = job
        self.launcher = launcher
        self.client = client
        self.heal_client = heal_client if heal_client is not None else client
        self.endpoint = endpoint
        self.pool_token = pool_token
        self.poll_s = poll_s
        self.device_check_s = device_check_s
        self.unmovable_retry_s = unmovable_retry_s
        self.on_recovery = on_recovery
        self.placement: dict[str, Any] = {}
        self.restarts: dict[str, int] = {g.name: 0 for g in job.groups}
        self.done: set[str] = set()  # workers that finished with status 0
        self.failed: dict[str, str] = {}  # group -> why it was given up
        self.died_after_end: dict[str, int] = {}  # worker -> signal exit after it left its healing group cleanly
        self.recoveries: list[Recovery] = []
        self._pending: dict[str, Recovery] = {}  # group -> recovery waiting for its restores
        self._healing: dict[str, Recovery] = {}  # worker -> heal waiting for its replacement's admission
        # worker -> its restart alone, waiting for it to register (with the ids it had registered under before)
        self._restarting: dict[str, tuple[Recovery, set[str] | None]] = {}
        self.runs: dict[str, str] = {}  # healing group -> its current healing run
        self._live: dict[str, set[str]] = {}  # group -> workers started and not exited
        # group -> the degraded devices it could not be moved off, and when it tried (it tries again after
        # ``unmovable_retry_s``: another job ending frees devices)
        self._unmovable: dict[str, tuple[list[str], float]] = {}
        self._restarted: set[str] = set()  # groups restarted during the current step
        # Failure history per group, for ``snapshots.cadence: failure_history``: seconds trained by the group's
        # earlier incarnations, when the current one started, and the restarts that rolled it back to snapshots.
        self._trained_s: dict[str, float] = {g.name: 0.0 for g in job.groups}
        self._up_since: dict[str, float] = {}
        self.rollbacks: dict[str, int] = {g.name: 0 for g in job.groups}
        self._last_poll = time.time()
        self._last_device_check = 0.0
        # Room for bursts (dsec.quota.room): the requests already seen, and from when to read them.
        self._room_seen: set[int] = set()
        self._room_since = time.time() - ROOM_LOOKBACK_S

    # -- placement and start ----------------------------------------------------------------------------------
    def _place(self, pins: dict[str, str] | None = None) -> dict[str, Any]:
        return place_job(self.job, self.client, pins)

    def _spawn(self, launches: list[WorkerLaunch]) -> None:
        self.launcher.start(launches)
        for w in launches:
            self._live.setdefault(w.group, set()).add(w.worker)

    def _group(self, name: str) -> Any:
        return next(x for x in self.job.groups if x.name == name)

    def _new_run(self, group: str) -> None:
        if self._group(group).heal:
            self.runs[group] = f"{self.job.job}-{group}-{uuid.uuid4().hex[:10]}"

    def _launches(
        self, group: str, restore: bool, ranks: list[int] | None = None, replacement: bool = False
    ) -> list[WorkerLaunch]:
        return worker_launches(
            self.job,
            self.placement,
            self._group(group),
            restore=restore,
            ranks=ranks,
            replacement=replacement,
            runs=self.runs,
            endpoint=self.endpoint,
            pool_token=self.pool_token,
            assign_devices=self.assign_devices,
            history=self.history(group),
        )

    def history(self, group: str) -> tuple[float, int]:
        """``group``'s seconds trained so far (every incarnation) and the restarts that rolled it back."""
        up = self._up_since.get(group)
        return self._trained_s[group] + (time.time() - up if up is not None else 0.0), self.rollbacks[group]

    def _share_history(self) -> None:
        """Rewrite the job's history file (dsec.job_history) for the learners' cadence: each group's history as
        of now, and whether it trains on. A failed write costs only the sharpening of their prior (logged)."""
        snaps = self.job.snapshots
        if not snaps.enabled or snaps.cadence == "fixed":
            return
        now = time.time()
        groups = {}
        for g in self.job.groups:
            if g.role == "actor":  # restarts alone and keeps no snapshot: no learner's history
                continue
            exposure, rollbacks = self.history(g.name)
            groups[g.name] = GroupHistory(exposure, rollbacks, running=g.name in self._up_since)
        try:
            write_history(history_path(snaps.dir, self.job.job), groups, now)
        except OSError as exc:
            log.warning("job history not shared with the learners: %s", exc)

    def start(self, restore: bool = False) -> None:
        """Place the job and start every group (``restore``: from the newest snapshots, e.g. after a crash of the
        whole job)."""
        self.placement = self._place()
        now = time.time()
        for g in self.job.groups:
            self._up_since[g.name] = now
        self._share_history()  # before the first process starts: it reads the file at its first interval
        for g in self.job.groups:
            self._new_run(g.name)
            self._spawn(self._launches(g.name, restore=restore))
        self._last_poll = time.time()

    # -- supervision loop -----------------------------------------------------------------------------------------
    def step(self) -> None:
        """One supervision pass (never blocks beyond stopping a failed group)."""
        now = time.time()
        previous, self._last_poll = self._last_poll, now
        self._restarted = set()
        for e in self.launcher.poll():
            # Exits polled together come from the incarnation that ran before this poll: once one of them restarted
            # the group, the others (ranks that died with it) are not failures of the restarted group.
            if e.group not in self._restarted:
                self._on_exit(e, previous)
        if self._healing:
            self._check_healed()
        if self.client is not None:
            try:
                self._check_resumed()
                self._check_restarted_workers()
                if now - self._last_device_check >= self.device_check_s:
                    self._last_device_check = now
                    self._check_devices()
                    self._check_room()
            except ClientError as exc:
                # The control plane restarting must not take the supervisor (and its job) down: try again later.
                log.warning("supervisor: control plane request failed (%s); retrying", exc)

    def finished(self) -> bool:
        groups = {g.name for g in self.job.groups}
        live = groups - set(self.failed)
        total = {g.name: g.world_size for g in self.job.groups}
        return (
            all(sum(1 for w in self.done if w.rsplit("-", 1)[0] == g) >= total[g] for g in live)
            and not self._pending
            and not self._healing
            and not self._restarting
        )

    def run(self, timeout_s: float | None = None) -> bool:
        """Supervise until every group finished (True) or gave up / ``timeout_s`` passed (False)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not self.finished():
            if deadline is not None and time.monotonic() > deadline:
                return False
            self.step()
            time.sleep(self.poll_s)
        return not self.failed

    def stop(self) -> None:
        self.launcher.stop()

    def _on_exit(self, e: Exit, previous: float) -> None:
        if e.code == 0:
            self.done.add(e.worker)
            self._live.get(e.group, set()).discard(e.worker)
            return
        if e.group in self.failed or e.group in self._pending:
            return
        detect_s = max(0.0, e.at - previous)
        self._live.get(e.group, set()).discard(e.worker)
        if e.code is not None and e.code < 0 and self._left_cleanly(e):
            # Its script had ended (it left the group at destroy_process_group or a clean interpreter exit) and the
            # process died by a signal in teardown (e.g. a native destructor at interpreter shutdown): its training
            # is complete, nothing is healed and nothing restarted (a restart from snapshots would redo finished work).
            log.warning("%s died by signal %d after it left its healing group cleanly: counted finished",
                        e.worker, -e.code)  # fmt: skip
            self.died_after_end[e.worker] = e.code
            self.done.add(e.worker)
            return
        if self._group(e.group).scope == "worker" and self.launcher.starts_single_workers:
            self._restart_worker(e, detect_s)
            return
        waiting = {w for w, r in self._healing.items() if r.group == e.group}
        members = self._live.get(e.group, set()) - waiting - {e.worker}
        # Healing needs a live member to carry the state: with none left (every rank died, or the ranks stopped
        # together) the group restarts from its agreed snapshots instead.
        if e.group in self.runs and members and self._heal(e, detect_s):
            return
        self._restart(e.group, e.worker, e.code, "exit", e.at, detect_s)

    # -- healing ----------------------------------------------------------------------------------------------
    def _heal_request(self, group: str, method: str, path: str, body: Any = None) -> Any:
        assert self.heal_client is not None
        return self.heal_client.request(method, f"/v1/heal/{self.runs[group]}{path}", json=body)

    def _left_cleanly(self, e: Exit) -> bool:
        """Whether the exited rank had left its healing group cleanly (the control plane's view says so)."""
        if e.group not in self.runs or self.heal_client is None:
            return False
        try:
            state = self._heal_request(e.group, "GET", "")
        except Exception as exc:
            log.warning("group %s: cannot read the healing group (%s); treating %s's exit as a failure",
                        e.group, exc, e.worker)  # fmt: skip
            return False
        return int(e.worker.rsplit("-", 1)[1]) in (state.get("left") or [])

    def _heal(self, e: Exit, detect_s: float, reason: str = "exit") -> bool:
        """Replace the dead (or moved) rank in place, at its placed device (its peers keep training). False: the
        group must restart instead."""
        if self.heal_client is None:
            return False
        if not self.launcher.starts_single_workers:  # (the Ray launcher starts a group whole)
            log.warning("group %s: the %s launcher cannot start one rank of a running group; restarting the group",
                        e.group, self.launcher.name)  # fmt: skip
            return False
        rank = int(e.worker.rsplit("-", 1)[1])
        rec = Recovery(e.group, e.worker, e.code, reason, e.at, detect_s, mode="heal", run=self.runs[e.group])
        why = f"{e.worker} exited with {e.code}" if reason == "exit" else f"{e.worker} stopped ({reason})"
        rec.report = {"dead_rank": rank, "dead_pid": e.pid, "reason": why}
        view = self._report(rec)
        if view is not None and not view.get("epoch"):
            return False  # died before the group's first epoch formed: nothing to heal yet
        rec.stopped_at = time.time()
        if self._spent(e.group, e.worker, e.code, reason):
            return True
        self.done.discard(e.worker)
        launches = self._launches(e.group, restore=False, ranks=[rank], replacement=True)
        self._spawn_for(rec, launches)
        self._healing[e.worker] = rec
        return True

    def _report(self, rec: Recovery) -> dict[str, Any] | None:
        """Tell the control plane which rank died (the survivors then re-form without waiting for it). While it is
        unreachable the report is retried; the survivors' own failed collectives break the epoch meanwhile."""
        try:
            out = self._heal_request(rec.group, "POST", "/fail", rec.report)
        except Exception as exc:
            log.warning("group %s: cannot report %s's death yet (%s)", rec.group, rec.worker, exc)
            return None
        rec.report = None
        return dict(out.get("view") or {})

    def _finished_without(self, rec: Recovery) -> bool:
        """Every rank of the group but the waiting replacement(s) finished cleanly: the job is done; a replacement
        has nothing left to join."""
        waiting = {w for w, r in self._healing.items() if r.group == rec.group}
        others = {f"{rec.group}-{r}" for r in range(self._group(rec.group).world_size)} - waiting
        return bool(others) and others <= self.done

    def _check_healed(self) -> None:
        for worker, rec in list(self._healing.items()):
            if self._finished_without(rec):
                log.info("group %s finished while %s's replacement waited: stopping it", rec.group, worker)
                self.launcher.stop_group(rec.group)
                self._live.pop(rec.group, None)
                del self._healing[worker]
                self.done.add(worker)
                continue
            rank = int(worker.rsplit("-", 1)[1])
            if rec.report is not None:
                self._report(rec)
            try:
                state = self._heal_request(rec.group, "GET", "")
            except Exception:
                continue
            if rank_rejoined(rec, rank, state):
                rec.resumed_at = float(state.get("formed_at") or time.time())
                rec.epoch = int(state.get("epoch") or 0)
                del self._healing[worker]
                self._complete(rec)
            elif time.time() - rec.spawned_at > self.job.restart.admit_timeout_s:
                del self._healing[worker]
                log.warning("group %s: %s not admitted within %.0f s; restarting the group from its snapshots",
                            rec.group, worker, self.job.restart.admit_timeout_s)  # fmt: skip
                self._restart(rec.group, worker, None, "heal-timeout", time.time(), 0.0)

    def _restart(
        self, group: str, worker: str, code: int | None, reason: str, detected_at: float, detect_s: float
    ) -> None:
        rec = Recovery(group, worker, code, reason, detected_at, detect_s)
        # Said in the log: a whole-group restart rolls every rank back to its snapshots (one that happened silently
        # after a heal was hard to explain from a test's output).
        log.warning("group %s restarts from its snapshots: %s (%s, code %s)", group, reason, worker, code)
        self._restarted.add(group)
        self.launcher.stop_group(group)
        self._live.pop(group, None)
        rec.stopped_at = time.time()
        self._trained_s[group], self._up_since[group] = self.history(group)[0], rec.stopped_at
        # A move off a degraded device restores the snapshot taken for it; a burst's OOM or a drain, the snapshot taken
        # ahead of it (launch/foreseen.py): none argues for snapshotting more often.
        if reason != MOVE and not self._foreseen(group, detected_at):
            self.rollbacks[group] += 1
        if self._spent(group, worker, code, reason):
            self._up_since.pop(group, None)
            self._share_history()
            return
        self._share_history()
        self.done = {w for w in self.done if not w.startswith(f"{group}-")}
        for w in [w for w, r in self._healing.items() if r.group == group]:
            del self._healing[w]
        self._new_run(group)  # a fresh healing run: the restarted ranks form a new group
        launches = self._launches(group, restore=True)
        self._spawn_for(rec, launches)
        if self.client is None:
            self._complete(rec)
        else:
            self._pending[group] = rec

    def _foreseen(self, group: str, failed_at: float, rank: int | None = None) -> bool:
        snaps = self.job.snapshots
        if not snaps.enabled or snaps.cadence == "fixed":
            return False
        if foreseen_failure(Path(snaps.dir), group, failed_at, rank=rank):
            log.info("group %s stopped right after a snapshot taken ahead of it (a memory burst or a drain): not "
                     "counted as a rollback", group)  # fmt: skip
            return True
        return False

    def _spent(self, group: str, worker: str, code: int | None, reason: str) -> bool:
        """Give ``group`` up when it has used its restarts (heals count); else count this one. A move off a
        degraded device is not a failure of the job and is not counted: a group that had used its restarts was
        given up — stopped for good — when the control plane moved it off a device."""
        if reason in (MOVE, ROOM):
            return False
        if self.restarts[group] >= self.job.restart.max_restarts:
            self.failed[group] = f"{worker} exited with {code}; {self.restarts[group]} restarts already"
            log.error("group %s given up: %s", group, self.failed[group])
            return True
        self.restarts[group] += 1
        return False

    def _spawn_for(self, rec: Recovery, launches: list[WorkerLaunch]) -> None:
        rec.devices = {w.worker: str(w.device) for w in launches}
        self._spawn(launches)
        rec.spawned_at = time.time()

    def _restart_worker(self, e: Exit, detect_s: float, reason: str = "exit") -> None:
        """``restart_scope: worker``: start the dead (or moved) process again, from its own newest snapshot, at its
        placed device; its peers keep running (nothing of theirs is stopped or rolled back)."""
        if e.worker in self._restarting:  # its last restart died before it registered: recorded unresumed
            self._complete(self._restarting.pop(e.worker)[0])
        rec = Recovery(e.group, e.worker, e.code, reason, e.at, detect_s, mode="worker")
        rec.stopped_at = time.time()  # nothing to stop (a moved worker was stopped just before)
        log.warning("group %s: %s %s; restarting it alone", e.group, e.worker,
                    f"exited with {e.code}" if reason == "exit" else f"restarts ({reason})")  # fmt: skip
        if self._spent(e.group, e.worker, e.code, reason):
            return
        self.done.discard(e.worker)
        rank = int(e.worker.rsplit("-", 1)[1])
        # A learner restarted alone resumes from its own newest snapshot: a rollback for its group's cadence, unless
        # it moved (its snapshot was taken for the move) or the probe foresaw the stop. Actors keep no snapshot.
        if reason != MOVE and self._group(e.group).role != "actor" and not self._foreseen(e.group, e.at, rank):
            self.rollbacks[e.group] += 1
            self._share_history()
        # The registrations this worker had so far: the restarted process is the one that is not among them (a
        # registration time would need the supervisor's and the control plane's clocks to agree).
        known: set[str] | None = None
        if self.client is not None:
            try:
                known = {str(w["id"]) for w in self._registrations(e.group, rank)}
            except ClientError as exc:  # unreachable now: then by registration time, after the spawn
                log.warning("group %s: cannot read %s's registrations (%s)", e.group, e.worker, exc)
        launches = self._launches(e.group, restore=True, ranks=[rank])
        self._spawn_for(rec, launches)
        if self.client is None:
            self._complete(rec)
        else:
            self._restarting[e.worker] = (rec, known)

    def _registrations(
        self, group: str, rank: int, workers: list[dict[str, Any]] | None = None
    ) -> list[dict[str, Any]]:
        """The control plane's worker records of ``group``'s ``rank`` (from ``workers``, or asked for now)."""
        if workers is None:
            workers = self.client.workers(pool=self.job.pool)
        return [w for w in workers if w.get("group") == group and w.get("rank") == rank]

    def _check_restarted_workers(self) -> None:
        """A restarted worker has resumed once its new process registered with the control plane (its restore, if
        it had a snapshot to restore, is its ``restore`` event's)."""
        if not self._restarting:
            return
        workers = self.client.workers(pool=self.job.pool)  # one request per pass, whatever number waits
        for name, (rec, known) in list(self._restarting.items()):
            new = [
                w
                for w in self._registrations(rec.group, int(name.rsplit("-", 1)[1]), workers)
                if (str(w["id"]) not in known if known is not None else float(w["registered_at"]) >= rec.spawned_at)
            ]
            if new:
                rec.resumed_at = min(float(w["registered_at"]) for w in new)
                del self._restarting[name]
                self._complete(rec)
            elif time.time() - rec.spawned_at > self.job.restart.resume_timeout_s:
                log.warning("group %s: %s's restart not registered within %.0f s", rec.group, name,
                            self.job.restart.resume_timeout_s)  # fmt: skip
                del self._restarting[name]
                self._complete(rec)

    def _check_resumed(self) -> None:
        for group, rec in list(self._pending.items()):
            g = next(x for x in self.job.groups if x.name == group)
            events = self.client.all_events(types=["restore"], pool=self.job.pool, since=rec.spawned_at - 1.0)
            workers = {w["id"]: w for w in self.client.workers(pool=self.job.pool)}
            mine = [e for e in events if workers.get(e["worker_id"] or "", {}).get("group") == group]
            if len({e["worker_id"] for e in mine}) >= g.world_size:
                rec.resumed_at = max(float(e["ts"]) for e in mine)
                rec.restore_s = max(float(e["data"].get("restore_s") or 0.0) for e in mine)
                rec.restored = sorted(str(e["data"].get("id") or e["data"].get("status")) for e in mine)
                self._complete(rec)
            elif time.time() - rec.spawned_at > self.job.restart.resume_timeout_s:
                log.warning(
                    "group %s: restores not all reported within %.0f s", group, self.job.restart.resume_timeout_s
                )
                self._complete(rec)

    def _complete(self, rec: Recovery) -> None:
        self._pending.pop(rec.group, None)
        self.recoveries.append(rec)
        if self.client is not None:
            self.client.record_event("recovery", {"job": self.job.job, **rec.timings()}, pool=self.job.pool)
        if self.on_recovery is not None:
            self.on_recovery(rec)

    # -- degraded devices -----------------------------------------------------------------------------------------
    def _check_devices(self) -> None:
        health = {d["id"]: d["health"] for d in self.client.devices()}
        mine = {a["worker"]: a["device"] for a in self.placement.get("assignments", [])}
        for g in self.job.groups:
            if (
                g.name in self._pending
                or g.name in self.failed
                or any(r.group == g.name for r in self._healing.values())
            ):
                continue
            bad = sorted({d for w, d in mine.items() if w.startswith(f"{g.name}-") and health.get(d) == "degraded"})
            tried = self._unmovable.get(g.name)
            if bad and (tried is None or tried[0] != bad or time.time() - tried[1] >= self.unmovable_retry_s):
                self._migrate(g.name, bad)

    # -- room for a burst ----------------------------------------------------------------------------------------
    def _check_room(self) -> None:
        """Room for a burst (dsec.quota.room): the control plane asks for an actor to move off a card that a burst is
        about to fill (a ``room`` event naming the actor's device; the card takes no new worker
        while the burst lasts). An actor of this job on that device, in a ``restart_scope: worker`` group, moves
        alone (:meth:`_make_room`). A group restarted whole is left where it is: stopping every worker of it costs
        more than the OOM the move may avoid."""
        events = self.client.all_events(types=["room"], pool=self.job.pool, since=self._room_since)
        on = {a["device"]: a["worker"] for a in self.placement.get("assignments", [])}
        for ev in events:
            self._room_since = max(self._room_since, float(ev["ts"]) - ROOM_LOOKBACK_S)
            data = ev.get("data") or {}
            if ev["id"] in self._room_seen:
                continue
            self._room_seen.add(ev["id"])
            worker = on.get(str(data.get("device")))
            if worker is None:
                continue
            group = worker.rsplit("-", 1)[0]
            g = self._group(group)
            busy = group in self._pending or group in self.failed or worker in self._restarting
            single = self.launcher.starts_single_workers and getattr(self.launcher, "stop_workers", None) is not None
            if g.role != "actor" or g.scope != "worker" or not single or busy or g.name in self.runs:
                log.info("group %s: %s is asked to make room on card %s; it stays (%s)", group, worker,
                         data.get("card"), "busy" if busy else "its group restarts whole")  # fmt: skip
                continue
            self._make_room(group, worker, str(data.get("card")))

    def _make_room(self, group: str, worker: str, card: str) -> None:
        """Move ``worker`` (an actor of a ``restart_scope: worker`` group) alone off its card: place the job again
        with every other worker pinned where it runs, then stop it and start it at its new device. Nowhere to go: it
        stays (the burst may still fit; if not, the allocation fails as it would have)."""
        current = {a["worker"]: a["device"] for a in self.placement.get("assignments", [])}
        try:
            placement = self._place({w: d for w, d in current.items() if w != worker})
        except RuntimeError as exc:
            log.warning("group %s: no room elsewhere for %s, it stays on card %s: %s", group, worker, card, exc)
            return
        self.placement = placement
        log.info("group %s: %s moves off card %s to make room for a burst", group, worker, card)
        self._move_alone(group, [worker], ROOM)

    def _migrate(self, group: str, bad: list[str]) -> None:
        """Move a group's workers off degraded devices: place the job again with every worker not on a degraded
        device pinned where it runs (the job's other groups keep running, and the placement on record must say
        where), then move only the workers on those devices when the group allows it — a ``restart_scope: worker``
        group restarts each alone from its own snapshot, a healing group heals each in place (a replacement on the
        new device takes the live state from a peer that stays: nothing rolls back) — or else restart the whole
        group from the snapshot the control plane requested (waited for, bounded)."""
        current = {a["worker"]: a["device"] for a in self.placement.get("assignments", [])}
        try:
            placement = self._place({w: d for w, d in current.items() if d not in bad})
        except RuntimeError as exc:
            # Nowhere to go (no spare healthy device): the group keeps running where it is rather than stopping.
            if group not in self._unmovable:
                log.warning("group %s stays on degraded %s: %s", group, ", ".join(bad), exc)
            self._unmovable[group] = (bad, time.time())
            return
        moved = sorted(w for w, d in current.items() if w.startswith(f"{group}-") and d in bad)
        live = self._live.get(group, set())
        stop_workers = getattr(self.launcher, "stop_workers", None)
        single = self.launcher.starts_single_workers and stop_workers is not None
        # Healing needs a member that stays to hand the state over; without one the group restarts.
        healing = single and group in self.runs and bool(live - set(moved))
        alone = single and (healing or self._group(group).scope == "worker")
        t0 = time.time()
        # A replacement in a healing group takes the live state: no snapshot to wait for (nor with snapshots off).
        deadline = t0 + (10.0 if self.job.snapshots.enabled and not healing else 0.0)
        while time.time() < deadline:
            snaps = self.client.all_events(types=["snapshot"], pool=self.job.pool, since=t0 - 30.0)
            if any(any(str(r).startswith("degraded-") for r in e["data"].get("requests", [])) for e in snaps):
                break
            time.sleep(0.1)
        self.placement = placement
        self._unmovable.pop(group, None)
        log.info("group %s moves off degraded %s", group, ", ".join(bad))
        if not alone or stop_workers is None:
            self._restart(group, f"{group}-*", None, MOVE, time.time(), 0.0)
            return
        self._move_alone(group, moved, MOVE, healing)

    def _move_alone(self, group: str, moved: list[str], reason: str, healing: bool = False) -> None:
        """Stop ``moved`` (workers of ``group`` that the placement now in force puts on new devices) and start each
        again there alone (``restart_scope: worker``), or heal each in place (a healing group; if a heal cannot
        start, the group restarts). The launcher starts single workers (``stop_workers``)."""
        live = self._live.get(group, set())
        pids: dict[str, int] = getattr(self.launcher, "pids", lambda _g: {})(group)
        self.launcher.stop_workers(moved)  # type: ignore[attr-defined]
        for w in moved:
            live.discard(w)
            gone = Exit(w, group, None, time.time(), pids.get(w))
            if not healing:
                self._restart_worker(gone, 0.0, reason)
            elif not self._heal(gone, 0.0, reason):
                self._restart(group, w, None, reason, time.time(), 0.0)
                return
