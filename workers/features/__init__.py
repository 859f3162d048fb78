"""The features a job may use besides capture, one module each, each with one ``register(context, hooks)``
that adds its record stage and commit hooks (:mod:`workers.unit_hooks`) when the job's plan asks for it.
The job runner installs them all through :func:`install` and names none of them."""

from __future__ import annotations

from collections.abc import Callable

from workers.features import publication, regeneration, stream_items
from workers.unit_hooks import FeatureContext, UnitHooks

# In this order: a consumer of a published job is handed a shard only once it is in the store, so the
# publication's after-commit work runs before the news that wakes a waiting lease for the new item.
FEATURES: tuple[Callable[[FeatureContext, UnitHooks], None], ...] = (
    regeneration.register,
    publication.register,
    stream_items.register,
)


def install(context: FeatureContext) -> UnitHooks:
    """The stages and hooks of every feature the job's plan asks for."""
    hooks = UnitHooks()
    for register in FEATURES:
        register(context, hooks)
    return hooks
