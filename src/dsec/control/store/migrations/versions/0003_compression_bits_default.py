"""Stored directives: ``compression_bits`` 32 becomes null.

Before this revision 32 in a directive meant "the probe's configured default"; now null means that and 32 means
uncompressed. Without this step a probe configured for 8 bits would switch to uncompressed gradients when its
control plane is upgraded.

Revision ID: 0003_compression_bits_default
Revises: 0002_runtimes
"""

from typing import Any

import sqlalchemy as sa
from alembic import op

revision = "0003_compression_bits_default"
down_revision = "0002_runtimes"
branch_labels = None
depends_on = None

_directives = sa.table("directives", sa.column("worker_id", sa.String), sa.column("fields", sa.JSON))


def _rewrite(old: Any, new: Any) -> None:
    # Row by row in Python: the JSON functions differ between SQLite and PostgreSQL, and directives are one per worker.
    conn = op.get_bind()
    for worker_id, fields in conn.execute(sa.select(_directives.c.worker_id, _directives.c.fields)).all():
        if isinstance(fields, dict) and "compression_bits" in fields and fields["compression_bits"] == old:
            conn.execute(
                sa.update(_directives)
                .where(_directives.c.worker_id == worker_id)
                .values(fields={**fields, "compression_bits": new})
            )


def upgrade() -> None:
    _rewrite(32, None)


def downgrade() -> None:
    _rewrite(None, 32)
