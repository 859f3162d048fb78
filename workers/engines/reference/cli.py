"""``python -m workers.engines.reference.cli``: serve the reference engine over HTTP."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from hsx import contract
from hsx.server.serving import add_port_file_option


def parse_aux_layers(text: str) -> list[int]:
    try:
        layers = [int(part) for part in text.split(",") if part.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(
            f"--aux-layers wants comma-separated integers, got {text!r}"
        ) from exc
    if not layers:
        raise argparse.ArgumentTypeError("--aux-layers is empty")
    return layers


def build_parser() -> argparse.ArgumentParser:
    from workers.engines.model_store import DEFAULT_MODEL

    parser = argparse.ArgumentParser(
        prog="hsx-reference-engine",
        description="A transformers engine speaking SGLang's /generate protocol, capturing hsx dumps.",
    )
    parser.add_argument("--model", default=DEFAULT_MODEL, help="the default model or a local model directory")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000, help="0: any free port (see --port-file)")
    add_port_file_option(parser)
    parser.add_argument("--dump-dir", default=None, help="where dumps go (default: HSX_DUMP_DIR's value)")
    parser.add_argument(
        "--aux-layers", type=parse_aux_layers, default=None, help="decoder layer ids, e.g. 1,14,26 (EAGLE-3)"
    )
    parser.add_argument(
        "--dtype", choices=["float32", "bfloat16"], default=None, help="default: float32 on CPU, bf16 on CUDA"
    )
    parser.add_argument(
        "--device", default=None, help="torch device (default: cuda when available, else cpu)"
    )
    parser.add_argument(
        "--disable-prefix-cache",
        action="store_true",
        help="never reuse a cached prefix (every token computed)",
    )
    parser.add_argument("--max-cached-prompts", type=int, default=32)
    parser.add_argument(
        "--final-state",
        choices=list(contract.FINAL_STATES),
        default="post",
        help=(
            "post: the final norm's output as hidden.<N> (default); pre: its input, the last layer's "
            f"output, as {contract.PRE_NORM_TENSOR} instead; both"
        ),
    )
    parser.add_argument(
        "--threads", type=int, default=None, help="torch CPU threads (default: torch's choice, one per core)"
    )
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    return parser


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    if args.max_cached_prompts < 1:
        print("--max-cached-prompts must be at least 1", file=sys.stderr)
        return 2
    # Before transformers is imported: the engine serves local files only and must never reach the Hub.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s %(message)s")

    from hsx.server.serving import serve
    from hsx.server.settings import get_settings
    from workers.engines.model_store import resolve_model_dir
    from workers.engines.reference.engine import EngineConfig, ReferenceEngine
    from workers.engines.reference.server import create_app

    if args.threads is not None:
        import torch

        # Several engines on one small host oversubscribe the cores badly with torch's default thread count.
        torch.set_num_threads(max(1, args.threads))
    settings = get_settings()
    try:
        model_dir = resolve_model_dir(args.model, settings)
        engine = ReferenceEngine(
            EngineConfig(
                model_dir=model_dir,
                dump_dir=os.path.abspath(args.dump_dir or settings.resolved_dump_dir),
                aux_layer_ids=args.aux_layers,
                dtype=args.dtype,
                prefix_cache=not args.disable_prefix_cache,
                max_cached_prompts=args.max_cached_prompts,
                device=args.device,
                final_state=args.final_state,
            )
        )
    except (ValueError, FileNotFoundError) as exc:
        print(f"hsx reference engine: {exc}", file=sys.stderr)
        return 2
    info = engine.info()
    logging.getLogger(__name__).info(
        "serving %s (%d layers, %s, hf indices %s, final state %s, prefix cache %s) on %s:%d, dumps in %s",
        info.model_path,
        info.num_layers,
        info.dtype,
        info.hf_indices,
        info.final_state,
        "on" if info.prefix_cache else "off",
        args.host,
        args.port,
        info.dump_dir,
    )
    serve(create_app(engine), args.host, args.port, args.port_file, log_level=args.log_level)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
