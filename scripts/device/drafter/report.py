"""The drafter proof's table from one run's logs ($W/out): tau per draft and chain, and for each training its
last logged loss and per-position accuracies, its step time and data wait (SpecForge's own ``perf/*``
figures, the mean over its windows after the first), and the samples and tokens it trained on.

    python3 report.py OUT_DIR
"""

from __future__ import annotations

import ast
import json
import statistics
import sys
from pathlib import Path
from typing import Any

ROWS = [
    ("untrained", "nothing (the untrained draft)"),
    ("hsx", "hsx output, read offline (`hsx export --format specforge`)"),
    ("hsx42", "hsx output, read offline, seed 42"),
    ("hsx43", "hsx output, read offline, seed 43"),
    ("streamed", "hsx output, streamed while the job runs (`hsx feed specforge`)"),
    ("specforge", "SpecForge's own capture of the same samples (SGLang 0.5.14)"),
    ("misaligned", "radix cache on, dumped rows paired with the sample's tokens from its start"),
    ("aligned", "the same truncated captures, each row at its true position"),
]


def steps(log: Path) -> list[tuple[int, dict[str, Any]]]:
    """SpecForge's console lines, ``step N: {metrics}``."""
    out = []
    for line in log.read_text(errors="replace").splitlines():
        if not line.startswith("step ") or ": {" not in line:
            continue
        head, body = line.split(": ", 1)
        try:
            out.append((int(head.split()[1]), ast.literal_eval(body)))
        except (ValueError, SyntaxError):
            continue
    return out


def training(log: Path) -> dict[str, Any]:
    logged = steps(log)
    if not logged:
        return {}
    step, last = logged[-1]
    row: dict[str, Any] = {"steps": step}
    for key, value in last.items():
        if key in ("loss", "plosses", "acces", "acceptance_rates", "lr"):
            row[key] = [round(float(v), 4) for v in value] if isinstance(value, list) else round(float(value), 6)
    for key in ("perf/optimizer_step_time_s", "perf/data_wait_time_s", "perf/train_compute_time_s"):
        values = [float(m[key]) for _, m in logged[1:] if key in m] or [float(m[key]) for _, m in logged if key in m]
        if values:
            row[key.split("/")[1]] = round(statistics.mean(values), 4)
    return row


def main(argv: list[str]) -> int:
    out = Path(argv[1])
    chains = sorted({p.stem.rsplit("_", 1)[1] for p in out.glob("tau_*_*.json")})
    print("| draft trained on | " + " | ".join(f"tau, chain {c[0]}/{c[1]}/{c[2:]}" for c in chains) + " |")
    print("| --- |" + " --- |" * len(chains))
    for key, label in ROWS:
        if not (out / f"train_{key}.log").is_file() and not list(out.glob(f"tau_{key}_*.json")):
            continue
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
        if log.is_file():
            print(f"- {key}: {json.dumps(training(log))}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
