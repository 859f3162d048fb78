"""Conversion of a job's dataset to the prepared JSONL: one local file of records, one per line, made by
the worker that prepares the job (never inside an API request).

``materialize(dataset_uri, dest_dir, settings)`` accepts what
:func:`hsx.server.ingest.policy.check_dataset_uri` accepts, and checks it again here:

* a local path or ``file://`` URI under the dataset roots: a JSONL file is returned as it is (no copy); a
  JSON array, a Parquet file or a Hugging Face ``datasets`` folder (``save_to_disk``; for a DatasetDict,
  its ``train`` split or its only split) is converted;
* ``http(s)://`` and ``s3://bucket/key``: fetched by :mod:`hsx.server.ingest.fetch` (public addresses only,
  pinned connections, an allowed bucket, size and time limits) into ``dest_dir/downloads``, then as above.

A converted file is ``dest_dir/source.jsonl``, written under a temp name, fsynced and renamed, so it is
whole or absent. Record ``i`` is line ``i``: the sample numbering of :mod:`hsx.server.ingest.files`. Parquet
and Arrow give every row every column and every struct every field, so a value that is null is written as an
absent key (that is how the same record reads in JSONL); values stored as JSON text (the ``arrow.json``
type ``datasets`` uses for objects whose keys differ) are decoded; dates become ISO text and binary values
base64 text. Columns are read with pyarrow alone: no ``datasets`` package at run time.

Every refusal is a :class:`hsx.server.ingest.errors.DatasetError` with a stable reason.
"""

from __future__ import annotations

import base64
import datetime
import decimal
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from hsx.layout import atomic_file
from hsx.server.ingest.errors import DatasetError
from hsx.server.ingest.fetch import download_dataset, fetch_s3
from hsx.server.ingest.files import PARQUET_MAGIC, detect_layout, load_array
from hsx.server.ingest.policy import (
    HostCheck,
    UriRefused,
    check_dataset_uri,
    ensure_public_host,
    is_datasets_folder,
    resolve_local_dataset,
    uri_scheme,
)
from hsx.server.settings import Settings

SOURCE_FILE = "source.jsonl"
DOWNLOADS_DIR = "downloads"
_BATCH_ROWS = 1024


def materialize(
    dataset_uri: str, dest_dir: Path, settings: Settings, *, check_host: HostCheck = ensure_public_host
) -> Path:
    """The dataset as a local JSONL file: the original if it is one, else a new file under ``dest_dir``.

    ``check_host`` vets each http(s) hop (production: public addresses only; tests let loopback through).
    """
    try:
        # The same checks as at submit time, each where it applies: characters and the scheme allow-list
        # first, then the roots for a path, every hop's addresses for a download, the bucket for s3.
        scheme = uri_scheme(dataset_uri, settings)
        if scheme == "file":
            source = resolve_local_dataset(dataset_uri, settings).path
        elif scheme in ("http", "https"):
            downloads = Path(dest_dir) / DOWNLOADS_DIR
            source = download_dataset(dataset_uri, settings, check_host=check_host, into=downloads).path
        elif scheme == "s3":
            source = fetch_s3(dataset_uri, Path(dest_dir) / DOWNLOADS_DIR, settings)
        else:
            check_dataset_uri(dataset_uri, settings)  # refuses a scheme hsx cannot read, saying so
            raise DatasetError("uri_scheme_not_supported", f"{scheme}:// datasets cannot be read")
    except UriRefused as exc:
        raise DatasetError(exc.error, exc.detail) from exc
    return as_jsonl(source, Path(dest_dir))


def source_kind(path: Path) -> str:
    """``datasets_folder``, ``parquet``, ``json_array`` or ``jsonl``."""
    if path.is_dir():
        if is_datasets_folder(path):
            return "datasets_folder"
        raise DatasetError("unsupported_format", f"{path} is a folder but not a datasets save_to_disk folder")
    with open(path, "rb") as fh:
        if fh.read(len(PARQUET_MAGIC)) == PARQUET_MAGIC:
            return "parquet"
    return "json_array" if detect_layout(path) == "json_array" else "jsonl"


def as_jsonl(source: Path, dest_dir: Path) -> Path:
    kind = source_kind(source)
    if kind == "jsonl":
        return source
    readers = {"parquet": _parquet_records, "datasets_folder": _folder_records, "json_array": _array_records}
    return _write_jsonl(readers[kind](source), dest_dir / SOURCE_FILE)


# --- writing ----------------------------------------------------------------------------------------------


def _write_jsonl(records: Iterator[Any], target: Path) -> Path:
    target.parent.mkdir(parents=True, exist_ok=True)
    with atomic_file(target, text=True) as fh:
        for record in records:
            # ASCII escapes: a record may hold lone surrogates, valid JSON but not UTF-8.
            fh.write(json.dumps(record, separators=(",", ":"), default=_json_value))
            fh.write("\n")
    return target


def _json_value(value: Any) -> Any:
    if isinstance(value, datetime.datetime | datetime.date | datetime.time):
        return value.isoformat()
    if isinstance(value, decimal.Decimal):
        return str(value)
    if isinstance(value, bytes | bytearray | memoryview):
        return base64.b64encode(bytes(value)).decode("ascii")
    if isinstance(value, datetime.timedelta):
        return value.total_seconds()
    raise TypeError(f"a {type(value).__name__} value has no JSON form")


def _json_decoder(arrow_type: Any) -> Callable[[Any], Any] | None:
    """How to turn a value of ``arrow_type`` from ``to_pylist`` back into JSON data (None: as it is).

    ``datasets`` 4 and later store a column whose objects differ in their keys as the ``arrow.json``
    extension type: JSON text per value, which is decoded here, at any depth.
    """
    import pyarrow as pa

    if getattr(arrow_type, "extension_name", None) == "arrow.json":
        return lambda value: None if value is None else json.loads(value)
    if (
        pa.types.is_list(arrow_type)
        or pa.types.is_large_list(arrow_type)
        or pa.types.is_fixed_size_list(arrow_type)
    ):
        inner = _json_decoder(arrow_type.value_type)
        if inner is None:
            return None
        return lambda value: None if value is None else [inner(item) for item in value]
    if pa.types.is_struct(arrow_type):
        fields: dict[str, Callable[[Any], Any]] = {}
        for index in range(arrow_type.num_fields):
            field = arrow_type.field(index)
            decoder = _json_decoder(field.type)
            if decoder is not None:
                fields[field.name] = decoder
        if not fields:
            return None
        return lambda value: (
            None if value is None else {k: fields[k](v) if k in fields else v for k, v in value.items()}
        )
    return None


def _batch_records(batch: Any) -> Iterator[Any]:
    decoders: dict[str, Callable[[Any], Any]] = {}
    for field in batch.schema:
        decoder = _json_decoder(field.type)
        if decoder is not None:
            decoders[field.name] = decoder
    for row in batch.to_pylist():
        for name, decoder in decoders.items():
            row[name] = decoder(row[name])
        yield without_nulls(row)


def without_nulls(value: Any) -> Any:
    """Drop null-valued keys at every depth (Arrow's filled-in struct fields); lists keep their nulls."""
    if isinstance(value, dict):
        return {k: without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [without_nulls(v) for v in value]
    return value


# --- formats ----------------------------------------------------------------------------------------------


def _parquet_records(path: Path) -> Iterator[Any]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(path)
        for batch in parquet.iter_batches(batch_size=_BATCH_ROWS):
            yield from _batch_records(batch)
    except (pa.ArrowException, OSError) as exc:
        raise DatasetError("unreadable_parquet", f"{path.name}: {exc}") from exc


def _array_records(path: Path) -> Iterator[Any]:
    yield from load_array(path)


def _folder_records(folder: Path) -> Iterator[Any]:
    """Rows of a ``save_to_disk`` folder, from its Arrow files in the order ``state.json`` lists them."""
    import pyarrow as pa

    folder = _split_folder(folder)
    try:
        state = json.loads((folder / "state.json").read_text(encoding="utf-8"))
        files = [entry["filename"] for entry in state["_data_files"]]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise DatasetError("unreadable_datasets_folder", f"{folder.name}/state.json: {exc}") from exc
    if state.get("_indices_data_files"):
        raise DatasetError(
            "unsupported_format",
            "the datasets folder holds an indices mapping; save it again after flatten_indices()",
        )
    for name in files:
        try:
            for batch in _arrow_batches(folder / _plain_name(name)):
                yield from _batch_records(batch)
        except (pa.ArrowException, OSError) as exc:
            raise DatasetError("unreadable_datasets_folder", f"{name}: {exc}") from exc


def _arrow_batches(path: Path) -> Iterator[Any]:
    """Record batches of an Arrow IPC stream (what save_to_disk writes) or, failing that, an IPC file."""
    import pyarrow as pa

    with pa.memory_map(str(path)) as source:
        try:
            stream = pa.ipc.open_stream(source)
        except pa.ArrowInvalid:
            source.seek(0)
            file = pa.ipc.open_file(source)
            for number in range(file.num_record_batches):
                yield file.get_batch(number)
            return
        yield from stream


def _split_folder(folder: Path) -> Path:
    """The folder itself for a Dataset; for a DatasetDict, its ``train`` split or its only split."""
    if (folder / "state.json").is_file():
        return folder
    try:
        splits = list(json.loads((folder / "dataset_dict.json").read_text(encoding="utf-8"))["splits"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise DatasetError("unreadable_datasets_folder", f"dataset_dict.json: {exc}") from exc
    chosen = "train" if "train" in splits else (splits[0] if len(splits) == 1 else None)
    if chosen is None:
        raise DatasetError(
            "ambiguous_split",
            f"the DatasetDict has splits {splits} and none is 'train'; save one split alone",
        )
    split = folder / _plain_name(str(chosen))
    if not (split / "state.json").is_file():
        raise DatasetError("unreadable_datasets_folder", f"split {chosen!r} has no state.json")
    return split


def _plain_name(name: str) -> str:
    if not name or "/" in name or "\\" in name or name in (".", "..") or "\x00" in name:
        raise DatasetError(
            "unreadable_datasets_folder", f"file name {name!r} in the folder's metadata is not plain"
        )
    return name
