"""Parallel layouts: which ranks capture, and the layouts under which no rank holds a complete residual
(standard library only; used by the launcher and, again, by every scheduler process).

How SGLang 0.5.17 spreads the residual stream (``layers/dp_attention.py``, ``layers/communicator.py``):

* The ``tp_size`` ranks of a replica are cut into attention-DP groups: ``dp_size`` of them under
  ``--enable-dp-attention``, else one. A group is ``attention_tp = tp_size // groups`` consecutive ranks
  (rank ``r`` is in group ``r // attention_tp`` at position ``r % attention_tp``) and serves its own
  requests. Plain ``--dp`` (without DP attention) runs ``dp_size`` replicas, each with TP ranks 0..tp-1.
* Between two decoder layers a rank holds its group's rows in batch order, padding only at the end (SGLang
  pads a group's batch to a multiple of ``attention_tp``, and under DP attention's MAX_LEN mode to the longest
  group's), every reduction done. What it holds follows the layer's ``layer_output_mode``: ``TP_ATTN_FULL``,
  every row of the group; ``SCATTERED``, only its ``tensor_split(attention_tp)`` share. A layer's output is
  ``SCATTERED`` when its MLP runs scattered and it is not the last layer (whose output is gathered back):
  MoE layers with an all-to-all backend (``--moe-a2a-backend`` other than ``none``), FlashInfer's CUTLASS
  FP4 all-gather MoE or DWDP, and dense layers under ``--moe-dense-tp-size 1``.

So the group's position-0 rank (its *leader*) holds every captured row exactly when ``attention_tp`` is 1
or no tapped layer's output is ``SCATTERED``; at ``attention_tp`` 1 the two modes are the same rows. The
capture runs on every group's leader, each writing the rids of its own group.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from hsx import contract

SCATTERED = "SCATTERED"  # the name of SGLang's ScatterMode whose rows are split over attention TP
A2A_NONE = "none"

# model_type of the architectures whose every layer SGLang 0.5.17 builds with is_layer_sparse=True (their
# LayerScatterModes treat no layer as dense, whatever the config's mlp_only_layers says).
ALL_SPARSE_MODEL_TYPES = frozenset({"qwen2_moe", "qwen3_moe", "qwen3_next", "gpt_oss", "minimax_m2"})
# Config keys that give a routed-expert count: a config with none of them is a dense model.
EXPERT_COUNT_KEYS = ("n_routed_experts", "num_experts", "num_local_experts", "moe_num_experts")


def _int(server_args: Any, name: str, default: int = 1) -> int:
    value = getattr(server_args, name, None)
    return default if value is None else int(value)


def attention_dp_size(server_args: Any) -> int:
    return _int(server_args, "dp_size") if getattr(server_args, "enable_dp_attention", False) else 1


def attention_tp_size(server_args: Any) -> int:
    """The ranks of one attention-DP group (SGLang's ``compute_dp_attention_world_info``)."""
    groups = attention_dp_size(server_args) * _int(server_args, "attn_cp_size")
    return max(1, _int(server_args, "tp_size") // max(1, groups))


def parallel_layout(server_args: Any) -> contract.ParallelLayout:
    """The layout of SGLang's final server arguments, as /hsx/info and the manifests record it."""
    return contract.ParallelLayout(
        tp=_int(server_args, "tp_size"),
        dp=_int(server_args, "dp_size"),
        dp_attention=bool(getattr(server_args, "enable_dp_attention", False)),
        ep=_int(server_args, "ep_size"),
        moe_a2a_backend=str(getattr(server_args, "moe_a2a_backend", None) or A2A_NONE),
        pp=_int(server_args, "pp_size"),
        nnodes=_int(server_args, "nnodes"),
    )


def is_capture_leader(server_args: Any, tp_rank: int, pp_rank: int = 0) -> bool:
    """Whether the scheduler of ``tp_rank`` captures: the first rank of its attention-DP group (of its
    replica, under plain DP: SGLang numbers each replica's ranks from 0). PP is refused, but its stage 0
    is the one that would hold the first layers."""
    return pp_rank == 0 and tp_rank % attention_tp_size(server_args) == 0


def leaders_on_node(server_args: Any, node_rank: int) -> int:
    """How many capturing schedulers run on node ``node_rank``: they share its host-memory budgets."""
    nnodes = max(1, _int(server_args, "nnodes"))
    if not getattr(server_args, "enable_dp_attention", False):
        # Plain DP runs on one node only (SGLang refuses multi-node DP without DP attention), one leader per
        # replica; TP across nodes has its one leader, rank 0, on node 0.
        return _int(server_args, "dp_size") if nnodes == 1 else int(node_rank == 0)
    per_node = max(1, _int(server_args, "tp_size") // nnodes)
    group = attention_tp_size(server_args)
    return sum(1 for r in range(node_rank * per_node, (node_rank + 1) * per_node) if r % group == 0)


def scattered_moe_reason(server_args: Any) -> str | None:
    """Why the MoE layers' outputs are ``SCATTERED`` (each rank keeps its share of its group's tokens), or
    None when they are all-reduced back to ``TP_ATTN_FULL``."""
    backend = str(getattr(server_args, "moe_a2a_backend", None) or A2A_NONE)
    if backend != A2A_NONE:
        return f"the all-to-all MoE backend {backend!r} (--moe-a2a-backend)"
    if _int(server_args, "dwdp_size") > 1:
        return "DWDP (--dwdp-size)"
    if (
        getattr(server_args, "enable_dp_attention", False)
        and not getattr(server_args, "disable_flashinfer_cutlass_moe_fp4_allgather", False)
        and getattr(server_args, "moe_runner_backend", None) == "flashinfer_cutlass"
        and getattr(server_args, "quantization", None) == "modelopt_fp4"
    ):
        return "FlashInfer CUTLASS MoE with its FP4 all-gather"
    return None


def layout_problems(server_args: Any, shared_dump_dir: bool = False) -> list[str]:
    """Layouts under which no rank holds every captured row, or the rows land where no worker reads them.
    ``shared_dump_dir``: the operator says every node's dump directory is the one the worker reads."""
    problems: list[str] = []
    attention_tp = attention_tp_size(server_args)
    scattered = scattered_moe_reason(server_args)
    if scattered is not None and attention_tp > 1:
        problems.append(
            f"{scattered} with attention TP {attention_tp}: between the MoE layers each rank holds only its "
            f"tensor_split share of its group's tokens, so no rank has a captured layer's every row (use "
            f"attention TP 1: --enable-dp-attention --dp {_int(server_args, 'tp_size')}, or no all-to-all)"
        )
    pp = _int(server_args, "pp_size")
    if pp > 1:
        problems.append(
            f"pipeline parallelism (--pp-size {pp}): the decoder layers live on different stages, so no rank "
            "runs every captured layer; each stage's capture would see only its own layers' hooks fire, and "
            "a capture whose hooks did not all fire is dropped"
        )
    nnodes = _int(server_args, "nnodes")
    if getattr(server_args, "enable_dp_attention", False) and nnodes > 1 and not shared_dump_dir:
        problems.append(
            f"DP attention over {nnodes} nodes: the leaders of the DP groups on nodes 1.. would write their "
            "dumps on their own node, where no worker reads them (hsx does not route a worker's requests to "
            "its node's DP ranks); pass --shared-dump-dir if every node's --dump-dir is the directory the "
            "worker reads"
        )
    return problems


def dense_layer_ids(text_config: Any, num_layers: int) -> frozenset[int] | None:
    """The decoder layers SGLang 0.5.17 builds as dense (``is_layer_sparse`` False), from the model's text
    config; None when the architecture's rule is not known here."""
    if text_config is None:
        return None

    def get(name: str) -> Any:
        return getattr(text_config, name, None)

    everything = frozenset(range(num_layers))
    if get("first_k_dense_replace") is not None:  # DeepSeek V2/V3, Kimi K2/K2.5, GLM-4 MoE
        if get("n_routed_experts") is None:
            return everything
        first, every = int(get("first_k_dense_replace")), int(get("moe_layer_freq") or 1)
        return frozenset(layer for layer in everything if layer < first or layer % every != 0)
    if get("model_type") in ALL_SPARSE_MODEL_TYPES:
        return frozenset()
    if all(get(key) is None for key in EXPERT_COUNT_KEYS):
        return everything  # a dense model: every MLP is a dense one
    return None


def dense_aux_problems(
    server_args: Any, text_config: Any, aux_layer_ids: Sequence[int], num_layers: int
) -> list[str]:
    """Aux layers whose output ``--moe-dense-tp-size 1`` leaves ``SCATTERED`` at attention TP > 1."""
    attention_tp = attention_tp_size(server_args)
    if getattr(server_args, "moe_dense_tp_size", None) != 1 or attention_tp == 1:
        return []
    dense = dense_layer_ids(text_config, num_layers)
    if dense is None:
        arch = getattr(text_config, "model_type", None) or "this model"
        return [
            f"--moe-dense-tp-size 1 with attention TP {attention_tp}: dense layers' outputs stay split over "
            f"the attention-TP ranks, and which layers of {arch} are dense is not known here"
        ]
    hit = sorted(set(aux_layer_ids) & dense)
    if not hit:
        return []
    return [
        f"aux layers {hit} are dense layers, and --moe-dense-tp-size 1 runs dense MLPs on each rank's share "
        f"of the tokens: with attention TP {attention_tp} no rank holds their every row (choose sparse aux "
        "layers, attention TP 1, or drop --moe-dense-tp-size 1)"
    ]


def scattered_taps(layers: Sequence[Any], layer_ids: Iterable[int]) -> list[int]:
    """The layers among ``layer_ids`` whose output the loaded SGLang model leaves ``SCATTERED`` (read from
    each decoder layer's own ``layer_scatter_modes``; layers without one are all-reduced)."""
    found = []
    for layer_id in layer_ids:
        modes = getattr(layers[layer_id], "layer_scatter_modes", None)
        if getattr(getattr(modes, "layer_output_mode", None), "name", None) == SCATTERED:
            found.append(layer_id)
    return found
