"""The SGLang launcher's argument handling, version range, /hsx/info, and the plugin's config hand-over."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from hsx import contract
from hsx.engine import regenerate_contract as engine_contract
from workers.engines.sglang import launcher
from workers.engines.sglang.config import (
    ENV_FINAL_STATE,
    ENV_SWITCH_INTERVAL_MS,
    ENV_WRITERS,
    SUPPORTED_RANGE,
    VERSION_OVERRIDE_FLAG,
    PluginConfig,
    parse_release,
    version_problem,
)
from workers.engines.sglang.guards import DISABLE_FUSION_FLAG, argv_problems
from workers.engines.sglang.launch_args import engine_extra, launch_problems, sglang_argv, split_args


def test_hsx_flags_are_taken_out_and_the_rest_goes_to_sglang() -> None:
    ns, rest = split_args(
        [
            "--model-path",
            "/m",
            "--final-state",
            "both",
            "--aux-layers",
            "1,3",
            "--tp-size",
            "2",
            "--dump-dir=/d",
        ]
    )
    assert (ns.final_state, ns.aux_layers, ns.dump_dir) == ("both", "1,3", "/d")
    assert rest == ["--model-path", "/m", "--tp-size", "2"]
    assert split_args([])[0].final_state == "post" and not split_args([])[0].allow_unsupported_sglang_version


@pytest.mark.parametrize(
    "bad",
    [
        ["--final-state", "last"],
        ["--pinned-mb", "0"],
        ["--writer-threads", "0"],
        ["--switch-interval-ms", "-1"],
        ["--switch-interval-ms", "500"],
    ],
)
def test_bad_hsx_flags_are_refused(bad: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises((SystemExit, ValueError)):
        split_args(bad)


def test_writer_flags_default_to_the_deployments_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    # The flags used to default to 4 writers whatever HSX_SGLANG_WRITER_THREADS said.
    monkeypatch.delenv(ENV_WRITERS, raising=False)
    monkeypatch.delenv(ENV_SWITCH_INTERVAL_MS, raising=False)
    ns, _ = split_args([])
    assert (ns.writer_threads, ns.switch_interval_ms) == (8, 0.5)
    monkeypatch.setenv(ENV_WRITERS, "12")
    monkeypatch.setenv(ENV_SWITCH_INTERVAL_MS, "0")
    ns, _ = split_args([])
    assert (ns.writer_threads, ns.switch_interval_ms) == (12, 0.0)
    assert split_args(["--writer-threads", "3"])[0].writer_threads == 3
    monkeypatch.setenv(ENV_WRITERS, "many")
    with pytest.raises(ValueError, match="HSX_SGLANG_WRITER_THREADS='many' is not a number"):
        split_args([])


def test_sglang_gets_what_the_capture_needs() -> None:
    ns, rest = split_args(["--model-path", "/m", "--tp-size", "2"])
    argv = sglang_argv(ns, rest)
    assert argv[:2] == ["--cuda-graph-backend-prefill", "disabled"]
    assert "--skip-tokenizer-init" in argv and DISABLE_FUSION_FLAG in argv
    ns, rest = split_args(["--with-tokenizer", "--cuda-graph-backend-prefill=disabled", DISABLE_FUSION_FLAG])
    argv = sglang_argv(ns, rest)
    assert "--skip-tokenizer-init" not in argv and argv.count(DISABLE_FUSION_FLAG) == 1
    assert argv.count("--cuda-graph-backend-prefill=disabled") == 1 and "disabled" not in argv


@pytest.mark.parametrize(
    ("version", "inside"),
    [
        ("0.5.17", True),
        ("0.5.17.post1", True),
        ("0.5.17.post2+cu130", True),
        ("0.5.17rc1", False),
        ("0.5.17.dev3+g1234", False),
        ("0.5.16", False),
        ("0.5.18", False),
        ("0.6.0", False),
        ("main", False),
        (None, False),
    ],
)
def test_the_supported_version_range(version: str | None, inside: bool) -> None:
    problem = version_problem(version)
    assert (problem is None) == inside
    if problem is not None:
        assert SUPPORTED_RANGE in problem


def test_parse_release() -> None:
    assert parse_release("0.5.17") == ((0, 5, 17), True)
    assert parse_release("v1.2.3.4rc1") == ((1, 2, 3, 4), False)
    assert parse_release("latest") is None


def test_a_version_outside_the_range_is_refused_unless_overridden(capsys: pytest.CaptureFixture[str]) -> None:
    ns, _ = split_args([])
    with pytest.raises(launcher.LaunchRefused, match=f"sglang{SUPPORTED_RANGE}.*{VERSION_OVERRIDE_FLAG}"):
        launcher.check_version(ns, "0.5.18")
    ns, _ = split_args([VERSION_OVERRIDE_FLAG])
    launcher.check_version(ns, "0.5.18")
    assert "running anyway" in capsys.readouterr().err
    launcher.check_version(split_args([])[0], "0.5.17")


def test_main_refuses_an_unsupported_sglang_before_importing_it(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(launcher, "installed_sglang_version", lambda: "0.5.9")
    assert launcher.main(["--model-path", "/nowhere"]) == 2
    err = capsys.readouterr().err
    assert "SGLang 0.5.9" in err and SUPPORTED_RANGE in err


class FakeModelConfig:
    num_hidden_layers = 12
    hidden_size = 64
    dtype = "torch.bfloat16"


def fake_server_args(**over: Any) -> Any:
    values = dict(
        model_path="/m",
        tp_size=2,
        chunked_prefill_size=2048,
        attention_backend="triton",
        flashinfer_allreduce_fusion_backend=None,
        disable_radix_cache=True,
        get_model_config=FakeModelConfig,
    )
    values.update(over)
    return SimpleNamespace(**values)


@pytest.mark.parametrize("final_state", contract.FINAL_STATES)
def test_hsx_info_records_the_final_state_and_the_engine_facts(final_state: str) -> None:
    ns, _ = split_args(["--final-state", final_state, "--aux-layers", "1,5,8"])
    info, cfg = launcher.build_info(ns, fake_server_args(), "/dumps", "0.5.17")
    raw = info.to_dict()
    assert raw["final_state"] == final_state == cfg.final_state
    assert raw["hf_indices"] == [2, 6, 9, 12] and raw["prefix_cache"] is False and raw["dtype"] == "bfloat16"
    assert raw["extra"] == {
        "engine_version": "0.5.17",
        "supported_versions": SUPPORTED_RANGE,
        "version_in_range": True,
        "tp_size": 2,
        contract.PARALLEL_LAYOUT: contract.ParallelLayout(tp=2).to_dict(),
        "chunked_prefill_size": 2048,
        "attention_backend": "triton",
        "flashinfer_allreduce_fusion_backend": None,
        "disable_radix_cache": True,
        "seeded_sampling": False,
    }
    assert contract.EngineInfo.from_dict(raw) == info


def test_deterministic_inference_is_let_through_and_makes_the_seed_count() -> None:
    """Regeneration's seed reaches SGLang's sampler only under --enable-deterministic-inference: the
    launcher passes the flag on, refuses nothing for it, and /hsx/info says the seed is honoured."""
    ns, rest = split_args(["--model-path", "/m", "--enable-deterministic-inference"])
    assert "--enable-deterministic-inference" in sglang_argv(ns, rest)
    assert argv_problems(rest) == []
    server_args = fake_server_args(enable_deterministic_inference=True)
    assert launch_problems(server_args, env={}) == []
    info, _ = launcher.build_info(ns, server_args, "/dumps", "0.5.17")
    assert info.extra[engine_contract.SEEDED_SAMPLING] is True


def test_hsx_info_says_how_long_a_prompt_and_how_large_a_dump_the_engine_takes(tmp_path: Path) -> None:
    class LongModelConfig(FakeModelConfig):
        context_len = 133120

    ns, _ = split_args([])
    args = fake_server_args(get_model_config=LongModelConfig)
    info, _ = launcher.build_info(ns, args, str(tmp_path), "0.5.17")
    # SGLang's scheduler refuses max_req_input_len = context - 1 - 5 tokens and more.
    assert info.context_length == 133120 and info.max_prompt_tokens == 133120 - 7
    memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    capacity = contract.dump_dir_capacity(str(tmp_path))
    assert capacity and info.max_dump_bytes == min(capacity, memory // 2)
    # No context length reported: nothing said of the prompt either.
    info, _ = launcher.build_info(ns, fake_server_args(), str(tmp_path), "0.5.17")
    assert info.context_length is None and info.max_prompt_tokens is None


def test_bad_aux_layers_are_refused() -> None:
    ns, _ = split_args(["--aux-layers", "1,11"])
    with pytest.raises(launcher.LaunchRefused, match="out of range"):
        launcher.build_info(ns, fake_server_args(), "/dumps", "0.5.17")
    ns, _ = split_args(["--aux-layers", "one"])
    with pytest.raises(launcher.LaunchRefused, match="integers"):
        launcher.build_info(ns, fake_server_args(), "/dumps", "0.5.17")


def test_engine_extra_stringifies_what_json_cannot_hold() -> None:
    extra = engine_extra(fake_server_args(attention_backend=SimpleNamespace(name="x")), "0.6.0")
    assert isinstance(extra["attention_backend"], str) and extra["version_in_range"] is False


def test_launch_problems_add_the_launchers_own() -> None:
    problems = launch_problems(fake_server_args(tokenizer_worker_num=2), env={"SGLANG_RUST_SERVER": "1"})
    assert any("tokenizer-worker-num" in p for p in problems) and any("RUST" in p for p in problems)
    assert launch_problems(fake_server_args(), env={}) == []


def test_the_plugin_config_travels_through_the_environment() -> None:
    cfg = PluginConfig(
        "/d",
        [1, 2],
        pinned_mb=64,
        writer_threads=3,
        switch_interval_ms=0,
        final_state="pre",
        allow_any_version=True,
        shared_dump_dir=True,
        peer_wait_seconds=12.5,
    )
    env = cfg.to_env()
    assert env[ENV_FINAL_STATE] == "pre"
    assert PluginConfig.from_env(env) == cfg
    assert PluginConfig.from_env({"HSX_SGLANG_DUMP_DIR": "/d"}) == PluginConfig("/d")
    with pytest.raises(RuntimeError, match="HSX_SGLANG_DUMP_DIR"):
        PluginConfig.from_env({})
    with pytest.raises(ValueError, match="final_state"):
        PluginConfig.from_env({**env, ENV_FINAL_STATE: "middle"})


def test_resolve_refuses_deferring_flags_before_sglang_runs() -> None:
    def never(_argv: list[str]) -> Any:
        raise AssertionError("prepare_server_args must not run")

    ns, rest = split_args(
        ["--flashinfer-allreduce-fusion-backend=trtllm", "--enable-attn-tp-input-scattered"]
    )
    with pytest.raises(launcher.LaunchRefused) as err:
        launcher.resolve_server_args(ns, rest, prepare=never)
    assert "--flashinfer-allreduce-fusion-backend" in str(err.value)
    assert "--enable-attn-tp-input-scattered" in str(err.value)
    assert isinstance(ns, argparse.Namespace)
