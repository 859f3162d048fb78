"""The dashboard in a real browser: Debian's headless Chromium (driven by Playwright) opens /ui with the
API token, sees a job finish, opens its units, shards and tokens/s plot, runs verify, cancels and retries a
job, keeps the job picked last against a slower load of another, and keeps a screenshot
(``$HSX_TEST_ARTIFACTS``, default ``.hsx/artifacts/``)."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.fixtures.live_server import serve_in_thread
from tests.fixtures.stack import REPO, TEST_TOKEN, Stack

SAMPLE = REPO / "tests" / "data" / "short_chats.jsonl"
postgres_only = pytest.mark.parametrize("db_url", ["postgres"], indirect=True)
CHROMIUM_ARGS = [
    "--no-sandbox",  # CI runs as root
    "--disable-gpu",
    "--disable-background-networking",  # this machine's closed network refuses Chromium's own calls
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
TIMEOUT_MS = 90_000


def chromium_path() -> str:
    for candidate in ("chromium", "chromium-browser"):
        found = shutil.which(candidate)
        if found:
            return found
    pytest.skip(
        "no chromium binary on PATH: install Debian's package (apt-get install -y chromium; .ci/run does)"
    )


def artifacts_dir() -> Path:
    folder = Path(os.environ.get("HSX_TEST_ARTIFACTS") or REPO / ".hsx" / "artifacts")
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def refreshes(tab: Any) -> int:
    """How many of the page's refreshes have finished (app.js counts them on <body>)."""
    return int(tab.get_attribute("body", "data-refreshes") or 0)


def wait_for_refreshes(tab: Any, n: int, in_flight: int) -> None:
    """Until n refreshes have finished and this many are out."""
    tab.wait_for_function(
        "([n, out]) => Number(document.body.dataset.refreshes || 0) >= n"
        " && Number(document.body.dataset.inFlight) === out",
        arg=[n, in_flight],
    )


@pytest.fixture
def page(stack: Stack) -> Iterator[tuple[Any, str]]:
    executable = chromium_path()
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is in the dev extra")
    with serve_in_thread(stack.client.app) as url, sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=executable, args=CHROMIUM_ARGS)
        try:
            tab = browser.new_page(viewport={"width": 1400, "height": 900})
            tab.set_default_timeout(TIMEOUT_MS)
            yield tab, url
        finally:
            browser.close()


@postgres_only
def test_dashboard_shows_a_job_finish_runs_verify_cancels_and_retries(
    stack: Stack, page: tuple[Any, str]
) -> None:
    tab, url = page
    errors: list[str] = []
    tab.on("pageerror", lambda exc: errors.append(str(exc)))
    tab.on("console", lambda msg: errors.append(msg.text) if msg.type == "error" else None)

    done_job = stack.submit(SAMPLE, samples_per_shard=4)
    stack.start_worker(burst=True)

    tab.goto(f"{url}/ui")
    # Without the token every call is refused, and the page says so.
    tab.wait_for_selector(
        "[data-testid=status]:has-text('unauthorized'), [data-testid=status]:has-text('token')"
    )
    tab.fill("#token", TEST_TOKEN)
    tab.press("#token", "Enter")
    tab.wait_for_selector(f"[data-testid='state-{done_job['id']}']:has-text('succeeded')")

    tab.click(f"tr[data-job='{done_job['id']}']")
    doc = stack.job(done_job["id"])
    units = tab.locator("#job-units tr")
    units.nth(doc["progress"]["units_total"] - 1).wait_for()
    assert units.count() == doc["progress"]["units_total"]
    shards = doc["shards"]
    more = 1 if shards["total"] > len(shards["items"]) else 0
    # The panel may first be drawn from a document of a moment before the job ended (one shard, running):
    # the page's next refresh draws the finished one.
    expected = len(shards["items"]) + more
    tab.wait_for_function(
        "n => document.querySelectorAll('#job-shards tr').length === n"
        " && document.getElementById('job-state').textContent === 'succeeded'",
        arg=expected,
        timeout=15000,
    )
    assert tab.locator("#job-shards tr").count() == expected
    assert tab.inner_text("#job-state") == "succeeded"

    stack.start_worker()  # verify runs on a worker (it reads the dumps); stopped before the next job
    tab.click("[data-testid=verify]")
    verdict = tab.wait_for_selector("[data-testid=verify-verdict]")
    assert verdict is not None and "verify passed" in verdict.inner_text()
    stack.stop_workers()

    # A second job, with no worker left to run it: cancel it from the page, then retry it.
    queued = stack.submit(SAMPLE, samples_per_shard=4)
    tab.click(f"[data-testid='cancel-{queued['id']}']")
    tab.wait_for_selector(f"[data-testid='state-{queued['id']}']:has-text('cancelled')")
    assert stack.job(queued["id"])["state"] == "cancelled"
    tab.click(f"[data-testid='retry-{queued['id']}']")
    tab.wait_for_selector("[data-testid=status]:has-text('resubmitted')")
    jobs = stack.client.get("/jobs").json()
    assert jobs["total"] == 3
    retried = jobs["items"][0]
    assert retried["state"] == "queued" and retried["dataset_uri"] == queued["dataset_uri"]
    tab.wait_for_selector(f"[data-testid='state-{retried['id']}']")

    # The finished job's panel plots its tokens/s over the run, from start to finish: every token counted.
    tab.click(f"tr[data-job='{done_job['id']}']")
    tab.wait_for_selector(f"#job-id:has-text('{done_job['id']}')")
    tab.wait_for_selector("#job-state:has-text('succeeded')")
    plot = tab.wait_for_selector(f"[data-testid=throughput-plot][data-tokens='{doc['progress']['tokens']}']")
    assert plot is not None and int(plot.get_attribute("data-points")) > 1
    assert float(plot.get_attribute("data-ymax")) >= doc["progress"]["tokens_per_second"] > 0
    assert len(tab.get_attribute("[data-testid=throughput-line]", "points").split()) > 1

    # A load of another job still in flight when this one is picked must not draw over it: hold the
    # answers about the retried job (the interval waits while a refresh is out), pick it, then the finished
    # job, and let the held answers in last.
    held: list[Any] = []
    tab.route(f"**/jobs/{retried['id']}**", lambda route: held.append(route))
    with tab.expect_request(f"**/jobs/{retried['id']}"):
        tab.click(f"tr[data-job='{retried['id']}']")
    before = refreshes(tab)
    tab.click(f"tr[data-job='{done_job['id']}']")
    wait_for_refreshes(tab, before + 1, in_flight=1)  # only the held refresh is out
    assert held and tab.inner_text("#job-id") == done_job["id"]
    before = refreshes(tab)
    for route in held:
        route.continue_()
    tab.unroute(f"**/jobs/{retried['id']}**")
    wait_for_refreshes(tab, before + 1, in_flight=0)
    assert tab.inner_text("#job-id") == done_job["id"]
    assert tab.inner_text("#job-state") == "succeeded"
    shot = artifacts_dir() / "dashboard.png"
    tab.screenshot(path=str(shot), full_page=True)
    assert shot.stat().st_size > 10_000
    assert not [e for e in errors if "401" not in e], errors  # only the refused calls before the token


def test_dashboard_files_carry_a_strict_content_security_policy() -> None:
    from fastapi.testclient import TestClient

    from app.main import create_app

    client = TestClient(create_app())
    page = client.get("/ui/")
    assert page.status_code == 200 and '<script src="app.js">' in page.text
    assert "script-src 'self'" in page.headers["content-security-policy"]
    assert '<script src="plot.js">' in page.text  # the tokens/s plot, drawn as SVG nodes by script
    for name in ("app.js", "plot.js", "style.css"):
        assert client.get(f"/ui/{name}").status_code == 200
    assert client.get("/ui/__init__.py").status_code == 404  # the package's Python is not served
