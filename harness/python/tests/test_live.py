"""The live training state by category: what a phase leaves alive shows in its end's
`memory_after.by_category`, each storage once, and nothing when everything was released."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ckpt_record import Recorder, live, memory


def trained() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A 4×4 linear layer (80 bytes of float32 parameters) after one AdamW step."""
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    return model, opt


def phase_end(path: Path) -> dict[str, int]:
    """The `memory_after.by_category` of the record's last line."""
    end = json.loads(path.read_text().splitlines()[-1])
    assert end["kind"] == "phase_end"
    counted: dict[str, int] = end["memory_after"]["by_category"]
    return counted


def test_a_model_kept_past_its_phase_is_counted_and_a_released_one_is_not(tmp_path: Path) -> None:
    before = memory.held("cpu")["by_category"]
    kept = tmp_path / "kept.jsonl"
    rec = Recorder.open(kept, "reference", memory_before=memory.held("cpu"))
    model, opt = trained()
    del opt
    rec.phase_end()
    after = phase_end(kept)
    assert {k: after[k] - before[k] for k in live.CATEGORIES} == {
        "params": 80,
        "grads": 80,
        "optimizer": 0,
    }
    del model
    released = tmp_path / "released.jsonl"
    rec = Recorder.open(released, "reference", memory_before=memory.held("cpu"))
    model, opt = trained()
    del model, opt
    rec.phase_end()
    assert phase_end(released) == before


def test_optimizer_state_and_tied_weights_count_once() -> None:
    before = live.by_category()
    model, opt = trained()
    assert isinstance(model.weight, torch.Tensor)
    alias = torch.nn.Parameter(model.weight.data)
    now = live.by_category()
    # exp_avg and exp_avg_sq of both tensors (160 bytes) and their float32 step counts (8 bytes).
    assert {k: now[k] - before[k] for k in live.CATEGORIES} == {
        "params": 80,
        "grads": 80,
        "optimizer": 168,
    }
    del model, opt, alias


def test_without_memory_before_the_phase_end_counts_nothing(tmp_path: Path) -> None:
    path = tmp_path / "r.jsonl"
    rec = Recorder.open(path, "reference")
    rec.phase_end()
    end = json.loads(path.read_text().splitlines()[-1])
    assert "by_category" not in end["memory_after"]
