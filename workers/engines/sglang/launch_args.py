"""The launcher's argument handling (standard library only): hsx flags out, SGLang's argv in, checks.

hsx flags are taken out of the command line; everything else goes to SGLang's own ``prepare_server_args``
after :func:`sglang_argv` adds what the capture needs:

* ``--skip-tokenizer-init`` (the worker sends token ids; ``--with-tokenizer`` keeps SGLang's);
* ``--cuda-graph-backend-prefill disabled`` (module hooks do not run when a prefill CUDA graph replays;
  decode graphs stay as configured) unless the caller chose a prefill graph backend themselves;
* ``--enforce-disable-flashinfer-allreduce-fusion`` (a fused all-reduce would run after the capture point;
  see :mod:`guards`).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from hsx import contract
from hsx.engine import regenerate_contract as engine_contract
from workers.engines.sglang import guards, layouts
from workers.engines.sglang.config import (
    DEFAULT_SWITCH_INTERVAL_MS,
    DEFAULT_WRITERS,
    ENV_SWITCH_INTERVAL_MS,
    ENV_WRITERS,
    SUPPORTED_RANGE,
    VERSION_OVERRIDE_FLAG,
    version_problem,
)

# Flags with which the caller picks the prefill CUDA graph backend themselves.
PREFILL_GRAPH_FLAGS = (
    "--cuda-graph-backend-prefill",
    "--cuda-graph-config",
    "--disable-prefill-cuda-graph",
    "--enable-breakable-cuda-graph",
    "--enforce-piecewise-cuda-graph",
    "--disable-piecewise-cuda-graph",
)


def default_dump_dir() -> str:
    """``HSX_DUMP_DIR`` when set, else hsx's own default (shared memory where it exists)."""
    env = os.environ.get("HSX_DUMP_DIR")
    if env:
        return env
    return "/dev/shm/hsx-dumps" if os.path.isdir("/dev/shm") else str(Path.home() / ".hsx" / "dumps")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hsx engine --backend sglang",
        allow_abbrev=False,
        add_help=False,
        description="SGLang server with hsx hidden-state capture; other arguments go to SGLang.",
    )
    parser.add_argument("--backend", default="sglang", choices=["sglang"], help=argparse.SUPPRESS)
    parser.add_argument("--dump-dir", default=None, help="where per-request dumps go (default: HSX_DUMP_DIR)")
    parser.add_argument(
        "--aux-layers", default=None, help="decoder layer ids, comma-separated (default: EAGLE-3)"
    )
    parser.add_argument(
        "--final-state",
        default="post",
        choices=list(contract.FINAL_STATES),
        help=(
            f"post: the final norm's output as hidden.<N> (default); pre: its input (the last layer's "
            f"output) as {contract.PRE_NORM_TENSOR} instead; both"
        ),
    )
    parser.add_argument(
        "--pinned-mb",
        type=int,
        default=2048,
        help="pinned host staging memory (MiB) of this node, shared by its capturing schedulers (DP leaders)",
    )
    # The defaults come from the environment, so HSX_SGLANG_* set by a deployment is not overridden.
    parser.add_argument(
        "--writer-threads",
        type=int,
        default=_env_number(ENV_WRITERS, int, DEFAULT_WRITERS),
        help=f"dump writer threads (default: ${ENV_WRITERS}, else {DEFAULT_WRITERS})",
    )
    parser.add_argument(
        "--switch-interval-ms",
        type=float,
        default=_env_number(ENV_SWITCH_INTERVAL_MS, float, DEFAULT_SWITCH_INTERVAL_MS),
        help=(
            "the scheduler process's GIL switch interval, so the writer threads are not held up by the "
            f"scheduler loop (default: ${ENV_SWITCH_INTERVAL_MS}, else {DEFAULT_SWITCH_INTERVAL_MS}; 0 keeps "
            "Python's 5 ms)"
        ),
    )
    parser.add_argument("--with-tokenizer", action="store_true", help="do not add --skip-tokenizer-init")
    parser.add_argument(
        "--shared-dump-dir",
        action="store_true",
        help=(
            "every node's --dump-dir is the directory the worker reads (a shared file system, or simulated "
            "nodes on one host): lets DP-attention groups on several nodes capture (checked at start)"
        ),
    )
    parser.add_argument(
        VERSION_OVERRIDE_FLAG,
        dest="allow_unsupported_sglang_version",
        action="store_true",
        help=f"run on an SGLang outside sglang{SUPPORTED_RANGE} (the capture is unproven there)",
    )
    parser.add_argument("--hsx-help", action="help", help="show the hsx flags and exit")
    return parser


def _env_number(name: str, kind: type[int] | type[float], default: float) -> float:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        return kind(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a number") from None


def split_args(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    """The hsx flags, and everything else (for SGLang)."""
    ns, rest = build_parser().parse_known_args(list(argv))
    if ns.pinned_mb < 1:
        raise ValueError(f"--pinned-mb must be at least 1, got {ns.pinned_mb}")
    if ns.writer_threads < 1:
        raise ValueError(f"--writer-threads must be at least 1, got {ns.writer_threads}")
    if not 0 <= ns.switch_interval_ms <= 100:
        raise ValueError(f"--switch-interval-ms must be within 0..100, got {ns.switch_interval_ms}")
    return ns, rest


def sglang_argv(ns: argparse.Namespace, rest: Sequence[str]) -> list[str]:
    """SGLang's command line: the caller's arguments plus what the capture needs."""
    out = list(rest)
    if not ns.with_tokenizer and "--skip-tokenizer-init" not in out:
        out.append("--skip-tokenizer-init")
    if not any(guards.flag_given(out, f) for f in PREFILL_GRAPH_FLAGS):
        out = ["--cuda-graph-backend-prefill", "disabled", *out]
    if not guards.flag_given(out, guards.DISABLE_FUSION_FLAG):
        out.append(guards.DISABLE_FUSION_FLAG)
    return out


def launch_problems(
    server_args: Any, env: Mapping[str, str] | None = None, shared_dump_dir: bool = False
) -> list[str]:
    """Everything about the final server arguments (and the launcher's environment) hsx refuses."""
    env = os.environ if env is None else env
    problems = guards.unsupported_config(server_args, shared_dump_dir)
    if (getattr(server_args, "tokenizer_worker_num", 1) or 1) > 1:
        problems.append("--tokenizer-worker-num > 1: /hsx/info lives in this process's app only")
    if env.get("SGLANG_RUST_SERVER", "").lower() in ("1", "true", "yes"):
        problems.append("SGLANG_RUST_SERVER: the Python HTTP app (and /hsx/info) is not served")
    return problems


def engine_extra(server_args: Any, version: str | None = None) -> dict[str, Any]:
    """Engine facts recorded in ``/hsx/info``'s ``extra``, each dump's ``meta.extra`` and the manifest."""
    if version is None:
        from workers.engines.sglang.config import installed_sglang_version

        version = installed_sglang_version()

    def get(name: str) -> Any:
        value = getattr(server_args, name, None)
        return value if value is None or isinstance(value, (bool, int, float, str)) else str(value)

    return {
        "engine_version": version,
        "supported_versions": SUPPORTED_RANGE,
        "version_in_range": version_problem(version) is None,
        "tp_size": int(get("tp_size") or 1),
        contract.PARALLEL_LAYOUT: layouts.parallel_layout(server_args).to_dict(),
        "chunked_prefill_size": get("chunked_prefill_size"),
        "attention_backend": get("attention_backend"),
        "flashinfer_allreduce_fusion_backend": get("flashinfer_allreduce_fusion_backend"),
        "disable_radix_cache": bool(get("disable_radix_cache")),
        # SGLang 0.5.17 hands sampling_seed to its sampler only under --enable-deterministic-inference.
        engine_contract.SEEDED_SAMPLING: bool(get("enable_deterministic_inference")),
    }
