"""What ``hsx submit --wait``, ``hsx watch``, ``hsx status`` and ``hsx jobs`` show: a live progress bar and
tables drawn with ``rich``, or JSON for scripts, and the exit codes a script can rely on.

The live bar goes to stderr (only when stderr is a terminal; otherwise one plain line per change), so
stdout carries only the result: a table, or the job document with ``--json``.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import httpx
from rich.cells import cell_len
from rich.console import Console, RenderableType
from rich.progress import BarColumn, Progress, ProgressColumn, Task, TaskProgressColumn, TextColumn
from rich.table import Table
from rich.text import Text

# Exit codes. 0 is "succeeded" (or, for commands that wait for nothing, "done as asked").
EXIT_SUCCEEDED = 0
EXIT_FAILED = 1
EXIT_REFUSED = 2  # bad arguments, or the API refused the request (4xx: bad dataset, unknown job, no token)
EXIT_CANCELLED = 3
EXIT_TIMEOUT = 4  # --timeout passed while the job was still queued or running
EXIT_UNREACHABLE = 5  # no answer from the API, or a 5xx
EXIT_ACTIVE = 6  # hsx status: the job is still queued or running

FINAL_STATES = {"succeeded", "failed", "cancelled"}
STATE_EXIT = {"succeeded": EXIT_SUCCEEDED, "failed": EXIT_FAILED, "cancelled": EXIT_CANCELLED}
STATE_STYLE = {
    "queued": "cyan",
    "running": "blue",
    "succeeded": "green",
    "failed": "bold red",
    "cancelled": "red",
}
# Consecutive seconds without an answer after which watching gives up.
UNREACHABLE_GIVE_UP_SECONDS = 60.0


class ApiError(Exception):
    def __init__(self, code: int, message: str, doc: Any = None) -> None:
        super().__init__(message)
        self.code = code
        self.doc = doc


@dataclass
class Api:
    url: str
    headers: dict[str, str]
    timeout: float = 30.0
    # One client for the command's life: a fresh one per call (httpx.request) costs about 40 ms of CPU,
    # its TLS context, which a watch polling every second takes from the job on a small host.
    _client: httpx.Client | None = field(default=None, repr=False)

    def call(self, method: str, path: str, **kwargs: Any) -> Any:
        if self._client is None:
            self._client = httpx.Client()
        try:
            kwargs.setdefault("timeout", self.timeout)
            resp = self._client.request(method, self.url.rstrip("/") + path, headers=self.headers, **kwargs)
        except httpx.HTTPError as exc:
            raise ApiError(EXIT_UNREACHABLE, f"API unreachable at {self.url}: {exc}") from exc
        try:
            doc = resp.json()
        except ValueError:
            doc = {"error": "not_json", "detail": resp.text[:500]}
        if resp.status_code >= 500:
            raise ApiError(EXIT_UNREACHABLE, f"API error {resp.status_code}", doc)
        if resp.status_code >= 400:
            raise ApiError(EXIT_REFUSED, f"refused ({resp.status_code})", doc)
        return doc


def exit_code_for_state(state: str | None, waiting: bool) -> int:
    """What a command that waited (``waiting``) or only looked returns for a job in ``state``."""
    if state in STATE_EXIT:
        return STATE_EXIT[state]
    return EXIT_TIMEOUT if waiting else EXIT_ACTIVE


def local_dataset_uri(dataset: str) -> str:
    """A relative local path means the caller's directory, not the API's: send it absolute."""
    if "://" in dataset or Path(dataset).is_absolute():
        return dataset
    return str(Path(dataset).resolve())


def print_json(doc: Any) -> None:
    print(json.dumps(doc, indent=2, sort_keys=True, default=str))


# --- the live bar ------------------------------------------------------------------------------------------


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


# --- tables ------------------------------------------------------------------------------------------------


def state_text(state: str) -> Text:
    return Text(state, style=STATE_STYLE.get(state, ""))


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def job_table(doc: dict[str, Any]) -> Table:
    p = doc.get("progress", {})
    table = Table(show_header=False, box=None, pad_edge=False)
    table.add_column(style="bold")
    table.add_column()
    fraction = float(p.get("fraction", 0.0))
    table.add_row("job", doc.get("id", ""))
    table.add_row("state", state_text(doc.get("state", "?")))
    table.add_row("dataset", doc.get("dataset_uri", ""))
    table.add_row(
        "progress",
        f"{fraction:.0%}: {p.get('samples_done', 0)} done, {p.get('samples_rejected', 0)} rejected "
        f"of {p.get('samples_total', 0)} samples; units {p.get('units_done', 0)}/{p.get('units_total', 0)}",
    )
    rate = p.get("tokens_per_second")
    table.add_row("tokens", f"{p.get('tokens', 0):,}" + ("" if rate is None else f" ({rate:,.1f} tok/s)"))
    regenerate = doc.get("regenerate")
    if regenerate:
        table.add_row(
            "generated",
            f"{regenerate.get('generated_tokens', 0):,} tokens "
            f"({fmt_rate(regenerate.get('generated_tokens_per_second'))}) in "
            f"{regenerate.get('samples_regenerated', 0)} samples, "
            f"{regenerate.get('turns_at_length', 0)} turns at max_new_tokens",
        )
    if doc.get("state") in ("queued", "running"):
        table.add_row("eta", fmt_eta(p.get("eta_seconds")))
    table.add_row("rejections", fmt_rejections(doc.get("rejections", {})))
    # GET /jobs/{id} shows a bounded page of shards: {"total", "items", "href"}.
    shards = doc.get("shards") or {}
    items = shards.get("items", []) if isinstance(shards, dict) else list(shards)
    total = shards.get("total", len(items)) if isinstance(shards, dict) else len(items)
    size = fmt_bytes(sum(s.get("bytes", 0) for s in items))
    table.add_row("shards", f"{total} ({size}{'' if total == len(items) else f' in the first {len(items)}'})")
    table.add_row("output", doc.get("manifest") or doc.get("output_dir", ""))
    if doc.get("error"):
        table.add_row("error", Text(str(doc["error"]), style="red"))
    for key in ("created_at", "started_at", "finished_at"):
        if doc.get(key):
            table.add_row(key.removesuffix("_at"), str(doc[key]))
    return table


# hsx jobs' columns, most wanted first: the first two always show (the id is what a user copies into the
# next command, never cut); each other one shows where the width leaves room for it. The dataset comes
# before the numbers a glance can do without, which show only once its path has DATASET_WIDE cells (or all
# it needs); its path is the one shortened (in the middle, keeping the file's name), never to less than
# DATASET_MIN_WIDTH cells, and it takes whatever width is left.
JOBS_COLUMNS = ("job", "state", "done", "samples", "dataset", "rejected", "tok/s", "created")
JOBS_RIGHT_ALIGNED = {"done", "samples", "rejected", "tok/s"}
DATASET_MIN_WIDTH = 12
DATASET_WIDE = 40
JOBS_COLUMN_GAP = 2


def jobs_table(page: dict[str, Any], width: int) -> Table:
    """A page of ``GET /jobs`` as a table that fits ``width`` cells (a terminal's, or 80 in a pipe)."""
    rows = [_job_row(job) for job in page.get("items", [])]
    natural = {
        name: max([cell_len(name), *(cell_len(row[name].plain) for row in rows)]) for name in JOBS_COLUMNS
    }
    widths: dict[str, int] = {}
    used, dataset_short = -JOBS_COLUMN_GAP, False
    for index, name in enumerate(JOBS_COLUMNS):
        room = width - used - JOBS_COLUMN_GAP
        wanted = natural[name]
        if name == "dataset":
            wide = min(wanted, DATASET_WIDE)
            dataset_short = wide > room
            wanted = min(wanted, DATASET_MIN_WIDTH) if dataset_short else wide
        elif dataset_short:  # the room left is the path's
            break
        if index < 2 or wanted <= room:
            widths[name] = wanted
            used += JOBS_COLUMN_GAP + wanted
    if "dataset" in widths:  # what the others leave, up to the whole path
        widths["dataset"] = min(natural["dataset"], widths["dataset"] + max(0, width - used))
    table = Table(
        title=f"{page.get('total', 0)} jobs",
        title_justify="left",
        box=None,
        padding=(0, JOBS_COLUMN_GAP // 2),
        pad_edge=False,
        header_style="bold",
    )
    # The dataset last: a path of any length ends the line.
    order = [name for name in JOBS_COLUMNS if name in widths and name != "dataset"]
    order += ["dataset"] if "dataset" in widths else []
    for name in order:
        justify: Literal["left", "right"] = "right" if name in JOBS_RIGHT_ALIGNED else "left"
        table.add_column(name, justify=justify, no_wrap=True, min_width=widths[name], max_width=widths[name])
    for row in rows:
        cells = [row[name] for name in order]
        if "dataset" in widths:
            cells[-1] = Text(shorten_middle(row["dataset"].plain, widths["dataset"]))
        table.add_row(*cells)
    return table


def _job_row(job: dict[str, Any]) -> dict[str, Text]:
    p = job.get("progress", {})
    rate = p.get("tokens_per_second")
    return {
        "job": Text(job.get("id", "")),
        "state": state_text(job.get("state", "?")),
        "done": Text(f"{float(p.get('fraction', 0.0)):.0%}"),
        "samples": Text(f"{p.get('samples_done', 0)}/{p.get('samples_total', 0)}"),
        "rejected": Text(str(p.get("samples_rejected", 0))),
        "tok/s": Text("" if rate is None else f"{rate:,.1f}"),
        "created": Text(str(job.get("created_at", ""))[:19].replace("T", " ")),
        "dataset": Text(job.get("dataset_uri", "")),
    }


def shorten_middle(text: str, width: int) -> str:
    """``text`` in at most ``width`` cells: its start and (the larger part) its end about an ellipsis."""
    if cell_len(text) <= width:
        return text
    if width <= 1:
        return "…"[:width]
    tail_cells = (width - 1) - (width - 1) // 3
    head, tail = _cells_from_start(text, width - 1 - tail_cells), _cells_from_end(text, tail_cells)
    return f"{head}…{tail}"


def _cells_from_start(text: str, cells: int) -> str:
    taken = 0
    for index, char in enumerate(text):
        taken += cell_len(char)
        if taken > cells:
            return text[:index]
    return text


def _cells_from_end(text: str, cells: int) -> str:
    return _cells_from_start(text[::-1], cells)[::-1]


def print_error(exc: ApiError, as_json: bool) -> int:
    if as_json:
        print_json(exc.doc if exc.doc is not None else {"error": "unreachable", "detail": str(exc)})
    else:
        detail = exc.doc.get("detail") if isinstance(exc.doc, dict) else None
        error = exc.doc.get("error") if isinstance(exc.doc, dict) else None
        message = f"{exc}: {error}: {detail}" if error else str(exc)
        Console(stderr=True).print(Text(f"hsx: {message}", style="red"))
    return exc.code
