"""The error of fp8 (e4m3) hidden states against the engine's own, per token and per stored tensor.

    python bench/fp8_error.py [--model DIR] [--prompts N] [--length T] [--random-tokens]

Runs the model (Hugging Face, the weights' own dtype: bf16 for the default SmolLM2 and the device's
Llamas) over real text, takes the states hsx stores (each EAGLE-3 aux layer, then the post-norm final
state), quantizes them as the worker does (hsx.fp8, one scale per token per tensor) and as speculators
does (one scale per token shared by every tensor), and compares the dequantized values with the
unquantized ones token by token: cosine similarity and relative L2 error ``|x' - x| / |x|``.

Text: the chats of tests/data/short_chats.jsonl through the model's chat template, then the repository's
docs cut into ``--length``-token pieces, ``--prompts`` prompts in all. ``--random-tokens`` uses random ids
instead (the device's random-init Llamas have a byte tokenizer and no template).

Prints a markdown table per scale choice (cosine: min, p1, median, mean; relative L2: max, p99, median,
mean), then one JSON line. Tokens whose state is all zeros (none in practice) are counted, not compared.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from hsx import contract, fp8  # noqa: E402


def quantize_shared(
    tensors: list[npt.NDArray[np.float32]],
) -> tuple[list[npt.NDArray[np.uint8]], npt.NDArray[np.float32]]:
    """Every tensor [T, H] of one token range against one scale per token (the maximum over all of them):
    speculators' layout, measured here against hsx's scale per tensor (hsx never stores it)."""
    scales = np.max(np.stack([fp8.row_scales(t) for t in tensors]), axis=0)
    return [fp8.encode_e4m3(t / scales[:, None]) for t in tensors], scales


def _prompts(model_dir: Path, count: int, length: int, random_tokens: bool, vocab: int) -> list[list[int]]:
    if random_tokens:
        rng = random.Random(20261203)
        return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(count)]
    from transformers import AutoTokenizer

    from workers.chat import ChatEncoder

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    encoder = ChatEncoder(tokenizer, use_chat_template=bool(tokenizer.chat_template))
    prompts: list[list[int]] = []
    for line in (REPO / "tests/data/short_chats.jsonl").read_text().splitlines():
        prompts.append(list(encoder.encode(json.loads(line)["messages"]).input_ids))
    docs = " ".join(path.read_text() for path in sorted((REPO / "docs").glob("*.md")))
    ids = tokenizer(docs)["input_ids"]
    for start in range(0, len(ids) - length, length):
        prompts.append(ids[start : start + length])
    return prompts[:count]


def _states(model_dir: Path, prompts: list[list[int]]) -> tuple[dict[str, list[Any]], dict[str, Any]]:
    """The stored tensors of every prompt as float32 numpy [T, H], keyed by dump tensor name."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model: Any = AutoModelForCausalLM.from_pretrained(model_dir, dtype="auto")
    model = model.to(device).eval()
    layers = config.num_hidden_layers
    indices = contract.hf_indices(contract.eagle3_aux_layer_ids(layers), layers)
    names = [contract.tensor_name(i) for i in indices]
    states: dict[str, list[Any]] = {name: [] for name in names}
    with torch.no_grad():
        for ids in prompts:
            out = model.model(input_ids=torch.tensor([ids], device=device), output_hidden_states=True)
            for index, name in zip(indices[:-1], names[:-1], strict=True):
                states[name].append(out.hidden_states[index][0].float().cpu().numpy())
            states[names[-1]].append(out.last_hidden_state[0].float().cpu().numpy())
    facts = {
        "model": str(model_dir),
        "dtype": str(model.dtype),
        "layers": layers,
        "hidden": config.hidden_size,
    }
    return states, facts


def _errors(
    original: npt.NDArray[np.float32], restored: npt.NDArray[np.float32]
) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.float64], int]:
    x = original.astype(np.float64)
    y = restored.astype(np.float64)
    norm = np.linalg.norm(x, axis=1)
    keep = norm > 0
    cosine = (x * y).sum(axis=1)[keep] / (norm[keep] * np.linalg.norm(y, axis=1)[keep])
    relative = np.linalg.norm(y - x, axis=1)[keep] / norm[keep]
    return cosine, relative, int((~keep).sum())


def _summary(cosine: npt.NDArray[np.float64], relative: npt.NDArray[np.float64]) -> dict[str, float]:
    return {
        "cos_min": float(cosine.min()),
        "cos_p1": float(np.percentile(cosine, 1)),
        "cos_median": float(np.median(cosine)),
        "cos_mean": float(cosine.mean()),
        "rel_l2_max": float(relative.max()),
        "rel_l2_p99": float(np.percentile(relative, 99)),
        "rel_l2_median": float(np.median(relative)),
        "rel_l2_mean": float(relative.mean()),
    }


def measure(states: dict[str, list[Any]]) -> dict[str, dict[str, dict[str, float]]]:
    names = list(states)
    results: dict[str, dict[str, dict[str, float]]] = {"per_tensor": {}, "shared": {}}
    for scheme in results:
        collected: dict[str, tuple[list[Any], list[Any]]] = {name: ([], []) for name in names}
        skipped = 0
        for sample in range(len(states[names[0]])):
            tensors = [states[name][sample] for name in names]
            if scheme == "per_tensor":
                restored = [fp8.dequantize(*fp8.quantize_rows(t, "F32")) for t in tensors]
            else:
                codes, scales = quantize_shared(tensors)
                restored = [fp8.dequantize(c, scales) for c in codes]
            for name, original, back in zip(names, tensors, restored, strict=True):
                cosine, relative, zeros = _errors(original, back)
                collected[name][0].append(cosine)
                collected[name][1].append(relative)
                skipped += zeros
        for name in names:
            summary = _summary(np.concatenate(collected[name][0]), np.concatenate(collected[name][1]))
            results[scheme][name] = summary | {"zero_tokens": skipped}
    return results


def _table(label: str, rows: dict[str, dict[str, float]], final: str) -> str:
    lines = [
        f"**{label}**",
        "",
        "| tensor | cos min | cos p1 | cos median | cos mean "
        "| rel L2 max | rel L2 p99 | rel L2 median | rel L2 mean |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, s in rows.items():
        shown = f"{name} (final)" if name == final else f"{name} (aux)"
        cos = [f"{s[k]:.6f}" for k in ("cos_min", "cos_p1", "cos_median", "cos_mean")]
        rel = [f"{s[k]:.4f}" for k in ("rel_l2_max", "rel_l2_p99", "rel_l2_median", "rel_l2_mean")]
        lines.append("| " + " | ".join([shown, *cos, *rel]) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model", type=Path, default=None, help="model directory (default: hsx's default model)"
    )
    parser.add_argument("--prompts", type=int, default=40)
    parser.add_argument("--length", type=int, default=256, help="tokens per docs piece or random prompt")
    parser.add_argument("--random-tokens", action="store_true")
    args = parser.parse_args(argv)
    model_dir = args.model
    if model_dir is None:
        from hsx.server.settings import Settings
        from workers.engines.model_store import resolve_model_dir

        model_dir = resolve_model_dir(None, Settings())
    started = time.monotonic()
    from transformers import AutoConfig

    vocab = int(AutoConfig.from_pretrained(model_dir).vocab_size)
    prompts = _prompts(Path(model_dir), args.prompts, args.length, args.random_tokens, min(vocab, 120000))
    states, facts = _states(Path(model_dir), prompts)
    results = measure(states)
    tokens = sum(len(p) for p in prompts)
    final = list(states)[-1]
    print(
        f"fp8 e4m3 error vs the engine's states: {facts['model']} ({facts['dtype']}, {facts['layers']} "
        f"layers, hidden {facts['hidden']}), {len(prompts)} prompts, {tokens} tokens\n"
    )
    print(_table("one scale per token per tensor (hsx)", results["per_tensor"], final) + "\n")
    print(_table("one scale per token shared by all tensors (speculators)", results["shared"], final) + "\n")
    line = {
        "bench": "fp8_error",
        **facts,
        "prompts": len(prompts),
        "tokens": tokens,
        "results": results,
        "seconds": round(time.monotonic() - started, 1),
    }
    print(json.dumps(line))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
