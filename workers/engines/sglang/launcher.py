"""Launch a stock SGLang server with the hsx capture plugin.

    python -m workers.engines.sglang.launcher --model-path DIR [--dump-dir DIR] [--aux-layers 1,15,28]
        [--final-state post|pre|both] [--allow-unsupported-sglang-version] [any sglang server argument]

The launcher

* refuses an SGLang outside ``config.SUPPORTED_RANGE`` unless ``--allow-unsupported-sglang-version``;
* refuses flags that defer a reduction past the capture point (``guards.argv_problems``);
* builds SGLang's command line (``launch_args.sglang_argv``) and SGLang's own final server arguments
  (``prepare_server_args``), and refuses any configuration the capture cannot follow
  (``launch_args.launch_problems``: ``guards.unsupported_config`` and the launcher's own);
* resolves the aux layers (default: EAGLE-3's low/middle/high) against the model config;
* hands the plugin config to the spawned schedulers through ``HSX_SGLANG_*`` environment variables;
* adds ``GET /hsx/info`` (``contract.EngineInfo`` with ``final_state`` and ``extra``) to SGLang's app;
* runs ``launch_server(server_args, run_scheduler_process_func=plugin.run_scheduler_process)``.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import Any

from hsx import contract
from hsx.engine.model_identity import model_fingerprint
from workers.engines.sglang import guards, layouts, plugin
from workers.engines.sglang.config import (
    SAFETENSORS_DTYPES,
    PluginConfig,
    installed_sglang_version,
    parse_aux_layers,
    version_problem,
)
from workers.engines.sglang.launch_args import (
    default_dump_dir,
    engine_extra,
    launch_problems,
    sglang_argv,
    split_args,
)


class LaunchRefused(Exception):
    """A configuration the capture cannot follow; the message says why."""


def _say(msg: str) -> None:
    print(f"hsx engine (sglang): {msg}", file=sys.stderr, flush=True)


def check_version(ns: argparse.Namespace, version: str | None) -> None:
    problem = version_problem(version)
    if problem is None:
        return
    if not ns.allow_unsupported_sglang_version:
        raise LaunchRefused(problem)
    _say(f"WARNING: {problem.split(';')[0]}; running anyway (--allow-unsupported-sglang-version)")


def resolve_server_args(ns: argparse.Namespace, rest: Sequence[str], prepare: Any = None) -> Any:
    """SGLang's final server arguments for this launch; raises :class:`LaunchRefused` when unsupported.

    ``prepare`` is ``sglang.srt.server_args.prepare_server_args`` unless given.
    """
    problems = guards.argv_problems(rest)
    if problems:
        raise LaunchRefused("unsupported flags: " + "; ".join(problems))
    if prepare is None:
        from sglang.srt.server_args import prepare_server_args

        prepare = prepare_server_args
    server_args = prepare(sglang_argv(ns, rest))
    problems = launch_problems(server_args, shared_dump_dir=bool(ns.shared_dump_dir))
    if problems:
        raise LaunchRefused("unsupported configuration: " + "; ".join(problems))
    return server_args


# SGLang's scheduler refuses a prompt of ``max_req_input_len`` tokens or more, which is its context length
# (or KV pool) less 1 for the generated token, less 5 more (sglang 0.5.17, TpModelWorker.get_worker_info);
# its tokenizer manager only asks for the 1.
SCHEDULER_MARGIN = 7


def served_prompt_limit() -> int | None:
    """The longest prompt the running server's scheduler takes (its ``max_req_input_len`` less 1: it
    counts the KV pool as well as the context), or None before it says or where its internals differ."""
    try:
        from sglang.srt.entrypoints.http_server import get_global_state

        limit = get_global_state().tokenizer_manager.max_req_input_len
    except Exception:  # noqa: BLE001 - another SGLang's internals: the static bound stands
        return None
    return int(limit) - 1 if isinstance(limit, int) and limit > 1 else None


def dump_limit(dump_dir: str, writers_on_host: int = 1, writers_on_disk: int = 1) -> int | None:
    """The largest dump the plugin can write: it must fit the dump directory's file system, and a chunked
    prompt is gathered whole in host memory (workers/engines/sglang/reassembly.py) while its dump is
    written, to shared memory on a GPU host: half the host's memory at most. Under DP attention every
    group's leader writes at once: ``writers_on_host`` share the memory, ``writers_on_disk`` the disk."""
    capacity = contract.dump_dir_capacity(dump_dir)
    capacity = capacity // max(1, writers_on_disk) if capacity else capacity
    try:
        memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 2 // max(1, writers_on_host)
    except (ValueError, OSError):
        return capacity
    return min(capacity, memory) if capacity else memory


def capture_leaders(ns: argparse.Namespace, server_args: Any) -> tuple[int, int]:
    """How many capturing schedulers share this node's host memory, and this dump directory's disk."""
    node = int(getattr(server_args, "node_rank", 0) or 0)
    nnodes = int(getattr(server_args, "nnodes", 1) or 1)
    here = layouts.leaders_on_node(server_args, node)
    everywhere = sum(layouts.leaders_on_node(server_args, n) for n in range(nnodes))
    return here, everywhere if ns.shared_dump_dir else here


def build_info(
    ns: argparse.Namespace, server_args: Any, dump_dir: str, version: str | None
) -> tuple[contract.EngineInfo, PluginConfig]:
    """``/hsx/info`` and the plugin configuration for the final server arguments."""
    model_config = server_args.get_model_config()
    num_layers = int(model_config.num_hidden_layers)
    hidden_size = int(model_config.hidden_size)
    dtype = str(model_config.dtype).replace("torch.", "")
    try:
        aux = parse_aux_layers(ns.aux_layers)
        aux = aux if aux is not None else contract.eagle3_aux_layer_ids(num_layers)
        hf = contract.hf_indices(aux, num_layers)
    except ValueError as exc:
        raise LaunchRefused(str(exc)) from None
    if dtype not in SAFETENSORS_DTYPES:
        raise LaunchRefused(f"unsupported model dtype {dtype}")
    text_config = getattr(model_config, "hf_text_config", None) or getattr(model_config, "hf_config", None)
    problems = layouts.dense_aux_problems(server_args, text_config, aux, num_layers)
    if problems:
        raise LaunchRefused("unsupported configuration: " + "; ".join(problems))
    on_host, on_disk = capture_leaders(ns, server_args)
    cfg = PluginConfig(
        dump_dir=dump_dir,
        aux_layer_ids=aux,
        # the node's pinned budget, split among the DP leaders that capture on it
        pinned_mb=max(1, ns.pinned_mb // max(1, on_host)),
        writer_threads=ns.writer_threads,
        switch_interval_ms=ns.switch_interval_ms,
        stats_seconds=float(os.environ.get(plugin.ENV_STATS_SECONDS, "30")),
        final_state=ns.final_state,
        allow_any_version=bool(ns.allow_unsupported_sglang_version),
        shared_dump_dir=bool(ns.shared_dump_dir),
        peer_wait_seconds=float(
            os.environ.get(plugin.ENV_PEER_WAIT_SECONDS, str(plugin.DEFAULT_PEER_WAIT_SECONDS))
        ),
    )
    context = int(getattr(model_config, "context_len", 0) or 0) or None
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
        final_state=ns.final_state,
        extra=engine_extra(server_args, version),
        context_length=context,
        max_prompt_tokens=context - SCHEDULER_MARGIN if context else None,
        max_dump_bytes=dump_limit(dump_dir, on_host, on_disk),
    )
    if os.path.isdir(str(server_args.model_path)):
        # Which weights produced the states: workers never mix two checkpoints of one shape in a job. A hub
        # id (not a local directory) gets none, and jobs then compare shape, tokenizer and template only.
        info.extra[contract.MODEL_FINGERPRINT] = model_fingerprint(str(server_args.model_path))
    return info, cfg


def main(argv: list[str]) -> int:
    try:
        ns, rest = split_args(argv)
        version = installed_sglang_version()
        check_version(ns, version)
        server_args = resolve_server_args(ns, rest)
        dump_dir = os.path.abspath(ns.dump_dir or default_dump_dir())
        os.makedirs(dump_dir, exist_ok=True)
        if not os.access(dump_dir, os.W_OK):
            raise LaunchRefused(f"dump dir {dump_dir} is not writable")
        info, cfg = build_info(ns, server_args, dump_dir, version)
    except (LaunchRefused, ValueError) as exc:
        _say(str(exc))
        return 2
    from sglang.srt.entrypoints.http_server import app, launch_server

    os.environ.update(cfg.to_env())  # inherited by the spawned scheduler processes
    info_dict = info.to_dict()

    async def hsx_info() -> dict[str, object]:
        served = served_prompt_limit()
        if served is not None:  # the KV pool's bound as well as the context's, once the scheduler says
            info_dict["max_prompt_tokens"] = served
        return info_dict

    app.add_api_route(contract.INFO_PATH, hsx_info, methods=["GET"], response_model=None)
    _say(
        f"sglang {version} layers={info.num_layers} hidden={info.hidden_size} dtype={info.dtype} "
        f"aux={info.aux_layer_ids} hf={info.hf_indices} final_state={info.final_state} "
        f"dump_dir={dump_dir} prefix_cache={info.prefix_cache} layout={info.parallel_layout} "
        f"pinned_mb={cfg.pinned_mb} per capturing scheduler"
    )
    node = int(getattr(server_args, "node_rank", 0) or 0)
    if node > 0 and not cfg.shared_dump_dir:
        _say(f"node {node}: no scheduler here captures; dumps are written on node 0, where the worker runs")
    launch_server(server_args, run_scheduler_process_func=plugin.run_scheduler_process)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
