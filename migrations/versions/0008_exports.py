"""exports: an export's state is a row of the job table, no longer a JSON file under data_dir that the API
had to read (so the API needs no view of the workers' disks)

Revision ID: 0008_exports
Revises: 0007_regenerated_samples
Create Date: 2026-12-06 09:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0008_exports"
down_revision: str | None = "0007_regenerated_samples"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # Exports recorded in status files before this revision are not carried over: their folders stay
    # where they are, and asking for the same export again makes it anew (the files were never a contract).
    op.create_table(
        "exports",
        sa.Column("id", sa.String(length=32), nullable=False),
        sa.Column("job_id", sa.String(length=36), nullable=False),
        sa.Column("format", sa.String(length=32), nullable=False),
        sa.Column("options", sa.JSON(), nullable=False),
        sa.Column("dest", sa.Text(), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("error", sa.JSON(), nullable=True),
        sa.Column("report", sa.JSON(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ix_exports_job_id", "exports", ["job_id"], unique=False)


def downgrade() -> None:
    op.drop_index("ix_exports_job_id", table_name="exports")
    op.drop_table("exports")
