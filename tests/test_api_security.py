"""Hostile input through the real API: nobody without the token reads or starts anything, no path or address
outside what is allowed is fetched, oversized bodies are refused, concurrent duplicates make one job, and
fuzzing the OpenAPI spec finds no server error and no response outside the spec.

The API runs in a real uvicorn on 127.0.0.1 wherever concurrency or the HTTP layer matters; every URL a test
submits is either refused before any connection or served by a test server on 127.0.0.1.
"""

from __future__ import annotations

import http.server
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.fixtures.live_server import serve_in_thread as serve
from tests.fixtures.stack import REPO, TEST_TOKEN, Stack, make_stack

SAMPLE = REPO / "data" / "sample_chats.jsonl"
AUTH = {"Authorization": f"Bearer {TEST_TOKEN}"}
PUBLIC = {("GET", "/healthz"), ("GET", "/readyz")}
# FastAPI's own documentation routes: the schema is public (it names routes, it serves no data).
DOCUMENTATION = {"/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc"}
NO_ENGINE = "http://127.0.0.1:9"  # discard port: for tests that never reach an engine

postgres_only = pytest.mark.parametrize("db_url", ["postgres"], indirect=True)


# --- a live API ------------------------------------------------------------------------------------------


@pytest.fixture
def api(
    db_url: str, redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[Stack, str]]:
    """A stack (job table, Redis queue) and the real app served over HTTP on loopback."""
    from app.main import create_app
    from hsx.server.settings import get_settings

    # No worker runs here: POST /verify (run on a worker) answers 504 after this wait instead of the default.
    stack = make_stack(
        db_url, redis_url, NO_ENGINE, tmp_path, monkeypatch, max_body_bytes="65536", verify_wait_seconds="1"
    )
    with serve(create_app()) as base:
        yield stack, base
    get_settings.cache_clear()


def job_count(stack: Stack) -> int:
    from sqlalchemy import func, select

    from hsx.server.db.models import Job
    from hsx.server.db.session import session_scope

    with session_scope(stack.env["HSX_DATABASE_URL"]) as session:
        return int(session.scalar(select(func.count()).select_from(Job)) or 0)


def queued(stack: Stack) -> int:
    from hsx.server.jobs.queue import queue_for

    return int(queue_for(stack.settings).count)


# --- 9. concurrent duplicate submissions -----------------------------------------------------------------


def test_twenty_parallel_submissions_with_one_key_make_one_job(api: tuple[Stack, str]) -> None:
    stack, base = api
    body = {"dataset_uri": str(SAMPLE), "options": {"samples_per_shard": 8}}
    start = threading.Barrier(20)
    answers: list[httpx.Response] = []
    lock = threading.Lock()

    def post() -> None:
        with httpx.Client(base_url=base, headers={**AUTH, "Idempotency-Key": "same-key-1"}) as client:
            start.wait()
            response = client.post("/jobs", json=body, timeout=60)
        with lock:
            answers.append(response)

    threads = [threading.Thread(target=post) for _ in range(20)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert len(answers) == 20
    codes = sorted(r.status_code for r in answers)
    assert codes == [200] * 19 + [201], [(r.status_code, r.text[:200]) for r in answers]
    ids = {r.json()["id"] for r in answers}
    assert len(ids) == 1
    assert job_count(stack) == 1
    # Units are made by the worker that prepares the job; the API wakes one worker, once.
    assert stack.job(ids.pop())["progress"]["units_total"] == 0
    assert queued(stack) == 1, "the one job's wake-up, enqueued once"


# --- 10. the token guards every route ---------------------------------------------------------------------


def api_routes(app: Any) -> set[tuple[str, str]]:
    """(method, path) of every API route, found by walking the routers, schema or not."""
    from fastapi.routing import APIRoute

    found: set[tuple[str, str]] = set()

    def walk(routes: list[Any], prefix: str) -> None:
        for route in routes:
            if isinstance(route, APIRoute):
                found.update((m, prefix + route.path) for m in route.methods or ())
            elif hasattr(route, "original_router"):  # an included router
                walk(route.original_router.routes, prefix + route.include_context.prefix)

    walk(app.routes, "")
    return found


def concrete(path: str) -> str:
    return path.replace("{job_id}", "00000000-0000-0000-0000-000000000000")


def test_every_route_but_health_refuses_a_missing_or_wrong_token(api: tuple[Stack, str]) -> None:
    from app.main import create_app

    stack, base = api
    app = create_app()
    spec = app.openapi()
    operations = {(m.upper(), p) for p, ops in spec["paths"].items() for m in ops}
    assert api_routes(app) == operations, "every API route is in the schema"
    plain = {getattr(r, "path", "") for r in app.routes if type(r).__name__ == "Route"}
    assert plain == DOCUMENTATION, "no route outside the API routers but FastAPI's documentation"
    protected = sorted(operations - PUBLIC)
    assert len(protected) >= 7 and operations >= PUBLIC
    refusals = [
        {},
        {"Authorization": "Bearer wrong-token"},
        {"Authorization": f"Bearer {TEST_TOKEN}x"},
        {"Authorization": f"Bearer {TEST_TOKEN[:-1]}"},
        {"Authorization": f"Basic {TEST_TOKEN}"},
        {"Authorization": "Bearer"},
        {"Authorization": TEST_TOKEN},
        {"X-Api-Token": TEST_TOKEN},
    ]
    # A body that would start a job, and one FastAPI could not even parse: the token is checked first.
    bodies: list[dict[str, Any]] = [{"json": {"dataset_uri": str(SAMPLE)}}, {"content": b"{not json"}, {}]
    with httpx.Client(base_url=base, timeout=30) as client:
        for method, path in protected:
            documented = spec["paths"][path][method.lower()]["responses"]
            assert "401" in documented, f"{method} {path} does not document its 401"
            for headers in refusals:
                for body in bodies if method == "POST" else [{}]:
                    r = client.request(method, concrete(path), headers=headers, **body)
                    assert r.status_code == 401, (method, path, headers, body, r.status_code, r.text)
                    assert r.json()["error"] == "unauthorized" and r.headers["www-authenticate"] == "Bearer"
                    assert TEST_TOKEN not in r.text
            with_token = client.request(method, concrete(path), headers=AUTH)
            assert with_token.status_code != 401, (method, path)
        for method, path in sorted(PUBLIC):
            assert client.request(method, path).status_code in (200, 503)  # open; 503: no engine here
    assert job_count(stack) == 0 and queued(stack) == 0


# --- 11. paths and addresses outside what is allowed ------------------------------------------------------


class _Recorder(http.server.BaseHTTPRequestHandler):
    """A loopback server that records every request; ``/go`` redirects to the URL in ``target``."""

    requests: list[str]
    target: str

    def do_GET(self) -> None:  # noqa: N802 - the http.server naming
        type(self).requests.append(self.path)
        if self.path.startswith("/go"):
            self.send_response(302)
            self.send_header("Location", type(self).target)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        body = b'{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}\n'
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *_args: Any) -> None:
        pass


@pytest.fixture
def recorder() -> Iterator[tuple[type[_Recorder], int]]:
    handler = type("Recorder", (_Recorder,), {"requests": [], "target": ""})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield handler, server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def stack_no_engine(
    db_url: str, redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Stack]:
    from hsx.server.settings import get_settings

    yield make_stack(db_url, redis_url, NO_ENGINE, tmp_path, monkeypatch)
    get_settings.cache_clear()


def refused(stack: Stack, uri: str) -> dict[str, Any]:
    response = stack.client.post("/jobs", json={"dataset_uri": uri})
    assert response.status_code in (400, 403), (uri, response.status_code, response.text)
    return dict(response.json())


@postgres_only
def test_path_traversal_plain_encoded_and_symlinked_is_refused(
    stack_no_engine: Stack, tmp_path_factory: pytest.TempPathFactory
) -> None:
    stack = stack_no_engine
    root = stack.tmp  # a dataset root of this stack (the other is the repository)
    outside = tmp_path_factory.mktemp("outside") / "secret.jsonl"
    outside.write_text(SAMPLE.read_text())  # a valid dataset, so only its place can refuse it
    (root / "escape.jsonl").symlink_to(outside)
    (root / "escape_dir").symlink_to(outside.parent, target_is_directory=True)
    depth = "../" * len(root.parts)
    cases = {
        "path_traversal": [
            f"{depth}etc/passwd",
            f"data/{depth}etc/passwd",
            "%2e%2e/%2e%2e/etc/passwd",
            "%2E%2E%2F%2E%2E%2Fetc%2Fpasswd",
            "%252e%252e/%252e%252e/etc/passwd",
            "..%2f..%2fetc%2fpasswd",
            "..\\..\\etc\\passwd",
            f"file://{root}/../secret.jsonl",
            f"file://{root}/%2e%2e/secret.jsonl",
            f"file://{root}/%252e%252e/secret.jsonl",
        ],
        "path_outside_roots": [
            "/etc/passwd",
            str(outside),
            f"file://{outside}",
            str(root / "escape.jsonl"),
            str(root / "escape_dir" / "secret.jsonl"),
            f"file://{root / 'escape_dir' / 'secret.jsonl'}",
        ],
        "nul_byte": ["data/sample_chats.jsonl\x00.txt", "data/sample_chats.jsonl%00"],
    }
    for code, uris in cases.items():
        for uri in uris:
            assert refused(stack, uri)["error"] == code, uri
    assert job_count(stack) == 0 and queued(stack) == 0
    # The same file through its real path inside a root is accepted: the refusals were about the path.
    copy = root / "inside.jsonl"
    copy.write_text(outside.read_text())
    assert stack.client.post("/jobs", json={"dataset_uri": str(copy)}).status_code == 201


@postgres_only
def test_private_and_loopback_addresses_are_refused_without_a_connection(
    stack_no_engine: Stack, recorder: tuple[type[_Recorder], int]
) -> None:
    stack = stack_no_engine
    handler, port = recorder
    uris = [
        f"http://127.0.0.1:{port}/data.jsonl",  # loopback is not public: a server right here is refused
        f"http://localhost:{port}/data.jsonl",
        f"http://[::1]:{port}/data.jsonl",
        f"http://[::ffff:127.0.0.1]:{port}/data.jsonl",
        f"http://127.1:{port}/data.jsonl",
        f"http://2130706433:{port}/data.jsonl",
        f"http://0x7f000001:{port}/data.jsonl",
        f"http://0.0.0.0:{port}/data.jsonl",
        "http://10.0.0.1/data.jsonl",
        "http://172.16.0.1/data.jsonl",
        "http://192.168.1.1/data.jsonl",
        "http://169.254.169.254/latest/meta-data/",
        "http://100.64.0.1/data.jsonl",
        "http://[fd00::1]/data.jsonl",
        "http://[fe80::1]/data.jsonl",
        "https://10.0.0.1/data.jsonl",
    ]
    for uri in uris:
        body = refused(stack, uri)
        assert body["error"] == "address_not_public", (uri, body)
    assert handler.requests == [], "nothing was fetched"
    assert job_count(stack) == 0 and queued(stack) == 0


@postgres_only
@pytest.mark.parametrize(
    "target",
    [
        "http://10.0.0.1/data.jsonl",
        "http://169.254.169.254/latest/meta-data/",
        "http://192.168.0.10:8080/data.jsonl",
        "http://[fd12::1]/data.jsonl",
        "http://127.0.0.1:{port}/data.jsonl",
        "http://localhost:{port}/data.jsonl",
    ],
)
def test_a_redirect_to_a_private_address_is_refused(
    stack_no_engine: Stack,
    recorder: tuple[type[_Recorder], int],
    monkeypatch: pytest.MonkeyPatch,
    target: str,
    tmp_path: Path,
) -> None:
    """A download happens in the worker that prepares the job (hsx.server.ingest.convert), never in the
    request; each hop is judged there. The first hop must pass the address check for the redirect to be seen
    at all, and the only server a test may reach is on loopback, which the check refuses: so the check lets
    that one first hop through (once), and every later hop is judged for real, before any connection."""
    from hsx.server.ingest import DatasetError, materialize, policy

    stack = stack_no_engine
    handler, port = recorder
    handler.target = target.format(port=port)
    real = policy.is_public_address
    first_hop = ["127.0.0.1"]

    def public_once(address: str) -> bool:
        if first_hop and address == first_hop[0]:
            first_hop.clear()
            return True
        return real(address)

    monkeypatch.setattr(policy, "is_public_address", public_once)
    with pytest.raises(DatasetError) as refused_by_worker:
        materialize(f"http://127.0.0.1:{port}/go", tmp_path / "prepared", stack.settings)
    assert refused_by_worker.value.reason == "address_not_public", refused_by_worker.value
    assert handler.requests == ["/go"], "only the first hop was fetched"
    assert not any((tmp_path / "prepared").rglob("*.jsonl")), "nothing was kept"


def test_hostile_job_ids_are_not_found_on_every_job_route(api: tuple[Stack, str]) -> None:
    """Ids no job can have (NUL bytes, which PostgreSQL text refuses; far too long; odd characters)."""
    from app.main import create_app

    stack, base = api
    spec = create_app().openapi()
    job_routes = [(m.upper(), p) for p, ops in spec["paths"].items() for m in ops if "{job_id}" in p]
    assert len(job_routes) == 16  # GET /jobs/{job_id}/regenerated is the 16th
    ids = [
        "%00",
        "a%00b",
        "x" * 5000,
        "%E2%80%AE%F0%9F%92%A5",
        "..%2F..%2Fetc",
        "%27%3B%20DROP%20TABLE%20jobs",
    ]
    with httpx.Client(base_url=base, headers=AUTH, timeout=30) as client:
        for method, path in job_routes:
            # A well-formed body where one is needed, so that the id is what gets the request refused.
            bodies = {"/exports": {"format": "modelopt"}, "/acks": {"items": [{"id": 1, "delivery": 1}]}}
            body = next((b for end, b in bodies.items() if path.endswith(end) and method == "POST"), {})
            other_ids = {"{export_id}": "e" * 32, "{consumer_id}": "c" * 32}
            for job_id in ids:
                url = path.replace("{job_id}", job_id)
                for name, value in other_ids.items():
                    url = url.replace(name, value)
                r = client.request(method, url, **({"json": body} if method == "POST" else {}))
                assert r.status_code == 404, (method, path, job_id[:20], r.status_code, r.text[:300])
                assert r.json()["error"] in ("job_not_found", "not_found")
    assert job_count(stack) == 0


# --- 12. oversized bodies, and fuzzing the spec ----------------------------------------------------------


@postgres_only
def test_oversized_bodies_are_refused_with_413(api: tuple[Stack, str]) -> None:
    stack, base = api
    limit = stack.settings.max_body_bytes
    padding = "x" * (limit + 1)
    big = {"dataset_uri": str(SAMPLE), "options": {}, "pad": padding}

    def chunks() -> Iterator[bytes]:
        text = f'{{"dataset_uri": "{SAMPLE}", "pad": "{padding}"}}'.encode()
        for i in range(0, len(text), 4096):
            yield text[i : i + 4096]

    with httpx.Client(base_url=base, timeout=30) as client:
        for headers in (AUTH, {}):  # refused with or without the token, before any handler runs
            r = client.post("/jobs", json=big, headers=headers)
            assert (r.status_code, r.json()["error"]) == (413, "payload_too_large"), r.text
            r = client.post(
                "/jobs", content=chunks(), headers={**headers, "Content-Type": "application/json"}
            )
            assert "content-length" not in r.request.headers
            assert (r.status_code, r.json()["error"]) == (413, "payload_too_large"), r.text
        r = client.post("/verify", content=b"0" * (limit + 1), headers=AUTH)
        assert r.status_code == 413
    assert job_count(stack) == 0 and queued(stack) == 0


FUZZ_CHECKS = (
    "not_a_server_error",
    "status_code_conformance",
    "content_type_conformance",
    "response_headers_conformance",
    "response_schema_conformance",
    "negative_data_rejection",
)


@postgres_only
def test_fuzzing_the_spec_finds_no_server_error_and_no_off_spec_response(
    db_url: str, redis_url: str, engine_synthetic: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Schemathesis' CLI against the app under uvicorn on loopback, with the token; bounded by examples."""
    from app.main import create_app
    from hsx.server.settings import get_settings

    # File URIs only: a fuzzed http URI would send its host name to the resolver.
    stack = make_stack(
        db_url, redis_url, engine_synthetic.url, tmp_path, monkeypatch, allowed_uri_schemes='["file"]'
    )
    # Half the job ids are a real job's, so that the job routes answer with documents, not only 404s.
    job_id = stack.submit(SAMPLE)["id"]
    config = tmp_path / "schemathesis.toml"
    config.write_text(
        f'[dictionaries.jobs]\nvalues = ["{job_id}"]\n\n'
        '[parameters]\n"path.job_id" = { dictionary = "jobs", probability = 0.5 }\n'
    )
    try:
        with serve(create_app()) as base:
            run = subprocess.run(
                [
                    str(Path(sys.executable).with_name("schemathesis")),
                    "--config-file",
                    str(config),
                    "run",
                    f"{base}/openapi.json",
                    "--header",
                    f"Authorization: Bearer {TEST_TOKEN}",
                    "--checks",
                    ",".join(FUZZ_CHECKS),
                    # No input to fuzz, and it runs on a worker, which none is here: with none it answers
                    # 504 by design (tests/test_split_topology.py holds it to its answers).
                    "--exclude-path",
                    "/verify",
                    "--phases",
                    "examples,coverage,fuzzing",
                    "--max-examples",
                    "60",
                    "--seed",
                    "20240601",
                    "--workers",
                    "1",
                    "--request-timeout",
                    "60",
                    "--suppress-health-check",
                    "all",
                    "--output-sanitize",
                    "true",
                ],
                capture_output=True,
                text=True,
                timeout=150,
                cwd=tmp_path,
                env={**os.environ, "NO_COLOR": "1", "SCHEMATHESIS_HOOKS": ""},
            )
    finally:
        get_settings.cache_clear()
    report = run.stdout[-6000:] + run.stderr[-2000:]
    assert run.returncode == 0, report
    assert "No issues found" in run.stdout or " passed" in run.stdout, report
    assert stack.client.get("/healthz").status_code == 200
