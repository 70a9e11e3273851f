"""Reading snapshots back: rebuild a chain (base + deltas), verify every byte, fall back past damage."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import zstandard

from dsec.snapshot import codec
from dsec.snapshot.manifest import CorruptSnapshot, unseal
from dsec.snapshot.store import SnapshotStore, StoreError

if TYPE_CHECKING:
    import torch

MAX_CHAIN = 10_000


@dataclass
class Loaded:
    """A verified snapshot: its manifest and the encoded bytes of every tensor."""

    manifest: dict[str, Any]
    encoded: dict[str, np.ndarray]
    read_s: float = 0.0

    @property
    def seq(self) -> int:
        return int(self.manifest["seq"])

    def tensor(self, name: str) -> torch.Tensor:
        return codec.decode(self.encoded[name], self.manifest["tensors"][name])

    def tensors(self, prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
        for name in self.manifest["tensors"]:
            if name.startswith(prefix):
                yield name, self.tensor(name)

    def decode_all(self) -> dict[str, torch.Tensor]:
        """Every tensor decoded, in parallel."""
        names = list(self.manifest["tensors"])
        with ThreadPoolExecutor(_workers(), thread_name_prefix="dsec-restore") as pool:
            return dict(zip(names, pool.map(self.tensor, names), strict=False))


@dataclass
class Fallback:
    """What a restore had to skip on its way to a good snapshot."""

    skipped: list[tuple[int, str]] = field(default_factory=list)


def read_manifest(store: SnapshotStore, worker: str, seq: int) -> dict[str, Any]:
    try:
        m = unseal(store.get_manifest(worker, seq), where=f"snapshot {worker}/{seq}")
    except StoreError as exc:
        raise CorruptSnapshot(str(exc)) from None
    if m.get("worker") != worker or m.get("seq") != seq:
        raise CorruptSnapshot(f"snapshot {worker}/{seq}: manifest names {m.get('worker')}/{m.get('seq')}")
    check_tensors(m, f"snapshot {worker}/{seq}")
    return m


def check_tensors(m: dict[str, Any], where: str) -> None:
    """The tensor table holds what the codec can decode: known dtypes and encodings, shapes of non-negative ints.
    The checksum proves a manifest is intact, not that whoever sealed it was DSec (snapshot/manifest.py)."""
    tensors = m.get("tensors")
    if not isinstance(tensors, dict):
        raise CorruptSnapshot(f"{where}: no tensor table")
    for name, e in tensors.items():
        if not isinstance(e, dict):
            raise CorruptSnapshot(f"{where}: tensor {name}: not an object")
        if e.get("dtype") not in codec.DTYPES:
            raise CorruptSnapshot(f"{where}: tensor {name}: dtype {e.get('dtype')!r} is not a tensor dtype")
        if e.get("enc") not in codec.ENCODINGS:
            raise CorruptSnapshot(f"{where}: tensor {name}: encoding {e.get('enc')!r} is unknown")
        shape = e.get("shape")
        if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
            raise CorruptSnapshot(f"{where}: tensor {name}: shape {shape!r} is not a list of sizes")


def _chain(store: SnapshotStore, worker: str, seq: int) -> list[dict[str, Any]]:
    """Manifests from the base to ``seq``."""
    chain = [read_manifest(store, worker, seq)]
    while chain[-1]["kind"] == "delta":
        parent = chain[-1]["parent"]
        if not isinstance(parent, int) or parent >= chain[-1]["seq"] or len(chain) > MAX_CHAIN:
            raise CorruptSnapshot(f"snapshot {worker}/{seq}: broken parent link {parent!r}")
        try:
            chain.append(read_manifest(store, worker, parent))
        except CorruptSnapshot as exc:
            raise CorruptSnapshot(f"snapshot {worker}/{seq}: its chain is damaged: {exc}") from None
    chain.reverse()
    return chain


def _chunk(store: SnapshotStore, entry: dict[str, Any], name: str, dctx: zstandard.ZstdDecompressor) -> np.ndarray:
    chunk_id = entry.get("chunk")
    if not isinstance(chunk_id, str):
        raise CorruptSnapshot(f"tensor {name}: no chunk")
    try:
        data = store.get_chunk(chunk_id)
    except StoreError as exc:
        raise CorruptSnapshot(f"tensor {name}: {exc}") from None
    if codec.digest(data) != chunk_id:
        raise CorruptSnapshot(f"tensor {name}: chunk {chunk_id[:12]} is damaged (checksum mismatch)")
    nbytes = int(entry["nbytes"])
    try:
        raw = dctx.decompress(data, max_output_size=nbytes)
    except zstandard.ZstdError as exc:
        raise CorruptSnapshot(f"tensor {name}: chunk {chunk_id[:12]} does not decompress ({exc})") from None
    if len(raw) != nbytes:
        raise CorruptSnapshot(f"tensor {name}: chunk holds {len(raw)} bytes, manifest says {nbytes}")
    return np.frombuffer(raw, dtype=np.uint8)


def _workers() -> int:
    return max(1, min(4, os.cpu_count() or 1))


def load(store: SnapshotStore, worker: str, seq: int) -> Loaded:
    """Snapshot ``worker/seq`` rebuilt from its chain and verified; raises CorruptSnapshot.

    Each tensor is rebuilt from its newest full chunk in the chain plus the deltas after it (superseded chunks
    are not read), tensors in parallel (decompression and hashing release the GIL)."""
    t0 = time.perf_counter()
    chain = _chain(store, worker, seq)
    target = chain[-1]

    def rebuild(name: str) -> np.ndarray:
        links: list[dict[str, Any]] = []
        for m in reversed(chain):
            entry = m["tensors"].get(name)
            if entry is None:
                raise CorruptSnapshot(f"snapshot {worker}/{m['seq']}: tensor {name} refers to a missing parent")
            if entry.get("from_parent"):
                continue
            links.append(entry)
            if not entry.get("delta"):
                break
        else:
            raise CorruptSnapshot(f"snapshot {worker}/{seq}: tensor {name} has no full chunk in its chain")
        dctx = zstandard.ZstdDecompressor()
        full = links.pop()
        data = _chunk(store, full, name, dctx)
        for entry in reversed(links):
            if len(data) != int(entry["nbytes"]):
                raise CorruptSnapshot(f"snapshot {worker}/{seq}: delta of {name} has no matching parent")
            data = codec.undelta(_chunk(store, entry, name, dctx), data, codec.delta_op(entry["enc"]))
        if codec.digest(data) != target["tensors"][name]["sha"]:
            raise CorruptSnapshot(f"snapshot {worker}/{seq}: tensor {name} does not match its checksum")
        return data

    def rebuild_named(name: str) -> np.ndarray:
        try:
            return rebuild(name)
        except CorruptSnapshot as exc:
            msg = str(exc)
            raise CorruptSnapshot(msg if msg.startswith("snapshot ") else f"snapshot {worker}/{seq}: {msg}") from None

    names = list(target["tensors"])
    with ThreadPoolExecutor(_workers(), thread_name_prefix="dsec-restore") as pool:
        encoded = dict(zip(names, pool.map(rebuild_named, names), strict=True))
    return Loaded(target, encoded, time.perf_counter() - t0)


def load_latest(
    store: SnapshotStore, worker: str, at_most: int | None = None, fallback: Fallback | None = None
) -> Loaded | None:
    """The newest snapshot of ``worker`` (at most ``at_most``) that verifies; damaged ones are recorded in
    ``fallback`` and skipped. None when there is no usable snapshot."""
    for seq in reversed(store.manifests(worker)):
        if at_most is not None and seq > at_most:
            continue
        try:
            return load(store, worker, seq)
        except CorruptSnapshot as exc:
            if fallback is not None:
                fallback.skipped.append((seq, str(exc)))
    return None


def verify(store: SnapshotStore, worker: str) -> list[tuple[int, str | None]]:
    """(seq, None when good else the reason) for every snapshot of ``worker``."""
    out: list[tuple[int, str | None]] = []
    for seq in store.manifests(worker):
        reason: str | None = None
        try:
            load(store, worker, seq)
        except CorruptSnapshot as exc:
            reason = str(exc)
        out.append((seq, reason))
    return out
