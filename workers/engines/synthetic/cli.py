"""``hsx engine --backend synthetic``: serve the synthetic engine (benchmarks and scale tests)."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from hsx.server.serving import add_port_file_option


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hsx engine --backend synthetic",
        description="An engine that speaks the hsx protocol and writes patterned states at memory speed.",
    )
    parser.add_argument("--hidden-size", type=int, default=4096)
    parser.add_argument("--num-layers", type=int, default=32)
    parser.add_argument(
        "--aux-layers", default=None, help="decoder layer ids, e.g. 1,14,28 (default EAGLE-3)"
    )
    parser.add_argument("--final-state", choices=["post", "pre", "both"], default="post")
    parser.add_argument(
        "--seed", type=int, default=7, help="pattern seed: another seed acts as another checkpoint"
    )
    parser.add_argument("--context-length", type=int, default=32768, help="the positions a prompt may have")
    parser.add_argument(
        "--max-prompt-tokens",
        type=int,
        default=None,
        help="the longest prompt it takes and reports, when shorter than the context length (as SGLang's "
        "KV pool and scheduler make it); a longer one gets a 400",
    )
    parser.add_argument(
        "--max-dump-bytes",
        type=int,
        default=None,
        help="the largest dump it writes and reports (default: its dump directory's file system size); a "
        "larger one is answered and never written, as a real engine whose writer fails",
    )
    parser.add_argument(
        "--reported-dtype",
        default="bfloat16",
        help="the dtype /hsx/info reports (dumps are bf16 whatever it says: another value makes an engine "
        "that breaks the protocol, for tests)",
    )
    parser.add_argument("--vocab-size", type=int, default=49152, help="generated tokens are below it")
    parser.add_argument("--eos-token-id", type=int, default=2, help="the token a finished generation ends on")
    parser.add_argument(
        "--generation-span", type=int, default=64, help="a generation wants 1 to this many tokens"
    )
    parser.add_argument(
        "--ignore-sampling-seed",
        action="store_true",
        help="sample anew whatever sampling_seed says (as SGLang without --enable-deterministic-inference)",
    )
    parser.add_argument(
        "--tokenizer",
        default="",
        help="tokenizer directory reported as the model path (for chat templates); 'default' for the "
        "default model's",
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000, help="0: any free port (see --port-file)")
    add_port_file_option(parser)
    parser.add_argument("--dump-dir", default=None, help="where dumps go (default: HSX_DUMP_DIR's value)")
    parser.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])
    return parser


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s %(message)s")
    from hsx.server.serving import serve
    from hsx.server.settings import get_settings
    from workers.engines.synthetic.engine import SyntheticConfig, SyntheticEngine
    from workers.engines.synthetic.server import create_app

    settings = get_settings()
    if settings.worker_nice > 0:  # the synthetic engine stands in for work a GPU does: it yields to the API
        os.nice(settings.worker_nice)
    tokenizer = args.tokenizer
    try:
        if tokenizer == "default":
            from workers.engines.model_store import DEFAULT_MODEL, resolve_model_dir

            tokenizer = str(resolve_model_dir(DEFAULT_MODEL, settings))
        aux = [int(x) for x in args.aux_layers.split(",")] if args.aux_layers else None
        engine = SyntheticEngine(
            SyntheticConfig(
                hidden_size=args.hidden_size,
                num_layers=args.num_layers,
                dump_dir=os.path.abspath(args.dump_dir or settings.resolved_dump_dir),
                model_path=tokenizer,
                aux_layer_ids=aux,
                final_state=args.final_state,
                seed=args.seed,
                context_length=args.context_length,
                reported_dtype=args.reported_dtype,
                vocab_size=args.vocab_size,
                eos_token_id=args.eos_token_id,
                generation_span=args.generation_span,
                honour_sampling_seed=not args.ignore_sampling_seed,
                max_dump_bytes=args.max_dump_bytes,
                max_prompt_tokens=args.max_prompt_tokens,
            )
        )
    except (ValueError, FileNotFoundError) as exc:
        print(f"hsx synthetic engine: {exc}", file=sys.stderr)
        return 2
    serve(create_app(engine), args.host, args.port, args.port_file, log_level=args.log_level)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
