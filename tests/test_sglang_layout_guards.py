"""Parallel layouts at launch: which the launcher refuses (with the real reason), what it records in
/hsx/info, and how it splits the host's budgets among the DP leaders that capture.

One table of launches drives two levels of test, as in tests/test_sglang_guards.py:

* always: the launcher's own path (``launcher.resolve_server_args`` and ``launcher.build_info``) with
  SGLang's ``prepare_server_args`` replaced by :func:`stand_in_prepare`, which resolves the few arguments
  that decide the layout the way sglang 0.5.17 does (an all-to-all backend sets ``ep_size`` to ``tp_size``);
* opt-in (``HSX_SGLANG_SITE``, the site described in tests/test_sglang_guards.py): the same table through
  the real ``prepare_server_args`` of sglang 0.5.17 (``--device cpu``) on DeepSeek-V3 and Kimi-K2.5 configs.

The multi-process check of where the capture is installed, and of the rows it writes, is
tests/test_sglang_layouts.py.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from hsx import contract
from workers.engines.sglang import launcher, layouts
from workers.engines.sglang.launch_args import split_args

REPO_ROOT = Path(__file__).resolve().parents[1]
NUM_LAYERS = 6
# DeepSeek-V3's shape at 6 layers: layer 0 dense (first_k_dense_replace), 1..5 MoE.
DSV3 = {
    "model_type": "deepseek_v3",
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "n_routed_experts": 8,
}
ADDR = ["--dist-init-addr", "127.0.0.1:5000"]
DP8 = ["--tp-size", "8", "--dp-size", "8", "--enable-dp-attention"]
DP4 = ["--tp-size", "8", "--dp-size", "4", "--enable-dp-attention"]

# (name, hsx and SGLang arguments, the refusal's words or None, capturing schedulers on node 0)
CASES: list[tuple[str, list[str], str | None, int]] = [
    ("tp8", ["--tp-size", "8"], None, 1),
    ("tp8-ep8", ["--tp-size", "8", "--ep-size", "8"], None, 1),
    ("tp4-dp2-replicas", ["--tp-size", "4", "--dp-size", "2"], None, 2),
    ("tp8-dp8-dpattn", DP8, None, 8),
    ("kimi: tp8-dp8-dpattn-deepep", [*DP8, "--moe-a2a-backend", "deepep"], None, 8),
    ("tp8-dp8-dpattn-densetp1", [*DP8, "--moe-dense-tp-size", "1", "--aux-layers", "0,2,3"], None, 8),
    ("tp8-dp4-dpattn", DP4, None, 4),
    ("tp8-dp4-dpattn-densetp1-sparse", [*DP4, "--moe-dense-tp-size", "1", "--aux-layers", "1,2,3"], None, 4),
    (
        "tp8-dp4-dpattn-densetp1-dense-aux",
        [*DP4, "--moe-dense-tp-size", "1", "--aux-layers", "0,2,3"],
        "aux layers [0] are dense layers",
        4,
    ),
    (
        "tp8-dp4-dpattn-deepep",
        [*DP4, "--moe-a2a-backend", "deepep"],
        "'deepep' (--moe-a2a-backend) with attention TP 2",
        4,
    ),
    ("tp8-deepep", ["--tp-size", "8", "--moe-a2a-backend", "deepep"], "with attention TP 8", 1),
    ("tp8-mori", ["--tp-size", "8", "--moe-a2a-backend", "mori"], "with attention TP 8", 1),
    ("tp4-pp2", ["--tp-size", "4", "--pp-size", "2"], "the decoder layers live on different stages", 1),
    ("tp8-2nodes", ["--tp-size", "8", "--nnodes", "2", "--node-rank", "0", *ADDR], None, 1),
    (
        "tp8-dp8-dpattn-2nodes",
        [*DP8, "--nnodes", "2", "--node-rank", "0", *ADDR],
        "DP attention over 2 nodes",
        4,
    ),
    (
        "tp8-dp8-dpattn-2nodes-shared",
        [*DP8, "--nnodes", "2", "--node-rank", "0", *ADDR, "--shared-dump-dir"],
        None,
        4,
    ),
]


def stand_in_prepare(argv: list[str]) -> Any:
    """``prepare_server_args`` reduced to the arguments that decide the layout (sglang 0.5.17)."""

    def value(flag: str, default: str | None) -> str | None:
        for i, a in enumerate(argv):
            if a == flag:
                return argv[i + 1]
        return default

    tp = int(value("--tp-size", "1") or 1)
    a2a = value("--moe-a2a-backend", "none")
    dense = value("--moe-dense-tp-size", None)
    return SimpleNamespace(
        model_path=value("--model-path", "/m"),
        tp_size=tp,
        dp_size=int(value("--dp-size", "1") or 1),
        enable_dp_attention="--enable-dp-attention" in argv,
        # SGLang's all-to-all backends spread the experts over every rank
        ep_size=tp if a2a != "none" else int(value("--ep-size", "1") or 1),
        moe_a2a_backend=a2a,
        moe_dense_tp_size=None if dense is None else int(dense),
        pp_size=int(value("--pp-size", "1") or 1),
        nnodes=int(value("--nnodes", "1") or 1),
        node_rank=int(value("--node-rank", "0") or 0),
        attn_cp_size=1,
        flashinfer_allreduce_fusion_backend=None,
        disaggregation_mode="null",
        chunked_prefill_size=2048,
        attention_backend="triton",
        disable_radix_cache=True,
        get_model_config=lambda: SimpleNamespace(
            num_hidden_layers=NUM_LAYERS,
            hidden_size=64,
            dtype="torch.bfloat16",
            hf_text_config=SimpleNamespace(**DSV3),
        ),
    )


def launch(argv: list[str], dump_dir: str, prepare: Any = stand_in_prepare) -> tuple[Any, Any]:
    """The launcher's path from the command line to /hsx/info and the plugin config (refusals raise)."""
    ns, rest = split_args(["--model-path", "/m", *argv])
    server_args = launcher.resolve_server_args(ns, rest, prepare=prepare)
    return launcher.build_info(ns, server_args, dump_dir, "0.5.17")


@pytest.mark.parametrize(("name", "argv", "refusal", "leaders"), CASES, ids=[c[0] for c in CASES])
def test_layouts_are_refused_or_recorded(
    name: str, argv: list[str], refusal: str | None, leaders: int, tmp_path: Path
) -> None:
    if refusal is not None:
        with pytest.raises(launcher.LaunchRefused, match=re.escape(refusal)):
            launch(argv, str(tmp_path))
        return
    info, cfg = launch(argv, str(tmp_path))
    layout = info.parallel_layout
    assert layout is not None and layout.tp == int(argv[argv.index("--tp-size") + 1])
    assert layout.dp_attention == ("--enable-dp-attention" in argv)
    # the node's host budgets are split among its capturing schedulers
    assert cfg.pinned_mb == 2048 // leaders
    others = sum(layouts.leaders_on_node(stand_in_prepare(argv), n) for n in range(layout.nnodes))
    on_disk = others if cfg.shared_dump_dir else leaders
    assert info.max_dump_bytes == launcher.dump_limit(str(tmp_path), leaders, on_disk)
    assert (
        info.max_dump_bytes is not None
        and info.max_dump_bytes <= launcher.dump_limit(str(tmp_path)) // leaders
    )


def test_the_kimi_layout_on_record() -> None:
    args = stand_in_prepare([*DP8, "--moe-a2a-backend", "deepep"])
    assert layouts.parallel_layout(args) == contract.ParallelLayout(
        tp=8, dp=8, dp_attention=True, ep=8, moe_a2a_backend="deepep"
    )
    assert layouts.attention_tp_size(args) == 1 and layouts.layout_problems(args) == []


@pytest.mark.parametrize(
    ("argv", "leaders"),
    [
        (["--tp-size", "8"], [0]),
        (DP8, list(range(8))),
        (DP4, [0, 2, 4, 6]),
        (["--tp-size", "4", "--dp-size", "2"], [0]),  # plain replicas: each numbers its ranks from 0
    ],
)
def test_the_capture_runs_on_each_dp_groups_first_rank(argv: list[str], leaders: list[int]) -> None:
    args = stand_in_prepare(argv)
    assert [r for r in range(args.tp_size) if layouts.is_capture_leader(args, r)] == leaders
    assert not layouts.is_capture_leader(args, 0, pp_rank=1)


def test_leaders_per_node_over_two_nodes() -> None:
    dp8 = stand_in_prepare([*DP8, "--nnodes", "2"])
    assert [layouts.leaders_on_node(dp8, n) for n in (0, 1)] == [4, 4]
    tp8 = stand_in_prepare(["--tp-size", "8", "--nnodes", "2"])
    assert [layouts.leaders_on_node(tp8, n) for n in (0, 1)] == [1, 0]  # rank 0 alone writes, on node 0


@pytest.mark.parametrize(
    ("config", "dense"),
    [
        (DSV3, {0}),
        ({**DSV3, "first_k_dense_replace": 3, "moe_layer_freq": 2}, {0, 1, 2, 3, 5}),
        ({"model_type": "deepseek_v3", "first_k_dense_replace": 1, "n_routed_experts": None}, set(range(6))),
        ({"model_type": "qwen3_moe", "num_experts": 8, "mlp_only_layers": [0]}, set()),  # SGLang: all sparse
        ({"model_type": "llama"}, set(range(6))),  # no experts: a dense model
        ({"model_type": "mixtral", "num_local_experts": 8}, None),  # a MoE whose rule is not known here
    ],
)
def test_which_layers_sglang_builds_dense(config: dict[str, Any], dense: set[int] | None) -> None:
    found = layouts.dense_layer_ids(SimpleNamespace(**config), NUM_LAYERS)
    assert found == (None if dense is None else frozenset(dense))


def test_an_unknown_moe_under_dense_tp_1_is_refused_saying_why() -> None:
    args = stand_in_prepare([*DP4, "--moe-dense-tp-size", "1"])
    problems = layouts.dense_aux_problems(
        args, SimpleNamespace(model_type="mixtral", num_local_experts=8), [1], 6
    )
    assert len(problems) == 1 and "which layers of mixtral are dense is not known" in problems[0]
    assert (
        layouts.dense_aux_problems(stand_in_prepare([*DP8, "--moe-dense-tp-size", "1"]), None, [0], 6) == []
    )


REAL_LAYOUTS = r"""
import json, os, sys, tempfile
exec(open(sys.argv[3]).read())  # the sglang import prelude of tests/test_sglang_guards.py
from workers.engines.sglang import launcher
from workers.engines.sglang.launch_args import split_args

common = {"hidden_size": 64, "num_hidden_layers": 6, "num_attention_heads": 4, "num_key_value_heads": 2,
          "vocab_size": 1000, "intermediate_size": 128, "torch_dtype": "bfloat16", "kv_lora_rank": 16,
          "q_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 8,
          "num_experts_per_tok": 2, "moe_intermediate_size": 32, "n_shared_experts": 1}
dsv3 = {"model_type": "deepseek_v3", **common, **json.loads(sys.argv[4])}
configs = {"DeepseekV3ForCausalLM": {"architectures": ["DeepseekV3ForCausalLM"], **dsv3},
           "KimiK25ForConditionalGeneration": {"architectures": ["KimiK25ForConditionalGeneration"],
                                               "model_type": "kimi_k25", "text_config": dsv3}}
out = {"version": sglang.__version__, "results": {}}
for arch, cfg in configs.items():
    d = os.path.join(sys.argv[1], arch)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "config.json"), "w") as fh:
        json.dump(cfg, fh)
    for name, argv in json.loads(sys.argv[2]):
        res = {}
        try:
            ns, rest = split_args(["--model-path", d, "--device", "cpu", *argv])
            server_args = launcher.resolve_server_args(ns, rest)
            info, cfg_ = launcher.build_info(ns, server_args, tempfile.mkdtemp(), sglang.__version__)
            res = {"refused": None, "layout": info.extra["parallel_layout"], "pinned_mb": cfg_.pinned_mb}
        except launcher.LaunchRefused as exc:
            res = {"refused": str(exc)}
        except BaseException as exc:
            res = {"error": repr(exc)[:400]}
        out["results"][f"{arch}/{name}"] = res
print("RESULT " + json.dumps(out))
"""


@pytest.mark.skipif(
    not os.environ.get("HSX_SGLANG_SITE"),
    reason="HSX_SGLANG_SITE (sglang 0.5.17 site dirs, os.pathsep-separated) unset",
)
@pytest.mark.timeout(600)
def test_real_sglang_layouts(tmp_path: Path) -> None:
    from tests.test_sglang_guards import REAL_CHECK

    prelude = tmp_path / "prelude.py"  # the site, the torchvision stub, transformers' config registry
    prelude.write_text(REAL_CHECK.split("from sglang.srt.server_args import prepare_server_args")[0])
    cases = [(name, argv) for name, argv, _, _ in CASES]
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            REAL_LAYOUTS,
            str(tmp_path),
            json.dumps(cases),
            str(prelude),
            json.dumps(DSV3),
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=580,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, proc.stderr[-3000:]
    out = json.loads(lines[-1][len("RESULT ") :])
    assert out["version"].startswith("0.5.17"), out
    for arch in ("DeepseekV3ForCausalLM", "KimiK25ForConditionalGeneration"):
        for name, _argv, refusal, leaders in CASES:
            res = out["results"][f"{arch}/{name}"]
            assert "error" not in res, (arch, name, res)
            if refusal is None:
                assert res["refused"] is None and res["pinned_mb"] == 2048 // leaders, (arch, name, res)
            else:
                assert res["refused"] and refusal in res["refused"], (arch, name, res)
