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
"""

from __future__ import annotations

import logging
import random
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import zstandard

from dsec.jsonsafe import json_safe as _json_safe
from dsec.snapshot import codec, writer
from dsec.snapshot.manifest import CorruptSnapshot
from dsec.snapshot.reader import Fallback, Loaded, load, load_latest, read_manifest
from dsec.snapshot.retention import collect_garbage
from dsec.snapshot.store import SnapshotStore, check_worker

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

SYNC_COPY_NUMEL = 65_536  # tensors smaller than this are copied in take(): cheaper than coordinating
EventSink = Callable[[str, dict[str, Any]], None]


@dataclass
class Ticket:
    """A snapshot request. ``done`` is set when it is published (``seq``) or failed (``error``)."""

    requests: list[str] = field(default_factory=list)
    done: threading.Event = field(default_factory=threading.Event)
    seq: int | None = None
    error: str | None = None
    stats: dict[str, Any] = field(default_factory=dict)
    blocking_s: float = 0.0  # take() + waits at the step gate; final once the next optimizer step has begun

    def wait(self, timeout: float | None = None) -> bool:
        return self.done.wait(timeout)


@dataclass
class RestoreReport:
    seq: int
    step: int | None
    restore_s: float
    lossless: bool
    skipped: list[tuple[int, str]]

    def as_event(self, worker: str) -> dict[str, Any]:
        return {
            "id": f"{worker}/{self.seq}",
            "step": self.step,
            "restore_s": round(self.restore_s, 4),
            "lossless": self.lossless,
            "skipped": [{"id": f"{worker}/{s}", "reason": r} for s, r in self.skipped],
        }


@dataclass
class _Item:
    name: str
    tensor: torch.Tensor
    bits: int
    sqrt: bool
    lazy: bool


@dataclass
class _Job:
    seq: int
    kind: str
    parent: int | None
    base: int
    step: int | None
    mode: codec.Mode  # as captured: a level change while this one is written applies to the next
    meta: dict[str, Any]
    items: list[_Item]
    carried: dict[str, dict[str, Any]]
    ticket: Ticket
    staged: threading.Event = field(default_factory=threading.Event)
    started: float = field(default_factory=time.perf_counter)


def _unwrap(module: Any) -> Any:
    """DDP / DataParallel wrap the user's module in ``.module``; snapshot the inner one so names are stable."""
    inner = getattr(module, "module", None)
    return (
        inner if inner is not None and type(module).__name__ in ("DistributedDataParallel", "DataParallel") else module
    )


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
            self._modules[name] = _unwrap(obj)
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
        import torch

        base = self._last_seq is None or self._force_base or self._since_base + 1 >= self.base_every
        self._force_base = False
        kind = "base" if base else "delta"
        mode = self.mode
        items: list[_Item] = []
        gated = self._gated()
        seen: dict[int, str] = {}

        def add(name: str, t: torch.Tensor, bits: int, sqrt: bool = False) -> None:
            lazy = id(t) in gated and t.numel() >= SYNC_COPY_NUMEL
            items.append(_Item(name, t if lazy else t.detach().clone(), bits, sqrt, lazy))

        for mname, mod in self._modules.items():
            for pname, p in mod.named_parameters():
                seen[id(p)] = f"{mname}/{pname}"
                add(f"{mname}/{pname}", p, mode.weight_bits)
            for bname, b in mod.named_buffers():
                add(f"{mname}/{bname}", b, 32)
        meta: dict[str, Any] = {"rng": _rng_state(), "state": {}, "optimizers": {}}
        carried: dict[str, dict[str, Any]] = {}
        for oname, opt in self._optimizers.items():
            params = [p for g in opt.param_groups for p in g["params"]]
            refs: list[str] = []
            for i, p in enumerate(params):
                if id(p) not in seen:
                    seen[id(p)] = f"{oname}/param/{i}"
                    add(seen[id(p)], p, mode.weight_bits)
                refs.append(seen[id(p)])
            sd = opt.state_dict()
            ometa: dict[str, Any] = {"params": refs, "param_groups": _json_safe(sd["param_groups"]), "scalars": {}}
            refresh = mode.optimizer != "drop" and (base or mode.optimizer_in_deltas)
            if refresh:
                for idx, st in sd["state"].items():
                    for key, value in st.items():
                        name = f"{oname}/state/{idx}/{key}"
                        if isinstance(value, torch.Tensor):
                            add(name, value, mode.optimizer_bits, sqrt=True)
                        else:
                            ometa["scalars"][name] = _json_safe(value)
            elif mode.optimizer != "drop":
                prefix = f"{oname}/state/"
                carried.update({k: v for k, v in self._last_entries.items() if k.startswith(prefix)})
                ometa["scalars"] = self._last_meta.get("optimizers", {}).get(oname, {}).get("scalars", {})
                ometa["carried_from"] = self._last_base
            meta["optimizers"][oname] = ometa
        for sname, (get, _set) in self._states.items():
            meta["state"][sname] = get()
        if "torch" in meta["rng"]:
            items.append(_Item("rng/torch", meta["rng"].pop("torch"), 32, False, False))
        for i, cuda_state in enumerate(meta["rng"].pop("cuda", [])):
            items.append(_Item(f"rng/cuda/{i}", cuda_state, 32, False, False))
        seq = self._next_seq
        self._next_seq += 1
        base_seq = seq if base else self._last_base
        assert base_seq is not None
        return _Job(seq, kind, None if base else self._last_seq, base_seq, step, mode, meta, items, carried, ticket)

    def _gated(self) -> set[int]:
        """Ids of the tensors the step gate holds: parameters and state of registered optimizers change only inside
        step(), which the gate holds back."""
        import torch

        gated: set[int] = set()
        for opt in self._optimizers.values():
            gated.update(id(p) for g in opt.param_groups for p in g["params"])
            gated.update(id(v) for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor))
        return gated

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
        out: list[tuple[int, int]] = []
        for seq in reversed(self.store.manifests(self.worker)):
            try:
                step = read_manifest(self.store, self.worker, seq).get("step")
            except CorruptSnapshot:
                continue
            if isinstance(step, int) and not isinstance(step, bool):
                out.append((seq, step))
        return out

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
        """Write a loaded snapshot into the registered modules, optimizers, user state and RNGs."""
        import torch

        m = loaded.manifest
        tensors = loaded.decode_all()
        by_name: dict[str, torch.Tensor] = {}
        with torch.no_grad():
            for mname, mod in self._modules.items():
                for pname, t in (*mod.named_parameters(), *mod.named_buffers()):
                    name = f"{mname}/{pname}"
                    if name not in tensors:
                        raise CorruptSnapshot(f"snapshot has no tensor {name}: was it taken from another model?")
                    value = tensors[name]
                    if tuple(value.shape) != tuple(t.shape):
                        raise CorruptSnapshot(f"tensor {name}: shape {list(value.shape)} != model's {list(t.shape)}")
                    t.copy_(value)
                    by_name[name] = t
            for oname, opt in self._optimizers.items():
                ometa = m["meta"]["optimizers"].get(oname)
                if ometa is None:
                    raise CorruptSnapshot(f"snapshot has no optimizer {oname}")
                params = [p for g in opt.param_groups for p in g["params"]]
                if len(params) != len(ometa["params"]):
                    raise CorruptSnapshot(
                        f"optimizer {oname}: {len(params)} parameters, snapshot has {len(ometa['params'])}"
                    )
                for p, ref in zip(params, ometa["params"], strict=False):
                    if ref not in by_name:
                        p.copy_(tensors[ref].to(p.device))
                self._load_optimizer(opt, oname, ometa, m, tensors)
        for sname, (_get, set_) in self._states.items():
            if sname in m["meta"]["state"]:
                set_(m["meta"]["state"][sname])
        rng = dict(m["meta"]["rng"])
        if "rng/torch" in tensors:
            rng["torch"] = tensors["rng/torch"]
        cuda = sorted(n for n in tensors if n.startswith("rng/cuda/"))
        if cuda:
            rng["cuda"] = [tensors[n] for n in cuda]
        _set_rng_state(rng)

    def catch_up(self, oname: str) -> None:
        """Load the restored snapshot's state into optimizer ``oname``, registered after the restore (a script
        that builds its optimizers one by one); its parameters too, when no registered module holds them."""
        import torch

        loaded = self.restored
        opt = self._optimizers[oname]
        if loaded is None:
            return
        m = loaded.manifest
        ometa = m["meta"]["optimizers"].get(oname)
        if ometa is None:
            raise CorruptSnapshot(f"snapshot has no optimizer {oname}")
        held = {f"{mn}/{pn}" for mn, mod in self._modules.items() for pn, _ in mod.named_parameters()}
        needed = [n for n in m["tensors"] if n.startswith(f"{oname}/state/")] + [
            r for r in ometa["params"] if r not in held
        ]
        tensors = {n: loaded.tensor(n) for n in needed}
        params = [p for g in opt.param_groups for p in g["params"]]
        with torch.no_grad():
            for p, ref in zip(params, ometa["params"], strict=False):
                if ref in tensors:
                    p.copy_(tensors[ref].to(p.device))
        self._load_optimizer(opt, oname, ometa, m, tensors)

    def _load_optimizer(
        self, opt: Any, oname: str, ometa: dict[str, Any], manifest: dict[str, Any], tensors: dict[str, Any]
    ) -> None:
        current = opt.state_dict()
        state: dict[int, dict[str, Any]] = {}
        prefix = f"{oname}/state/"
        for name in manifest["tensors"]:
            if name.startswith(prefix):
                idx, key = name[len(prefix) :].split("/", 1)
                state.setdefault(int(idx), {})[key] = tensors[name]
        for name, value in ometa.get("scalars", {}).items():
            idx, key = name[len(prefix) :].split("/", 1)
            state.setdefault(int(idx), {})[key] = value
        groups = current["param_groups"]
        for group, saved in zip(groups, ometa["param_groups"], strict=False):
            for key, value in saved.items():
                if key != "params" and value is not None and isinstance(group.get(key), (int, float, bool)):
                    group[key] = value
        opt.load_state_dict({"state": state, "param_groups": groups})

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


def _rng_state() -> dict[str, Any]:
    import torch

    version, internal, gauss = random.getstate()
    out: dict[str, Any] = {"python": [version, list(internal), gauss], "torch": torch.get_rng_state()}
    if "numpy" in sys.modules:
        state: Any = np.random.get_state(legacy=True)
        name, keys, pos, has_gauss, cached = state
        out["numpy"] = [name, keys.tolist(), int(pos), int(has_gauss), float(cached)]
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        out["cuda"] = torch.cuda.get_rng_state_all()
    return out


def _set_rng_state(rng: dict[str, Any]) -> None:
    import torch

    if "python" in rng:
        version, internal, gauss = rng["python"]
        random.setstate((version, tuple(internal), gauss))
    if "numpy" in rng:
        name, keys, pos, has_gauss, cached = rng["numpy"]
        np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    if "torch" in rng:
        torch.set_rng_state(rng["torch"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])


def replay_metadata(storage: Any, size: int, pointer: int) -> dict[str, Any]:
    """Replay-buffer metadata for ``register_state``: size, write pointer and a content hash of the first
    ``size`` entries, instead of the contents (a restored buffer refills; the hash says whether it matches)."""
    import hashlib

    h = hashlib.blake2b(digest_size=16)
    arr = storage[:size]
    if hasattr(arr, "detach"):
        arr = arr.detach().cpu().numpy()
    h.update(np.ascontiguousarray(arr).tobytes())
    return {"size": int(size), "pointer": int(pointer), "hash": h.hexdigest()}
