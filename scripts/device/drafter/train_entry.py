"""`specforge train` / `specforge export` as the drafter proof runs them: SpecForge 0.2.0's own CLI, with one
change under FAST=1 that leaves the math alone.

SpecForge's EAGLE-3 forward (``OnlineEagle3Model.forward``) calls ``torch.cuda.empty_cache()`` on every
step. That hands the step's blocks back to the driver, so the next step allocates them again with
cudaMalloc, which synchronises the device; with several trainers on one card each one's frees and mallocs
also wait on the others. The caching allocator reuses blocks of the same sizes step after step, so keeping
them changes no value, only when memory goes back (at the process's end). FAST=0 runs SpecForge untouched.

    python3 train_entry.py train -c run.yaml
"""

from __future__ import annotations

import os
import sys


def main(argv: list[str]) -> int:
    if os.environ.get("FAST", "1") == "1":
        import torch

        torch.cuda.empty_cache = lambda: None
    from specforge.cli import main as specforge_main

    return int(specforge_main(argv) or 0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
