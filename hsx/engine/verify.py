"""``hsx verify``: prove that an engine's captures are complete before trusting it with a job.

Two prompts that share a long prefix go to the engine one after the other, without ``extra_key``: an engine
whose prefix cache is on (SGLang's radix cache by default) recomputes only the second prompt's tail and
dumps a truncated capture, which shows up here as a failing ``cached_tokens`` check. Each dump is judged
by the job's own validator (:func:`hsx.engine.dumps.validate_open_dump`): the report lists its every check, so
a passing preflight proves exactly what a job applies to each sample (plus a count of NaN/Inf in every
byte, where the job may rely on the engine's count and its copy-time check).

It also says why an engine is unfit, before any prompt: a protocol it does not speak, a prefix cache
that is on, and, given a job (its engine record and options), how it differs from the engine that job
started with (``hsx verify --job ID``; see :mod:`hsx.engine.fitness`); for an fp8 job, also that a few of
its stored samples are within the documented error bound of this engine's states
(:mod:`hsx.engine.verify_fp8`).

No torch: the API runs this. A torch comparison against transformers plugs in through ``dump_check``.
"""

from __future__ import annotations

import os
import re
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from tokenizers import Tokenizer

from hsx import contract
from hsx.engine import fitness as engine_fitness
from hsx.engine.client import DumpMissing, EngineClient, EngineError, EngineRejected
from hsx.engine.dumps import Dump, delete_dump, load_states, open_dump, validate_open_dump
from hsx.engine.validation import Check as Check  # the validator's check is the report's

# About 50 tokens shared by both prompts, then different endings: long enough that any prefix cache hits.
SHARED_PREFIX = (
    "The lighthouse keeper climbed the spiral stairs every evening at dusk, counting all one hundred and "
    "twelve steps while the wind rattled the narrow windows. At the top he trimmed the wick, polished the "
    "great lens, and wrote the weather in his logbook."
)
PROMPT_A = SHARED_PREFIX + " Tonight the sea was calm and the sky was full of stars."
PROMPT_B = SHARED_PREFIX + " Tonight a storm rolled in from the west and the ships hurried home."

# Rids of a reply-only check: outside contract.RID_PREFIX, so the engine captures nothing.
REPLY_ONLY_PREFIX = "verify-reply-"
DEFAULT_TIMEOUT_SECONDS = 120.0
DEFAULT_DUMP_WAIT_SECONDS = 30.0


@dataclass
class VerifyReport:
    ok: bool
    checks: list[Check] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "checks": [check.to_dict() for check in self.checks]}

    @property
    def failed(self) -> list[Check]:
        return [check for check in self.checks if not check.ok]


# Extra checks on each dump before it is deleted: (prompt label, sent ids, dump) -> checks.
DumpCheck = Callable[[str, list[int], Dump], list[Check]]


def run_verification(
    engine_url: str,
    dump_dir: str | None = None,
    tokenizer_path: str | None = None,
    rid_prefix_tag: str = "verify",
    *,
    dump_check: DumpCheck | None = None,
    timeout: float = DEFAULT_TIMEOUT_SECONDS,
    dump_wait_seconds: float = DEFAULT_DUMP_WAIT_SECONDS,
    job: Mapping[str, Any] | None = None,
    dumps: bool = True,
) -> VerifyReport:
    """Verify the engine at ``engine_url``; engine failures become failing checks, never exceptions.
    ``job``: a job document (``engine`` and ``options``) the engine is checked against as well.
    ``dumps=False``: judge only what the engine replies (cache reuse, token counts) and have nothing
    dumped, for a host that does not see the dumps (the API's submit preflight): the prompts go with rids
    outside the capture prefix, so no dump is left behind for nobody to delete."""
    checks: list[Check] = []
    with EngineClient(engine_url, timeout=timeout, retries=1, backoff=0.2) as client:
        info = _engine_info(client, checks)
        if info is None:
            return _report(checks)
        checks.extend(fitness_checks(info, job))
        tokenizer: Tokenizer | None = None
        engine_tokenizer = os.path.join(info.model_path, "tokenizer.json") if info.model_path else ""
        if tokenizer_path or os.path.isfile(engine_tokenizer):
            tokenizer = _load_tokenizer(tokenizer_path or info.model_path, checks)
            if tokenizer is None:
                return _report(checks)
        else:
            # A checkpoint without tokenizer files (or a synthetic engine): the prompts go in as byte-level
            # ids, which every vocabulary holds; what is checked (cache reuse, counts) does not need words.
            detail = f"no tokenizer.json at {info.model_path!r}: prompts sent as byte-level ids"
            checks.append(Check("tokenizer", True, "a tokenizer, or byte-level ids", detail))
        directory = dump_dir or info.dump_dir
        tag = re.sub(r"[^A-Za-z0-9_.-]", "-", rid_prefix_tag) or "verify"
        run_id = uuid.uuid4().hex[:12]
        for label, text in (("prompt_a", PROMPT_A), ("prompt_b", PROMPT_B)):
            ids = list(tokenizer.encode(text).ids) if tokenizer else [3 + b for b in text.encode()]
            if not dumps:
                _check_reply(client, label, ids, f"{REPLY_ONLY_PREFIX}{tag}-{run_id}-{label}", checks)
                continue
            rid = f"{contract.RID_PREFIX}{tag}-{run_id}-{label}"
            _check_prompt(client, info, directory, label, ids, rid, dump_check, dump_wait_seconds, checks)
        if job is not None and dumps:
            from hsx.engine.verify_fp8 import fp8_job_checks

            # An fp8 job: a few of its stored samples against this engine's states for the same tokens.
            checks.extend(fp8_job_checks(client, info, directory, job, dump_wait_seconds=dump_wait_seconds))
    return _report(checks)


def _report(checks: list[Check]) -> VerifyReport:
    return VerifyReport(ok=bool(checks) and all(check.ok for check in checks), checks=checks)


def _engine_info(client: EngineClient, checks: list[Check]) -> contract.EngineInfo | None:
    expected = f"an hsx engine speaking protocol {contract.PROTOCOL_VERSION}"
    try:
        info = client.info()
    except EngineError as exc:
        checks.append(Check("engine_info", False, expected, f"{contract.INFO_PATH} failed: {exc}"))
        return None
    summary = {
        "backend": info.backend,
        "model_path": info.model_path,
        "protocol_version": info.protocol_version,
        "hf_indices": info.hf_indices,
        "prefix_cache": info.prefix_cache,
        "context_length": info.context_length,
        "model_fingerprint": info.model_fingerprint,
    }
    ok = info.protocol_version == contract.PROTOCOL_VERSION
    checks.append(Check("engine_info", ok, expected, summary))
    return info if ok else None


def fitness_checks(info: contract.EngineInfo, job: Mapping[str, Any] | None = None) -> list[Check]:
    """Why the engine is unfit before any prompt is sent: its prefix cache (every job that sends no
    per-request namespace would lose states), what it leaves unreported, and a given job's requirements."""
    checks = [
        Check(
            "prefix_cache",
            not info.prefix_cache,
            "off (SGLang: --disable-radix-cache)",
            "on: a cached prefix is not computed, so not dumped" if info.prefix_cache else "off",
        ),
        Check(
            "identity",
            True,
            "model_fingerprint and context_length reported",
            engine_fitness.unreported_identity(info) or "both reported",
        ),
    ]
    if job is not None:
        reason = engine_fitness.unfit_reason(info, dict(job.get("options") or {}), job.get("engine") or None)
        checks.append(
            Check("job_fitness", reason is None, f"fit for job {job.get('id', '?')}", reason or "fit")
        )
    return checks


def _load_tokenizer(path: str, checks: list[Check]) -> Tokenizer | None:
    file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
    try:
        tokenizer = Tokenizer.from_file(file)
    except Exception as exc:  # tokenizers raises plain Exception for unreadable or malformed files
        checks.append(Check("tokenizer", False, "a readable tokenizer.json", f"{file}: {exc}"))
        return None
    return tokenizer


def _prefill(
    client: EngineClient, label: str, ids: list[int], rid: str, checks: list[Check]
) -> tuple[int | None, dict[str, Any]] | None:
    """The reply's meta_info and its cached_tokens as the job reads it (None when missing), after the
    prompt_tokens check; None when the request failed (a failing check says why)."""
    try:
        reply = client.prefill(ids, rid)
    except EngineRejected as exc:
        checks.append(Check(f"{label}.generate", False, "request accepted", f"rejected: {exc}"))
        return None
    except EngineError as exc:
        checks.append(Check(f"{label}.generate", False, "request accepted", f"engine failed: {exc}"))
        return None
    meta_info = reply["meta_info"]
    cached = meta_info.get("cached_tokens")
    # The reply's own count, as the job reads it (a missing one makes the job call the engine unfit).
    reported = cached if isinstance(cached, int) and not isinstance(cached, bool) and cached >= 0 else None
    prompt_tokens = meta_info.get("prompt_tokens")
    checks.append(Check(f"{label}.prompt_tokens", prompt_tokens == len(ids), len(ids), prompt_tokens))
    return reported, meta_info


def _check_reply(client: EngineClient, label: str, ids: list[int], rid: str, checks: list[Check]) -> None:
    replied = _prefill(client, label, ids, rid, checks)
    if replied is None:
        return
    reported, meta_info = replied
    actual = reported if reported is not None else meta_info.get("cached_tokens", "missing from the reply")
    checks.append(Check(f"{label}.cached_tokens", reported == 0, 0, actual))


def _check_prompt(
    client: EngineClient,
    info: contract.EngineInfo,
    dump_dir: str,
    label: str,
    ids: list[int],
    rid: str,
    dump_check: DumpCheck | None,
    dump_wait_seconds: float,
    checks: list[Check],
) -> None:
    replied = _prefill(client, label, ids, rid, checks)
    if replied is None:
        return
    reported = replied[0]
    try:
        with open_dump(dump_dir, rid, dump_wait_seconds) as dump:
            # The job's own validator on the known prompt, also counting NaN/Inf in every byte.
            verdict = validate_open_dump(dump, ids, reported, info, count_values=True)
            for check in verdict.checks:
                check.name = f"{label}.{check.name}"
            checks.extend(verdict.checks)
            if dump_check is not None:
                checks.extend(dump_check(label, ids, load_states(dump)))
    except DumpMissing as exc:  # DumpCorrupt included
        checks.append(Check(f"{label}.dump", False, f"a dump in {dump_dir}", str(exc)))
    finally:
        delete_dump(dump_dir, rid)
