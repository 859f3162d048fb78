"""Dataset sources: Parquet, ``datasets`` folders, JSON arrays, http(s) and s3 give the records of the same
data in JSONL, read by the worker's own record parser. The fixtures are made with the ``datasets`` package;
the code under test reads them with pyarrow alone. S3 is moto's server on a loopback port."""

from __future__ import annotations

import http.server
import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from hsx.server.ingest import (
    SOURCE_FILE,
    DatasetError,
    Pretokenized,
    ensure_public_host,
    materialize,
    parse_record,
    without_nulls,
)
from hsx.server.settings import Settings
from tests.fixtures.s3 import S3Bucket

datasets = pytest.importorskip("datasets", reason="the interop extra provides datasets for these fixtures")

# One column layout (Arrow needs one type per column), optional struct fields present in some rows only,
# multi-turn conversations, ShareGPT rows and pre-tokenized rows side by side, unicode and a newline.
RECORDS: list[dict[str, Any]] = [
    {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Add 2 and 3.", "name": "ana"},
            {"role": "assistant", "content": "5."},
            {"role": "user", "content": "And times 4?"},
            {"role": "assistant", "content": "20.\nDone."},
        ]
    },
    {"conversations": [{"from": "human", "value": "Bonjour ☕"}, {"from": "gpt", "value": "Salut !"}]},
    {"input_ids": [5, 6, 7, 8], "loss_mask": [0, 0, 1, 1]},
    {
        "messages": [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello", "name": "bot"},
        ]
    },
    {"messages": [{"role": "user", "content": "Only a question"}]},
    {"input_ids": [9, 10]},
]


def parsed(path: Path) -> list[Any]:
    lines = [line for line in path.read_bytes().split(b"\n") if line.strip()]
    return [parse_record(line) for line in lines]


@pytest.fixture
def root(tmp_path: Path) -> Path:
    folder = tmp_path / "root"
    folder.mkdir()
    return folder


@pytest.fixture
def settings(root: Path, tmp_path: Path) -> Settings:
    return Settings(data_dir=tmp_path / "data", dataset_roots=[root])


@pytest.fixture
def jsonl(root: Path) -> Path:
    path = root / "chats.jsonl"
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in RECORDS), encoding="utf-8")
    return path


@pytest.fixture
def hf(jsonl: Path, tmp_path: Path) -> Any:
    """The JSONL file as the ``datasets`` package reads it (its own JSON loader, cached under tmp)."""
    return datasets.Dataset.from_json(str(jsonl), cache_dir=str(tmp_path / "hf-cache"))


def test_the_fixture_is_what_the_comparison_needs(jsonl: Path, hf: Any) -> None:
    # Arrow fills absent columns with nulls, and datasets stores objects whose keys differ as JSON text
    # (the arrow.json type): the cases the conversion must undo.
    row = hf.data.slice(0, 1).to_pylist()[0]
    assert row["input_ids"] is None and isinstance(row["messages"][0], str)
    records = parsed(jsonl)
    assert isinstance(records[2], Pretokenized) and isinstance(records[0], list) and len(records[0]) == 5


def test_a_jsonl_file_is_used_in_place(jsonl: Path, settings: Settings, tmp_path: Path) -> None:
    dest = tmp_path / "prepared"
    assert materialize(str(jsonl), dest, settings) == jsonl.resolve()
    assert materialize(f"file://{jsonl}", dest, settings) == jsonl.resolve()
    assert not dest.exists()


def test_parquet_gives_the_same_records_as_jsonl(
    jsonl: Path, hf: Any, root: Path, settings: Settings, tmp_path: Path
) -> None:
    hf.to_parquet(str(root / "chats.parquet"))
    out = materialize("chats.parquet", tmp_path / "prepared", settings)
    assert out == tmp_path / "prepared" / SOURCE_FILE
    assert parsed(out) == parsed(jsonl)
    assert [json.loads(line) for line in out.read_text().splitlines()] == RECORDS
    assert not [p for p in out.parent.iterdir() if p.name.startswith(".")]  # no temp file left


def test_a_datasets_folder_gives_the_same_records_as_jsonl(
    jsonl: Path, hf: Any, root: Path, settings: Settings, tmp_path: Path
) -> None:
    hf.save_to_disk(str(root / "saved"), num_shards=3)  # several Arrow files, read in order
    assert len(list((root / "saved").glob("*.arrow"))) > 1
    out = materialize(str(root / "saved"), tmp_path / "prepared", settings)
    assert parsed(out) == parsed(jsonl)
    splits = datasets.DatasetDict({"test": hf.select([1]), "train": hf})
    splits.save_to_disk(str(root / "splits"))
    out = materialize("splits", tmp_path / "prepared-dict", settings)
    assert parsed(out) == parsed(jsonl)


def test_a_json_array_gives_the_same_records_as_jsonl(
    jsonl: Path, root: Path, settings: Settings, tmp_path: Path
) -> None:
    (root / "chats.json").write_text(json.dumps(RECORDS, ensure_ascii=False, indent=1), encoding="utf-8")
    assert parsed(materialize("chats.json", tmp_path / "prepared", settings)) == parsed(jsonl)


def test_unusable_sources_are_refused_with_a_reason(
    hf: Any, root: Path, settings: Settings, tmp_path: Path
) -> None:
    (root / "plain").mkdir()
    (root / "plain" / "x.jsonl").write_text("{}\n")
    ambiguous = datasets.DatasetDict({"a": hf, "b": hf})
    ambiguous.save_to_disk(str(root / "ambiguous"))
    (root / "broken.parquet").write_bytes(b"PAR1 not really")
    cases = {"plain": "not_a_file", "ambiguous": "ambiguous_split", "broken.parquet": "unreadable_parquet"}
    for name, reason in cases.items():
        with pytest.raises(DatasetError) as caught:
            materialize(name, tmp_path / "prepared", settings)
        assert caught.value.reason == reason, (name, caught.value)
    with pytest.raises(DatasetError) as caught:
        materialize("../outside.jsonl", tmp_path / "prepared", settings)
    assert caught.value.reason == "path_traversal"


def test_without_nulls_keeps_list_positions() -> None:
    assert without_nulls({"a": None, "b": [None, {"c": None, "d": 1}]}) == {"b": [None, {"d": 1}]}


# --- http(s), through the guarded downloader ------------------------------------------------------------


@pytest.fixture
def web(root: Path, hf: Any) -> Iterator[str]:
    hf.to_parquet(str(root / "web.parquet"))
    payload = (root / "web.parquet").read_bytes()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - the http.server hook name
            self.send_response(200)
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/exports/chats.parquet"
    finally:
        server.shutdown()
        server.server_close()


def test_http_sources_keep_the_address_guard(
    web: str, jsonl: Path, settings: Settings, tmp_path: Path
) -> None:
    with pytest.raises(DatasetError) as caught:
        materialize(web, tmp_path / "prepared", settings)  # production check: loopback is not public
    assert caught.value.reason == "address_not_public"

    def loopback_only_here(host: str) -> list[str]:
        return ["127.0.0.1"] if host == "127.0.0.1" else ensure_public_host(host)

    out = materialize(web, tmp_path / "prepared", settings, check_host=loopback_only_here)
    assert parsed(out) == parsed(jsonl)
    assert out.parent == tmp_path / "prepared" and len(list((out.parent / "downloads").iterdir())) == 1


# --- s3, from moto's server ------------------------------------------------------------------------------


def test_s3_objects_and_folders_give_the_same_records(
    s3_bucket: S3Bucket, jsonl: Path, hf: Any, root: Path, tmp_path: Path
) -> None:
    client = s3_bucket.client()
    client.upload_file(str(jsonl), s3_bucket.name, "raw/chats.jsonl")
    hf.to_parquet(str(root / "chats.parquet"))
    client.upload_file(str(root / "chats.parquet"), s3_bucket.name, "raw/chats.parquet")
    hf.save_to_disk(str(root / "saved"))
    for path in (root / "saved").iterdir():
        client.upload_file(str(path), s3_bucket.name, f"raw/saved/{path.name}")
    settings = s3_bucket.settings(data_dir=tmp_path / "data", dataset_roots=[root])
    for number, key in enumerate(("raw/chats.jsonl", "raw/chats.parquet", "raw/saved", "raw/saved/")):
        out = materialize(f"s3://{s3_bucket.name}/{key}", tmp_path / f"prepared-{number}", settings)
        assert parsed(out) == parsed(jsonl), key
        assert out.is_relative_to(tmp_path / f"prepared-{number}")


def test_s3_refusals(s3_bucket: S3Bucket, root: Path, tmp_path: Path) -> None:
    settings = s3_bucket.settings(data_dir=tmp_path / "data", dataset_roots=[root], max_dataset_bytes=64)
    s3_bucket.client().put_object(Bucket=s3_bucket.name, Key="big.jsonl", Body=b"{}\n" * 100)
    s3_bucket.client().put_object(Bucket=s3_bucket.name, Key="loose/a.jsonl", Body=b"{}\n")
    cases = {
        f"s3://{s3_bucket.name}/big.jsonl": "too_large",
        f"s3://{s3_bucket.name}/missing.jsonl": "not_found",
        f"s3://{s3_bucket.name}/loose": "unsupported_format",
        "s3://not-allowed-bucket/x.jsonl": "bucket_not_allowed",
    }
    for uri, reason in cases.items():
        with pytest.raises(DatasetError) as caught:
            materialize(uri, tmp_path / "prepared", settings)
        assert caught.value.reason == reason, (uri, caught.value)
    assert not (tmp_path / "prepared" / "downloads").exists() or not [
        p for p in (tmp_path / "prepared" / "downloads").iterdir() if p.name.startswith(".partial")
    ]
