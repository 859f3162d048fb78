"""vLLM speculators' offline layout, as ``speculators prepare-data`` and ``generate-offline-data`` write it
and ``speculators.train.data.ArrowDataset`` reads it (speculators 0.9.0, hs-connectors 0.9.0).

* the folder itself is a Hugging Face ``datasets`` folder (``save_to_disk`` layout: one Arrow stream file,
  ``dataset_info.json``, ``state.json`` with the torch format) with columns ``input_ids`` and ``loss_mask``
  (lists of int64) and ``seq_len``: row ``i`` is sample ``i``;
* ``hidden_states/hs_<i>.safetensors`` holds ``hidden_states`` [T, A+1, H] (the aux layers in order, then
  the final state *before* the norm, as vLLM hands it over) and ``token_ids`` [T] int64;
* ``token_freq.pt``: loss-bearing token counts, from which the trainer builds its draft vocabulary.

The dataset folder is written with pyarrow directly, so the export needs no ``datasets`` package.
The pre-norm state exists only when the job captured it (``final_state`` ``pre`` or ``both``); otherwise
the export is refused before anything is written.
"""

from __future__ import annotations

import json
import secrets
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from hsx.integrations.exports import (
    ExportError,
    ExportOptions,
    TargetWriter,
    WrittenFile,
    hash_existing,
    write_file,
)
from hsx.manifest import Manifest
from hsx.safetensors_io import encode_header

if TYPE_CHECKING:
    import pyarrow as pa
    import torch

    from hsx.samples import TorchSample

ARROW_FILE = "data-00000-of-00001.arrow"
HIDDEN_STATES_DIR = "hidden_states"
TOKEN_FREQ_FILE = "token_freq.pt"
_ROWS_PER_BATCH = 256
_FEATURES = {
    "input_ids": {"feature": {"dtype": "int64", "_type": "Value"}, "_type": "List"},
    "loss_mask": {"feature": {"dtype": "int64", "_type": "Value"}, "_type": "List"},
    "seq_len": {"dtype": "int64", "_type": "Value"},
}
_NUMPY_WORDS = {"BF16": np.int16, "F16": np.float16, "F32": np.float32}


def _dtype_name(tensor: torch.Tensor) -> str:
    import torch

    return {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32"}[tensor.dtype]


def _raw(tensor: torch.Tensor) -> memoryview:
    """The tensor's bytes without a copy (bf16 through its int16 words: numpy has no bf16)."""
    import torch

    if tensor.dtype == torch.bfloat16:
        tensor = tensor.view(torch.int16)
    array: Any = np.ascontiguousarray(tensor.numpy())
    return memoryview(array).cast("B")


class SpeculatorsWriter(TargetWriter):
    format = "speculators"

    def __init__(self, root: Path, manifest: Manifest, options: ExportOptions) -> None:
        import pyarrow as pa

        super().__init__(root, manifest, options)
        self.aux_layers = len(manifest.hf_indices) - 1
        self.token_freq: Counter[int] = Counter()
        self._pending: list[tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]] = []
        self._rows = 0
        info = json.dumps({"info": {"features": _FEATURES}}).encode()
        self.schema = pa.schema(
            [
                pa.field("input_ids", pa.list_(pa.int64())),
                pa.field("loss_mask", pa.list_(pa.int64())),
                pa.field("seq_len", pa.int64()),
            ],
            metadata={b"huggingface": info},
        )
        self._arrow = pa.OSFile(str(root / ARROW_FILE), "wb")
        self._stream = pa.ipc.new_stream(self._arrow, self.schema)

    @classmethod
    def refusal(cls, manifest: Manifest, options: ExportOptions) -> str | None:
        if manifest.final_state not in ("pre", "both"):
            return (
                "speculators trains on the final state before the norm (the last slot of its "
                "hidden_states, as vLLM hands it over), and this job captured only the post-norm state "
                f"(final_state {manifest.final_state!r}). Run the job again on an engine started with "
                "--final-state both (or pre)."
            )
        return None

    def add(self, ordinal: int, sample: TorchSample) -> None:
        import torch

        pre = getattr(sample, "final_pre_norm", None)
        if pre is None:
            raise ExportError(
                f"sample {sample.index} has no pre-norm final state; speculators needs it",
                error="export_not_possible",
            )
        tokens = int(sample.input_ids.numel())
        hidden = self.manifest.hidden_size
        aux = sample.aux_hidden_state.reshape(tokens, self.aux_layers, hidden)
        states = torch.cat([aux, pre.unsqueeze(1)], dim=1).contiguous()  # [T, A+1, H]
        token_ids = sample.input_ids.to(torch.int64).contiguous()
        # The tensor's own dtype: an fp8 job's states arrive dequantized to bf16 (speculators' reader has
        # no fp8; hs_connectors only writes its fp8 files).
        dtype = _dtype_name(states)
        header = encode_header(
            [
                ("hidden_states", dtype, list(states.shape), states.numel() * states.element_size()),
                ("token_ids", "I64", [tokens], tokens * 8),
            ]
        )

        def produce(fh: Any) -> None:
            fh.write(header)
            fh.write(_raw(states))
            fh.write(_raw(token_ids))

        self.files.append(write_file(self.root, f"{HIDDEN_STATES_DIR}/hs_{ordinal}.safetensors", produce))
        ids = sample.input_ids.numpy().astype(np.int64)
        mask = sample.loss_mask.numpy().astype(np.int64)
        selected, counts = np.unique(ids[mask.astype(bool)], return_counts=True)
        self.token_freq.update(dict(zip(selected.tolist(), counts.tolist(), strict=True)))
        self._pending.append((ids, mask))
        if len(self._pending) >= _ROWS_PER_BATCH:
            self._flush()

    def _flush(self) -> None:
        import pyarrow as pa

        if not self._pending:
            return
        lengths = np.array([len(ids) for ids, _ in self._pending], dtype=np.int64)
        offsets = pa.array(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))

        def column(part: int) -> pa.Array:
            values = pa.array(np.concatenate([row[part] for row in self._pending]))
            return pa.ListArray.from_arrays(offsets, values, type=pa.list_(pa.int64()))

        batch = pa.record_batch([column(0), column(1), pa.array(lengths)], schema=self.schema)
        self._stream.write_batch(batch)
        self._rows += len(self._pending)
        self._pending.clear()

    def finish(self) -> dict[str, Any]:
        import torch

        self._flush()
        self._stream.close()
        self._arrow.close()
        self.files.append(hash_existing(self.root, ARROW_FILE))
        state: dict[str, Any] = {
            "_data_files": [{"filename": ARROW_FILE}],
            "_fingerprint": secrets.token_hex(8),
            "_format_columns": None,
            "_format_kwargs": {},
            "_format_type": "torch",
            "_output_all_columns": False,
            "_split": None,
        }
        info = {"citation": "", "description": "", "features": _FEATURES, "homepage": "", "license": ""}
        for name, doc in (("state.json", state), ("dataset_info.json", info)):
            self.files.append(_write_json(self.root, name, doc))
        freq = dict(self.token_freq)
        self.files.append(write_file(self.root, TOKEN_FREQ_FILE, lambda fh: torch.save(freq, fh)))
        return {
            "layout": "datasets folder (input_ids, loss_mask, seq_len) + hidden_states/hs_<i>.safetensors "
            "(hidden_states [T, A+1, H] with the pre-norm final state last, token_ids) + token_freq.pt",
            "rows": self._rows,
            "data_path": ".",
            "use": "pass this folder as the trainer's data path; hidden states are read from "
            "hidden_states/ (hs_connectors FileTransfer)",
        }

    def listed_samples(self) -> int:
        # speculators.data_generation.offline.get_existing_hidden_state_indices, against the dataset rows.
        indices = set()
        folder = self.root / HIDDEN_STATES_DIR
        for path in folder.iterdir() if folder.is_dir() else ():
            if path.name.startswith("hs_") and path.name.endswith(".safetensors"):
                try:
                    indices.add(int(path.name[3 : -len(".safetensors")]))
                except ValueError:
                    continue
        return len(indices & set(range(self._rows)))


def _write_json(root: Path, name: str, doc: dict[str, Any]) -> WrittenFile:
    text = json.dumps(doc, indent=2, sort_keys=True).encode()
    return write_file(root, name, lambda fh: fh.write(text))
