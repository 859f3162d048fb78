"""Whether an engine may serve a job: the rules a worker applies before it takes a unit, and that
``/readyz`` and ``hsx verify`` report. No torch, no ``workers`` import.

An engine is unfit for a job when it would put other states in it than the job's first engine did, or
states that cannot be trusted:

* another model: layers, hidden size, captured layers, dtype or final state differ, or the same shape
  with other weights (the ``model_fingerprint`` the engine reports, see :mod:`hsx.engine.model_identity`);
* another tokenizer or chat template on the worker's side (token ids, and so the states, would differ);
* a prefix cache that is on, whatever the job's ``cache_namespace_per_request`` says: a cached prefix is not
  computed, so not dumped. A per-request namespace (SGLang's ``extra_key``) is only a second guard: it
  depends on the engine honouring the key, which a stock engine, another version or a proxy in between may
  not, and the preflight, which sends none, could not prove the engine then. So the rule is the safe one,
  the same here, in the preflight (``hsx verify``) and in the README;
* aux layers other than the job asks for, or a context shorter than the job's ``max_length``, or one that
  cannot hold a regenerate job's ``max_new_tokens`` beside a prompt;
* an engine that does not speak this protocol version.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from hsx import contract
from hsx.server.job_options import JobOptions

# Facts of EngineInfo a job's states depend on; they must be equal across the engines of one job.
SHAPE_KEYS = ("num_layers", "hidden_size", "hf_indices", "dtype", "final_state")


def protocol_problem(info: contract.EngineInfo) -> str | None:
    if info.protocol_version != contract.PROTOCOL_VERSION:
        return f"the engine speaks protocol {info.protocol_version}, this hsx {contract.PROTOCOL_VERSION}"
    return None


PREFIX_CACHE_PROBLEM = (
    "the engine's prefix cache is on: a cached prefix is not computed, so not dumped (per-request cache "
    "namespaces do not make it fit; start it with --disable-radix-cache or --disable-prefix-cache)"
)


def as_options(options: JobOptions | Mapping[str, Any]) -> JobOptions:
    """A job's options, typed: a job row's JSON is read as :meth:`JobOptions.from_stored` reads it."""
    return options if isinstance(options, JobOptions) else JobOptions.from_stored(options)


@dataclass(frozen=True)
class OptionProblem:
    code: str  # the error POST /jobs refuses the options with (a 422)
    detail: str


def option_checks(
    info: contract.EngineInfo, options: JobOptions | Mapping[str, Any], check_cache: bool = True
) -> list[OptionProblem]:
    """What makes the engine unfit for a job's options, whatever engine the job started with.
    (``check_cache=False``: where the preflight decides on the cache, and where a test shows the
    per-sample checks behind the cache rule.)"""
    typed = as_options(options)
    problems: list[OptionProblem] = []
    if check_cache and info.prefix_cache:
        problems.append(OptionProblem("engine_unfit", PREFIX_CACHE_PROBLEM))
    if typed.aux_layers is not None and typed.aux_layers != list(info.aux_layer_ids):
        detail = f"the job asks for aux layers {typed.aux_layers}, the engine captures {info.aux_layer_ids}"
        problems.append(OptionProblem("aux_layers_mismatch", detail))
    context = info.context_length
    if context and typed.max_length > context:
        detail = f"max_length {typed.max_length} exceeds the engine's context length {context}"
        problems.append(OptionProblem("max_length_exceeds_context", detail))
    # A generation's prompt and its new tokens must fit in the context together (the engine refuses the
    # request otherwise, hsx.engine.regenerate_contract), and a prompt has a token at least: past this,
    # every sample would be rejected as generation_rejected.
    if context and typed.regenerate is not None and typed.regenerate.max_new_tokens >= context:
        detail = (
            f"regenerate.max_new_tokens {typed.regenerate.max_new_tokens} leaves no room for a prompt in "
            f"the engine's context length {context} (a prompt and its new tokens must fit in it together)"
        )
        problems.append(OptionProblem("max_new_tokens_exceeds_context", detail))
    return problems


def option_problems(
    info: contract.EngineInfo, options: JobOptions | Mapping[str, Any], check_cache: bool = True
) -> list[str]:
    """:func:`option_checks`, as sentences."""
    return [problem.detail for problem in option_checks(info, options, check_cache)]


def identity_problems(
    job_engine: Mapping[str, Any], info: contract.EngineInfo, worker_side: Mapping[str, Any] | None = None
) -> list[str]:
    """How this engine (and the worker's tokenizer and template, ``worker_side``: the ``tokenizer`` and
    ``chat_template_sha256`` entries of an engine record) differ from the job's first engine."""
    problems: list[str] = []
    for key in SHAPE_KEYS:
        want = job_engine.get(key, "post" if key == "final_state" else None)
        if want != getattr(info, key):
            problems.append(f"{key} is {getattr(info, key)!r}, the job's engine had {want!r}")
    want_print = (job_engine.get("extra") or {}).get(contract.MODEL_FINGERPRINT)
    if want_print and info.model_fingerprint != want_print:
        got = info.model_fingerprint or "not reported"
        problems.append(f"model fingerprint is {got}, the job's engine had {want_print} (another checkpoint)")
    if worker_side is not None:
        problems.extend(_tokenizer_problems(job_engine, worker_side))
    return problems


def _tokenizer_problems(job_engine: Mapping[str, Any], worker_side: Mapping[str, Any]) -> list[str]:
    problems: list[str] = []
    want, got = job_engine.get("tokenizer") or {}, worker_side.get("tokenizer") or {}
    if "error" not in want:  # the job started without a tokenizer (pre-tokenized records): nothing to match
        for key in ("tokenizer_json_sha256", "vocab_size"):
            if want.get(key) is not None and got.get(key) != want.get(key):
                problems.append(f"tokenizer {key} is {got.get(key)!r}, the job's was {want.get(key)!r}")
        want_template = job_engine.get("chat_template_sha256")
        if want_template and worker_side.get("chat_template_sha256") != want_template:
            problems.append(
                f"chat template sha256 is {worker_side.get('chat_template_sha256') or 'none'}, "
                f"the job's was {want_template}"
            )
    return problems


def unfit_reason(
    info: contract.EngineInfo,
    options: JobOptions | Mapping[str, Any],
    job_engine: Mapping[str, Any] | None = None,
    worker_side: Mapping[str, Any] | None = None,
) -> str | None:
    """Why this engine may not serve the job, or None."""
    problems = [p for p in [protocol_problem(info)] if p]
    problems += option_problems(info, options)
    if job_engine:
        problems += identity_problems(job_engine, info, worker_side)
    return "; ".join(problems) or None


def identity_digest(info: contract.EngineInfo, worker_side: Mapping[str, Any] | None = None) -> str:
    """A short digest of everything a preflight result depends on: an engine whose digest is unchanged
    need not be verified again for the same job."""
    raw = info.to_dict()
    raw.pop("dump_dir", None)
    raw["worker_side"] = dict(worker_side or {})
    text = json.dumps(raw, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def unreported_identity(info: contract.EngineInfo) -> list[str]:
    """What the engine does not report, so that a job cannot check it (never a reason to refuse it)."""
    notes: list[str] = []
    if not info.model_fingerprint:
        notes.append(
            "no model_fingerprint reported: another checkpoint of the same shape could join a job unnoticed"
        )
    if not info.context_length:
        notes.append("no context_length reported: max_length is not checked against the model")
    return notes
