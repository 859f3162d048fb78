"""The dashboard shows a streaming job: its buffered bytes against its cap, that it waits on consumers,
and each consumer with what it holds leased (real Chromium; skipped, saying why, where it is missing)."""

from __future__ import annotations

import time
from typing import Any

import pytest

from tests.fixtures.stack import TEST_TOKEN, Stack
from tests.test_ui import SAMPLE, page  # noqa: F401  (the browser fixture)

postgres_only = pytest.mark.parametrize("db_url", ["postgres"], indirect=True)


@postgres_only
def test_dashboard_shows_the_buffer_against_the_cap_and_the_consumers(
    stack: Stack,
    page: tuple[Any, str],  # noqa: F811
) -> None:
    tab, url = page
    job = stack.submit(SAMPLE, samples_per_shard=4, retention="consume", buffer_cap_bytes=1)
    stack.start_worker()
    consumer = stack.client.post(f"/jobs/{job['id']}/consumers", json={"name": "rank0"}).json()["id"]
    deadline = time.monotonic() + 120
    held: list[Any] = []
    while not held and time.monotonic() < deadline:
        held = stack.client.post(f"/jobs/{job['id']}/consumers/{consumer}/leases", json={}).json()["items"]
        time.sleep(0.2)
    assert held, stack.logs()

    tab.goto(f"{url}/ui")
    tab.fill("#token", TEST_TOKEN)
    tab.press("#token", "Enter")
    tab.click(f"tr[data-job='{job['id']}']")
    tab.wait_for_selector("[data-testid=stream-summary]:has-text('waiting on consumers')")
    summary = tab.inner_text("[data-testid=stream-summary]")
    assert "consume" in summary and "cap" in summary and "1 leased" in summary, summary
    row = tab.wait_for_selector("#stream-consumers tr:has-text('rank0')")
    assert row is not None and row.inner_text().split("\t")[1].strip() == "1"
    assert tab.locator("#stream-buffer.full").count() == 1
