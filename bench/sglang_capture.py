"""Capture cost of the SGLang engine: one server, captured rids vs plain rids, in one run.

    python bench/sglang_capture.py --url http://127.0.0.1:30000 --dump-dir /dev/shm/hsx-dumps \
        [--num-prompts 256 --prompt-len 1024 --concurrency 32 --rounds 2 --out result.json]

Plain rids are served but never captured, so the plain rounds measure the stock server; captured rounds
measure the server with the dump, end to end (until every ``meta.json`` is on disk) and until the last
response. Rounds alternate (plain, captured, plain, captured, ...) to cancel drift. After each captured
round every dump is checked for completeness (meta, shapes, file size) and a few are read in full.
Standard library plus ``hsx.contract`` only.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import http.client
import json
import os
import random
import shutil
import struct
import sys
import threading
import time
import urllib.parse
import uuid
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from hsx import contract  # noqa: E402


class Client:
    """Keep-alive HTTP/1.1 connections, one per thread."""

    def __init__(self, url: str, timeout: float = 600.0) -> None:
        u = urllib.parse.urlparse(url)
        self.host, self.port, self.timeout = u.hostname or "127.0.0.1", u.port or 80, timeout
        self.local = threading.local()

    def _conn(self) -> http.client.HTTPConnection:
        conn = getattr(self.local, "conn", None)
        if conn is None:
            conn = self.local.conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)
        return conn

    def request(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        data = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json"} if data is not None else {}
        for attempt in range(2):
            conn = self._conn()
            try:
                conn.request(method, path, body=data, headers=headers)
                resp = conn.getresponse()
                raw = resp.read()
                try:
                    return resp.status, json.loads(raw) if raw else None
                except ValueError:
                    return resp.status, raw.decode(errors="replace")
            except (http.client.HTTPException, ConnectionError, OSError):
                conn.close()
                self.local.conn = None
                if attempt:
                    raise
        raise AssertionError("unreachable")

    def generate(self, ids: list[int], rid: str, extra_key: str | None = None) -> dict[str, Any]:
        status, out = self.request("POST", "/generate", contract.generate_body(ids, rid, extra_key))
        if status != 200:
            raise RuntimeError(f"/generate {rid}: HTTP {status}: {str(out)[:300]}")
        return out  # type: ignore[no-any-return]


def make_prompts(n: int, length: int, seed: int, low: int = 10, high: int = 120000) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(low, high) for _ in range(length)] for _ in range(n)]


def wait_for_dumps(dump_dir: str, rids: list[str], timeout: float) -> float | None:
    """Seconds until every rid has its meta.json, or None on timeout."""
    t0 = time.perf_counter()
    pending = list(rids)
    while pending:
        pending = [r for r in pending if not os.path.exists(os.path.join(dump_dir, r, contract.META_FILE))]
        if not pending:
            break
        if time.perf_counter() - t0 > timeout:
            return None
        time.sleep(0.005)
    return time.perf_counter() - t0


def header_of(path: str) -> tuple[dict[str, Any], int]:
    with open(path, "rb") as fh:
        (hlen,) = struct.unpack("<Q", fh.read(8))
        return json.loads(fh.read(hlen)), 8 + hlen


def check_dumps(
    dump_dir: str, rids: list[str], prompts: list[list[int]], info: dict[str, Any], deep: int = 2
) -> dict[str, Any]:
    """Every dump complete: meta, tensor names/shapes/dtypes, exact file size; ``deep`` read in full."""
    hidden, hf = info["hidden_size"], info["hf_indices"]
    itemsize = contract.DTYPE_SIZES[{"bfloat16": "BF16", "float16": "F16", "float32": "F32"}[info["dtype"]]]
    bad: list[str] = []
    for i, (rid, ids) in enumerate(zip(rids, prompts, strict=True)):
        d = os.path.join(dump_dir, rid)
        try:
            with open(os.path.join(d, contract.META_FILE)) as fh:
                meta = contract.DumpMeta.from_json(fh.read())
            T = len(ids)
            assert meta.num_tokens == T == meta.prompt_tokens, (
                f"tokens {meta.num_tokens}/{meta.prompt_tokens}/{T}"
            )
            assert meta.cached_tokens == 0, f"cached {meta.cached_tokens}"
            assert meta.hf_indices == hf, f"hf {meta.hf_indices}"
            path = os.path.join(d, contract.STATES_FILE)
            header, base = header_of(path)
            names = {"input_ids"} | {contract.tensor_name(x) for x in hf}
            assert set(header) - {"__metadata__"} == names, f"names {sorted(header)}"
            assert header["input_ids"]["shape"] == [T]
            for x in hf:
                assert header[contract.tensor_name(x)]["shape"] == [T, hidden]
            expected = base + 4 * T + len(hf) * T * hidden * itemsize
            assert os.path.getsize(path) == expected, f"size {os.path.getsize(path)} != {expected}"
            if i < deep:
                tensors = contract.read_safetensors(path)
                got = list(struct.unpack(f"<{T}i", tensors["input_ids"].data))
                assert got == list(ids), "input_ids differ"
        except Exception as exc:  # noqa: BLE001 - collect every failure
            bad.append(f"{rid}: {exc!r}")
    return {"checked": len(rids), "complete": len(rids) - len(bad), "bad": bad[:10]}


def run_round(
    client: Client,
    prompts: list[list[int]],
    concurrency: int,
    prefix: str,
    dump_dir: str | None,
    extra_key: bool = False,
) -> dict[str, Any]:
    tag = uuid.uuid4().hex[:8]
    rids = [f"{prefix}{tag}-{i}" for i in range(len(prompts))]
    cached = [0] * len(prompts)

    def one(i: int) -> None:
        out = client.generate(prompts[i], rids[i], extra_key=f"ek-{rids[i]}" if extra_key else None)
        cached[i] = int(out["meta_info"].get("cached_tokens", 0))

    t0 = time.perf_counter()
    with cf.ThreadPoolExecutor(concurrency) as ex:
        list(ex.map(one, range(len(prompts))))
    t_resp = time.perf_counter() - t0
    tokens = sum(len(p) for p in prompts)
    res: dict[str, Any] = {
        "mode": "captured" if prefix.startswith(contract.RID_PREFIX) else "plain",
        "tokens": tokens,
        "secs_responses": round(t_resp, 3),
        "tok_s_responses": round(tokens / t_resp),
        "cached_sum": sum(cached),
        "rids": rids,
    }
    if dump_dir is not None:
        drain = wait_for_dumps(dump_dir, rids, timeout=120)
        res["drain_after_last_response_s"] = None if drain is None else round(drain, 3)
        if drain is not None:
            res["secs_end_to_end"] = round(t_resp + drain, 3)
            res["tok_s_end_to_end"] = round(tokens / (t_resp + drain))
    return res


def bench(
    url: str,
    dump_dir: str,
    num_prompts: int,
    prompt_len: int,
    concurrency: int,
    rounds: int,
    seed: int = 7,
    extra_key: bool = False,
    vocab: int = 120000,
) -> dict[str, Any]:
    """``extra_key``: a distinct cache namespace per request (what the worker sends), so that repeated
    prompts cannot hit a radix cache that is on."""
    client = Client(url)
    status, info = client.request("GET", contract.INFO_PATH)
    if status != 200:
        raise RuntimeError(f"{contract.INFO_PATH}: HTTP {status}")
    prompts = make_prompts(num_prompts, prompt_len, seed, high=vocab)
    warm = make_prompts(concurrency, prompt_len, seed + 1, high=vocab)
    run_round(client, warm, concurrency, "plain-warm-", None, extra_key)
    w = run_round(client, warm, concurrency, contract.RID_PREFIX + "warm-", dump_dir, extra_key)
    for r in w["rids"]:
        shutil.rmtree(os.path.join(dump_dir, r), ignore_errors=True)
    out: dict[str, Any] = {
        "num_prompts": num_prompts,
        "prompt_len": prompt_len,
        "concurrency": concurrency,
        "extra_key": extra_key,
        "info": info,
        "rounds": [],
    }
    for _ in range(rounds):
        plain = run_round(client, prompts, concurrency, "plain-", None, extra_key)
        cap = run_round(client, prompts, concurrency, contract.RID_PREFIX + "bench-", dump_dir, extra_key)
        cap["dumps"] = check_dumps(dump_dir, cap["rids"], prompts, info)
        for r in cap["rids"]:
            shutil.rmtree(os.path.join(dump_dir, r), ignore_errors=True)
        for r in (plain, cap):
            r.pop("rids")
        out["rounds"].append({"plain": plain, "captured": cap})
    plain_best = max(r["plain"]["tok_s_responses"] for r in out["rounds"])
    cap_resp = max(r["captured"]["tok_s_responses"] for r in out["rounds"])
    cap_e2e = max(r["captured"].get("tok_s_end_to_end", 0) for r in out["rounds"])
    out["summary"] = {
        "plain_tok_s": plain_best,
        "captured_tok_s_responses": cap_resp,
        "captured_tok_s_end_to_end": cap_e2e,
        "ratio_responses": round(cap_resp / plain_best, 3),
        "ratio_end_to_end": round(cap_e2e / plain_best, 3),
        "dumps_complete": all(
            r["captured"]["dumps"]["complete"] == r["captured"]["dumps"]["checked"] == num_prompts
            for r in out["rounds"]
        ),
    }
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default="http://127.0.0.1:30000")
    ap.add_argument("--dump-dir", required=True)
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--extra-key", action="store_true", help="a distinct extra_key per request")
    ap.add_argument("--vocab", type=int, default=120000, help="token ids are drawn from [10, vocab)")
    ap.add_argument("--out", default="")
    a = ap.parse_args(argv)
    res = bench(
        a.url,
        a.dump_dir,
        a.num_prompts,
        a.prompt_len,
        a.concurrency,
        a.rounds,
        extra_key=a.extra_key,
        vocab=a.vocab,
    )
    text = json.dumps(res, indent=1)
    if a.out:
        with open(a.out, "w") as fh:
            fh.write(text)
    print(json.dumps(res["summary"]))
    return 0 if res["summary"]["dumps_complete"] else 1


if __name__ == "__main__":
    sys.exit(main())
