"""Compare states read back from a job's shards with a Hugging Face forward of the same model and ids.

    python3 scripts/device/check_shards.py OUTPUT_DIR MODEL_DIR [N_SAMPLES]

Prints one JSON line: per-layer minimum cosine over the checked samples and whether each sample's token
count equals its input_ids length.
"""

from __future__ import annotations

import json
import sys

import torch
from transformers import AutoModelForCausalLM

from hsx.loader import iter_samples
from hsx.manifest import Manifest


def main(output_dir: str, model_dir: str, n: int) -> None:
    manifest = Manifest.load(__import__("pathlib").Path(output_dir))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if manifest.dtype == "BF16" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    aux, final = manifest.hf_indices[:-1], manifest.hf_indices[-1]
    h = manifest.hidden_size
    worst = {str(i): 1.0 for i in manifest.hf_indices}
    counts_ok = True
    checked = 0
    for sample in iter_samples(output_dir, as_torch=True):
        if checked >= n:
            break
        t = sample.input_ids.shape[0]
        counts_ok &= sample.hidden_state.shape[0] == t == sample.aux_hidden_state.shape[0]
        with torch.no_grad():
            out = model(sample.input_ids.long().unsqueeze(0).to(device), output_hidden_states=True)
        got = {final: sample.hidden_state}
        for k, idx in enumerate(aux):
            got[idx] = sample.aux_hidden_state[:, k * h : (k + 1) * h]
        for idx, states in got.items():
            ref = out.hidden_states[idx][0].float()
            cos = torch.nn.functional.cosine_similarity(states.to(device).float(), ref, dim=-1).min().item()
            worst[str(idx)] = min(worst[str(idx)], cos)
        checked += 1
    print(
        json.dumps(
            {"samples_checked": checked, "min_cosine_by_hf_index": worst, "token_counts_exact": counts_ok}
        )
    )


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else 8)
