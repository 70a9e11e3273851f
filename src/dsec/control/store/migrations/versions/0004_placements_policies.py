"""Placements and applied policies in the store.

Placements were held only in memory: a restarted control plane forgot which devices its jobs held and could hand
them out twice. Applied policies were a file ($DSEC_HOME/policies.yaml) on the host of the control plane that
applied them, so a control plane started elsewhere against the same database ran without them; that file is
imported at start (``PolicyRunner.load``) since a migration does not know where $DSEC_HOME is.

Revision ID: 0004_placements_policies
Revises: 0003_compression_bits_default
"""

import sqlalchemy as sa
from alembic import op

revision = "0004_placements_policies"
down_revision = "0003_compression_bits_default"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "placements",
        sa.Column("job", sa.String(128), primary_key=True),
        sa.Column("pool", sa.String(128), nullable=True),
        sa.Column("placement", sa.JSON, nullable=False),
        sa.Column("placed_at", sa.Float, nullable=False),
    )
    op.create_table(
        "policy_versions",
        sa.Column("version", sa.Integer, primary_key=True, autoincrement=False),
        sa.Column("text", sa.Text, nullable=False),
        sa.Column("source", sa.String(256), nullable=False),
        sa.Column("applied_at", sa.Float, nullable=False),
    )


def downgrade() -> None:
    op.drop_table("policy_versions")
    op.drop_table("placements")
