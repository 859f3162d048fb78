"""The server side of streaming a job's output while it runs (docs/streaming.md): retention, the byte cap
that throttles workers, and the leases and acknowledgements that hand each committed shard to consumers
exactly once. The trainer's side is :mod:`hsx.streams`."""
