"""stream items at commit: a unit's commit now writes its shard's stream item in the same transaction;
shards committed before (whose items were created by a lease call, if ever) get theirs here, once

Revision ID: 0006_stream_items_at_commit
Revises: 0005_unit_publication
Create Date: 2026-12-05 08:30:00
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0006_stream_items_at_commit"
down_revision: str | None = "0005_unit_publication"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.execute(
        "INSERT INTO stream_items (job_id, shard_id, unit_index, bytes, delivery) "
        "SELECT s.job_id, s.id, u.unit_index, s.bytes, 0 FROM shards s JOIN work_units u ON u.id = s.unit_id "
        "WHERE NOT EXISTS (SELECT 1 FROM stream_items i WHERE i.shard_id = s.id)"
    )


def downgrade() -> None:
    # The items stay: the schema is unchanged, and a lease call of the older version finds them in place.
    pass
