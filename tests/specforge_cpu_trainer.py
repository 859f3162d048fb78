"""``specforge train`` (SpecForge 0.2.0's own CLI, unmodified) on a host with no GPU, for the tests.

    python tests/specforge_cpu_trainer.py train -c run.yaml --role consumer

Two things of SpecForge's cannot run here. Its trainer wraps the draft in FSDP (``training.fsdp_sharding``
SHARD_GRAD_OP by default), which needs an accelerator; on CPU the run gets SpecForge's own override
``training.fsdp_sharding=NO_SHARD``, its DDP path (with one rank, the same steps). And one module:
``specforge/core/loss.py``, whose ``LogSoftmaxLoss`` (the EAGLE-3 loss) is a Triton kernel. It imports
``triton`` at import; with a real ``triton`` installed it imports on CPU, and the kernel's first launch
fails ("0 active drivers"); a stand-in ``triton`` module breaks torch's own compiler, which looks for
triton too. So, and only on a host without CUDA, that one module is replaced before anything imports it
by one holding the reference formula that sits beside the kernel in the same file (``_compute_loss``:
``-(mask * target * log_softmax(logits)).sum(-1).mean()``, the value the kernel computes), without
``torch.compile``. Everything else, from the config through the
optimizer steps and checkpoints to the consumer's sentinels, is SpecForge's.
"""

from __future__ import annotations

import sys
import types
from typing import Any


def _cpu_loss() -> None:
    import torch

    if torch.cuda.is_available():
        return  # a GPU runs SpecForge's own kernel

    def _compute_loss(logits: torch.Tensor, target_p: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        out_logp = torch.log_softmax(logits.float(), dim=2)
        return -torch.sum(mask * target_p * out_logp, 2).mean()

    class LogSoftmaxLoss:
        apply = staticmethod(_compute_loss)

    import specforge.core

    module: Any = types.ModuleType("specforge.core.loss", "SpecForge's EAGLE-3 loss, its reference formula")
    module._compute_loss = _compute_loss
    module.LogSoftmaxLoss = LogSoftmaxLoss
    sys.modules["specforge.core.loss"] = module
    specforge.core.loss = module  # type: ignore[attr-defined]


def _cpu_argv(argv: list[str]) -> list[str]:
    import torch

    if torch.cuda.is_available() or not argv or argv[0] != "train":
        return argv
    return [*argv, "training.fsdp_sharding=NO_SHARD"]  # a dotted override, as `specforge train` takes them


if __name__ == "__main__":
    _cpu_loss()
    from specforge.cli import main

    sys.exit(main(_cpu_argv(sys.argv[1:])))
