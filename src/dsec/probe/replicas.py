"""Keeping the replicas of a DDP group identical, and noticing when they are not.

DDP's contract is that every rank applies the same update to the same weights; nothing in DDP checks it. A restore
from snapshots taken at different steps, a rank that computes its own learning rate from a local counter, a
non-deterministic kernel: each makes the replicas drift apart silently. :class:`ReplicaGuard` rides on the sync
header (sync_header.py), so it costs no extra collective:

- **Drift check.** Every ``check_every`` synchronized steps (and at the first step after a start, a restore or a
  heal) each rank computes a :func:`fingerprint` of its parameters and buffers right after the optimizer step and
  attaches 24 bits of it to the next header. Every rank then sees every fingerprint; a rank whose fingerprint
  differs from the majority reports a ``replica_drift`` anomaly (the control plane raises a critical alert) and the
  ``replica_drift`` health feature turns 1.
- **Hyper-parameters.** Each header carries a digest of the optimizer hyper-parameters the rank will apply
  (learning rate, betas, weight decay, ...); differing digests are a ``hyperparameter_mismatch`` anomaly.
- **Group snapshots.** A rank whose snapshot period is due (or that was asked for one) sets a flag; when any rank
  wants one and none is still writing its previous one, *every* rank snapshots right after that step's optimizer
  update — so the ranks' snapshots share steps, and a restore can pick one step for all (probe/snapshots.py).
"""

from __future__ import annotations

import hashlib
import logging
import struct
import threading
import weakref
import zlib
from collections import Counter
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from dsec.probe.sync_header import Flag, Header

if TYPE_CHECKING:
    import torch

    from dsec.probe.runtime import Probe

log = logging.getLogger(__name__)

DEFAULT_CHECK_EVERY = 100
# The comm hook's header carries a digest of the optimizer hyper-parameters read once per this many synchronized
# steps (ReplicaGuard.extras).
HYPER_EVERY = 8
_CHUNK = 1 << 20
MASK24 = (1 << 24) - 1


def _int_view(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bits as small signed integers (int16 pieces, or int8 for one-byte types): exact, and small
    enough that sums of squares over a chunk never overflow int64."""
    import torch

    flat = t.detach().reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    if flat.dtype == torch.bool:
        flat = flat.to(torch.uint8)
    if flat.element_size() == 1:
        return flat.view(torch.int8)
    if flat.is_complex():
        flat = torch.view_as_real(flat).reshape(-1)
    return flat.view(torch.int16)


_WEIGHTS: dict[Any, torch.Tensor] = {}  # position weights per device (values depend only on the position)


def fingerprint(tensors: Iterable[torch.Tensor]) -> int:
    """A 64-bit digest of the tensors' exact bits (order of tensors matters), independent of thread counts and
    reduction order, so bit-identical replicas always agree.

    A tensor in host memory enters as the CRC-32 of its bytes (zlib: ~2 ms for the 6.7 MB of a Nature-CNN learner,
    where the integer sums below took ~20 ms; the guard runs it every ``check_every`` steps). A tensor on an
    accelerator enters through three integer sums per chunk (plain, squared and position-weighted), computed on
    its device without copying it to the host. The two give different digests for the same bits, so the ranks of a
    group must hold their models on the same kind of device (DDP's buckets and backends assume it as well); a
    transfer (replica_state.py) fingerprints host copies on both sides."""
    import torch

    h = hashlib.blake2b(digest_size=8)
    weights = _WEIGHTS
    for t in tensors:
        if t.device.type == "cpu":
            raw = t.detach().reshape(-1)
            if not raw.is_contiguous():
                raw = raw.contiguous()
            data = raw.view(torch.uint8).numpy()  # any dtype (bfloat16, bool, complex) as its bytes
            h.update(struct.pack("<qI", raw.numel(), zlib.crc32(data.data)))
            continue
        ints = _int_view(t)
        n = ints.numel()
        h.update(struct.pack("<q", n))
        for start in range(0, n, _CHUNK):
            c = ints[start : start + _CHUNK].to(torch.int64)
            w = weights.get(c.device)
            if w is None or w.numel() < c.numel():
                # Built once per device and size (a fresh 1M-element arange per check cost milliseconds).
                size = min(_CHUNK, max(c.numel(), 2 * (0 if w is None else w.numel()), 4096))
                w = weights[c.device] = torch.arange(size, dtype=torch.int64, device=c.device) % 251 + 1
            s1, s2, s3 = (int(v) for v in torch.stack((c.sum(), (c * c).sum(), (c * w[: c.numel()]).sum())).tolist())
            h.update(struct.pack("<qqq", s1, s2, s3))
    return int.from_bytes(h.digest(), "little")


def hyper_digest(optimizers: Iterable[Any]) -> int:
    """24 bits of a digest of every optimizer's numeric hyper-parameters (what an update depends on besides the
    gradient and the optimizer state)."""
    h = hashlib.blake2b(digest_size=4)
    for opt in optimizers:
        for group in opt.param_groups:
            for key in sorted(group):
                if key == "params":
                    continue
                value = group[key]
                if hasattr(value, "numel") and value.numel() == 1:
                    value = value.item()
                if isinstance(value, (bool, int, float, str)) or value is None:
                    h.update(f"{key}={value!r};".encode())
                elif isinstance(value, (tuple, list)):
                    h.update(f"{key}={[float(v) if isinstance(v, (int, float)) else str(v) for v in value]};".encode())
    return int.from_bytes(h.digest(), "little") & MASK24


def _plain(value: Any) -> Any:
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    if isinstance(value, (tuple, list)):
        return tuple(_plain(v) for v in value)
    if hasattr(value, "numel") and value.numel() == 1:
        return float(value.item())
    return id(value)


def _hyper_key(optimizers: Iterable[Any]) -> tuple[Any, ...]:
    """Every optimizer's hyper-parameter values as a cheap comparable tuple: the digest is recomputed only when
    it changes."""
    key: list[Any] = []
    add = key.append
    for opt in optimizers:
        add(id(opt))
        for group in opt.param_groups:
            for k, v in group.items():
                if k != "params":
                    add(k)
                    # (one type lookup for the common plain values instead of a call per value: read every step)
                    add(v if type(v) in _PLAIN_TYPES else _plain(v))
            add(None)  # the end of a group
    return tuple(key)


_PLAIN_TYPES = frozenset({bool, int, float, str, type(None)})


class ReplicaGuard:
    def __init__(self, probe: Probe, check_every: int = DEFAULT_CHECK_EVERY) -> None:
        self.probe = probe
        self.check_every = check_every
        self._modules: list[weakref.ref[Any]] = []
        self._optimizers: list[weakref.ref[Any]] = []
        self._lock = threading.Lock()
        self._fp_due = check_every > 0  # the first step after a (re)start is always checked
        self._pending_fp: int | None = None
        self.snapshot_agreed = False
        self.checks = 0
        self.drifts = 0
        self.drifted = False  # this rank differed from the majority at the last check
        self.last_check: dict[str, Any] | None = None
        self._hyper_reported: set[tuple[tuple[int, int], ...]] = set()
        self._hyper_key: Any = None
        self._hyper = 0
        self._hyper_step: int | None = None  # the step the hyper-parameters were last read at (None: never, or no step)

    # -- what the guard covers --------------------------------------------------------------------------
    def add_module(self, module: Any) -> None:
        self._modules.append(weakref.ref(getattr(module, "module", module)))

    def add_optimizer(self, opt: Any) -> None:
        self._optimizers.append(weakref.ref(opt))

    def modules(self) -> list[Any]:
        return [m for m in (r() for r in self._modules) if m is not None]

    def optimizers(self) -> list[Any]:
        return [o for o in (r() for r in self._optimizers) if o is not None]

    def tensors(self) -> list[torch.Tensor]:
        out: list[torch.Tensor] = []
        for m in self.modules():
            out.extend(p for _, p in m.named_parameters())
            out.extend(b for _, b in m.named_buffers())
        return out

    # -- training thread ----------------------------------------------------------------------------------
    def force_check(self) -> None:
        """Check at the next step (after a restore or a heal)."""
        if self.check_every > 0:
            self._fp_due = True

    def after_step(self) -> None:
        """Right after an optimizer step: compute the fingerprint when one is due (it goes into the next header)."""
        if not self._fp_due:
            return
        self._fp_due = False
        try:
            self._pending_fp = fingerprint(self.tensors()) & MASK24
        except Exception:
            log.exception("dsec: replica fingerprint failed")

    def extras(self, step: int | None = None) -> tuple[int, int, int]:
        """(flags, fingerprint, hyper) for this rank's next header (called at the start of a sync cycle). ``step``:
        the group's agreed count of synchronized steps; with it the optimizers' hyper-parameters are read once per
        ``HYPER_EVERY`` steps (at the same steps on every rank, so their digests stay comparable; a mismatch is seen
        up to that many steps later) — reading every value of every param group cost ~40 µs per step, and a
        schedule that changes the learning rate every step would otherwise change the header at every step, which
        the comm hook's fast path (ddp.py ``_headers_arrived``) needs not to."""
        flags = 0
        snaps = self.probe.snapshots
        if snaps is not None:
            wanted, busy = snaps.group_status()
            if wanted:
                flags |= Flag.SNAPSHOT_WANTED
            if busy:
                flags |= Flag.SNAPSHOT_BUSY
        fp, self._pending_fp = self._pending_fp, None
        if fp is not None:
            flags |= Flag.FINGERPRINT
        if step is not None and self._hyper_step is not None and step // HYPER_EVERY == self._hyper_step // HYPER_EVERY:
            return int(flags), fp or 0, self._hyper
        self._hyper_step = step
        try:
            opts = self.optimizers()
            key = _hyper_key(opts)
            if key != self._hyper_key:  # the digest (f-strings, blake2b) only when a value changed
                self._hyper_key, self._hyper = key, hyper_digest(opts)
        except Exception:
            self._hyper_key, self._hyper = None, 0
        return int(flags), fp or 0, self._hyper

    # -- after every synchronized step (any thread) -----------------------------------------------------------
    def on_headers(self, headers: list[Header] | None, rank: int, syncs: int, since: int = 1) -> None:
        """``headers`` by rank; a rank without ``Flag.PRESENT`` (dead, under healing) is left out of every vote.
        None: every rank's fields are those of the previous call's headers, which carried no vote (no fingerprint,
        no snapshot wanted) — the comm hook's fast path; only the fingerprint schedule moves on.
        ``since``: synchronized steps since the previous header (the comm hook may carry one every few steps only):
        a fingerprint is due when a multiple of ``check_every`` was passed in between."""
        if self.check_every > 0 and syncs // self.check_every != (syncs - since) // self.check_every:
            self._fp_due = True
        if headers is None:
            self.snapshot_agreed = False  # (what the previous headers, without a snapshot wish, gave)
            return  # a hyper-parameter mismatch in them was reported when they were read
        present = {r: h for r, h in enumerate(headers) if h.has(Flag.PRESENT)}
        wanted = any(h.has(Flag.SNAPSHOT_WANTED) for h in present.values())
        busy = any(h.has(Flag.SNAPSHOT_BUSY) for h in present.values())
        self.snapshot_agreed = wanted and not busy
        checked = {r: h.fingerprint for r, h in present.items() if h.has(Flag.FINGERPRINT)}
        if checked:
            self._judge(checked, rank, syncs)
        hypers = tuple((r, h.hyper) for r, h in present.items())
        if len({v for _, v in hypers}) > 1 and hypers not in self._hyper_reported:
            self._hyper_reported.add(hypers)
            self.probe.event(
                "anomaly",
                urgent=True,
                kind="hyperparameter_mismatch",
                step=syncs,
                digests={str(r): f"{v:06x}" for r, v in hypers},
                message="ranks apply different optimizer hyper-parameters (learning rate, betas, ...): "
                "their replicas will drift apart",
            )

    def _judge(self, checked: dict[int, int], rank: int, syncs: int) -> None:
        counts = Counter(checked.values())
        majority, votes = counts.most_common(1)[0]
        # No strict majority: every rank that disagrees with anyone is suspect.
        strict = votes * 2 > len(checked)
        odd = sorted(r for r, v in checked.items() if v != majority or (not strict and len(counts) > 1))
        with self._lock:
            self.checks += 1
            self.drifted = rank in odd
            if odd:
                self.drifts += 1
            self.last_check = {"step": syncs, "ranks": len(checked), "drifted": odd}
        if rank in odd:
            self.probe.event(
                "anomaly",
                urgent=True,
                kind="replica_drift",
                step=syncs,
                fingerprint=f"{checked[rank]:06x}",
                majority=f"{majority:06x}" if strict else None,
                drifted_ranks=odd,
                message=f"rank {rank}'s parameters differ from "
                + ("the majority's" if strict else "its peers'")
                + f" after synchronized step {syncs}",
            )

    def metrics(self) -> dict[str, float]:
        with self._lock:
            if not self.checks:
                return {}
            return {
                "replica_checks_total": float(self.checks),
                "replica_drift_total": float(self.drifts),
                "replica_drift": 1.0 if self.drifted else 0.0,
            }
