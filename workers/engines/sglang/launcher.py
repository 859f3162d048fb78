"""Launch a stock SGLang server with the hsx capture plugin.

    python -m workers.engines.sglang.launcher --model-path DIR [--dump-dir DIR] [--aux-layers 1,15,28]
        [any sglang server argument]

hsx flags are taken out; everything else goes to SGLang's own ``prepare_server_args``. The launcher

* adds ``--skip-tokenizer-init`` (the worker sends token ids; ``--with-tokenizer`` keeps SGLang's) and
  ``--cuda-graph-backend-prefill disabled`` (module hooks do not run when a prefill CUDA graph replays;
  decode graphs stay as configured) unless the caller chose a prefill graph backend, in which case the
  launch is refused unless it is ``disabled``;
* refuses server configurations the capture cannot follow (see ``plugin.unsupported_config``);
* resolves the aux layers (default: EAGLE-3's low/middle/high) against the model config;
* hands the plugin config to the spawned schedulers through ``HSX_SGLANG_*`` environment variables;
* adds ``GET /hsx/info`` (``contract.EngineInfo``) to SGLang's FastAPI app in this process;
* runs ``launch_server(server_args, run_scheduler_process_func=plugin.run_scheduler_process)``.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from hsx import contract
from workers.engines.sglang import plugin

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


def parse_aux_layers(text: str | None) -> list[int] | None:
    if text is None or not text.strip():
        return None
    try:
        return [int(x) for x in text.replace(" ", ",").split(",") if x]
    except ValueError:
        raise SystemExit(f"--aux-layers: expected comma-separated integers, got {text!r}") from None


def split_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
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
    parser.add_argument("--pinned-mb", type=int, default=2048, help="pinned host staging arena (MiB)")
    parser.add_argument("--writer-threads", type=int, default=4, help="dump writer threads")
    parser.add_argument("--with-tokenizer", action="store_true", help="do not add --skip-tokenizer-init")
    parser.add_argument("--hsx-help", action="help", help="show the hsx flags and exit")
    return parser.parse_known_args(argv)


def sglang_argv(ns: argparse.Namespace, rest: list[str]) -> list[str]:
    out = list(rest)
    if not ns.with_tokenizer and "--skip-tokenizer-init" not in out:
        out.append("--skip-tokenizer-init")
    chosen = any(a == f or a.startswith(f + "=") for a in out for f in PREFILL_GRAPH_FLAGS)
    if not chosen:
        out = ["--cuda-graph-backend-prefill", "disabled", *out]
    return out


def _fail(msg: str) -> int:
    print(f"hsx engine (sglang): {msg}", file=sys.stderr, flush=True)
    return 2


def main(argv: list[str]) -> int:
    ns, rest = split_args(argv)
    from sglang.srt.entrypoints.http_server import app, launch_server
    from sglang.srt.server_args import prepare_server_args

    server_args = prepare_server_args(sglang_argv(ns, rest))

    problems = plugin.unsupported_config(server_args)
    if (getattr(server_args, "tokenizer_worker_num", 1) or 1) > 1:
        problems.append("--tokenizer-worker-num > 1: /hsx/info lives in this process's app only")
    if os.environ.get("SGLANG_RUST_SERVER", "").lower() in ("1", "true", "yes"):
        problems.append("SGLANG_RUST_SERVER: the Python HTTP app (and /hsx/info) is not served")
    if problems:
        return _fail("unsupported configuration: " + "; ".join(problems))

    model_config = server_args.get_model_config()
    num_layers = int(model_config.num_hidden_layers)
    hidden_size = int(model_config.hidden_size)
    dtype = str(model_config.dtype).replace("torch.", "")
    aux = parse_aux_layers(ns.aux_layers)
    try:
        aux = aux if aux is not None else contract.eagle3_aux_layer_ids(num_layers)
        hf = contract.hf_indices(aux, num_layers)
    except ValueError as exc:
        return _fail(str(exc))
    if dtype not in plugin.SAFETENSORS_DTYPES:
        return _fail(f"unsupported model dtype {dtype}")

    dump_dir = os.path.abspath(ns.dump_dir or default_dump_dir())
    os.makedirs(dump_dir, exist_ok=True)
    if not os.access(dump_dir, os.W_OK):
        return _fail(f"dump dir {dump_dir} is not writable")

    cfg = plugin.PluginConfig(
        dump_dir=dump_dir,
        aux_layer_ids=aux,
        pinned_mb=ns.pinned_mb,
        writer_threads=ns.writer_threads,
        stats_seconds=float(os.environ.get(plugin.ENV_STATS_SECONDS, "30")),
    )
    os.environ.update(cfg.to_env())  # inherited by the spawned scheduler processes

    info = contract.EngineInfo(
        backend=plugin.ENGINE_NAME,
        model_path=str(server_args.model_path),
        num_layers=num_layers,
        hidden_size=hidden_size,
        dtype=dtype,
        aux_layer_ids=list(aux),
        hf_indices=list(hf),
        dump_dir=dump_dir,
        prefix_cache=not bool(getattr(server_args, "disable_radix_cache", False)),
    ).to_dict()

    async def hsx_info() -> dict[str, object]:
        return info

    app.add_api_route(contract.INFO_PATH, hsx_info, methods=["GET"], response_model=None)
    print(
        f"hsx engine (sglang): layers={num_layers} hidden={hidden_size} dtype={dtype} aux={aux} hf={hf} "
        f"dump_dir={dump_dir} prefix_cache={info['prefix_cache']}",
        file=sys.stderr,
        flush=True,
    )
    launch_server(server_args, run_scheduler_process_func=plugin.run_scheduler_process)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
