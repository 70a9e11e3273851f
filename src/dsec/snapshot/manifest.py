"""Snapshot manifests: what a snapshot contains and how to rebuild it, sealed with a checksum.

A manifest is JSON (format version ``FORMAT``)::

    {"format": 1, "worker": "learner-0", "seq": 42, "kind": "base" | "delta", "parent": 41 | null,
     "base": 40, "created": 1764400000.0, "step": 1200, "mode": {...}, "requests": ["..."],
     "tensors": {"model/fc.weight": {"dtype": "float32", "shape": [64, 4], "enc": "q8", "sqrt": false,
                                     "block": 256, "nbytes": 1088, "sha": "<sha256 of the encoded bytes>",
                                     "chunk": "<sha256 of the chunk file>", "stored": 301,
                                     "delta": true, "from_parent": false}},
     "meta": {...},            # JSON state: RNG (python, numpy), optimizer hyper-parameters, user state
     "stats": {"full_bytes": .., "stored_bytes": .., "blocking_ms": .., "stage_ms": .., "total_ms": ..},
     "checksum": "<sha256 of the canonical JSON of everything above>"}

``delta: true`` means the chunk holds the byte delta against the same tensor's encoded bytes in the parent;
``from_parent: true`` means the encoded bytes are the parent's (unchanged, or optimizer state that the mode
refreshes only in base snapshots) and there is no chunk.

The checksum (and the chunks' sha256 names) detect **corruption, not tampering**: it is an unkeyed hash, so whoever
can write the snapshot directory can rewrite a manifest and seal it again. Protect the directory like the training
job's own files (its owner only); a restore trusts what it finds there. Readers therefore treat manifest fields as
untrusted data all the same (reader.py checks dtypes, encodings and shapes before the codec sees them).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from dsec.errors import StorageError

FORMAT = 1


class CorruptSnapshot(StorageError):
    """A snapshot that cannot be trusted: bad checksum, missing or damaged chunk, unknown format."""


def _canonical(body: dict[str, Any]) -> bytes:
    return json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def seal(body: dict[str, Any]) -> bytes:
    body = {k: v for k, v in body.items() if k != "checksum"}
    body["format"] = FORMAT
    checksum = hashlib.sha256(_canonical(body)).hexdigest()
    return json.dumps({**body, "checksum": checksum}, sort_keys=True, indent=1, allow_nan=False).encode()


def unseal(data: bytes, where: str = "manifest") -> dict[str, Any]:
    try:
        body = json.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        raise CorruptSnapshot(f"{where}: not valid JSON ({exc})") from None
    if not isinstance(body, dict):
        raise CorruptSnapshot(f"{where}: not a JSON object")
    if body.get("format") != FORMAT:
        raise CorruptSnapshot(f"{where}: format {body.get('format')!r} is not supported (expected {FORMAT})")
    checksum = body.pop("checksum", None)
    if checksum != hashlib.sha256(_canonical(body)).hexdigest():
        raise CorruptSnapshot(f"{where}: checksum mismatch")
    return body


def summary(m: dict[str, Any]) -> dict[str, Any]:
    """The fields a listing shows."""
    stats = m.get("stats", {})
    return {
        "id": f"{m['worker']}/{m['seq']}",
        "worker": m["worker"],
        "seq": m["seq"],
        "kind": m["kind"],
        "base": m["base"],
        "parent": m["parent"],
        "created": m["created"],
        "step": m.get("step"),
        "mode": m["mode"]["name"],
        "lossless": bool(m["mode"].get("lossless")),
        "tensors": len(m["tensors"]),
        "full_bytes": stats.get("full_bytes"),
        "stored_bytes": stats.get("stored_bytes"),
        "blocking_ms": stats.get("blocking_ms"),
        "total_ms": stats.get("total_ms"),
    }
