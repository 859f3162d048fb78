"""Server configurations under which the capture would see the wrong rows or values (standard library only).

Shared by the launcher (fail before launching) and the scheduler processes (defence in depth).

The capture reads the residual stream entering decoder layer ``L + 1``. That is the output of layer ``L``
only if every reduction of layer ``L`` has run by then. SGLang 0.5.17 can defer one past that point: with
FlashInfer's (or, on ROCm, aiter's) all-reduce fusion, a layer's MLP all-reduce is skipped
(``LayerCommunicator.should_fuse_mlp_allreduce_with_next_layer``), the MLP output is tagged
``_sglang_needs_allreduce_fusion`` and reduced inside the *next* layer's ``prepare_attn``, after the
plugin's pre-hook on that layer has run. TP rank 0 would then capture its own partial sum: finite, the
right shape and count, wrong values. ``_flashinfer_allreduce_fusion_auto_enable``
(``sglang/srt/arg_groups/overrides.py``) turns that fusion on by itself on SM90/SM100 whenever
``tp_size > 1`` on one node for the architectures in :data:`ALLREDUCE_FUSION_ARCHS`.

hsx turns those fusions off (the launcher adds ``--enforce-disable-flashinfer-allreduce-fusion``, whose
pass runs after the auto-enable), refuses a launch whose final server arguments still have one on, and
drops (never writes) a capture whose hooked tensor still carries the tag.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from workers.engines.sglang.layouts import layout_problems

# The tag SGLang 0.5.17 sets on a layer output whose all-reduce was deferred to the next layer.
NEEDS_ALLREDUCE_TAG = "_sglang_needs_allreduce_fusion"

# ``_FLASHINFER_ALLREDUCE_FUSION_ARCHS`` of sglang 0.5.17 (``sglang/srt/arg_groups/overrides.py``): the
# architectures for which SGLang enables the deferred all-reduce by itself at tp > 1. Kept here for the
# tests and the docs; the guard itself reads the final server arguments, not this list.
ALLREDUCE_FUSION_ARCHS = frozenset(
    {
        "DeepseekV3ForCausalLM",
        "DeepseekV32ForCausalLM",
        "GptOssForCausalLM",
        "GlmMoeDsaForCausalLM",
        "Glm4MoeForCausalLM",
        "Glm4MoeLiteForCausalLM",
        "MistralLarge3ForCausalLM",
        "Qwen3MoeForCausalLM",
        "Qwen3VLMoeForConditionalGeneration",
        "Qwen3NextForCausalLM",
        "KimiK25ForConditionalGeneration",
        "Qwen3_5MoeForConditionalGeneration",
        "InternS2PreviewForConditionalGeneration",
        "Qwen3_5ForConditionalGeneration",
        "NemotronHForCausalLM",
        "NemotronHPuzzleForCausalLM",
    }
)

# The sglang switch whose post-processing pass runs after the auto-enable and clears the backend.
DISABLE_FUSION_FLAG = "--enforce-disable-flashinfer-allreduce-fusion"

# Flags with which a caller would ask for a deferred reduction (or tokens scattered across TP ranks).
DEFERRING_FLAGS = {
    "--flashinfer-allreduce-fusion-backend": "FlashInfer all-reduce fusion defers the MLP all-reduce",
    "--enable-flashinfer-allreduce-fusion": "FlashInfer all-reduce fusion defers the MLP all-reduce",
    "--enable-aiter-allreduce-fusion": "aiter all-reduce fusion defers the MLP all-reduce",
    "--enable-attn-tp-input-scattered": "TP input scattering splits a batch's tokens across ranks",
}


def flag_given(argv: Sequence[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in argv)


def argv_problems(argv: Sequence[str]) -> list[str]:
    """Flags the caller passed that ask for something the capture cannot follow."""
    return [
        f"{flag}: {why} past the capture point"
        for flag, why in DEFERRING_FLAGS.items()
        if flag_given(argv, flag)
    ]


def deferred_reduction_problems(server_args: Any) -> list[str]:
    """Final server arguments under which a reduction may still be pending at the capture point."""
    problems: list[str] = []
    backend = getattr(server_args, "flashinfer_allreduce_fusion_backend", None)
    tp = int(getattr(server_args, "tp_size", 1) or 1)
    if backend is not None:
        problems.append(
            f"FlashInfer all-reduce fusion is on (flashinfer_allreduce_fusion_backend={backend!r}, "
            f"tp_size={tp}): the MLP all-reduce would run inside the next layer, after the capture; "
            f"pass {DISABLE_FUSION_FLAG}"
        )
    if getattr(server_args, "enable_aiter_allreduce_fusion", False):
        problems.append(
            "aiter all-reduce fusion is on (--enable-aiter-allreduce-fusion): the MLP all-reduce would "
            "run inside the next layer, after the capture"
        )
    if getattr(server_args, "enable_attn_tp_input_scattered", False):
        problems.append("--enable-attn-tp-input-scattered: each TP rank holds only part of a batch's tokens")
    return problems


def unsupported_config(server_args: Any, shared_dump_dir: bool = False) -> list[str]:
    """Server configurations under which the hooks would capture wrong rows; empty when fine.
    (Parallel layouts: :func:`layouts.layout_problems`; ``shared_dump_dir`` is the launcher's flag.)"""
    problems: list[str] = []

    def get(name: str, default: Any = None) -> Any:
        return getattr(server_args, name, default)

    if get("is_embedding"):
        problems.append("embedding models (--is-embedding)")
    problems += layout_problems(server_args, shared_dump_dir)
    if (
        (get("attn_cp_size") or 1) > 1
        or (get("dcp_size") or 1) > 1
        or get("enable_prefill_context_parallel")
        or get("enable_dsa_prefill_context_parallel")
    ):
        problems.append("context parallelism: a request's tokens are split across ranks")
    if get("speculative_algorithm"):
        problems.append("speculative decoding: the target forward runs as verify passes")
    if get("enable_pdmux"):
        problems.append("--enable-pdmux: split prefill bypasses forward_batch_generation")
    if get("enable_two_batch_overlap") or get("enable_single_batch_overlap"):
        problems.append("two/single batch overlap: layers run on micro-batches")
    if get("enable_torch_compile"):
        problems.append("--enable-torch-compile: module hooks inside a compiled graph")
    if get("dllm_algorithm"):
        problems.append("diffusion LLMs")
    mode = get("disaggregation_mode")
    if mode not in (None, "null"):
        problems.append(f"PD disaggregation (--disaggregation-mode {mode})")
    cfg = get("cuda_graph_config")
    prefill = getattr(getattr(cfg, "prefill", None), "backend", None)
    if prefill is not None and str(prefill) != "disabled":
        problems.append(
            f"prefill CUDA graph backend {prefill!r}: hooks do not run on graph replay "
            "(use --cuda-graph-backend-prefill disabled; the launcher adds it by default)"
        )
    problems += deferred_reduction_problems(server_args)
    return problems


def pending_reduction(tensor: Any) -> bool:
    """True when SGLang tagged this tensor as still waiting for its all-reduce."""
    return bool(getattr(tensor, NEEDS_ALLREDUCE_TAG, False))
