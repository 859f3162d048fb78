"""regenerated samples: the conversations a regenerate job generated, kept per sample before capture

Revision ID: 0007_regenerated_samples
Revises: 0006_stream_items_at_commit
Create Date: 2026-12-05 08:10:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007_regenerated_samples"
down_revision: str | None = "0006_stream_items_at_commit"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "regenerated_samples",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("job_id", sa.String(length=36), nullable=False),
        sa.Column("unit_id", sa.Integer(), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("sample_index", sa.Integer(), nullable=False),
        sa.Column("record_id", sa.String(length=200), nullable=True),
        sa.Column("reason", sa.String(length=64), nullable=True),
        sa.Column("detail", sa.Text(), nullable=False),
        sa.Column("messages", sa.JSON(), nullable=True),
        sa.Column("input_ids", sa.JSON(), nullable=True),
        sa.Column("loss_mask", sa.JSON(), nullable=True),
        sa.Column("generated_tokens", sa.Integer(), nullable=False),
        sa.Column("turns_generated", sa.Integer(), nullable=False),
        sa.Column("turns_at_length", sa.Integer(), nullable=False),
        sa.Column("generation", sa.JSON(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"], ondelete="CASCADE"),
        sa.ForeignKeyConstraint(["unit_id"], ["work_units.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("job_id", "sample_index", name="uq_regenerated_samples_job_sample"),
    )
    op.create_index("ix_regenerated_samples_job_id", "regenerated_samples", ["job_id"], unique=False)


def downgrade() -> None:
    op.drop_index("ix_regenerated_samples_job_id", table_name="regenerated_samples")
    op.drop_table("regenerated_samples")
