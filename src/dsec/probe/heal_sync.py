"""The DDP comm hook under healing: one collective per synchronized step, on the elastic group.

Differences from the plain hook (ddp.py), and why:

- **One op per step.** Buckets are held until the last one, then the whole gradient goes as one collective. A
  healing member must be able to run an interrupted collective again from its original inputs, and to be exactly
  one collective behind or level with its peers; several buckets in flight at once would break both. The cost is
  the overlap of communication with the rest of ``backward()`` (measured in docs/benchmarks.md).
- **Parameter order, not bucket order.** The flat gradient lists parameters in the model's order. DDP rebuilds its
  buckets after its first iteration (in the order gradients became ready): a replacement's first iterations use
  the initial layout while its peers use the rebuilt one, so bucket order would add up different parameters.
- **Headers by logical rank.** The header slots are laid out for the job's world size, whoever is present; a dead
  rank's slots stay zero (no ``Flag.PRESENT``) and it takes part in no decision.
- **The average is over contributors.** Gradients are pre-scaled by ``1 / (world * accum)`` as before, then scaled
  by ``world / contributors`` once the headers say how many contributed: the survivors of a failure, and not a
  replacement in its first period (``Flag.CONTRIBUTES``: its first rollout came from its own untrained weights).
- **Admission and settings** ride in the header too: ``Flag.JOIN_KNOWN`` + ``admit`` (elastic.py), and the optimizer
  hyper-parameter digests; when they differ the group keeps its oldest member's settings (applied at the next
  optimizer step).
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from dsec import quant
from dsec.probe import sync_header as sh
from dsec.probe.ddp import FP16_MAX, SyncCoordinator, chunk_bytes
from dsec.probe.elastic import ElasticGroup
from dsec.probe.epoch import Epoch

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)


class HealingSync(SyncCoordinator):
    def __init__(self, *args: Any, elastic: ElasticGroup, params: list[Any], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.elastic = elastic
        self.order = {id(p): i for i, p in enumerate(params)}  # canonical: the model's parameter order
        self._bufs: list[torch.Tensor] = []
        self._futs: list[Any] = []
        self._grads: dict[int, torch.Tensor] = {}  # canonical index -> the parameter's gradient view in its bucket
        self._admit: int | None = None
        self.hyper_reference: int | None = None  # logical rank whose optimizer settings the group keeps

    def _start_cycle(self) -> None:
        # Only present ranks' headers change the agreed settings (a dead rank's zeros would read as "0 bits").
        if self._seen is not None:
            self.peer_bits = [b if b else self.peer_bits[r] for r, (b, _) in enumerate(self._seen)]
            self.accum = max(1, max(a for _, a in self._seen))
            self._seen = None
        self.actuators.confirm(self.peer_bits[self.rank], self.accum)
        self._my_desired = self.actuators.declare()
        if self.guard is not None:
            self._my_extras = self.guard.extras()
        self._admit = self.elastic.next_admission()

    def hook(self, _state: object, bucket: Any) -> torch.futures.Future[torch.Tensor]:
        import torch

        buf, last = self._prelude(bucket)
        fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        if not self._sync_now:
            fut.set_result(buf)
            return fut
        self._bufs.append(buf)
        self._futs.append(fut)
        for p, g in zip(bucket.parameters(), bucket.gradients(), strict=True):
            self._grads[self.order[id(p)]] = g
        if not last:
            return fut
        self._late()
        grads = [self._grads[i] for i in sorted(self._grads)]
        op = GradSyncOp(self, grads, self._bufs, self._futs, tuple(sorted(self._grads)))
        self._bufs, self._futs, self._grads = [], [], {}
        bufs, futs = op.bufs, op.futs

        def done(f: Any) -> None:
            # DDP's backward is released here, when the group's future completes: after the op is recorded in the
            # group's sequence of collectives (ElasticGroup._complete). Released from finish() instead, the training
            # thread could issue, complete and record its next collective first (a lone survivor's ops complete at
            # once) and the sequence would lose its period: no admission point for a replacement.
            try:
                f.value()
            except Exception as exc:
                for bf in futs:
                    if not bf.done():
                        bf.set_exception(exc)
                return
            for buf, bf in zip(bufs, futs, strict=True):
                if not bf.done():
                    bf.set_result(buf)

        self.elastic.submit(op).then(done)
        return fut

    def headers_seen(self, headers: list[sh.Header], latency_s: float, period_ms: float | None) -> None:
        present = [r for r, h in enumerate(headers) if h.has(sh.Flag.PRESENT)]
        self._seen = [(h.bits, h.accum) if r in present else (0, 0) for r, h in enumerate(headers)]
        if self.rank in present:
            stamps = [headers[r].stamp for r in present]
            deltas = sh.circle_deltas(stamps, headers[self.rank].stamp, period_ms)
            self.telemetry.record_arrival(-min(deltas), max(0.0, latency_s - max(deltas)) - min(deltas))
        self._synced(headers)
        proposals = {headers[r].admit for r in present if headers[r].has(sh.Flag.JOIN_KNOWN)}
        if proposals and self.elastic.journaling:
            self.elastic.journal(f"proposals {[(r, headers[r].admit, headers[r].flags) for r in present]}")
        if len(proposals) == 1 and all(headers[r].has(sh.Flag.JOIN_KNOWN) for r in present):
            # Every member knew of the waiting replacement and proposed the same point: arm the admission.
            here = self.elastic.seq.position  # this sync's own index (not yet counted): proposals lie after it
            self.elastic.arm_admission(here + ((proposals.pop() - here) % (sh.MASK24 + 1)))
        if len({headers[r].hyper for r in present}) > 1:
            # The oldest member's settings win, not the majority's: differences come from replacements whose
            # script restarted its own counters (several replacements can outnumber the survivors).
            self.hyper_reference = self.elastic.reference_rank(present)
        else:
            self.hyper_reference = None


class GradSyncOp:
    """One synchronized step's gradient (all buckets) as an op of the elastic group."""

    sig: str | None = "grad"

    def __init__(
        self,
        coord: HealingSync,
        grads: list[torch.Tensor],
        bufs: list[torch.Tensor],
        futs: list[Any],
        params: tuple[int, ...],
    ) -> None:
        import torch

        self.c = coord
        self.grads, self.bufs, self.futs, self.params = grads, bufs, futs, params
        self.flat = torch.cat([g.detach().reshape(-1).to(torch.float32) for g in grads])  # kept for a re-run
        self.n = self.flat.numel()
        self.start = time.perf_counter()
        self._chunk: torch.Tensor | None = None  # this rank's encoded chunk (error feedback applied once)
        self._chunk_shadow: bool | None = None
        self.path = ""
        self.out: list[torch.Tensor] = []
        self.sizes: list[int] = []
        self.members: tuple[int, ...] = ()

    # -- issuing ------------------------------------------------------------------------------------------------
    def issue(self, ep: Epoch) -> Any:
        import torch
        import torch.distributed as dist

        c = self.c
        self.start = time.perf_counter()
        self.members = ep.members
        bits = [c.peer_bits[r] for r in ep.members]
        header = c._my_header(0.0, contributes=not ep.shadow, admit=c._admit or 0)
        if all(b == 32 for b in bits) or all(b == 16 for b in bits):
            self.path, b = "all_reduce", bits[0]
            send = torch.zeros_like(self.flat) if ep.shadow else self.flat * (1.0 / (c.world * c.accum))
            if b == 16:
                send = send.clamp_(-FP16_MAX, FP16_MAX).to(torch.float16)
            slots = sh.encode_slots(header, c.rank, c.world, b, send.dtype, sh.stamp_now_ms(time.time()))
            self.out = [torch.cat((send, slots))]
            return ep.pg.allreduce(self.out, dist.AllreduceOptions())  # SUM
        mine = self._encoded(bits[ep.pg_rank], ep.shadow, header)
        self.sizes = [sh.HEADER_BYTES + chunk_bytes(self.n, b, c.block) for b in bits]
        if len(set(self.sizes)) == 1:
            self.path = "all_gather"
            self.out = [torch.empty(self.sizes[0], dtype=torch.uint8) for _ in ep.members]
            return ep.pg.allgather([self.out], [mine])
        self.path = "all_to_all"
        self.out = [torch.empty(sum(self.sizes), dtype=torch.uint8)]
        return ep.pg.alltoall_base(
            self.out[0],
            mine.repeat(len(ep.members)),
            self.sizes,
            [mine.numel()] * len(ep.members),
            dist.AllToAllOptions(),
        )

    def _encoded(self, bits: int, shadow: bool, header: sh.Header) -> torch.Tensor:
        import torch

        if self._chunk is None or self._chunk_shadow != shadow:
            if shadow:
                x = torch.zeros_like(self.flat)
                payload = self._raw(x, bits)
            else:
                payload = self.c._encode(self.flat, bits, self.params)[sh.HEADER_BYTES :]
            self._chunk, self._chunk_shadow = payload, shadow
        return torch.cat((sh.encode_bytes(replace(header, stamp=time.time())), self._chunk))

    def _raw(self, x: torch.Tensor, bits: int) -> torch.Tensor:
        import torch

        if bits == 32:
            return x.contiguous().view(torch.uint8)
        if bits == 16:
            return x.to(torch.float16).view(torch.uint8)
        return quant.to_bytes(quant.quantize(x, bits, self.c.block))

    # -- results ------------------------------------------------------------------------------------------------
    def result(self) -> list[torch.Tensor]:
        return self.out

    def accept(self, tensors: list[torch.Tensor]) -> None:
        for dst, src in zip(self.out, tensors, strict=True):
            dst.copy_(src)

    def finish(self) -> Any:
        import torch

        c = self.c
        latency = time.perf_counter() - self.start
        if self.path == "all_reduce":
            send = self.out[0]
            b = 32 if send.dtype == torch.float32 else 16
            headers = sh.decode_slots(send[self.n :], c.world, b)
            contributors = sum(1 for h in headers if h.has(sh.Flag.CONTRIBUTES))
            total = send[: self.n].to(torch.float32) * (c.world / max(1, contributors))
            nbytes = send.numel() * send.element_size()
            period: float | None = sh.STAMP_PERIOD_MS[b]
        else:
            parts = self.out if self.path == "all_gather" else list(torch.split(self.out[0], self.sizes))
            by_rank = {m: sh.decode_bytes(part) for m, part in zip(self.members, parts, strict=True)}
            headers = [by_rank.get(r, sh.Header(0, 0)) for r in range(c.world)]
            total = torch.zeros(self.n, dtype=torch.float32)
            contributors = 0
            for m, part in zip(self.members, parts, strict=True):
                if by_rank[m].has(sh.Flag.CONTRIBUTES):
                    total += c._decode(part, self.n, c.peer_bits[m])
                    contributors += 1
            total.div_(max(1, contributors) * c.accum)
            nbytes = sh.HEADER_BYTES + (self._chunk.numel() if self._chunk is not None else 0)
            period = None
        c.headers_seen(headers, latency, period)
        at = 0
        for g in self.grads:  # views into the bucket buffers
            k = g.numel()
            g.copy_(total[at : at + k].view(g.shape).to(g.dtype))
            at += k
        c._grad_sq = float(torch.linalg.vector_norm(total).item()) ** 2
        c.telemetry.record_sync(nbytes, latency, True, last=True)  # the step's one collective: its wait
        c.grad_norm = c._grad_sq**0.5
        c._grad_sq = 0.0
        return None  # the bucket futures are completed once the group has recorded this op (HealingSync.hook)
