"""The bearer-token dependency and the body-size middleware, on a small app served by a real uvicorn on
127.0.0.1 (the in-process ASGI transport is used only to play a non-loopback client)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, SecretStr

from app.deps import settings_dep
from app.security import BodySizeLimitMiddleware, require_token, serving_refusal
from hsx.errors import HsxError
from hsx.server.settings import Settings
from tests.fixtures.live_server import serve_in_thread
from tests.fixtures.stack import REPO

TOKEN = "s3cret-token-\u00e9"  # non-ASCII on purpose: compared as bytes
LIMIT = 1024


class Item(BaseModel):
    text: str


def build_app(settings: Settings) -> tuple[FastAPI, list[str]]:
    """The app under test and the list of handler calls, to show which requests reached a handler."""
    calls: list[str] = []
    app = FastAPI()

    @app.exception_handler(HsxError)
    async def _render(_request: Request, exc: HsxError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status_code, headers=exc.headers or None)

    @app.get("/open")
    def open_route() -> dict[str, str]:
        return {"ok": "yes"}

    @app.post("/raw", dependencies=[Depends(require_token)])
    async def raw(request: Request) -> dict[str, int]:
        body = await request.body()
        calls.append("raw")
        return {"size": len(body)}

    @app.post("/item", dependencies=[Depends(require_token)])
    def item(payload: Item) -> dict[str, int]:
        calls.append("item")
        return {"size": len(payload.text)}

    app.dependency_overrides[settings_dep] = lambda: settings
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=LIMIT)
    return app, calls


@pytest.fixture
def serve() -> Iterator[Callable[[FastAPI], str]]:
    with contextlib.ExitStack() as running:
        yield lambda app: running.enter_context(serve_in_thread(app))


def token_settings(**overrides: object) -> Settings:
    values: dict[str, object] = {"api_token": SecretStr(TOKEN)}
    values.update(overrides)
    return Settings(**values)  # type: ignore[arg-type]


def bearer(token: str) -> dict[bytes, bytes]:
    # httpx would encode a str header as ASCII; send the token's UTF-8 bytes as a client would.
    return {b"Authorization": b"Bearer " + token.encode("utf-8")}


# Tokens


def test_missing_or_wrong_token_is_401_with_a_challenge(serve: Callable[[FastAPI], str]) -> None:
    app, calls = build_app(token_settings())
    base = serve(app)
    cases: list[dict[bytes, bytes]] = [
        {},
        bearer("wrong"),
        bearer(TOKEN + "x"),
        bearer(TOKEN[:-1]),
        {b"Authorization": b"Basic czNjcmV0"},
        {b"Authorization": b"Bearer"},
        {b"Authorization": TOKEN.encode("utf-8")},
    ]
    for headers in cases:
        response = httpx.post(f"{base}/raw", content=b"{}", headers=headers)
        assert response.status_code == 401, headers
        assert response.json()["error"] == "unauthorized"
        assert response.headers["www-authenticate"] == "Bearer"
        assert TOKEN not in response.text
    assert calls == []


def test_right_token_is_200(serve: Callable[[FastAPI], str]) -> None:
    app, calls = build_app(token_settings())
    base = serve(app)
    response = httpx.post(f"{base}/raw", content=b"hello", headers=bearer(TOKEN))
    assert (response.status_code, response.json()) == (200, {"size": 5})
    lower_scheme = {b"Authorization": b"bearer " + TOKEN.encode("utf-8")}
    response = httpx.post(f"{base}/item", json={"text": "abc"}, headers=lower_scheme)
    assert (response.status_code, response.json()) == (200, {"size": 3})
    assert httpx.get(f"{base}/open").status_code == 200  # routes without the dependency stay open
    assert calls == ["raw", "item"]


def test_token_file_is_read_and_a_missing_one_fails_closed(
    serve: Callable[[FastAPI], str], tmp_path: Path
) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n", encoding="utf-8")
    base = serve(build_app(Settings(api_token_file=token_file))[0])
    assert httpx.post(f"{base}/raw", content=b"", headers=bearer(TOKEN)).status_code == 200
    assert httpx.post(f"{base}/raw", content=b"").status_code == 401

    base = serve(build_app(Settings(api_token_file=tmp_path / "absent"))[0])
    response = httpx.post(f"{base}/raw", content=b"", headers=bearer(TOKEN))
    assert (response.status_code, response.json()["error"]) == (503, "auth_unavailable")


def test_configured_token_wins_over_auth_disabled(serve: Callable[[FastAPI], str]) -> None:
    base = serve(build_app(token_settings(auth_disabled=True))[0])
    assert httpx.post(f"{base}/raw", content=b"").status_code == 401


def test_without_a_token_only_loopback_clients_are_served(serve: Callable[[FastAPI], str]) -> None:
    app, _ = build_app(Settings())
    assert httpx.post(f"{serve(app)}/raw", content=b"x").status_code == 200  # the demo: no setup needed

    async def from_address(app: FastAPI, client: tuple[str, int]) -> httpx.Response:
        transport = httpx.ASGITransport(app=app, client=client)
        async with httpx.AsyncClient(transport=transport, base_url="http://hsx") as remote:
            return await remote.post("/raw", content=b"x")

    response = asyncio.run(from_address(app, ("203.0.113.7", 40000)))
    assert response.status_code == 401
    assert "HSX_API_TOKEN_FILE" in response.json()["detail"]
    assert asyncio.run(from_address(app, ("::ffff:127.0.0.1", 40000))).status_code == 200
    assert asyncio.run(from_address(app, ("::1", 40000))).status_code == 200

    opened, _ = build_app(Settings(auth_disabled=True))
    assert asyncio.run(from_address(opened, ("203.0.113.7", 40000))).status_code == 200


def test_the_token_is_never_logged(serve: Callable[[FastAPI], str], caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    base = serve(build_app(token_settings())[0])
    httpx.post(f"{base}/raw", content=b"", headers=bearer(TOKEN))
    httpx.post(f"{base}/raw", content=b"", headers=bearer("wrong-" + TOKEN))
    assert TOKEN not in caplog.text


# Body size


def test_oversized_content_length_is_413_before_the_handler(serve: Callable[[FastAPI], str]) -> None:
    app, calls = build_app(token_settings())
    base = serve(app)
    for path in ("/raw", "/item"):
        response = httpx.post(f"{base}{path}", content=b"x" * (LIMIT * 8), headers=bearer(TOKEN))
        assert response.status_code == 413
        assert response.json() == {
            "error": "payload_too_large",
            "detail": f"the request body is over the limit of {LIMIT} bytes",
        }
    # Exactly at the limit passes.
    response = httpx.post(f"{base}/raw", content=b"x" * LIMIT, headers=bearer(TOKEN))
    assert (response.status_code, response.json()) == (200, {"size": LIMIT})
    assert calls == ["raw"]


def test_oversized_chunked_body_is_413(serve: Callable[[FastAPI], str]) -> None:
    app, calls = build_app(token_settings())
    base = serve(app)

    def pieces(total: int, size: int = 256) -> Iterator[bytes]:
        for start in range(0, total, size):
            yield b"x" * min(size, total - start)

    for path in ("/raw", "/item"):  # /item goes through FastAPI's own body parsing, which would say 400
        response = httpx.post(f"{base}{path}", content=pieces(LIMIT * 8), headers=bearer(TOKEN))
        assert "content-length" not in response.request.headers  # really chunked
        assert response.status_code == 413, response.text
        assert response.json()["error"] == "payload_too_large"
    response = httpx.post(f"{base}/raw", content=pieces(LIMIT), headers=bearer(TOKEN))
    assert (response.status_code, response.json()) == (200, {"size": LIMIT})
    assert calls == ["raw"]


def test_non_numeric_content_length_is_400() -> None:
    app, calls = build_app(token_settings())

    async def send() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://hsx") as client:
            request = client.build_request("POST", "/raw", content=b"{}", headers=bearer(TOKEN))
            request.headers["Content-Length"] = "1_0"  # what int() would take
            return await client.send(request)

    response = asyncio.run(send())
    assert response.status_code == 400
    assert calls == []


# Serving defaults: what `hsx api` refuses at start, empty tokens, forwarded headers


def _hsx_api(env_overrides: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HSX_")}
    env.update(env_overrides)
    return subprocess.run(
        [sys.executable, "-m", "hsx.cli", "api", "--port", "9", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_api_refuses_a_network_address_without_a_token(tmp_path: Path) -> None:
    done = _hsx_api({}, "--host", "0.0.0.0")
    assert done.returncode == 2
    assert "refusing to serve on 0.0.0.0 without an API token" in done.stderr
    assert "HSX_API_TOKEN_FILE" in done.stderr and "Traceback" not in done.stderr

    empty = tmp_path / "token"
    empty.write_text("\n", encoding="utf-8")
    for overrides in ({"HSX_API_TOKEN": ""}, {"HSX_API_TOKEN_FILE": str(empty)}):
        done = _hsx_api(overrides)  # on loopback too: an empty token is a mistake, not "no token"
        assert done.returncode == 2, done.stderr
        assert "empty" in done.stderr and "Traceback" not in done.stderr


@pytest.mark.parametrize(
    ("host", "settings", "refused"),
    [
        ("127.0.0.1", {}, False),
        ("::1", {}, False),
        ("localhost", {}, False),
        ("0.0.0.0", {}, True),
        ("::", {}, True),
        ("10.1.2.3", {}, True),
        ("api.example", {}, True),
        ("0.0.0.0", {"api_token": SecretStr("t")}, False),
        ("0.0.0.0", {"auth_disabled": True}, False),
        ("127.0.0.1", {"api_token": SecretStr(" ")}, True),
    ],
)
def test_serving_refusal(host: str, settings: dict[str, object], refused: bool) -> None:
    assert (serving_refusal(host, Settings(**settings)) is not None) == refused  # type: ignore[arg-type]


def test_an_empty_token_fails_closed(serve: Callable[[FastAPI], str], tmp_path: Path) -> None:
    empty = tmp_path / "token"
    empty.write_text("", encoding="utf-8")
    for settings in (Settings(api_token=SecretStr("")), Settings(api_token_file=empty)):
        base = serve(build_app(settings)[0])
        response = httpx.post(f"{base}/raw", content=b"")
        assert (response.status_code, response.json()["error"]) == (503, "auth_unavailable")


def test_forwarded_requests_are_not_local_unless_proxies_are_trusted(serve: Callable[[FastAPI], str]) -> None:
    # This uvicorn rewrites the client address from X-Forwarded-For sent by 127.0.0.1, as a proxied
    # deployment would: without trusted proxies configured, the app must not take such a request as local.
    base = serve(build_app(Settings())[0])
    assert httpx.post(f"{base}/raw", content=b"").status_code == 200
    for header in (
        {"X-Forwarded-For": "127.0.0.1"},
        {"Forwarded": "for=127.0.0.1"},
        {"X-Real-IP": "127.0.0.1"},
    ):
        response = httpx.post(f"{base}/raw", content=b"", headers=header)
        assert response.status_code == 401, header
        assert "HSX_FORWARDED_ALLOW_IPS" in response.json()["detail"]

    trusting = serve(build_app(Settings(forwarded_allow_ips="127.0.0.1"))[0])
    assert (
        httpx.post(f"{trusting}/raw", content=b"", headers={"X-Forwarded-For": "127.0.0.1"}).status_code
        == 200
    )
    assert (
        httpx.post(f"{trusting}/raw", content=b"", headers={"X-Forwarded-For": "203.0.113.9"}).status_code
        == 401
    )


def test_hsx_api_ignores_forwarded_headers_by_default(tmp_path: Path) -> None:
    from hsx.cli.local_stack import wait_port_file

    env = {k: v for k, v in os.environ.items() if not k.startswith("HSX_")}
    env["HSX_DATABASE_URL"] = f"sqlite:///{tmp_path / 'unmigrated.sqlite3'}"
    port_file = tmp_path / "port"
    proc = subprocess.Popen(
        [sys.executable, "-m", "hsx.cli", "api", "--port", "0", "--port-file", str(port_file)],
        cwd=REPO,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        base = f"http://127.0.0.1:{wait_port_file(port_file, 60, proc)}"
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{base}/healthz", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline and proc.poll() is None, "hsx api did not start"
            time.sleep(0.2)
        # Loopback and no token: served (the unmigrated database then answers in the error shape).
        local = httpx.get(f"{base}/jobs")
        assert (local.status_code, local.json()["error"]) == (500, "database_error")
        relayed = httpx.get(f"{base}/jobs", headers={"X-Forwarded-For": "127.0.0.1"})
        assert relayed.status_code == 401
    finally:
        proc.terminate()
        proc.wait(30)
