"""``hsx verify --job`` on an fp8 job: re-prefill a few of its samples and hold the stored (dequantized)
states to the documented bound of the engine's own (``hsx.fp8.DOCUMENTED_*``; docs/format.md).

Each checked sample is sent again under a fresh rid, its dump read whole, and every stored tensor (each aux
layer, the final state(s)) compared token by token: the smallest cosine and the largest relative L2 error
must stay within the bound. A different engine (or model) than the job's fails here, as it should.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from hsx import contract, fp8
from hsx.engine.client import DumpMissing, EngineClient, EngineError
from hsx.engine.dumps import as_float32, delete_dump, open_dump
from hsx.engine.validation import Check
from hsx.layout import state_tensor_names
from hsx.server.job_options import JobOptions

DEFAULT_SAMPLES = 3


def token_errors(stored: npt.NDArray[np.float32], engine: npt.NDArray[np.float32]) -> tuple[float, float]:
    """The smallest per-token cosine and the largest per-token relative L2 error (all-zero tokens skipped)."""
    x = engine.astype(np.float64)
    y = stored.astype(np.float64)
    norm = np.linalg.norm(x, axis=1)
    keep = norm > 0
    if not keep.any():
        return 1.0, 0.0
    other = np.linalg.norm(y, axis=1)[keep]
    cosine = (x * y).sum(axis=1)[keep] / np.maximum(norm[keep] * other, np.finfo(np.float64).tiny)
    relative = np.linalg.norm(y - x, axis=1)[keep] / norm[keep]
    return float(cosine.min()), float(relative.max())


def fp8_job_checks(
    client: EngineClient,
    info: contract.EngineInfo,
    dump_dir: str,
    job: Mapping[str, Any],
    samples: int = DEFAULT_SAMPLES,
    dump_wait_seconds: float = 30.0,
) -> list[Check]:
    """The checks for an fp8 job (none for another job): its first ``samples`` stored samples against
    the engine's states for the same tokens."""
    if not JobOptions.from_stored(job.get("options")).stores_fp8:
        return []
    from hsx.loader import LoaderError, OutputReader
    from hsx.manifest import ManifestError

    try:
        reader = OutputReader(Path(str(job.get("output_dir", ""))), verify_checksums=True)
    except (ManifestError, LoaderError, OSError) as exc:
        return [Check("fp8.output", False, "the job's manifest and shards", str(exc))]
    manifest = reader.manifest
    names = state_tensor_names(manifest.hf_indices, manifest.final_state)
    bound = f"cos >= {fp8.DOCUMENTED_MIN_COSINE}, rel L2 <= {fp8.DOCUMENTED_MAX_REL_L2}"
    checks: list[Check] = []
    for position in range(min(samples, len(reader))):
        try:
            sample = reader[position]
            stored = _stored_tensors(sample, names, manifest.hidden_size)
        except LoaderError as exc:
            checks.append(Check(f"fp8.sample_{position}", False, "a readable sample", str(exc)))
            continue
        rid = f"{contract.RID_PREFIX}verify-fp8-{uuid.uuid4().hex[:12]}-s{sample.index}"
        label = f"fp8.sample_{sample.index}"
        try:
            client.prefill([int(t) for t in sample.input_ids], rid)
            with open_dump(dump_dir, rid, dump_wait_seconds) as dump:
                specs = dump.state_specs()
                for name in names:
                    if name not in specs:
                        checks.append(Check(f"{label}.{name}", False, "in the engine's dump", "missing"))
                        continue
                    engine = as_float32(dump.read_state(name), specs[name].dtype)
                    cosine, relative = token_errors(stored[name], engine)
                    ok = cosine >= fp8.DOCUMENTED_MIN_COSINE and relative <= fp8.DOCUMENTED_MAX_REL_L2
                    actual = f"min cos {cosine:.6f}, max rel L2 {relative:.4f}"
                    checks.append(Check(f"{label}.{name}", ok, bound, actual))
        except (EngineError, DumpMissing) as exc:
            checks.append(Check(f"{label}.prefill", False, "the engine's states of the sample", str(exc)))
        finally:
            delete_dump(dump_dir, rid)
    if not checks:
        checks.append(Check("fp8.samples", False, "at least one stored sample", "the job stored none"))
    return checks


def _stored_tensors(sample: Any, names: list[str], hidden: int) -> dict[str, npt.NDArray[np.float32]]:
    """A loaded (dequantized) sample's tensors by their dump names."""
    aux = [name for name in names if name.startswith("hidden.")][: sample.aux_hidden_state.shape[1] // hidden]
    tensors = {name: sample.aux_hidden_state[:, i * hidden : (i + 1) * hidden] for i, name in enumerate(aux)}
    rest = [name for name in names if name not in tensors]
    for name in rest:
        tensors[name] = sample.final_pre_norm if name == contract.PRE_NORM_TENSOR else sample.hidden_state
    return tensors
