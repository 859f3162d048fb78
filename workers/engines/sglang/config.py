"""The plugin's configuration and the SGLang versions it is proven on (standard library only).

The launcher builds a :class:`PluginConfig` and hands it to the spawned scheduler processes through
``HSX_SGLANG_*`` environment variables; each scheduler reads it back with :meth:`PluginConfig.from_env`.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

from hsx import contract, layout

ENGINE_NAME = "sglang"

# Plugin configuration, passed from the launcher to the spawned schedulers through the environment.
ENV_DUMP_DIR = "HSX_SGLANG_DUMP_DIR"
ENV_AUX_LAYERS = "HSX_SGLANG_AUX_LAYERS"  # comma-separated decoder layer ids; empty: EAGLE-3 default
ENV_PINNED_MB = "HSX_SGLANG_PINNED_MB"  # pinned host staging arena of each capturing scheduler
ENV_WRITERS = "HSX_SGLANG_WRITER_THREADS"
# How long the scheduler thread may hold the GIL before a writer thread gets it back (ms); 0 keeps Python's
# 5 ms. SGLang's scheduler loop runs Python without pause, so at 5 ms every writer syscall waited for it.
ENV_SWITCH_INTERVAL_MS = "HSX_SGLANG_SWITCH_INTERVAL_MS"
DEFAULT_WRITERS = 8  # 4 lagged the GPU on an 8B model (docs/sglang.md)
DEFAULT_SWITCH_INTERVAL_MS = 0.5
ENV_STATS_SECONDS = "HSX_SGLANG_STATS_SECONDS"  # period of the stats log line; 0 disables it
ENV_FINAL_STATE = "HSX_SGLANG_FINAL_STATE"  # post | pre | both (contract.FINAL_STATES)
ENV_ANY_VERSION = "HSX_SGLANG_ALLOW_ANY_VERSION"  # "1": the user overrode the version range
# "1": every node's dump dir is the directory the worker reads (--shared-dump-dir; multi-node DP attention).
ENV_SHARED_DUMP_DIR = "HSX_SGLANG_SHARED_DUMP_DIR"
# How long a multi-node launch waits for the other nodes' schedulers to say how they run (peers.py).
ENV_PEER_WAIT_SECONDS = "HSX_SGLANG_PEER_WAIT_SECONDS"
DEFAULT_PEER_WAIT_SECONDS = 300.0

SAFETENSORS_DTYPES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}

# The plugin reads private scheduler state (Req.origin_input_ids, prefix_lens/extend_lens, to_finish,
# cached_tokens) and patches private methods, so it runs only on the SGLang releases it was proven on:
# the lowest supported release, inclusive, and the first release past the range, exclusive.
SUPPORTED_MIN = (0, 5, 17)
SUPPORTED_BELOW = (0, 5, 18)
SUPPORTED_RANGE = ">=0.5.17,<0.5.18"
VERSION_OVERRIDE_FLAG = "--allow-unsupported-sglang-version"

_RELEASE = re.compile(r"^\s*v?(\d+)\.(\d+)\.(\d+)((?:\.\d+)*)(.*)$")


def parse_release(version: str) -> tuple[tuple[int, ...], bool] | None:
    """The release numbers of a version string and whether it is a final release (no rc/dev/alpha).

    ``0.5.17`` and ``0.5.17.post1`` are final; ``0.5.17rc1`` and ``0.5.17.dev3+g1234`` are not (they come
    before 0.5.17). A local build tag after ``+`` does not count. None when the text is no version.
    """
    match = _RELEASE.match(version)
    if match is None:
        return None
    numbers = tuple(int(x) for x in match.group(1, 2, 3)) + tuple(
        int(x) for x in match.group(4).split(".") if x
    )
    suffix = match.group(5).split("+", 1)[0].lower()
    final = suffix == "" or re.fullmatch(r"[.-]?post\d*", suffix) is not None
    return numbers, final


def version_problem(version: str | None) -> str | None:
    """Why this SGLang version is outside the supported range; None when it is inside."""
    if not version:
        return f"the SGLang version is unknown; the hsx plugin supports sglang{SUPPORTED_RANGE}"
    parsed = parse_release(version)
    if parsed is None:
        return f"SGLang version {version!r} is not a release number; supported: sglang{SUPPORTED_RANGE}"
    numbers, final = parsed
    release = numbers[:3]
    inside = SUPPORTED_MIN <= release < SUPPORTED_BELOW and (final or release > SUPPORTED_MIN)
    if inside:
        return None
    return (
        f"SGLang {version} is outside the range the hsx plugin is proven on (sglang{SUPPORTED_RANGE}); "
        f"install a supported release or pass {VERSION_OVERRIDE_FLAG} to run it anyway"
    )


def installed_sglang_version() -> str | None:
    """The installed SGLang's version, read from the package metadata (no import of sglang)."""
    from importlib import metadata

    try:
        return metadata.version("sglang")
    except metadata.PackageNotFoundError:
        return None


def parse_aux_layers(text: str | None) -> list[int] | None:
    """``"1,15,28"`` (or space-separated) as integers; None for an empty value (the EAGLE-3 default)."""
    if text is None or not text.strip():
        return None
    try:
        return [int(x) for x in text.replace(" ", ",").split(",") if x]
    except ValueError:
        raise ValueError(f"--aux-layers: expected comma-separated integers, got {text!r}") from None


@dataclass
class PluginConfig:
    dump_dir: str
    aux_layer_ids: list[int] | None = None
    pinned_mb: int = 2048
    writer_threads: int = DEFAULT_WRITERS
    switch_interval_ms: float = DEFAULT_SWITCH_INTERVAL_MS
    stats_seconds: float = 30.0
    final_state: str = "post"
    allow_any_version: bool = False
    shared_dump_dir: bool = False
    peer_wait_seconds: float = DEFAULT_PEER_WAIT_SECONDS

    def __post_init__(self) -> None:
        if self.final_state not in contract.FINAL_STATES:
            raise ValueError(f"final_state {self.final_state!r}: expected one of {contract.FINAL_STATES}")
        if self.pinned_mb < 1:
            raise ValueError(f"pinned_mb must be at least 1, got {self.pinned_mb}")
        if self.writer_threads < 1:
            raise ValueError(f"writer_threads must be at least 1, got {self.writer_threads}")
        if not 0 <= self.switch_interval_ms <= 100:
            raise ValueError(f"switch_interval_ms must be within 0..100, got {self.switch_interval_ms}")
        if self.peer_wait_seconds <= 0:
            raise ValueError(f"peer_wait_seconds must be positive, got {self.peer_wait_seconds}")

    def to_env(self) -> dict[str, str]:
        return {
            ENV_DUMP_DIR: self.dump_dir,
            ENV_AUX_LAYERS: ",".join(str(x) for x in self.aux_layer_ids or []),
            ENV_PINNED_MB: str(self.pinned_mb),
            ENV_WRITERS: str(self.writer_threads),
            ENV_SWITCH_INTERVAL_MS: str(self.switch_interval_ms),
            ENV_STATS_SECONDS: str(self.stats_seconds),
            ENV_FINAL_STATE: self.final_state,
            ENV_ANY_VERSION: "1" if self.allow_any_version else "0",
            ENV_SHARED_DUMP_DIR: "1" if self.shared_dump_dir else "0",
            ENV_PEER_WAIT_SECONDS: str(self.peer_wait_seconds),
        }

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> PluginConfig:
        env = os.environ if env is None else env
        dump_dir = env.get(ENV_DUMP_DIR, "")
        if not dump_dir:
            raise RuntimeError(
                f"hsx sglang plugin: {ENV_DUMP_DIR} is not set; start the server with "
                "`python -m workers.engines.sglang.launcher` (or `hsx engine --backend sglang`)"
            )
        return cls(
            dump_dir=dump_dir,
            aux_layer_ids=parse_aux_layers(env.get(ENV_AUX_LAYERS, "")),
            pinned_mb=int(env.get(ENV_PINNED_MB, "2048")),
            writer_threads=int(env.get(ENV_WRITERS, str(DEFAULT_WRITERS))),
            switch_interval_ms=float(env.get(ENV_SWITCH_INTERVAL_MS, str(DEFAULT_SWITCH_INTERVAL_MS))),
            stats_seconds=float(env.get(ENV_STATS_SECONDS, "30")),
            final_state=env.get(ENV_FINAL_STATE, "post") or "post",
            allow_any_version=env.get(ENV_ANY_VERSION, "0") == "1",
            shared_dump_dir=env.get(ENV_SHARED_DUMP_DIR, "0") == "1",
            peer_wait_seconds=float(env.get(ENV_PEER_WAIT_SECONDS, str(DEFAULT_PEER_WAIT_SECONDS))),
        )


def dump_tensor_names(hf_indices: list[int], final_state: str) -> list[str]:
    """The hidden-state tensors of a dump, in capture order: the aux layers, then the final state(s).

    ``hf_indices`` keeps the contract's meaning whatever the final state (aux layers, then ``N``); with
    ``pre`` the dump holds :data:`contract.PRE_NORM_TENSOR` in place of ``hidden.<N>``.
    """
    return layout.state_tensor_names(hf_indices, final_state)
