"""``hsx submit`` can say everything ``POST /jobs`` takes: a flag for every field of ``JobOptions`` (and of
the models nested in it), made from the model itself, so that a new option cannot be left out of the CLI."""

from __future__ import annotations

import argparse
import enum
import json
import subprocess
import sys
from collections.abc import Iterator
from typing import Any, Literal, get_args, get_origin

import pytest
from pydantic import BaseModel, ConfigDict, Field

from hsx.cli.api_client import EXIT_REFUSED
from hsx.cli.main import build_parser
from hsx.cli.options import add_model_flags, options_from_args
from hsx.server.job_options import JobOptions
from tests.fixtures.live_server import serve_in_thread
from tests.fixtures.stack import REPO, Stack
from tests.test_cli_watch import hsx

SAMPLE = REPO / "tests" / "data" / "short_chats.jsonl"
postgres_only = pytest.mark.parametrize("db_url", ["postgres"], indirect=True)


def submit_parser() -> argparse.ArgumentParser:
    subcommands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    parser: argparse.ArgumentParser = subcommands.choices["submit"]
    return parser


def leaves(model: type[BaseModel], prefix: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], Any]]:
    """Every field a value goes in, with its type (X | None read as X), nested models walked into."""
    for name, info in model.model_fields.items():
        kinds = [k for k in get_args(info.annotation) if k is not type(None)] or [info.annotation]
        kind = kinds[0] if len(kinds) == 1 else info.annotation
        if isinstance(kind, type) and issubclass(kind, BaseModel):
            yield from leaves(kind, (*prefix, name))
        else:
            yield (*prefix, name), kind


def test_every_job_option_has_a_submit_flag() -> None:
    actions = {s: a for a in submit_parser()._actions for s in a.option_strings}
    fields = list(leaves(JobOptions))
    assert len(fields) >= 10
    for path, kind in fields:
        flag = "--" + "-".join(part.replace("_", "-") for part in path)
        assert flag in actions, f"JobOptions field {'.'.join(path)} has no hsx submit flag {flag}"
        if kind is bool:
            assert f"--no-{flag[2:]}" in actions, flag
        if get_origin(kind) is Literal:
            assert list(actions[flag].choices or []) == list(get_args(kind)), flag


def parse(*argv: str) -> dict[str, Any]:
    args = submit_parser().parse_args(["data.jsonl", *argv])
    return options_from_args(args, args.option_flags, JobOptions)


def test_flags_parse_into_the_options_the_api_takes_and_nothing_given_sends_nothing() -> None:
    assert parse() == {}
    options = parse(
        *("--format", "sharegpt", "--no-chat-template", "--max-length", "512", "--truncation", "reject"),
        *("--aux-layers", "1,5, 9", "--samples-per-shard", "8", "--no-cache-namespace-per-request"),
        *("--state-dtype", "fp8_e4m3", "--retention", "consume", "--buffer-cap-bytes", "4096"),
    )
    assert options == {
        "format": "sharegpt",
        "chat_template": False,
        "max_length": 512,
        "truncation": "reject",
        "aux_layers": [1, 5, 9],
        "samples_per_shard": 8,
        "cache_namespace_per_request": False,
        "state_dtype": "fp8_e4m3",
        "retention": "consume",
        "buffer_cap_bytes": 4096,
    }
    stored = JobOptions.model_validate_json(json.dumps(options)).stored()
    defaults = JobOptions().stored()
    # What was given is stored as given; every field no flag named keeps its default.
    assert stored == {**defaults, **options}
    assert parse("--chat-template") == {"chat_template": True}


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--max-length=0"], "--max-length: Input should be greater than or equal to 8"),
        (["--max-length=ten"], "--max-length: 'ten' is not a whole number"),
        (["--state-dtype", "fp16"], "invalid choice: 'fp16' (choose from 'engine', 'fp8_e4m3')"),
        (["--buffer-cap-bytes", "0"], "--buffer-cap-bytes: Input should be greater than or equal to 1"),
        (["--aux-layers", "1,x"], "--aux-layers: 'x' is not a whole number"),
        # A rule of the model across a value (a validator), checked before anything is sent.
        (["--aux-layers", "3,3"], "--aux-layers: Value error, aux_layers must be distinct"),
    ],
)
def test_a_bad_value_is_refused_naming_the_flag_before_anything_is_sent(argv: list[str], says: str) -> None:
    # An API address nothing listens on: a refusal here is the CLI's own.
    done = subprocess.run(
        [sys.executable, "-m", "hsx.cli", "submit", "x.jsonl", "--api-url", "http://127.0.0.1:9", *argv],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == EXIT_REFUSED, done
    assert says in done.stderr, done.stderr


# A model as a future option might look: a nested model (as ``regenerate``), an Enum, a list of strings.
class Turns(enum.Enum):
    LAST = "last"
    ALL = "all"


class Sampling(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    max_new_tokens: int = Field(256, ge=1)
    temperature: float = Field(0.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    seed: int | None = None
    turns: Turns = Turns.LAST


class Future(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    regenerate: Sampling | None = None
    stop: list[str] | None = None
    strict_mode: bool = False
    keep_turns: list[Turns] | None = None
    weights: dict[str, float] | None = None


def parse_future(*argv: str) -> dict[str, Any]:
    parser = argparse.ArgumentParser(exit_on_error=False)
    flags = add_model_flags(parser, Future)
    return options_from_args(parser.parse_args(list(argv)), flags, Future)


def test_nested_models_enums_bools_and_lists_get_flags_of_their_own() -> None:
    assert parse_future() == {}
    assert parse_future(
        *("--regenerate-max-new-tokens", "64", "--regenerate-top-p", "0.9", "--regenerate-turns", "all"),
        *("--stop", "</s>,<|eot|>", "--strict-mode"),
    ) == {
        "regenerate": {"max_new_tokens": 64, "top_p": 0.9, "turns": "all"},
        "stop": ["</s>", "<|eot|>"],
        "strict_mode": True,
    }
    # An optional nested model can be asked for with its defaults alone.
    assert parse_future("--regenerate") == {"regenerate": {}}
    assert parse_future("--regenerate", "--regenerate-seed", "7") == {"regenerate": {"seed": 7}}
    with pytest.raises(argparse.ArgumentError, match="less than or equal to 1"):
        parse_future("--regenerate-top-p", "1.5")
    with pytest.raises(argparse.ArgumentError, match="invalid choice"):
        parse_future("--regenerate-turns", "first")


def test_lists_of_choices_go_comma_separated_and_other_shapes_as_json() -> None:
    options = parse_future("--keep-turns", "all,last", "--weights", '{"a": 0.5, "b": 2}')
    assert options == {"keep_turns": ["all", "last"], "weights": {"a": 0.5, "b": 2}}
    json.dumps(options)  # plain values, as the request sends them
    with pytest.raises(argparse.ArgumentError, match="--keep-turns"):
        parse_future("--keep-turns", "all,first")
    with pytest.raises(argparse.ArgumentError, match="is not JSON"):
        parse_future("--weights", "a=0.5")
    with pytest.raises(argparse.ArgumentError, match="valid number"):
        parse_future("--weights", '{"a": "heavy"}')


@postgres_only
def test_submit_sends_every_option_and_the_api_takes_them(synthetic_stack: Stack) -> None:
    """An fp8 consume job from the command line, as only curl could submit before; a value only the API can
    judge (a length past the engine's context) comes back as its 422."""
    stack = synthetic_stack
    with serve_in_thread(stack.client.app) as api_url:
        done = hsx(
            stack,
            *("submit", str(SAMPLE), "--json", "--api-url", api_url),
            *("--state-dtype", "fp8_e4m3", "--retention", "consume", "--buffer-cap-bytes", "4096"),
            *("--samples-per-shard", "3", "--truncation", "reject", "--no-cache-namespace-per-request"),
        )
        assert done.returncode == 0, (done.stdout, done.stderr)
        options = json.loads(done.stdout)["options"]
        assert options == {
            **JobOptions().stored(),
            "state_dtype": "fp8_e4m3",
            "retention": "consume",
            "buffer_cap_bytes": 4096,
            "samples_per_shard": 3,
            "truncation": "reject",
            "cache_namespace_per_request": False,
        }
        assert stack.job(json.loads(done.stdout)["id"])["stream"]["cap_bytes"] == 4096

        too_long = hsx(stack, "submit", str(SAMPLE), "--json", "--api-url", api_url, "--max-length", "131072")
        assert too_long.returncode == EXIT_REFUSED, too_long
        assert json.loads(too_long.stdout)["error"] == "max_length_exceeds_context", too_long.stdout
