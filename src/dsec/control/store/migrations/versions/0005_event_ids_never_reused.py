"""Event ids are never reused (SQLite: ``AUTOINCREMENT``).

An event's id is the cursor of ``GET /v1/events?after=`` and of the cost gauges' ledger: both assume ids only grow.
SQLite's plain ``INTEGER PRIMARY KEY`` gives a new row one more than the largest id *left*, so once retention had
deleted the newest events (a control plane with no new event for the retention period), the next ones took ids a
reader had already passed and was never shown. PostgreSQL's sequence never goes back; there nothing changes.

The table is rebuilt with ``AUTOINCREMENT`` (SQLite cannot add it in place): rows, ids and indexes are kept.

Revision ID: 0005_event_ids_never_reused
Revises: 0004_placements_policies
"""

from alembic import op

revision = "0005_event_ids_never_reused"
down_revision = "0004_placements_policies"
branch_labels = None
depends_on = None


def upgrade() -> None:
    if op.get_bind().dialect.name != "sqlite":
        return
    with op.batch_alter_table("events", recreate="always", table_kwargs={"sqlite_autoincrement": True}):
        pass


def downgrade() -> None:
    if op.get_bind().dialect.name != "sqlite":
        return
    with op.batch_alter_table("events", recreate="always", table_kwargs={"sqlite_autoincrement": False}):
        pass
