"""``hsx bench submit``: what the preflight adds to ``POST /jobs``. One reference engine (the real model,
prefix cache off) and three API processes in turn: ``HSX_ENGINE_FLEET=true`` (no preflight, today's
baseline), a preflight on every submission (``HSX_SUBMIT_PREFLIGHT_TTL_SECONDS=0``), and the default (one
preflight per engine identity and HSX_SUBMIT_PREFLIGHT_TTL_SECONDS, so every submission after the first is
answered from it).

    hsx bench submit [--submits 10]

Prints a table, then one JSON line of median submit times (ms) and their ratios to the baseline.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import private_stack, say, table, write_pretokenized  # noqa: E402

from hsx.cli.local_stack import free_port, hsx_command, wait_http  # noqa: E402

MODES = {
    "fleet (no preflight)": {"HSX_ENGINE_FLEET": "true"},
    "preflight every submit": {"HSX_SUBMIT_PREFLIGHT_TTL_SECONDS": "0"},
    "preflight kept (default TTL)": {},
}


def _stop_api(stack: Any) -> None:
    for name, proc in list(stack.local.procs):
        if name == "api":
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(20)
            stack.local.procs.remove((name, proc))


def main() -> int:
    parser = argparse.ArgumentParser(prog="hsx bench submit")
    parser.add_argument("--submits", type=int, default=10)
    args = parser.parse_args()
    medians: dict[str, float] = {}
    with private_stack("submit") as stack:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        cmd = hsx_command(
            "engine", "--backend", "reference", "--disable-prefix-cache", "--port", str(port),
            "--dump-dir", stack.env["HSX_DUMP_DIR"],
        )  # fmt: skip
        wait_http(f"{url}/health", 300, stack.local.start("engine", cmd, stack.env))
        stack.env["HSX_ENGINE_URL"] = url
        dataset = stack.work / "d.jsonl"
        write_pretokenized(dataset, [32] * 4)
        base_env = dict(stack.env)
        for mode, extra in MODES.items():
            stack.env = {**base_env, **extra}
            stack.start_api()
            times = [stack.submit(dataset)[1] * 1000 for _ in range(args.submits)]
            medians[mode] = statistics.median(times)
            say(f"{mode}: first {times[0]:.0f} ms, median {medians[mode]:.0f} ms")
            _stop_api(stack)
    base = medians["fleet (no preflight)"]
    table([(mode, f"{ms:.0f} ms median, {ms / base:.2f}x the baseline") for mode, ms in medians.items()])
    print(json.dumps({**{f"{k}_ms": round(v, 1) for k, v in medians.items()},
                      **{f"{k}_ratio": round(v / base, 2) for k, v in medians.items()}}))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
