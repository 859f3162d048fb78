"""What ``hsx status`` and ``hsx jobs`` print: a job, and a page of jobs fitted to the terminal's width, as
``rich`` tables."""

from __future__ import annotations

from typing import Any, Literal

from rich.cells import cell_len
from rich.table import Table
from rich.text import Text

from hsx.cli.progress import fmt_eta, fmt_rate, fmt_rejections

STATE_STYLE = {
    "queued": "cyan",
    "running": "blue",
    "succeeded": "green",
    "failed": "bold red",
    "cancelled": "red",
}


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
