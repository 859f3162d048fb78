"""Random-init models of several architectures and their Hugging Face reference states (arch matrix).

* :func:`build_config` / :func:`make_model`: a small random-init checkpoint per architecture (bf16), with
  randomised norm weights (so that the post-norm state is not a per-token rescaling of the pre-norm one)
  and scaled MoE routers (random routers sit near ties; scaling widens the margins);
* :func:`reference_states`: transformers' states on the same weights, in bf16 and in fp32 (an exact
  upcast of the bf16 weights: the "true" states of the checkpoint), at the hf indices, the post-norm final
  state and the pre-norm final state (the final norm's input), plus the level a wrong tap would show (the
  mean cosine of each captured state with the previous layer's).

Used on the device by ``arch_matrix.py`` and on CPU, at a tiny scale, by ``tests/test_sglang_arch_matrix.py``.
"""

from __future__ import annotations

import os
import sys
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
for _path in (ROOT, HERE):
    if _path not in sys.path:
        sys.path.insert(0, _path)

from arch_stats import token_cosines  # noqa: E402

from hsx import contract  # noqa: E402

# Priority order: the matrix launches them in this order and stops when its time budget runs out.
ARCHS = ["llama", "qwen3", "qwen3_moe", "deepseek_v3", "gpt_oss", "gemma3", "gemma", "gemma2"]
# The final state each server is asked for: "pre" alone once (the dump must lack hidden.<N>), "both" else.
FINAL_STATE = {name: ("pre" if name == "llama" else "both") for name in ARCHS}
NUM_LAYERS = 8
ROUTER_SCALE = 4.0
# transformers' attention for the reference: eager where sinks or soft-capping need it.
HF_ATTENTION = {"gpt_oss": "eager", "gemma2": "eager", "gemma3": "eager"}


def build_config(name: str, tiny: bool = False) -> Any:
    """The transformers config of one matrix architecture (``tiny``: a CPU-sized one for tests)."""
    import transformers as tf

    h = 64 if tiny else 1024
    heads = 4 if tiny else 16
    kv = 2 if tiny else 4
    head_dim = 16 if tiny else 64
    vocab = 512 if tiny else 32000
    experts, topk, moe_inter = (8, 2, 32) if tiny else (16, 4, 256)
    common: dict[str, Any] = dict(
        vocab_size=vocab,
        hidden_size=h,
        num_hidden_layers=NUM_LAYERS,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    )
    if name == "llama":
        return tf.LlamaConfig(intermediate_size=4 * h, **common)
    if name == "qwen3":
        return tf.Qwen3Config(intermediate_size=4 * h, head_dim=head_dim, **common)
    if name == "qwen3_moe":
        return tf.Qwen3MoeConfig(
            intermediate_size=4 * h,
            moe_intermediate_size=moe_inter,
            num_experts=experts,
            num_experts_per_tok=topk,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            head_dim=head_dim,
            **common,
        )
    if name == "deepseek_v3":
        common["num_key_value_heads"] = heads
        return tf.DeepseekV3Config(
            intermediate_size=4 * h,
            moe_intermediate_size=moe_inter,
            n_routed_experts=experts,
            num_experts_per_tok=topk,
            n_shared_experts=1,
            first_k_dense_replace=1,
            n_group=1,
            topk_group=1,
            routed_scaling_factor=1.0,
            q_lora_rank=96 if tiny else 384,
            kv_lora_rank=32 if tiny else 512,
            qk_nope_head_dim=16 if tiny else 128,
            qk_rope_head_dim=16 if tiny else 64,
            v_head_dim=16 if tiny else 128,
            # Read by SGLang 0.5.17's DeepseekV2 code, absent from the device's transformers config: the
            # first matrix run died on moe_layer_freq (docs/sglang.md); its MoEGate and top-k read the other
            # two (noaux_tc: the e_score_correction_bias gate, like transformers' router). Values
            # of DeepSeek-V3's config.json.
            moe_layer_freq=1,
            topk_method="noaux_tc",
            scoring_func="sigmoid",
            **common,
        )
    if name == "gpt_oss":
        return tf.GptOssConfig(
            intermediate_size=moe_inter * 2,
            num_local_experts=experts,
            num_experts_per_tok=topk,
            head_dim=head_dim,
            sliding_window=128,
            layer_types=["sliding_attention", "full_attention"] * (NUM_LAYERS // 2),
            swiglu_limit=7.0,  # read by SGLang 0.5.17, absent from the device's transformers config
            **common,
        )
    if name == "gemma":
        return tf.GemmaConfig(intermediate_size=4 * h, head_dim=head_dim, **common)
    if name == "gemma2":
        return tf.Gemma2Config(
            intermediate_size=4 * h,
            head_dim=head_dim,
            sliding_window=128,
            query_pre_attn_scalar=head_dim,
            hidden_act="gelu_pytorch_tanh",  # SGLang 0.5.17 reads hidden_act, newer configs hidden_activation
            **common,
        )
    if name == "gemma3":
        return tf.Gemma3TextConfig(
            intermediate_size=4 * h,
            head_dim=head_dim,
            sliding_window=128,
            query_pre_attn_scalar=head_dim,
            layer_types=(["sliding_attention"] * 3 + ["full_attention"]) * (NUM_LAYERS // 4),
            **common,
        )
    raise ValueError(f"unknown matrix architecture {name!r}; known: {ARCHS}")


def _final_norm(model: Any) -> Any:
    return model.model.norm


def perturb(model: Any, name: str, seed: int) -> None:
    """Randomise the norm weights and scale the MoE routers (in place, reproducibly)."""
    import torch

    g = torch.Generator(device="cpu").manual_seed(seed)
    gemma = name.startswith("gemma")  # Gemma's norms scale by (1 + weight)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if p.dim() == 1 and "norm" in pname:
                noise = torch.randn(p.shape, generator=g) * 0.3
                p.copy_((noise if gemma else 1.0 + noise).to(p.dtype))
            elif pname.endswith(("mlp.gate.weight", "mlp.router.weight")):
                p.mul_(ROUTER_SCALE)
            elif name == "gemma" and pname.endswith("embed_tokens.weight"):
                # Gemma scales its embeddings by sqrt(hidden): at random init they would drown every layer's
                # contribution, and neighbouring layers would look alike (cosine ~0.99).
                p.div_(model.config.hidden_size**0.5)


def make_model(
    name: str, out_dir: str, device: str = "cuda", seed: int = 20261203, tiny: bool = False
) -> Any:
    """Write a random-init bf16 checkpoint of ``name`` to ``out_dir``; returns its config."""
    import torch
    from transformers import AutoModelForCausalLM

    config = build_config(name, tiny)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config)
    model = model.to(torch.bfloat16)
    perturb(model, name, seed)
    model.save_pretrained(out_dir)
    del model
    if device.startswith("cuda"):
        torch.cuda.empty_cache()  # the servers size their memory pools from what is free
    return config


def load_reference_model(model_dir: str, name: str, device: str) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    kwargs: dict[str, Any] = {"dtype": torch.bfloat16}
    if name in HF_ATTENTION:
        kwargs["attn_implementation"] = HF_ATTENTION[name]
    model = AutoModelForCausalLM.from_pretrained(model_dir, **kwargs)
    return model.to(device).eval()


def _forward_states(model: Any, ids: list[int], hf: list[int], device: str) -> dict[str, Any]:
    """The states of one prompt: hidden.<i> for the aux indices and N (post-norm), and the pre-norm one."""
    import torch

    seen: list[Any] = []
    handle = _final_norm(model).register_forward_pre_hook(lambda _m, args: seen.append(args[0]))
    try:
        out = model.model(input_ids=torch.tensor([ids], device=device), output_hidden_states=True)
    finally:
        handle.remove()
    n = model.config.num_hidden_layers
    states = {contract.tensor_name(k): out.hidden_states[k][0] for k in hf[:-1]}
    states[contract.tensor_name(n)] = out.last_hidden_state[0]
    states[contract.PRE_NORM_TENSOR] = seen[0][0]
    # the previous layer's state of each captured one: the level a tap one layer off would show
    prev = {contract.tensor_name(k): out.hidden_states[k - 1][0] for k in hf[:-1]}
    prev[contract.tensor_name(n)] = seen[0][0]
    prev[contract.PRE_NORM_TENSOR] = out.hidden_states[n - 1][0]
    return {"states": states, "prev": prev}


def reference_states(
    model_dir: str, name: str, prompts: list[list[int]], hf: list[int], device: str
) -> dict[str, Any]:
    """bf16 and fp32 states of every prompt (CPU tensors), and the wrong-tap level per tensor name."""
    import torch

    model = load_reference_model(model_dir, name, device)
    bf16: list[dict[str, Any]] = []
    with torch.no_grad():
        for ids in prompts:
            bf16.append({k: v.cpu() for k, v in _forward_states(model, ids, hf, device)["states"].items()})
        model = model.float()  # exact upcast of the bf16 weights
        fp32: list[dict[str, Any]] = []
        neighbour: dict[str, list[Any]] = {}
        for ids in prompts:
            got = _forward_states(model, ids, hf, device)
            fp32.append({k: v.cpu() for k, v in got["states"].items()})
            for k, v in got["states"].items():
                neighbour.setdefault(k, []).append(token_cosines(v, got["prev"][k]).cpu())
    del model
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    level = {k: float(torch.cat(v).mean()) for k, v in neighbour.items()}
    return {"bf16": bf16, "fp32": fp32, "neighbour": level}
