"""The engine protocol: how a worker talks to an engine (client, the generation contract), whether an
engine fits a job (fitness), the per-request dumps it writes and how they are validated, and ``hsx verify``.
It imports the SDK and the server core (a job's options), never the integrations or the CLI."""
