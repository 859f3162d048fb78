"""Configurations the SGLang capture cannot follow, and above all the deferred all-reduce at tp > 1.

SGLang 0.5.17 turns FlashInfer's all-reduce fusion on by itself for the architectures in
``guards.ALLREDUCE_FUSION_ARCHS`` at tp > 1 on SM90/SM100 (``_flashinfer_allreduce_fusion_auto_enable``
in ``sglang/srt/arg_groups/overrides.py``); a later pass (``_enforce_disable_allreduce_fusion``) clears
it again when ``--enforce-disable-flashinfer-allreduce-fusion`` is given. The launcher adds that flag and
refuses final server arguments with the fusion still on.

Two levels of test:

* always: the launcher's path (``launcher.resolve_server_args``) with ``prepare_server_args`` replaced by
  :func:`sglang_0517_prepare`, a transcription of those two passes keyed on SGLang's own flag name and
  architecture list (written out here, so a wrong constant in hsx fails instead of agreeing with
  itself). The real function cannot run in CI: importing ``sglang.srt.server_args`` pulls in
  ``triton`` (about 1 GB, GPU only) and ``torchvision`` built for the same torch, and
  ``prepare_server_args`` wants an accelerator (or ``--device cpu``) and an SM90 GPU for the pass to
  fire at all.
* opt-in (``HSX_SGLANG_SITE``): the same launcher path against the real ``prepare_server_args`` of an
  installed sglang 0.5.17, in a subprocess, with SGLang's SM90 probe patched to say yes and
  ``--device cpu``. Build the site once (about 1.2 GB, mostly triton)::

      pip install --no-deps --target /tmp/sglang-site sglang==0.5.17 triton orjson pybase64 pillow \\
          ipython traitlets aiohttp multidict attrs yarl propcache aiosignal frozenlist aiohappyeyeballs \\
          msgspec pyzmq dill openai sniffio partial-json-parser xgrammar apache-tvm-ffi==0.1.11 \\
          sentencepiece einops compressed-tensors loguru
      HSX_SGLANG_SITE=/tmp/sglang-site pytest tests/test_sglang_guards.py -k real

  (torchvision is replaced by an import stub there when the installed one does not load.)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from workers.engines.sglang import launcher
from workers.engines.sglang.guards import (
    ALLREDUCE_FUSION_ARCHS,
    DISABLE_FUSION_FLAG,
    NEEDS_ALLREDUCE_TAG,
    argv_problems,
    deferred_reduction_problems,
    pending_reduction,
    unsupported_config,
)
from workers.engines.sglang.launch_args import split_args

REPO_ROOT = Path(__file__).resolve().parents[1]

# Written out from sglang 0.5.17's wheel, not imported from hsx: the stand-in below must behave as SGLang
# does even when hsx's own constants are wrong. ``_FLASHINFER_ALLREDUCE_FUSION_ARCHS`` in
# ``sglang/srt/arg_groups/overrides.py``, and the CLI flag of the ``ServerArgs`` field
# ``enforce_disable_flashinfer_allreduce_fusion`` (``arg_utils`` turns ``_`` into ``-``).
SGLANG_0517_FUSION_ARCHS = frozenset(
    {
        "DeepseekV3ForCausalLM",
        "DeepseekV32ForCausalLM",
        "GptOssForCausalLM",
        "GlmMoeDsaForCausalLM",
        "Glm4MoeForCausalLM",
        "Glm4MoeLiteForCausalLM",
        "MistralLarge3ForCausalLM",
        "Qwen3MoeForCausalLM",
        "Qwen3VLMoeForConditionalGeneration",
        "Qwen3NextForCausalLM",
        "KimiK25ForConditionalGeneration",
        "Qwen3_5MoeForConditionalGeneration",
        "InternS2PreviewForConditionalGeneration",
        "Qwen3_5ForConditionalGeneration",
        "NemotronHForCausalLM",
        "NemotronHPuzzleForCausalLM",
    }
)
SGLANG_0517_ENFORCE_DISABLE_FLAG = "--enforce-disable-flashinfer-allreduce-fusion"
AFFECTED = sorted(SGLANG_0517_FUSION_ARCHS)


def sglang_0517_prepare(
    arch: str, sm90: bool = True, enforce_works: bool = True, sm100: bool = False
) -> Callable[[list[str]], Any]:
    """``prepare_server_args`` reduced to what decides the all-reduce fusion in sglang 0.5.17."""

    def prepare(argv: list[str]) -> Any:
        def value(flag: str, default: str) -> str:
            for i, a in enumerate(argv):
                if a == flag:
                    return argv[i + 1]
                if a.startswith(flag + "="):
                    return a.split("=", 1)[1]
            return default

        view = SimpleNamespace(
            architecture=arch,
            tp_size=int(value("--tp-size", "1")),
            nnodes=int(value("--nnodes", "1")),
            enable_dp_attention="--enable-dp-attention" in argv,
            moe_a2a_backend=value("--moe-a2a-backend", "none"),
            flashinfer_allreduce_fusion_backend=None,
            enforce_disable_flashinfer_allreduce_fusion=SGLANG_0517_ENFORCE_DISABLE_FLAG in argv,
            argv=list(argv),
        )
        # _flashinfer_allreduce_fusion_auto_enable
        if (
            view.flashinfer_allreduce_fusion_backend is None
            and arch in SGLANG_0517_FUSION_ARCHS
            and (sm90 or sm100)
            and view.tp_size > 1
            and not view.enable_dp_attention
            and (view.nnodes == 1 or sm100)  # on Blackwell across nodes too
            and view.moe_a2a_backend == "none"
        ):
            view.flashinfer_allreduce_fusion_backend = "auto"
        # _enforce_disable_allreduce_fusion
        if view.enforce_disable_flashinfer_allreduce_fusion and enforce_works:
            view.flashinfer_allreduce_fusion_backend = None
        return view

    return prepare


@pytest.mark.parametrize("arch", AFFECTED)
def test_the_launcher_turns_the_deferred_all_reduce_off_at_tp_2(arch: str) -> None:
    ns, rest = split_args(["--model-path", "/m", "--tp-size", "2"])
    # Without the launcher's flag this SGLang would defer the MLP all-reduce past the capture point ...
    bare = sglang_0517_prepare(arch)(["--tp-size", "2"])
    assert bare.flashinfer_allreduce_fusion_backend == "auto" and deferred_reduction_problems(bare)
    # ... the launcher's final server arguments have it off, and pass the guard.
    final = launcher.resolve_server_args(ns, rest, prepare=sglang_0517_prepare(arch))
    assert final.tp_size == 2 and final.flashinfer_allreduce_fusion_backend is None


def test_the_launcher_turns_the_fusion_off_across_nodes_on_blackwell() -> None:
    # What a plain SGLang node 1 would run with: the fusion on by itself (nnodes > 1 on SM100); every node
    # runs the launcher (peers.py checks it), whose final arguments have it off on each node.
    argv = ["--tp-size", "8", "--nnodes", "2", "--node-rank", "1"]
    prepare = sglang_0517_prepare("KimiK25ForConditionalGeneration", sm90=False, sm100=True)
    assert prepare(argv).flashinfer_allreduce_fusion_backend == "auto"
    ns, rest = split_args(["--model-path", "/m", *argv])
    assert launcher.resolve_server_args(ns, rest, prepare=prepare).flashinfer_allreduce_fusion_backend is None
    hopper = sglang_0517_prepare("KimiK25ForConditionalGeneration")  # SM90: one node only
    assert hopper(argv).flashinfer_allreduce_fusion_backend is None


@pytest.mark.parametrize("arch", AFFECTED)
def test_a_fusion_left_on_is_refused_at_tp_2(arch: str) -> None:
    # An SGLang whose switch no longer clears the backend: the launch is refused, never run wrong.
    ns, rest = split_args(["--model-path", "/m", "--tp-size", "2"])
    with pytest.raises(launcher.LaunchRefused, match=DISABLE_FUSION_FLAG):
        launcher.resolve_server_args(ns, rest, prepare=sglang_0517_prepare(arch, enforce_works=False))


@pytest.mark.parametrize(("arch", "tp"), [("LlamaForCausalLM", "2"), ("DeepseekV3ForCausalLM", "1")])
def test_layouts_without_the_fusion_launch_even_when_the_switch_is_broken(arch: str, tp: str) -> None:
    # An architecture SGLang never fuses, or tp 1: nothing to clear, so the launch goes ahead even on an
    # SGLang whose switch does not work, and the launcher still passes the switch it relies on at tp > 1.
    ns, rest = split_args(["--model-path", "/m", "--tp-size", tp])
    final = launcher.resolve_server_args(ns, rest, prepare=sglang_0517_prepare(arch, enforce_works=False))
    assert final.tp_size == int(tp) and final.flashinfer_allreduce_fusion_backend is None
    assert SGLANG_0517_ENFORCE_DISABLE_FLAG in final.argv and deferred_reduction_problems(final) == []


def test_hsx_names_sglangs_own_flag_and_architectures() -> None:
    # The launcher passes DISABLE_FUSION_FLAG and the docs quote ALLREDUCE_FUSION_ARCHS: a misspelling or
    # a stale list would make SGLang ignore the switch (the stand-in above then refuses every launch).
    assert DISABLE_FUSION_FLAG == SGLANG_0517_ENFORCE_DISABLE_FLAG
    assert ALLREDUCE_FUSION_ARCHS == SGLANG_0517_FUSION_ARCHS


def test_the_affected_architectures_include_the_ones_hsx_serves() -> None:
    for arch in (
        "DeepseekV3ForCausalLM",
        "KimiK25ForConditionalGeneration",
        "Qwen3MoeForCausalLM",
        "GptOssForCausalLM",
        "Glm4MoeForCausalLM",
        "Glm4MoeLiteForCausalLM",
        "GlmMoeDsaForCausalLM",
    ):
        assert arch in ALLREDUCE_FUSION_ARCHS


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        ({"flashinfer_allreduce_fusion_backend": "trtllm", "tp_size": 4}, "FlashInfer all-reduce fusion"),
        ({"enable_aiter_allreduce_fusion": True}, "aiter"),
        ({"enable_attn_tp_input_scattered": True}, "input-scattered"),
        ({"pp_size": 2}, "decoder layers live on different stages"),
        ({"tp_size": 8, "moe_a2a_backend": "deepep"}, "attention TP 8"),
        ({"tp_size": 8, "dp_size": 8, "enable_dp_attention": True, "nnodes": 2}, "DP attention over 2 nodes"),
        ({"attn_cp_size": 2}, "context parallelism"),
        ({"enable_prefill_context_parallel": True}, "context parallelism"),
        ({"speculative_algorithm": "EAGLE3"}, "speculative"),
        ({"enable_two_batch_overlap": True}, "overlap"),
        ({"enable_torch_compile": True}, "torch-compile"),
        ({"disaggregation_mode": "prefill"}, "disaggregation"),
        ({"is_embedding": True}, "embedding"),
        ({"cuda_graph_config": SimpleNamespace(prefill=SimpleNamespace(backend="breakable"))}, "CUDA graph"),
    ],
)
def test_unsupported_configurations_are_named(flags: dict[str, Any], needle: str) -> None:
    problems = unsupported_config(SimpleNamespace(**flags))
    assert len(problems) == 1 and needle in problems[0]


def test_a_plain_configuration_passes() -> None:
    args = SimpleNamespace(
        tp_size=8,
        pp_size=1,
        disaggregation_mode="null",
        cuda_graph_config=SimpleNamespace(prefill=SimpleNamespace(backend="disabled")),
        flashinfer_allreduce_fusion_backend=None,
    )
    assert unsupported_config(args) == []


def test_deferring_flags_on_the_command_line_are_named() -> None:
    assert argv_problems(["--tp-size", "8", DISABLE_FUSION_FLAG]) == []
    problems = argv_problems(
        ["--enable-aiter-allreduce-fusion", "--flashinfer-allreduce-fusion-backend", "auto"]
    )
    assert len(problems) == 2


def test_the_tag_of_a_pending_all_reduce_is_recognised() -> None:
    import torch

    t = torch.zeros(2, 2)
    assert not pending_reduction(t)
    setattr(t, NEEDS_ALLREDUCE_TAG, True)
    assert pending_reduction(t)
    setattr(t, NEEDS_ALLREDUCE_TAG, False)  # qwen2_moe clears it once the reduction ran
    assert not pending_reduction(t)


REAL_CHECK = r"""
import importlib, json, os, sys, types
sys.path[:0] = os.environ["HSX_SGLANG_SITE"].split(os.pathsep)
try:
    import torchvision  # noqa: F401
except Exception:
    # torchvision's C ops must match torch's build; SGLang only needs the names to import here.
    from importlib import abc, machinery
    from unittest import mock
    import transformers.image_utils, transformers.processing_utils  # noqa: F401  (before the stub)
    for name in [m for m in sys.modules if m.split(".")[0] == "torchvision"]:
        del sys.modules[name]

    class Stub(types.ModuleType):
        def __getattr__(self, name):
            if name.startswith("__"):
                raise AttributeError(name)
            return mock.MagicMock(name=name)

    class Finder(abc.MetaPathFinder, abc.Loader):
        def find_spec(self, name, path, target=None):
            if name.split(".")[0] != "torchvision":
                return None
            return machinery.ModuleSpec(name, self, is_package=True)
        def create_module(self, spec):
            m = Stub(spec.name); m.__path__ = []; return m
        def exec_module(self, module):
            pass

    sys.meta_path.insert(0, Finder())
from transformers.models.auto import configuration_auto as ca
orig = ca._LazyConfigMapping.register
ca._LazyConfigMapping.register = lambda self, k, v, exist_ok=False: orig(self, k, v, exist_ok=True)

import sglang
import sglang.srt.arg_groups.overrides as ov
ov.is_sm90_supported = lambda *a, **k: True  # the pass fires on SM90/SM100 only
from sglang.srt.server_args import prepare_server_args
from workers.engines.sglang import guards, launcher
from workers.engines.sglang.launch_args import split_args

out = {"version": sglang.__version__,
       "archs_match": sorted(ov._FLASHINFER_ALLREDUCE_FUSION_ARCHS) == sorted(guards.ALLREDUCE_FUSION_ARCHS),
       "results": {}}
common = {"hidden_size": 64, "num_hidden_layers": 6, "num_attention_heads": 4, "num_key_value_heads": 2,
          "vocab_size": 1000, "intermediate_size": 128, "torch_dtype": "bfloat16"}
for arch, model_type in json.loads(sys.argv[2]):
    d = os.path.join(sys.argv[1], arch)
    os.makedirs(d, exist_ok=True)
    cfg = {"architectures": [arch], "model_type": model_type}
    if model_type == "kimi_k25":
        cfg["text_config"] = {"model_type": "deepseek_v3", **common}
    else:
        cfg.update(common)
    with open(os.path.join(d, "config.json"), "w") as fh:
        json.dump(cfg, fh)
    base = ["--model-path", d, "--tp-size", "2", "--device", "cpu"]
    res = {}
    try:
        bare = prepare_server_args(base + ["--skip-tokenizer-init"])
        res["bare"] = bare.flashinfer_allreduce_fusion_backend
        ns, rest = split_args(base)
        try:
            final = launcher.resolve_server_args(ns, rest)
            res["launcher"] = final.flashinfer_allreduce_fusion_backend
            res["refused"] = None
        except launcher.LaunchRefused as exc:
            res["refused"] = str(exc)
    except Exception as exc:
        res["error"] = repr(exc)[:300]
    out["results"][arch] = res
print("RESULT " + json.dumps(out))
"""

REAL_ARCHS = [
    ("DeepseekV3ForCausalLM", "deepseek_v3"),
    ("KimiK25ForConditionalGeneration", "kimi_k25"),
    ("Qwen3MoeForCausalLM", "qwen3_moe"),
    ("GptOssForCausalLM", "gpt_oss"),
    ("Glm4MoeForCausalLM", "glm4_moe"),
    ("Glm4MoeLiteForCausalLM", "glm4_moe_lite"),
    ("LlamaForCausalLM", "llama"),
]


@pytest.mark.skipif(
    not os.environ.get("HSX_SGLANG_SITE"),
    reason="HSX_SGLANG_SITE (sglang 0.5.17 site dirs, os.pathsep-separated) unset",
)
@pytest.mark.timeout(600)
def test_real_sglang_final_server_arguments_at_tp_2(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", REAL_CHECK, str(tmp_path), json.dumps(REAL_ARCHS)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=580,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, proc.stderr[-3000:]
    out = json.loads(lines[-1][len("RESULT ") :])
    assert out["version"].startswith("0.5.17") and out["archs_match"], out
    for arch, _ in REAL_ARCHS:
        res = out["results"][arch]
        assert "error" not in res, (arch, res)
        expected_bare = None if arch == "LlamaForCausalLM" else "auto"
        assert res["bare"] == expected_bare, (arch, res)  # what SGLang does on its own
        assert res["refused"] is None and res["launcher"] is None, (arch, res)  # what the launcher runs
