"""``hsx verify``: prove that an engine's captures are complete before trusting it with a job.

Two prompts that share a long prefix go to the engine one after the other, without ``extra_key``: an engine
whose prefix cache is on (SGLang's radix cache by default) recomputes only the second prompt's tail and
dumps a truncated capture, which shows up here as a failing ``cached_tokens`` check. Each dump must also
hold exactly the sent tokens, every expected layer, the model's hidden size and only finite values.

No torch: the API runs this. A torch comparison against transformers plugs in through ``dump_check``.
"""

from __future__ import annotations

import os
import re
import uuid
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from tokenizers import Tokenizer

from hsx import contract
from workers.engine_client import Dump, DumpMissing, EngineClient, EngineError, EngineRejected
from workers.validation import count_non_finite

# About 50 tokens shared by both prompts, then different endings: long enough that any prefix cache hits.
SHARED_PREFIX = (
    "The lighthouse keeper climbed the spiral stairs every evening at dusk, counting all one hundred and "
    "twelve steps while the wind rattled the narrow windows. At the top he trimmed the wick, polished the "
    "great lens, and wrote the weather in his logbook."
)
PROMPT_A = SHARED_PREFIX + " Tonight the sea was calm and the sky was full of stars."
PROMPT_B = SHARED_PREFIX + " Tonight a storm rolled in from the west and the ships hurried home."

DEFAULT_TIMEOUT_SECONDS = 120.0
DEFAULT_DUMP_WAIT_SECONDS = 30.0


@dataclass
class Check:
    name: str
    ok: bool
    expected: Any
    actual: Any

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


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
) -> VerifyReport:
    """Verify the engine at ``engine_url``; engine failures become failing checks, never exceptions."""
    checks: list[Check] = []
    with EngineClient(engine_url, timeout=timeout, retries=1, backoff=0.2) as client:
        info = _engine_info(client, checks)
        if info is None:
            return _report(checks)
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
            rid = f"{contract.RID_PREFIX}{tag}-{run_id}-{label}"
            _check_prompt(client, info, directory, label, ids, rid, dump_check, dump_wait_seconds, checks)
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
    }
    ok = info.protocol_version == contract.PROTOCOL_VERSION
    checks.append(Check("engine_info", ok, expected, summary))
    return info if ok else None


def _load_tokenizer(path: str, checks: list[Check]) -> Tokenizer | None:
    file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
    try:
        tokenizer = Tokenizer.from_file(file)
    except Exception as exc:  # tokenizers raises plain Exception for unreadable or malformed files
        checks.append(Check("tokenizer", False, "a readable tokenizer.json", f"{file}: {exc}"))
        return None
    return tokenizer


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
    try:
        reply = client.prefill(ids, rid)
    except EngineRejected as exc:
        checks.append(Check(f"{label}.generate", False, "request accepted", f"rejected: {exc}"))
        return
    except EngineError as exc:
        checks.append(Check(f"{label}.generate", False, "request accepted", f"engine failed: {exc}"))
        return
    meta_info = reply["meta_info"]
    cached = meta_info.get("cached_tokens")
    checks.append(
        Check(f"{label}.cached_tokens", cached == 0, 0, cached if cached is not None else "missing")
    )
    prompt_tokens = meta_info.get("prompt_tokens")
    checks.append(Check(f"{label}.prompt_tokens", prompt_tokens == len(ids), len(ids), prompt_tokens))
    try:
        dump = client.read_dump(dump_dir, rid, dump_wait_seconds)
    except DumpMissing as exc:
        checks.append(Check(f"{label}.dump", False, f"a dump in {dump_dir}", str(exc)))
        client.delete_dump(dump_dir, rid)
        return
    try:
        checks.extend(_dump_checks(info, label, ids, dump))
        if dump_check is not None:
            checks.extend(dump_check(label, ids, dump))
    finally:
        client.delete_dump(dump_dir, rid)


def _dump_checks(info: contract.EngineInfo, label: str, ids: Sequence[int], dump: Dump) -> list[Check]:
    checks: list[Check] = []
    if dump.meta.cached_tokens != 0:
        checks.append(Check(f"{label}.meta_cached_tokens", False, 0, dump.meta.cached_tokens))
    rows = {"meta": dump.meta.num_tokens, "input_ids": int(dump.input_ids.size)}
    rows.update({f"hidden.{index}": int(state.shape[0]) for index, state in sorted(dump.states.items())})
    uniform = len(set(rows.values())) == 1
    checks.append(
        Check(
            f"{label}.dumped_tokens",
            uniform and dump.meta.num_tokens == len(ids),
            len(ids),
            dump.meta.num_tokens if uniform else rows,
        )
    )
    checks.append(Check(f"{label}.input_ids", *_compare_ids(ids, dump.input_ids.tolist())))
    non_finite = sum(count_non_finite(state, dump.dtypes[index]) for index, state in dump.states.items())
    checks.append(Check(f"{label}.finite", non_finite == 0, 0, non_finite))
    layers = sorted(dump.states)
    # With only the pre-norm final state captured, hidden.<N> is absent (final_pre_norm stands for it).
    expected = sorted(info.hf_indices if info.final_state != "pre" else info.hf_indices[:-1])
    checks.append(Check(f"{label}.layers", layers == expected, expected, layers))
    widths = sorted({int(state.shape[-1]) if state.ndim == 2 else -1 for state in dump.states.values()})
    checks.append(Check(f"{label}.hidden_size", widths == [info.hidden_size], info.hidden_size, widths))
    return checks


def _compare_ids(sent: Sequence[int], dumped: Sequence[int]) -> tuple[bool, str, str]:
    expected = f"the {len(sent)} sent ids"
    if list(sent) == list(dumped):
        return True, expected, "identical"
    if len(sent) != len(dumped):
        return False, expected, f"{len(dumped)} ids"
    first = next(i for i, (a, b) in enumerate(zip(sent, dumped, strict=True)) if a != b)
    return False, expected, f"differ from position {first} (dumped {dumped[first]}, sent {sent[first]})"
