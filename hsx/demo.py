"""``hsx demo``: a real extraction job end to end on the embedded defaults.

It starts what is missing (a local Redis, the reference engine with its prefix cache off, the API and one
worker), migrates the embedded SQLite job table, submits the sample dataset, waits, reads every shard back
through the loader, prints the job's final ``GET /jobs/{id}`` document last, and stops what it started.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import httpx

from hsx.local_stack import free_port, hsx_command, local_stack, redis_reachable, wait_http
from hsx.settings import get_settings


def _say(msg: str) -> None:
    print(f"[demo] {msg}", file=sys.stderr, flush=True)


def run_demo(dataset: str, keep_running: bool = False, timeout: float = 900) -> int:
    settings = get_settings()
    data_dir = settings.data_dir.resolve()
    env: dict[str, str] = {"HSX_DATA_DIR": str(data_dir), "TOKENIZERS_PARALLELISM": "false"}
    with local_stack(data_dir / "logs") as stack:
        redis_url = settings.redis_url
        if not redis_reachable(redis_url):
            redis_url = stack.start_redis()
            _say(f"started redis at {redis_url}")
        env["HSX_REDIS_URL"] = redis_url
        env["HSX_QUEUE_NAME"] = f"hsx-demo-{os.getpid()}"
        engine_port, api_port = free_port(), free_port()
        engine_url, api_url = f"http://127.0.0.1:{engine_port}", f"http://127.0.0.1:{api_port}"
        env.update(HSX_ENGINE_URL=engine_url, HSX_API_URL=api_url)
        os.environ.update(env)
        get_settings.cache_clear()

        from hsx.db.migrate import upgrade

        upgrade(get_settings().resolved_database_url)
        _say("job table migrated; starting the reference engine (first run converts the model, ~1 min)")
        engine = stack.start(
            "engine",
            hsx_command(
                "engine", "--backend", "reference", "--port", str(engine_port), "--disable-prefix-cache"
            ),
            env,
        )
        wait_http(f"{engine_url}/health", 600, engine)
        api = stack.start("api", hsx_command("api", "--port", str(api_port)), env)
        wait_http(f"{api_url}/healthz", 60, api)
        stack.start("worker", hsx_command("worker"), env)
        token = get_settings().token()
        headers = {"Authorization": f"Bearer {token}"} if token else {}

        verify = httpx.post(f"{api_url}/verify", headers=headers, timeout=120)
        _say(f"POST /verify -> {verify.status_code} ok={verify.json().get('ok')}")
        body = {"dataset_uri": str(Path(dataset).resolve()), "options": {"samples_per_shard": 8}}
        resp = httpx.post(f"{api_url}/jobs", json=body, headers=headers, timeout=120)
        if resp.status_code >= 400:
            _say(f"submit refused: {resp.text}")
            return 1
        job_id = resp.json()["id"]
        _say(f"job {job_id} submitted")
        deadline = time.monotonic() + timeout
        doc: dict[str, object] = {}
        while time.monotonic() < deadline:
            doc = httpx.get(f"{api_url}/jobs/{job_id}", headers=headers, timeout=30).json()
            if doc.get("state") in ("succeeded", "failed", "cancelled"):
                break
            time.sleep(1)
        ok = doc.get("state") == "succeeded" and _check_output(doc)
        print(json.dumps(doc, indent=2, sort_keys=True), flush=True)
        return 0 if ok else 1


def _check_output(doc: dict[str, object]) -> bool:
    """Every sample is in a shard with its full token count, or rejected with a reason."""
    from hsx.loader import iter_samples

    progress = doc["progress"]
    assert isinstance(progress, dict)
    seen = 0
    for sample in iter_samples(str(doc["output_dir"])):
        if len(sample.input_ids) != sample.hidden_state.shape[0] or sample.aux_hidden_state.shape[0] != len(
            sample.input_ids
        ):
            _say(f"sample {sample.index}: token count mismatch")
            return False
        seen += 1
    total = int(progress["samples_total"])
    rejected = int(progress["samples_rejected"])
    _say(f"read back {seen} samples from the shards; {rejected} rejected; {total} in the dataset")
    return seen + rejected == total and seen == int(progress["samples_done"])
