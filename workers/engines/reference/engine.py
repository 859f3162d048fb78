"""The model, the hidden-state capture and the generation of the reference engine (its prefix cache is
:mod:`.prefix_cache`).

Every ``/generate`` runs the prompt forward (dumped when its rid is captured), then decodes up to
``max_new_tokens`` tokens one forward at a time (:mod:`.sampling` picks them). A capture is a generation of
one greedy token. Forwards are serialised one at a time, not whole requests: a long generation lets the
captures and generations that arrive meanwhile take their turns between its tokens.
"""

from __future__ import annotations

import inspect
import logging
import os
import shutil
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, DynamicCache, PreTrainedModel

from hsx import contract
from hsx.engine import regenerate_contract as engine_contract
from hsx.engine.model_identity import model_fingerprint
from hsx.engine.regenerate_contract import FinishReason, GenerationParams
from hsx.errors import ReasonError
from workers.engines.reference.prefix_cache import KvLayers, PrefixCache, kv_layers
from workers.engines.reference.sampling import generator_for, model_eos_ids, next_token

log = logging.getLogger(__name__)

BACKEND = "reference"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# safetensors names of the dtypes a dump can hold
SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16"}
HEALTH_CHECK_RID_PREFIX = "HEALTH_CHECK_"


class RequestRejected(ReasonError):
    """A request the engine refuses; the server answers it with HTTP 400 ``{"error", "detail"}``."""


@dataclass(frozen=True)
class EngineConfig:
    model_dir: Path
    dump_dir: str
    aux_layer_ids: list[int] | None = None  # None: the EAGLE-3 default for the model's depth
    dtype: str | None = None  # None: float32 on CPU, bfloat16 on CUDA
    prefix_cache: bool = True
    max_cached_prompts: int = 32
    device: str | None = None  # None: CUDA when available
    # contract.FINAL_STATES: "post" dumps hidden.<N> (the final norm's output), "pre" the norm's input as
    # contract.PRE_NORM_TENSOR instead, "both" both.
    final_state: str = "post"


# What a capture asks for: the prompt's forward and one greedy token (hsx.contract.generate_body).
PREFILL = GenerationParams(max_new_tokens=1, temperature=0.0)


@dataclass(frozen=True)
class RequestResult:
    rid: str
    output_ids: list[int]
    finish_reason: FinishReason
    prompt_tokens: int
    cached_tokens: int
    computed_tokens: int  # prompt tokens computed (not taken from the prefix cache)
    dumped: bool


class ReferenceEngine:
    """Runs prefill forwards one at a time and dumps the captured hidden states of hsx requests."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = torch.device(config.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        dtype_name = config.dtype or ("bfloat16" if self.device.type == "cuda" else "float32")
        if dtype_name not in DTYPES:
            raise ValueError(f"unsupported dtype {dtype_name!r}; choose one of {sorted(DTYPES)}")
        self.dtype_name = dtype_name
        self.dtype = DTYPES[dtype_name]
        self.model = self._load_model(config.model_dir)
        model_config = self.model.config
        self.num_layers = int(model_config.num_hidden_layers)
        self.hidden_size = int(model_config.hidden_size)
        self.vocab_size = int(model_config.vocab_size)
        self.max_positions = int(getattr(model_config, "max_position_embeddings", 0) or 0)
        self.fingerprint = model_fingerprint(config.model_dir)
        self.aux_layer_ids = list(
            config.aux_layer_ids
            if config.aux_layer_ids is not None
            else contract.eagle3_aux_layer_ids(self.num_layers)
        )
        self.hf_indices = contract.hf_indices(self.aux_layer_ids, self.num_layers)
        if config.final_state not in contract.FINAL_STATES:
            raise ValueError(f"final_state {config.final_state!r}: choose one of {contract.FINAL_STATES}")
        self.final_state = config.final_state
        # The captured hidden_states indices: the aux layers, and N unless only the pre-norm state is kept.
        self.captured_indices = self.hf_indices if self.final_state != "pre" else self.hf_indices[:-1]
        self._final_norm = _final_norm(self.model) if self.final_state != "post" else None
        self.prefix_cache = PrefixCache(config.max_cached_prompts) if config.prefix_cache else None
        self._cache_kwarg = _cache_kwarg_name(self.model)
        self.eos_ids = model_eos_ids(self.model)
        self._forward_lock = threading.Lock()
        self._inflight_lock = threading.Lock()
        self._inflight: set[str] = set()
        os.makedirs(config.dump_dir, exist_ok=True)

    def _load_model(self, model_dir: Path) -> PreTrainedModel:
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=self.dtype, local_files_only=True)
        # Through nn.Module: transformers wraps these methods in ways type checkers cannot follow.
        torch.nn.Module.to(model, self.device)
        torch.nn.Module.eval(model)
        return model

    # --- public API ---------------------------------------------------------------------------------

    def info(self) -> contract.EngineInfo:
        return contract.EngineInfo(
            backend=BACKEND,
            model_path=str(self.config.model_dir),
            num_layers=self.num_layers,
            hidden_size=self.hidden_size,
            dtype=self.dtype_name,
            aux_layer_ids=list(self.aux_layer_ids),
            hf_indices=list(self.hf_indices),
            dump_dir=self.config.dump_dir,
            prefix_cache=self.prefix_cache is not None,
            final_state=self.final_state,
            extra={
                contract.MODEL_FINGERPRINT: self.fingerprint,
                engine_contract.SEEDED_SAMPLING: True,
                # one process on one device: the layout every dataset it makes was made with
                contract.PARALLEL_LAYOUT: contract.ParallelLayout().to_dict(),
            },
            context_length=self.max_positions or None,
            max_dump_bytes=contract.dump_dir_capacity(self.config.dump_dir),
        )

    def prefill(self, input_ids: Sequence[int], rid: str, extra_key: str | None = None) -> RequestResult:
        """Run the prompt forward (reusing a cached prefix when allowed); dump it if the rid is captured."""
        return self.generate(input_ids, rid, extra_key, PREFILL)

    def generate(
        self, input_ids: Sequence[int], rid: str, extra_key: str | None, params: GenerationParams
    ) -> RequestResult:
        """The prompt forward (dumped if the rid is captured), then up to ``params.max_new_tokens`` tokens;
        stops after a token of the model's eos ids or ``params.stop_token_ids`` (kept, as SGLang does)."""
        self._check_input_ids(input_ids)
        # The last token is never fed back: a prompt of the whole context still gets its one token.
        if self.max_positions and len(input_ids) + params.max_new_tokens - 1 > self.max_positions:
            raise RequestRejected(
                "too_long",
                f"{len(input_ids)} prompt tokens and {params.max_new_tokens} new ones exceed the model's "
                f"{self.max_positions} positions",
            )
        capture = contract.is_captured_rid(rid)
        if capture:
            try:
                contract.dump_path(self.config.dump_dir, rid)
            except ValueError as exc:
                raise RequestRejected("bad_rid", str(exc)) from exc
        with self._claim_rid(rid):
            return self._run(list(input_ids), rid, extra_key, params, capture, remember=True)

    def health_generate(self) -> RequestResult:
        """A one-token forward outside the capture and the prefix cache, like SGLang's health check."""
        rid = f"{HEALTH_CHECK_RID_PREFIX}{time.time_ns()}"
        bos = getattr(self.model.config, "bos_token_id", None)
        token = bos if isinstance(bos, int) and 0 <= bos < self.vocab_size else 0
        with self._claim_rid(rid):
            return self._run([token], rid, None, PREFILL, capture=False, remember=False)

    def flush_cache(self) -> None:
        with self._forward_lock:
            if self.prefix_cache is not None:
                self.prefix_cache.clear()

    # --- internals ----------------------------------------------------------------------------------

    def _check_input_ids(self, input_ids: Sequence[int]) -> None:
        if len(input_ids) == 0:
            raise RequestRejected("empty_input", "input_ids is empty")
        if self.max_positions and len(input_ids) > self.max_positions:
            raise RequestRejected(
                "too_long", f"{len(input_ids)} tokens exceed the model's {self.max_positions} positions"
            )
        for position, token in enumerate(input_ids):
            if not 0 <= token < self.vocab_size:
                raise RequestRejected(
                    "token_out_of_vocab",
                    f"input_ids[{position}] = {token} is outside the vocabulary [0, {self.vocab_size})",
                )

    @contextmanager
    def _claim_rid(self, rid: str) -> Iterator[None]:
        with self._inflight_lock:
            if rid in self._inflight:
                raise RequestRejected("duplicate_rid", f"a request with rid {rid!r} is already in flight")
            self._inflight.add(rid)
        try:
            yield
        finally:
            with self._inflight_lock:
                self._inflight.discard(rid)

    def _run(
        self,
        input_ids: list[int],
        rid: str,
        extra_key: str | None,
        params: GenerationParams,
        capture: bool,
        remember: bool,
    ) -> RequestResult:
        remember = remember and self.prefix_cache is not None
        with self._forward_lock:
            reused, past = 0, KvLayers()
            if self.prefix_cache is not None and remember:
                reused, past = self.prefix_cache.longest_prefix(extra_key, input_ids)
            computed_ids = input_ids[reused:]
            cache = self._cache_from(past)
            logits, hidden = self._forward(computed_ids, cache, keep_states=capture)
            if self.prefix_cache is not None and remember:
                self.prefix_cache.insert(extra_key, input_ids, kv_layers(cache))
            if capture:
                self._write_dump(rid, computed_ids, hidden, prompt_tokens=len(input_ids), cached=reused)
        output_ids, finish = self._decode(logits, cache, params)
        if self.prefix_cache is not None and remember and len(output_ids) > 1:
            # As SGLang's radix cache keeps a finished request's whole sequence: every fed token's keys.
            with self._forward_lock:
                self.prefix_cache.insert(extra_key, input_ids + output_ids[:-1], kv_layers(cache))
        return RequestResult(
            rid=rid,
            output_ids=output_ids,
            finish_reason=finish,
            prompt_tokens=len(input_ids),
            cached_tokens=reused,
            computed_tokens=len(computed_ids),
            dumped=capture,
        )

    def _decode(
        self, logits: torch.Tensor, cache: DynamicCache, params: GenerationParams
    ) -> tuple[list[int], FinishReason]:
        """Tokens after the prompt's ``logits``, feeding each back through ``cache`` until a stop."""
        generator = generator_for(params)
        stops = self.eos_ids | set(params.stop_token_ids)
        output_ids: list[int] = []
        while True:
            token = next_token(logits, params, generator)
            output_ids.append(token)
            if token in stops:
                return output_ids, "stop"
            if len(output_ids) >= params.max_new_tokens:
                return output_ids, "length"
            with self._forward_lock:
                logits, _ = self._forward([token], cache, keep_states=False)

    def _cache_from(self, past: KvLayers) -> DynamicCache:
        cache = DynamicCache(config=self.model.config)
        for layer_index, (keys, values) in enumerate(past):
            # update() concatenates into fresh tensors: the cache entry that lent these slices stays intact.
            cache.update(keys, values, layer_index)
        return cache

    def _forward(
        self, computed_ids: list[int], cache: DynamicCache, keep_states: bool
    ) -> tuple[torch.Tensor, dict[int | str, torch.Tensor]]:
        """Forward ``computed_ids`` after what ``cache`` holds (which it then holds too): the last position's
        logits and, when ``keep_states``, the captured states (by hf index, and the pre-norm state under
        ``contract.PRE_NORM_TENSOR`` when asked)."""
        ids = torch.tensor([computed_ids], dtype=torch.long, device=self.device)
        kwargs: dict[str, Any] = {self._cache_kwarg: cache}
        pre_norm: list[torch.Tensor] = []
        handle = None
        if keep_states and self._final_norm is not None:
            # The final norm's input is the last decoder layer's output: the state before the norm.
            def keep_input(_module: torch.nn.Module, args: tuple[Any, ...]) -> None:
                pre_norm.append(args[0])

            handle = self._final_norm.register_forward_pre_hook(keep_input)
        try:
            with torch.inference_mode():
                out = self.model(
                    input_ids=ids,
                    use_cache=True,
                    output_hidden_states=keep_states,
                    logits_to_keep=1,
                    **kwargs,
                )
        finally:
            if handle is not None:
                handle.remove()
        logits = out.logits[0, -1]
        if not keep_states:
            return logits, {}
        hidden_states = out.hidden_states
        if hidden_states is None or len(hidden_states) != self.num_layers + 1:
            got = "none" if hidden_states is None else len(hidden_states)
            raise RuntimeError(f"model returned {got} hidden states, expected {self.num_layers + 1}")
        captured: dict[int | str, torch.Tensor] = {
            index: hidden_states[index][0].detach().to("cpu") for index in self.captured_indices
        }
        if self._final_norm is not None:
            if len(pre_norm) != 1:
                raise RuntimeError(f"the final norm ran {len(pre_norm)} times in one forward, expected once")
            captured[contract.PRE_NORM_TENSOR] = pre_norm[0][0].detach().to("cpu")
        return logits, captured

    def _write_dump(
        self,
        rid: str,
        computed_ids: list[int],
        hidden: dict[int | str, torch.Tensor],
        prompt_tokens: int,
        cached: int,
    ) -> None:
        directory = contract.dump_path(self.config.dump_dir, rid)
        # A retried request replaces the earlier dump rather than mixing with it.
        if os.path.isdir(directory):
            shutil.rmtree(directory)
        os.makedirs(directory)
        tensors: list[tuple[str, str, Sequence[int], bytes]] = [
            (
                "input_ids",
                "I32",
                [len(computed_ids)],
                tensor_bytes(torch.tensor(computed_ids, dtype=torch.int32)),
            )
        ]
        safetensors_dtype = SAFETENSORS_DTYPES[self.dtype]
        non_finite: dict[str, int] = {}
        for key, state in hidden.items():
            name = key if isinstance(key, str) else contract.tensor_name(key)
            non_finite[name] = int((~torch.isfinite(state)).sum().item())
            tensors.append((name, safetensors_dtype, list(state.shape), tensor_bytes(state)))
        contract.write_safetensors(os.path.join(directory, contract.STATES_FILE), tensors)
        meta = contract.DumpMeta(
            rid=rid,
            num_tokens=len(computed_ids),
            prompt_tokens=prompt_tokens,
            cached_tokens=cached,
            hidden_size=self.hidden_size,
            dtype=self.dtype_name,
            num_layers=self.num_layers,
            aux_layer_ids=list(self.aux_layer_ids),
            hf_indices=list(self.hf_indices),
            engine=BACKEND,
            non_finite=non_finite,
            extra={"model_path": str(self.config.model_dir), "final_state": self.final_state},
        )
        contract.write_meta_atomically(directory, meta)


def tensor_bytes(tensor: torch.Tensor) -> bytes:
    """Raw little-endian bytes (the hosts hsx runs on are little-endian); bf16 as its 2-byte words."""
    tensor = tensor.contiguous()
    if tensor.dtype == torch.bfloat16:
        tensor = tensor.view(torch.int16)
    data: bytes = tensor.numpy().tobytes()
    return data


def _final_norm(model: PreTrainedModel) -> torch.nn.Module:
    """The decoder's final norm, whose input is the pre-norm final state."""
    decoder = getattr(model, "model", None) or getattr(model, "base_model", None)
    norm = getattr(decoder, "norm", None)
    if not isinstance(norm, torch.nn.Module):
        raise ValueError(f"{type(model).__name__}: no final norm found; --final-state pre/both needs one")
    return norm


def _cache_kwarg_name(model: PreTrainedModel) -> str:
    # transformers 5 renamed past_key_values to cache; the old name still works there but warns.
    parameters = inspect.signature(type(model).forward).parameters
    return "cache" if "cache" in parameters else "past_key_values"
