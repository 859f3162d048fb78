"""Hugging Face reference states for the device test: prompts and hidden_states at the hsx indices.

hf_reference.py MODEL_DIR OUT_DIR LEN[,LEN...] AUX[,AUX...]  ->  OUT_DIR/prompts.json, OUT_DIR/ref_<i>.safetensors
"""

import json
import os
import random
import sys
import time

import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from hsx import contract  # noqa: E402


def main(model_dir: str, out: str, lens: str, aux: str) -> None:
    os.makedirs(out, exist_ok=True)
    t0 = time.time()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16, device_map="cuda").eval()
    n_layers = model.config.num_hidden_layers
    aux_ids = [int(x) for x in aux.split(",")] if aux else contract.eagle3_aux_layer_ids(n_layers)
    hf = contract.hf_indices(aux_ids, n_layers)
    rng = random.Random(20261202)
    prompts = [[rng.randrange(10, 120000) for _ in range(int(n))] for n in lens.split(",")]
    same_final = True
    with torch.no_grad():
        for i, ids in enumerate(prompts):
            x = torch.tensor([ids], device="cuda")
            o = model.model(input_ids=x, output_hidden_states=True)
            hs = o.hidden_states
            assert len(hs) == n_layers + 1
            same_final &= bool(torch.equal(hs[n_layers], o.last_hidden_state))
            t = {contract.tensor_name(k): hs[k][0].contiguous().cpu() for k in hf[:-1]}
            t[contract.tensor_name(n_layers)] = o.last_hidden_state[0].contiguous().cpu()  # post-norm
            t["input_ids"] = torch.tensor(ids, dtype=torch.int32)
            save_file(t, os.path.join(out, f"ref_{i}.safetensors"))
    with open(os.path.join(out, "prompts.json"), "w") as fh:
        json.dump(
            {
                "prompts": prompts,
                "aux": aux_ids,
                "hf": hf,
                "num_layers": n_layers,
                "hf_hidden_states_N_is_post_norm": same_final,
            },
            fh,
        )
    print(
        f"hf_reference: {len(prompts)} prompts, {sum(map(len, prompts))} tokens, hf={hf}, "
        f"hidden_states[N]==last_hidden_state: {same_final}, {time.time() - t0:.1f}s",
        flush=True,
    )


if __name__ == "__main__":
    main(*sys.argv[1:5])
