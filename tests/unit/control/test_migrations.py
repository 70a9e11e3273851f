"""Data migrations of the control plane's store, from a database left by an older version."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import sqlalchemy as sa
from alembic import command
from alembic.config import Config

from dsec.control.store import open_store
from dsec.control.store.sql import _MIGRATIONS


def _at_revision(url: str, revision: str) -> sa.Engine:
    engine = sa.create_engine(url)
    cfg = Config()
    cfg.set_main_option("script_location", str(_MIGRATIONS))
    with engine.begin() as conn:
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, revision)
    return engine


def _fields(bits: Any) -> dict[str, Any]:
    return {"compression_bits": bits, "grad_accum_steps": 1, "async_sampling": True, "precision": "fp32"}


def test_directive_32_written_when_it_meant_default_becomes_null(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'old.db'}"
    engine = _at_revision(url, "0002_runtimes")
    directives = sa.table(
        "directives",
        sa.column("worker_id", sa.String),
        sa.column("version", sa.Integer),
        sa.column("fields", sa.JSON),
        sa.column("updated_at", sa.Float),
    )
    with engine.begin() as conn:
        conn.execute(
            sa.insert(directives),
            [
                {"worker_id": "w-default", "version": 1, "fields": _fields(32), "updated_at": 1.0},
                {"worker_id": "w-eight", "version": 3, "fields": _fields(8), "updated_at": 2.0},
            ],
        )
    engine.dispose()
    store = open_store(url)  # migrates to the newest revision
    try:
        got = {d.worker_id: d.fields.compression_bits for d in store.list_directives()}
    finally:
        store.close()
    assert got == {"w-default": None, "w-eight": 8}


def test_a_database_before_placements_and_policies_keeps_its_data_and_gains_empty_tables(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'old.db'}"
    engine = _at_revision(url, "0003_compression_bits_default")
    pools = sa.table(
        "pools", sa.column("name", sa.String), sa.column("spec", sa.JSON), sa.column("updated_at", sa.Float)
    )
    with engine.begin() as conn:
        conn.execute(sa.insert(pools), [{"name": "pool-a", "spec": {"name": "pool-a"}, "updated_at": 1.0}])
    engine.dispose()
    store = open_store(url)  # 0004: placements and policy_versions
    try:
        assert [p.name for p in store.list_pools()] == ["pool-a"]
        assert store.list_placements() == [] and store.current_policy() is None
    finally:
        store.close()


def test_event_ids_are_never_reused_after_retention_deleted_the_newest(tmp_path: Path) -> None:
    """An event id is a cursor (``GET /v1/events?after=``, the cost ledger): once retention has deleted every event
    (or the newest), the next event must still get an id above every id handed out. A database from before 0005 keeps
    its events and ids and gains that."""
    from dsec.control.store import WriteBatch
    from dsec.model import Event, EventType

    url = f"sqlite:///{tmp_path / 'old.db'}"
    engine = _at_revision(url, "0004_placements_policies")
    events = sa.table(
        "events",
        sa.column("id", sa.Integer),
        sa.column("ts", sa.Float),
        sa.column("type", sa.String),
        sa.column("worker_id", sa.String),
        sa.column("pool", sa.String),
        sa.column("data", sa.JSON),
    )
    with engine.begin() as conn:
        conn.execute(sa.insert(events), [{"ts": 1.0 + i, "type": "log", "worker_id": "w", "pool": "p", "data": {}}
                                         for i in range(3)])  # fmt: skip
    engine.dispose()
    store = open_store(url)  # migrates to the newest revision
    try:
        from dsec.control.store import EventQuery

        assert [e.id for e in store.query_events(EventQuery())] == [1, 2, 3]  # kept, with their ids
        assert store.prune_events(before=10.0) == 3  # retention deleted every event
        store.write(WriteBatch(events=[Event(ts=20.0, type=EventType.LOG, worker_id="w", pool="p", data={})]))
        (fresh,) = store.query_events(EventQuery())
        assert fresh.id is not None and fresh.id > 3, fresh.id  # plain SQLite rowids would hand out 1 again
    finally:
        store.close()
