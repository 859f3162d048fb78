"""prepared records: unit byte ranges, a job-level prepare lease, streamed shards' header checksum

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-03 08:20:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("records_path", sa.Text(), nullable=True))
        batch.add_column(sa.Column("records_bytes", sa.BigInteger(), nullable=True))
        batch.add_column(sa.Column("prepare_owner", sa.String(length=200), nullable=True))
        batch.add_column(sa.Column("prepare_expires", sa.Float(), nullable=True))
    with op.batch_alter_table("work_units") as batch:
        batch.add_column(sa.Column("byte_start", sa.BigInteger(), nullable=True))
        batch.add_column(sa.Column("byte_end", sa.BigInteger(), nullable=True))
    with op.batch_alter_table("shards") as batch:
        batch.add_column(sa.Column("header_sha256", sa.String(length=64), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("shards") as batch:
        batch.drop_column("header_sha256")
    with op.batch_alter_table("work_units") as batch:
        batch.drop_column("byte_end")
        batch.drop_column("byte_start")
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("prepare_expires")
        batch.drop_column("prepare_owner")
        batch.drop_column("records_bytes")
        batch.drop_column("records_path")
