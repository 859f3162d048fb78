"""``hsx export JOB_OR_DIR --format specforge|speculators|modelopt DEST``: arguments and the command."""

from __future__ import annotations

import argparse
import json
import sys

from hsx.integrations.exports import FORMATS, ExportOptions, export_output, resolve_source


def add_export_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "source", metavar="JOB_OR_DIR", help="a job id (under HSX_OUTPUT_DIR) or an output dir"
    )
    parser.add_argument("--format", required=True, choices=FORMATS)
    parser.add_argument("dest", metavar="DEST", help="a new (or empty) directory for the export")
    parser.add_argument(
        "--draft-vocab-size", type=int, help="specforge: also write vocab_mapping/vocab_mapping.pt for it"
    )
    parser.add_argument(
        "--target-vocab-size", type=int, help="default: vocab_size in the target model's config.json"
    )
    parser.add_argument(
        "--vocab-max-length", type=int, help="count only each sample's first N tokens (the trainer's max_len)"
    )
    parser.add_argument("--group-size", type=int, default=2000, help="specforge: files per rows_* folder")
    parser.add_argument("--no-verify", action="store_true", help="skip hashing each shard before reading it")


def run_export_command(args: argparse.Namespace) -> int:
    from hsx.errors import HsxError
    from hsx.loader import LoaderError
    from hsx.server.settings import get_settings

    options = ExportOptions(
        draft_vocab_size=args.draft_vocab_size,
        target_vocab_size=args.target_vocab_size,
        vocab_max_length=args.vocab_max_length,
        group_size=args.group_size,
        verify_checksums=not args.no_verify,
    )
    try:
        source = resolve_source(args.source, get_settings().resolved_output_dir)
        report = export_output(source, args.format, args.dest, options)
    except HsxError as exc:
        print(json.dumps(exc.body(), indent=2), file=sys.stderr)
        return 2
    except LoaderError as exc:  # a shard does not match its manifest: the output itself is damaged
        print(json.dumps({"error": "output_damaged", "detail": str(exc)}, indent=2), file=sys.stderr)
        return 1
    print(json.dumps(report, indent=2, sort_keys=True))
    return 0
