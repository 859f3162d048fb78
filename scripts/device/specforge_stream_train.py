"""A few EAGLE-3 optimizer steps of SpecForge 0.2.0's own draft model, fed through SpecForge's own stream
classes from what hsx's feeder writes: the part of docs/streaming.md's SpecForge section that cannot
run on CPU (SpecForge's EAGLE-3 loss is a Triton kernel).

    python3 scripts/device/specforge_stream_train.py OUTPUT_DIR MODEL_DIR [STEPS] [WORK_DIR]

OUTPUT_DIR is a finished hsx job's output (e.g. from scripts/device/run_job_e2e.sh), MODEL_DIR its target
model. The job's samples are written into a StreamingRefChannel and a SharedDirFeatureStore with the
feeder's own writer (hsx.integrations.specforge.feed_layout, as ``hsx feed specforge`` writes them for a
running job), the channel is closed, and SpecForge's FeatureDataLoader (StreamingRefQueue +
SharedDirFeatureStore + the EAGLE-3 streaming collator) feeds Eagle3TrainStrategy for STEPS steps (the
stream is read again while steps are left). Needs specforge 0.2.0 and triton (CUDA torch brings it).
Prints one JSON line: the losses, whether all are finite, whether the last third's mean is below the first.
"""

from __future__ import annotations

import json
import math
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from transformers import AutoConfig, LlamaConfig

from hsx.loader import OutputReader
from hsx.manifest import Manifest
from hsx.integrations.specforge import feed_layout as layout


def feed_finished(output_dir: Path, work: Path, tag: str) -> tuple[Path, Path]:
    """The job's samples as the feeder writes them, then the channel's close sentinel."""
    manifest = Manifest.load(output_dir)
    channel = layout.RefChannel(work / tag / "refs.jsonl")
    features = layout.FeatureDir(work / "features", tag)
    for sample in OutputReader(output_dir, verify_checksums=True, raw_bf16=True):
        sid = layout.sample_id(manifest.job_id, sample.index)
        tensors = layout.eagle3_tensors(sample, manifest.dtype)
        features.write(sid, tensors)
        channel.append(
            [layout.sample_ref(sid, features, tensors, manifest.job_id, {"hsx_job": manifest.job_id})]
        )
    features.sync()
    channel.close()
    return channel.path, work / "features"


def target_head(model_dir: str, device: str) -> torch.nn.Module:
    """SpecForge's TargetHead with the lm_head weight, or the embedding where the model ties them (its
    from_pretrained wants a sharded checkpoint's index and an untied lm_head.weight)."""
    from specforge.modeling.target.target_head import TargetHead

    head = TargetHead(model_dir)
    weight = None
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as fh:
            for key in ("lm_head.weight", "model.embed_tokens.weight"):
                if key in fh.keys() and (weight is None or key == "lm_head.weight"):  # noqa: SIM118 - no __contains__
                    weight = fh.get_tensor(key)
    assert weight is not None, f"no lm_head or embedding in {model_dir}"
    head.fc.weight.data.copy_(weight)
    head.freeze_weights()
    moved: torch.nn.Module = head.eval().to(device=device, dtype=torch.bfloat16)
    return moved


def main(output_dir: str, model_dir: str, steps: int, work_dir: str | None) -> None:
    from specforge.algorithms.eagle3.model import OnlineEagle3Model
    from specforge.algorithms.eagle3.providers import algorithm_providers
    from specforge.modeling.auto import AutoDraftModel
    from specforge.runtime.contracts import TrainBatch
    from specforge.runtime.data_plane.disaggregated import SharedDirFeatureStore
    from specforge.runtime.data_plane.feature_dataloader import FeatureDataLoader
    from specforge.runtime.data_plane.streaming_ref_channel import StreamingRefChannel, StreamingRefQueue
    from specforge.training.strategies.base import Eagle3TrainStrategy

    device = "cuda" if torch.cuda.is_available() else "cpu"
    work = Path(work_dir or tempfile.mkdtemp(prefix="specforge-stream-"))
    target = AutoConfig.from_pretrained(model_dir)
    draft_fields: dict[str, Any] = dict(
        architectures=["LlamaForCausalLMEagle3"],
        hidden_size=target.hidden_size,
        num_hidden_layers=1,
        num_attention_heads=target.num_attention_heads,
        num_key_value_heads=target.num_key_value_heads,
        head_dim=getattr(target, "head_dim", None) or target.hidden_size // target.num_attention_heads,
        intermediate_size=target.intermediate_size,
        vocab_size=target.vocab_size,
        draft_vocab_size=target.vocab_size,
        max_position_embeddings=target.max_position_embeddings,
        rms_norm_eps=target.rms_norm_eps,
        rope_theta=getattr(target, "rope_theta", 10000.0),
        hidden_act="silu",
        pad_token_id=target.pad_token_id,
        tie_word_embeddings=False,
    )
    draft_config = LlamaConfig(**draft_fields)
    torch.manual_seed(0)
    draft = AutoDraftModel.from_config(draft_config, attention_backend="sdpa", torch_dtype=torch.bfloat16)
    draft.freeze_embedding()
    model = OnlineEagle3Model(draft_model=draft, length=3, attention_backend="sdpa").to(device)
    strategy = Eagle3TrainStrategy(model, target_head=target_head(model_dir, device))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    collate = algorithm_providers().server_streaming_for("text").build_collator()
    losses: list[float] = []
    rounds = 0
    while len(losses) < steps:
        rounds += 1
        channel_path, store_root = feed_finished(Path(output_dir), work, f"round{rounds}")
        queue = StreamingRefQueue(StreamingRefChannel(str(channel_path)), poll_s=0.05, idle_timeout_s=60)
        store = SharedDirFeatureStore(str(store_root), store_id=f"round{rounds}")
        for batch in FeatureDataLoader(store, queue, batch_size=1, collate_fn=collate, strategy="eagle3"):
            assert isinstance(batch, TrainBatch)
            out = strategy.forward_loss(batch)
            out.loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(float(out.loss))
            if len(losses) >= steps:
                break
    third = max(len(losses) // 3, 1)
    print(
        json.dumps(
            {
                "device": device,
                "steps": len(losses),
                "first_loss": losses[0],
                "last_third_mean": sum(losses[-third:]) / third,
                "finite": all(math.isfinite(x) for x in losses),
                "falling": sum(losses[-third:]) / third < sum(losses[:third]) / third,
                "losses": [round(x, 4) for x in losses],
            }
        )
    )


if __name__ == "__main__":
    args = sys.argv[1:]
    main(args[0], args[1], int(args[2]) if len(args) > 2 else 30, args[3] if len(args) > 3 else None)
