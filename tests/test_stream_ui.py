"""The dashboard shows a streaming job: its buffered bytes against its cap, that it waits on consumers, each
consumer with what it holds leased and how long it has been idle, and the job's tokens/s over its run as a
plot built from the units' commit times, which follows the job as it runs (real Chromium; skipped, saying
why, where it is missing)."""

from __future__ import annotations

import time
from typing import Any

import pytest

from tests.fixtures.stack import TEST_TOKEN, Stack
from tests.test_ui import SAMPLE, artifacts_dir, page  # noqa: F401  (the browser fixture)

postgres_only = pytest.mark.parametrize("db_url", ["postgres"], indirect=True)
PLOT = "[data-testid=throughput-plot]"


def lease(stack: Stack, job_id: str, consumer: str, deadline: float) -> dict[str, Any]:
    """The next leased item, or the end of the stream, polling until one comes."""
    while True:
        out = dict(stack.client.post(f"/jobs/{job_id}/consumers/{consumer}/leases", json={}).json())
        if out["items"] or out["end_of_stream"]:
            return out
        assert time.monotonic() < deadline, stack.logs()
        time.sleep(0.2)


def ack(stack: Stack, job_id: str, consumer: str, item: dict[str, Any]) -> None:
    resp = stack.client.post(
        f"/jobs/{job_id}/consumers/{consumer}/acks",
        json={"items": [{"id": item["id"], "delivery": item["delivery"]}]},
    )
    assert resp.status_code == 200 and resp.json()["acked"] == [item["id"]], resp.text


def wait_for_plot_tokens(tab: Any, tokens: int) -> None:
    """The page draws a refresh every two seconds: wait until it shows this many tokens."""
    tab.wait_for_function(
        "n => { const p = document.querySelector('[data-testid=throughput-plot]');"
        " return p !== null && Number(p.dataset.tokens) === n; }",
        arg=tokens,
    )


# One look at the plot, taken in the page at once: the page redraws every two seconds, so attributes read
# one by one could come from two drawings.
SNAPSHOT = """() => {
  const plot = document.querySelector('[data-testid=throughput-plot]');
  const line = document.querySelector('[data-testid=throughput-line]');
  const ytext = document.querySelector('[data-testid=plot-ymax]');
  if (plot === null) return null;
  const points = [...plot.querySelectorAll('circle.point')];
  return {
    n: Number(plot.dataset.points), line: line ? line.getAttribute('points').trim().split(/\\s+/).length : 0,
    rates: points.map((p) => Number(p.dataset.rate)), spread: points.map((p) => Number(p.dataset.tokens)),
    ymax: Number(plot.dataset.ymax), ymaxText: ytext ? ytext.textContent : '',
    mean: Number(plot.dataset.mean), tokens: Number(plot.dataset.tokens), text: plot.textContent,
  };
}"""


def check_plot(tab: Any, stack: Stack, job_id: str) -> tuple[dict[str, Any], int]:
    """The plot agrees with the job: its buckets add up to the job's tokens, one point a bucket, and the
    y axis reaches the peak bucket and the job's mean rate. Returns the job as read after the plot, and the
    tokens the plot stood for."""
    wait_for_plot_tokens(tab, stack.job(job_id)["progress"]["tokens"])  # what the page reads too
    shot = tab.evaluate(SNAPSHOT)
    # Read after the drawing looked at, from the job table (not a document the API kept): its clock is at
    # or past the page's, and its tokens at or past the plot's.
    doc = stack.job(job_id, fresh=True)
    n, rates = shot["n"], shot["rates"]
    assert n > 1 and shot["line"] == n and len(rates) == n, shot
    assert abs(sum(shot["spread"]) - shot["tokens"]) < 0.01 * n, shot
    assert shot["ymaxText"] and shot["ymax"] >= max(rates) > 0, shot
    tokens, rate = doc["progress"]["tokens"], doc["progress"]["tokens_per_second"]
    assert rate > 0 and tokens >= shot["tokens"] > 0, (shot, doc["progress"])
    # The API's rate is its tokens over its elapsed time, which is at least the page's: so the page's mean,
    # the plot's tokens over the page's time, is at least the API's rate scaled to the plot's tokens. The
    # page times with milliseconds and the API with microseconds; both round to 0.1 tok/s.
    floor = rate * shot["tokens"] / tokens
    assert shot["ymax"] >= shot["mean"] >= floor * 0.99 - 0.1, (shot["mean"], floor, doc["progress"])
    assert "tok/s" in shot["text"] and "time since start" in shot["text"]
    return doc, int(shot["tokens"])


@postgres_only
def test_dashboard_shows_the_buffer_against_the_cap_the_consumers_and_tokens_per_second(
    stack: Stack,
    page: tuple[Any, str],  # noqa: F811
) -> None:
    tab, url = page
    errors: list[str] = []
    tab.on("pageerror", lambda exc: errors.append(str(exc)))
    job = stack.submit(SAMPLE, samples_per_shard=2, retention="consume", buffer_cap_bytes=1)
    stack.start_worker()
    consumer = stack.client.post(f"/jobs/{job['id']}/consumers", json={"name": "rank0"}).json()["id"]
    deadline = time.monotonic() + 240
    held = lease(stack, job["id"], consumer, deadline)["items"]
    assert held

    tab.goto(f"{url}/ui")
    tab.fill("#token", TEST_TOKEN)
    tab.press("#token", "Enter")
    tab.click(f"tr[data-job='{job['id']}']")
    tab.wait_for_selector("[data-testid=stream-summary]:has-text('waiting on consumers')")
    summary = tab.inner_text("[data-testid=stream-summary]")
    assert "consume" in summary and "cap" in summary and "1 leased" in summary and "lag" in summary, summary
    assert tab.locator("#stream-buffer.full").count() == 1
    assert "of 1 B cap (>999%)" in tab.inner_text("[data-testid=stream-buffer-label]")
    row = tab.wait_for_selector(f"#stream-consumers tr[data-consumer='{consumer}']")
    assert row is not None and "rank0" in row.inner_text()
    assert tab.inner_text(f"tr[data-consumer='{consumer}'] [data-testid=leased-items]") == "1"
    leased_bytes = tab.get_attribute(f"tr[data-consumer='{consumer}'] [data-testid=leased-bytes]", "title")
    assert leased_bytes == f"{held[0]['bytes']} bytes"
    idle = tab.inner_text(f"tr[data-consumer='{consumer}'] [data-testid=idle]")
    assert idle.endswith(" s") and float(idle.split()[0]) >= 0, idle

    # A running job: the plot stands for what it has committed so far, the unit the consumer holds.
    doc, first = check_plot(tab, stack, job["id"])
    assert doc["state"] == "running" and doc["progress"]["units_done"] >= 1
    assert "now" in (tab.text_content(PLOT) or "")

    # The consumer acknowledges: the cap lets the workers on, and the plot follows them.
    ack(stack, job["id"], consumer, held[0])
    screenshot_at = 4
    acked = 1
    while True:
        out = lease(stack, job["id"], consumer, deadline)
        if out["end_of_stream"]:
            break
        if acked == screenshot_at:
            doc, now_drawn = check_plot(tab, stack, job["id"])
            assert doc["state"] == "running" and now_drawn > first
            tab.wait_for_selector(f"tr[data-consumer='{consumer}'] [data-testid=leased-items]:text-is('1')")
            shot = artifacts_dir() / "dashboard-stream.png"
            tab.screenshot(path=str(shot), full_page=True)
            assert shot.stat().st_size > 10_000
        ack(stack, job["id"], consumer, out["items"][0])
        acked += 1
    assert acked > screenshot_at

    # Finished: the plot covers the run from start to finish and adds up to every token of it.
    doc = stack.wait(job["id"])
    assert doc["state"] == "succeeded", doc
    tab.wait_for_selector("#job-state:has-text('succeeded')")
    _, drawn = check_plot(tab, stack, job["id"])
    assert "now" not in (tab.text_content(PLOT) or "")
    assert drawn == doc["progress"]["tokens"]
    assert not errors, errors
