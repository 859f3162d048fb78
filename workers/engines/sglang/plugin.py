"""Hidden-state capture inside a stock SGLang (0.5.17) scheduler process: the plugin's public face.

The launcher passes :func:`run_scheduler_process` to ``launch_server(run_scheduler_process_func=...)``.
The plugin is split so that a reader can take one part at a time:

* :mod:`.config`: the configuration handed to the schedulers, the supported SGLang versions;
* :mod:`.guards`: configurations the capture cannot follow (deferred all-reduce, speculative decoding, ...);
* :mod:`.layouts`: parallel layouts: which ranks capture, which layouts are refused;
* :mod:`.peers`: a multi-node launch checks that every node runs the hsx launcher with the same flags;
* :mod:`.launch_args`: the launcher's argument handling;
* :mod:`.patching`: the scheduler entry point and the patches of SGLang's classes;
* :mod:`.capture`: the module hooks and the per-forward plans and copies;
* :mod:`.planning`: which batch rows belong to captured requests (chunks, restarts, aborts);
* :mod:`.arena`: the pinned host ring the copies land in;
* :mod:`.reassembly`: chunked prompts gathered in order;
* :mod:`.writer`: the writer threads and the dump files.

Only ``hsx.contract`` is imported from hsx; torch and sglang are imported lazily (this module is also
imported by the launcher process, which must stay light).
"""

from __future__ import annotations

from workers.engines.sglang.config import (
    DEFAULT_PEER_WAIT_SECONDS,
    ENGINE_NAME,
    ENV_AUX_LAYERS,
    ENV_DUMP_DIR,
    ENV_FINAL_STATE,
    ENV_PEER_WAIT_SECONDS,
    ENV_PINNED_MB,
    ENV_STATS_SECONDS,
    ENV_WRITERS,
    SAFETENSORS_DTYPES,
    SUPPORTED_RANGE,
    PluginConfig,
)
from workers.engines.sglang.guards import unsupported_config
from workers.engines.sglang.patching import run_scheduler_process

__all__ = [
    "DEFAULT_PEER_WAIT_SECONDS",
    "ENGINE_NAME",
    "ENV_AUX_LAYERS",
    "ENV_DUMP_DIR",
    "ENV_FINAL_STATE",
    "ENV_PEER_WAIT_SECONDS",
    "ENV_PINNED_MB",
    "ENV_STATS_SECONDS",
    "ENV_WRITERS",
    "SAFETENSORS_DTYPES",
    "SUPPORTED_RANGE",
    "PluginConfig",
    "run_scheduler_process",
    "unsupported_config",
]
