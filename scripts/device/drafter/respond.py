"""Write the target model's own responses to the drafter proof's training prompts, through SGLang's native
``/generate`` (token ids in, token ids out, ``--skip-tokenizer-init``), and save them as an hsx dataset.

    python3 respond.py ENGINE_URL MODEL_DIR PROMPTS_JSONL OUT_JSONL [MAX_NEW_TOKENS] [CONCURRENCY]

Sampling: temperature 0.7, top_p 0.9, a seed per sample (its line number), so the texts are the target's
own distribution and reproducible. The assistant turn is the decoded text of the returned ids (special
tokens dropped); a response cut by max_new_tokens is kept and counted. Prints a JSON summary.
"""

from __future__ import annotations

import json
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from transformers import AutoTokenizer


def _generate(url: str, input_ids: list[int], max_new: int, seed: int) -> dict[str, Any]:
    body = {
        "input_ids": input_ids,
        "sampling_params": {
            "max_new_tokens": max_new,
            "temperature": 0.7,
            "top_p": 0.9,
            "sampling_seed": seed,
        },
    }
    request = urllib.request.Request(
        url + "/generate", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=600) as answer:
        return json.load(answer)


def main(argv: list[str]) -> int:
    url, model_dir, prompts_path, out_path = argv[1:5]
    max_new = int(argv[5]) if len(argv) > 5 else 384
    concurrency = int(argv[6]) if len(argv) > 6 else 128
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    with open(prompts_path, encoding="utf-8") as fh:
        rows = [json.loads(line) for line in fh]
    prompts = [
        tokenizer.apply_chat_template(row["messages"], add_generation_prompt=True, tokenize=True)
        for row in rows
    ]
    prompts = [
        list(p["input_ids"]) if isinstance(p, dict) or hasattr(p, "keys") else list(p) for p in prompts
    ]
    started = time.time()
    with ThreadPoolExecutor(concurrency) as pool:
        answers = list(pool.map(lambda a: _generate(url, a[1], max_new, a[0]), enumerate(prompts)))
    elapsed = time.time() - started
    cut = generated = 0
    with open(out_path, "w", encoding="utf-8") as fh:
        for row, answer in zip(rows, answers, strict=True):
            ids = answer["output_ids"]
            generated += len(ids)
            reason = (answer["meta_info"].get("finish_reason") or {}).get("type")
            cut += reason == "length"
            text = tokenizer.decode(ids, skip_special_tokens=True).strip()
            messages = [*row["messages"], {"role": "assistant", "content": text}]
            fh.write(json.dumps({"id": row["id"], "messages": messages}) + "\n")
    print(
        json.dumps(
            {
                "samples": len(rows),
                "generated_tokens": generated,
                "cut_at_max_new_tokens": cut,
                "seconds": round(elapsed, 1),
                "tok_s": round(generated / elapsed),
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
