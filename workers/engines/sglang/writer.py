"""Writer threads: wait for a forward's copies, reassemble chunked prompts, write the dumps.

Each dump is ``<dump_dir>/<rid>/states.safetensors`` written from the raw bytes of the host rows
(``contract.write_safetensors``: no pickle, no copy for one-piece prompts), then ``meta.json`` last
(``contract.write_meta_atomically``). Pieces of one rid always go to the same writer (rid hash), so a
drop is ordered after that rid's pieces.
"""

from __future__ import annotations

import logging
import os
import queue
import shutil
import threading
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from hsx import contract
from workers.engines.sglang.arena import Block, PinnedArena
from workers.engines.sglang.planning import Piece
from workers.engines.sglang.reassembly import ChunkOutOfOrder, Reassembler

log = logging.getLogger("hsx.sglang")


class Stats:
    """Counters shared by the scheduler thread and the writers."""

    KEYS = ("dumps", "rows", "bytes", "dropped", "errors", "forwards")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values = dict.fromkeys(self.KEYS, 0)

    def add(self, **deltas: int) -> None:
        with self._lock:
            for key, delta in deltas.items():
                self._values[key] += delta

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._values)


@dataclass
class Job:
    """The host rows of one forward, shared by its pieces; its arena block is freed after the last."""

    event: Any  # CUDA event recorded after the copies; None on CPU
    block: Block | None
    u8: Any  # uint8 [K, rows, row_bytes]
    non_finite: Any  # int32 [K, rows] non-finite values per row, or None when not counted
    remaining: int
    lock: threading.Lock = field(default_factory=threading.Lock)
    synced: bool = False

    def wait(self) -> None:
        if not self.synced:
            if self.event is not None:
                self.event.synchronize()
            self.synced = True

    def piece_non_finite(self, p: Piece) -> list[int]:
        if self.non_finite is None:
            return []
        return [int(x) for x in self.non_finite[:, p.cap_off : p.cap_off + p.n].sum(dim=1).tolist()]


class _Flush:
    """A marker that runs a callback when a writer reaches it (tests, shutdown)."""

    block = None

    def __init__(self, callback: Callable[[], None]) -> None:
        self.callback = callback

    def wait(self) -> None:
        self.callback()


class DumpWriter:
    def __init__(
        self,
        torch: Any,
        arena: PinnedArena,
        dump_dir: str,
        names: list[str],
        st_dtype: str,
        hidden_size: int,
        row_bytes: int,
        threads: int,
        stats: Stats,
    ) -> None:
        self.torch = torch
        self.arena = arena
        self.dump_dir = dump_dir
        self.names = list(names)
        self.st_dtype = st_dtype
        self.hidden_size = hidden_size
        self.row_bytes = row_bytes
        self.stats = stats
        self._queues: list[queue.SimpleQueue[Any]] = []
        self.reassemblers: list[Reassembler] = []  # one per writer, touched by that writer only
        for i in range(threads):
            q: queue.SimpleQueue[Any] = queue.SimpleQueue()
            self._queues.append(q)
            reassembler = Reassembler(torch, len(names), row_bytes)
            self.reassemblers.append(reassembler)
            threading.Thread(
                target=self._run, args=(q, reassembler, i), name=f"hsx-writer-{i}", daemon=True
            ).start()

    # ---- scheduler thread -------------------------------------------------------------------------

    def _queue_for(self, rid: str) -> queue.SimpleQueue[Any]:
        # crc32, not hash(): the same rid must map to the same writer in every run (and test)
        return self._queues[zlib.crc32(rid.encode()) % len(self._queues)]

    def submit(self, job: Job, pieces: list[Piece]) -> None:
        for p in pieces:
            self._queue_for(p.rid).put(("piece", job, p))

    def drop(self, rid: str, token: int) -> None:
        self._queue_for(rid).put(("drop", rid, token))

    def release(self, job: Job) -> None:
        """Free a job's block once its copies ran, without writing anything (a failed capture)."""
        self._queues[0].put(("release", job))

    def flush(self, timeout: float = 60.0) -> bool:
        """Wait until every writer has handled what was queued before this call."""
        done = threading.Event()
        pending = [len(self._queues)]
        lock = threading.Lock()

        def mark() -> None:
            with lock:
                pending[0] -= 1
                if pending[0] == 0:
                    done.set()

        for q in self._queues:
            q.put(("release", _Flush(mark)))
        return done.wait(timeout)

    def stop(self) -> None:
        for q in self._queues:
            q.put(("stop",))

    # ---- writer threads ---------------------------------------------------------------------------

    def _run(self, q: queue.SimpleQueue[Any], reassembler: Reassembler, index: int) -> None:
        while True:
            msg = q.get()
            kind = msg[0]
            try:
                if kind == "piece":
                    self._piece(reassembler, msg[1], msg[2])
                elif kind == "drop":
                    reassembler.drop(msg[1], msg[2])
                elif kind == "release":
                    msg[1].wait()
                    self.arena.release(msg[1].block)
                elif kind == "stop":
                    return
            except Exception:
                log.exception("hsx: writer %d failed on %s", index, kind)
                self.stats.add(errors=1)

    def _piece(self, reassembler: Reassembler, job: Job, p: Piece) -> None:
        try:
            job.wait()
            rows = job.u8[:, p.cap_off : p.cap_off + p.n]
            try:
                done = reassembler.add(p, rows, job.piece_non_finite(p))
            except ChunkOutOfOrder as exc:
                log.error("hsx: %s", exc)
                self.stats.add(errors=1)
                return
            if done is not None:
                assert p.meta is not None
                if done.non_finite:
                    p.meta.non_finite = dict(zip(self.names, done.non_finite, strict=True))
                self.write_dump(p.rid, p.meta, done.ids, done.layers)
        finally:
            with job.lock:
                job.remaining -= 1
                last = job.remaining == 0
            if last:
                self.arena.release(job.block)

    def write_dump(self, rid: str, meta: contract.DumpMeta, ids: bytes, layers: list[Any]) -> None:
        directory = contract.dump_path(self.dump_dir, rid)
        if os.path.isdir(directory):
            # A request resent under the same rid replaces the earlier dump (as the reference engine does);
            # a re-prefill of the same request never gets here (its capture is closed).
            shutil.rmtree(directory)
        T, H = meta.num_tokens, self.hidden_size
        tensors: list[tuple[str, str, list[int], Any]] = [("input_ids", "I32", [T], ids)]
        for name, layer in zip(self.names, layers, strict=True):
            # raw little-endian bytes of the rows, straight from the host buffer: no copy, no pickle
            tensors.append((name, self.st_dtype, [T, H], layer.reshape(-1).numpy().data))
        try:
            os.makedirs(directory, exist_ok=True)
            contract.write_safetensors(os.path.join(directory, contract.STATES_FILE), tensors)
            contract.write_meta_atomically(directory, meta)
        except BaseException:
            shutil.rmtree(directory, ignore_errors=True)  # no half dump
            raise
        self.stats.add(dumps=1, rows=T, bytes=T * (4 + len(self.names) * self.row_bytes))
