"""publication unit by unit: where a job's output goes in the object store (fixed at submission) and when
each shard was confirmed there

Revision ID: 0005_unit_publication
Revises: 0004_streams
Create Date: 2026-12-05 10:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005_unit_publication"
down_revision: str | None = "0004_streams"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("output_uri", sa.Text(), nullable=True))
    with op.batch_alter_table("shards") as batch:
        batch.add_column(sa.Column("published_at", sa.Float(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("shards") as batch:
        batch.drop_column("published_at")
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("output_uri")
