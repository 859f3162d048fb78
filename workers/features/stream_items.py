"""Every committed shard is a stream item (docs/streaming.md): written in the unit's commit transaction,
so an item exists exactly when its shard is visible, and announced once committed, so the lease that has
waited longest hands it out at once instead of at its next look."""

from __future__ import annotations

from hsx.server.jobs.repository import ClaimedUnit
from hsx.server.streams.news import ITEM, announce
from hsx.server.streams.service import record_item
from workers.unit_hooks import FeatureContext, UnitHooks


def register(context: FeatureContext, hooks: UnitHooks) -> None:
    def announce_item(unit: ClaimedUnit) -> None:
        announce(context.settings, context.job_id, ITEM)

    hooks.in_transaction.append(record_item)
    hooks.after_commit.append(announce_item)
