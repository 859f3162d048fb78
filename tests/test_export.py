"""Exports from small outputs written in the native format: refusals, the staged destination, the report
and its checksums, and SpecForge's vocabulary mapping reproduced tie for tie. The trainers' own readers on
a real job's export are in test_export_trainers.py."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

from hsx.integrations.exports import (
    CHECKSUMS_FILE,
    REPORT_FILE,
    ExportDestinationTaken,
    ExportError,
    ExportOptions,
    export_output,
)
from hsx.integrations.specforge.export import vocab_mapping
from hsx.loader import ChecksumMismatch, iter_samples
from tests.fixtures.outputs import OutputSpec, write_output

REPO = Path(__file__).resolve().parents[1]


def make(tmp_path: Path, **spec: object) -> Path:
    directory = tmp_path / "out"
    write_output(directory, OutputSpec(**spec))  # type: ignore[arg-type]
    return directory


def refused(source: Path, fmt: str, dest: Path, options: ExportOptions | None = None) -> ExportError:
    with pytest.raises(ExportError) as caught:
        export_output(source, fmt, dest, options)
    assert not dest.exists()
    return caught.value


def test_speculators_needs_the_pre_norm_state(tmp_path: Path) -> None:
    error = refused(make(tmp_path, final_state="post"), "speculators", tmp_path / "x")
    assert error.error == "export_not_possible" and error.status_code == 400
    assert "before the norm" in error.detail and "--final-state both" in error.detail


def test_specforge_needs_the_post_norm_state_and_modelopt_takes_either(tmp_path: Path) -> None:
    source = make(tmp_path, final_state="pre")
    assert "post-norm" in refused(source, "specforge", tmp_path / "sf").detail
    report = export_output(source, "modelopt", tmp_path / "mo")
    assert report["target"]["hidden_states"] == "pre-norm (hidden_states_prenorm)"
    for sample in iter_samples(source, as_torch=True):
        saved = torch.load(tmp_path / "mo" / f"{sample.index:08d}.pt", weights_only=True)
        assert saved["hidden_states_prenorm"] is True
        assert torch.equal(saved["hidden_states"], sample.final_pre_norm)


def test_vocab_options_are_checked_before_anything_is_written(tmp_path: Path) -> None:
    source = make(tmp_path)  # its model path has no config.json
    assert (
        "target_vocab_size"
        in refused(source, "specforge", tmp_path / "a", ExportOptions(draft_vocab_size=8)).detail
    )
    too_big = ExportOptions(draft_vocab_size=80, target_vocab_size=40)
    assert "larger than" in refused(source, "specforge", tmp_path / "b", too_big).detail
    small = ExportOptions(draft_vocab_size=8, target_vocab_size=10)  # the fixture's ids go up to 39
    error = refused(source, "specforge", tmp_path / "c", small)
    assert error.error == "export_vocab_mismatch"
    assert not [p for p in tmp_path.iterdir() if ".hsx-partial-" in p.name]


def test_the_destination_is_new_or_empty_and_never_half_written(tmp_path: Path) -> None:
    source = make(tmp_path)
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "keep.txt").write_text("mine")
    with pytest.raises(ExportDestinationTaken):
        export_output(source, "modelopt", taken)
    assert (taken / "keep.txt").read_text() == "mine"
    empty = tmp_path / "empty"
    empty.mkdir()
    assert export_output(source, "modelopt", empty)["counts"]["samples"] == 7
    # A shard that no longer matches its checksum stops the export midway: nothing is published.
    shard = source / "shards" / "shard-00001.safetensors"
    blob = bytearray(shard.read_bytes())
    blob[-1] ^= 0xFF
    shard.write_bytes(bytes(blob))
    with pytest.raises(ChecksumMismatch):
        export_output(source, "specforge", tmp_path / "broken")
    assert not (tmp_path / "broken").exists()
    assert not [p for p in tmp_path.iterdir() if ".hsx-partial-" in p.name]


def test_report_and_checksums_describe_every_file(tmp_path: Path) -> None:
    source = make(tmp_path, final_state="both")
    dest = tmp_path / "exp"
    report = export_output(source, "speculators", dest)
    assert json.loads((dest / REPORT_FILE).read_text()) == report
    assert report["counts"]["samples"] == 7 and report["counts"]["tokens"] == sum(OutputSpec().lengths)
    assert (
        report["source"]["manifest_sha256"]
        == hashlib.sha256((source / "manifest.json").read_bytes()).hexdigest()
    )
    lines = (dest / CHECKSUMS_FILE).read_text().splitlines()
    listed = {line.split("  ", 1)[1]: line.split("  ", 1)[0] for line in lines}
    on_disk = {
        p.relative_to(dest).as_posix()
        for p in dest.rglob("*")
        if p.is_file() and p.name not in (REPORT_FILE, CHECKSUMS_FILE)
    }
    assert set(listed) == on_disk
    assert report["counts"]["files"] == len(on_disk)
    for relative, digest in listed.items():
        assert hashlib.sha256((dest / relative).read_bytes()).hexdigest() == digest
    check = subprocess.run(["sha256sum", "--quiet", "-c", CHECKSUMS_FILE], cwd=dest, capture_output=True)
    assert check.returncode == 0, check.stderr


def test_specforge_vocab_mapping_breaks_ties_the_way_specforge_does(tmp_path: Path) -> None:
    # Dataset indices past 10 in folders of 4: SpecForge meets files in sorted path order (rows_12-16
    # before rows_4-8, data_10 before data_9), not in sample order, and ties among equal counts follow
    # that first meeting. Few distinct ids, so most counts tie.
    spec = dict(lengths=(6,) * 14, samples_per_shard=5, vocab_size=12, seed=0, skip_indices=(0, 1, 3, 5))
    source = make(tmp_path, **spec)
    options = ExportOptions(draft_vocab_size=5, target_vocab_size=12, group_size=4)
    report = export_output(source, "specforge", tmp_path / "sf", options)
    saved = torch.load(tmp_path / "sf" / "vocab_mapping" / "vocab_mapping.pt", weights_only=True)
    assert report["target"]["vocab_mapping"]["path"] == "vocab_mapping/vocab_mapping.pt"

    specforge = pytest.importorskip(
        "specforge.data.preprocessing",
        reason="specforge (interop extra, installed with --no-deps) is missing",
    )
    from specforge.training.vocab_mapping import count_effective_feature_tokens

    counts = count_effective_feature_tokens(str(tmp_path / "sf"), target_vocab_size=12)
    d2t, t2d = specforge.process_token_dict_to_mappings(counts, 5, 12)
    assert torch.equal(saved["d2t"], d2t) and torch.equal(saved["t2d"], t2d)
    assert saved["d2t"].dtype == d2t.dtype and saved["t2d"].dtype == t2d.dtype

    # The order matters here: counting in sample order picks a different vocabulary.
    naive: Counter[int] = Counter()
    for sample in iter_samples(source):
        naive.update(sample.input_ids[sample.loss_mask.astype(bool)].tolist())
    assert not torch.equal(vocab_mapping(naive, 5, 12)[1], t2d)


def test_cli_exports_and_refuses(tmp_path: Path) -> None:
    source = make(tmp_path, final_state="post")
    run = [sys.executable, "-m", "hsx.cli", "export", str(source), "--format"]
    done = subprocess.run([*run, "modelopt", str(tmp_path / "mo")], cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["counts"]["samples"] == 7
    refused_run = subprocess.run(
        [*run, "speculators", str(tmp_path / "sp")], cwd=REPO, capture_output=True, text=True
    )
    assert refused_run.returncode == 2
    assert json.loads(refused_run.stderr)["error"] == "export_not_possible"
    missing = subprocess.run(
        [
            sys.executable,
            "-m",
            "hsx.cli",
            "export",
            "no-such-job",
            "--format",
            "modelopt",
            str(tmp_path / "m2"),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        env={"HSX_OUTPUT_DIR": str(tmp_path / "outputs"), "PATH": "/usr/bin:/bin"},
    )
    assert missing.returncode == 2 and json.loads(missing.stderr)["error"] == "export_source_not_found"
