"""Carrying out directives inside the training process.

A directive arrives on the reporter thread. Fields that need no coordination with peers (sampling
switch, memory quota, precision, snapshot settings) take effect at once. Fields that change what the
ranks exchange (``compression_bits``, ``grad_accum_steps``) must change on every rank at the same
step, so they take effect at the next *safe point* — the start of the next synchronization cycle in
the DDP comm hook, where the ranks agree on them — and the directive is acked only then.

``async_sampling``: a flag plus a callback registry. Sampler threads call ``dsec.wait_for_sampling()``
(or check ``dsec.sampling_allowed()``); environments created through gymnasium's ``make`` wait inside
``step`` while sampling is paused in processes whose role is ``actor``. Heartbeats, inference and
everything else keep running.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any

log = logging.getLogger(__name__)

VALID_BITS = (32, 16, 8, 4)


class Actuators:
    def __init__(
        self,
        default_bits: int = 32,
        ack: Callable[[int], None] | None = None,
        unappliable: Callable[[int, str, Any, str], None] | None = None,
    ) -> None:
        if default_bits not in VALID_BITS:
            raise ValueError(f"compression_bits={default_bits} is invalid: expected one of {list(VALID_BITS)}")
        self._ack = ack
        self._lock = threading.Lock()
        self.default_bits = default_bits
        # desired (from the latest directive) and effective (in force) collective settings
        self.desired_bits = default_bits
        self.desired_accum = 1
        self.effective_bits = default_bits
        self.effective_accum = 1
        self._pending_version: int | None = None
        self.collective_users = 0  # DDP hooks that will reach a safe point
        # A user-registered comm hook owns gradient sync: compression/accumulation cannot be applied,
        # so directives changing them are never acked (the control plane sees them pending).
        self.collectives_locked = False
        # Fields this process cannot carry out (field -> why): a directive asking to change one is answered with
        # ``unappliable(version, field, requested, reason)`` (a ``directive_unappliable`` event) and never acked;
        # its other fields still take effect.
        self.refused: dict[str, str] = {}
        self._unappliable = unappliable
        self._answered: set[tuple[int, str]] = set()
        self._last: Mapping[str, Any] | None = None
        self.memory_quota_gb: float | None = None
        self.memory_limit_gb: float | None = None
        self.memory_ceiling_gb: float | None = None
        self.precision = "fp32"
        self.snapshot_interval_s: float | None = None
        self.snapshot_now: str | None = None
        self.snapshot_compression_level: int | None = None
        self.sync_priority = 0
        self._sampling = threading.Event()
        self._sampling.set()
        # The same state as a plain attribute for the environment monitors, which read it at every env step: an
        # attribute read there instead of two calls (sampling_allowed -> Event.is_set, ~4 µs each with the caches
        # cold after a policy forward pass; probe-overhead benchmark).
        self.sampling_paused = False
        self._sampling_callbacks: list[Callable[[bool], None]] = []
        self.memory_fraction_applied: float | None = None

    # -- directives ---------------------------------------------------------------------------------
    def handle(self, directive: Mapping[str, Any]) -> bool:
        """Reporter's directive handler. True: in force now; False: acked later at the safe point."""
        version = int(directive.get("version", 0))
        self._last = directive
        bits, accum = self._requested(directive)
        self._set_sampling(bool(directive.get("async_sampling", True)))
        self.memory_quota_gb = directive.get("memory_quota_gb")
        self.memory_limit_gb = directive.get("memory_limit_gb")
        self.memory_ceiling_gb = directive.get("memory_ceiling_gb")
        self.precision = str(directive.get("precision") or "fp32")
        self.snapshot_interval_s = directive.get("snapshot_interval_s")
        self.snapshot_now = directive.get("snapshot_now")
        self.snapshot_compression_level = directive.get("snapshot_compression_level")
        self.sync_priority = int(directive.get("sync_priority") or 0)
        self._apply_memory_quota()
        with self._lock:
            if self.collectives_locked and (bits, accum) != (self.effective_bits, self.effective_accum):
                self._pending_version = None
                refused = True
            else:
                refused = self._refuse_fields(version, bits, accum)
            if refused:
                # The fields this process can carry out still take effect; the version is never acked.
                if "compression_bits" not in self.refused and not self.collectives_locked:
                    self.desired_bits = bits
                self._pending_version = None
                return False
            self.desired_bits, self.desired_accum = bits, accum
            if self.collective_users == 0:
                # No gradient exchange in this process: nothing to coordinate, in force at once.
                self.effective_bits, self.effective_accum = bits, accum
                self._pending_version = None
                return True
            if bits == self.effective_bits and accum <= self.effective_accum:
                self._pending_version = None
                return True
            self._pending_version = version
            return False

    def _requested(self, directive: Mapping[str, Any]) -> tuple[int, int]:
        bits = directive.get("compression_bits")
        # None: the level this probe was configured with; 32: uncompressed, even when that default is 8 or 4.
        bits = self.default_bits if bits is None else int(bits)
        return bits, int(directive.get("grad_accum_steps") or 1)

    def _refuse_fields(self, version: int, bits: int, accum: int) -> bool:
        """Under the lock: True when the directive changes a refused field; each (version, field) answered once."""
        asked = (("compression_bits", bits, self.effective_bits), ("grad_accum_steps", accum, self.effective_accum))
        out = False
        for name, want, have in asked:
            reason = self.refused.get(name)
            if reason is None or want == have:
                continue
            out = True
            if (version, name) not in self._answered and self._unappliable is not None:
                self._answered.add((version, name))
                try:
                    self._unappliable(version, name, want, reason)
                except Exception:
                    log.warning("dsec: could not report an unappliable directive field", exc_info=True)
        return out

    def refuse(self, name: str, reason: str) -> None:
        """This process cannot carry out directive field ``name`` (from now on): the directive in force, if it
        asks for a change of it, is answered at once (and no longer acked later)."""
        with self._lock:
            if name in self.refused:
                return
            self.refused[name] = reason
            # What is in force from now on, whatever was reported before: uncompressed, not accumulated.
            if name == "compression_bits":
                self.desired_bits = self.effective_bits = 32
            elif name == "grad_accum_steps":
                self.desired_accum = self.effective_accum = 1
            last = self._last
            if last is None:
                return
            bits, accum = self._requested(last)
            if self._refuse_fields(int(last.get("version", 0)), bits, accum):
                self._pending_version = None

    def declare(self) -> tuple[int, int]:
        """The (bits, accum) this rank asks its peers for; read by the comm hook at each cycle start."""
        with self._lock:
            return self.desired_bits, self.desired_accum

    def confirm(self, bits: int, accum: int) -> None:
        """The comm hook reports what the group agreed for this rank (its own bits; the group's accum).
        The pending directive is acked once its bits are in force and accumulation is at least what it
        asked for (the group runs the largest accumulation any rank asks for)."""
        with self._lock:
            self.effective_bits, self.effective_accum = bits, accum
            version = self._pending_version
            if version is None or bits != self.desired_bits or accum < self.desired_accum:
                return
            self._pending_version = None
        if self._ack is not None:
            self._ack(version)

    # -- async sampling -----------------------------------------------------------------------------
    def _set_sampling(self, allowed: bool) -> None:
        if allowed == self._sampling.is_set():
            return
        if allowed:
            self._sampling.set()
        else:
            self._sampling.clear()
        self.sampling_paused = not allowed
        for cb in list(self._sampling_callbacks):
            try:
                cb(allowed)
            except Exception:
                log.warning("dsec: sampling callback failed", exc_info=True)

    def sampling_allowed(self) -> bool:
        return self._sampling.is_set()

    def wait_for_sampling(self, timeout: float | None = None) -> bool:
        return self._sampling.wait(timeout)

    def on_sampling_change(self, callback: Callable[[bool], None]) -> None:
        self._sampling_callbacks.append(callback)

    # -- memory -------------------------------------------------------------------------------------
    def allocator_limit_gb(self) -> float | None:
        """What the allocator may take: the grant, or the limit when that is more (dsec.quota.elastic, "Grant and
        limit"); None without a quota."""
        if self.memory_quota_gb is None:
            return None
        quota = float(self.memory_quota_gb)
        return quota if self.memory_limit_gb is None else max(quota, float(self.memory_limit_gb))

    def _apply_memory_quota(self) -> None:
        """On CUDA, cap the caching allocator at :meth:`allocator_limit_gb` (a soft, per-process limit); on CPU the
        quota is only reported against (memory_quota_gb next to memory_used_gb)."""
        limit = self.allocator_limit_gb()
        if limit is None:
            return
        import sys

        torch = sys.modules.get("torch")
        if torch is None or not torch.cuda.is_available():
            return
        dev = torch.cuda.current_device()
        total = torch.cuda.get_device_properties(dev).total_memory / 2**30
        fraction = max(0.01, min(1.0, limit / total))
        torch.cuda.set_per_process_memory_fraction(fraction, dev)
        self.memory_fraction_applied = fraction

    # -- precision ----------------------------------------------------------------------------------
    @contextlib.contextmanager
    def autocast(self, device_type: str = "cpu") -> Iterator[None]:
        """torch.autocast at the precision the directive asks for (fp32: no autocast)."""
        if self.precision == "fp32":
            yield
            return
        import torch

        dtype = torch.bfloat16 if self.precision == "bf16" else torch.float16
        with torch.autocast(device_type=device_type, dtype=dtype):
            yield

    def state(self) -> dict[str, float]:
        out = {
            "compression_bits": float(self.effective_bits),
            "grad_accum_steps": float(self.effective_accum),
            "async_sampling": 1.0 if self.sampling_allowed() else 0.0,
            "precision_bits": {"fp32": 32.0, "bf16": 16.0, "fp16": 16.0}.get(self.precision, 32.0),
        }
        if self.memory_quota_gb is not None:
            out["memory_quota_gb"] = float(self.memory_quota_gb)
        if (limit := self.allocator_limit_gb()) is not None and self.memory_limit_gb is not None:
            out["memory_limit_gb"] = limit
        return out
