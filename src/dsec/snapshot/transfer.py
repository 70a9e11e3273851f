"""A verified snapshot, packed to travel between ranks and checked again on arrival.

Used by the rank-agreed restore (probe/agreed_restore.py) when the newest snapshot that verifies is held by some ranks
of a group only: the rank that holds it sends it to the others, so every rank restores the same step. What travels
is the snapshot as the reader rebuilt it: the sealed manifest (its checksum) and the encoded bytes of every tensor,
in the manifest's order. The receiver checks the manifest's checksum, its tensor table, and every tensor's sha256
against the manifest before anything is used — the same checks a restore from disk makes — so a damaged transfer
raises :class:`CorruptSnapshot` and nothing is applied. No pickle: the wire carries JSON and raw bytes only.
"""

from __future__ import annotations

import numpy as np

from dsec.snapshot import codec
from dsec.snapshot.manifest import CorruptSnapshot, seal, unseal
from dsec.snapshot.reader import Loaded, check_tensors

RNG_PREFIX = "rng/"


def pack(loaded: Loaded) -> tuple[bytes, np.ndarray]:
    """(sealed manifest, the encoded tensors concatenated in the manifest's order)."""
    parts = []
    for name, entry in loaded.manifest["tensors"].items():
        data = loaded.encoded[name]
        if data.size != int(entry["nbytes"]):
            raise CorruptSnapshot(f"tensor {name}: {data.size} encoded bytes, manifest says {entry['nbytes']}")
        parts.append(data)
    flat = np.concatenate(parts) if parts else np.empty(0, dtype=np.uint8)
    return seal(loaded.manifest), flat


def unpack(sealed: bytes, flat: np.ndarray, where: str = "received snapshot") -> Loaded:
    """The snapshot :func:`pack` sent, verified byte for byte (raises CorruptSnapshot)."""
    manifest = unseal(sealed, where=where)
    check_tensors(manifest, where)
    encoded: dict[str, np.ndarray] = {}
    at = 0
    for name, entry in manifest["tensors"].items():
        n = entry.get("nbytes")
        if type(n) is not int or n < 0:
            raise CorruptSnapshot(f"{where}: tensor {name}: nbytes {n!r} is not a size")
        data = flat[at : at + n]
        if data.size != n:
            raise CorruptSnapshot(f"{where}: tensor {name}: {data.size} bytes received, {n} expected")
        if codec.digest(np.ascontiguousarray(data)) != entry.get("sha"):
            raise CorruptSnapshot(f"{where}: tensor {name} does not match its checksum")
        encoded[name] = data
        at += n
    if at != flat.size:
        raise CorruptSnapshot(f"{where}: {flat.size - at} bytes more than the manifest's tensors")
    return Loaded(manifest, encoded)


def without_rng(loaded: Loaded) -> Loaded:
    """The snapshot less its random-number states: a rank restoring a peer's snapshot keeps its own streams (a copy
    of the peer's generators would make it draw the same actions and minibatches as that peer)."""
    m = loaded.manifest
    tensors = {n: e for n, e in m["tensors"].items() if not n.startswith(RNG_PREFIX)}
    manifest = {**m, "meta": {**m.get("meta", {}), "rng": {}}, "tensors": tensors}
    return Loaded(manifest, {n: loaded.encoded[n] for n in tensors}, loaded.read_s)
