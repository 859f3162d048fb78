"""``hsx regenerated JOB``: the regenerated dataset of a job, streamed from the API into a file (or
stdout) as it comes, so a large one never sits in memory. No torch here."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import BinaryIO

import httpx

from hsx.cli.api_client import EXIT_REFUSED, EXIT_SUCCEEDED, EXIT_UNREACHABLE, Api, ApiError


def download(api: Api, job_id: str, out: BinaryIO) -> int:
    """Write the job's JSONL to ``out``; returns the number of samples. Raises :class:`ApiError`."""
    url = f"{api.url.rstrip('/')}/jobs/{job_id}/regenerated"
    try:
        with httpx.stream("GET", url, headers=api.headers, timeout=api.timeout) as response:
            if response.status_code >= 400:
                response.read()
                try:
                    doc = response.json()
                except ValueError:
                    doc = {"error": "not_json", "detail": response.text[:500]}
                code = EXIT_UNREACHABLE if response.status_code >= 500 else EXIT_REFUSED
                raise ApiError(code, f"refused ({response.status_code})", doc)
            lines = 0
            for chunk in response.iter_bytes():
                out.write(chunk)
                lines += chunk.count(b"\n")
            return lines
    except httpx.HTTPError as exc:
        raise ApiError(EXIT_UNREACHABLE, f"API unreachable at {api.url}: {exc}") from exc


def run(api: Api, job_id: str, output: str | None) -> int:
    """The command: to ``output`` (written whole under a temporary name, then renamed) or to stdout."""
    if output is None or output == "-":
        count = download(api, job_id, sys.stdout.buffer)
    else:
        target = Path(output)
        partial = target.with_name(target.name + ".partial")
        try:
            with partial.open("wb") as fh:
                count = download(api, job_id, fh)
            os.replace(partial, target)
        finally:
            partial.unlink(missing_ok=True)
    print(json.dumps({"job_id": job_id, "samples": count, "output": output or "-"}), file=sys.stderr)
    return EXIT_SUCCEEDED
