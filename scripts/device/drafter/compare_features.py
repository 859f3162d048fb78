"""Two SpecForge offline feature folders of the same conversations, compared sample by sample: hsx's export
against SpecForge's own capture (specforge_capture.py).

The two number their files differently (hsx by dataset line, SpecForge after its shuffle), so samples are
paired by their content: the token ids of the first user turn (between the second ``<|im_start|>`` and the
``<|im_end|>`` after it; SmolLM2's ids 1 and 2). For each pair: are the ids equal, and the loss masks; where
the ids are equal, the cosine of every row of the final state and of each aux layer; where they differ, the
first position they differ at and the tokens there; where the masks differ, how many positions and which
tokens. Prints one JSON document.

    python3 compare_features.py HSX_FEATURES SPECFORGE_FEATURES [TOKENIZER_DIR]
"""

from __future__ import annotations

import json
import statistics
import sys
from collections import Counter
from pathlib import Path
from typing import Any

IM_START, IM_END = 1, 2


def user_key(ids: list[int]) -> tuple[int, ...]:
    starts = [i for i, t in enumerate(ids) if t == IM_START]
    if len(starts) < 2:
        return tuple(ids[:64])
    body = ids[starts[1] :]
    end = body.index(IM_END) if IM_END in body else len(body)
    return tuple(body[:end])


def load(path: Path) -> dict[str, Any]:
    import torch

    return dict(torch.load(path, map_location="cpu", weights_only=True, mmap=True))


def index(folder: Path) -> dict[tuple[int, ...], Path]:
    out: dict[tuple[int, ...], Path] = {}
    for path in sorted(folder.rglob("*.ckpt")):
        out.setdefault(user_key(load(path)["input_ids"].view(-1).tolist()), path)
    return out


def row_cosines(a: Any, b: Any) -> Any:
    import torch

    a, b = a.float().reshape(-1, a.shape[-1]), b.float().reshape(-1, b.shape[-1])
    return torch.nn.functional.cosine_similarity(a, b, dim=-1)


def main(argv: list[str]) -> int:
    hsx_dir, sf_dir = Path(argv[1]), Path(argv[2])
    tokenizer = None
    if len(argv) > 3:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(argv[3])

    def show(tokens: list[int]) -> str:
        return tokenizer.decode(tokens) if tokenizer is not None else str(tokens)

    hsx, sf = index(hsx_dir), index(sf_dir)
    report: dict[str, Any] = {"hsx_samples": len(hsx), "specforge_samples": len(sf)}
    paired = [(k, hsx[k], sf[k]) for k in hsx if k in sf]
    report["paired"] = len(paired)
    equal_ids = equal_masks = 0
    final_cos: list[float] = []
    aux_cos: list[list[float]] = []
    worst: list[tuple[float, str]] = []
    id_diffs: list[dict[str, Any]] = []
    mask_diffs: Counter[str] = Counter()
    mask_diff_samples = 0
    for _key, hp, sp in paired:
        h, s = load(hp), load(sp)
        hi, si = h["input_ids"].view(-1).tolist(), s["input_ids"].view(-1).tolist()
        if hi != si:
            first = next((i for i, (a, b) in enumerate(zip(hi, si)) if a != b), min(len(hi), len(si)))
            if len(id_diffs) < 5:
                id_diffs.append({"hsx_len": len(hi), "specforge_len": len(si), "first_diff": first,
                                 "hsx": show(hi[first : first + 8]), "specforge": show(si[first : first + 8])})
            continue
        equal_ids += 1
        hm, sm = h["loss_mask"].view(-1).tolist(), s["loss_mask"].view(-1).tolist()
        if hm == sm:
            equal_masks += 1
        else:
            mask_diff_samples += 1
            for i, (a, b) in enumerate(zip(hm, sm)):
                if a != b:
                    mask_diffs[f"{'hsx' if a else 'specforge'} only: {show([hi[i]])!r}"] += 1
        fc = row_cosines(h["hidden_state"], s["hidden_state"])
        final_cos.append(float(fc.mean()))
        worst.append((float(fc.min()), sp.name))
        width = h["hidden_state"].shape[-1]
        ha, sa = h["aux_hidden_state"], s["aux_hidden_state"]
        aux_cos.append([float(row_cosines(ha[..., j * width : (j + 1) * width], sa[..., j * width : (j + 1) * width]).mean())
                        for j in range(ha.shape[-1] // width)])
    report["equal_ids"] = equal_ids
    report["equal_ids_and_masks"] = equal_masks
    report["mask_differs"] = mask_diff_samples
    report["mask_difference_tokens"] = dict(mask_diffs.most_common(10))
    report["id_differences"] = id_diffs
    if final_cos:
        report["final_state_cosine"] = {"mean": round(statistics.mean(final_cos), 6),
                                        "min_sample_mean": round(min(final_cos), 6),
                                        "min_row": round(min(w for w, _ in worst), 6)}
        per_layer = list(zip(*aux_cos))
        report["aux_cosine_mean"] = [round(statistics.mean(c), 6) for c in per_layer]
        report["aux_cosine_min_sample_mean"] = [round(min(c), 6) for c in per_layer]
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
