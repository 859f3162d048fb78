"""What ``hsx submit --wait`` and ``hsx watch`` show while a job runs: a live progress bar drawn with
``rich``, polling the API until the job ends.

The live bar goes to stderr (only when stderr is a terminal; otherwise one plain line per change), so
stdout carries only the result: a table, or the job document with ``--json``.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterable
from typing import Any

from rich.console import Console, RenderableType
from rich.progress import BarColumn, Progress, ProgressColumn, Task, TaskProgressColumn, TextColumn
from rich.text import Text

from hsx.cli.api_client import EXIT_UNREACHABLE, Api, ApiError

FINAL_STATES = {"succeeded", "failed", "cancelled"}
# Consecutive seconds without an answer after which watching gives up.
UNREACHABLE_GIVE_UP_SECONDS = 60.0


class FieldColumn(ProgressColumn):
    """One of the task's fields, as plain text."""

    def __init__(self, name: str, style: str = "") -> None:
        super().__init__()
        self.name = name
        self.style = style

    def render(self, task: Task) -> Text:
        return Text(str(task.fields.get(self.name, "")), style=self.style)


def fmt_eta(seconds: float | None) -> str:
    if seconds is None:
        return "ETA -"
    seconds = int(seconds)
    hours, rest = divmod(seconds, 3600)
    return f"ETA {hours}:{rest // 60:02d}:{rest % 60:02d}" if hours else f"ETA {rest // 60}:{rest % 60:02d}"


def fmt_rejections(reasons: dict[str, int]) -> str:
    if not reasons:
        return "0 rejected"
    parts = ", ".join(f"{reason} {n}" for reason, n in sorted(reasons.items(), key=lambda kv: -kv[1]))
    return f"{sum(reasons.values())} rejected ({parts})"


def fmt_rate(rate: float | None) -> str:
    return "- tok/s" if rate is None else f"{rate:,.0f} tok/s"


def bar_fields(doc: dict[str, Any], units: dict[str, Any] | None) -> dict[str, Any]:
    p = doc.get("progress", {})
    rate = p.get("tokens_per_second")
    busy = f"units {p.get('units_done', 0)}/{p.get('units_total', 0)}"
    if units is not None:
        busy += f", {units.get('leased', 0)} leased, {units.get('workers_busy', 0)} workers busy"
    shown = "- tok/s" if rate is None else f"{rate:,.0f} tok/s"
    regenerate = doc.get("regenerate")
    if regenerate:  # generation and capture are two rates: a job is held back by one or the other
        shown = f"generated {fmt_rate(regenerate.get('generated_tokens_per_second'))}, captured {shown}"
    return {
        "state": doc.get("state", "?"),
        "samples": f"{p.get('samples_done', 0) + p.get('samples_rejected', 0)}/{p.get('samples_total', 0)}",
        "rate": shown,
        "eta": fmt_eta(p.get("eta_seconds")),
        "rejected": fmt_rejections(doc.get("rejections", {})),
        "units": busy,
    }


class JobProgress(Progress):
    """The bar on one line, rejections by reason and busy units and workers on the line below."""

    def get_renderables(self) -> Iterable[RenderableType]:
        yield self.make_tasks_table(self.tasks)
        for task in self.tasks:
            line = Text("  ")
            line.append(str(task.fields.get("rejected", "")), style="yellow")
            line.append(" · ")
            line.append(str(task.fields.get("units", "")), style="dim")
            yield line


def progress_bar(console: Console) -> Progress:
    return JobProgress(
        FieldColumn("state", "bold"),
        BarColumn(bar_width=None),
        TaskProgressColumn(),
        FieldColumn("samples"),
        TextColumn("samples"),
        FieldColumn("rate", "magenta"),
        FieldColumn("eta", "cyan"),
        console=console,
        transient=False,
        refresh_per_second=4,
        expand=True,
    )


def watch(
    api: Api,
    job_id: str,
    timeout: float,
    interval: float = 1.0,
    show: bool = True,
    console: Console | None = None,
    sleep: Callable[[float], None] = time.sleep,
) -> dict[str, Any]:
    """Poll a job until it is final or ``timeout`` passes; draw the bar on the way. Returns the last
    document seen. Raises :class:`ApiError` when the job is unknown or the API stays unreachable."""
    console = console or Console(stderr=True)
    live = show and console.is_terminal
    deadline = time.monotonic() + timeout
    unreachable_since: float | None = None
    last_line = ""
    doc: dict[str, Any] = {}
    bar = progress_bar(console) if live else None
    task = None
    if bar is not None:
        bar.start()
    try:
        while True:
            try:
                doc = api.call("GET", f"/jobs/{job_id}")
                units = _units(api, job_id) if show else None
                unreachable_since = None
            except ApiError as exc:
                if exc.code != EXIT_UNREACHABLE:
                    raise
                now = time.monotonic()
                unreachable_since = unreachable_since or now
                if now - unreachable_since > UNREACHABLE_GIVE_UP_SECONDS or now > deadline:
                    raise
                if show:
                    console.print(f"[yellow]{exc}; retrying[/yellow]")
                sleep(interval)
                continue
            p = doc.get("progress", {})
            fields = bar_fields(doc, units)
            if bar is not None:
                total = max(int(p.get("samples_total", 0)), 1)
                handled = int(p.get("samples_done", 0)) + int(p.get("samples_rejected", 0))
                if task is None:
                    task = bar.add_task("job", total=total, completed=handled, **fields)
                bar.update(task, total=total, completed=handled, **fields)
            elif show:
                line = (
                    f"{fields['state']}: {fields['samples']} samples, {fields['rejected']}, {fields['units']}"
                )
                if line != last_line:
                    print(line, file=sys.stderr, flush=True)
                    last_line = line
            if doc.get("state") in FINAL_STATES or time.monotonic() > deadline:
                return doc
            sleep(interval)
    finally:
        if bar is not None:
            bar.stop()


def _units(api: Api, job_id: str) -> dict[str, Any] | None:
    try:
        return dict(api.call("GET", f"/jobs/{job_id}/units"))
    except ApiError as exc:
        if exc.code == EXIT_UNREACHABLE:
            raise
        return None  # an older API without the route: the bar shows units from the job document only
