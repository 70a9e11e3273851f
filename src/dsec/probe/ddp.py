"""The DDP comm hook: measured, compressed and accumulated gradient synchronization.

Per bucket the hook measures the bytes this rank hands to the backend and the latency to completion,
and carries out two directive fields:

* ``compression_bits`` — each rank encodes its gradient at its *own* level: 32 (float32), 16 (fp16),
  8 or 4 (block quantization with one float32 scale per 256 values, error feedback); a directive's null is the
  probe's configured default, resolved in actuators.py before the hook sees it. When every rank
  uses 32 or every rank uses 16 the bucket goes through one ``all_reduce``; when every rank uses the
  same 8/4-bit level, through one ``all_gather`` of the packed payloads; when levels differ, through one
  ``all_to_all_single`` with uneven splits — so a degraded rank uploads less without forcing its peers
  to. Quantized payloads are never summed as integers: each rank dequantizes every peer's payload with
  that peer's scales, then averages in float32. The quantization error of a step is carried into the
  next step (error feedback), keyed by the bucket's parameters, so DDP's re-bucketing after the first
  step never applies a residual to the wrong layout (a changed layout starts from zero residual).

* ``grad_accum_steps`` — synchronize every N backward passes: between syncs the hook returns the local
  bucket unchanged, autograd accumulates into ``.grad``, and the optimizer step and ``zero_grad`` are
  skipped by the probe (see torch_hooks.py); the sync step averages the accumulated sum over N x world,
  so one optimizer update sees the mean gradient of N x world micro-batches at the unchanged learning
  rate. Accumulation must be the same on every rank, so the group uses the largest N any rank asks for.

Agreement without extra collectives: the last bucket of a synchronized step carries a small header
(sync_header.py) with every rank's *desired* (bits, accum), its arrival stamp and what the replica guard needs
(group snapshot flags, the replica fingerprint, a digest of the optimizer hyper-parameters; see replicas.py) —
one-hot slots summed by the all_reduce, or a prefix of each rank's chunk. All ranks see the same headers, so at the
next cycle start they switch together, and they agree on group snapshots and drift without another collective.
A hand-written all-reduce of gradients (manual_sync.py) carries it at every step.

The header is what costs in the all_reduce path (encoding, decoding, the guard's votes: a few hundred µs of Python per
step inside a learner's step, where the caches are cold, against a native all_reduce launch of ~150). Most steps repeat
every field but the arrival stamps, so the slots are built again only when a field changed and decoded only when a
rank's fields changed (``_header_slots``, ``_headers_arrived``: the fast path). It can also ride every Nth synchronized
step only (``DSEC_HEADER_EVERY``, opt-in; default 1: every step, sync_header.DEFAULT_EVERY); the steps between
all_reduce the bucket's own buffer in place, the way DDP's default hook does. Whether a step carries the header depends
only on the agreed state (the count of synchronized steps since the last header and the agreed levels), so every rank
decides the same. What N > 1 costs: level changes, group-snapshot agreement, replica fingerprints and the arrival stamps
happen only at header steps (a directive takes effect up to N steps later); between them a rank's sync cost is estimated
from its lag and wait at the last header (``_estimate_arrival``: its cost stays its own share, the straggler's punctual
peers are not blamed for waiting; a straggler that recovers is seen at the next header). The byte paths (8/4 bits, mixed
levels) carry the header at every step. Measured (docs/benchmarks.md): the probe's cost on a learner-sized step
0.41-0.43% with N = 1 and the fast path (0.58% without it); N = 8 was the default for a few hours on 2026-12-03 and went
back to opt-in: the demo's breaker scene still blamed the healthy peer in 2 of 14 runs (a suspect: a header step aligned
with the first sync after each PPO rollout, where arrival order differs).

Who is slow: an all_reduce ends at the same moment on every rank, so every rank's measured latency
includes waiting for the slowest one and raw latency cannot name the straggler. The header therefore
also carries each rank's *arrival stamp* (wall clock when it entered the last bucket's collective).
From the stamps every rank computes its ``lag`` (how long after the earliest peer it arrived) and its
``cost`` = lag + the part of its latency not spent waiting for later peers — the time the group lost
because of this rank. A straggler's cost is its lateness; its punctual peers' cost is the bare
collective time. Stamps use the wall clock: exact on one host, as good as clock sync across hosts.
In the float slots of the all_reduce path the stamp is milliseconds modulo a period the dtype holds
exactly (2**20 ms for float32, 2048 ms for float16) and differences are taken on the circle.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

from dsec import quant
from dsec.probe import sync_header as sh
from dsec.probe.actuators import Actuators
from dsec.probe.chaos import Chaos
from dsec.probe.telemetry import Telemetry

if TYPE_CHECKING:
    import torch

    from dsec.probe.replicas import ReplicaGuard

log = logging.getLogger(__name__)

HEADER_BYTES = sh.HEADER_BYTES
FP16_MAX = 65504.0


def chunk_bytes(numel: int, bits: int, block: int = quant.DEFAULT_BLOCK) -> int:
    """Bytes of one rank's encoded bucket (payload only, no header)."""
    if bits == 32:
        return numel * 4
    if bits == 16:
        return numel * 2
    code_bytes, nblocks = quant.encoded_size(numel, bits, block)
    return code_bytes + 4 * nblocks


class SyncCoordinator:
    """Per-DDP-model hook state. ``hook`` is registered with ``register_comm_hook(None, hook)``."""

    def __init__(
        self,
        actuators: Actuators,
        telemetry: Telemetry,
        process_group: Any = None,
        collectives: Any = None,
        block: int = quant.DEFAULT_BLOCK,
        error_feedback: bool = True,
        chaos: Chaos | None = None,
        guard: ReplicaGuard | None = None,
        header_every: int = sh.DEFAULT_EVERY,
    ) -> None:
        import torch.distributed as dist

        if header_every < 1:
            raise ValueError(f"header_every={header_every} is invalid: expected >= 1")

        self._dist = dist
        # Unpatched collectives: the hook's own traffic is gradient sync, not user collectives.
        self._c = collectives or dist
        self.pg = process_group
        self.world = dist.get_world_size(process_group)
        self.rank = dist.get_rank(process_group)
        self.actuators = actuators
        self.telemetry = telemetry
        self.block = block
        self.error_feedback = error_feedback
        self.chaos = chaos
        self.guard = guard
        default = actuators.default_bits
        self.peer_bits = [default] * self.world  # agreed: identical on every rank
        self.accum = 1
        self._seen: list[tuple[int, int]] | None = None  # headers of the last synced step
        self._cycle_pos = 0
        self._in_backward = False
        self._sync_now = True
        self.last_backward_synced = True
        self._residual: dict[tuple[int, ...], torch.Tensor] = {}
        self._grad_sq = 0.0
        # Set by the optimizer hook while the training code clips the synchronized gradient itself
        # (clip_grad_norm_ returns the norm of the same averaged gradient): the hook then skips its own pass over
        # every bucket (~0.1 ms per MB of gradients on a CPU core), see TorchInstrumentation._post_step.
        self.norm_from_clip = False
        self.steps = 0  # backward passes seen
        self.syncs = 0  # synchronized steps completed (identical on every rank)
        self._my_extras = (0, 0, 0)
        self._no_stamps = [0.0] * self.world
        self.header_every = header_every
        self._reduce = self._reduce_path()  # this cycle's buckets go through one all_reduce (set at each cycle start)
        self._header_due = True  # this cycle's last bucket carries the header (agreed: identical on every rank)
        self._since_header = header_every  # synced steps since the last header (the first step carries one)
        actuators.collective_users += 1
        # A bucket's all_reduce goes to the process group itself, as DDP's built-in hook does: torch's Python wrapper
        # (argument checks, the coalescing lookup, its logging decorators) cost ~55 µs per call inside a learner's step
        # (probe-overhead benchmark, cnn workload: caches are cold after the forward and backward passes), where a
        # tight loop shows ~1 µs. A stand-in group without ``allreduce`` (tests) goes through the collectives.
        self._sum_opts = dist.AllreduceOptions()
        self._sum_opts.reduceOp = dist.ReduceOp.SUM  # type: ignore[assignment]
        if hasattr(self._sum_opts, "asyncOp"):  # (torch >= 2.6; what dist.all_reduce(async_op=True) sets)
            self._sum_opts.asyncOp = True
        self._direct = process_group is not None and hasattr(process_group, "allreduce")

    # -- cycle bookkeeping ----------------------------------------------------------------------------
    def _start_cycle(self) -> None:
        # Settings the group agreed on from the last synced step's headers take effect now, on every
        # rank at once; then this rank declares what it wants next (carried by this cycle's headers).
        if self._seen is not None:
            if self._seen is not self._applied:  # (the header fast path hands over the same list again)
                self.peer_bits = [b for b, _ in self._seen]
                self.accum = max(a for _, a in self._seen)
                self._applied = self._seen
            self._seen = None
        self.actuators.confirm(self.peer_bits[self.rank], self.accum)
        if self.peer_bits is not self._reduce_for:  # the levels change only here
            self._reduce, self._reduce_for = self._reduce_path(), self.peer_bits
        self._header_due = not self._reduce or self._since_header >= self.header_every - 1
        if self._header_due:
            # Read only when a header will carry them: extras() hands over a pending fingerprint once.
            self._my_desired = self.actuators.declare()
            if self.guard is not None:
                self._my_extras = self.guard.extras(self.syncs)

    _applied: list[tuple[int, int]] | None = None  # the headers' (bits, accum) last taken into peer_bits / accum
    _reduce_for: list[int] | None = None  # the peer_bits self._reduce was computed for

    def _reduce_path(self) -> bool:
        """Whether this cycle's buckets go through one all_reduce (every rank at 32 bits, or every rank at 16)."""
        bits = self.peer_bits
        return all(b == 32 for b in bits) or all(b == 16 for b in bits)

    def _my_header(self, stamp: float, contributes: bool = True, admit: int = 0) -> sh.Header:
        bits, accum = self._my_desired
        flags, fp, hyper = self._my_extras
        flags |= sh.Flag.PRESENT
        if contributes:
            flags |= sh.Flag.CONTRIBUTES
        if admit:
            flags |= sh.Flag.JOIN_KNOWN
        return sh.Header(bits, min(accum, sh.MAX_ACCUM), stamp, int(flags), fp, hyper, admit & sh.MASK24)

    def _header_slots(self, bits: int, dtype: torch.dtype, device: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's header as all_reduce slots of the bucket's dtype, and a view of its stamp slot. Built again only
        when a field changed (a level change, a fingerprint, a snapshot vote, every 8th sync's hyper-parameter digest);
        between, the same tensor is reused with the stamp written in place (the cat copies it, so the next step may
        write it again). A key of plain tuples: building the Header to compare cost more than the slots themselves."""
        key = (self._my_desired, self._my_extras, bits, dtype, device)
        if self._slots_key != key:
            values = sh.slot_values(self._my_header(0.0), self.rank, self.world, bits)
            slots = sh.slots_tensor(values, self.rank, bits, 0.0, dtype, device=device)
            at = sh.SLOTS_PER_RANK[bits] * self.rank
            self._slots_key, self._slots = key, (slots, slots[at : at + 1])
        return self._slots

    _slots_key: Any = None
    _slots: tuple[torch.Tensor, torch.Tensor]

    def _headers_arrived(self, slots: torch.Tensor, bits: int, period_ms: float, latency_s: float) -> None:
        """The summed header slots of an all_reduce step. Most steps every rank's fields are those of the step
        before and only the arrival stamps are new: then the decoded headers, the agreed levels and the replica
        guard's votes stand as they were (nothing a vote reads changed) and only the stamps are read — the full
        decode and the guard's pass cost ~100 µs of Python per step on a learner (probe-overhead benchmark)."""
        n = sh.SLOTS_PER_RANK[bits]
        flat = slots.tolist()
        stamps = flat[::n]
        flat[::n] = self._no_stamps
        repeat = self._repeat
        if repeat is not None and flat == repeat[0]:
            self._seen = repeat[1]
            self._record_arrivals(stamps, period_ms, latency_s)
            self._synced(None, unchanged=True)
            return
        headers = sh.decode_slots(slots, self.world, bits)
        self._headers_seen(headers, period_ms, latency_s)
        # Votes the guard counts once per header that carries them (a fingerprint is a check, a snapshot wish an
        # agreement the step consumes): headers with one are decoded and read again, even if they repeat.
        votes = sh.Flag.FINGERPRINT | sh.Flag.SNAPSHOT_WANTED
        if not any(h.flags & votes for h in headers):
            self._repeat = (flat, self._seen)

    # The last headers read, when the next step may take their place: their fields without the stamps, and the
    # (bits, accum) they gave. None once other headers were read since, or when they carried a vote.
    _repeat: tuple[list[float], list[tuple[int, int]] | None] | None = None

    def _headers_seen(self, headers: list[sh.Header], period_ms: float | None, latency_s: float) -> None:
        self._repeat = None  # the fields _headers_arrived compares with are no longer the last ones read
        self._seen = [(h.bits, h.accum) for h in headers]
        self._record_arrivals([h.stamp for h in headers], period_ms, latency_s)
        self._synced(headers)

    def _synced(self, headers: list[sh.Header] | None, unchanged: bool = False) -> None:
        """One more synchronized step; the replica guard reads its headers (None: a step without a header, or with
        ``unchanged`` a header whose fields are those the guard read last)."""
        self.syncs += 1
        if headers is None and not unchanged:
            self._since_header += 1
            return
        since, self._since_header = self._since_header + 1, 0
        if self.guard is not None:
            try:
                self.guard.on_headers(headers, self.rank, self.syncs, since=min(since, self.syncs))
            except Exception:
                log.exception("dsec: replica guard failed on a sync header")

    def _prelude(self, bucket: Any) -> tuple[Any, bool]:
        """Cycle bookkeeping at each bucket: (the bucket's buffer, whether it is the backward's last bucket)."""
        if not self._in_backward:
            self._in_backward = True
            if self._cycle_pos == 0:
                self._start_cycle()
            self._sync_now = self._cycle_pos >= self.accum - 1
        last = bucket.is_last()
        if last:
            self._in_backward = False
            self.last_backward_synced = self._sync_now
            self._cycle_pos = 0 if self._sync_now else self._cycle_pos + 1
            self.steps += 1
        buf = bucket.buffer()
        if self.chaos is not None:
            factor = self.chaos.grad_factor()
            if factor != 1.0:
                buf.mul_(factor)  # injected gradient spike on this rank
        return buf, last

    def _sum(self, t: torch.Tensor) -> Any:
        """Start an all_reduce (sum) of ``t`` on this hook's group; returns the work."""
        if self._direct:
            return self.pg.allreduce([t], self._sum_opts)
        return self._c.all_reduce(t, group=self.pg, async_op=True)

    def _late(self) -> None:
        if self.chaos is not None:
            # Injected lateness: this rank reaches the step's last collective late (a slow rank).
            delay = self.chaos.sync_delay_s(self.rank)
            if delay > 0:
                time.sleep(delay)

    def hook(self, _state: object, bucket: Any) -> torch.futures.Future[torch.Tensor]:
        import torch

        buf, last = self._prelude(bucket)
        if not self._sync_now:
            fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
            fut.set_result(buf)
            return fut
        if last:
            self._late()
        start = time.perf_counter()
        if self._reduce:
            if last and self._header_due:
                return self._all_reduce(buf, self.peer_bits[0], last, start)
            return self._all_reduce_plain(buf, self.peer_bits[0], last, start)
        return self._exchange(buf, tuple(id(p) for p in bucket.parameters()), last, start)

    # -- paths ----------------------------------------------------------------------------------------
    def _record_arrivals(self, stamps: list[float], period_ms: float | None, latency_s: float) -> None:
        """Lag and cost of this rank from every rank's arrival stamp (seconds, or ms on a circle)."""
        deltas = sh.circle_deltas(stamps, stamps[self.rank], period_ms)
        lag = -min(deltas)  # how long after the earliest peer this rank arrived
        wait = max(deltas)  # how long it then waited for the latest one
        self._last_arrival = (lag, wait)
        self._estimate_arrival(latency_s)

    def _estimate_arrival(self, latency_s: float) -> None:
        """Record this step's lag and cost from the last header's lag and wait (at a header step: its own). A
        synchronized step without the header (``header_every`` > 1) has no stamps, so its cost is still this rank's
        own share. Without it a beat whose steps carried no
        header had no cost at all, the judge fell back to raw latency, which includes waiting for a straggler, and
        blamed the straggler's punctual peers too (the demo's breaker scene with DSEC_HEADER_EVERY=8). A straggler
        that recovers between headers is seen at the next one."""
        if self._last_arrival is None:
            return
        lag, wait = self._last_arrival
        self.telemetry.record_arrival(lag, max(0.0, latency_s - wait) + lag)

    _last_arrival: tuple[float, float] | None = None

    def _all_reduce_plain(
        self, buf: torch.Tensor, bits: int, last: bool, start: float
    ) -> torch.futures.Future[torch.Tensor]:
        """A bucket without the header: at 32 bits the bucket's own buffer, scaled in place, is all-reduced (as DDP's
        default hook does: no copy in, none out)."""
        import torch

        scale = 1.0 / (self.world * self.accum)
        if bits == 32:
            send = buf if scale == 1.0 else buf.mul_(scale)  # one rank, no accumulation: nothing to scale
        else:
            send = buf.mul(scale).clamp_(-FP16_MAX, FP16_MAX).to(torch.float16)
        nbytes = send.numel() * send.element_size()
        work = self._sum(send)

        def done(fut: torch.futures.Future[Any]) -> torch.Tensor:
            try:
                fut.value()
            except Exception:
                self.telemetry.record_sync(nbytes, time.perf_counter() - start, False)
                raise
            if send is not buf:
                buf.copy_(send)
            if last:
                self._estimate_arrival(time.perf_counter() - start)
                self._synced(None)
            self._finish(buf, last, nbytes, start)
            return buf

        return cast("torch.futures.Future[torch.Tensor]", work.get_future().then(done))

    def _all_reduce(self, buf: torch.Tensor, bits: int, last: bool, start: float) -> torch.futures.Future[torch.Tensor]:
        import torch

        scale = 1.0 / (self.world * self.accum)
        # Scaled in place (the bucket's buffer receives the result anyway): a copy less of the bucket per step,
        # which on a learner with a few MB of gradients in its last bucket is most of what the hook costs.
        send = buf if scale == 1.0 else buf.mul_(scale)
        if bits == 16:
            send = send.clamp_(-FP16_MAX, FP16_MAX).to(torch.float16)
        period = sh.STAMP_PERIOD_MS[bits]
        if last:
            header, stamp = self._header_slots(bits, send.dtype, send.device)  # the bucket's device (a GPU under NCCL)
            stamp.fill_(sh.stamp_now_ms(time.time()) % period)
            send = torch.cat((send, header))
        nbytes = send.numel() * send.element_size()
        work = self._sum(send)
        n = buf.numel()

        def done(fut: torch.futures.Future[Any]) -> torch.Tensor:
            try:
                fut.value()
            except Exception:
                self.telemetry.record_sync(nbytes, time.perf_counter() - start, False)
                raise
            latency = time.perf_counter() - start
            if last:
                self._headers_arrived(send[n:], bits, period, latency)
            if send is not buf:
                buf.copy_(send[:n])
            self._finish(buf, last, nbytes, start)
            return buf

        return cast("torch.futures.Future[torch.Tensor]", work.get_future().then(done))

    def _encode(self, buf: torch.Tensor, bits: int, params: tuple[int, ...]) -> torch.Tensor:
        """This rank's chunk: header + payload (uint8). Applies and updates error feedback."""
        import torch

        x = buf.to(torch.float32)
        use_ef = self.error_feedback and bits < 32
        if use_ef:
            res = self._residual.get(params)
            if res is not None and res.numel() == x.numel():
                x = x + res
        if bits == 32:
            payload = x.contiguous().view(torch.uint8)
            decoded = None
        elif bits == 16:
            half = x.clamp(-FP16_MAX, FP16_MAX).to(torch.float16)
            payload = half.view(torch.uint8)
            decoded = half.to(torch.float32)
        else:
            qt = quant.quantize(x, bits, self.block)
            payload = quant.to_bytes(qt)
            decoded = quant.dequantize(qt)
        if use_ef and decoded is not None:
            self._residual[params] = x - decoded
        header = sh.encode_bytes(self._my_header(time.time()), device=payload.device)
        return torch.cat((header, payload.reshape(-1)))

    def _decode(self, chunk: torch.Tensor, numel: int, bits: int) -> torch.Tensor:
        import torch

        payload = chunk[HEADER_BYTES:]
        if bits == 32:
            return payload.clone().view(torch.float32)
        if bits == 16:
            return payload.clone().view(torch.float16).to(torch.float32)
        return quant.dequantize(quant.from_bytes(payload, numel, bits, self.block))

    def _exchange(
        self, buf: torch.Tensor, params: tuple[int, ...], last: bool, start: float
    ) -> torch.futures.Future[torch.Tensor]:
        import torch

        n = buf.numel()
        bits = self.peer_bits
        mine = self._encode(buf, bits[self.rank], params)
        sizes = [HEADER_BYTES + chunk_bytes(n, b, self.block) for b in bits]
        nbytes = mine.numel()
        if len(set(bits)) == 1:
            outs = [torch.empty(sizes[0], dtype=torch.uint8, device=mine.device) for _ in range(self.world)]
            work = self._c.all_gather(outs, mine, group=self.pg, async_op=True)

            def chunks() -> list[torch.Tensor]:
                return outs
        else:
            out = torch.empty(sum(sizes), dtype=torch.uint8, device=mine.device)
            work = self._c.all_to_all_single(
                out,
                mine.repeat(self.world),
                output_split_sizes=sizes,
                input_split_sizes=[nbytes] * self.world,
                group=self.pg,
                async_op=True,
            )

            def chunks() -> list[torch.Tensor]:
                return list(torch.split(out, sizes))

        def done(fut: torch.futures.Future[Any]) -> torch.Tensor:
            try:
                fut.value()
            except Exception:
                self.telemetry.record_sync(nbytes, time.perf_counter() - start, False)
                raise
            parts = chunks()
            total = torch.zeros(n, dtype=torch.float32, device=buf.device)
            latency = time.perf_counter() - start
            for r, part in enumerate(parts):
                total += self._decode(part, n, bits[r])
            if last:
                self._headers_seen([sh.decode_bytes(part) for part in parts], None, latency)
            buf.copy_(total.div_(self.world * self.accum))
            self._finish(buf, last, nbytes, start)
            return buf

        return cast("torch.futures.Future[torch.Tensor]", work.get_future().then(done))

    def _finish(self, buf: torch.Tensor, last: bool, nbytes: int, start: float) -> None:
        import torch

        if not self.norm_from_clip:
            self._grad_sq += float(torch.linalg.vector_norm(buf).item()) ** 2
        self.telemetry.record_sync(nbytes, time.perf_counter() - start, True, last)
        if last:
            self.grad_norm = None if self.norm_from_clip else self._grad_sq**0.5
            self._grad_sq = 0.0

    grad_norm: float | None = None


def measured_hook(user_hook: Callable[[Any, Any], Any], telemetry: Telemetry) -> Callable[[Any, Any], Any]:
    """Wrap a comm hook the user registered: measure bytes and latency, change nothing else."""

    def hook(state: Any, bucket: Any) -> Any:
        start = time.perf_counter()
        nbytes = bucket.buffer().numel() * bucket.buffer().element_size()
        fut = user_hook(state, bucket)

        def done(f: Any) -> Any:
            try:
                value = f.value()
            except Exception:
                telemetry.record_sync(nbytes, time.perf_counter() - start, False)
                raise
            telemetry.record_sync(nbytes, time.perf_counter() - start, True)
            return value

        return fut.then(done)

    return hook
