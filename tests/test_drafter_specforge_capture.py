"""The drafter proof's "SpecForge's own capture" row, the parts that run on CPU.

``scripts/device/drafter/specforge_capture.py`` turns the proof's conversations into token ids and loss masks
with SpecForge 0.2.0's own ``build_eagle3_dataset`` (its parser, the model's chat template, a SmolLM2
template registered the way SpecForge says to register a new model's). Those must equal what an hsx job
feeds the engine for the same conversations (``workers.chat.ChatEncoder``), or the two rows would train on
different tokens. ``compare_features.py`` then pairs the two feature folders by content and compares ids,
masks and states; it is checked here on folders whose differences are known.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

from tests.fixtures.stack import REPO
from workers.chat import ChatEncoder

DRAFTER = REPO / "scripts" / "device" / "drafter"


def _module(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, DRAFTER / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _conversations(tmp_path: Path) -> list[dict[str, Any]]:
    """The proof's own training prompts, each with an answer of the shapes the target writes (several
    lines, a list, non-ASCII text, a trailing space)."""
    subprocess.run(
        [sys.executable, str(DRAFTER / "make_prompts.py"), str(tmp_path / "prompts")],
        check=True,
        capture_output=True,
    )
    lines = (tmp_path / "prompts" / "train_prompts.jsonl").read_text().splitlines()
    answers = ["Sure. First, water it.\nThen:\n- repot\n- wait ", "Café au lait — 3 × 2 = 6.", "Yes."]
    rows = []
    for i, line in enumerate(lines[:60]):
        row = json.loads(line)
        row["messages"].append({"role": "assistant", "content": answers[i % len(answers)] + f" ({i})"})
        rows.append(row)
    return rows


def test_specforge_tokenises_the_proof_as_hsx_does(tmp_path: Path, tokenizer: Any) -> None:
    pytest.importorskip("specforge")
    rows = _conversations(tmp_path)
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in rows))
    capture = _module("specforge_capture")
    dataset = capture.build_dataset(tokenizer.name_or_path, str(train), str(tmp_path / "cache"), num_proc=1)
    assert len(dataset) == len(rows)
    encoder = ChatEncoder(tokenizer, max_length=1024)
    expected = {}
    for row in rows:
        sample = encoder.encode(row["messages"])
        expected[tuple(sample.input_ids)] = sample.loss_mask
    for row in dataset:  # SpecForge shuffles: pair by the ids themselves
        ids = tuple(torch.as_tensor(row["input_ids"]).view(-1).tolist())
        assert ids in expected, tokenizer.decode(list(ids))
        assert torch.as_tensor(row["loss_mask"]).view(-1).tolist() == expected.pop(ids)
    assert not expected


def _write(path: Path, ids: list[int], mask: list[int], states: torch.Tensor) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(
        {
            "input_ids": torch.tensor(ids),
            "loss_mask": torch.tensor(mask),
            "hidden_state": states[..., :8].clone(),
            "aux_hidden_state": states[..., 8:].clone(),
        },
        path,
    )


def _sample(user: int, answer: list[int], mask_end: bool = True) -> tuple[list[int], list[int]]:
    """<|im_start|>system .. <|im_end|> <|im_start|>user U <|im_end|> <|im_start|>assistant A <|im_end|>"""
    ids = [1, 9, 9, 2, 1, 5, user, 2, 1, 6, *answer, 2]
    return ids, [0] * 10 + [1] * len(answer) + [1 if mask_end else 0]


def test_compare_features_pairs_by_content_and_reports_each_difference(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(0)
    hsx = {10: _sample(10, [20, 21]), 11: _sample(11, [22]), 12: _sample(12, [23, 24]), 13: _sample(13, [25])}
    # SpecForge's side, numbered in another order: user 11's answer differs by a token, user 12's mask
    # leaves out the closing <|im_end|>.
    specforge = {
        13: _sample(13, [25]),
        12: _sample(12, [23, 24], mask_end=False),
        11: _sample(11, [22, 26]),
        10: _sample(10, [20, 21]),
    }
    for i, (user, (ids, mask)) in enumerate(hsx.items()):
        states = torch.randn(1, len(ids), 32, generator=g)
        _write(tmp_path / "hsx" / "rows_0-2000" / f"data_{i}.ckpt", ids, mask, states)
        sf_ids, sf_mask = specforge[user]
        noise = torch.randn(1, len(sf_ids), 32, generator=g) * 0.01
        sf_states = states + noise if len(sf_ids) == len(ids) else noise
        _write(tmp_path / "sf" / "rows_0-2000" / f"data_{3 - i}.ckpt", sf_ids, sf_mask, sf_states)
    out = subprocess.run(
        [sys.executable, str(DRAFTER / "compare_features.py"), str(tmp_path / "hsx"), str(tmp_path / "sf")],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    report = json.loads(out)
    assert report["paired"] == 4
    assert report["equal_ids"] == 3
    assert report["equal_ids_and_masks"] == 2
    assert report["mask_differs"] == 1
    assert report["mask_difference_tokens"] == {"hsx only: '[2]'": 1}
    assert report["id_differences"] == [
        {"hsx_len": 12, "specforge_len": 13, "first_diff": 11, "hsx": "[2]", "specforge": "[26, 2]"}
    ]
    assert 0.99 < report["final_state_cosine"]["mean"] < 1.0
    assert len(report["aux_cosine_mean"]) == 3
    assert all(0.99 < c < 1.0 for c in report["aux_cosine_mean"])
