"""poison units fail after bounded attempts and can be retried; engines of a job; truncation; output size;
record ids on rejections; in-flight progress of a leased unit

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-03 09:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("samples_truncated", sa.Integer(), nullable=False, server_default="0"))
        batch.add_column(sa.Column("bytes_written", sa.BigInteger(), nullable=False, server_default="0"))
        batch.add_column(sa.Column("projection", sa.JSON(), nullable=True))
        batch.add_column(sa.Column("engines", sa.JSON(), nullable=True))
    with op.batch_alter_table("work_units") as batch:
        batch.add_column(sa.Column("failures", sa.Integer(), nullable=False, server_default="0"))
        batch.add_column(sa.Column("last_error", sa.Text(), nullable=True))
        batch.add_column(sa.Column("samples_truncated", sa.Integer(), nullable=False, server_default="0"))
        batch.add_column(sa.Column("live_samples_done", sa.Integer(), nullable=False, server_default="0"))
        batch.add_column(sa.Column("live_samples_rejected", sa.Integer(), nullable=False, server_default="0"))
        batch.add_column(sa.Column("live_tokens", sa.BigInteger(), nullable=False, server_default="0"))
        batch.add_column(sa.Column("sample_indices", sa.JSON(), nullable=True))
        batch.add_column(sa.Column("parent_unit_id", sa.Integer(), nullable=True))
    with op.batch_alter_table("rejections") as batch:
        batch.add_column(sa.Column("record_id", sa.String(length=200), nullable=True))
        batch.add_column(sa.Column("retry_unit_id", sa.Integer(), nullable=True))
    op.create_table(
        "truncations",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("job_id", sa.String(length=36), nullable=False),
        sa.Column("unit_id", sa.Integer(), nullable=False),
        sa.Column("sample_index", sa.Integer(), nullable=False),
        sa.Column("record_id", sa.String(length=200), nullable=True),
        sa.Column("tokens", sa.Integer(), nullable=False),
        sa.Column("kept", sa.Integer(), nullable=False),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"], ondelete="CASCADE"),
        sa.ForeignKeyConstraint(["unit_id"], ["work_units.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("job_id", "sample_index", name="uq_truncations_job_sample"),
    )
    op.create_index("ix_truncations_job_id", "truncations", ["job_id"])


def downgrade() -> None:
    op.drop_index("ix_truncations_job_id", table_name="truncations")
    op.drop_table("truncations")
    with op.batch_alter_table("rejections") as batch:
        batch.drop_column("retry_unit_id")
        batch.drop_column("record_id")
    with op.batch_alter_table("work_units") as batch:
        for name in (
            "parent_unit_id",
            "sample_indices",
            "live_tokens",
            "live_samples_rejected",
            "live_samples_done",
            "samples_truncated",
            "last_error",
            "failures",
        ):
            batch.drop_column(name)
    with op.batch_alter_table("jobs") as batch:
        for name in ("engines", "projection", "bytes_written", "samples_truncated"):
            batch.drop_column(name)
