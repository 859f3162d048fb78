"""streams: consumers of a running job and the delivery of its committed shards (docs/streaming.md)

Revision ID: 0004_streams
Revises: 0003
Create Date: 2026-12-03 23:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004_streams"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "stream_consumers",
        sa.Column("id", sa.String(length=36), nullable=False),
        sa.Column("job_id", sa.String(length=36), nullable=False),
        sa.Column("name", sa.String(length=200), nullable=False),
        sa.Column("group_name", sa.String(length=200), nullable=False),
        sa.Column("lease_seconds", sa.Float(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("last_seen", sa.Float(), nullable=False),
        sa.Column("items_acked", sa.Integer(), nullable=False, server_default="0"),
        sa.Column("bytes_acked", sa.BigInteger(), nullable=False, server_default="0"),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ix_stream_consumers_job_id", "stream_consumers", ["job_id"])
    op.create_table(
        "stream_items",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("job_id", sa.String(length=36), nullable=False),
        sa.Column("shard_id", sa.Integer(), nullable=False),
        sa.Column("unit_index", sa.Integer(), nullable=False),
        sa.Column("bytes", sa.BigInteger(), nullable=False),
        sa.Column("delivery", sa.Integer(), nullable=False, server_default="0"),
        sa.Column("consumer_id", sa.String(length=36), nullable=True),
        sa.Column("lease_expires", sa.Float(), nullable=True),
        sa.Column("acked_at", sa.Float(), nullable=True),
        sa.Column("acked_by", sa.String(length=36), nullable=True),
        sa.Column("deleted_at", sa.Float(), nullable=True),
        sa.CheckConstraint(
            "acked_at IS NULL OR (consumer_id IS NULL AND lease_expires IS NULL)",
            name="ck_stream_items_acked_unleased",
        ),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"], ondelete="CASCADE"),
        sa.ForeignKeyConstraint(["shard_id"], ["shards.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("shard_id", name="uq_stream_items_shard"),
    )
    op.create_index("ix_stream_items_job_acked", "stream_items", ["job_id", "acked_at"])


def downgrade() -> None:
    op.drop_index("ix_stream_items_job_acked", table_name="stream_items")
    op.drop_table("stream_items")
    op.drop_index("ix_stream_consumers_job_id", table_name="stream_consumers")
    op.drop_table("stream_consumers")
