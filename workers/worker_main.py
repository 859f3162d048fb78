"""``hsx worker``: an RQ worker that runs one work unit per RQ job, plus the reconciler.

SIGTERM is a warm shutdown: RQ lets the unit in hand finish (its horse runs in its own process group, so
the signal does not reach it), then the worker exits 0. A horse that dies has its leases ended at once so
another attempt can take the unit without waiting for the lease to run out.

Losing Redis does not end the worker: RQ gives up its work loop on a Redis error met outside the wait for
the next job (checking on a horse, reporting a result), so the loop is started again once Redis answers,
and the reconciler, which kept running, re-enqueues whatever the new Redis does not know about.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import time
from typing import Any, NoReturn

from redis.exceptions import RedisError
from rq import Worker
from rq.exceptions import StopRequested

from hsx.server.jobs.queue import queue_for
from hsx.server.logging_setup import configure_logging
from hsx.server.redis_clients import rq_connection
from hsx.server.settings import Settings, get_settings
from workers.job_runner import lease_owner
from workers.reconciler import FORK_LOCK, ReconcilerThread, expire_leases_of, wake_for_a_new_worker
from workers.tasks.extraction import STOP_SIGNAL

log = logging.getLogger(__name__)

RESTART_DELAY_SECONDS = 2.0
# How long the thread reading RQ's command channel blocks in one read. RQ asks for 60 s, and on leaving
# (a burst worker done, a SIGTERM) it stops that thread and redis-py waits out the read in hand: a worker
# could take a minute to exit after "unsubscribing from channel".
COMMAND_CHANNEL_READ_SECONDS = 1.0


class HsxWorker(Worker):
    def subscribe(self) -> None:
        self.log.info("Worker %s: subscribing to channel %s", self.name, self.pubsub_channel_name)
        self.pubsub = self.connection.pubsub()
        self.pubsub.subscribe(**{self.pubsub_channel_name: self.handle_payload})
        self.pubsub_thread = self.pubsub.run_in_thread(  # type: ignore[assignment] # RQ annotates None
            sleep_time=COMMAND_CHANNEL_READ_SECONDS,
            daemon=True,
            exception_handler=self._pubsub_exception_handler,
        )

    def fork_work_horse(self, job: Any, queue: Any) -> None:
        with FORK_LOCK:  # never while the reconciler thread is mid-pass (see FORK_LOCK)
            super().fork_work_horse(job, queue)

    def handle_warm_shutdown_request(self) -> None:
        super().handle_warm_shutdown_request()  # type: ignore[no-untyped-call]
        # A horse works through a job's units one after another: ask it to stop after the one in hand.
        if self.horse_pid:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.horse_pid, STOP_SIGNAL)

    def handle_work_horse_killed(self, job: Any, retpid: int, ret_val: int, rusage: Any) -> None:
        super().handle_work_horse_killed(job, retpid, ret_val, rusage)  # type: ignore[no-untyped-call]
        settings = get_settings()
        owner = lease_owner(retpid, settings.engine_url)
        try:
            n = expire_leases_of(
                settings.resolved_database_url,
                owner,
                f"the work horse holding it died (wait status {ret_val})",
                max(1, settings.unit_max_horse_deaths),
            )
            log.warning("work horse %s died (status %s); released %d lease(s)", retpid, ret_val, n)
        except Exception as exc:  # noqa: BLE001 - the leases still expire on their own
            log.warning("could not release leases of dead horse %s: %s", retpid, exc)


def preload() -> None:
    """Import the heavy modules once in the parent so every forked horse starts warm."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import transformers  # noqa: F401

    # Loading any tokenizer imports a model's configuration module, which pulls in transformers' model
    # machinery (and torch.distributed): seconds of imports that every horse would otherwise pay per unit.
    import transformers.modeling_utils  # noqa: F401

    import workers.chat  # noqa: F401
    import workers.job_runner  # noqa: F401


def preload_tokenizer(settings: Settings) -> None:
    """Load the engine's tokenizer once in the parent, so a horse does not spend its first second on it
    (every horse needs it to check the job's tokenizer identity). Best effort: an engine that is not up
    yet, or a model without tokenizer files, leaves each horse to load (or miss) it itself."""
    from hsx.engine.client import EngineClient
    from workers.job_tokenizer import load_tokenizer

    path = settings.tokenizer_path
    try:
        if not path:
            client = EngineClient(settings.engine_url, timeout=5, retries=0)
            try:
                path = client.info().model_path
            finally:
                client.close()
        if path:
            load_tokenizer(path)
    except Exception as exc:  # noqa: BLE001 - a preload never stops a worker from starting
        log.info("no tokenizer preloaded (%s): %s", path or settings.engine_url, exc)


def run_worker(settings: Settings, burst: bool = False, reconcile: bool = True) -> int:
    prepare_process(settings)
    return serve(settings, burst, reconcile)


def prepare_process(settings: Settings) -> None:
    """What a worker process sets up before it listens; a process forked after it inherits all of it."""
    if settings.worker_nice > 0:
        os.nice(settings.worker_nice)
    configure_logging(settings.log_format, settings.log_level)
    # A unit's collecting thread copies each dump in 1 MiB steps, each a system call after which it needs
    # the GIL back; at Python's 5 ms a prefill thread parsing a reply could hold it up that long per step.
    sys.setswitchinterval(0.0005)
    preload()
    preload_tokenizer(settings)


def serve(settings: Settings, burst: bool, reconcile: bool) -> int:
    """The worker's life once prepared: RQ's work loop (started again after a lost Redis), and the
    reconciler beside it."""
    try:
        wake_for_a_new_worker(settings)
    except Exception as exc:  # noqa: BLE001 - the reconciler wakes it later
        log.warning("could not look for jobs with work waiting: %s", exc)
    reconciler = ReconcilerThread(settings) if reconcile else None
    if reconciler is not None:
        reconciler.start()
    try:
        while True:
            worker: HsxWorker | None = None
            try:
                worker = new_worker(settings)
                worker.work(burst=burst, logging_level="INFO", with_scheduler=False)
            except RedisError as exc:  # registering and tearing down talk to Redis too
                if burst:
                    raise
                log.warning("worker loop ended on a Redis error: %s", exc)
            asked = worker is not None and worker._shutdown_requested_date is not None  # SIGTERM, SIGINT
            if burst or asked:
                return 0
            log.warning(
                "worker loop ended unasked (Redis lost?); starting again in %.0fs", RESTART_DELAY_SECONDS
            )
            try:
                time.sleep(RESTART_DELAY_SECONDS)
            except StopRequested:  # the old loop's signal handler is still installed
                return 0
    finally:
        if reconciler is not None:
            reconciler.stopped.set()


def new_worker(settings: Settings) -> HsxWorker:
    """An RQ worker on a connection of RQ's own (:func:`hsx.server.redis_clients.rq_connection`): RQ raises
    the socket timeout of the pool it is given to its blocking pop, 415 s. Given the process's short-call
    pool, it raised every announce and wake-up of this worker and of its horses to that, a call
    that could block for minutes on a Redis that hangs."""
    connection = rq_connection(settings)
    return HsxWorker([queue_for(settings, connection)], connection=connection)


def run_worker_processes(count: int, burst: bool = False, reconcile: bool = True) -> int:
    """``hsx worker --processes N``: N worker processes on this host, each with its own unit in flight,
    all feeding the same engine. They are forked once the heavy imports and the tokenizer are loaded, as
    RQ forks its horses, so a fleet is listening in a second rather than after N fresh interpreters have
    each imported torch and transformers. SIGTERM and SIGINT are passed on (a warm shutdown of each); the
    exit code is the worst of theirs."""
    settings = get_settings()
    prepare_process(settings)
    children: list[int] = []
    for number in range(count):
        # Only the first runs the reconciler: one pass per host is plenty, and every pass is idempotent.
        pid = os.fork()
        if pid == 0:
            _run_forked_worker(settings, burst, reconcile and number == 0)
        children.append(pid)

    def forward(signum: int, _frame: Any) -> None:
        for child in children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    codes = []
    for child in children:
        _pid, status = os.waitpid(child, 0)  # retried by Python when a forwarded signal interrupts it
        codes.append(os.waitstatus_to_exitcode(status))
    return max(codes, key=abs, default=0)


def _run_forked_worker(settings: Settings, burst: bool, reconcile: bool) -> NoReturn:
    """A forked child's whole life: one worker, then ``os._exit``, so that nothing of the parent (its
    exit handlers, its buffered output) runs twice."""
    code = 1
    try:
        code = serve(settings, burst, reconcile)
    except BaseException:  # noqa: BLE001 - reported here: nothing above a forked child can catch it
        log.exception("worker process %d failed", os.getpid())
    finally:
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
