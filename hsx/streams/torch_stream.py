"""``JobStream``: a ``torch.utils.data.IterableDataset`` that follows a running job through the API.

Every DataLoader worker of every rank registers a consumer of the job and leases one shard at a time; the
API hands each shard to one lease holder, so ranks and workers split the job between them with no sample
twice, whatever their number. Samples carry a ``stream_ref``; after ``optimizer.step()`` the training loop
calls :meth:`JobStream.ack` with the batch, and a shard is acknowledged (and, in ``consume`` retention,
deleted) once all its samples have been acknowledged. Iteration ends when the job has succeeded and every
shard is acknowledged or leased to this stream's group (its DataLoader workers; pass the same ``group`` to
every rank of a run); it raises :class:`JobStreamError` when the job failed or was cancelled,
so a trainer never takes a failed job for the end of its data.

An API that restarts, or a connection cut in between, is ridden out: connection errors and 5xx answers are
retried with backoff for up to ``outage_seconds`` (4xx answers raise at once). Retrying is safe: a lease
names the deliveries this worker has received (``seen``), so one whose answer was lost is handed over again
at once, and an acknowledgement repeated for the same delivery is accepted once more and counted once.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import httpx
from torch.utils.data import IterableDataset, get_worker_info

from hsx.manifest import Manifest
from hsx.samples import Item, sample_item
from hsx.streams.api_calls import call_api
from hsx.streams.contract import consumes, lease_wait
from hsx.streams.reader import ShardGone, Source, item_samples, manifest_for

# (consumer id, item id, delivery, samples in the item): what an acknowledgement needs of a sample.
StreamRef = tuple[str, int, int, int]
log = logging.getLogger(__name__)
# The API's bound on a lease's ``seen`` list (app/streams/schemas.py SEEN_MAX).
SEEN_MAX = 1000
# A received delivery is named in ``seen`` until this long after its lease ran out by this host's clock,
# so a clock a little ahead of the API's never drops one the API still counts as held.
SEEN_CLOCK_MARGIN_SECONDS = 300.0


class JobStreamError(RuntimeError):
    """The job failed or was cancelled (or the API refused the stream): the data did not end, it broke."""


class JobStream(IterableDataset[Item]):
    def __init__(
        self,
        api_url: str,
        job_id: str,
        *,
        token: str | None = None,
        name: str = "trainer",
        group: str | None = None,
        rank: int | None = None,
        lease_seconds: float | None = None,
        poll_seconds: float = 0.5,
        wait_seconds: float | None = None,
        verify_checksums: bool = True,
        timeout: float = 60.0,
        outage_seconds: float = 600.0,
        source: Source = "auto",
    ) -> None:
        super().__init__()
        self.api_url = api_url.rstrip("/")
        self.job_id = job_id
        self.token = token if token is not None else os.environ.get("HSX_API_TOKEN", "")
        self.name = name
        # Made here, in the process that builds the dataset, so every DataLoader worker shares it; give all
        # ranks of one run the same group, or a rank ends while another still holds shards.
        self.group = group or f"{name}-{uuid.uuid4().hex[:12]}"
        self.rank = rank if rank is not None else _distributed_rank()
        self.lease_seconds = lease_seconds
        self.poll_seconds = poll_seconds
        # A lease that finds nothing waits this long at the API for the next item (0: poll every
        # poll_seconds instead); the API answers within it, so it must stay inside the read timeout. None:
        # LEASE_WAIT_SECONDS, or less where the timeout is short.
        self.wait_seconds = lease_wait(wait_seconds, timeout)
        self.verify_checksums = verify_checksums
        self.timeout = timeout
        # How long an unreachable API (connection errors, 5xx) is retried before a call raises.
        self.outage_seconds = outage_seconds
        # "auto": a shard's path where this host sees it, else its object (an item's uri, when the job is
        # published to an object store); "file" or "s3" to insist on one.
        self.source: Source = source
        # In the process that calls ack(): samples still to acknowledge per delivery.
        self._pending: dict[tuple[str, int, int], int] = {}
        self._client: httpx.Client | None = None
        self._pid = -1

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state.update(_client=None, _pid=-1, _pending={})
        return state

    def _http(self) -> httpx.Client:
        if self._client is None or self._pid != os.getpid():
            headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
            self._client = httpx.Client(base_url=self.api_url, headers=headers, timeout=self.timeout)
            self._pid = os.getpid()
        return self._client

    def _call(self, method: str, path: str, body: Mapping[str, Any] | None = None) -> Any:
        path = f"/jobs/{self.job_id}{path}"
        return call_api(self._http(), method, path, body, self.outage_seconds, JobStreamError)

    def _manifest(self) -> tuple[Manifest, bool]:
        """The job's layout, once it has started (its engine record is set when a worker starts it), and
        whether it is a ``consume`` job."""
        while True:
            doc = self._call("GET", "")
            if doc["state"] in ("failed", "cancelled"):
                raise JobStreamError(f"job {self.job_id} is {doc['state']}: {doc.get('error')}")
            if doc.get("engine"):
                return manifest_for(doc), consumes(doc.get("options"))
            time.sleep(self.poll_seconds)

    def __iter__(self) -> Iterator[Item]:
        info = get_worker_info()
        worker = 0 if info is None else info.id
        body: dict[str, Any] = {"name": f"{self.name}-rank{self.rank}-worker{worker}", "group": self.group}
        if self.lease_seconds is not None:
            body["lease_seconds"] = self.lease_seconds
        consumer = self._call("POST", "/consumers", body)["id"]
        manifest, consume = self._manifest()
        received: OrderedDict[tuple[int, int], float] = OrderedDict()  # delivery -> its lease's end
        while True:
            body = {"max_items": 1, "seen": _seen(received), "wait_seconds": self.wait_seconds}
            answer = self._call("POST", f"/consumers/{consumer}/leases", body)
            if answer["job_state"] in ("failed", "cancelled"):
                raise JobStreamError(f"job {self.job_id} is {answer['job_state']}: {answer.get('error')}")
            for item in answer["items"]:
                delivery = (int(item["id"]), int(item["delivery"]))
                try:
                    samples = item_samples(item, manifest, self.verify_checksums, self.source)
                except ShardGone as exc:
                    if not consume:
                        raise JobStreamError(f"job {self.job_id} keeps its shards, yet {exc}") from exc
                    # This delivery's lease ran out while it waited here, and the consumer given the item
                    # next acknowledged it: its samples were used once, so they are not yielded again.
                    log.warning("delivery %s of item %s skipped: %s", delivery[1], delivery[0], exc)
                    continue
                received[delivery] = float(item["lease_expires"])
                ref: StreamRef = (consumer, *delivery, int(item["samples"]))
                for sample in samples:
                    out = sample_item(sample, manifest.dtype)
                    out["stream_ref"] = ref
                    yield out
            if answer["end_of_stream"]:
                return
            if not answer["items"] and not self.wait_seconds:
                time.sleep(self.poll_seconds)

    def ack(self, batch: Mapping[str, Any] | Iterable[Mapping[str, Any]]) -> int:
        """Acknowledge a batch (a :func:`collate_samples` batch, or a list of samples) once the optimizer
        has stepped on it. Returns how many shards this call acknowledged."""
        refs: list[StreamRef] = (
            list(batch["stream_ref"])
            if isinstance(batch, Mapping)
            else [sample["stream_ref"] for sample in batch]
        )
        complete: dict[str, list[dict[str, int]]] = {}
        for consumer, item_id, delivery, samples in refs:
            key = (consumer, int(item_id), int(delivery))
            left = self._pending.get(key, int(samples)) - 1
            if left > 0:
                self._pending[key] = left
                continue
            self._pending.pop(key, None)
            complete.setdefault(consumer, []).append({"id": key[1], "delivery": key[2]})
        acked = 0
        for consumer, items in complete.items():
            answer = self._call("POST", f"/consumers/{consumer}/acks", {"items": items})
            acked += len(answer["acked"])
        return acked


def _seen(received: OrderedDict[tuple[int, int], float]) -> list[dict[str, int]]:
    """The received deliveries that may still be held, newest last, at most SEEN_MAX (oldest dropped)."""
    now = time.time()
    for key, expires in list(received.items()):
        if expires + SEEN_CLOCK_MARGIN_SECONDS < now or len(received) > SEEN_MAX:
            del received[key]
    return [{"id": i, "delivery": d} for i, d in received]


def _distributed_rank() -> int:
    import torch

    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return int(torch.distributed.get_rank())
    return 0
