"""Per-layer comparison figures of the arch matrix and its table (torch only; runs on CPU in the tests).

MoE routing flips a few tokens between any two bf16 forwards, so a layer is judged by the mean per-token
cosine and the share of tokens at >= 0.999 against the fp32 states, side by side with transformers' own
bf16 forward; a wrong tap shows up as a different distribution, a neighbouring layer's level, or wrong
counts.
"""

from __future__ import annotations

from typing import Any

THRESHOLD = 0.999
# SGLang's error against fp32 may be this many times transformers' own bf16 error (plus a floor) ...
ERR_FACTOR, ERR_FLOOR = 2.5, 5e-4
# ... and its share of tokens >= THRESHOLD this much below transformers' share.
SHARE_SLACK = 0.05


def token_cosines(a: Any, b: Any) -> Any:
    """Cosine of each token's row, in float32: [T]."""
    import torch

    return torch.nn.functional.cosine_similarity(a.float(), b.float(), dim=-1)


def summarize(cos: Any) -> dict[str, float]:
    """Mean, share >= THRESHOLD and minimum of a vector of per-token cosines."""
    return {
        "mean": round(float(cos.mean()), 6),
        "share": round(float((cos >= THRESHOLD).float().mean()), 4),
        "min": round(float(cos.min()), 5),
    }


def layer_figures(got: list[Any], bf16: list[Any], fp32: list[Any]) -> dict[str, dict[str, float]]:
    """One tensor over all prompts: SGLang vs fp32, transformers bf16 vs fp32, SGLang vs transformers bf16."""
    import torch

    def over(xs: list[Any], ys: list[Any]) -> Any:
        return torch.cat([token_cosines(x, y) for x, y in zip(xs, ys, strict=True)])

    return {
        "sglang_vs_fp32": summarize(over(got, fp32)),
        "hf_bf16_vs_fp32": summarize(over(bf16, fp32)),
        "sglang_vs_hf_bf16": summarize(over(got, bf16)),
    }


def numerics_ok(fig: dict[str, dict[str, float]]) -> bool:
    """SGLang's distance to the exact states is of the size of transformers' own bf16 distance."""
    sg, hf = fig["sglang_vs_fp32"], fig["hf_bf16_vs_fp32"]
    err_ok = (1 - sg["mean"]) <= ERR_FACTOR * (1 - hf["mean"]) + ERR_FLOOR
    return err_ok and sg["share"] >= hf["share"] - SHARE_SLACK


def table(results: dict[str, Any]) -> str:
    """The markdown table of the matrix: one row per architecture and captured tensor."""
    head = (
        "| arch | final_state | tensor | SGLang vs fp32: mean / share>=0.999 | transformers bf16 vs fp32: "
        "mean / share | SGLang vs transformers bf16: mean | wrong-tap level | counts | ok |"
    )
    lines = [head, "|" + "---|" * 9]
    notes = []
    for arch, res in results.items():
        counts = res.get("counts")
        count_text = ""
        if counts is not None:
            count_text = f"{counts['exact']}/{counts['prompts']} exact, stray {len(res['stray_dirs'])}" + (
                "" if res.get("shape_ok", True) else ", TENSORS WRONG"
            )
        if not res.get("layers"):
            status = str(res.get("status", "?")).replace("|", "/")[:120]
            lines.append(
                f"| {arch} | {res.get('final_state', '')} | - | {status} | | | | {count_text} | NO |"
            )
            continue
        prompts = res.get("prompts", [])
        chunks = [p.get("chunks") for p in prompts]
        bad = sum(sum((p.get("non_finite") or {}).values()) for p in prompts)
        notes.append(
            f"- {arch}: startup {res.get('startup_s')} s, dumps drained {res.get('drain_s')} s after the "
            f"last response, passes per prompt {chunks} (lengths {[p['len'] for p in prompts]}), "
            f"/health_generate {res.get('health')}, engine-counted non-finite values {bad}, "
            f"/hsx/info ok {res.get('info_ok')}"
        )
        for name, fig in res["layers"].items():
            sg, hf, cross = fig["sglang_vs_fp32"], fig["hf_bf16_vs_fp32"], fig["sglang_vs_hf_bf16"]
            ok = "yes" if fig["ok"] and res["counts_ok"] else "NO"
            lines.append(
                f"| {arch} | {res['final_state']} | {name} | {sg['mean']:.5f} / {sg['share']:.3f} | "
                f"{hf['mean']:.5f} / {hf['share']:.3f} | {cross['mean']:.5f} | {fig['neighbour']:.3f} | "
                f"{count_text} | {ok} |"
            )
    return "\n".join(lines + [""] + notes)
