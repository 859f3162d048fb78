"""SpecForge's offline EAGLE-3 layout, as its ``scripts/prepare_hidden_states.py`` writes it and
``specforge.runtime.data_plane.offline_reader`` reads it (SpecForge 0.2.0).

One ``torch.save`` file per sample, ``rows_<g>-<g+N>/data_<index>.ckpt`` (``N`` samples per folder, 2000 by
default), holding ``input_ids`` [T] int64, ``loss_mask`` [T] int64, ``hidden_state`` [1, T, H] (the final
post-norm state, the trainer's target) and ``aux_hidden_state`` [1, T, A*H], in the shard's dtype. The
reader walks the folder for ``.ckpt`` files in sorted path order and ``torch.load``s each with ``mmap``.

With a draft vocabulary size, ``vocab_mapping/vocab_mapping.pt`` (``d2t``, ``t2d``) is written too: the
mapping SpecForge's trainer would otherwise build before its first step by reading every file
(``training.vocab_mapping.count_effective_feature_tokens`` then
``data.preprocessing.process_token_dict_to_mappings``). It is computed the same way, ties included: the
trainer's ``Counter`` meets token ids in sorted file order and, within a file, in ascending id order, and
``most_common`` keeps that order among equal counts, so the counts here are replayed in that order.
Point the trainer's ``model.vocab_mapping_path`` at the file.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from hsx.integrations.exports import ExportError, ExportOptions, TargetWriter, write_file
from hsx.manifest import Manifest

if TYPE_CHECKING:
    import torch

    from hsx.samples import TorchSample

VOCAB_MAPPING_FILE = "vocab_mapping/vocab_mapping.pt"
_FEATURE_SUFFIXES = (".ckpt", ".ckpt.gz")


def model_vocab_size(manifest: Manifest) -> int | None:
    """``vocab_size`` from the target model's config.json (text_config for multimodal models), if readable.

    This, not the tokenizer's size, is the length of the trainer's ``t2d``: embeddings are often padded.
    """
    try:
        config = json.loads((Path(manifest.model.path) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if isinstance(config.get("text_config"), dict) and "vocab_size" in config["text_config"]:
        config = config["text_config"]
    size = config.get("vocab_size")
    return size if isinstance(size, int) and size > 0 else None


def target_vocab_size(manifest: Manifest, options: ExportOptions) -> int | None:
    return options.target_vocab_size or model_vocab_size(manifest)


class VocabCounter:
    """Loss-bearing token counts, replayable in the order SpecForge's trainer would first meet them."""

    def __init__(self, max_length: int | None, vocab_size: int) -> None:
        self.max_length = max_length
        self.vocab_size = vocab_size
        self.counts: Counter[int] = Counter()
        self.first_file: dict[int, str] = {}

    def add(self, relative_path: str, input_ids: npt.NDArray[Any], loss_mask: npt.NDArray[Any]) -> None:
        if self.max_length is not None:
            input_ids, loss_mask = input_ids[: self.max_length], loss_mask[: self.max_length]
        tokens, frequencies = np.unique(input_ids[loss_mask.astype(bool)], return_counts=True)
        if len(tokens) and int(tokens[-1]) >= self.vocab_size:
            raise ExportError(
                f"{relative_path} holds token id {int(tokens[-1])}, outside the target vocabulary of "
                f"{self.vocab_size}",
                error="export_vocab_mismatch",
            )
        for token, frequency in zip(tokens.tolist(), frequencies.tolist(), strict=True):
            self.counts[token] += frequency
            first = self.first_file.get(token)
            if first is None or relative_path < first:
                self.first_file[token] = relative_path

    def in_trainer_order(self) -> Counter[int]:
        # Paths share the export root, so comparing them relative is comparing SpecForge's absolute paths.
        ordered: Counter[int] = Counter()
        for token in sorted(self.counts, key=lambda t: (self.first_file[t], t)):
            ordered[token] = self.counts[token]
        return ordered


def vocab_mapping(
    token_counts: Counter[int], draft_vocab_size: int, target_vocab_size: int
) -> tuple[torch.Tensor, torch.Tensor, float]:
    """``(d2t, t2d, top_ratio)`` exactly as SpecForge's ``process_token_dict_to_mappings`` builds them.

    The same steps in the same order (filling from ``set(range(draft)) - existing``, ``most_common``, the
    sort), so equal counts break the same way; ``t2d`` is tested against a set, same result.
    """
    import torch

    token_dict = Counter(token_counts)
    if len(token_dict) < draft_vocab_size:
        existing_tokens = set(token_dict.keys())
        missing_tokens = set(range(draft_vocab_size)) - existing_tokens
        for token in missing_tokens:
            token_dict[token] = 0
            if len(token_dict) >= draft_vocab_size:
                break
    total = sum(token_dict.values())
    top = token_dict.most_common(draft_vocab_size)
    ratio = sum(freq for _, freq in top) / total if total else 0.0
    used_tokens = sorted(key for key, _ in top)
    used = set(used_tokens)
    d2t = torch.tensor([used_tokens[i] - i for i in range(len(used_tokens))])
    t2d = torch.tensor([i in used for i in range(target_vocab_size)])
    return d2t, t2d, ratio


class SpecForgeWriter(TargetWriter):
    format = "specforge"

    def __init__(self, root: Path, manifest: Manifest, options: ExportOptions) -> None:
        super().__init__(root, manifest, options)
        self.vocab: VocabCounter | None = None
        if options.draft_vocab_size is not None:
            size = target_vocab_size(manifest, options)
            if size is None:
                raise ExportError("the target vocabulary size is unknown; pass target_vocab_size")
            self.vocab = VocabCounter(options.vocab_max_length, size)

    @classmethod
    def refusal(cls, manifest: Manifest, options: ExportOptions) -> str | None:
        if manifest.final_state == "pre":
            return (
                "SpecForge's EAGLE-3 trainer takes the final post-norm state as its target (hidden_state); "
                "this job captured only the pre-norm one (final_state 'pre'). Run the job again with the "
                "post-norm state captured (final_state 'post' or 'both')."
            )
        draft = options.draft_vocab_size
        if draft is None:
            return None
        if draft < 1:
            return "draft_vocab_size must be positive"
        target = target_vocab_size(manifest, options)
        if target is None:
            return (
                f"the target vocabulary size is needed for the vocab mapping (t2d's length) and "
                f"{manifest.model.path}/config.json cannot be read here; pass target_vocab_size"
            )
        if draft > target:
            return f"draft_vocab_size {draft} is larger than the target vocabulary ({target})"
        if options.vocab_max_length is not None and options.vocab_max_length < 1:
            return "vocab_max_length must be positive"
        return None

    def relative_path(self, index: int) -> str:
        size = self.options.group_size
        group = (index // size) * size
        return f"rows_{group}-{group + size}/data_{index}.ckpt"

    def add(self, ordinal: int, sample: TorchSample) -> None:
        import torch

        if sample.hidden_state is None:
            raise ExportError(
                f"sample {sample.index} has no post-norm final state", error="export_not_possible"
            )
        relative = self.relative_path(sample.index)
        payload = {
            "input_ids": sample.input_ids.to(torch.int64),
            "loss_mask": sample.loss_mask.to(torch.int64),
            "hidden_state": sample.hidden_state.unsqueeze(0),
            "aux_hidden_state": sample.aux_hidden_state.unsqueeze(0),
        }
        self.files.append(write_file(self.root, relative, lambda fh: torch.save(payload, fh)))
        if self.vocab is not None:
            self.vocab.add(relative, sample.input_ids.numpy(), sample.loss_mask.numpy())

    def finish(self) -> dict[str, Any]:
        import torch

        report: dict[str, Any] = {
            "layout": "rows_<g>-<g+N>/data_<index>.ckpt (torch.save: input_ids, loss_mask, hidden_state "
            "[1,T,H] post-norm, aux_hidden_state [1,T,A*H])",
            "group_size": self.options.group_size,
            "hidden_states_path": ".",
            "vocab_mapping": None,
        }
        if self.vocab is not None and self.options.draft_vocab_size is not None:
            d2t, t2d, ratio = vocab_mapping(
                self.vocab.in_trainer_order(), self.options.draft_vocab_size, self.vocab.vocab_size
            )
            mapping = {"d2t": d2t, "t2d": t2d}
            self.files.append(write_file(self.root, VOCAB_MAPPING_FILE, lambda fh: torch.save(mapping, fh)))
            report["vocab_mapping"] = {
                "path": VOCAB_MAPPING_FILE,
                "draft_vocab_size": self.options.draft_vocab_size,
                "target_vocab_size": self.vocab.vocab_size,
                "max_length": self.options.vocab_max_length,
                "distinct_tokens": len(self.vocab.counts),
                "top_frequency_ratio": round(ratio, 6),
                "use": "set model.vocab_mapping_path to this file",
            }
        return report

    def listed_samples(self) -> int:
        # specforge.runtime.data_plane.offline_reader.list_feature_files: every .ckpt / .ckpt.gz below root.
        return sum(
            1 for _, _, names in os.walk(self.root) for name in names if name.endswith(_FEATURE_SUFFIXES)
        )
