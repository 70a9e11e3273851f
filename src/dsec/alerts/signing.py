"""HMAC-SHA256 signing for outgoing webhooks, and the check a receiver runs.

The signature covers ``f"{timestamp}.".encode() + body`` so that a captured request cannot be
replayed later (the receiver rejects timestamps outside its tolerance) nor have its body swapped.
The header carries a scheme prefix (``v1=``) so the algorithm can change without breaking
receivers, and may carry several comma-separated signatures so a secret can be rotated without a
window in which either side rejects the other: the sender signs with the old and the new secret,
the receiver accepts any match. Nothing here is specific to alerts; other webhooks reuse it.
"""

from __future__ import annotations

import hashlib
import hmac
import math
from collections.abc import Sequence
from typing import TypeAlias

from dsec.errors import InvalidInput

TIMESTAMP_HEADER = "X-DSec-Timestamp"
SIGNATURE_HEADER = "X-DSec-Signature"
#: A uuid4 hex per notification, the same on every retry, so receivers can drop duplicates.
DELIVERY_HEADER = "X-DSec-Delivery"
EVENT_HEADER = "X-DSec-Event"

SCHEME = "v1"
#: Longer than any epoch-seconds value; keeps a hostile header from reaching int()'s slow paths.
_MAX_TIMESTAMP_CHARS = 20

Secret: TypeAlias = bytes | str


class SignatureError(InvalidInput, ValueError):
    """A webhook request failed verification; the message says which check failed and why."""


def _key(secret: Secret) -> bytes:
    key = secret.encode() if isinstance(secret, str) else secret
    if not key:
        raise ValueError("secret must be non-empty: an empty HMAC key signs nothing")
    return key


def _secrets(secret: Secret | Sequence[Secret]) -> list[bytes]:
    # str and bytes are sequences themselves; one of them is a single secret, not a list of characters.
    items = [secret] if isinstance(secret, (str, bytes)) else list(secret)
    if not items:
        raise ValueError("at least one secret is required")
    return [_key(s) for s in items]


def _digest(key: bytes, timestamp: int, body: bytes) -> str:
    return hmac.new(key, f"{timestamp}.".encode() + body, hashlib.sha256).hexdigest()


def sign(secret: Secret, timestamp: int, body: bytes) -> str:
    """The signature header value for one secret: ``"v1=" + hex(HMAC-SHA256(secret, "<ts>." + body))``."""
    return f"{SCHEME}={_digest(_key(secret), int(timestamp), body)}"


def sign_all(secrets: Secret | Sequence[Secret], timestamp: int, body: bytes) -> str:
    """Comma-separated signatures, one per secret: what a sender puts in the header while rotating."""
    return ",".join(f"{SCHEME}={_digest(k, int(timestamp), body)}" for k in _secrets(secrets))


def verify(
    secret: Secret | Sequence[Secret],
    timestamp_header: str | None,
    signature_header: str | None,
    body: bytes,
    now: float,
    tolerance_s: float = 300.0,
) -> None:
    """Raise ``SignatureError`` unless one of the request's signatures matches one of ``secret``.

    ``secret`` may be several secrets (the receiver's side of a rotation). ``now`` is passed in, not
    read from a clock, so the check is deterministic; the timestamp must lie within ``tolerance_s``
    of it in either direction (a sender's clock may run slightly ahead).
    """
    if not (isinstance(tolerance_s, (int, float)) and math.isfinite(tolerance_s) and tolerance_s >= 0):
        raise ValueError(f"tolerance_s={tolerance_s!r} is invalid: expected a finite number >= 0")
    keys = _secrets(secret)
    raw_ts = (timestamp_header or "").strip()
    if not raw_ts:
        raise SignatureError(f"missing {TIMESTAMP_HEADER} header")
    if len(raw_ts) > _MAX_TIMESTAMP_CHARS or not raw_ts.isascii() or not raw_ts.isdigit():
        raise SignatureError(
            f"malformed {TIMESTAMP_HEADER} header {raw_ts[:_MAX_TIMESTAMP_CHARS]!r}: expected integer epoch seconds"
        )
    timestamp = int(raw_ts)
    skew = now - timestamp
    if skew > tolerance_s:
        raise SignatureError(
            f"stale {TIMESTAMP_HEADER} {timestamp}: {skew:.0f} s old, tolerance is {tolerance_s:g} s (replay?)"
        )
    if -skew > tolerance_s:
        raise SignatureError(
            f"{TIMESTAMP_HEADER} {timestamp} is {-skew:.0f} s in the future, tolerance is {tolerance_s:g} s"
        )
    entries = [e.strip() for e in (signature_header or "").split(",") if e.strip()]
    if not entries:
        raise SignatureError(f"missing {SIGNATURE_HEADER} header")
    candidates = [value for scheme, sep, value in (e.partition("=") for e in entries) if sep and scheme == SCHEME]
    if not candidates:
        schemes = sorted({e.partition("=")[0] if "=" in e else "<none>" for e in entries})
        raise SignatureError(f"no {SCHEME} signature in {SIGNATURE_HEADER} (found schemes: {', '.join(schemes)})")
    expected = [_digest(k, timestamp, body) for k in keys]
    # Compare every pair without stopping early, so timing does not reveal which one matched.
    matched = False
    for candidate in candidates:
        for digest in expected:
            matched |= hmac.compare_digest(candidate.encode(), digest.encode())
    if not matched:
        raise SignatureError(f"{SIGNATURE_HEADER} mismatch: no {SCHEME} signature matches the body and timestamp")
