"""SpecForge's own capture of the drafter proof's samples: the row a user gets without hsx.

SpecForge 0.2.0's own steps, as its ``scripts/prepare_hidden_states.py`` takes them, on the SGLang 0.5.14 it
pins (run with that site first on PYTHONPATH):

1. ``build_eagle3_dataset`` over the conversations (SpecForge's tokenisation and loss mask, the model's own
   chat template rendered by the tokenizer, its shuffle with seed 42, max length 1,024). SmolLM2's ChatML
   turns are registered as a template the way SpecForge's docs say to register a new model's:
   ``<|im_start|>user\\n`` / ``<|im_start|>assistant\\n`` / ``<|im_end|>\\n``, and the system prompt
   SmolLM2's own template inserts when a conversation has none (SpecForge's ``qwen`` template would insert
   "You are a helpful assistant." instead, a different prompt from the one the target answered);
2. ``load_offline_capture`` (an in-process SGLang model runner, radix cache off, triton attention) with
   the aux layers 1, 14, 26 (SGLang's EAGLE-3 taps ``L + 1``, as hsx does);
3. one ``.ckpt`` per sample, ``rows_<g>-<g+2000>/data_<i>.ckpt`` holding ``input_ids``, ``loss_mask``,
   ``hidden_state`` [1, T, H] and ``aux_hidden_state`` [1, T, 3H], written by a pool of IO threads.

    python3 specforge_capture.py MODEL_DIR TRAIN_JSONL OUT_DIR

Prints one JSON line: samples, tokens, seconds (dataset build, engine load, capture and saves).
"""

from __future__ import annotations

import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

for key, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"), ("MASTER_ADDR", "127.0.0.1"),
                   ("MASTER_PORT", "29571")):
    os.environ.setdefault(key, value)

AUX_LAYERS = [1, 14, 26]
SMOLLM2_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


def build_dataset(model_dir: str, train_jsonl: str, cache_dir: str, num_proc: int = 8):  # type: ignore[no-untyped-def]
    from datasets import Dataset
    from specforge.data.preprocessing import build_eagle3_dataset
    from specforge.data.template import TEMPLATE_REGISTRY, ChatTemplate
    from transformers import AutoTokenizer

    if "smollm2" not in TEMPLATE_REGISTRY.get_all_template_names():
        TEMPLATE_REGISTRY.register(
            name="smollm2",
            template=ChatTemplate(
                assistant_header="<|im_start|>assistant\n",
                user_header="<|im_start|>user\n",
                system_prompt=SMOLLM2_SYSTEM,
                end_of_turn_token="<|im_end|>\n",
            ),
        )
    rows = [json.loads(line) for line in open(train_jsonl, encoding="utf-8")]
    dataset = Dataset.from_dict({"id": [r["id"] for r in rows], "conversations": [r["messages"] for r in rows]})
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return build_eagle3_dataset(dataset=dataset, tokenizer=tokenizer, chat_template="smollm2", max_length=1024,
                                cache_dir=cache_dir, cache_key="drafter-proof", num_proc=num_proc)


def save(record: dict, path: Path) -> None:  # type: ignore[type-arg]
    import torch

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save(record, tmp)
    os.replace(tmp, path)


def main(model_dir: str, train_jsonl: str, out_dir: str) -> int:
    import torch
    from specforge.distributed import init_distributed

    times: dict[str, float] = {}
    # The engine loads while the target still writes the responses; the dataset is built once they exist.
    t = time.time()
    init_distributed(tp_size=1)
    from specforge.offline_capture import load_offline_capture

    cap = load_offline_capture(model_dir, torch_dtype=torch.bfloat16, mem_fraction_static=0.9,
                               max_total_tokens=32768, attention_backend="triton", sampling_backend="pytorch",
                               grammar_backend="none", skip_tokenizer_init=True, disable_radix_cache=True)
    cap.set_capture_layers(AUX_LAYERS)
    times["engine_s"] = round(time.time() - t, 1)
    t = time.time()
    while not os.path.exists(train_jsonl):
        time.sleep(2)
    times["waited_for_responses_s"] = round(time.time() - t, 1)

    t = time.time()
    dataset = build_dataset(model_dir, train_jsonl, out_dir + ".cache")
    times["dataset_s"] = round(time.time() - t, 1)

    t = time.time()
    tokens = 0
    out = Path(out_dir)
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 8) as pool:
        pending = []
        for i, row in enumerate(dataset):
            ids = torch.as_tensor(row["input_ids"]).view(1, -1)
            mask = torch.as_tensor(row["loss_mask"]).view(1, -1)
            batch = cap.capture(input_ids=ids.cuda(), attention_mask=torch.ones_like(ids).cuda(),
                                loss_mask=mask.cuda())
            record = {
                "input_ids": batch.input_ids[0].cpu(),
                "loss_mask": batch.loss_mask[0].cpu(),
                "hidden_state": batch.last_hidden_states[0].cpu().clone().unsqueeze(0),
                "aux_hidden_state": batch.hidden_states[0].cpu().clone().unsqueeze(0),
            }
            tokens += ids.shape[1]
            group = i // 2000 * 2000
            pending.append(pool.submit(save, record, out / f"rows_{group}-{group + 2000}" / f"data_{i}.ckpt"))
            if len(pending) >= 128:  # bounded, as SpecForge's own IO queue is
                pending.pop(0).result()
        for f in pending:
            f.result()
    os.sync()
    times["capture_s"] = round(time.time() - t, 1)
    print(json.dumps({"samples": len(dataset), "tokens": tokens, **times}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:4]))
