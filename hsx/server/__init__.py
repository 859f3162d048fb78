"""Server core: what the API (app/) and the workers (workers/) share: settings, the job options, the job
table and its SQL (db, jobs, streams, regenerate), dataset ingest, object-store publication, Redis, logging
and telemetry. Installed with ``hsx[server]``. It imports the SDK (hsx's top-level modules and
hsx.streams), never the engine protocol, the integrations or the CLI."""
