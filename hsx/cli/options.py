"""Command-line flags made from a pydantic model's fields, so that ``hsx submit`` can say everything
``POST /jobs`` takes (:class:`hsx.server.job_options.JobOptions`) and a new option cannot be forgotten in one
of them: a field is a flag with no second list to keep.

A field ``max_length`` is ``--max-length``; a field of a nested model, ``regenerate.top_p``, is
``--regenerate-top-p``, and an optional nested model also gets ``--regenerate`` to ask for it with its
defaults. A Literal or an Enum is a choice, a bool ``--x``/``--no-x``, a list comma-separated values, and
any other shape (a dict, say) its JSON.
Each value is checked against its field's constraints as it is parsed (a clear error naming the flag),
the whole against the model before anything is sent (a rule across fields); the API checks again (422).
A flag that is not given is not sent, so the API's default (or the deployment's) applies.
"""

from __future__ import annotations

import argparse
import enum
import json
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel, TypeAdapter, ValidationError
from pydantic.fields import FieldInfo

# Where parsed values go in the namespace: apart from the command's own flags (--json, --wait).
DEST_PREFIX = "option__"


@dataclass(frozen=True)
class OptionFlag:
    path: tuple[str, ...]  # the field's place in the model: ("regenerate", "top_p")
    flag: str  # "--regenerate-top-p"
    enables_model: bool = False  # ``--regenerate``: an optional nested model, asked for with its defaults

    @property
    def dest(self) -> str:
        return DEST_PREFIX + "__".join(self.path)


def flag_name(path: tuple[str, ...]) -> str:
    return "--" + "-".join(part.replace("_", "-") for part in path)


def add_model_flags(parser: argparse.ArgumentParser, model: type[BaseModel]) -> list[OptionFlag]:
    """Add a flag for every field of ``model`` (and of its nested models) to ``parser``; the flags added.
    A field whose flag clashes with one the command has (``--json``, ``--wait``) fails here, when the
    parser is built, so that a test finds it."""
    group = parser.add_argument_group(f"{model.__name__} (each left out takes the API's default)")
    flags: list[OptionFlag] = []
    for path, info, enables_model in _fields(model, ()):
        flag = OptionFlag(path, flag_name(path), enables_model)
        if enables_model:
            group.add_argument(
                flag.flag,
                dest=flag.dest,
                action="store_true",
                default=None,
                help=f"ask for {path[-1]} with its defaults (any {flag.flag}-* flag asks for it too)",
            )
        else:
            _add_value_flag(group, flag, info)
        flags.append(flag)
    return flags


def options_from_args(
    args: argparse.Namespace, flags: list[OptionFlag], model: type[BaseModel]
) -> dict[str, Any]:
    """The options the flags gave (nested as the model nests them), checked against ``model``: a
    ValidationError says what is wrong before anything is sent."""
    options: dict[str, Any] = {}
    for flag in flags:
        value = getattr(args, flag.dest, None)
        if value is None:
            continue
        place = options
        for part in flag.path[:-1]:
            place = place.setdefault(part, {})
        if flag.enables_model:
            place.setdefault(flag.path[-1], {})
        else:
            place[flag.path[-1]] = value
    # As JSON, as the API reads the request (strict models take an enum's value only from JSON).
    model.model_validate_json(json.dumps(options))
    return options


def describe_error(exc: ValidationError) -> str:
    """A model's validation error as flags: ``--max-length: Input should be ...``."""
    return "; ".join(
        f"{flag_name(tuple(str(p) for p in e['loc'])) if e['loc'] else 'options'}: {e['msg']}"
        for e in exc.errors()
    )


def _fields(
    model: type[BaseModel], prefix: tuple[str, ...]
) -> Iterator[tuple[tuple[str, ...], FieldInfo, bool]]:
    for name, info in model.model_fields.items():
        path = (*prefix, name)
        inner, optional = _unwrap_optional(info.annotation)
        if isinstance(inner, type) and issubclass(inner, BaseModel):
            if optional:
                yield path, info, True
            yield from _fields(inner, path)
        else:
            yield path, info, False


def _unwrap_optional(annotation: Any) -> tuple[Any, bool]:
    """``X | None`` as (X, True); anything else as (it, False)."""
    if get_origin(annotation) in (Union, types.UnionType):
        args = [a for a in get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return args[0], len(args) < len(get_args(annotation))
    return annotation, False


def _add_value_flag(group: argparse._ArgumentGroup, flag: OptionFlag, info: FieldInfo) -> None:
    inner, _ = _unwrap_optional(info.annotation)
    text = (info.description or "").strip()
    default = "" if info.is_required() or info.default is None else f" (default: {_shown(info.default)})"
    check = _checker(info)
    if inner is bool:
        group.add_argument(
            flag.flag,
            dest=flag.dest,
            action=argparse.BooleanOptionalAction,
            default=None,
            help=text + default,
        )
        return
    choices = _choices(inner)
    if choices is not None:  # argparse names the choices when a value is none of them
        group.add_argument(
            flag.flag,
            dest=flag.dest,
            type=type(choices[0]),
            choices=choices,
            default=None,
            help=text + default,
        )
        return
    convert, metavar = _reader(inner)
    group.add_argument(
        flag.flag,
        dest=flag.dest,
        type=lambda raw: check(convert(raw)),
        default=None,
        metavar=metavar,
        help=text + default,
    )


def _reader(kind: Any) -> tuple[Callable[[str], Any], str]:
    """How a flag's text becomes a value of ``kind``, and what the help calls it: a plain value as itself,
    a list of plain values comma-separated, any other shape (a dict, a list of lists) as its JSON."""
    scalar = _scalar(kind)
    if scalar is not None:
        return scalar, kind.__name__.upper() if isinstance(kind, type) else "VALUE"
    item = _scalar(get_args(kind)[0]) if get_origin(kind) is list and get_args(kind) else None
    if item is not None:
        return (lambda raw: [item(part.strip()) for part in raw.split(",") if part.strip()]), "A,B,..."
    return _json_value, "JSON"


def _choices(annotation: Any) -> list[Any] | None:
    if get_origin(annotation) is Literal:
        return list(get_args(annotation))
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return [member.value for member in annotation]
    return None


def _scalar(kind: Any) -> Callable[[str], Any] | None:
    """How one value of ``kind`` is read from the command line, if it is a plain value."""
    choices = _choices(kind)
    if choices is not None:

        def choose(raw: str) -> Any:
            value = type(choices[0])(raw)
            if value not in choices:
                raise argparse.ArgumentTypeError(f"{raw!r} is not one of {', '.join(map(str, choices))}")
            return value

        return choose
    if kind is int:
        return lambda raw: _number(raw, int, "a whole number")
    if kind is float:
        return lambda raw: _number(raw, float, "a number")
    if kind is str:
        return str
    return None


def _json_value(raw: str) -> Any:
    try:
        return json.loads(raw)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{raw!r} is not JSON") from None


def _number(raw: str, kind: type[int] | type[float], what: str) -> int | float:
    try:
        return kind(raw)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{raw!r} is not {what}") from None


def _checker(info: FieldInfo) -> Callable[[Any], Any]:
    """A value checked against its field's own constraints (ge, le, min_length...), not the model's rules
    across fields: those are checked on the whole (:func:`options_from_args`). The value is kept as given
    (what validation makes of it, an Enum say, is not what the request sends)."""
    constrained: Any = Annotated[(info.annotation, *info.metadata)] if info.metadata else info.annotation
    adapter: TypeAdapter[Any] = TypeAdapter(constrained)

    def check(value: Any) -> Any:
        try:
            adapter.validate_python(value)
        except ValidationError as exc:
            raise argparse.ArgumentTypeError("; ".join(e["msg"] for e in exc.errors())) from None
        return value

    return check


def _shown(value: Any) -> str:
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, enum.Enum):
        return str(value.value)
    return str(value)
