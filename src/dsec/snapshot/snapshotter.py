"""The snapshotter: capture on the training thread, everything else on a background thread.

What the training thread pays for (DataStates-style overlap): in :meth:`Snapshotter.take`, the RNG states, user
state, small tensors and every tensor that is *not* a parameter of a registered optimizer are copied at once; the
large parameters and optimizer-state tensors are only referenced. Those change only inside ``optimizer.step()``, so
the snapshot thread reads them while forward and backward run, and a step pre-hook on each registered optimizer
waits for that read to finish before the step may change them. Blocking time = the ``take()`` call + that wait.
Encoding, delta, compression and the durable write run after the read, off the training thread.

At most one snapshot is in flight per snapshotter; requests made meanwhile coalesce into one follow-up snapshot,
started by the next :meth:`poll` or :meth:`take` after the current one is published (the probe polls at every
optimizer step). Nothing here sleeps on the training thread except that step gate.

What is copied at ``take()``: capture.py; the write path: writer.py; the restore side: restorer.py.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import zstandard

from dsec.snapshot import codec, restorer, writer
from dsec.snapshot.capture import capture, unwrap
from dsec.snapshot.jobs import RestoreReport, Ticket, _Item, _Job
from dsec.snapshot.reader import Fallback, Loaded, load, load_latest
from dsec.snapshot.restorer import replay_metadata
from dsec.snapshot.retention import collect_garbage
from dsec.snapshot.store import SnapshotStore, check_worker

log = logging.getLogger(__name__)

EventSink = Callable[[str, dict[str, Any]], None]

# Re-exported: callers import them from here (dsec.snapshot, writer.py).
__all__ = ["EventSink", "RestoreReport", "Snapshotter", "Ticket", "_Item", "_Job", "replay_metadata"]


class Snapshotter:
    def __init__(
        self,
        store: SnapshotStore,
        worker: str,
        *,
        level: int = codec.DEFAULT_LEVEL,
        optimizer: str | None = None,
        base_every: int = 8,
        keep_chains: int = 2,
        zstd_level: int = 1,
        gc_grace_s: float = 600.0,
        on_event: EventSink | None = None,
    ) -> None:
        if base_every < 1:
            raise ValueError(f"base_every={base_every} is invalid: expected >= 1")
        if keep_chains < 1:
            raise ValueError(f"keep_chains={keep_chains} is invalid: expected >= 1")
        self.store = store
        self.worker = check_worker(worker)
        self.mode = codec.mode_for(level, optimizer)
        self._optimizer_policy = optimizer
        self.base_every = base_every
        self.keep_chains = keep_chains
        self.gc_grace_s = gc_grace_s
        self._zstd_level = zstd_level
        self._on_event = on_event
        self._modules: dict[str, Any] = {}
        self._optimizers: dict[str, Any] = {}
        self._states: dict[str, tuple[Callable[[], Any], Callable[[Any], None]]] = {}
        self._hooks: list[Any] = []
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._job: _Job | None = None
        self._followup: Ticket | None = None
        self._closed = False
        existing = store.manifests(self.worker)
        self._next_seq = (existing[-1] + 1) if existing else 1
        # The last published snapshot's encoded bytes and entries: the reference for the next delta.
        self._last_seq: int | None = None
        self._last_base: int | None = None
        self._last_encoded: dict[str, np.ndarray] = {}
        self._last_entries: dict[str, dict[str, Any]] = {}
        self._last_meta: dict[str, Any] = {}
        self._since_base = 0
        self._force_base = False
        self._last_take = time.monotonic()  # the first periodic snapshot comes one interval after start
        self.published: list[dict[str, Any]] = []  # summaries of this process's snapshots, oldest first
        self.restored: Loaded | None = None  # the snapshot restore_latest() applied (for catch_up)
        self._thread = threading.Thread(target=self._run, name="dsec-snapshot", daemon=True)
        self._thread.start()

    # -- registration -------------------------------------------------------------------------------------
    def register(self, name: str, obj: Any) -> None:
        """Register an ``nn.Module`` (DDP unwrapped) or an optimizer under ``name``."""
        if "/" in name or not name:
            raise ValueError(f"name {name!r} is invalid: it must be non-empty and contain no '/'")
        if name in self._modules or name in self._optimizers or name in self._states:
            raise ValueError(f"name {name!r} is already registered")
        if hasattr(obj, "param_groups") and hasattr(obj, "state_dict"):
            self._optimizers[name] = obj
            # The gate: a step may not change tensors the snapshot thread is still reading.
            self._hooks.append(obj.register_step_pre_hook(lambda *_: self._before_step()))
        elif hasattr(obj, "named_parameters") and hasattr(obj, "named_buffers"):
            self._modules[name] = unwrap(obj)
        else:
            raise TypeError(
                f"cannot snapshot {type(obj).__name__}: register a module, an optimizer, or use "
                "register_state(name, get, set)"
            )

    def register_state(self, name: str, get: Callable[[], Any], set: Callable[[Any], None]) -> None:
        """JSON state captured at ``take()`` and handed back to ``set`` on restore: environment seeds, the
        observation-buffer head pointer, replay-buffer metadata (see :func:`replay_metadata`)."""
        if "/" in name or not name or name in self._states:
            raise ValueError(f"state name {name!r} is invalid or already registered")
        self._states[name] = (get, set)

    def set_level(self, level: int) -> None:
        """Change the compression level (a directive may raise it); the next snapshot starts a new chain."""
        mode = codec.mode_for(level, self._optimizer_policy)
        with self._lock:
            if mode != self.mode:
                self.mode = mode
                self._force_base = True

    # -- taking ---------------------------------------------------------------------------------------------
    def take(
        self, step: int | None = None, request: str | None = None, *, wait: bool = False, requests: tuple[str, ...] = ()
    ) -> Ticket:
        """Snapshot now (or, when one is in flight, as soon as it is published). Returns its ticket."""
        t0 = time.perf_counter()
        asked = [r for r in (request, *requests) if r]
        with self._lock:
            if self._closed:
                raise RuntimeError("snapshotter is closed")
            if self._job is not None:
                if self._followup is None:
                    self._followup = Ticket()
                self._followup.requests.extend(asked)
                return self._followup
            ticket = self._followup or Ticket()
            self._followup = None
            ticket.requests.extend(asked)
            job = self._capture(step, ticket)
            self._job = job
            self._last_take = time.monotonic()
            self._wake.notify_all()
        if wait or not self._optimizers:
            # Nothing gates the tensors the thread reads: wait until they are read (consistent, but blocking).
            job.staged.wait()
        ticket.blocking_s += time.perf_counter() - t0
        if wait:
            ticket.wait()
        return ticket

    def poll(self, step: int | None = None, interval_s: float | None = None, request: str | None = None) -> None:
        """Called from the training loop (the probe calls it after every optimizer step): takes the coalesced
        follow-up, a new request, or the periodic snapshot when ``interval_s`` has passed."""
        with self._lock:
            if self._job is not None:
                if request and self._followup is None:
                    self._followup = Ticket(requests=[request])
                elif request and self._followup is not None and request not in self._followup.requests:
                    self._followup.requests.append(request)
                return
            due = self._followup is not None or request is not None
            if not due and interval_s is not None:
                due = time.monotonic() - self._last_take >= interval_s
        if due:
            self.take(step, request)

    def busy(self) -> bool:
        """A snapshot is being written, or one is queued behind it."""
        with self._lock:
            return self._job is not None or self._followup is not None

    def due(self, interval_s: float | None) -> bool:
        """The periodic snapshot is due (``interval_s`` since the last one was taken)."""
        return interval_s is not None and time.monotonic() - self._last_take >= interval_s

    def wait_idle(self, timeout: float | None = None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            while self._job is not None:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._wake.wait(left)
        return True

    def _before_step(self) -> None:
        job = self._job
        if job is not None and not job.staged.is_set():
            t0 = time.perf_counter()
            job.staged.wait()
            job.ticket.blocking_s += time.perf_counter() - t0

    # -- capture (training thread) ------------------------------------------------------------------------
    def _capture(self, step: int | None, ticket: Ticket) -> _Job:
        """The job of a snapshot taken now (what is copied and what only referenced: capture.py)."""
        base = self._last_seq is None or self._force_base or self._since_base + 1 >= self.base_every
        self._force_base = False
        kind = "base" if base else "delta"
        mode = self.mode
        items, meta, carried = capture(
            self._modules,
            self._optimizers,
            self._states,
            mode,
            base,
            self._last_entries,
            self._last_meta,
            self._last_base,
        )
        seq = self._next_seq
        self._next_seq += 1
        base_seq = seq if base else self._last_base
        assert base_seq is not None
        return _Job(seq, kind, None if base else self._last_seq, base_seq, step, mode, meta, items, carried, ticket)

    # -- background thread ----------------------------------------------------------------------------------
    def _run(self) -> None:
        cctx = zstandard.ZstdCompressor(level=self._zstd_level)
        while True:
            with self._lock:
                while self._job is None and not self._closed:
                    self._wake.wait()
                job = self._job
                if job is None:
                    return
            try:
                self._write(job, cctx)
            except Exception as exc:  # a failed snapshot must never take training down
                log.exception("dsec: snapshot %s/%d failed", self.worker, job.seq)
                job.staged.set()
                job.ticket.error = f"{type(exc).__name__}: {exc}"
                self._emit("snapshot_failed", {"id": f"{self.worker}/{job.seq}", "error": job.ticket.error})
            finally:
                with self._lock:
                    self._job = None
                    self._wake.notify_all()
                job.ticket.done.set()

    def _write(self, job: _Job, cctx: zstandard.ZstdCompressor) -> None:
        """Stage, encode and store the job's tensors, publish its manifest, then make it the next delta's reference
        (writer.py)."""
        staged, stage_s = writer.stage(job)
        out = writer.encode(job, staged, self._last_encoded, self._last_entries, self.store, cctx)
        stats = writer.stats(job, out, stage_s)
        body = writer.manifest_body(self.worker, job, out.entries, stats)
        writer.publish(self.store, self.worker, job, body, self._take_seq)
        self._published(job, out, stats)

    def _take_seq(self) -> int:
        seq = self._next_seq
        self._next_seq += 1
        return seq

    def _published(self, job: _Job, out: writer.Encoded, stats: dict[str, Any]) -> None:
        with self._lock:
            self._last_seq = job.seq
            self._last_base = job.base
            self._last_encoded = out.encoded
            self._last_entries = out.entries
            self._last_meta = job.meta
            self._since_base = 0 if job.kind == "base" else self._since_base + 1
        job.ticket.seq = job.seq
        job.ticket.stats = {**stats, "total_ms": round((time.perf_counter() - job.started) * 1e3, 3)}
        info = {
            "id": f"{self.worker}/{job.seq}",
            "kind": job.kind,
            "step": job.step,
            "mode": job.mode.name,
            "bytes": out.stored_bytes,
            **job.ticket.stats,
        }
        if job.ticket.requests:
            info["requests"] = job.ticket.requests
        self.published.append(info)
        self._emit("snapshot", info)
        if job.kind == "base":
            collect_garbage(self.store, self.worker, keep_chains=self.keep_chains, grace_s=self.gc_grace_s)

    def _emit(self, kind: str, data: dict[str, Any]) -> None:
        if self._on_event is not None:
            try:
                self._on_event(kind, data)
            except Exception:
                log.exception("dsec: snapshot event sink failed")

    # -- restore ----------------------------------------------------------------------------------------------
    def restore_latest(self, at_most: int | None = None) -> RestoreReport | None:
        """Load the newest snapshot that verifies into the registered objects (None when there is none).

        Damaged snapshots are skipped, each reported as a ``snapshot_skipped`` event. Call it before training
        resumes: it writes into parameters and optimizer state in place."""
        t0 = time.perf_counter()
        fallback = Fallback()
        loaded = load_latest(self.store, self.worker, at_most, fallback)
        for seq, reason in fallback.skipped:
            self._emit("snapshot_skipped", {"id": f"{self.worker}/{seq}", "reason": reason})
        if loaded is None:
            return None
        return self.restore(loaded, fallback.skipped, t0)

    def manifest_steps(self) -> list[tuple[int, int]]:
        """(seq, step) of this worker's snapshots that record a step, newest first. Reads the manifests only:
        whether the snapshot verifies is only known once it is :meth:`load`-ed."""
        return restorer.manifest_steps(self.store, self.worker)

    def load(self, seq: int) -> Loaded:
        """Snapshot ``seq`` of this worker, rebuilt and verified (raises CorruptSnapshot); nothing is applied."""
        return load(self.store, self.worker, seq)

    def restore(
        self,
        loaded: Loaded,
        skipped: list[tuple[int, str]] | None = None,
        t0: float | None = None,
        note: dict[str, Any] | None = None,
    ) -> RestoreReport:
        """Apply a loaded snapshot to the registered objects and report it (a ``restore`` event, with ``note``'s
        fields added)."""
        t0 = time.perf_counter() - loaded.read_s if t0 is None else t0
        self.apply(loaded)
        self.restored = loaded
        report = RestoreReport(
            loaded.seq,
            loaded.manifest.get("step"),
            time.perf_counter() - t0,
            bool(loaded.manifest["mode"].get("lossless")),
            list(skipped or []),
        )
        self._emit("restore", {**report.as_event(self.worker), **(note or {})})
        return report

    def apply(self, loaded: Loaded) -> None:
        """Write a loaded snapshot into the registered modules, optimizers, user state and RNGs (restorer.py)."""
        restorer.apply(loaded, self._modules, self._optimizers, self._states)

    def catch_up(self, oname: str) -> None:
        """Load the restored snapshot's state into optimizer ``oname``, registered after the restore (a script
        that builds its optimizers one by one); its parameters too, when no registered module holds them."""
        restorer.catch_up(self.restored, oname, self._optimizers[oname], self._modules)

    def list(self) -> list[dict[str, Any]]:
        from dsec.snapshot.retention import listing

        return listing(self.store, self.worker)

    # -- lifecycle ----------------------------------------------------------------------------------------------
    def close(self, timeout: float = 60.0) -> None:
        """Finish the snapshot in flight and a coalesced follow-up (if any), stop the thread, remove the hooks.

        Call it from the training thread (it may capture the follow-up)."""
        self.wait_idle(timeout)
        if self._followup is not None and not self._closed:
            self.take(wait=True)
        self.wait_idle(timeout)
        with self._lock:
            self._closed = True
            self._wake.notify_all()
        self._thread.join(timeout)
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()

    def __enter__(self) -> Snapshotter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
