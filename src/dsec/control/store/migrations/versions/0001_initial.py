"""Initial schema: pools, devices, workers, directives, events, tokens.

Revision ID: 0001
Revises:
"""

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "pools",
        sa.Column("name", sa.String(128), primary_key=True),
        sa.Column("spec", sa.JSON, nullable=False),
        sa.Column("updated_at", sa.Float, nullable=False),
    )
    op.create_table(
        "devices",
        sa.Column("id", sa.String(128), primary_key=True),
        sa.Column("spec", sa.JSON, nullable=False),
        sa.Column("updated_at", sa.Float, nullable=False),
    )
    op.create_table(
        "workers",
        sa.Column("id", sa.String(64), primary_key=True),
        sa.Column("pool", sa.String(128), nullable=False),
        sa.Column("info", sa.JSON, nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("token_hash", sa.String(64), nullable=False),
        sa.Column("registered_at", sa.Float, nullable=False),
        sa.Column("last_beat_at", sa.Float, nullable=False),
        sa.Column("last_seq", sa.BigInteger, nullable=False),
        sa.Column("acked_version", sa.Integer, nullable=False),
        sa.Column("beats", sa.BigInteger, nullable=False),
        sa.Column("metrics", sa.JSON, nullable=False),
    )
    op.create_index("ix_workers_pool", "workers", ["pool"])
    op.create_table(
        "directives",
        sa.Column("worker_id", sa.String(64), primary_key=True),
        sa.Column("version", sa.Integer, nullable=False),
        sa.Column("fields", sa.JSON, nullable=False),
        sa.Column("updated_at", sa.Float, nullable=False),
    )
    op.create_table(
        "events",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("ts", sa.Float, nullable=False),
        sa.Column("type", sa.String(32), nullable=False),
        sa.Column("worker_id", sa.String(64), nullable=True),
        sa.Column("pool", sa.String(128), nullable=True),
        sa.Column("data", sa.JSON, nullable=False),
    )
    op.create_index("ix_events_worker_id", "events", ["worker_id", "id"])
    op.create_index("ix_events_pool_id", "events", ["pool", "id"])
    op.create_index("ix_events_type_id", "events", ["type", "id"])
    op.create_index("ix_events_ts", "events", ["ts"])
    op.create_table(
        "tokens",
        sa.Column("token_hash", sa.String(64), primary_key=True),
        sa.Column("pool", sa.String(128), nullable=True),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("label", sa.Text, nullable=False),
        sa.Column("created_at", sa.Float, nullable=False),
    )


def downgrade() -> None:
    for table in ("tokens", "events", "directives", "workers", "devices", "pools"):
        op.drop_table(table)
