"""The worker's side of the engine protocol: prefill requests over HTTP and dumps read from disk.

No torch here: the API process (through :mod:`hsx.verify`) uses this too. bf16 states come back as raw
``uint16`` words; :func:`as_float32` widens them.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import httpx
import numpy as np
import numpy.typing as npt

from hsx import contract
from hsx.errors import HsxError, ReasonError
from hsx.retry import engine_policy

DEFAULT_TIMEOUT_SECONDS = 600.0
DEFAULT_RETRIES = 4
DEFAULT_BACKOFF_SECONDS = 0.5
# Statuses that say the server is not an hsx engine (or not this route's), whatever the request: the
# engine is unfit, not the sample.
ENGINE_LEVEL_STATUSES = frozenset({401, 403, 404, 405})
# /hsx/info is answered at once by a live engine, however long its prefills take (their timeout is
# HSX_ENGINE_TIMEOUT_SECONDS): a frozen engine is found out in seconds, not in a prefill's time.
INFO_TIMEOUT_SECONDS = 15.0

# How a dump's safetensors dtype is held in numpy; bf16 has no numpy type, so its words stay uint16.
NUMPY_DTYPES: dict[str, npt.DTypeLike] = {
    "F32": np.float32,
    "F16": np.float16,
    "BF16": np.uint16,
    "I32": np.int32,
    "I64": np.int64,
}
_BF16_NAMES = ("BF16", "bfloat16", "bf16")


class EngineError(HsxError):
    """Base of the engine failures a worker turns into a retry or a rejected sample."""

    status_code = 503
    error = "engine_error"


class EngineUnavailable(EngineError):
    """The engine did not answer properly (connection errors, 5xx), after the retries."""

    error = "engine_unavailable"


class EngineTimeout(EngineUnavailable):
    """A prefill got no answer within the timeout. Not resent by the client: the engine may still be
    working on it, and the same rid again would run twice (or be refused as a duplicate)."""

    error = "engine_timeout"


class EngineUnfit(EngineError):
    """This engine cannot serve the job at all (not an hsx engine, another model, a reply or dump that
    breaks the protocol): its worker gives the work back for others and takes no more of the job."""

    error = "engine_unfit"


class EngineRejected(EngineError, ReasonError):
    """The engine refused the request (4xx); retrying it unchanged cannot help."""

    status_code = 502

    def __init__(self, reason: str, status: int = 400, detail: str = "") -> None:
        ReasonError.__init__(self, reason, detail)
        self.status = status


class DumpMissing(EngineError):
    """No complete dump appeared for a request in time."""

    error = "dump_missing"


class DumpCorrupt(DumpMissing):
    """A dump is present but unreadable; for a sample it is as good as missing."""


@dataclass
class Dump:
    meta: contract.DumpMeta
    input_ids: npt.NDArray[np.int32]
    states: dict[int, npt.NDArray[Any]]  # hf_index -> [T, H]; bf16 as uint16 words
    dtypes: dict[int, str]  # hf_index -> safetensors dtype name ("F32", "BF16", ...)
    path: str

    def state_float32(self, hf_index: int) -> npt.NDArray[np.float32]:
        return as_float32(self.states[hf_index], self.dtypes[hf_index])


def as_float32(raw: npt.NDArray[Any], dtype: str) -> npt.NDArray[np.float32]:
    """A state as float32: bf16 words are the high halves of float32 words, so they widen by a shift."""
    if dtype in _BF16_NAMES:
        words = np.ascontiguousarray(raw).view(np.uint16)
        return (words.astype(np.uint32) << np.uint32(16)).view(np.float32)
    return np.asarray(raw, dtype=np.float32)


class EngineClient:
    def __init__(
        self,
        base_url: str,
        timeout: float = DEFAULT_TIMEOUT_SECONDS,
        retries: int = DEFAULT_RETRIES,
        backoff: float = DEFAULT_BACKOFF_SECONDS,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.retries = max(0, retries)
        self.policy = engine_policy(retries, backoff)
        self.timeout = timeout
        # Connecting is quick or hopeless; only the prefill itself may take long.
        self._http = httpx.Client(
            base_url=self.base_url, timeout=httpx.Timeout(timeout, connect=min(timeout, 10.0))
        )

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> EngineClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def info(self) -> contract.EngineInfo:
        """``GET /hsx/info``; raises :class:`EngineUnfit` when the server is not an hsx engine."""
        try:
            raw = self._request("GET", contract.INFO_PATH, timeout=INFO_TIMEOUT_SECONDS)
        except EngineRejected as exc:
            raise EngineUnfit(
                f"{self.base_url}{contract.INFO_PATH} answered HTTP {exc.status} ({exc}): not an hsx engine "
                "(a stock server without the hsx plugin?)"
            ) from exc
        if not isinstance(raw, dict):
            raise EngineUnfit(f"{self.base_url}{contract.INFO_PATH} did not answer a JSON object")
        try:
            return contract.EngineInfo.from_dict(raw)
        except TypeError as exc:  # a required field is absent: not an hsx-capable engine
            raise EngineUnfit(f"{self.base_url}{contract.INFO_PATH} is not an hsx engine's: {exc}") from exc

    def prefill(self, input_ids: Sequence[int], rid: str, extra_key: str | None = None) -> dict[str, Any]:
        """``POST /generate`` for one prompt; the engine's JSON reply. A 4xx that no request could avoid
        (401, 403, 404, 405) is :class:`EngineUnfit`; other 4xx are :class:`EngineRejected`."""
        body = contract.generate_body([int(token) for token in input_ids], rid, extra_key)
        try:
            reply = self._request("POST", "/generate", json=body)
        except EngineRejected as exc:
            if exc.status in ENGINE_LEVEL_STATUSES:
                raise EngineUnfit(f"{self.base_url}/generate answered HTTP {exc.status}: {exc}") from exc
            raise
        if not isinstance(reply, dict) or not isinstance(reply.get("meta_info"), dict):
            raise EngineUnfit(f"/generate answered without meta_info: {str(reply)[:200]}")
        return reply

    def alive(self) -> bool:
        """Whether the engine answers ``/hsx/info`` now (after the usual retries)."""
        try:
            self.info()
        except EngineError:
            return False
        return True

    def read_dump(self, dump_dir: str, rid: str, wait_seconds: float) -> Dump:
        return read_dump(dump_dir, rid, wait_seconds)

    def delete_dump(self, dump_dir: str, rid: str) -> None:
        delete_dump(dump_dir, rid)

    def _request(self, method: str, path: str, json: Any = None, timeout: float | None = None) -> Any:
        limit: Any = httpx.USE_CLIENT_DEFAULT
        if timeout is not None:
            limit = httpx.Timeout(min(timeout, self.timeout), connect=min(timeout, self.timeout, 10.0))

        def once() -> Any:
            try:
                response = self._http.request(method, path, json=json, timeout=limit)
            except httpx.ReadTimeout as exc:
                if method != "GET":
                    raise EngineTimeout(f"{method} {path}: no answer within the timeout ({exc})") from exc
                raise _Transient(f"{type(exc).__name__}: {exc}") from exc
            except httpx.TransportError as exc:
                raise _Transient(f"{type(exc).__name__}: {exc}") from exc
            if response.status_code >= 500:
                raise _Transient(f"HTTP {response.status_code}: {response.text[:200]}")
            if response.status_code >= 400:
                reason, detail = _rejection(response)
                raise EngineRejected(reason, response.status_code, detail)
            try:
                return response.json()
            except ValueError as exc:
                raise EngineUnavailable(f"{method} {path}: reply is not JSON: {response.text[:200]}") from exc

        try:
            return self.policy.call(once, (_Transient,), f"{method} {self.base_url}{path}")
        except _Transient as exc:
            raise EngineUnavailable(
                f"{method} {self.base_url}{path} failed {self.policy.attempts} times; last: {exc}"
            ) from exc


class _Transient(Exception):
    """A failure a later try may not meet: no connection, a 5xx, a GET that timed out."""


def _rejection(response: httpx.Response) -> tuple[str, str]:
    """The reason and detail of a 4xx: hsx engines send ``{"error", "detail"}``, SGLang a message object."""
    try:
        body = response.json()
    except ValueError:
        return f"http_{response.status_code}", response.text[:500]
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, str):
            return error, str(body.get("detail", ""))
        if isinstance(error, dict):
            return f"http_{response.status_code}", str(error.get("message", error))
        if "message" in body:
            return f"http_{response.status_code}", str(body["message"])
        if "detail" in body:
            return f"http_{response.status_code}", str(body["detail"])
    return f"http_{response.status_code}", str(body)[:500]


def wait_for_meta(dump_dir: str, rid: str, wait_seconds: float) -> str:
    """The dump directory of ``rid`` once its ``meta.json`` exists (written last: the dump is complete)."""
    directory = contract.dump_path(dump_dir, rid)
    meta_path = os.path.join(directory, contract.META_FILE)
    deadline = time.monotonic() + max(0.0, wait_seconds)
    pause = 0.002
    while not os.path.isfile(meta_path):
        if time.monotonic() >= deadline:
            raise DumpMissing(f"no dump for {rid} in {dump_dir} after {wait_seconds:g}s")
        time.sleep(pause)
        # A short cap: the shard writer takes dumps in order, and every ms it oversleeps a landed dump is a
        # ms it is not copying (a stat every 10 ms costs nothing).
        pause = min(pause * 2, 0.01)
    return directory


def read_dump(dump_dir: str, rid: str, wait_seconds: float) -> Dump:
    """The complete dump of ``rid``, waiting up to ``wait_seconds`` for the engine to finish writing it."""
    directory = wait_for_meta(dump_dir, rid, wait_seconds)
    meta_path = os.path.join(directory, contract.META_FILE)
    try:
        with open(meta_path, encoding="utf-8") as fh:
            meta = contract.DumpMeta.from_json(fh.read())
        tensors = contract.read_safetensors(os.path.join(directory, contract.STATES_FILE))
    except (OSError, ValueError, TypeError, KeyError) as exc:
        raise DumpCorrupt(f"dump of {rid} is unreadable: {exc}") from exc
    if meta.rid != rid:
        raise DumpCorrupt(f"dump directory of {rid} holds the meta of {meta.rid}")
    if "input_ids" not in tensors:
        raise DumpCorrupt(f"dump of {rid} has no input_ids tensor")
    input_ids = _to_numpy("input_ids", tensors["input_ids"]).astype(np.int32, copy=False)
    states: dict[int, npt.NDArray[Any]] = {}
    dtypes: dict[int, str] = {}
    for name, tensor in tensors.items():
        if not name.startswith("hidden."):
            continue
        try:
            hf_index = int(name.removeprefix("hidden."))
        except ValueError as exc:
            raise DumpCorrupt(f"dump of {rid} has a badly named tensor {name!r}") from exc
        states[hf_index] = _to_numpy(name, tensor)
        dtypes[hf_index] = tensor.dtype
    return Dump(meta=meta, input_ids=input_ids, states=states, dtypes=dtypes, path=directory)


def delete_dump(dump_dir: str, rid: str) -> None:
    shutil.rmtree(contract.dump_path(dump_dir, rid), ignore_errors=True)


def _to_numpy(name: str, tensor: contract.RawTensor) -> npt.NDArray[Any]:
    numpy_dtype = NUMPY_DTYPES.get(tensor.dtype)
    if numpy_dtype is None:
        raise DumpCorrupt(f"tensor {name} has unsupported dtype {tensor.dtype}")
    try:
        array = np.frombuffer(tensor.data, dtype=np.dtype(numpy_dtype).newbyteorder("<"))
    except ValueError as exc:  # a byte count that is no multiple of the item size
        raise DumpCorrupt(f"tensor {name}: {exc}") from exc
    count = 1
    for dim in tensor.shape:
        count *= dim
    if array.size != count:
        raise DumpCorrupt(f"tensor {name}: {array.size} values for shape {tensor.shape}")
    return array.reshape(tensor.shape)
