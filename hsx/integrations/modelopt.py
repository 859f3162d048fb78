"""NVIDIA ModelOpt's offline EAGLE layout, as its ``collect_hidden_states/compute_hidden_states_*.py``
scripts write it and ``modelopt.torch.speculative.eagle.utils.OfflineSupervisedDataset`` reads it
(nvidia-modelopt 0.47.0).

One ``torch.save`` file per sample, ``<conversation_id>.pt`` (here the dataset index, zero-padded to 8
digits as the scripts name unnamed conversations), holding ``input_ids`` [T] int64, ``hidden_states``
[T, H] (the final state), ``aux_hidden_states`` [T, A*H], ``loss_mask`` [T] int64 (read with
``answer_only_loss``) and ``conversation_id``. The training script finds them with ``rglob("*.pt")`` and
the dataset loads each with ``weights_only=True``.

``hidden_states`` is the post-norm state when the job has it. A job that captured only the pre-norm state
exports that one with ``hidden_states_prenorm: True``, the flag ModelOpt's dataset reads to re-apply the
base model's final norm.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from hsx.integrations.exports import ExportError, TargetWriter, write_file

if TYPE_CHECKING:
    from hsx.samples import TorchSample


class ModelOptWriter(TargetWriter):
    format = "modelopt"

    @staticmethod
    def relative_path(index: int) -> str:
        return f"{index:08d}.pt"

    def add(self, ordinal: int, sample: TorchSample) -> None:
        import torch

        prenorm = sample.hidden_state is None
        final = sample.final_pre_norm if prenorm else sample.hidden_state
        if final is None:
            raise ExportError(f"sample {sample.index} has no final state", error="export_not_possible")
        conversation_id = f"{sample.index:08d}"
        payload: dict[str, Any] = {
            "input_ids": sample.input_ids.to(torch.int64),
            "hidden_states": final,
            "aux_hidden_states": sample.aux_hidden_state,
            "loss_mask": sample.loss_mask.to(torch.int64),
            "conversation_id": conversation_id,
        }
        if prenorm:
            payload["hidden_states_prenorm"] = True
        relative = self.relative_path(sample.index)
        self.files.append(write_file(self.root, relative, lambda fh: torch.save(payload, fh)))

    def finish(self) -> dict[str, Any]:
        return {
            "layout": "<conversation_id>.pt (torch.save: input_ids, hidden_states [T,H], aux_hidden_states "
            "[T,A*H], loss_mask, conversation_id)",
            "hidden_states": "pre-norm (hidden_states_prenorm)"
            if self.manifest.final_state == "pre"
            else "post-norm",
            "offline_data_path": ".",
            "use": "data.offline_data_path = this folder; answer_only_loss to train on loss_mask",
        }

    def listed_samples(self) -> int:
        # ModelOpt's training script: Path(offline_data_path).rglob("*.pt").
        return sum(1 for _ in Path(self.root).rglob("*.pt"))
