"""A synthetic engine for benchmarks and scale tests: the hsx engine protocol (hsx/contract.py) exactly,
with states from a cheap deterministic pattern instead of a model.

It answers ``/generate`` like SGLang (``cached_tokens`` always 0, no prefix cache), writes contract-exact
dumps for ``hsx-`` rids (``input_ids`` and one tensor per captured layer, ``meta.json`` last, with its own
count of non-finite values), and reports ``backend: synthetic`` in ``/hsx/info`` so a job made with it
says so in its manifest. The row of token ``t`` in the tensor of HF index ``l`` is row ``(t + 31 l) % 256``
of a fixed table of finite bf16 values: the bytes cost only memory bandwidth, so what is measured behind it
is the worker side. No torch.

Generation (regeneration's ``/generate`` with ``max_new_tokens``; :func:`synthetic_generation`) is as cheap
and as deterministic: the tokens come from a hash of the prompt, the engine's seed and, when sampling,
the request's ``sampling_seed``. A greedy request gives the same tokens every time; a sampled one without
a seed (or with ``honour_sampling_seed`` off, as SGLang without ``--enable-deterministic-inference``) new
tokens every time, so tests can tell a kept text from a second generation.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from hsx import contract
from hsx.engine import regenerate_contract as engine_contract
from hsx.engine.model_identity import fingerprint_of
from hsx.engine.regenerate_contract import FinishReason, GenerationParams
from hsx.safetensors_io import encode_header

log = logging.getLogger(__name__)

BACKEND = "synthetic"
PATTERN_ROWS = 256
ROWS_PER_WRITE = 256
FIRST_PLAIN_TOKEN = 3  # below it: the special tokens of the usual tokenizers (SmolLM2's 0, 1, 2)


@dataclass(frozen=True)
class SyntheticConfig:
    hidden_size: int
    num_layers: int
    dump_dir: str
    model_path: str = ""  # a tokenizer directory, for jobs that apply a chat template
    aux_layer_ids: list[int] | None = None
    final_state: str = "post"
    # Another seed is another "checkpoint" of the same shape: other states, another fingerprint.
    seed: int = 7
    context_length: int = 32768
    # What /hsx/info says the states are; dumps are bf16 whatever it says. Anything else makes an engine
    # that breaks the protocol, which tests use to show a worker refusing it.
    reported_dtype: str = "bfloat16"
    # Generation: tokens are drawn from [FIRST_PLAIN_TOKEN, vocab_size) less the stop tokens; a generation
    # "wants" 1 to generation_span tokens and ends on eos_token_id when max_new_tokens lets it.
    vocab_size: int = 49152
    eos_token_id: int = 2
    generation_span: int = 64
    honour_sampling_seed: bool = True
    # The largest dump it writes (None: its dump directory's file system). A larger one is answered and
    # never written, as the SGLang plugin's writer fails after the answer on a dump it cannot hold.
    max_dump_bytes: int | None = None
    # The longest prompt it takes when shorter than the context (SGLang's KV pool and scheduler margin).
    max_prompt_tokens: int | None = None


def pattern_table(hidden_size: int, seed: int = 7) -> npt.NDArray[np.uint16]:
    """bf16 words of finite values in [-2, 2): the float32 bits' upper halves."""
    values = np.random.default_rng(seed).uniform(-2.0, 2.0, size=(PATTERN_ROWS, hidden_size))
    return (values.astype(np.float32).view(np.uint32) >> np.uint32(16)).astype(np.uint16)


class SyntheticEngine:
    def __init__(self, config: SyntheticConfig) -> None:
        if config.hidden_size < 1:
            raise ValueError("hidden size must be positive")
        if config.final_state not in contract.FINAL_STATES:
            raise ValueError(f"final state must be one of {contract.FINAL_STATES}")
        if not 0 <= config.eos_token_id < config.vocab_size or config.vocab_size <= FIRST_PLAIN_TOKEN + 1:
            raise ValueError(
                f"eos token {config.eos_token_id} must be in a vocabulary of {config.vocab_size}"
            )
        if config.generation_span < 1:
            raise ValueError("generation span must be positive")
        self.config = config
        aux = config.aux_layer_ids or contract.eagle3_aux_layer_ids(config.num_layers)
        self.aux_layer_ids = list(aux)
        self.hf_indices = contract.hf_indices(self.aux_layer_ids, config.num_layers)
        self.table = pattern_table(config.hidden_size, config.seed)
        self.fingerprint = fingerprint_of(
            {
                "backend": BACKEND,
                "hidden_size": config.hidden_size,
                "num_layers": config.num_layers,
                "seed": config.seed,
                "pattern_rows": PATTERN_ROWS,
            }
        )
        os.makedirs(config.dump_dir, exist_ok=True)
        self.max_dump_bytes = config.max_dump_bytes or contract.dump_dir_capacity(config.dump_dir)

    def prompt_limit(self) -> int:
        """The longest prompt it takes."""
        return min(self.config.context_length, self.config.max_prompt_tokens or self.config.context_length)

    def tensor_names(self) -> list[tuple[str, int]]:
        """(dump tensor name, HF index whose pattern fills it)."""
        names = [(contract.tensor_name(i), i) for i in self.hf_indices[:-1]]
        final = self.hf_indices[-1]
        if self.config.final_state in ("post", "both"):
            names.append((contract.tensor_name(final), final))
        if self.config.final_state in ("pre", "both"):
            names.append((contract.PRE_NORM_TENSOR, final + 1))
        return names

    def info(self) -> contract.EngineInfo:
        return contract.EngineInfo(
            backend=BACKEND,
            model_path=self.config.model_path,
            num_layers=self.config.num_layers,
            hidden_size=self.config.hidden_size,
            dtype=self.config.reported_dtype,
            aux_layer_ids=self.aux_layer_ids,
            hf_indices=self.hf_indices,
            dump_dir=self.config.dump_dir,
            prefix_cache=False,
            final_state=self.config.final_state,
            extra={
                "pattern": f"table[(token + 31 * hf_index) % {PATTERN_ROWS}]",
                "seed": self.config.seed,
                contract.MODEL_FINGERPRINT: self.fingerprint,
                engine_contract.SEEDED_SAMPLING: self.config.honour_sampling_seed,
            },
            context_length=self.config.context_length,
            max_dump_bytes=self.max_dump_bytes,
            max_prompt_tokens=self.config.max_prompt_tokens,
        )

    def prefill(self, input_ids: list[int], rid: str) -> None:
        """Write the dump of a captured request (others leave no trace)."""
        if not contract.is_captured_rid(rid):
            return
        size = contract.dump_bytes(len(input_ids), self.config.hidden_size, len(self.tensor_names()), 2)
        if self.max_dump_bytes and size > self.max_dump_bytes:
            log.error("dump of %s not written: %d bytes, at most %d", rid, size, self.max_dump_bytes)
            return
        directory = contract.dump_path(self.config.dump_dir, rid)
        os.makedirs(directory, exist_ok=False)
        try:
            self._write_states(os.path.join(directory, contract.STATES_FILE), input_ids)
            meta = contract.DumpMeta(
                rid=rid,
                num_tokens=len(input_ids),
                prompt_tokens=len(input_ids),
                cached_tokens=0,
                hidden_size=self.config.hidden_size,
                dtype="bfloat16",
                num_layers=self.config.num_layers,
                aux_layer_ids=self.aux_layer_ids,
                hf_indices=self.hf_indices,
                engine=BACKEND,
                non_finite={name: 0 for name, _ in self.tensor_names()},
            )
            contract.write_meta_atomically(directory, meta)
        except BaseException:
            shutil.rmtree(directory, ignore_errors=True)
            raise

    def generate(self, input_ids: list[int], params: GenerationParams) -> tuple[list[int], FinishReason]:
        """The synthetic continuation of ``input_ids`` (see :func:`synthetic_generation`)."""
        seed = params.seed if self.config.honour_sampling_seed else None
        return synthetic_generation(self.config, input_ids, params, seed)

    def _write_states(self, path: str, input_ids: list[int]) -> None:
        ids = np.asarray(input_ids, dtype="<i4")
        tokens, hidden = len(ids), self.config.hidden_size
        names = self.tensor_names()
        entries = [("input_ids", "I32", [tokens], ids.nbytes)]
        entries += [(name, "BF16", [tokens, hidden], tokens * hidden * 2) for name, _ in names]
        rows = np.empty((min(tokens, ROWS_PER_WRITE), hidden), dtype="<u2")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            _write_all(fd, encode_header(entries))
            _write_all(fd, ids.tobytes())
            for _name, hf_index in names:
                pattern = (ids.astype(np.int64) + 31 * hf_index) % PATTERN_ROWS
                for start in range(0, tokens, ROWS_PER_WRITE):
                    part = pattern[start : start + ROWS_PER_WRITE]
                    np.take(self.table, part, axis=0, out=rows[: len(part)])
                    _write_all(fd, rows[: len(part)].data.cast("B"))
        finally:
            os.close(fd)


def _write_all(fd: int, data: bytes | memoryview) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def expected_state(
    table: npt.NDArray[np.uint16], input_ids: npt.NDArray[np.integer], hf_index: int
) -> npt.NDArray[np.uint16]:
    """What the engine writes for one tensor: tests compare shards with it."""
    return table[(np.asarray(input_ids, dtype=np.int64) + 31 * hf_index) % PATTERN_ROWS]


def synthetic_generation(
    config: SyntheticConfig, input_ids: list[int], params: GenerationParams, seed: int | None
) -> tuple[list[int], FinishReason]:
    """The generated tokens and why they ended: ``min(wanted, max_new_tokens)`` tokens, where ``wanted``
    in ``[1, generation_span]`` comes from the same hash; the last is ``eos_token_id`` when ``wanted`` fits.

    Greedy (temperature below SGLang's epsilon): a function of the prompt and the engine's seed. Sampled:
    of those and ``seed``; with no seed, of fresh random bytes (every call differs)."""
    key = hashlib.sha256()
    key.update(f"hsx-synthetic-generation:{config.seed}:".encode())
    key.update(np.asarray(input_ids, dtype="<i8").tobytes())
    if not params.greedy:
        # top_p and temperature shape a real distribution; here they only make another draw.
        key.update(f":{params.temperature!r}:{params.top_p!r}:".encode())
        key.update(str(seed).encode() if seed is not None else os.urandom(16))
    stream = np.random.default_rng(np.frombuffer(key.digest(), dtype="<u4"))
    wanted = 1 + int(stream.integers(config.generation_span))
    stops = {config.eos_token_id, *params.stop_token_ids}
    count = min(wanted, params.max_new_tokens)
    # Always the whole span, so a shorter max_new_tokens cuts the same generation rather than drawing another.
    drawn = stream.integers(FIRST_PLAIN_TOKEN, config.vocab_size, size=config.generation_span)[:count]
    tokens = [_not_a_stop(int(token), stops, config.vocab_size) for token in drawn]
    if wanted <= params.max_new_tokens:
        return [*tokens[:-1], config.eos_token_id], "stop"
    return tokens, "length"


def _not_a_stop(token: int, stops: set[int], vocab_size: int) -> int:
    """``token``, or the next plain token that is no stop token (a drawn stop would end the turn)."""
    span = vocab_size - FIRST_PLAIN_TOKEN
    for step in range(span):
        candidate = FIRST_PLAIN_TOKEN + (token - FIRST_PLAIN_TOKEN + step) % span
        if candidate not in stops:
            return candidate
    raise ValueError("every token of the vocabulary is a stop token")
