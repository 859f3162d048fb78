"""The synthetic engine as the worker meets it: a real server process speaking the hsx engine protocol,
leaving contract-exact dumps of known content."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from fastapi.testclient import TestClient

from hsx import contract
from hsx.cli.local_stack import hsx_command, local_stack, wait_http, wait_port_file
from hsx.engine import regenerate_contract as engine_contract
from hsx.engine.client import EngineClient
from hsx.engine.dumps import read_dump
from hsx.engine.regenerate_contract import GenerationParams, generation_rid
from hsx.safetensors_io import read_file
from tests.fixtures.dump_checks import validate_dump
from workers.engines.synthetic.engine import (
    SyntheticConfig,
    SyntheticEngine,
    expected_state,
    pattern_table,
)
from workers.engines.synthetic.server import create_app

REPO_ROOT = Path(__file__).resolve().parents[1]
HIDDEN, LAYERS = 32, 8
HF_INDICES = [2, 4, 5, 8]  # EAGLE-3 aux layers 1, 3, 4 of an 8-layer model, then the final state


@dataclass
class Server:
    url: str
    dump_dir: Path
    client: EngineClient


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    base = tmp_path_factory.mktemp("synthetic")
    dump_dir = base / "dumps"
    port_file = base / "port"
    command = hsx_command(
        "engine",
        "--backend",
        "synthetic",
        "--hidden-size",
        str(HIDDEN),
        "--num-layers",
        str(LAYERS),
        "--port",
        "0",
        "--port-file",
        str(port_file),
        "--dump-dir",
        str(dump_dir),
    )
    env = {"PYTHONPATH": str(REPO_ROOT)}
    with local_stack(base / "logs") as stack:
        process = stack.start("synthetic-engine", command, env=env)
        try:
            url = f"http://127.0.0.1:{wait_port_file(port_file, 60, process)}"
            wait_http(f"{url}/health", 60, process)
        except (RuntimeError, TimeoutError):
            print((base / "logs" / "synthetic-engine.log").read_text()[-4000:])
            raise
        with EngineClient(url, timeout=30, retries=0) as client:
            yield Server(url=url, dump_dir=dump_dir, client=client)


def test_info_describes_a_synthetic_engine(server: Server) -> None:
    raw = httpx.get(f"{server.url}{contract.INFO_PATH}", timeout=10).json()
    info = server.client.info()
    assert raw["backend"] == info.backend == "synthetic"
    assert info.final_state == "post"
    assert (info.hidden_size, info.num_layers, info.dtype) == (HIDDEN, LAYERS, "bfloat16")
    assert info.aux_layer_ids == [1, 3, 4] and info.hf_indices == HF_INDICES
    assert info.prefix_cache is False
    assert info.protocol_version == contract.PROTOCOL_VERSION
    assert info.layer_convention == contract.LAYER_CONVENTION
    assert Path(info.dump_dir) == server.dump_dir.resolve()
    for path in ("/health", "/health_generate"):
        assert httpx.get(f"{server.url}{path}", timeout=10).status_code == 200
    assert httpx.post(f"{server.url}/flush_cache", timeout=10).status_code == 200


def test_a_captured_request_leaves_a_contract_exact_dump(server: Server) -> None:
    ids = [7, 3, 0, 49151, 255, 256, 7] + list(range(1000, 1300))  # more rows than one engine write
    rid = "hsx-synthetic-test-captured"
    reply = server.client.prefill(ids, rid)
    assert reply["meta_info"]["cached_tokens"] == 0
    assert reply["meta_info"]["prompt_tokens"] == len(ids)
    assert reply["meta_info"]["id"] == rid

    dump = read_dump(str(server.dump_dir), rid, wait_seconds=5)
    validate_dump(dump, ids, reply["meta_info"]["cached_tokens"], HF_INDICES, HIDDEN)
    assert dump.input_ids.tolist() == ids
    assert sorted(dump.states) == HF_INDICES
    table = pattern_table(HIDDEN)
    for hf_index in HF_INDICES:
        assert dump.dtypes[hf_index] == "BF16"
        assert dump.states[hf_index].shape == (len(ids), HIDDEN)
        assert np.array_equal(dump.states[hf_index], expected_state(table, np.asarray(ids), hf_index))
    assert not np.array_equal(dump.states[HF_INDICES[0]], dump.states[HF_INDICES[1]])

    meta = dump.meta
    assert (meta.rid, meta.num_tokens, meta.prompt_tokens, meta.cached_tokens) == (rid, len(ids), len(ids), 0)
    assert (meta.hidden_size, meta.num_layers, meta.hf_indices, meta.engine) == (
        HIDDEN,
        LAYERS,
        HF_INDICES,
        "synthetic",
    )
    assert meta.non_finite == {contract.tensor_name(i): 0 for i in HF_INDICES}
    directory = Path(dump.path)
    assert sorted(p.name for p in directory.iterdir()) == [contract.META_FILE, contract.STATES_FILE]
    names = list(read_file(str(directory / contract.STATES_FILE)))
    assert names == ["input_ids", *(contract.tensor_name(i) for i in HF_INDICES)]


def test_a_plain_request_leaves_no_dump(server: Server) -> None:
    before = set(os.listdir(server.dump_dir))
    for rid in ("warmup-1", None, ""):
        body: dict[str, Any] = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 1}}
        if rid is not None:
            body["rid"] = rid
        reply = httpx.post(f"{server.url}/generate", json=body, timeout=10)
        assert reply.status_code == 200
        assert reply.json()["meta_info"]["cached_tokens"] == 0
        assert reply.json()["meta_info"]["prompt_tokens"] == 3
    assert set(os.listdir(server.dump_dir)) == before


@pytest.mark.parametrize(
    "body",
    [
        b"not json",
        b"[1, 2, 3]",
        b'{"rid": "hsx-x"}',
        b'{"input_ids": []}',
        b'{"input_ids": "1 2 3"}',
        b'{"input_ids": [1, -2]}',
        b'{"input_ids": [1, 2.5]}',
        b'{"input_ids": [1, "2"]}',
        b'{"input_ids": [1, 2], "rid": 7}',
    ],
)
def test_bad_bodies_get_400(server: Server, body: bytes) -> None:
    before = set(os.listdir(server.dump_dir))
    reply = httpx.post(
        f"{server.url}/generate", content=body, headers={"content-type": "application/json"}, timeout=10
    )
    assert reply.status_code == 400
    assert reply.json()["error"] == "bad_request" and reply.json()["detail"]
    assert set(os.listdir(server.dump_dir)) == before


@pytest.mark.parametrize("rid", ["hsx-../escape", "hsx-" + "x" * 300, "hsx-synthetic-test-duplicate"])
def test_a_rid_that_cannot_be_dumped_gets_a_4xx(server: Server, rid: str) -> None:
    body = {"input_ids": [1, 2], "rid": rid}
    if rid.endswith("duplicate"):
        assert httpx.post(f"{server.url}/generate", json=body, timeout=10).status_code == 200
    before = set(os.listdir(server.dump_dir))
    reply = httpx.post(f"{server.url}/generate", json=body, timeout=10)
    assert 400 <= reply.status_code < 500, reply.text
    assert set(os.listdir(server.dump_dir)) == before


@pytest.mark.parametrize("final_state", ["pre", "both"])
def test_pre_norm_state_is_dumped_on_request(tmp_path: Path, final_state: str) -> None:
    engine = SyntheticEngine(
        SyntheticConfig(
            hidden_size=HIDDEN, num_layers=LAYERS, dump_dir=str(tmp_path), final_state=final_state
        )
    )
    assert engine.info().final_state == final_state
    ids = [4, 5, 6]
    engine.prefill(ids, "hsx-pre")
    tensors = read_file(str(tmp_path / "hsx-pre" / contract.STATES_FILE))
    names = ["input_ids", *(contract.tensor_name(i) for i in HF_INDICES[:-1])]
    if final_state == "both":
        names.append(contract.tensor_name(HF_INDICES[-1]))
    names.append(contract.PRE_NORM_TENSOR)
    assert list(tensors) == names
    spec, data = tensors[contract.PRE_NORM_TENSOR]
    assert (spec.dtype, spec.shape) == ("BF16", (3, HIDDEN))
    pre = np.frombuffer(data, "<u2").reshape(3, HIDDEN)
    assert np.array_equal(pre, expected_state(engine.table, np.asarray(ids), LAYERS + 1))
    meta = contract.DumpMeta.from_json((tmp_path / "hsx-pre" / contract.META_FILE).read_text())
    assert meta.non_finite == {name: 0 for name in names[1:]}
    engine.prefill(ids, "not-captured")
    assert sorted(os.listdir(tmp_path)) == ["hsx-pre"]


@pytest.mark.parametrize(
    "args",
    [["--hidden-size", "0"], ["--num-layers", "3"], ["--final-state", "middle"], ["--aux-layers", "1,99"]],
)
def test_cli_refuses_a_bad_configuration(tmp_path: Path, args: list[str]) -> None:
    result = subprocess.run(
        hsx_command("engine", "--backend", "synthetic", "--dump-dir", str(tmp_path), "--port", "1", *args),
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO_ROOT,
        check=False,
    )
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.strip()


# --- generation (hsx.engine.regenerate_contract) -------------------------------------------------------


def test_a_generation_is_answered_through_the_client_and_leaves_no_dump(server: Server) -> None:
    before = set(os.listdir(server.dump_dir))
    prompt = [5, 9, 400, 1234]
    greedy = GenerationParams(max_new_tokens=200)
    first = server.client.generate(prompt, greedy, generation_rid("synthetic-greedy-1"))
    again = server.client.generate(prompt, greedy, generation_rid("synthetic-greedy-2"))
    assert first == again  # greedy: a function of the prompt
    assert (first.prompt_tokens, first.cached_tokens, first.finish_reason) == (len(prompt), 0, "stop")
    assert first.output_ids[-1] == 2 and 2 not in first.output_ids[:-1]
    assert all(3 <= token < 49152 for token in first.output_ids[:-1])
    assert len(first.output_ids) == 39  # what this prompt "wants"; a lower max_new_tokens cuts it: "length"
    short = server.client.generate(prompt, GenerationParams(max_new_tokens=10), generation_rid("short"))
    assert short.finish_reason == "length" and short.output_ids == first.output_ids[:10]
    other = server.client.generate([5, 9, 400, 1235], greedy, generation_rid("synthetic-greedy-3"))
    assert other.output_ids != first.output_ids
    assert set(os.listdir(server.dump_dir)) == before


def test_sampling_follows_the_seed_and_differs_without_one(server: Server) -> None:
    prompt = [11, 12, 13]
    seeded = GenerationParams(max_new_tokens=300, temperature=0.8, top_p=0.9, seed=42)
    one = server.client.generate(prompt, seeded, generation_rid("seed-a"))
    two = server.client.generate(prompt, seeded, generation_rid("seed-b"))
    other_seed = server.client.generate(prompt, replace(seeded, seed=43), generation_rid("seed-c"))
    assert one == two and one.output_ids != other_seed.output_ids
    unseeded = replace(seeded, seed=None)
    draws = {
        tuple(server.client.generate(prompt, unseeded, generation_rid(f"u{i}")).output_ids) for i in range(3)
    }
    assert len(draws) == 3


def test_stop_token_ids_are_never_generated_before_the_end(server: Server) -> None:
    params = GenerationParams(
        max_new_tokens=64, temperature=1.0, seed=1, stop_token_ids=tuple(range(3, 20000))
    )
    generation = server.client.generate([7, 8], params, generation_rid("stops"))
    assert all(token >= 20000 for token in generation.output_ids[:-1])


@pytest.mark.parametrize(
    ("sampling", "field"),
    [
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"max_new_tokens": 4, "temperature": -1}, "temperature"),
        ({"max_new_tokens": 4, "top_p": 0}, "top_p"),
        ({"max_new_tokens": 4, "top_k": 5}, "top_k"),
        ({"max_new_tokens": 4, "sampling_seed": "7"}, "seed"),
        ({"max_new_tokens": 4, "stop_token_ids": [-1]}, "stop_token_ids"),
    ],
)
def test_bad_sampling_params_get_400_naming_the_field(
    server: Server, sampling: dict[str, Any], field: str
) -> None:
    body = {"input_ids": [1, 2], "rid": "hsxgen-bad", "sampling_params": sampling}
    reply = httpx.post(f"{server.url}/generate", json=body, timeout=10)
    assert reply.status_code == 400 and field in reply.json()["detail"], reply.text


def test_a_generation_past_the_context_is_a_rejection_of_the_sample(tmp_path: Path) -> None:
    engine = SyntheticEngine(SyntheticConfig(hidden_size=HIDDEN, num_layers=LAYERS, dump_dir=str(tmp_path)))
    with TestClient(create_app(engine)) as http:
        body = {"input_ids": [1] * 10, "rid": "hsxgen-long", "sampling_params": {"max_new_tokens": 32759}}
        reply = http.post("/generate", json=body)
    assert reply.status_code == 400 and reply.json()["error"] == "too_long"


def test_an_engine_that_ignores_the_seed_says_so_and_samples_anew(tmp_path: Path) -> None:
    config = SyntheticConfig(hidden_size=HIDDEN, num_layers=LAYERS, dump_dir=str(tmp_path))
    honouring, ignoring = (
        SyntheticEngine(config),
        SyntheticEngine(replace(config, honour_sampling_seed=False)),
    )
    assert honouring.info().extra[engine_contract.SEEDED_SAMPLING] is True
    assert ignoring.info().extra[engine_contract.SEEDED_SAMPLING] is False
    params = GenerationParams(max_new_tokens=500, temperature=1.0, seed=5)
    assert honouring.generate([1, 2], params) == honouring.generate([1, 2], params)
    assert ignoring.generate([1, 2], params) != ignoring.generate([1, 2], params)
