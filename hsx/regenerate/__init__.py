"""Regeneration: a job's assistant turns rewritten by the target model before their capture.

The engine side of it (the ``/generate`` request and reply a worker and an engine agree on) is written
down once in :mod:`hsx.regenerate.engine_contract`.
"""
