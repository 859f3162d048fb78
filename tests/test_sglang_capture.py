"""The SGLang plugin's capture path on CPU, end to end: hooks, planning, staging, writers, dump files.

SGLang itself cannot run here (no accelerator), so a small torch model stands in for SGLang's: decoder
layers called as ``layer(positions, hidden_states, forward_batch, residual)`` and a final norm that, like
SGLang's fused add-RMSNorm, overwrites its inputs in place. Its layers act on each row alone, so every
request's states can be computed on their own and compared with what the capture dumped from shared,
chunked, mixed batches. The batches are cut the way SGLang's chunked prefill cuts them.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

from hsx import contract
from workers.engines.sglang.capture import Capture
from workers.engines.sglang.config import PluginConfig
from workers.engines.sglang.guards import NEEDS_ALLREDUCE_TAG
from workers.engines.sglang.patching import sweep_after, wrap_forward

H, LAYERS, VOCAB = 16, 6, 50
AUX = [1, 2, 3]  # hf indices 2, 3, 4 and the final 6


class FusedNorm(nn.Module):
    """SGLang's RMSNorm: ``forward(x, residual)`` adds in place, normalises in place, returns both."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.rand(H) + 0.5)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight

    def forward(self, *args: Any) -> Any:
        x = args[0]
        residual = args[1] if len(args) > 1 else None
        if residual is None:
            return self._norm(x)
        residual.add_(x)
        x.copy_(self._norm(residual))
        return x, residual


class Layer(nn.Module):
    def __init__(self, index: int) -> None:
        super().__init__()
        self.index = index
        self.input_layernorm = FusedNorm()
        self.proj = nn.Linear(H, H)

    def forward(
        self, positions: torch.Tensor, hidden_states: torch.Tensor, forward_batch: Any, residual: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden_states.clone()
            h = self.input_layernorm(hidden_states)
        else:
            h, residual = self.input_layernorm(hidden_states, residual)
        out = torch.tanh(self.proj(h)) + 0.01 * positions[:, None].float()
        if getattr(forward_batch, "tag_layer", None) == self.index:
            setattr(out, NEEDS_ALLREDUCE_TAG, True)  # as a layer whose MLP all-reduce was deferred
        return out, residual


class Decoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(VOCAB, H)
        self.layers = nn.ModuleList(Layer(i) for i in range(LAYERS))
        self.norm = FusedNorm()

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, forward_batch: Any) -> torch.Tensor:
        hidden, residual = self.embed_tokens(ids), None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, forward_batch, residual)
        out, _ = self.norm(hidden, residual)
        return out


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = Decoder()


def reference(model: Model, ids: list[int]) -> dict[str, torch.Tensor]:
    """One request's states computed alone: the stream after every layer, before and after the norm."""
    dec = model.model
    positions = torch.arange(len(ids))
    with torch.no_grad():
        hidden, residual = dec.embed_tokens(torch.tensor(ids)), None
        out: dict[str, torch.Tensor] = {}
        for i, layer in enumerate(dec.layers):
            hidden, residual = layer(positions, hidden, None, residual)
            out[contract.tensor_name(i + 1)] = (hidden + residual).clone()
        out[contract.PRE_NORM_TENSOR] = out[contract.tensor_name(LAYERS)]
        out[contract.tensor_name(LAYERS)] = dec.norm._norm(hidden + residual)
    return out


class Req:
    def __init__(self, rid: str, ids: list[int]) -> None:
        self.rid = rid
        self.origin_input_ids = ids
        self.to_finish: object = None
        self.done = False
        self.cached_tokens = 0
        self.extra_key = f"ek-{rid}"

    def finished(self) -> bool:
        return self.done


def batch(items: list[tuple[Req, int, int]], mode: str = "EXTEND", tag_layer: int | None = None) -> Any:
    return SimpleNamespace(
        forward_mode=SimpleNamespace(name=mode),
        reqs=[r for r, _, _ in items],
        prefix_lens=[p for _, p, _ in items],
        extend_lens=[e for _, _, e in items],
        tag_layer=tag_layer,
    )


def chunked_batches(reqs: list[Req], chunk: int) -> Iterator[list[tuple[Req, int, int]]]:
    """SGLang's chunked prefill: each pass takes up to ``chunk`` prompt tokens, oldest requests first."""
    pending = [[r, 0] for r in reqs]
    while pending:
        budget, items = chunk, []
        for entry in pending:
            r, pos = entry
            take = min(len(r.origin_input_ids) - pos, budget)
            if take <= 0:
                break
            items.append((r, pos, take))
            entry[1] = pos + take
            budget -= take
        pending = [e for e in pending if e[1] < len(e[0].origin_input_ids)]
        yield items


class Engine:
    """The capture wired into a stand-in worker the way ``patching.install`` wires it into SGLang's."""

    def __init__(self, tmp_path: Path, final_state: str = "post", writers: int = 2) -> None:
        self.model = Model()
        self.dump_dir = str(tmp_path / "dumps")
        cfg = PluginConfig(
            self.dump_dir, AUX, pinned_mb=1, writer_threads=writers, stats_seconds=0, final_state=final_state
        )
        self.capture = Capture(
            cfg, torch, self.model, LAYERS, H, torch.float32, torch.device("cpu"), {"tp_size": 1}
        )
        self.worker = SimpleNamespace(model_runner=SimpleNamespace(model=self.model))
        self.forward = wrap_forward(self._forward, self.capture)
        self.abort = sweep_after(lambda _self: None, self.capture)
        self.skip_layers = False

    def _forward(self, _worker: Any, b: Any) -> torch.Tensor:
        ids, positions = [], []
        for req, pre, ext in zip(b.reqs, b.prefix_lens, b.extend_lens, strict=True):
            prompt = req.origin_input_ids
            for pos in range(pre, pre + ext):
                ids.append(prompt[pos] if pos < len(prompt) else 1)  # a decode row: any token
                positions.append(pos)
        if self.skip_layers:
            return torch.zeros(len(ids), H)
        with torch.no_grad():
            return self.model.model(torch.tensor(ids), torch.tensor(positions), b)

    def run(self, b: Any) -> None:
        self.forward(self.worker, b)

    def flush(self) -> None:
        assert self.capture.flush(30)

    def dumps(self) -> list[str]:
        return sorted(os.listdir(self.dump_dir))

    def load(self, rid: str) -> tuple[contract.DumpMeta, dict[str, torch.Tensor]]:
        d = os.path.join(self.dump_dir, rid)
        with open(os.path.join(d, contract.META_FILE)) as fh:
            meta = contract.DumpMeta.from_json(fh.read())
        raw = contract.read_safetensors(os.path.join(d, contract.STATES_FILE))
        out = {}
        for name, t in raw.items():
            dtype = torch.int32 if t.dtype == "I32" else torch.float32
            out[name] = torch.frombuffer(bytearray(t.data), dtype=dtype).view(*t.shape)
        return meta, out


def prompt(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, VOCAB, (n,), generator=g).tolist()


def assert_dump_matches(engine: Engine, req: Req, names: list[str]) -> contract.DumpMeta:
    meta, tensors = engine.load(req.rid)
    ids = req.origin_input_ids
    assert (meta.num_tokens, meta.prompt_tokens, meta.cached_tokens) == (len(ids), len(ids), 0)
    assert tensors["input_ids"].tolist() == ids
    assert sorted(tensors) == sorted(["input_ids", *names])
    ref = reference(engine.model, ids)
    for name in names:
        assert torch.allclose(tensors[name], ref[name], atol=1e-5), (req.rid, name)
    return meta


def names_for(final_state: str) -> list[str]:
    names = [contract.tensor_name(i) for i in (2, 3, 4)]
    if final_state != "pre":
        names.append(contract.tensor_name(LAYERS))
    if final_state != "post":
        names.append(contract.PRE_NORM_TENSOR)
    return names


@pytest.mark.parametrize("final_state", ["post", "pre", "both"])
def test_chunked_mixed_batches_dump_exactly_the_captured_prompts(tmp_path: Path, final_state: str) -> None:
    engine = Engine(tmp_path, final_state)
    lengths = [1, 2, 7, 16, 17, 40]
    captured = [Req(f"hsx-{i}", prompt(i, n)) for i, n in enumerate(lengths)]
    plain = [Req(f"plain-{i}", prompt(100 + i, n)) for i, n in enumerate(lengths)]
    health = Req("HEALTH_CHECK_1", [3])
    order = [x for pair in zip(captured, plain, strict=True) for x in pair] + [health]
    for passes, items in enumerate(chunked_batches(order, chunk=16)):
        engine.run(batch(items, mode="MIXED" if passes % 2 else "EXTEND"))
    engine.run(batch([(r, len(r.origin_input_ids), 1) for r in captured], mode="DECODE"))
    engine.flush()
    assert engine.dumps() == sorted(r.rid for r in captured)  # nothing for plain or health rids
    for req in captured:
        meta = assert_dump_matches(engine, req, names_for(final_state))
        assert meta.hf_indices == [2, 3, 4, LAYERS] and meta.aux_layer_ids == AUX and meta.engine == "sglang"
        assert meta.extra["final_state"] == final_state and meta.extra["tp_size"] == 1
        assert meta.extra["extra_key"] == req.extra_key and meta.extra["start"] == 0
        assert meta.non_finite == dict.fromkeys(names_for(final_state), 0)
    long_meta, _ = engine.load("hsx-5")
    assert long_meta.extra["chunks"] >= 3
    assert engine.capture.arena.in_use() == 0  # every staged block was given back


def test_a_tensor_still_waiting_for_its_all_reduce_is_never_written(tmp_path: Path) -> None:
    engine = Engine(tmp_path)
    tagged, later, clean = (
        Req("hsx-tagged", prompt(1, 24)),
        Req("hsx-later", prompt(2, 5)),
        Req("hsx-ok", prompt(3, 5)),
    )
    # The first pass holds a layer output tagged as still needing its all-reduce, entering the hook on
    # layer AUX[0] + 1: that pass's capture is dropped, and so are the later chunks of its requests.
    engine.run(batch([(tagged, 0, 16), (later, 0, 5)], tag_layer=AUX[0]))
    engine.run(batch([(tagged, 16, 8), (clean, 0, 5)]))
    engine.flush()
    assert engine.dumps() == ["hsx-ok"]
    assert_dump_matches(engine, clean, names_for("post"))
    assert engine.capture.stats.snapshot()["errors"] == 2
    assert engine.capture.arena.in_use() == 0


def test_a_tagged_input_of_the_final_norm_is_refused_too(tmp_path: Path) -> None:
    engine = Engine(tmp_path, final_state="pre")
    req = Req("hsx-last", prompt(4, 6))
    engine.run(batch([(req, 0, 6)], tag_layer=LAYERS - 1))
    engine.flush()
    assert engine.dumps() == []


def test_non_finite_values_are_counted_per_tensor_across_chunks(tmp_path: Path) -> None:
    engine = Engine(tmp_path, final_state="both")
    with torch.no_grad():
        engine.model.model.embed_tokens.weight[7] = float("nan")
    ids = prompt(5, 20)
    ids[3] = ids[15] = 7  # one bad row in each of two chunks
    req = Req("hsx-nan", ids)
    for items in chunked_batches([req], chunk=8):
        engine.run(batch(items))
    engine.flush()
    meta, tensors = engine.load("hsx-nan")
    assert meta.non_finite == dict.fromkeys(names_for("both"), 2 * H)
    assert int(torch.isnan(tensors[contract.PRE_NORM_TENSOR]).sum()) == 2 * H


def test_an_abort_mid_prefill_leaves_no_dump_and_frees_everything(tmp_path: Path) -> None:
    engine = Engine(tmp_path, writers=1)
    victim, other = Req("hsx-victim", prompt(6, 30)), Req("hsx-other", prompt(7, 4))
    engine.run(batch([(victim, 0, 10)]))
    victim.to_finish = object()
    engine.abort(None)  # Scheduler.abort_request, wrapped: the sweep runs after it
    engine.run(batch([(other, 0, 4)]))
    engine.flush()
    assert engine.dumps() == ["hsx-other"]
    assert engine.capture.planner.dropped == 1 and not engine.capture.planner.partials
    assert all(not r.parts for r in engine.capture.writer.reassemblers)
    assert engine.capture.arena.in_use() == 0


def test_a_restarted_prefill_is_captured_again_from_its_start(tmp_path: Path) -> None:
    engine = Engine(tmp_path)
    req = Req("hsx-retracted", prompt(8, 20))
    engine.run(batch([(req, 0, 8)]))
    engine.run(batch([(req, 0, 12)]))  # retracted, then prefilled again from the start
    engine.run(batch([(req, 12, 8)]))
    engine.flush()
    meta = assert_dump_matches(engine, req, names_for("post"))
    assert meta.extra["chunks"] == 2 and engine.capture.planner.dropped == 1


def test_a_forward_that_skips_the_hooked_modules_writes_nothing(tmp_path: Path) -> None:
    engine = Engine(tmp_path)
    engine.skip_layers = True  # as a replayed CUDA graph would: the hooks never run
    engine.run(batch([(Req("hsx-graph", prompt(9, 5)), 0, 5)]))
    engine.skip_layers = False
    engine.flush()
    assert engine.dumps() == [] and engine.capture.stats.snapshot()["errors"] == 1


def test_a_forward_that_raises_drops_its_capture_and_raises(tmp_path: Path) -> None:
    engine = Engine(tmp_path)
    req = Req("hsx-boom", prompt(10, 5))
    b = batch([(req, 0, 5)])
    b.reqs.append("not a request")  # breaks the stand-in forward after planning
    b.prefix_lens.append(0)
    b.extend_lens.append(0)
    with pytest.raises(AttributeError):
        engine.run(b)
    engine.flush()
    assert engine.dumps() == [] and req._hsx_cap.closed and engine.capture.arena.in_use() == 0


def test_a_resent_rid_replaces_its_earlier_dump(tmp_path: Path) -> None:
    engine = Engine(tmp_path)
    first, second = Req("hsx-same", prompt(11, 5)), Req("hsx-same", prompt(12, 9))
    engine.run(batch([(first, 0, 5)]))
    engine.flush()
    engine.run(batch([(second, 0, 9)]))
    engine.flush()
    assert_dump_matches(engine, second, names_for("post"))
    with open(os.path.join(engine.dump_dir, "hsx-same", contract.META_FILE)) as fh:
        assert json.load(fh)["num_tokens"] == 9
