"""Retention, garbage collection, listing and compaction of snapshot chains."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import zstandard

from dsec.snapshot import codec
from dsec.snapshot.manifest import CorruptSnapshot, seal, summary
from dsec.snapshot.reader import load, read_manifest
from dsec.snapshot.store import SnapshotStore


def listing(store: SnapshotStore, worker: str) -> list[dict[str, Any]]:
    """Summaries of ``worker``'s snapshots, oldest first; unreadable manifests are listed with their error."""
    out: list[dict[str, Any]] = []
    for seq in store.manifests(worker):
        try:
            out.append(summary(read_manifest(store, worker, seq)))
        except CorruptSnapshot as exc:
            out.append({"id": f"{worker}/{seq}", "worker": worker, "seq": seq, "error": str(exc)})
    return out


def collect_garbage(
    store: SnapshotStore, worker: str, *, keep_chains: int = 2, grace_s: float = 600.0
) -> dict[str, int]:
    """Drop ``worker``'s chains older than the newest ``keep_chains`` (a chain = a base and its deltas), then every
    chunk no manifest of any worker references and that was not written or reused in the last ``grace_s``.

    The older chains are what a restore falls back to when the newest is damaged, so keep at least 2."""
    bases: dict[int, int] = {}  # seq -> base
    for seq in store.manifests(worker):
        try:
            bases[seq] = int(read_manifest(store, worker, seq)["base"])
        except CorruptSnapshot:
            bases[seq] = -1  # unreadable
    # A chain is as recent as its newest member (a compacted base can be older than a chain's later deltas).
    newest: dict[int, int] = {}
    for seq, base in bases.items():
        if base >= 0:
            newest[base] = max(newest.get(base, -1), seq)
    kept = set(sorted(newest, key=newest.__getitem__)[-keep_chains:])
    oldest_kept = min((min(s for s, b in bases.items() if b == k) for k in kept), default=0)
    dropped = 0
    # Newest first, so that a crash midway never leaves a delta whose base is already gone. Unreadable manifests
    # go once they are older than every kept chain.
    for seq in sorted(bases, reverse=True):
        base = bases[seq]
        if (base >= 0 and base not in kept) or (base < 0 and seq < oldest_kept):
            store.delete_manifest(worker, seq)
            dropped += 1
    chunks_removed = 0
    referenced: set[str] = set()
    for w in store.workers():
        for seq in store.manifests(w):
            try:
                m = read_manifest(store, w, seq)
            except CorruptSnapshot:
                continue
            referenced.update(e["chunk"] for e in m["tensors"].values() if e.get("chunk"))
    cutoff = time.time() - grace_s
    for chunk_id, mtime in list(store.chunks()):
        if chunk_id not in referenced and mtime < cutoff:
            store.delete_chunk(chunk_id)
            chunks_removed += 1
    return {"manifests_removed": dropped, "chunks_removed": chunks_removed}


def compact(
    store: SnapshotStore,
    worker: str,
    seq: int,
    zstd_level: int = 3,
    on_progress: Callable[[int, int], None] | None = None,
) -> int:
    """Write snapshot ``worker/seq`` again as a self-contained base (one manifest, full chunks), so restoring it
    reads no chain. Returns the new snapshot's number; the old chain stays until retention drops it.

    ``on_progress(tensors written, tensors)``: once the chain is read and verified, then after every tensor."""
    loaded = load(store, worker, seq)
    cctx = zstandard.ZstdCompressor(level=zstd_level)
    entries: dict[str, dict[str, Any]] = {}
    stored = 0
    total = len(loaded.manifest["tensors"])
    if on_progress is not None:
        on_progress(0, total)
    for name, entry in loaded.manifest["tensors"].items():
        data = cctx.compress(loaded.encoded[name].tobytes())
        chunk_id = codec.digest(data)
        if not store.has_chunk(chunk_id):
            store.put_chunk(chunk_id, data)
        entries[name] = {**entry, "delta": False, "from_parent": False, "chunk": chunk_id, "stored": len(data)}
        stored += len(data)
        if on_progress is not None:
            on_progress(len(entries), total)
    existing = store.manifests(worker)
    new_seq = existing[-1] + 1 if existing else seq + 1
    body = {
        **loaded.manifest,
        "seq": new_seq,
        "kind": "base",
        "parent": None,
        "base": new_seq,
        "created": time.time(),
        "tensors": entries,
        "compacted_from": seq,
        "stats": {**loaded.manifest.get("stats", {}), "stored_bytes": stored},
    }
    store.put_manifest(worker, new_seq, seal(body))
    return new_seq
