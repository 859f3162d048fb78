"""Client side of scripts/device/run_parallel_layouts.sh (standard library, torch and hsx).

    layout_checks.py send URL DUMP_DIR TAG VOCAB OUT.json      captured prompts (and plain ones, and two
        /health_generate calls) at once, so they share chunked, mixed batches; waits for every dump
    layout_checks.py compare BASE.json OTHER.json OUT.json     the same prompts' dumps of two servers, per
        tensor: per-token cosines and the largest difference, ids and counts exact, which DP group wrote each
    layout_checks.py verify URL DUMP_DIR OUT.json              ``hsx verify --reference``'s checks: the
        verification prompts through the engine, each dump against a transformers fp32 forward on the CPU

Every figure goes to the JSON named; a one-line verdict to stdout.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import random
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
for _path in (ROOT, HERE):
    if _path not in sys.path:
        sys.path.insert(0, _path)

from arch_matrix import LENS, load_dump  # noqa: E402  (the prompt lengths and dump reader of the matrix)

from bench.sglang_capture import Client, wait_for_dumps  # noqa: E402
from hsx import contract  # noqa: E402

COS_OK = 0.999  # per-token cosine of two bf16 forwards of one model whose reductions run in another order


def prompts(vocab: int) -> list[list[int]]:
    rng = random.Random(20261207)  # the same prompts on every server of one model
    return [[rng.randrange(10, vocab) for _ in range(n)] for n in LENS]


def send(url: str, dump_dir: str, tag: str, vocab: int, out: str) -> int:
    client = Client(url, timeout=300)
    _, info = client.request("GET", contract.INFO_PATH)
    cap = [(f"{contract.RID_PREFIX}{tag}-{i}", ids) for i, ids in enumerate(prompts(vocab))]
    jobs: list[tuple[str, Any]] = [("cap", c) for c in cap]
    jobs += [("plain", (f"plain-{tag}-{i}", ids)) for i, (_, ids) in enumerate(cap)]
    jobs += [("health", None)] * 2
    random.Random(7).shuffle(jobs)
    responses: dict[str, Any] = {}

    def one(job: tuple[str, Any]) -> None:
        kind, arg = job
        if kind == "health":
            responses.setdefault("health", []).append(client.request("GET", "/health_generate")[0])
        else:
            responses[arg[0]] = client.generate(arg[1], arg[0])

    t0 = time.perf_counter()
    with cf.ThreadPoolExecutor(len(jobs)) as ex:
        list(ex.map(one, jobs))
    drain = wait_for_dumps(dump_dir, [rid for rid, _ in cap], 60)
    result: dict[str, Any] = {
        "info": info,
        "dump_dir": dump_dir,
        "seconds": round(time.perf_counter() - t0, 2),
        "drain_s": drain,
        "health": responses.get("health"),
        "stray": sorted(d for d in os.listdir(dump_dir) if d.startswith("plain-")),
        "prompts": {},
    }
    for rid, ids in cap:
        row: dict[str, Any] = {"len": len(ids), "ids": ids}
        try:
            meta, t = load_dump(dump_dir, rid)
            row.update(
                rows=meta.num_tokens,
                dp_rank=meta.extra.get("dp_rank"),
                chunks=meta.extra.get("chunks"),
                exact=meta.num_tokens == len(ids) and t["input_ids"].tolist() == ids,
            )
        except (OSError, ValueError) as exc:
            row["error"] = repr(exc)[:200]
        result["prompts"][rid] = row
    exact = sum(1 for r in result["prompts"].values() if r.get("exact"))
    result["ok"] = exact == len(cap) and not result["stray"] and result["health"] == [200, 200]
    with open(out, "w") as fh:
        json.dump(result, fh, indent=1)
    groups = sorted({str(r.get("dp_rank")) for r in result["prompts"].values()})
    print(f"send {tag}: {exact}/{len(cap)} dumps exact, written by DP groups {groups}, ok={result['ok']}")
    return 0 if result["ok"] else 1


def compare(base_path: str, other_path: str, out: str) -> int:
    import torch

    with open(base_path) as fh:
        base = json.load(fh)
    with open(other_path) as fh:
        other = json.load(fh)
    names: list[str] = []
    cos: dict[str, list[Any]] = {}
    worst: dict[str, float] = {}
    missing = []
    for (rid_a, a), (rid_b, b) in zip(base["prompts"].items(), other["prompts"].items(), strict=True):
        if a["ids"] != b["ids"] or not (a.get("exact") and b.get("exact")):
            missing.append(rid_b)
            continue
        _, ta = load_dump(base["dump_dir"], rid_a)
        _, tb = load_dump(other["dump_dir"], rid_b)
        names = [n for n in ta if n != "input_ids"]
        for n in names:
            x, y = ta[n].float(), tb[n].float()
            cos.setdefault(n, []).append(torch.nn.functional.cosine_similarity(x, y, dim=-1))
            worst[n] = max(worst.get(n, 0.0), float((x - y).abs().max()) / max(float(x.abs().max()), 1e-6))
    tensors = {}
    for n in names:
        c = torch.cat(cos[n])
        tensors[n] = {
            "mean": round(float(c.mean()), 6),
            "share>=0.999": round(float((c >= COS_OK).float().mean()), 4),
            "min": round(float(c.min()), 5),
            "max_rel_diff": round(worst[n], 5),
        }
    ok = not missing and bool(tensors) and all(t["mean"] >= COS_OK for t in tensors.values())
    result = {"base": base_path, "other": other_path, "missing": missing, "tensors": tensors, "ok": ok}
    with open(out, "w") as fh:
        json.dump(result, fh, indent=1)
    means = " / ".join(f"{n} {t['mean']:.5f}" for n, t in tensors.items())
    print(f"compare {os.path.basename(other_path)} with {os.path.basename(base_path)}: {means}; ok={ok}")
    return 0 if ok else 1


def verify(url: str, dump_dir: str, out: str) -> int:
    from workers.reference_check import reference_checks

    checks = reference_checks(url, dump_dir)
    doc = {"checks": [c.to_dict() for c in checks], "ok": bool(checks) and all(c.ok for c in checks)}
    with open(out, "w") as fh:
        json.dump(doc, fh, indent=1)
    cosines = [c.actual for c in checks if c.name.endswith(".reference_cosine")]
    print(f"verify --reference {url}: ok={doc['ok']} {cosines}")
    return 0 if doc["ok"] else 1


def main(argv: list[str]) -> int:
    cmd, args = argv[0], argv[1:]
    if cmd == "send":
        return send(args[0], args[1], args[2], int(args[3]), args[4])
    if cmd == "compare":
        return compare(*args[:3])
    if cmd == "verify":
        return verify(*args[:3])
    raise SystemExit(__doc__)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
