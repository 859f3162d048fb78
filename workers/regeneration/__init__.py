"""Regeneration's worker side: a unit's record stage (:mod:`workers.regeneration.stage`) that rewrites the
assistant turns with the target model turn by turn (:mod:`workers.regeneration.turns`) and keeps every text
before capture starts. The contract with the engine, the kept-text table's queries and the download live in
:mod:`hsx.server.regenerate`, which the API imports without the worker's chat code."""
