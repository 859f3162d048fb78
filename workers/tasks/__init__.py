"""RQ entry points, one module per kind of work: ``extraction`` (a job's units) and ``export`` (a finished
job's output in a trainer's layout). Plain functions that take ids and open their own sessions; the API
enqueues them by the dotted paths in ``hsx.server.jobs.queue``, so it never imports this package (nor
torch)."""
