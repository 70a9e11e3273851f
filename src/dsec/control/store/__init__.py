"""Persistence for the control plane. ``open_store(url)`` picks a backend by URL scheme."""

from __future__ import annotations

from dsec.control.store.api import (
    EventQuery,
    HotRow,
    PlacementRow,
    PolicyRow,
    RuntimeRow,
    Store,
    StoreConflict,
    StoreError,
    StoreUnavailable,
    TokenRow,
    WorkerRow,
    WriteBatch,
)


def open_store(url: str) -> Store:
    """Open (and migrate) the store at ``url`` — any SQLAlchemy URL: sqlite:///..., postgresql+psycopg://..."""
    from dsec.control.store.sql import SqlStore

    store = SqlStore(url)
    store.migrate()
    return store


__all__ = [
    "EventQuery",
    "HotRow",
    "PlacementRow",
    "PolicyRow",
    "RuntimeRow",
    "Store",
    "StoreConflict",
    "StoreError",
    "StoreUnavailable",
    "TokenRow",
    "WorkerRow",
    "WriteBatch",
    "open_store",
]
