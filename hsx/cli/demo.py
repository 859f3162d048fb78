"""``hsx demo``: a real extraction job end to end on the embedded defaults.

It starts what is missing (a local Redis, the reference engine with its prefix cache off, the API and one
worker per engine), migrates the embedded SQLite job table, checks the engine through ``POST /verify``,
submits the dataset, waits, reads every shard back through the loader, prints the job's final
``GET /jobs/{id}`` document last, and stops what it started.

With ``--engine-url`` (repeatable) it uses engines that are already running instead, one worker each, all
sharing one job: that is how the GPU runs use it with patched SGLang servers.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from hsx.cli.local_stack import (
    LocalStack,
    hsx_command,
    local_stack,
    redis_reachable,
    wait_http,
    wait_port_file,
)
from hsx.server.settings import get_settings


def _say(msg: str) -> None:
    print(f"[demo] {msg}", file=sys.stderr, flush=True)


def _repeat_dataset(dataset: Path, repeat: int, work: Path) -> Path:
    if repeat <= 1:
        return dataset.resolve()
    rows = [line for line in dataset.read_text().splitlines() if line.strip()]
    out = work / f"{dataset.stem}.x{repeat}.jsonl"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(rows * repeat) + "\n")
    return out.resolve()


def _start(stack: LocalStack, name: str, args: list[str], env: dict[str, str], timeout: float) -> str:
    """``hsx ARGS`` serving on a port it binds itself (``--port 0``): its URL once it answers."""
    port_file = stack.log_dir / f"{name}.port"
    port_file.unlink(missing_ok=True)
    proc = stack.start(name, hsx_command(*args, "--port", "0", "--port-file", str(port_file)), env)
    url = f"http://127.0.0.1:{wait_port_file(port_file, timeout, proc)}"
    wait_http(f"{url}/{'healthz' if args[0] == 'api' else 'health'}", timeout, proc)
    return url


def _start_engines(stack: LocalStack, env: dict[str, str]) -> list[str]:
    _say("starting the reference engine (the first run converts the model, about a minute)")
    return [_start(stack, "engine", ["engine", "--backend", "reference", "--disable-prefix-cache"], env, 900)]


def run_demo(
    dataset: str,
    engine_urls: list[str] | None = None,
    samples_per_shard: int = 8,
    repeat: int = 1,
    timeout: float = 1800,
) -> int:
    settings = get_settings()
    data_dir = settings.data_dir.resolve()
    env: dict[str, str] = {"HSX_DATA_DIR": str(data_dir), "TOKENIZERS_PARALLELISM": "false"}
    with local_stack(data_dir / "logs") as stack:
        redis_url = settings.redis_url
        if not redis_reachable(redis_url):
            redis_url = stack.start_redis()
            _say(f"started redis at {redis_url}")
        env.update(HSX_REDIS_URL=redis_url, HSX_QUEUE_NAME=f"hsx-demo-{os.getpid()}")
        os.environ.update(env)
        get_settings.cache_clear()

        from hsx.server.db.migrate import upgrade

        upgrade(get_settings().resolved_database_url)
        _say("job table migrated")
        urls = engine_urls or _start_engines(stack, env)
        # /verify checks the first engine, run by whichever worker takes it; each worker is colocated with its
        # own engine.
        api_url = _start(stack, "api", ["api"], {**env, "HSX_ENGINE_URL": urls[0]}, 60)
        env["HSX_API_URL"] = api_url
        for i, url in enumerate(urls):
            stack.start(f"worker-{i}", hsx_command("worker"), {**env, "HSX_ENGINE_URL": url})
        token = get_settings().token()
        headers = {"Authorization": f"Bearer {token}"} if token else {}

        verify = httpx.post(f"{api_url}/verify", headers=headers, timeout=300)
        _say(f"POST /verify -> {verify.status_code} ok={verify.json().get('ok')}")
        path = _repeat_dataset(Path(dataset), repeat, data_dir / "datasets")
        body = {"dataset_uri": str(path), "options": {"samples_per_shard": samples_per_shard}}
        resp = httpx.post(f"{api_url}/jobs", json=body, headers=headers, timeout=300)
        if resp.status_code >= 400:
            _say(f"submit refused: {resp.text}")
            return 1
        job_id = resp.json()["id"]
        _say(f"job {job_id} submitted over {path.name}")
        doc = _wait(api_url, job_id, headers, timeout)
        ok = doc.get("state") == "succeeded" and _check_output(doc)
        if len(urls) > 1:
            _say(f"units done per engine: {json.dumps(_units_per_engine(job_id))}")
        print(json.dumps(doc, indent=2, sort_keys=True), flush=True)
        return 0 if ok else 1


def _wait(api_url: str, job_id: str, headers: dict[str, str], timeout: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    last = ""
    # One client for the whole wait: each new one costs about 40 ms of CPU (its TLS context).
    with httpx.Client(headers=headers, timeout=30) as client:
        while True:
            doc: dict[str, Any] = client.get(f"{api_url}/jobs/{job_id}").json()
            p = doc["progress"]
            line = f"{doc['state']}: {p['samples_done']}+{p['samples_rejected']}/{p['samples_total']} samples"
            if line != last:
                _say(line)
                last = line
            if doc["state"] in ("succeeded", "failed", "cancelled") or time.monotonic() > deadline:
                return doc
            time.sleep(1)


def _units_per_engine(job_id: str) -> dict[str, int]:
    from hsx.server.db.session import session_scope
    from hsx.server.jobs.queries import done_units_by_engine

    with session_scope(get_settings().resolved_database_url) as session:
        return done_units_by_engine(session, job_id)


def _check_output(doc: dict[str, Any]) -> bool:
    """Every sample is in exactly one shard with its full token count, or rejected with a reason."""
    from hsx.loader import iter_samples

    progress = doc["progress"]
    indices: list[int] = []
    for sample in iter_samples(str(doc["output_dir"])):
        t = len(sample.input_ids)
        if not (
            sample.aux_hidden_state.shape[0] == len(sample.loss_mask) == t
            and (sample.hidden_state is None or sample.hidden_state.shape[0] == t)
        ):
            _say(f"sample {sample.index}: token count mismatch")
            return False
        indices.append(sample.index)
    total, rejected = int(progress["samples_total"]), int(progress["samples_rejected"])
    duplicated = len(indices) - len(set(indices))
    _say(f"read back {len(indices)} samples ({duplicated} duplicated); {rejected} rejected; {total} in all")
    return (
        duplicated == 0 and len(indices) + rejected == total and len(indices) == int(progress["samples_done"])
    )
