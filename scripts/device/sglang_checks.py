"""Client-side checks of the SGLang engine on the device (run by run_sglang_e2e.sh).

    sglang_checks.py correctness URL DUMP_DIR REF_DIR OUT.json   # radix off, chunked prefill 2048
    sglang_checks.py radix URL DUMP_DIR OUT.json                 # radix cache on
    sglang_checks.py report OUT_DIR                              # the final table

correctness: /hsx/info; every reference prompt (1 .. 8,192 tokens) sent concurrently as a captured rid,
mixed with plain-rid copies and /health_generate calls; dumps compared with Hugging Face on the same
weights (per-layer cosine, exact token counts and ids); nothing dumped for plain or health rids; a
shared-prefix pair passes verification; captured requests aborted at staggered times leave either no
dump or a complete one, never a half one.
radix: the same shared-prefix pair fails verification on cached_tokens; with distinct extra_keys it passes.

The verification is inline (the rules of hsx.engine.verify as the contract states them: complete dump, rows ==
prompt tokens, cached_tokens == 0 in the response and the meta, the ids sent, [T, H] per hf index) unless
``hsx.engine.verify.run_verification`` can be called; the JSON says which.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import glob
import json
import os
import random
import sys
import threading
import time
import uuid
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
from bench.sglang_capture import Client, wait_for_dumps  # noqa: E402
from hsx import contract  # noqa: E402


def load_dump(dump_dir: str, rid: str) -> tuple[contract.DumpMeta, dict[str, contract.RawTensor]]:
    d = os.path.join(dump_dir, rid)
    with open(os.path.join(d, contract.META_FILE)) as fh:
        meta = contract.DumpMeta.from_json(fh.read())
    return meta, contract.read_safetensors(os.path.join(d, contract.STATES_FILE))


def verify_inline(
    dump_dir: str, rid: str, ids: list[int], response: dict[str, Any], info: dict[str, Any]
) -> list[str]:
    """What a verifier must reject; empty when the sample is good."""
    errs: list[str] = []
    mi = response.get("meta_info", {})
    if int(mi.get("cached_tokens", 0)) != 0:
        errs.append(f"response cached_tokens={mi.get('cached_tokens')}")
    if int(mi.get("prompt_tokens", len(ids))) != len(ids):
        errs.append(f"response prompt_tokens={mi.get('prompt_tokens')} != {len(ids)}")
    try:
        meta, t = load_dump(dump_dir, rid)
    except FileNotFoundError as exc:
        return errs + [f"no complete dump: {exc.filename}"]
    if meta.cached_tokens != 0:
        errs.append(f"meta cached_tokens={meta.cached_tokens}")
    if meta.num_tokens != len(ids) or meta.prompt_tokens != len(ids):
        errs.append(f"rows {meta.num_tokens}, prompt_tokens {meta.prompt_tokens}, sent {len(ids)}")
    got = list(memoryview(t["input_ids"].data).cast("i"))
    if got != list(ids):
        errs.append(f"input_ids differ ({len(got)} rows dumped)")
    if meta.hf_indices != info["hf_indices"]:
        errs.append(f"hf_indices {meta.hf_indices}")
    for k in info["hf_indices"]:
        shape = t[contract.tensor_name(k)].shape
        if shape != [len(ids), info["hidden_size"]]:
            errs.append(f"hidden.{k} shape {shape}")
    return errs


def _verify(
    dump_dir: str, rid: str, ids: list[int], response: dict[str, Any], info: dict[str, Any]
) -> tuple[bool, str, str]:
    errs = verify_inline(dump_dir, rid, ids, response, info)
    return not errs, "; ".join(errs), "inline"


def hsx_verify(url: str, dump_dir: str) -> dict[str, Any]:
    """``hsx.engine.verify.run_verification`` against the server (its two shared-prefix prompts, no extra_key)."""
    try:
        from hsx.engine.verify import run_verification
    except Exception as exc:  # noqa: BLE001 - a missing dependency on the device must not stop the run
        return {"available": False, "error": repr(exc)[:300]}
    rep = run_verification(url, dump_dir)
    return {
        "available": True,
        "ok": rep.ok,
        "failed": [f"{c.name}: expected {c.expected}, got {c.actual}" for c in rep.failed],
    }


def as_tensor(raw: contract.RawTensor, torch: Any) -> Any:
    dtype = {"BF16": torch.bfloat16, "F32": torch.float32, "F16": torch.float16}[raw.dtype]
    return torch.frombuffer(bytearray(raw.data), dtype=dtype).view(*raw.shape)


def cosines(
    t: dict[str, contract.RawTensor], ref_path: str, hf: list[int], torch: Any, dev: str
) -> tuple[dict[int, float], dict[int, float]]:
    """Per-layer cosine over the whole [T, H] tensor, and the smallest per-token cosine."""
    reft = contract.read_safetensors(ref_path)
    cos, tokmin = {}, {}
    for k in hf:
        name = contract.tensor_name(k)
        a = as_tensor(t[name], torch).to(dev).float()
        b = as_tensor(reft[name], torch).to(dev).float()
        if a.shape != b.shape:
            cos[k] = tokmin[k] = float("nan")
            continue
        cos[k] = round(torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0).item(), 6)
        tokmin[k] = round(torch.nn.functional.cosine_similarity(a, b, dim=1).min().item(), 5)
    return cos, tokmin


def prefix_pair(seed: int) -> tuple[list[int], list[int]]:
    rng = random.Random(seed)
    high = int(os.environ.get("HSX_E2E_VOCAB", "120000"))
    p1 = [rng.randrange(10, high) for _ in range(600)]
    p2 = p1[:500] + [rng.randrange(10, high) for _ in range(100)]
    return p1, p2


def shared_prefix_case(
    client: Client, dump_dir: str, info: dict[str, Any], extra_keys: bool
) -> dict[str, Any]:
    tag = uuid.uuid4().hex[:6]
    p1, p2 = prefix_pair(11)
    out: dict[str, Any] = {}
    for name, ids in (("first", p1), ("shares_500_prefix", p2)):
        rid = f"{contract.RID_PREFIX}prefix-{name}-{tag}"
        resp = client.generate(ids, rid, extra_key=f"ek-{rid}" if extra_keys else None)
        wait_for_dumps(dump_dir, [rid], 30)
        ok, why, how = _verify(dump_dir, rid, ids, resp, info)
        meta = None
        with contextlib.suppress(FileNotFoundError):
            meta, _ = load_dump(dump_dir, rid)
        out[name] = {
            "sent": len(ids),
            "cached_tokens": resp["meta_info"].get("cached_tokens"),
            "rows_dumped": meta.num_tokens if meta else None,
            "verify_pass": ok,
            "why": why,
            "verifier": how,
        }
    return out


def correctness(url: str, dump_dir: str, ref_dir: str, out_path: str) -> int:
    import torch

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    abort_len = int(os.environ.get("HSX_E2E_ABORT_LEN", "8000"))
    only_test1 = os.environ.get("HSX_E2E_ONLY_TEST1") == "1"
    client = Client(url)
    status, info = client.request("GET", contract.INFO_PATH)
    assert status == 200, (status, info)
    with open(os.path.join(ref_dir, "prompts.json")) as fh:
        ref = json.load(fh)
    prompts: list[list[int]] = ref["prompts"]
    res: dict[str, Any] = {
        "info": info,
        "hf_hidden_states_N_is_post_norm": ref["hf_hidden_states_N_is_post_norm"],
    }
    info_ok = info["hf_indices"] == ref["hf"] and info["num_layers"] == ref["num_layers"]
    res["info_ok"] = info_ok and info["prefix_cache"] is False and info["backend"] == "sglang"

    # --- test 1: concurrent mixed batches, chunked prefill --------------------------------------
    tag = uuid.uuid4().hex[:6]
    jobs: list[tuple[str, Any]] = []
    for i, ids in enumerate(prompts):
        jobs.append(("cap", (i, f"{contract.RID_PREFIX}t1-{i}-{tag}", ids)))
        jobs.append(("plain", (i, f"plain-t1-{i}-{tag}", ids)))
    jobs += [("health", None)] * 3
    random.Random(5).shuffle(jobs)
    responses: dict[str, Any] = {}

    def run(job: tuple[str, Any]) -> None:
        kind, arg = job
        if kind == "health":
            status, _ = client.request("GET", "/health_generate")
            responses.setdefault("health", []).append(status)
            return
        i, rid, ids = arg
        responses[rid] = client.generate(ids, rid)

    t0 = time.perf_counter()
    with cf.ThreadPoolExecutor(len(jobs)) as ex:
        list(ex.map(run, jobs))
    res["test1_secs"] = round(time.perf_counter() - t0, 2)
    cap_rids = [arg[1] for kind, arg in jobs if kind == "cap"]
    drain = wait_for_dumps(dump_dir, cap_rids, 60)
    res["test1_drain_s"] = drain
    rows = []
    for i, ids in enumerate(prompts):
        rid = f"{contract.RID_PREFIX}t1-{i}-{tag}"
        row: dict[str, Any] = {"len": len(ids)}
        try:
            meta, t = load_dump(dump_dir, rid)
            row.update(
                rows=meta.num_tokens,
                prompt_tokens=meta.prompt_tokens,
                cached=meta.cached_tokens,
                resp_cached=responses[rid]["meta_info"].get("cached_tokens"),
                chunks=meta.extra.get("chunks"),
            )
            row["ids_equal"] = list(memoryview(t["input_ids"].data).cast("i")) == ids
            hf = info["hf_indices"]
            cos, tokmin = cosines(t, os.path.join(ref_dir, f"ref_{i}.safetensors"), hf, torch, dev)
            row["cos"], row["min_token_cos"] = cos, tokmin
            counts_ok = (
                meta.num_tokens == len(ids) == meta.prompt_tokens
                and meta.cached_tokens == 0
                and row["ids_equal"]
            )
            primary = cos
            ref32 = os.path.join(ref_dir, f"ref32_{i}.safetensors")
            if os.path.exists(ref32):
                cos32, tokmin32 = cosines(t, ref32, hf, torch, dev)
                row["cos_fp32"], row["min_token_cos_fp32"] = cos32, tokmin32
                floor = ref["hf_bf16_vs_fp32_cos"][i]
                row["hf_bf16_vs_fp32"] = {k: floor[contract.tensor_name(k)] for k in hf}
                # error of this capture against the exact (fp32) states, relative to HF's own bf16 error
                row["err_ratio_vs_hf_bf16"] = {
                    k: round((1 - cos32[k]) / max(1e-9, 1 - row["hf_bf16_vs_fp32"][k]), 2) for k in hf
                }
                row["pass_numerics"] = counts_ok and all(
                    (1 - cos32[k]) <= 1.5 * (1 - row["hf_bf16_vs_fp32"][k]) + 1e-4 for k in hf
                )
                if info["dtype"] == "float32":
                    primary = cos32  # an fp32 server is compared with the fp32 reference
            row["pass"] = counts_ok and all(c >= 0.999 for c in primary.values())
        except Exception as exc:  # noqa: BLE001
            row.update(error=repr(exc), **{"pass": False})
        rows.append(row)
    res["test1"] = rows
    res["test1_pass"] = all(r["pass"] for r in rows)
    listing = sorted(os.listdir(dump_dir))
    stray = [d for d in listing if d not in set(cap_rids)]
    res["health_status"] = responses.get("health")
    res["stray_dirs"] = stray  # plain/health rids must not be dumped
    res["no_stray"] = not stray
    if only_test1:
        with open(out_path, "w") as fh:
            json.dump(res, fh, indent=1)
        print(json.dumps({k: res[k] for k in ("info_ok", "test1_pass", "no_stray")}))
        return 0

    # --- test 2 (radix off): a shared-prefix pair passes ----------------------------------------
    res["test2_radix_off"] = shared_prefix_case(client, dump_dir, info, extra_keys=False)
    res["test2_radix_off_hsx_verify"] = hsx_verify(url, dump_dir)

    # --- aborts: staggered aborts of captured 8,000-token requests ------------------------------
    rng = random.Random(3)
    high = int(os.environ.get("HSX_E2E_VOCAB", "120000"))
    trials = []
    for j, delay in enumerate([0.03, 0.06, 0.09, 0.12, 0.15, 0.2, 0.3, 0.5]):
        rid = f"{contract.RID_PREFIX}abort-{j}-{tag}"
        ids = [rng.randrange(10, high) for _ in range(abort_len)]
        box: dict[str, Any] = {}

        def send(rid: str = rid, ids: list[int] = ids, box: dict[str, Any] = box) -> None:
            try:
                box["resp"] = Client(url).generate(ids, rid)
            except Exception as exc:  # noqa: BLE001
                box["error"] = repr(exc)[:200]

        th = threading.Thread(target=send)
        th.start()
        time.sleep(delay)
        client.request("POST", "/abort_request", {"rid": rid})
        th.join()
        fr = (box.get("resp") or {}).get("meta_info", {}).get("finish_reason")
        trials.append(
            {"rid": rid, "delay": delay, "len": len(ids), "finish_reason": fr, "error": box.get("error")}
        )
    time.sleep(1.5)
    for tr in trials:
        d = os.path.join(dump_dir, tr["rid"])
        if not os.path.exists(d):
            tr["dump"] = "none"
        elif os.path.exists(os.path.join(d, contract.META_FILE)):
            meta, _ = load_dump(dump_dir, tr["rid"])
            tr["dump"] = "complete" if meta.num_tokens == tr["len"] else f"WRONG rows={meta.num_tokens}"
        else:
            tr["dump"] = "HALF: " + ",".join(sorted(os.listdir(d)))
    res["aborts"] = trials
    res["aborts_ok"] = all(tr["dump"] in ("none", "complete") for tr in trials)
    with open(out_path, "w") as fh:
        json.dump(res, fh, indent=1)
    print(json.dumps({k: res[k] for k in ("info_ok", "test1_pass", "no_stray", "aborts_ok")}))
    return 0


def radix(url: str, dump_dir: str, out_path: str) -> int:
    client = Client(url)
    status, info = client.request("GET", contract.INFO_PATH)
    assert status == 200
    res = {
        "info_prefix_cache": info["prefix_cache"],
        "test2_radix_on": shared_prefix_case(client, dump_dir, info, extra_keys=False),
        "test2_radix_on_extra_key": shared_prefix_case(client, dump_dir, info, extra_keys=True),
        "test2_radix_on_hsx_verify": hsx_verify(url, dump_dir),
    }
    with open(out_path, "w") as fh:
        json.dump(res, fh, indent=1)
    print(json.dumps(res))
    return 0


def report(out_dir: str) -> int:
    def load(name: str) -> dict[str, Any]:
        try:
            with open(os.path.join(out_dir, name)) as fh:
                return json.load(fh)  # type: ignore[no-any-return]
        except (OSError, ValueError):
            return {}

    def verdict(ok: bool) -> str:
        return "PASS" if ok else "FAIL"

    c, r = load("correctness.json"), load("radix.json")
    benches = {
        os.path.basename(f)[6:-5]: load(os.path.basename(f)) for f in glob.glob(f"{out_dir}/bench_*.json")
    }
    lines: list[str] = []
    for f in sorted(glob.glob(f"{out_dir}/correctness*.json")):
        lines += _test1_table(load(os.path.basename(f)), verdict)
    if c.get("test2_radix_off"):
        lines.append(f"health_generate during test 1: {c['health_status']}")
        t2 = c["test2_radix_off"]["shares_500_prefix"]
        lines.append(
            f"TEST 2  radix OFF: shared-prefix prompt cached={t2['cached_tokens']} "
            f"rows={t2['rows_dumped']}/{t2['sent']} inline verify={verdict(t2['verify_pass'])}"
        )
        lines.append(
            "TEST 2  radix OFF: hsx.engine.verify.run_verification "
            + _verify_text(c.get("test2_radix_off_hsx_verify", {}))
        )
    if r:
        t2 = r["test2_radix_on"]["shares_500_prefix"]
        lines.append(
            f"TEST 2  radix ON : shared-prefix prompt cached={t2['cached_tokens']} "
            f"rows={t2['rows_dumped']}/{t2['sent']} inline verify={verdict(t2['verify_pass'])}: "
            f"{t2['why'][:120]}"
        )
        lines.append(
            "TEST 2  radix ON : hsx.engine.verify.run_verification "
            + _verify_text(r.get("test2_radix_on_hsx_verify", {}))
        )
        t3 = r["test2_radix_on_extra_key"]["shares_500_prefix"]
        lines.append(
            f"TEST 2  radix ON + distinct extra_key: cached={t3['cached_tokens']} "
            f"rows={t3['rows_dumped']}/{t3['sent']} inline verify={verdict(t3['verify_pass'])}"
        )
    if c.get("aborts"):
        ab = c["aborts"]
        lines.append(
            f"ABORTS  {len(ab)} captured {ab[0]['len']}-token requests aborted at 30..500 ms: dumps "
            f"{[t['dump'] for t in ab]} -> {'OK' if c['aborts_ok'] else 'HALF DUMP'}"
        )
    for name, b in sorted(benches.items()):
        if not b:
            continue
        s = b["summary"]
        lines.append(
            f"TEST 3  {name}: {b['num_prompts']}x{b['prompt_len']} tok, {b['concurrency']} in flight: "
            f"plain {s['plain_tok_s']} tok/s, captured {s['captured_tok_s_responses']} tok/s (responses) / "
            f"{s['captured_tok_s_end_to_end']} tok/s (until last dump) -> ratio {s['ratio_responses']} / "
            f"{s['ratio_end_to_end']}; dumps complete: {s['dumps_complete']}"
        )
    print("\n".join(lines))
    with open(os.path.join(out_dir, "results.json"), "w") as fh:
        json.dump({"correctness": c, "radix": r, "bench": benches}, fh, indent=1)
    return 0


def _test1_table(c: dict[str, Any], verdict: Any) -> list[str]:
    if not c:
        return []
    hf = c["info"]["hf_indices"]
    has32 = any("cos_fp32" in row for row in c["test1"])
    lines = [
        f"TEST 1  SGLang {c['info']['dtype']} (chunked prefill 2048, radix off, concurrent mixed batches) "
        "vs HF transformers on the same weights"
    ]
    head = " ".join(f"{'h.' + str(k):>8}" for k in hf)
    cols = f"cos vs HF bf16: {head}"
    if has32:
        cols += f" | cos vs HF fp32: {head} | HF bf16 vs fp32: {head}"
    lines.append(
        f"{'tokens':>6} {'rows':>6} {'cached':>6} {'chunks':>6}  {cols}  min-tok  ok(>=0.999)  ok(numerics)"
    )
    for row in c["test1"]:
        if "error" in row:
            lines.append(f"{row['len']:>6} ERROR {row['error'][:100]}")
            continue
        cells = "                " + " ".join(f"{row['cos'][str(k)]:>8.5f}" for k in hf)
        mins = min(row["min_token_cos"].values())
        if "cos_fp32" in row:
            cells += " |                " + " ".join(f"{row['cos_fp32'][str(k)]:>8.5f}" for k in hf)
            cells += " |                 " + " ".join(f"{row['hf_bf16_vs_fp32'][str(k)]:>8.5f}" for k in hf)
            mins = min(row["min_token_cos_fp32"].values()) if c["info"]["dtype"] == "float32" else mins
        num = verdict(row["pass_numerics"]) if "pass_numerics" in row else "-"
        lines.append(
            f"{row['len']:>6} {row['rows']:>6} {row['cached']:>6} {row['chunks']:>6}  {cells}  {mins:.5f}"
            f"  {verdict(row['pass']):>11}  {num:>12}"
        )
    lines.append(
        f"  plain/health rids dumped: {c['stray_dirs'] or 'none'}; /hsx/info ok: {c['info_ok']}; "
        f"all rows PASS: {c['test1_pass']}"
    )
    return lines


def _verify_text(v: dict[str, Any]) -> str:
    if not v:
        return "not run"
    if not v.get("available"):
        return f"unavailable ({v.get('error')})"
    return "PASS" if v["ok"] else "FAIL: " + "; ".join(v["failed"])[:300]


if __name__ == "__main__":
    cmd = sys.argv[1]
    if cmd == "correctness":
        sys.exit(correctness(*sys.argv[2:6]))
    if cmd == "radix":
        sys.exit(radix(*sys.argv[2:5]))
    if cmd == "report":
        sys.exit(report(sys.argv[2]))
    raise SystemExit(f"unknown command {cmd}")
