"""Compare a dump with a direct transformers forward of the same tokens (``hsx verify --reference``).

The engine may compute in bf16 or through another attention kernel, so the comparison is a cosine
similarity per token, not equality.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from hsx.engine.client import EngineClient, EngineError
from hsx.engine.dumps import Dump
from hsx.engine.verify import Check, run_verification

# Per-token cosine a dump must reach against the float32 reference: float32 engines differ only by
# rounding; bf16 loses about three digits over a deep stack (0.9994 measured on SmolLM2's final state).
MIN_COSINE = {"float32": 0.999}
MIN_COSINE_LOW_PRECISION = 0.99
_model_lock = threading.Lock()


@lru_cache(maxsize=2)
def _load_model(model_dir: str) -> PreTrainedModel:
    # float32 on CPU: the reference must be at least as precise as whatever the engine ran.
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, local_files_only=True)
    torch.nn.Module.eval(model)  # through nn.Module: transformers' wrapper is untyped
    return model


def reference_states(model_dir: str | Path, input_ids: Sequence[int]) -> tuple[torch.Tensor, ...]:
    """Hugging Face ``hidden_states`` of a plain, uncached forward of ``input_ids``, each [T, H] float32."""
    with _model_lock:
        model = _load_model(str(model_dir))
        ids = torch.tensor([list(input_ids)], dtype=torch.long)
        with torch.inference_mode():
            out = model(input_ids=ids, use_cache=False, output_hidden_states=True, logits_to_keep=1)
    if out.hidden_states is None:
        raise RuntimeError(f"{model_dir}: the model returned no hidden states")
    return tuple(state[0].float() for state in out.hidden_states)


def transformers_greedy(model_dir: str | Path, input_ids: Sequence[int], max_new_tokens: int) -> list[int]:
    """The tokens transformers' own ``generate`` appends to ``input_ids``, greedy (eos ends it)."""
    with _model_lock:
        model = _load_model(str(model_dir))
        ids = torch.tensor([list(input_ids)], dtype=torch.long)
        with torch.inference_mode():
            out = model.generate(ids, do_sample=False, max_new_tokens=max_new_tokens)  # type: ignore[operator]
    return [int(token) for token in out[0, len(input_ids) :].tolist()]


def compare_with_transformers(
    model_dir: str | Path, input_ids: Sequence[int], dump: Dump
) -> dict[int, float]:
    """Per hf index, the lowest per-token cosine similarity between the dump and the reference forward.

    The minimum over tokens, not a mean, so that one wrong position cannot hide among many right ones. A
    dump of only the prompt's tail (an engine that reused a cached prefix) is compared with the matching
    final positions of the full forward.
    """
    dumped_ids = [int(token) for token in dump.input_ids.reshape(-1)]
    if (
        not dumped_ids
        or len(dumped_ids) > len(input_ids)
        or list(input_ids[-len(dumped_ids) :]) != dumped_ids
    ):
        raise ValueError(
            f"the dump's {len(dumped_ids)} ids are not the tail of the {len(input_ids)} ids given"
        )
    reference = reference_states(model_dir, input_ids)
    start = len(input_ids) - len(dumped_ids)
    similarities: dict[int, float] = {}
    for hf_index in sorted(dump.states):
        if not 0 <= hf_index < len(reference):
            raise ValueError(f"hf index {hf_index} is outside the model's {len(reference)} hidden states")
        expected = reference[hf_index][start:].double()
        actual = torch.from_numpy(np.array(dump.state_float32(hf_index), dtype=np.float64))
        if actual.shape != expected.shape:
            raise ValueError(
                f"hidden.{hf_index}: dump shape {list(actual.shape)}, expected {list(expected.shape)}"
            )
        cosine = torch.nn.functional.cosine_similarity(actual, expected, dim=-1, eps=1e-12)
        similarities[hf_index] = float(cosine.min().item())
    return similarities


def reference_checks(
    engine_url: str,
    dump_dir: str | None = None,
    model_dir: str | Path | None = None,
    min_cosine: float | None = None,
) -> list[Check]:
    """Verification prompts through the engine, each dump compared with transformers (one check a prompt).

    Returns the ``<prompt>.reference_cosine`` checks plus any other check that failed on the way, so a broken
    engine cannot make the reference comparison look vacuously clean. ``model_dir`` defaults to the engine's
    own model path, which must then be a local directory. ``min_cosine`` defaults by the engine's dtype:
    float32 must match to rounding, lower precision only closely.
    """
    with EngineClient(engine_url, timeout=120.0, retries=1, backoff=0.2) as client:
        try:
            info = client.info()
        except EngineError as exc:
            return [Check("reference.engine_info", False, "GET /hsx/info answers", str(exc))]
    model = str(model_dir) if model_dir is not None else info.model_path
    threshold = min_cosine if min_cosine is not None else MIN_COSINE.get(info.dtype, MIN_COSINE_LOW_PRECISION)
    expected = f">= {threshold}"

    def against_transformers(label: str, ids: list[int], dump: Dump) -> list[Check]:
        name = f"{label}.reference_cosine"
        try:
            similarities = compare_with_transformers(model, ids, dump)
        except (OSError, ValueError) as exc:
            return [Check(name, False, expected, f"no comparison: {exc}")]
        ok = bool(similarities) and min(similarities.values()) >= threshold
        return [Check(name, ok, expected, {str(i): round(c, 6) for i, c in similarities.items()})]

    report = run_verification(
        engine_url, dump_dir, rid_prefix_tag="verify-ref", dump_check=against_transformers
    )
    return [check for check in report.checks if check.name.endswith(".reference_cosine") or not check.ok]
