"""A small MoE decoder laid out over ranks the way SGLang 0.5.17 lays out DeepSeek-V3 (communicator.py).

Every rank builds the same weights; what a rank computes, and which rows it holds, follow its place in the
layout (:class:`Par`):

* attention stand-in: row-parallel over the attention-TP group (each rank a slice of the input columns),
  partial sums until the all-reduce;
* MLP (layer 0 dense, the others MoE): ``FULL`` mode gathers every DP group's rows (``dp_gather``), each
  TP rank computes its share (its slice of every expert's intermediate, or its experts under EP), an
  all-reduce sums them and ``dp_scatter`` hands each group its rows back; ``SCATTERED`` mode (an all-to-all
  backend, or ``--moe-dense-tp-size 1`` for the dense layer) reduce-scatters the attention output over
  attention TP (``tensor_split``) and runs the MLP on the rank's share alone;
* each decoder layer carries ``layer_scatter_modes`` as SGLang's do, so the plugin reads the model's own
  word; the last layer gathers a scattered output back;
* norms are fused add-RMSNorms that overwrite their inputs, as SGLang's do.

Each row's values depend on its own token and position only, so a request's states can be computed alone
(:func:`reference_states`) and compared with what any layout captured.
"""

from __future__ import annotations

import enum
import functools
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hsx import contract

H, LAYERS, VOCAB, EXPERTS, INTER, EXPERT_INTER = 16, 6, 64, 4, 32, 8
DENSE_LAYERS = frozenset({0})  # DeepSeek-V3's first_k_dense_replace, at 1


class ScatterMode(enum.Enum):  # the names of SGLang's ScatterMode that the plugin reads
    SCATTERED = enum.auto()
    TP_ATTN_FULL = enum.auto()
    FULL = enum.auto()


@dataclass
class Group:
    rank: int = 0
    size: int = 1
    pg: Any = None  # a gloo process group; None when size is 1 (no collective)


@dataclass
class Par:
    """One rank's place in a layout (the defaults: one unsharded rank, the reference)."""

    tp: Group = field(default_factory=Group)  # every TP rank of the replica (all DP groups)
    attn: Group = field(default_factory=Group)  # the rank's attention-DP group
    dp_rank: int = 0
    dp_size: int = 1  # attention-DP groups
    ep: bool = False  # experts spread over the TP ranks (else each expert's intermediate)
    a2a: bool = False  # MoE layers run scattered (an all-to-all backend)
    dense_fully_dp: bool = False  # --moe-dense-tp-size 1
    stage_layers: range = range(LAYERS)  # a PP stage's layers
    prev_stage: int | None = None  # global rank to receive from (PP)
    next_stage: int | None = None


def mlp_mode(par: Par, layer: int) -> ScatterMode:
    scattered = par.dense_fully_dp if layer in DENSE_LAYERS else par.a2a
    return ScatterMode.SCATTERED if scattered else ScatterMode.FULL


def output_mode(par: Par, layer: int) -> ScatterMode:
    if layer == LAYERS - 1 or mlp_mode(par, layer) is not ScatterMode.SCATTERED:
        return ScatterMode.TP_ATTN_FULL
    return ScatterMode.SCATTERED


def all_reduce(t: torch.Tensor, g: Group) -> torch.Tensor:
    if g.size > 1:
        dist.all_reduce(t, group=g.pg)
    return t


def all_gather(t: torch.Tensor, g: Group) -> torch.Tensor:
    if g.size == 1:
        return t
    parts = [torch.empty_like(t) for _ in range(g.size)]
    dist.all_gather(parts, t.contiguous(), group=g.pg)
    return torch.cat(parts)


def own_share(t: torch.Tensor, g: Group) -> torch.Tensor:
    return t.tensor_split(g.size)[g.rank]


def shard(n: int, parts: int, part: int) -> slice:
    return slice(part * n // parts, (part + 1) * n // parts)


class FusedNorm(nn.Module):
    """SGLang's RMSNorm: with a residual it adds in place, normalises in place, returns both."""

    def __init__(self, gen: torch.Generator) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.rand(H, generator=gen) + 0.5)

    def rms(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> Any:
        if residual is None:
            return self.rms(x)
        residual.add_(x)
        x.copy_(self.rms(residual))
        return x, residual


class Layer(nn.Module):
    def __init__(self, index: int, par: Par, gen: torch.Generator) -> None:
        super().__init__()
        self.index, self.par = index, par
        self.input_layernorm, self.post_attention_layernorm = FusedNorm(gen), FusedNorm(gen)
        self.wo = nn.Parameter(torch.randn(H, H, generator=gen) / H**0.5)
        self.pos = nn.Parameter(torch.randn(H, generator=gen) * 0.1)
        experts = 1 if index in DENSE_LAYERS else EXPERTS
        inter = INTER if index in DENSE_LAYERS else EXPERT_INTER
        self.router = nn.Parameter(torch.randn(H, experts, generator=gen))
        self.w1 = nn.Parameter(torch.randn(experts, H, inter, generator=gen) / H**0.5)
        self.w2 = nn.Parameter(torch.randn(experts, inter, H, generator=gen) / inter**0.5)
        previous = output_mode(par, index - 1) if index > 0 else ScatterMode.TP_ATTN_FULL
        self.layer_scatter_modes = SimpleNamespace(
            layer_input_mode=previous,
            mlp_mode=mlp_mode(par, index),
            layer_output_mode=output_mode(par, index),
        )

    def mlp(self, h: torch.Tensor, part: int, parts: int) -> torch.Tensor:
        """This rank's share of the MLP (``parts`` 1: all of it); experts mixed by a softmax gate."""
        gate = torch.softmax(h @ self.router, dim=-1)
        out = torch.zeros_like(h)
        for e in range(self.w1.shape[0]):
            if self.par.ep and self.w1.shape[0] > 1:
                if e % parts != part:
                    continue
                cols = slice(None)
            else:
                cols = shard(self.w1.shape[2], parts, part)
            out += gate[:, e : e + 1] * (torch.tanh(h @ self.w1[e][:, cols]) @ self.w2[e][cols])
        return out

    def forward(
        self, positions: torch.Tensor, hidden_states: torch.Tensor, forward_batch: Any, residual: Any
    ) -> tuple[torch.Tensor, Any]:
        par, modes = self.par, self.layer_scatter_modes
        scattered_in = modes.layer_input_mode is ScatterMode.SCATTERED
        if residual is None:
            residual, h = hidden_states.clone(), self.input_layernorm(hidden_states)
        else:
            h, residual = self.input_layernorm(hidden_states, residual)
        if scattered_in:
            h = all_gather(h, par.attn)
        cols = shard(H, par.attn.size, par.attn.rank)
        a = h[:, cols] @ self.wo[cols]
        if par.attn.rank == 0:
            a = a + torch.tanh(positions[:, None].float() * self.pos)
        if modes.mlp_mode is ScatterMode.SCATTERED:
            a = own_share(all_reduce(a, par.attn), par.attn)  # reduce-scatter
            residual = residual if scattered_in else own_share(residual, par.attn)
            h, residual = self.post_attention_layernorm(a, residual)
            out = self.mlp(h, 0, 1)  # on this rank's share, every expert (dispatch and combine stand-in)
            if modes.layer_output_mode is ScatterMode.TP_ATTN_FULL:  # the last layer gathers back
                return all_gather(out + residual, par.attn), None
            return out, residual
        a = all_reduce(a, par.attn)
        residual = all_gather(residual, par.attn) if scattered_in else residual
        h, residual = self.post_attention_layernorm(a, residual)
        out = all_reduce(self.mlp(dp_gather(h, par, forward_batch), par.tp.rank, par.tp.size), par.tp)
        return dp_scatter(out, par, forward_batch), residual


def dp_gather(h: torch.Tensor, par: Par, fb: Any) -> torch.Tensor:
    """Every DP group's rows, each group's block ``max_len`` long (MAX_LEN padding)."""
    if par.dp_size == 1:
        return h
    out = torch.zeros(par.dp_size * fb.max_len, H)
    if par.attn.rank == 0:  # the group's rows once, whatever its attention TP
        out[par.dp_rank * fb.max_len : par.dp_rank * fb.max_len + h.shape[0]] = h
    return all_reduce(out, par.tp)


def dp_scatter(out: torch.Tensor, par: Par, fb: Any) -> torch.Tensor:
    if par.dp_size == 1:
        return out
    return out[par.dp_rank * fb.max_len : (par.dp_rank + 1) * fb.max_len].clone()


class MissingLayer(nn.Module):  # another PP stage's layer, as SGLang's PPMissingLayer: never run here
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise AssertionError("another stage's layer")


class Decoder(nn.Module):
    def __init__(self, par: Par) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.par = par
        self.embed_tokens = nn.Embedding(VOCAB, H)
        with torch.no_grad():
            self.embed_tokens.weight.copy_(torch.randn(VOCAB, H, generator=gen))
        built = [Layer(i, par, gen) for i in range(LAYERS)]  # every rank draws every weight, in order
        self.layers = nn.ModuleList(
            b if i in par.stage_layers else MissingLayer() for i, b in enumerate(built)
        )
        self.norm = FusedNorm(gen)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, fb: Any) -> torch.Tensor | None:
        par = self.par
        if par.prev_stage is None:
            hidden, residual = self.embed_tokens(ids), None
        else:
            hidden, residual = torch.empty(len(ids), H), torch.empty(len(ids), H)
            dist.recv(hidden, par.prev_stage)
            dist.recv(residual, par.prev_stage)
        for i in par.stage_layers:
            hidden, residual = self.layers[i](positions, hidden, fb, residual)
        if par.next_stage is not None:
            dist.send(hidden.contiguous(), par.next_stage)
            dist.send(residual.contiguous(), par.next_stage)
            return None
        out = self.norm(hidden, residual)
        return out[0] if isinstance(out, tuple) else out


class Model(nn.Module):
    def __init__(self, par: Par) -> None:
        super().__init__()
        self.model = Decoder(par)


@functools.lru_cache(maxsize=1)
def _reference_model() -> Decoder:
    return Model(Par()).model


@functools.lru_cache(maxsize=64)
def reference_states(ids: tuple[int, ...]) -> dict[str, torch.Tensor]:
    """One request's states on one unsharded rank: the stream after every layer, before and after the norm."""
    dec = _reference_model()
    positions = torch.arange(len(ids))
    out: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        hidden, residual = dec.embed_tokens(torch.tensor(ids)), None
        for i, layer in enumerate(dec.layers):
            hidden, residual = layer(positions, hidden, None, residual)
            out[contract.tensor_name(i + 1)] = (hidden + residual).clone()
        out[contract.PRE_NORM_TENSOR] = out[contract.tensor_name(LAYERS)]
        out[contract.tensor_name(LAYERS)] = dec.norm.rms(hidden + residual)
    return out
