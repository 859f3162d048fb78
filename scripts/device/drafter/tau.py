"""Acceptance length (tau) of an EAGLE-3 server on the held-out prompts: greedy, token ids in and out.

    python3 tau.py ENGINE_URL MODEL_DIR HELDOUT_JSONL [MAX_NEW_TOKENS] [CONCURRENCY]

tau = sum of completion tokens / sum of ``meta_info.spec_verify_ct`` (one verify pass of the target per
draft round, each accepting tau tokens on average, the bonus token included). Prints one JSON line with
tau, the request count, the token sums, and the mean of the per-request ``spec_accept_length``.
"""

from __future__ import annotations

import json
import statistics
import sys
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from transformers import AutoTokenizer


def _generate(url: str, input_ids: list[int], max_new: int) -> dict[str, Any]:
    body = {"input_ids": input_ids, "sampling_params": {"max_new_tokens": max_new, "temperature": 0}}
    request = urllib.request.Request(
        url + "/generate", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=600) as answer:
        return json.load(answer)["meta_info"]


def main(argv: list[str]) -> int:
    url, model_dir, prompts_path = argv[1:4]
    max_new = int(argv[4]) if len(argv) > 4 else 256
    concurrency = int(argv[5]) if len(argv) > 5 else 16
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = []
    with open(prompts_path, encoding="utf-8") as fh:
        rows = [json.loads(line) for line in fh]
    for row in rows:
        encoded = tokenizer.apply_chat_template(row["messages"], add_generation_prompt=True, tokenize=True)
        prompts.append(list(encoded["input_ids"]) if hasattr(encoded, "keys") else list(encoded))
    with ThreadPoolExecutor(concurrency) as pool:
        metas = list(pool.map(lambda ids: _generate(url, ids, max_new), prompts))
    completion = sum(int(m["completion_tokens"]) for m in metas)
    verify = sum(int(m.get("spec_verify_ct") or 0) for m in metas)
    per_request = [float(m["spec_accept_length"]) for m in metas if m.get("spec_accept_length") is not None]
    print(
        json.dumps(
            {
                "tau": round(completion / verify, 4) if verify else None,
                "requests": len(metas),
                "completion_tokens": completion,
                "spec_verify_ct": verify,
                "mean_spec_accept_length": round(statistics.mean(per_request), 4) if per_request else None,
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
