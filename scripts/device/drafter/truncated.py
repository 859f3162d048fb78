"""The seed's failure, made on purpose: the drafter proof's training samples sent to a patched engine whose
radix (prefix) cache is ON, and the partial dumps stored the way a pipeline without hsx's checks would.

    python3 truncated.py ENGINE_URL DUMP_DIR HSX_OUTPUT_DIR OUT_ROOT [CONCURRENCY]

The token ids and loss masks come from the hsx job over the same samples (its output, HSX_OUTPUT_DIR), so
every variant trains on the same tokens. For each sample the engine computes only the tokens after its
cached prefix (``cached_tokens`` = c) and dumps T - c rows. Two SpecForge offline folders are written:

- ``OUT_ROOT/misaligned``: the dumped rows paired with the sample's tokens from its start (ids[:T-c]), as a
  pipeline that trusts the dump's row count would store them: every state sits c positions early;
- ``OUT_ROOT/aligned``: each row at its true position (ids[c:], mask[c:]): the uncaptured prefix is left out
  of the sequence and of the loss.

Prints a JSON summary (samples, how many were truncated, mean and max cached tokens).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hsx.engine.dumps import delete_dump, read_dump
from hsx.loader import OutputReader

AUX_HF = (2, 15, 27)  # EAGLE-3's default aux layers 1, 14, 26 of a 30-layer model, as HF indices
FINAL_HF = 30


def _prefill(url: str, rid: str, input_ids: list[int]) -> dict[str, Any]:
    body = {"input_ids": input_ids, "rid": rid, "sampling_params": {"max_new_tokens": 1, "temperature": 0}}
    request = urllib.request.Request(
        url + "/generate", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=600) as answer:
        return json.load(answer)


def _bf16(dump: Any, hf_index: int) -> torch.Tensor:
    """A dumped state as bf16, whatever dtype the engine dumped (SGLang serves bf16; the CPU reference engine
    dumps float32 unless told otherwise): bf16 goes through float32 and back unchanged."""
    return torch.from_numpy(dump.state_float32(hf_index)).to(torch.bfloat16)


def _save(path: Path, ids: np.ndarray, mask: np.ndarray, final: torch.Tensor, aux: torch.Tensor) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(
        {
            "input_ids": torch.from_numpy(ids.astype(np.int64)),
            "loss_mask": torch.from_numpy(mask.astype(np.int64)),
            "hidden_state": final.unsqueeze(0),
            "aux_hidden_state": aux.unsqueeze(0),
        },
        path,
    )


def main(argv: list[str]) -> int:
    url, dump_dir, output_dir, out_root = argv[1], argv[2], argv[3], Path(argv[4])
    concurrency = int(argv[5]) if len(argv) > 5 else 32
    samples = [(s.input_ids.copy(), s.loss_mask.copy()) for s in OutputReader(output_dir)]

    def one(i: int) -> int:
        ids, mask = samples[i]
        rid = f"hsx-trunc-{i}"
        answer = _prefill(url, rid, ids.tolist())
        cached = int(answer["meta_info"].get("cached_tokens") or 0)
        dump = read_dump(dump_dir, rid, 120.0)
        rows = len(dump.input_ids)
        final = _bf16(dump, FINAL_HF)
        aux = torch.cat([_bf16(dump, h) for h in AUX_HF], dim=-1)
        delete_dump(dump_dir, rid)
        if rows != len(ids) - cached:
            raise SystemExit(f"sample {i}: {rows} rows dumped, {len(ids)} sent, {cached} cached")
        group = f"rows_{i // 2000 * 2000}-{i // 2000 * 2000 + 2000}"
        _save(out_root / "misaligned" / group / f"data_{i}.ckpt", ids[:rows], mask[:rows], final, aux)
        _save(out_root / "aligned" / group / f"data_{i}.ckpt", ids[cached:], mask[cached:], final, aux)
        return cached

    with ThreadPoolExecutor(concurrency) as pool:
        cached = list(pool.map(one, range(len(samples))))
    truncated = sum(1 for c in cached if c > 0)
    summary = {
        "samples": len(samples),
        "truncated": truncated,
        "cached_mean": round(statistics.mean(cached), 1),
        "cached_max": max(cached),
        "tokens_sent": int(sum(len(ids) for ids, _ in samples)),
        "rows_dumped": int(sum(len(ids) for ids, _ in samples) - sum(cached)),
    }
    print(json.dumps(summary))
    os.makedirs(out_root, exist_ok=True)
    (out_root / "summary.json").write_text(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
