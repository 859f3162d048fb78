"""The pure parts of the device architecture matrix (scripts/device/arch_*.py), on CPU at a tiny scale.

The models, the transformers reference (bf16, fp32 and the pre-norm state), the per-layer figures and the
evaluation of dumps all run here; only the SGLang servers need the device.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from hsx import contract
from tests.fixtures.shared import once_per_session
from workers.engines.sglang.config import dump_tensor_names

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts" / "device"))
import arch_matrix  # noqa: E402
import arch_models  # noqa: E402
import arch_stats  # noqa: E402

HF = contract.hf_indices(contract.eagle3_aux_layer_ids(arch_models.NUM_LAYERS), arch_models.NUM_LAYERS)
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [11, 12, 13], [40]]


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[str, dict[str, Any]]]:
    """Every matrix architecture, tiny, with its reference states: made once per session, whichever test
    process asks first (tests/fixtures/shared.py)."""

    def build(work: Path) -> dict[str, tuple[str, dict[str, Any]]]:
        out = {}
        for name in arch_models.ARCHS:
            path = str(work / name)
            arch_models.make_model(name, path, device="cpu", tiny=True)
            out[name] = (path, arch_models.reference_states(path, name, PROMPTS, HF, "cpu"))
        return out

    return once_per_session(tmp_path_factory, "sglang-arch-matrix", build)


@pytest.mark.parametrize("name", arch_models.ARCHS)
def test_references_hold_every_tensor_and_tell_neighbouring_layers_apart(
    built: dict[str, tuple[str, dict[str, Any]]], name: str
) -> None:
    path, ref = built[name]
    names = dump_tensor_names(HF, "both")
    for states in (ref["bf16"], ref["fp32"]):
        assert len(states) == len(PROMPTS)
        for ids, s in zip(PROMPTS, states, strict=True):
            assert sorted(s) == sorted(names) and all(s[n].shape == (len(ids), 64) for n in names)
    assert all(ref["fp32"][0][n].dtype == torch.float32 for n in names)
    # the level a tap one layer off would show is far below the bar a right tap reaches
    assert all(level < 0.99 for level in ref["neighbour"].values()), ref["neighbour"]
    figures = arch_stats.layer_figures(
        [s[contract.PRE_NORM_TENSOR] for s in ref["bf16"]],
        [s[contract.PRE_NORM_TENSOR] for s in ref["bf16"]],
        [s[contract.PRE_NORM_TENSOR] for s in ref["fp32"]],
    )
    assert figures["hf_bf16_vs_fp32"]["mean"] > 0.99


@pytest.mark.parametrize("name", ["llama", "deepseek_v3", "gemma3"])
def test_the_pre_norm_reference_is_what_the_final_norm_turns_into_the_post_norm_state(
    built: dict[str, tuple[str, dict[str, Any]]], name: str
) -> None:
    path, ref = built[name]
    model = arch_models.load_reference_model(path, name, "cpu").float()
    for s in ref["fp32"]:
        with torch.no_grad():
            normed = model.model.norm(s[contract.PRE_NORM_TENSOR])
        assert torch.allclose(normed, s[contract.tensor_name(arch_models.NUM_LAYERS)], atol=1e-4)
        cos = arch_stats.token_cosines(s[contract.PRE_NORM_TENSOR], s[contract.tensor_name(8)])
        assert float(cos.mean()) < 0.99  # the randomised norm weights make the two states distinguishable


def test_figures_and_the_verdict() -> None:
    g = torch.Generator().manual_seed(0)
    exact = [torch.randn(50, 32, generator=g)]
    hf = [exact[0] + 0.01 * torch.randn(50, 32, generator=g)]
    close = [exact[0] + 0.012 * torch.randn(50, 32, generator=g)]
    fig = arch_stats.layer_figures(close, hf, exact)
    assert fig["sglang_vs_fp32"]["mean"] > 0.999 and arch_stats.numerics_ok(fig)
    neighbour = [exact[0] + 0.4 * torch.randn(50, 32, generator=g)]  # about a neighbouring layer's level
    bad = arch_stats.layer_figures(neighbour, hf, exact)
    assert bad["sglang_vs_fp32"]["mean"] < 0.95 and not arch_stats.numerics_ok(bad)
    s = arch_stats.summarize(torch.tensor([1.0, 0.9995, 0.99, 0.5]))
    assert s == {"mean": round((1.0 + 0.9995 + 0.99 + 0.5) / 4, 6), "share": 0.5, "min": 0.5}


class FakeRun:
    """What ``arch_matrix.evaluate`` reads of an ``ArchRun``."""

    def __init__(self, dump_dir: str, final_state: str, refs: dict[str, Any]) -> None:
        self.dump_dir = dump_dir
        self.final_state = final_state
        self.refs = refs


def write_dump(dump_dir: str, rid: str, ids: list[int], states: dict[str, torch.Tensor], fs: str) -> None:
    d = os.path.join(dump_dir, rid)
    os.makedirs(d)
    tensors = [("input_ids", "I32", [len(ids)], torch.tensor(ids, dtype=torch.int32).numpy().tobytes())]
    for name, t in states.items():
        raw = t.to(torch.bfloat16).contiguous().view(torch.int16).numpy().tobytes()
        tensors.append((name, "BF16", list(t.shape), raw))
    contract.write_safetensors(os.path.join(d, contract.STATES_FILE), tensors)
    meta = contract.DumpMeta(
        rid,
        len(ids),
        len(ids),
        0,
        64,
        "bfloat16",
        8,
        [1, 3, 4],
        HF,
        engine="sglang",
        extra={"final_state": fs},
    )
    contract.write_meta_atomically(d, meta)


@pytest.mark.parametrize("final_state", ["pre", "both"])
def test_evaluate_passes_right_dumps_and_catches_wrong_ones(
    built: dict[str, tuple[str, dict[str, Any]]],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    final_state: str,
) -> None:
    monkeypatch.setattr(arch_matrix, "GPU", "cpu")
    _, ref = built["qwen3_moe"]
    names = dump_tensor_names(HF, final_state)
    info = {"hf_indices": HF, "hidden_size": 64, "final_state": final_state, "extra": {"tp_size": 1}}
    cap = [(f"hsx-mx-t-{i}-x", ids) for i, ids in enumerate(PROMPTS)]
    responses = {rid: {"meta_info": {"cached_tokens": 0}} for rid, _ in cap}

    good = tmp_path / "good"
    for (rid, ids), states in zip(cap, ref["bf16"], strict=True):
        write_dump(str(good), rid, ids, {n: states[n] for n in names}, final_state)
    res = arch_matrix.evaluate(FakeRun(str(good), final_state, ref), info, cap, responses)  # type: ignore[arg-type]
    assert res["counts_ok"] and res["layers_ok"] and res["info_ok"] and sorted(res["layers"]) == sorted(names)
    assert res["counts"] == {"exact": 3, "prompts": 3} and res["stray_dirs"] == []

    wrong = tmp_path / "wrong"  # the first aux tensor holds the next layer's state: a tap one layer off
    for (rid, ids), states in zip(cap, ref["bf16"], strict=True):
        dumped = {n: states[n] for n in names}
        dumped[contract.tensor_name(HF[0])] = states[contract.tensor_name(HF[1])]
        write_dump(str(wrong), rid, ids, dumped, final_state)
    os.makedirs(wrong / "plain-mx-t-0-x")  # and a stray dump of a plain rid
    res = arch_matrix.evaluate(FakeRun(str(wrong), final_state, ref), info, cap, responses)  # type: ignore[arg-type]
    assert not res["layers"][contract.tensor_name(HF[0])]["ok"] and not res["layers_ok"]
    assert res["stray_dirs"] == ["plain-mx-t-0-x"] and not res["counts_ok"]
    text = arch_stats.table({"qwen3_moe": {"final_state": final_state, **res}, "gemma2": {"status": "x | y"}})
    assert "| qwen3_moe |" in text and "| gemma2 |" in text and "NO" in text


def test_prompts_are_fixed_per_architecture() -> None:
    a = arch_matrix.prompts_for("llama", 1000)
    assert a == arch_matrix.prompts_for("llama", 1000) != arch_matrix.prompts_for("qwen3", 1000)
    assert [len(p) for p in a] == arch_matrix.LENS and all(10 <= t < 1000 for p in a for t in p)


@pytest.mark.timeout(300)
def test_the_matrix_runs_end_to_end_with_the_reference_engine_in_place_of_sglang(tmp_path: Path) -> None:
    """``arch_matrix.py --dry-run-cpu``: the device script's whole flow (model, server, mixed traffic,
    references, evaluation, table) with the reference engine serving a tiny Llama at ``--final-state pre``."""
    import json
    import subprocess
    import time

    from tests.fixtures.ports import reserved_port

    out = tmp_path / "out"
    out.mkdir()
    script = Path(arch_matrix.__file__)
    with reserved_port() as port:  # one architecture: its server serves on the base port itself
        proc = subprocess.run(
            [
                sys.executable,
                str(script),
                "--out",
                str(out),
                "--deadline",
                str(time.time() + 240),
                "--archs",
                "llama",
                "--work",
                str(tmp_path / "work"),
                "--dump-root",
                str(tmp_path / "dumps"),
                "--base-port",
                str(port),
                "--dry-run-cpu",
            ],
            capture_output=True,
            text=True,
            timeout=280,
        )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    res = json.loads((out / "matrix.json").read_text())["llama"]
    assert res["status"] == "done", res
    assert res["counts_ok"] and res["layers_ok"] and res["health"] == [200, 200]
    assert sorted(res["layers"]) == sorted(dump_tensor_names(HF, "pre"))
    assert "| llama | pre | final_pre_norm |" in (out / "table.md").read_text()
