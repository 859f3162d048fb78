"""Streaming a job's output to trainers while it runs (docs/streaming.md): retention, the byte cap that
throttles workers, and consumers that lease and acknowledge committed shards exactly once."""
