"""The write path of a snapshot, on the snapshotter's background thread (snapshotter.py captures a job on the training
thread and hands it over): stage the captured tensors, encode each one and store it as a content-addressed chunk (a
delta against the previous snapshot's encoded bytes when that pays), then publish the sealed manifest.

The previous snapshot's encoded bytes and entries (the reference for deltas) are the snapshotter's; they are read
here, and the snapshotter replaces them once the manifest is published."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import zstandard

from dsec.snapshot import codec
from dsec.snapshot.manifest import seal
from dsec.snapshot.store import SnapshotStore

if TYPE_CHECKING:
    from dsec.snapshot.snapshotter import _Job


@dataclass
class Encoded:
    """A job's tensors as written: each one's manifest entry and encoded bytes (the next delta's reference), and the
    byte counts for the snapshot's stats."""

    entries: dict[str, dict[str, Any]] = field(default_factory=dict)
    encoded: dict[str, np.ndarray] = field(default_factory=dict)
    full_bytes: int = 0
    stored_bytes: int = 0


def stage(job: _Job) -> tuple[dict[str, codec.Staged], float]:
    """The job's tensors staged for encoding, and how long the step gate stayed closed for them (seconds)."""
    t_stage = time.perf_counter()
    try:
        # Only a plain copy while the step gate is closed: one memory pass, faster than quantizing (several
        # passes), so the next optimizer step waits as little as possible. Quantization reads the copy later.
        copies = [(item, codec.host_copy(item.tensor) if item.lazy else item.tensor) for item in job.items]
    finally:
        job.staged.set()  # the training thread may step again
    stage_s = time.perf_counter() - t_stage
    job.items = []  # drop references to live tensors
    staged = {item.name: codec.stage(t, item.bits, nonneg_sqrt=item.sqrt) for item, t in copies}
    return staged, stage_s


def encode(
    job: _Job,
    staged: dict[str, codec.Staged],
    last_encoded: dict[str, np.ndarray],
    last_entries: dict[str, dict[str, Any]],
    store: SnapshotStore,
    cctx: zstandard.ZstdCompressor,
) -> Encoded:
    """Encode every staged tensor and store the chunks not stored yet; a delta job refers to ``last_encoded`` and
    ``last_entries`` (the previous snapshot) for unchanged tensors and deltas. Carried tensors keep their entries."""
    delta = job.kind == "delta"
    out = Encoded()
    for name, st in staged.items():
        enc = st.encoded()
        prev = last_encoded.get(name) if delta else None
        prev_entry = last_entries.get(name) if delta else None
        entry = _entry(st, enc, prev, prev_entry, store, cctx)
        out.full_bytes += int(np.prod(st.shape, dtype=np.int64)) * _itemsize(st.dtype)
        out.stored_bytes += entry.get("stored", 0)
        out.entries[name] = entry
        out.encoded[name] = enc
    for name, entry in job.carried.items():
        out.entries[name] = {**entry, "delta": False, "from_parent": True, "chunk": None, "stored": 0}
        out.encoded[name] = last_encoded[name]
        out.full_bytes += int(np.prod(entry["shape"], dtype=np.int64)) * _itemsize(entry["dtype"])
    return out


def _entry(
    st: codec.Staged,
    enc: np.ndarray,
    prev: np.ndarray | None,
    prev_entry: dict[str, Any] | None,
    store: SnapshotStore,
    cctx: zstandard.ZstdCompressor,
) -> dict[str, Any]:
    """A tensor's manifest entry: unchanged from the parent (same digest), or written as a chunk."""
    sha = codec.digest(enc)
    entry: dict[str, Any] = {
        "dtype": st.dtype,
        "shape": list(st.shape),
        "enc": st.enc,
        "sqrt": st.sqrt,
        "block": st.q.block if st.q is not None else None,
        "nbytes": int(enc.nbytes),
        "sha": sha,
        "delta": False,
        "from_parent": False,
    }
    if prev is not None and prev_entry is not None and prev_entry["sha"] == sha:
        entry["from_parent"] = True
        return entry
    data, entry["delta"] = _chunk_bytes(st, enc, prev, prev_entry, cctx)
    chunk_id = codec.digest(data)
    if not store.has_chunk(chunk_id):
        store.put_chunk(chunk_id, data)
    entry["chunk"] = chunk_id
    entry["stored"] = len(data)
    return entry


def _chunk_bytes(
    st: codec.Staged,
    enc: np.ndarray,
    prev: np.ndarray | None,
    prev_entry: dict[str, Any] | None,
    cctx: zstandard.ZstdCompressor,
) -> tuple[bytes, bool]:
    """A tensor's chunk, compressed, and whether it is a delta against ``prev`` (same encoding and size) or the full
    encoded bytes."""
    can_delta = prev is not None and prev_entry is not None and prev_entry["enc"] == st.enc
    if can_delta and prev is not None and prev.nbytes == enc.nbytes:
        data = cctx.compress(codec.delta(enc, prev, codec.delta_op(st.enc)).tobytes())
        if len(data) > 0.9 * enc.nbytes:
            # A delta that barely compresses (raw floats that all moved) costs as much as the full
            # bytes but lengthens every restore's chain: store the full bytes when they are smaller.
            full = cctx.compress(enc.tobytes())
            if len(full) <= len(data):
                return full, False
        return data, True
    return cctx.compress(enc.tobytes()), False


def stats(job: _Job, out: Encoded, stage_s: float) -> dict[str, Any]:
    """The snapshot's stats as its manifest records them."""
    total_s = time.perf_counter() - job.started
    return {
        "full_bytes": out.full_bytes,
        "stored_bytes": out.stored_bytes,
        "blocking_ms": round(job.ticket.blocking_s * 1e3, 3),
        "stage_ms": round(stage_s * 1e3, 3),
        "total_ms": round(total_s * 1e3, 3),
    }


def manifest_body(worker: str, job: _Job, entries: dict[str, dict[str, Any]], stats: dict[str, Any]) -> dict[str, Any]:
    mode = job.mode
    return {
        "worker": worker,
        "seq": job.seq,
        "kind": job.kind,
        "parent": job.parent,
        "base": job.base,
        "created": time.time(),
        "step": job.step,
        "mode": {**mode.as_dict(), "lossless": mode.lossless},
        "requests": job.ticket.requests,
        "tensors": entries,
        "meta": job.meta,
        "stats": stats,
    }


def publish(store: SnapshotStore, worker: str, job: _Job, body: dict[str, Any], next_seq: Callable[[], int]) -> None:
    """Seal ``body`` and write it as manifest ``job.seq``; when that number is taken, under the next one
    (``next_seq``), ``job`` and ``body`` updated to it."""
    manifest = seal(body)
    while True:
        try:
            store.put_manifest(worker, job.seq, manifest)
            break
        except FileExistsError:
            # Another writer (a previous incarnation, a compaction) took this number: use the next one.
            job.seq = next_seq()
            if job.kind == "base":
                job.base = job.seq
            body.update(seq=job.seq, base=job.base)
            manifest = seal(body)


def _itemsize(dtype: str) -> int:
    import torch

    return int(torch.empty(0, dtype=codec.torch_dtype(dtype)).element_size())
