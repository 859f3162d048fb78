"""Hugging Face reference states for the device test: prompts and hidden_states at the hsx indices.

hf_reference.py MODEL_DIR OUT_DIR LEN[,LEN...] AUX[,AUX...]
  ->  OUT_DIR/prompts.json, OUT_DIR/ref_<i>.safetensors
"""

import json
import os
import random
import sys
import time
from typing import Any

import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from hsx import contract  # noqa: E402


def _states(
    model: Any, ids: list[int], dev: str, hf: list[int], n_layers: int
) -> tuple[dict[str, Any], bool]:
    o = model.model(input_ids=torch.tensor([ids], device=dev), output_hidden_states=True)
    hs = o.hidden_states
    assert len(hs) == n_layers + 1
    t = {contract.tensor_name(k): hs[k][0].contiguous() for k in hf[:-1]}
    t[contract.tensor_name(n_layers)] = o.last_hidden_state[0].contiguous()  # post-norm
    return t, bool(torch.equal(hs[n_layers], o.last_hidden_state))


def main(model_dir: str, out: str, lens: str, aux: str) -> None:
    """bf16 reference (ref_<i>), and with HSX_REF_FP32=1 also the fp32 forward of the same (bf16) weights
    (ref32_<i>) and the bf16-vs-fp32 cosine per layer: the noise floor of a bf16 forward."""
    os.makedirs(out, exist_ok=True)
    t0 = time.time()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).to(dev).eval()
    n_layers = model.config.num_hidden_layers
    aux_ids = [int(x) for x in aux.split(",")] if aux else contract.eagle3_aux_layer_ids(n_layers)
    hf = contract.hf_indices(aux_ids, n_layers)
    rng = random.Random(20261202)
    high = min(120000, model.config.vocab_size)
    prompts = [[rng.randrange(10, high) for _ in range(int(n))] for n in lens.split(",")]
    same_final = True
    bf16: list[dict[str, Any]] = []
    with torch.no_grad():
        for i, ids in enumerate(prompts):
            t, same = _states(model, ids, dev, hf, n_layers)
            same_final &= same
            t = {k: v.cpu() for k, v in t.items()}
            bf16.append(t)
            save_file(
                {**t, "input_ids": torch.tensor(ids, dtype=torch.int32)},
                os.path.join(out, f"ref_{i}.safetensors"),
            )
    floor: list[dict[str, float]] = []
    if os.environ.get("HSX_REF_FP32") == "1":
        model = model.float()  # exact upcast of the bf16 weights: the "true" states of this checkpoint
        with torch.no_grad():
            for i, ids in enumerate(prompts):
                t, _ = _states(model, ids, dev, hf, n_layers)
                cos = {
                    name: round(
                        torch.nn.functional.cosine_similarity(
                            v.flatten(), bf16[i][name].to(dev).float().flatten(), dim=0
                        ).item(),
                        6,
                    )
                    for name, v in t.items()
                }
                floor.append(cos)
                save_file(
                    {**{k: v.cpu() for k, v in t.items()}, "input_ids": torch.tensor(ids, dtype=torch.int32)},
                    os.path.join(out, f"ref32_{i}.safetensors"),
                )
    with open(os.path.join(out, "prompts.json"), "w") as fh:
        json.dump(
            {
                "prompts": prompts,
                "aux": aux_ids,
                "hf": hf,
                "num_layers": n_layers,
                "hf_hidden_states_N_is_post_norm": same_final,
                "hf_bf16_vs_fp32_cos": floor,
            },
            fh,
        )
    print(
        f"hf_reference: {len(prompts)} prompts, {sum(map(len, prompts))} tokens, hf={hf}, "
        f"hidden_states[N]==last_hidden_state: {same_final}, fp32 too: {bool(floor)}, "
        f"{time.time() - t0:.1f}s",
        flush=True,
    )
    if floor:
        print("HF bf16 vs fp32 cos (noise floor), last prompt:", floor[-1], flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:5])
