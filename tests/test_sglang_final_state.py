"""``--final-state post|pre|both`` on the reference engine (the CPU stand-in for the SGLang plugin).

The pre-norm final state is the last decoder layer's output, the final norm's input. It is checked two
independent ways on a small random Llama: it equals what a forward hook on the last decoder layer sees,
and the model's own final norm turns it into the post-norm state ``hidden.<N>`` of the same dump.
"""

from __future__ import annotations

import itertools
import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from hsx import contract
from workers.engines.reference.cli import build_parser
from workers.engines.reference.engine import EngineConfig, ReferenceEngine
from workers.engines.sglang.config import dump_tensor_names

LAYERS, HIDDEN = 6, 32
_rids = itertools.count()


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny-llama")
    torch.manual_seed(3)
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=HIDDEN,
        intermediate_size=64,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    LlamaForCausalLM(config).save_pretrained(path)
    return path


def engine(model_dir: Path, tmp_path: Path, final_state: str, prefix_cache: bool = False) -> ReferenceEngine:
    return ReferenceEngine(
        EngineConfig(
            model_dir=model_dir,
            dump_dir=str(tmp_path / f"dumps-{final_state}"),
            aux_layer_ids=[1, 2, 3],
            dtype="float32",
            prefix_cache=prefix_cache,
            device="cpu",
            final_state=final_state,
        )
    )


def run(eng: ReferenceEngine, ids: list[int]) -> tuple[contract.DumpMeta, dict[str, torch.Tensor]]:
    rid = f"{contract.RID_PREFIX}fs-{next(_rids)}"
    eng.prefill(ids, rid)
    directory = contract.dump_path(eng.config.dump_dir, rid)
    with open(os.path.join(directory, contract.META_FILE)) as fh:
        meta = contract.DumpMeta.from_json(fh.read())
    raw = contract.read_safetensors(os.path.join(directory, contract.STATES_FILE))
    tensors = {
        name: torch.frombuffer(
            bytearray(t.data), dtype=torch.int32 if t.dtype == "I32" else torch.float32
        ).view(*t.shape)
        for name, t in raw.items()
    }
    return meta, tensors


def last_layer_output(eng: ReferenceEngine, ids: list[int]) -> torch.Tensor:
    seen: list[torch.Tensor] = []

    def keep(_module: Any, _args: Any, out: Any) -> None:
        seen.append(out[0] if isinstance(out, tuple) else out)

    handle = eng.model.model.layers[-1].register_forward_hook(keep)
    try:
        with torch.inference_mode():
            eng.model(input_ids=torch.tensor([ids]), use_cache=False)
    finally:
        handle.remove()
    return seen[0][0]


IDS = [5, 17, 99, 3, 42, 64, 8, 120, 11]


@pytest.mark.parametrize("final_state", contract.FINAL_STATES)
def test_the_dump_holds_the_asked_final_states(tiny_llama: Path, tmp_path: Path, final_state: str) -> None:
    eng = engine(tiny_llama, tmp_path, final_state)
    info = eng.info()
    assert info.final_state == final_state and info.hf_indices == [2, 3, 4, LAYERS]
    meta, tensors = run(eng, IDS)
    names = dump_tensor_names(info.hf_indices, final_state)
    assert sorted(tensors) == sorted(["input_ids", *names])
    assert (contract.tensor_name(LAYERS) in tensors) == (final_state != "pre")
    assert (contract.PRE_NORM_TENSOR in tensors) == (final_state != "post")
    assert meta.hf_indices == [2, 3, 4, LAYERS] and meta.extra["final_state"] == final_state
    assert meta.non_finite == dict.fromkeys(names, 0)
    for name in names:
        assert tensors[name].shape == (len(IDS), HIDDEN)


def test_the_pre_norm_state_is_the_last_layers_output_and_norms_into_the_final_state(
    tiny_llama: Path, tmp_path: Path
) -> None:
    eng = engine(tiny_llama, tmp_path, "both")
    _, tensors = run(eng, IDS)
    pre, post = tensors[contract.PRE_NORM_TENSOR], tensors[contract.tensor_name(LAYERS)]
    assert torch.allclose(pre, last_layer_output(eng, IDS), atol=1e-5)
    with torch.inference_mode():
        normed = eng.model.model.norm(pre)
    assert torch.allclose(normed, post, atol=1e-5)
    # and it is not the post-norm state itself, nor the previous layer's output
    assert not torch.allclose(pre, post, atol=1e-2)
    assert not torch.allclose(pre, tensors[contract.tensor_name(LAYERS - 2)], atol=1e-2)


def test_pre_only_matches_both(tiny_llama: Path, tmp_path: Path) -> None:
    _, both = run(engine(tiny_llama, tmp_path, "both"), IDS)
    _, pre = run(engine(tiny_llama, tmp_path, "pre"), IDS)
    assert torch.equal(pre[contract.PRE_NORM_TENSOR], both[contract.PRE_NORM_TENSOR])


def test_a_prefix_cache_hit_captures_only_the_computed_rows_of_the_pre_norm_state(
    tiny_llama: Path, tmp_path: Path
) -> None:
    eng = engine(tiny_llama, tmp_path, "pre", prefix_cache=True)
    run(eng, IDS)
    meta, tensors = run(eng, IDS[:6] + [7, 7])
    assert meta.cached_tokens == 6 and meta.num_tokens == 2
    assert tensors[contract.PRE_NORM_TENSOR].shape == (2, HIDDEN)
    expected = last_layer_output(eng, IDS[:6] + [7, 7])[6:]
    assert torch.allclose(tensors[contract.PRE_NORM_TENSOR], expected, atol=1e-4)


def test_non_finite_values_are_counted_per_tensor(tiny_llama: Path, tmp_path: Path) -> None:
    eng = engine(tiny_llama, tmp_path, "both")
    with torch.no_grad():
        eng.model.model.embed_tokens.weight[99] = float("nan")
    meta, tensors = run(eng, IDS)  # IDS[2] == 99: that row, and every later one through attention
    assert meta.non_finite is not None
    for name, count in meta.non_finite.items():
        assert count == int(torch.isnan(tensors[name]).sum()) > 0
    info = json.loads(meta.to_json())
    assert set(info["non_finite"]) == set(dump_tensor_names([2, 3, 4, LAYERS], "both"))


def test_a_bad_final_state_is_refused(tiny_llama: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="final_state"):
        engine(tiny_llama, tmp_path, "middle")
    assert build_parser().parse_args(["--final-state", "pre"]).final_state == "pre"
    assert build_parser().parse_args([]).final_state == "post"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--final-state", "middle"])


def test_dump_tensor_names() -> None:
    assert dump_tensor_names([2, 5, 9], "post") == ["hidden.2", "hidden.5", "hidden.9"]
    assert dump_tensor_names([2, 5, 9], "pre") == ["hidden.2", "hidden.5", contract.PRE_NORM_TENSOR]
    assert dump_tensor_names([2, 5, 9], "both") == [
        "hidden.2",
        "hidden.5",
        "hidden.9",
        contract.PRE_NORM_TENSOR,
    ]
