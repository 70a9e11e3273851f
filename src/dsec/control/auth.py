"""Tokens: generated with ``secrets``, stored only as SHA-256 hashes, compared in constant time.

SHA-256 rather than a slow password hash is deliberate: tokens are 256-bit random strings, so there
is nothing to brute-force, and the check runs on every heartbeat.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

ADMIN_PREFIX = "dsa_"
POOL_PREFIX = "dsp_"
READ_PREFIX = "dsv_"  # read-only ("view"): dashboards, `dsec status`
RUNTIME_PREFIX = "dsr_"
WORKER_PREFIX = "dsw_"
PREFIXES = {"admin": ADMIN_PREFIX, "pool": POOL_PREFIX, "read": READ_PREFIX}


def new_token(prefix: str) -> str:
    return prefix + secrets.token_urlsafe(32)


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def token_id(token_hash: str) -> str:
    """A token's public name (for listing and revoking): the first 64 bits of its hash, which reveal nothing of it."""
    return token_hash[:16]


def same_hash(a: str, b: str) -> bool:
    return hmac.compare_digest(a, b)


def bearer(header: str | None) -> str | None:
    """The token from an ``Authorization: Bearer <token>`` header, or None."""
    if not header:
        return None
    scheme, _, value = header.partition(" ")
    if scheme.lower() != "bearer" or not value.strip():
        return None
    return value.strip()
