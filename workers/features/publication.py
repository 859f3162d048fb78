"""A job with a destination (its ``output_uri``) has each shard put in the object store by the worker that
committed it, right after the commit (:mod:`hsx.server.jobs.publication`: best effort; what it leaves
undone the reconciler or finalize puts)."""

from __future__ import annotations

from hsx.server.jobs.publication import publish_committed
from hsx.server.jobs.repository import ClaimedUnit
from workers.unit_hooks import FeatureContext, UnitHooks


def register(context: FeatureContext, hooks: UnitHooks) -> None:
    if not context.plan.destination:
        return
    db_url = context.settings.resolved_database_url

    def publish(unit: ClaimedUnit) -> None:
        publish_committed(db_url, context.job_id, unit.id, context.settings)

    hooks.after_commit.append(publish)
