"""Agent runtimes in the store (they were in $DSEC_HOME/runtimes.json, a file holding their signing secrets).

Revision ID: 0002_runtimes
Revises: 0001
"""

import sqlalchemy as sa
from alembic import op

revision = "0002_runtimes"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "runtimes",
        sa.Column("id", sa.String(64), primary_key=True),
        sa.Column("name", sa.String(128), nullable=False),
        sa.Column("type", sa.String(64), nullable=False),
        sa.Column("callback_url", sa.Text, nullable=False),
        sa.Column("secret", sa.Text, nullable=False),
        sa.Column("token_hash", sa.String(64), nullable=False),
        sa.Column("pool", sa.String(128), nullable=True),
        sa.Column("registered_at", sa.Float, nullable=False),
        sa.Column("report", sa.JSON, nullable=False),
        sa.Column("reported_at", sa.Float, nullable=True),
    )


def downgrade() -> None:
    op.drop_table("runtimes")
