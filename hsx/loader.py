"""Read a job's output back for drafter training (format: docs/format.md), one sample at a time or at
random, from schema 1, 2 and 3 outputs alike.

Schema 3 (fp8) states come back dequantized (float32; bf16 for torch) unless ``raw_fp8`` asks for the
e4m3 codes and their per-token scales; a scale that is non-finite, zero or negative raises LoaderError.

Shards are memory-mapped, so a sample costs its own bytes, not its shard's; each returned sample owns its
arrays (copies), so nothing keeps a shard mapped after the reader moves on. With ``verify_checksums`` a
shard is hashed before its first sample is returned and a mismatch raises :class:`ChecksumMismatch`.

numpy is required; torch only for ``as_torch=True``.
"""

from __future__ import annotations

import bisect
import hashlib
import mmap
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal, overload

import numpy as np
import numpy.typing as npt

from hsx import fp8
from hsx.layout import (
    PRE_NORM_TENSOR,
    TOKEN_TENSOR_NAMES,
    sample_tensor_name,
    scale_tensor_name,
    shard_checksums,
    state_tensor_names,
    tensor_name,
)
from hsx.manifest import Manifest, ShardEntry
from hsx.safetensors_io import SafetensorsError, TensorSpec, parse_header
from hsx.samples import Sample as Sample  # the loader's public names; defined beside the torch converter
from hsx.samples import TorchSample as TorchSample
from hsx.samples import bf16_words_to_float32 as bf16_words_to_float32
from hsx.samples import to_torch

_NUMPY_DTYPES = {
    "F8_E4M3": "u1",
    "BF16": "<u2",
    "F16": "<f2",
    "F32": "<f4",
    "I32": "<i4",
    "I64": "<i8",
    "U8": "u1",
}
_V1_STATE_TENSORS = ("hidden_state", "aux_hidden_state")
_OPEN_SHARDS = 4  # mapped at once by a random-access reader


class LoaderError(Exception):
    """A shard does not match its manifest entry or the shard format."""


class ChecksumMismatch(LoaderError):
    pass


class ShardView:
    """One mapped shard of either schema, checked against its manifest entry."""

    def __init__(self, path: Path, entry: ShardEntry, manifest: Manifest, verify: bool) -> None:
        self.path = path
        self.manifest = manifest
        with open(path, "rb") as fh:
            size = fh.seek(0, 2)
            if size != entry.bytes or size < 8:
                raise LoaderError(f"{path}: {size} bytes, the manifest says {entry.bytes}")
            self._buffer = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        try:
            self.specs = parse_header(self._buffer, size, str(path))
        except SafetensorsError as exc:
            raise LoaderError(str(exc)) from exc
        if verify:
            self._verify(entry)
        missing = [name for name in TOKEN_TENSOR_NAMES if name not in self.specs]
        if manifest.schema_version == 1:
            missing += [name for name in _V1_STATE_TENSORS if name not in self.specs]
        if missing:
            raise LoaderError(f"{path}: missing tensors {missing}")
        self.offsets = self._array("sample_offsets")
        self.indices = self._array("sample_index")
        self.input_ids = self._array("input_ids")
        self.loss_mask = self._array("loss_mask")
        self._check(entry)

    def _verify(self, entry: ShardEntry) -> None:
        if self.manifest.schema_version == 1:
            digest = hashlib.sha256(self._buffer).hexdigest()
            if digest != entry.sha256:
                raise ChecksumMismatch(f"{self.path}: sha256 {digest}, the manifest says {entry.sha256}")
            return
        header, data = shard_checksums(self._buffer)
        if header != entry.header_sha256 or data != entry.sha256:
            raise ChecksumMismatch(
                f"{self.path}: header/data sha256 {header}/{data}, the manifest says "
                f"{entry.header_sha256}/{entry.sha256}"
            )

    def _array(self, name: str) -> npt.NDArray[Any]:
        spec: TensorSpec = self.specs[name]
        if spec.dtype not in _NUMPY_DTYPES:
            raise LoaderError(f"{self.path}: tensor {name} has unsupported dtype {spec.dtype!r}")
        dtype = np.dtype(_NUMPY_DTYPES[spec.dtype])
        count = spec.nbytes // dtype.itemsize
        return np.frombuffer(self._buffer, dtype=dtype, count=count, offset=spec.start).reshape(spec.shape)

    def _state_names(self) -> list[str]:
        """Per-sample dump tensors a schema 2 shard holds, in the manifest's terms."""
        return state_tensor_names(self.manifest.hf_indices, self.manifest.final_state)

    def _check(self, entry: ShardEntry) -> None:
        m, offsets = self.manifest, self.offsets
        tokens = len(self.input_ids)
        problems = []
        if self.loss_mask.shape != (tokens,):
            problems.append("loss_mask length differs from input_ids")
        if len(offsets) != len(self.indices) + 1 or offsets[0] != 0 or offsets[-1] != tokens:
            problems.append("sample_offsets do not cover the tokens")
        elif (np.diff(offsets) <= 0).any():
            problems.append("sample_offsets are not increasing")
        if len(self.indices) != entry.samples or tokens != entry.tokens:
            problems.append(f"{len(self.indices)} samples / {tokens} tokens, manifest disagrees")
        if m.schema_version == 1:
            aux_width = m.hidden_size * (len(m.hf_indices) - 1)
            for name, width in (("hidden_state", m.hidden_size), ("aux_hidden_state", aux_width)):
                spec = self.specs[name]
                if spec.shape != (tokens, width) or spec.dtype != m.dtype:
                    problems.append(f"{name} is {spec.dtype}{list(spec.shape)}")
        elif not problems:
            for k in range(len(self.indices)):
                rows = int(offsets[k + 1] - offsets[k])
                for name in self._state_names():
                    got = self.specs.get(sample_tensor_name(k, name))
                    if got is None or got.shape != (rows, m.hidden_size) or got.dtype != m.dtype:
                        found = "missing" if got is None else f"{got.dtype}{list(got.shape)}"
                        want = f"{m.dtype}{[rows, m.hidden_size]}"
                        problems.append(f"{sample_tensor_name(k, name)} is {found}, expected {want}")
                        break
                    if m.dtype == fp8.FP8_DTYPE:
                        scale_name = scale_tensor_name(sample_tensor_name(k, name))
                        scale = self.specs.get(scale_name)
                        if scale is None or scale.shape != (rows,) or scale.dtype != fp8.SCALE_DTYPE:
                            found = "missing" if scale is None else f"{scale.dtype}{list(scale.shape)}"
                            problems.append(f"{scale_name} is {found}, expected F32[{rows}]")
                            break
        if problems:
            raise LoaderError(f"{self.path}: " + "; ".join(problems[:4]))

    def __len__(self) -> int:
        return len(self.indices)

    def _scales(self, k: int, name: str) -> npt.NDArray[np.float32]:
        tensor = scale_tensor_name(sample_tensor_name(k, name))
        scales: npt.NDArray[np.float32] = self._array(tensor).copy()
        problem = fp8.bad_scales(scales)
        if problem is not None:
            raise LoaderError(f"{self.path}: {tensor} {problem}: the shard is corrupt")
        return scales

    def _fp8_sample(self, k: int, rows: slice, raw: bool) -> Sample:
        m = self.manifest
        aux_names = [tensor_name(i) for i in m.hf_indices[:-1]]
        final_name = tensor_name(m.hf_indices[-1]) if m.final_state != "pre" else None
        pre_name = PRE_NORM_TENSOR if m.final_state != "post" else None
        scales = {name: self._scales(k, name) for name in [*aux_names, final_name, pre_name] if name}

        def tensor(name: str) -> npt.NDArray[Any]:
            codes = self._array(sample_tensor_name(k, name))
            return codes.copy() if raw else fp8.dequantize(codes, scales[name])

        def state(name: str | None) -> npt.NDArray[Any] | None:
            return None if name is None else tensor(name)

        aux_parts = [tensor(name) for name in aux_names]
        return Sample(
            index=int(self.indices[k]),
            input_ids=self.input_ids[rows].astype(np.int32),
            loss_mask=self.loss_mask[rows].copy(),
            hidden_state=state(final_name),
            aux_hidden_state=np.concatenate(aux_parts, axis=1),
            final_pre_norm=state(pre_name),
            hidden_state_scale=scales[final_name] if raw and final_name else None,
            aux_hidden_state_scale=np.stack([scales[n] for n in aux_names], axis=1) if raw else None,
            final_pre_norm_scale=scales[pre_name] if raw and pre_name else None,
        )

    def sample(self, k: int, raw_bf16: bool = False, raw_fp8: bool = False) -> Sample:
        rows = slice(int(self.offsets[k]), int(self.offsets[k + 1]))
        if self.manifest.dtype == fp8.FP8_DTYPE:
            return self._fp8_sample(k, rows, raw_fp8)
        convert = self.manifest.dtype == "BF16" and not raw_bf16

        def own(words: npt.NDArray[Any]) -> npt.NDArray[Any]:
            return bf16_words_to_float32(words) if convert else words.copy()

        m = self.manifest
        if m.schema_version == 1:
            final: npt.NDArray[Any] | None = own(self._array("hidden_state")[rows])
            aux = own(self._array("aux_hidden_state")[rows])
            pre = None
        else:
            aux_parts = [self._array(sample_tensor_name(k, tensor_name(i))) for i in m.hf_indices[:-1]]
            aux = own(np.concatenate(aux_parts, axis=1))
            final = (
                own(self._array(sample_tensor_name(k, tensor_name(m.hf_indices[-1]))))
                if m.final_state != "pre"
                else None
            )
            pre = (
                own(self._array(sample_tensor_name(k, PRE_NORM_TENSOR))) if m.final_state != "post" else None
            )
        return Sample(
            index=int(self.indices[k]),
            input_ids=self.input_ids[rows].astype(np.int32),
            loss_mask=self.loss_mask[rows].copy(),
            hidden_state=final,
            aux_hidden_state=aux,
            final_pre_norm=pre,
        )


class OutputReader:
    """Random access to every sample of a job's output, in manifest order (sample ``i`` of the reader is
    not the dataset index: rejected samples leave no gap here; ``Sample.index`` is the dataset's)."""

    def __init__(
        self,
        output_dir: Path | str,
        verify_checksums: bool = False,
        raw_bf16: bool = False,
        raw_fp8: bool = False,
    ) -> None:
        self.directory = Path(output_dir)
        self.manifest = Manifest.load(self.directory)
        self.verify_checksums = verify_checksums
        self.raw_bf16 = raw_bf16
        self.raw_fp8 = raw_fp8
        self._starts = [0]
        for entry in self.manifest.shards:
            self._starts.append(self._starts[-1] + entry.samples)
        self._open: OrderedDict[int, ShardView] = OrderedDict()

    def __len__(self) -> int:
        return self._starts[-1]

    def shard_sample_counts(self) -> list[int]:
        return [entry.samples for entry in self.manifest.shards]

    def shard(self, number: int) -> ShardView:
        view = self._open.pop(number, None)
        if view is None:
            entry = self.manifest.shards[number]
            path = self.manifest.shard_path(self.directory, entry)
            view = ShardView(path, entry, self.manifest, self.verify_checksums)
        self._open[number] = view
        while len(self._open) > _OPEN_SHARDS:
            self._open.popitem(last=False)
        return view

    def __getitem__(self, i: int) -> Sample:
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(f"sample {i} of {len(self)}")
        number = bisect.bisect_right(self._starts, i) - 1
        return self.shard(number).sample(i - self._starts[number], self.raw_bf16, self.raw_fp8)

    def iter_shard(self, number: int) -> Iterator[Sample]:
        view = self.shard(number)
        for k in range(len(view)):
            yield view.sample(k, self.raw_bf16, self.raw_fp8)

    def __iter__(self) -> Iterator[Sample]:
        for number in range(len(self.manifest.shards)):
            yield from self.iter_shard(number)
            self._open.pop(number, None)  # done with it: let the mapping go


@overload
def iter_samples(
    output_dir: Path | str,
    verify_checksums: bool = ...,
    *,
    raw_bf16: bool = ...,
    raw_fp8: bool = ...,
    as_torch: Literal[False] = ...,
) -> Iterator[Sample]: ...


@overload
def iter_samples(
    output_dir: Path | str,
    verify_checksums: bool = ...,
    *,
    raw_bf16: bool = ...,
    raw_fp8: bool = ...,
    as_torch: Literal[True],
) -> Iterator[TorchSample]: ...


def iter_samples(
    output_dir: Path | str,
    verify_checksums: bool = True,
    *,
    raw_bf16: bool = False,
    raw_fp8: bool = False,
    as_torch: bool = False,
) -> Iterator[Sample] | Iterator[TorchSample]:
    """Every sample of a job's output in manifest order.

    numpy: bf16 states become float32 unless ``raw_bf16`` (then their uint16 words); F16 and F32 are kept;
    fp8 (schema 3) is dequantized to float32 unless ``raw_fp8`` (then uint8 codes plus the ``*_scale``
    fields). ``as_torch``: torch tensors in the shard's own dtype (bf16 as ``torch.bfloat16``; fp8 as
    bfloat16, or ``torch.float8_e4m3fn`` codes with ``raw_fp8``); needs torch.
    """
    if not as_torch:
        return iter(OutputReader(output_dir, verify_checksums, raw_bf16, raw_fp8))
    reader = OutputReader(output_dir, verify_checksums, raw_bf16=True, raw_fp8=raw_fp8)
    dtype = reader.manifest.dtype
    return (to_torch(sample, dtype) for sample in reader)
