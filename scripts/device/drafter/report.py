"""The drafter proof's table from one run's $OUT: tau per draft and chain, and each draft's last logged
training line (loss and per-position accuracies, as SpecForge logs them).

    python3 report.py OUT_DIR
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

ROWS = [
    ("untrained", "nothing (the untrained draft)"),
    ("hsx", "hsx output, read offline (`hsx export --format specforge`)"),
    ("streamed", "hsx output, streamed while the job runs (`hsx feed specforge`)"),
    ("specforge", "SpecForge's own capture of the same samples"),
    ("misaligned", "radix cache on, dumped rows paired with the sample's tokens from its start"),
    ("aligned", "the same truncated captures, each row at its true position"),
]


def main(argv: list[str]) -> int:
    out = Path(argv[1])
    chains = sorted({p.stem.rsplit("_", 1)[1] for p in out.glob("tau_*_*.json")})
    print("| draft trained on | " + " | ".join(f"tau, chain {c[0]}/{c[1]}/{c[2:]}" for c in chains) + " |")
    print("| --- |" + " --- |" * len(chains))
    for key, label in ROWS:
        cells = []
        for chain in chains:
            path = out / f"tau_{key}_{chain}.json"
            try:
                cells.append(f"{json.loads(path.read_text())['tau']:.3f}")
            except (OSError, ValueError, KeyError, TypeError):
                cells.append("not run")
        print(f"| {label} | " + " | ".join(cells) + " |")
    print()
    for key, _label in ROWS:
        log = out / f"train_{key}.log"
        if not log.is_file():
            continue
        lines = [line for line in log.read_text(errors="replace").splitlines() if re.search(r"loss", line)]
        print(f"- {key}: {lines[-1][:400] if lines else 'no loss line logged'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
