"""``specforge train`` (SpecForge 0.2.0's own CLI, unmodified) on a host with no GPU, for the tests.

    python tests/specforge_cpu_trainer.py train -c run.yaml --role consumer

One thing of SpecForge's cannot run here: its EAGLE-3 loss, ``specforge.core.loss.LogSoftmaxLoss``, is a
Triton kernel (a real ``triton`` imports on CPU, and the kernel's first launch fails with "0 active
drivers"), and ``specforge/core/loss.py`` imports ``triton`` at import. So, and only on a host without
CUDA: where ``triton`` is not installed a stand-in module lets that file import (its kernels are then
never launched), and ``LogSoftmaxLoss`` is replaced by the reference formula beside it in the same file
(``_compute_loss``: ``-(mask * target * log_softmax(logits)).sum(-1).mean()``, the value the kernel
computes, here without ``torch.compile``). Everything else, from the config through the optimizer steps
and checkpoints to the consumer's sentinels, is SpecForge's.
"""

from __future__ import annotations

import importlib.util
import sys
import types
from typing import Any


def _stand_in_triton() -> None:
    """Just enough of triton for ``specforge/core/loss.py`` to import: ``@triton.jit`` and the
    ``tl.constexpr`` annotations its kernels are defined with."""
    triton: Any = types.ModuleType("triton")
    language: Any = types.ModuleType("triton.language")
    triton.jit = lambda fn=None, **_kw: fn if fn is not None else (lambda f: f)
    triton.next_power_of_2 = lambda n: 1 << max(int(n) - 1, 0).bit_length()
    language.constexpr = int
    triton.language = language
    sys.modules["triton"] = triton
    sys.modules["triton.language"] = language


def _cpu_loss() -> None:
    import torch

    if torch.cuda.is_available():
        return  # a GPU runs SpecForge's own kernel
    if importlib.util.find_spec("triton") is None:
        _stand_in_triton()
    from specforge.core import loss

    def reference(logits: torch.Tensor, target_p: torch.Tensor, position_mask: torch.Tensor) -> torch.Tensor:
        out_logp = torch.log_softmax(logits.float(), dim=2)
        return -torch.sum(position_mask * target_p * out_logp, 2).mean()

    class CpuLogSoftmaxLoss:
        apply = staticmethod(reference)

    # Before specforge.algorithms.eagle3.model imports the name from the module.
    loss.LogSoftmaxLoss = CpuLogSoftmaxLoss


if __name__ == "__main__":
    _cpu_loss()
    from specforge.cli import main

    sys.exit(main(sys.argv[1:]))
