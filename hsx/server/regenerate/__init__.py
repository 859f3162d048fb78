"""Regeneration: a job's assistant turns rewritten by the target model before their capture.

The engine side of it (the ``/generate`` request and reply a worker and an engine agree on) is written
down once in :mod:`hsx.engine.regenerate_contract`.

The job side (docs/regenerate.md):

======================================  =================================================================
module                                  what lives there
======================================  =================================================================
:mod:`hsx.server.db.regenerate_models`  the ``regenerated_samples`` table (one row per sample, never
                                        rewritten)
:mod:`.repository`                      its SQL: the fenced write, the read-back, the job's totals, the
                                        download
:mod:`.export`                          the regenerated dataset's JSONL line (``GET /jobs/{id}/regenerated``)
:mod:`hsx.cli.regenerated`              ``hsx regenerated JOB``
======================================  =================================================================

The worker side, which needs the worker's chat encoding, is :mod:`workers.regeneration`: ``turns`` (turn by
turn, the ids built from the engine's own ids for every generated span, and the loss mask) and ``stage`` (a
unit's stage before capture: kept texts looked up, the rest generated and written under the unit's lease).
Imports go one way, workers to hsx. The API imports only the options (:mod:`hsx.server.job_options`), the
table, ``repository`` and ``export``: no torch, no tokenizer.
"""
