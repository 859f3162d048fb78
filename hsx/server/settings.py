"""The one settings object. Every value comes from the environment with the ``HSX_`` prefix."""

from __future__ import annotations

import json
import logging
import os
from functools import lru_cache
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from hsx.fsutil import WRITE_BEHIND_WINDOW
from hsx.s3 import DEFAULT_TIMEOUT_SECONDS, S3Endpoint

log = logging.getLogger(__name__)

# Old environment names still read, each with the field that replaced it.
DEPRECATED_ENV = {"HSX_SAMPLES_PER_UNIT": "samples_per_shard"}


def _default_dump_dir() -> str:
    # Shared memory keeps per-request dumps off the disk where it exists (Linux); elsewhere a temp folder.
    return "/dev/shm/hsx-dumps" if os.path.isdir("/dev/shm") else str(Path.home() / ".hsx" / "dumps")


class TokenConfigError(ValueError):
    """A token is configured but unusable (empty): refusing beats silently serving without one."""


def _list_from_env(value: Any) -> Any:
    """A list setting from the environment: a JSON list, or one value, or comma-separated values."""
    if not isinstance(value, str):
        return value
    text = value.strip()
    if text.startswith("["):
        return json.loads(text)
    return [item.strip() for item in text.split(",") if item.strip()]


def _is_broad_directory(path: Path) -> bool:
    # "/" and top-level directories (/root, /etc, /tmp, /home) hold far more than datasets.
    return len(path.parts) < 3


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="HSX_", env_file=None, extra="ignore")

    data_dir: Path = Path(".hsx")
    database_url: str = ""  # empty: an embedded SQLite file under data_dir
    redis_url: str = "redis://127.0.0.1:6379/0"
    queue_name: str = "hsx"
    # The most a short Redis call (a wake-up, stream news published, a ping) waits to connect or for one
    # reply; none is retried, so a Redis that hangs costs each such call this long, then its caller goes on
    # as for any Redis error. Blocking waits get their own connections, timed out this long after their
    # wait (hsx/server/redis_clients.py).
    redis_timeout_seconds: float = Field(5.0, gt=0, le=300)

    api_url: str = "http://127.0.0.1:8000"
    engine_url: str = "http://127.0.0.1:30000"
    # Where the engine writes per-request dumps. Empty: the engine says (GET /hsx/info); set it where the
    # worker sees the shared mount under another path than the engine does.
    dump_dir: str = ""
    output_dir: Path = Path("")  # empty: data_dir / "output"
    model_cache_dir: Path = Path("")  # empty: data_dir / "models"
    tokenizer_path: str = ""  # empty: the engine's model path (the worker is colocated with its engine)

    # Work splitting and the lease protocol (the job table is the source of truth, RQ only wakes workers).
    # Samples per work unit, and so per shard, for a job whose options name none (the option of the same
    # name overrides it per job). HSX_SAMPLES_PER_UNIT, its old name, is still read (deprecated).
    samples_per_shard: int = Field(64, ge=1, le=65536)
    lease_seconds: float = 60.0
    heartbeat_seconds: float = 10.0
    reconcile_seconds: float = 15.0
    engine_concurrency: int = 8
    engine_timeout_seconds: float = 600.0
    engine_retries: int = 4
    dump_wait_seconds: float = 30.0
    # Finished captures waiting in the dump directory for the shard writer, per worker process, in bytes:
    # how far prefills may run ahead of the writer.
    max_inflight_dump_bytes: int = 4 << 30
    # A shard is handed to the disk every this many bytes as it is written (workers/shards.py), so the disk
    # works while the engine computes and the closing fsync has little left; 0 leaves it all to that fsync.
    shard_write_behind_bytes: int = WRITE_BEHIND_WINDOW
    # Worker processes `hsx worker` starts on this host (each one unit in flight at a time).
    worker_processes: int = 1
    # Attempts of a unit that may end in an error before the unit, and its job, fail with the last reason.
    # Failures no retry heals (dataset gone, disk full) fail at once.
    unit_max_failures: int = 3
    # Work horses that may die holding a unit before it fails: an outside kill (an operator, the OOM
    # killer) cannot be told from a sample that crashes the process, so deaths get more room than errors.
    unit_max_horse_deaths: int = 10
    # A job that no fit engine has worked on for this long (every engine that tried is unfit or down, and
    # no lease is live) fails, naming them; until then it waits for a healthy worker.
    no_fit_engine_seconds: float = 300.0
    # Other engines may join (workers on other hosts, engines still starting): POST /jobs then accepts a job
    # that HSX_ENGINE_URL's engine fails the preflight for, and the job waits no_fit_engine_seconds for a
    # fit one. Off: such a job is refused at once with a 422 naming the failed checks.
    engine_fleet: bool = False
    # How long POST /jobs trusts a preflight of an engine whose identity (everything /hsx/info reports) is
    # unchanged: a restart with other settings is another identity, checked afresh. A preflight is two short
    # prefills, yet took 20-30 s on the loaded 2-core test host (bench/submit.py).
    submit_preflight_ttl_seconds: float = 600.0
    # How long POST /verify waits for a worker to run the check (workers see the dumps; the API does not).
    # Longer than one check can take (two prefills of hsx verify's own limits, and their dumps); a worker
    # busy with a job's units takes it only between runs, so under load the answer may be "no worker".
    verify_wait_seconds: float = Field(300.0, gt=0, le=3600)
    # Refuse a job whose projected output does not fit in the output filesystem's free space (at prepare).
    # Off for filesystems whose free space means nothing (some network and FUSE mounts).
    check_output_space: bool = True
    # Chat records encoded at prepare to estimate the output's size.
    projection_sample_records: int = 64
    # Scheduling niceness of worker (and synthetic engine) processes: above 0 lets an API on the same host
    # answer first when the cores are busy.
    worker_nice: int = 0

    # How stale a polled GET /jobs/{id} may be (app/jobs/document_cache.py); 0 renders every request. Each
    # rendering costs the API a few queries; at 1 s a watched job costs one a second whatever the pollers.
    job_document_ttl_seconds: float = 1.0

    # Security and input limits.
    api_token: SecretStr | None = None
    api_token_file: Path | None = None
    # With no token configured the API serves loopback clients only; this opens it to every client.
    auth_disabled: bool = False
    # Trusted reverse proxies (uvicorn's forwarded_allow_ips: addresses or networks, comma-separated).
    # Empty: X-Forwarded-For and Forwarded are ignored, and a request carrying them never counts as local.
    forwarded_allow_ips: str = ""
    max_body_bytes: int = 1 << 20
    # List settings take a JSON list or comma-separated values (HSX_DATASET_ROOTS=/data/a,/data/b).
    allowed_uri_schemes: Annotated[list[str], NoDecode] = ["file", "http", "https"]
    # Empty: data_dir, plus the API's working directory unless that is "/" or a top-level directory.
    dataset_roots: Annotated[list[Path], NoDecode] = []
    max_dataset_bytes: int = 10 << 30
    # s3:// buckets a dataset URI or an output URI may name
    allowed_buckets: Annotated[list[str], NoDecode] = []
    # connect and per-read timeout of one dataset download (and of the S3 client)
    http_timeout_seconds: float = DEFAULT_TIMEOUT_SECONDS
    http_download_deadline_seconds: float = 1800.0  # whole download, so a trickling server cannot hold on
    max_sample_tokens: int = 131072

    # Object storage for s3:// datasets and outputs (the ``interop`` extra). Credentials come from the
    # standard AWS chain (environment, shared config, instance role), never from these settings.
    s3_endpoint_url: str = ""  # empty: AWS itself; set for MinIO, Ceph or a local test server
    s3_region: str = ""
    s3_multipart_threshold_bytes: int = 64 << 20  # files this large or larger go up in parts
    s3_part_bytes: int = 64 << 20  # S3 needs at least 5 MiB per part except the last

    # Trainer-format exports made through the API: one folder per export, with its status file beside it.
    exports_dir: Path = Path("")  # empty: data_dir / "exports"

    # Besides the output directory, publish each job submitted while this is set to <output_uri>/<job_id>
    # (s3://bucket/prefix; the bucket must be in allowed_buckets), a shard as its unit commits and the
    # manifest last. A job succeeds only once every object is confirmed there.
    output_uri: str = ""
    # Streaming (docs/streaming.md): what a consume job may hold committed but unacknowledged, plus what its
    # workers have in flight, unless the job names its own buffer_cap_bytes; and how long a consumer keeps
    # an item it leased without acknowledging it before the item goes to another consumer.
    stream_buffer_cap_bytes: int = 8 << 30
    stream_lease_seconds: float = 300.0
    # A worker that finds a consume job at its cap waits this long for room (on the job's stream news, and
    # reading the table every second) before it leaves the job to the queue's wake-up; 0 leaves at once.
    stream_room_wait_seconds: float = 10.0
    # Logs: "json" (one object a line) or "text" (key=value); both carry job, unit, attempt and rid.
    log_format: Literal["json", "text"] = "text"
    log_level: str = "INFO"

    @model_validator(mode="before")
    @classmethod
    def _deprecated_env_names(cls, values: Any) -> Any:
        if not isinstance(values, dict):
            return values
        for old, field in DEPRECATED_ENV.items():
            if old in os.environ and field not in values:
                log.warning("%s is deprecated; set HSX_%s instead", old, field.upper())
                values = {**values, field: os.environ[old]}
        return values

    @field_validator("allowed_uri_schemes", "dataset_roots", "allowed_buckets", mode="before")
    @classmethod
    def _lists_from_env(cls, value: Any) -> Any:
        return _list_from_env(value)

    @property
    def resolved_database_url(self) -> str:
        if self.database_url:
            return self.database_url
        return f"sqlite:///{(self.data_dir / 'hsx.sqlite3').resolve()}"

    @property
    def resolved_dump_dir(self) -> str:
        return self.dump_dir or _default_dump_dir()

    @property
    def resolved_output_dir(self) -> Path:
        return (
            self.output_dir if str(self.output_dir) not in ("", ".") else self.data_dir / "output"
        ).resolve()

    @property
    def s3_endpoint(self) -> S3Endpoint:
        return S3Endpoint(self.s3_endpoint_url, self.s3_region, self.http_timeout_seconds)

    @property
    def resolved_model_cache_dir(self) -> Path:
        path = (
            self.model_cache_dir if str(self.model_cache_dir) not in ("", ".") else self.data_dir / "models"
        )
        return path.resolve()

    @property
    def resolved_exports_dir(self) -> Path:
        path = self.exports_dir if str(self.exports_dir) not in ("", ".") else self.data_dir / "exports"
        return path.resolve()

    @property
    def resolved_dataset_roots(self) -> list[Path]:
        if self.dataset_roots:
            return [root.resolve() for root in self.dataset_roots]
        roots = [self.data_dir.resolve()]
        cwd = Path.cwd().resolve()
        if not _is_broad_directory(cwd):
            roots.insert(0, cwd)
        return roots

    def token(self) -> str | None:
        """The API token, None when none is configured. Raises :class:`TokenConfigError` for an empty one
        and ``OSError`` for a token file that cannot be read."""
        if self.api_token is not None:
            token = self.api_token.get_secret_value()
            if not token.strip():
                raise TokenConfigError("HSX_API_TOKEN is set but empty; give it a value or unset it")
            return token
        if self.api_token_file is not None:
            token = self.api_token_file.read_text(encoding="utf-8").strip()
            if not token:
                raise TokenConfigError(f"the API token file {self.api_token_file} is empty")
            return token
        return None


@lru_cache
def get_settings() -> Settings:
    return Settings()
