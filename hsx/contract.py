"""The engine protocol shared by the worker, the reference engine and the SGLang plugin.

Standard library only: the SGLang plugin imports this inside a stock server's scheduler process, and the
API imports it without torch.

Request: SGLang's native ``POST /generate`` with ``input_ids``, ``rid``, ``sampling_params`` (and optionally
``extra_key``, SGLang's cache namespace). Response: ``meta_info.prompt_tokens`` and
``meta_info.cached_tokens``. Only requests whose rid starts with :data:`RID_PREFIX` are captured; everything
else (health checks, warm-up, regeneration's generations: hsx/engine/regenerate_contract.py) is served but
never dumped.

Dump: a directory ``<dump_dir>/<rid>/`` holding :data:`STATES_FILE` (safetensors: ``input_ids`` int32 [T]
and one ``hidden.<hf_index>`` tensor [T, H] per captured layer) and :data:`META_FILE`. ``meta.json`` is
written last, through a rename, so its presence means the dump is complete.

Layer convention: an EAGLE-3 auxiliary layer id ``L`` is the output of decoder layer ``L`` (0-based), which
is Hugging Face's ``hidden_states[L + 1]``. The final state is the post-norm output of the last layer,
``hidden_states[N]`` for an ``N``-layer model. Tensors are keyed by the Hugging Face index.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from hsx import safetensors_io
from hsx.layout import FINAL_STATES as FINAL_STATES  # the on-disk names live in hsx.layout
from hsx.layout import PRE_NORM_TENSOR as PRE_NORM_TENSOR
from hsx.layout import tensor_name as tensor_name
from hsx.layout import write_atomically
from hsx.safetensors_io import DTYPE_SIZES as DTYPE_SIZES  # re-exported for callers of the contract

PROTOCOL_VERSION = 1
RID_PREFIX = "hsx-"
META_FILE = "meta.json"
STATES_FILE = "states.safetensors"
INFO_PATH = "/hsx/info"
# The pre-norm final state (hsx.layout.PRE_NORM_TENSOR) is captured on request (``--final-state pre|both``).
# The key of EngineInfo.extra that names the model's weights and config (hsx.engine.model_identity).
MODEL_FINGERPRINT = "model_fingerprint"
# The key of EngineInfo.extra (and so of a manifest's ``engine``) that holds ParallelLayout.to_dict().
PARALLEL_LAYOUT = "parallel_layout"
LAYER_CONVENTION = (
    "eagle3: aux id L = output of decoder layer L = HF hidden_states[L+1]; "
    "final = post-norm output = HF hidden_states[N]"
)


# Accepted spellings of the state dtype, mapped to the safetensors name the shard uses.
STATE_DTYPES = {
    "BF16": "BF16",
    "bf16": "BF16",
    "bfloat16": "BF16",
    "F16": "F16",
    "fp16": "F16",
    "float16": "F16",
    "F32": "F32",
    "fp32": "F32",
    "float32": "F32",
}


def canonical_state_dtype(dtype: str) -> str:
    try:
        return STATE_DTYPES[dtype]
    except KeyError:
        raise ValueError(
            f"unsupported state dtype {dtype!r}; expected one of {sorted(STATE_DTYPES)}"
        ) from None


def eagle3_aux_layer_ids(num_layers: int) -> list[int]:
    """The EAGLE-3 default: low, middle and high decoder layers."""
    if num_layers < 5:
        raise ValueError(f"EAGLE-3 needs at least 5 decoder layers, model has {num_layers}")
    return [1, num_layers // 2 - 1, num_layers - 4]


def hf_indices(aux_layer_ids: Sequence[int], num_layers: int) -> list[int]:
    """Hugging Face ``hidden_states`` indices of the aux layers followed by the final post-norm state."""
    for layer in aux_layer_ids:
        if not 0 <= layer < num_layers - 1:
            raise ValueError(f"aux layer {layer} out of range for a {num_layers}-layer model")
    return [layer + 1 for layer in aux_layer_ids] + [num_layers]


def is_captured_rid(rid: object) -> bool:
    return isinstance(rid, str) and rid.startswith(RID_PREFIX)


def dump_path(dump_dir: str, rid: str) -> str:
    """The dump directory of one request; refuses rids that could escape ``dump_dir``."""
    if not is_captured_rid(rid) or "/" in rid or "\\" in rid or rid in (".", "..") or "\x00" in rid:
        raise ValueError(f"not a capturable rid: {rid!r}")
    return os.path.join(dump_dir, rid)


@dataclass
class DumpMeta:
    rid: str
    num_tokens: int
    prompt_tokens: int
    cached_tokens: int
    hidden_size: int
    dtype: str
    num_layers: int
    aux_layer_ids: list[int]
    hf_indices: list[int]
    layer_convention: str = LAYER_CONVENTION
    protocol_version: int = PROTOCOL_VERSION
    engine: str = ""
    # Non-finite values per dump tensor, counted by the engine where the states already are (on the GPU
    # before the copy); absent when the engine did not count. The worker still checks the bytes it writes.
    non_finite: dict[str, int] | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> DumpMeta:
        raw = json.loads(text)
        known = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in raw.items() if k in known})


@dataclass(frozen=True)
class ParallelLayout:
    """How the engine's model was spread over GPUs when it made the states, so a dataset says how it was
    made. SGLang's names: tensor-parallel size, data-parallel size (replicas, or DP-attention groups when
    ``dp_attention``), expert-parallel size, the MoE all-to-all backend ("none": experts reduced by an
    all-reduce), pipeline stages, nodes. An engine on one device reports the defaults."""

    tp: int = 1
    dp: int = 1
    dp_attention: bool = False
    ep: int = 1
    moe_a2a_backend: str = "none"
    pp: int = 1
    nnodes: int = 1

    @property
    def attention_tp(self) -> int:
        """The ranks that share one request's attention (and hold the same residual rows)."""
        return max(1, self.tp // self.dp) if self.dp_attention else self.tp

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any] | None) -> ParallelLayout | None:
        """None when the engine (or an older manifest) did not say; fields it did not know take defaults."""
        if not isinstance(raw, Mapping):
            return None
        known = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in raw.items() if k in known})


@dataclass
class EngineInfo:
    """What ``GET /hsx/info`` returns: enough for a worker to check a job against the engine."""

    backend: str
    model_path: str
    num_layers: int
    hidden_size: int
    dtype: str
    aux_layer_ids: list[int]
    hf_indices: list[int]
    dump_dir: str
    prefix_cache: bool
    protocol_version: int = PROTOCOL_VERSION
    layer_convention: str = LAYER_CONVENTION
    # "post": hidden.<N> is the post-norm final state (the default); "pre": only the pre-norm state is
    # captured, as PRE_NORM_TENSOR; "both": both.
    final_state: str = "post"
    # Engine-specific facts worth recording with a job (version, tensor-parallel size, chunk size, ...).
    # ``extra[MODEL_FINGERPRINT]`` identifies the weights and config (see hsx.engine.model_identity): two
    # checkpoints of one shape differ there and nowhere else.
    extra: dict[str, Any] = field(default_factory=dict)
    # The most positions a prompt may have (the model's context length); None when the engine does not say.
    context_length: int | None = None
    # The longest prompt a prefill takes (SGLang: its context length and its KV pool, less the one token a
    # prefill generates), and the largest dump the engine can write (its dump directory's file system;
    # SGLang: also the host memory a chunked prompt is reassembled in). None where the engine does not say
    # (then ``context_length`` bounds the prompt). A worker rejects a longer or larger sample up front,
    # with the reason, instead of sending it.
    max_prompt_tokens: int | None = None
    max_dump_bytes: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def model_fingerprint(self) -> str | None:
        value = self.extra.get(MODEL_FINGERPRINT)
        return value if isinstance(value, str) and value else None

    @property
    def parallel_layout(self) -> ParallelLayout | None:
        return ParallelLayout.from_dict(self.extra.get(PARALLEL_LAYOUT))

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> EngineInfo:
        known = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in raw.items() if k in known})


def dump_dir_capacity(dump_dir: str) -> int | None:
    """The size of the file system ``dump_dir`` is on (bytes): no dump larger than that can land there."""
    try:
        stats = os.statvfs(dump_dir)
    except OSError:
        return None
    return stats.f_blocks * stats.f_frsize or None


def dump_bytes(tokens: int, hidden_size: int, tensors: int, itemsize: int) -> int:
    """A dump's size without its header: ``input_ids`` (int32) and ``tensors`` states of [tokens, hidden]."""
    return tokens * (4 + tensors * hidden_size * itemsize)


def generate_body(input_ids: Sequence[int], rid: str, extra_key: str | None = None) -> dict[str, Any]:
    """A prefill-only request: one new token, greedy, so the engine's work is the prompt forward."""
    body: dict[str, Any] = {
        "input_ids": list(input_ids),
        "rid": rid,
        "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
    }
    if extra_key is not None:
        body["extra_key"] = extra_key
    return body


# --- safetensors, through the one codec in hsx.safetensors_io (no pickle, no torch) -----------------


def write_safetensors(path: str, tensors: Iterable[tuple[str, str, Sequence[int], bytes]]) -> None:
    """Write ``(name, dtype, shape, raw little-endian bytes)`` tuples as a safetensors file, fsynced."""
    safetensors_io.write_file(path, tensors)


@dataclass
class RawTensor:
    dtype: str
    shape: list[int]
    data: bytes


def read_safetensors(path: str) -> dict[str, RawTensor]:
    """Read a safetensors file into raw tensors, checking that the header is sane."""
    return {
        name: RawTensor(spec.dtype, list(spec.shape), data)
        for name, (spec, data) in safetensors_io.read_file(path).items()
    }


def write_meta_atomically(directory: str, meta: DumpMeta) -> None:
    """Place a dump's meta.json last: its presence means the dump is complete. The directory is not
    fsynced: a dump lost to a power cut is asked for again, and the fsync would cost every sample."""
    write_atomically(os.path.join(directory, META_FILE), meta.to_json(), sync_dir=False)
