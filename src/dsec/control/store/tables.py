"""Table definitions (SQLAlchemy Core). The schema itself is created and evolved by the Alembic
migrations beside this module; this is the query-side view of the current head revision."""

from __future__ import annotations

from sqlalchemy import JSON, BigInteger, Column, Float, Index, Integer, MetaData, String, Table, Text

metadata = MetaData()

pools = Table(
    "pools",
    metadata,
    Column("name", String(128), primary_key=True),
    Column("spec", JSON, nullable=False),
    Column("updated_at", Float, nullable=False),
)

devices = Table(
    "devices",
    metadata,
    Column("id", String(128), primary_key=True),
    Column("spec", JSON, nullable=False),
    Column("updated_at", Float, nullable=False),
)

workers = Table(
    "workers",
    metadata,
    Column("id", String(64), primary_key=True),
    Column("pool", String(128), nullable=False, index=True),
    Column("info", JSON, nullable=False),
    Column("state", String(16), nullable=False),
    Column("token_hash", String(64), nullable=False),
    Column("registered_at", Float, nullable=False),
    Column("last_beat_at", Float, nullable=False),
    Column("last_seq", BigInteger, nullable=False),
    Column("acked_version", Integer, nullable=False),
    Column("beats", BigInteger, nullable=False),
    Column("metrics", JSON, nullable=False),
)

directives = Table(
    "directives",
    metadata,
    Column("worker_id", String(64), primary_key=True),
    Column("version", Integer, nullable=False),
    Column("fields", JSON, nullable=False),
    Column("updated_at", Float, nullable=False),
)

events = Table(
    "events",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("ts", Float, nullable=False),
    Column("type", String(32), nullable=False),
    Column("worker_id", String(64), nullable=True),
    Column("pool", String(128), nullable=True),
    Column("data", JSON, nullable=False),
    Index("ix_events_worker_id", "worker_id", "id"),
    Index("ix_events_pool_id", "pool", "id"),
    Index("ix_events_type_id", "type", "id"),
    Index("ix_events_ts", "ts"),
    # Ids are cursors (GET /v1/events?after=, the cost ledger): never reused after retention (migration 0005).
    sqlite_autoincrement=True,
)

tokens = Table(
    "tokens",
    metadata,
    Column("token_hash", String(64), primary_key=True),
    Column("pool", String(128), nullable=True),
    Column("kind", String(16), nullable=False),
    Column("label", Text, nullable=False),
    Column("created_at", Float, nullable=False),
)

runtimes = Table(
    "runtimes",
    metadata,
    Column("id", String(64), primary_key=True),
    Column("name", String(128), nullable=False),
    Column("type", String(64), nullable=False),
    Column("callback_url", Text, nullable=False),
    Column("secret", Text, nullable=False),
    Column("token_hash", String(64), nullable=False),
    Column("pool", String(128), nullable=True),
    Column("registered_at", Float, nullable=False),
    Column("report", JSON, nullable=False),
    Column("reported_at", Float, nullable=True),
)

placements = Table(
    "placements",
    metadata,
    Column("job", String(128), primary_key=True),
    Column("pool", String(128), nullable=True),
    Column("placement", JSON, nullable=False),  # dsec.scheduler.placement.Placement.to_dict()
    Column("placed_at", Float, nullable=False),
)

# Every applied policy text, one row per version (the newest is in force); versions are given by the control plane
# (the highest + 1), so two control planes applying at once conflict instead of one silently winning.
policy_versions = Table(
    "policy_versions",
    metadata,
    Column("version", Integer, primary_key=True, autoincrement=False),
    Column("text", Text, nullable=False),
    Column("source", String(256), nullable=False),
    Column("applied_at", Float, nullable=False),
)
