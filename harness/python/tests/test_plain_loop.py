"""A plain PyTorch loop on a tiny model with tied weights and dropout, through reference,
resume-mid and resume-end: its records validate, and the resumed phases record the reference's
losses and learning rates bit for bit and its saved state at their resume points."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import plain_loop
import pytest
import torch
from conftest import read_record
from phases import (
    assert_resumed_states_equal_saved,
    assert_resumed_steps_equal_reference,
    by_phase,
)

from ckpt_record import Recorder

MAX_STEPS, EXTRA, RESUME_AT = 6, 2, 3


def train(record: Path, ckpts: Path, phase: str, start: int) -> None:
    """Trains from step `start` (a fresh start at 0, else the checkpoint of `start` steps) to
    `MAX_STEPS + EXTRA`, saving at `RESUME_AT` and `MAX_STEPS` in the reference."""
    plain_loop.train(
        record,
        ckpts,
        phase,
        end=MAX_STEPS + EXTRA,
        horizon=MAX_STEPS,
        save_steps={RESUME_AT, MAX_STEPS} if phase == "reference" else set(),
        resume_dir=ckpts,
        start=start,
    )


def run_phases(tmp_path: Path) -> Path:
    record = tmp_path / "run.jsonl"
    train(record, tmp_path, "reference", 0)
    train(record, tmp_path, "resume-mid", RESUME_AT)
    train(record, tmp_path, "resume-end", MAX_STEPS)
    return record


def test_a_resumed_plain_loop_records_the_reference_s_steps_and_state(
    tmp_path: Path, validator: Any
) -> None:
    lines = read_record(run_phases(tmp_path), validator)
    kinds = [(line["kind"], line["phase"]) for line in lines]
    assert kinds.count(("phase_end", "reference")) == 1
    assert [k for k, p in kinds if p == "resume-mid"][:2] == ["phase", "resume"]
    steps = by_phase(lines, "step")
    assert [s["step"] for s in steps["reference"]] == list(range(MAX_STEPS + EXTRA))
    assert [s["step"] for s in steps["resume-end"]] == [MAX_STEPS, MAX_STEPS + 1]
    assert_resumed_steps_equal_reference(lines, ["resume-mid", "resume-end"])
    assert_resumed_states_equal_saved(lines, ["resume-mid", "resume-end"])
    (save,) = [s for s in by_phase(lines, "save")["reference"] if s["step"] == RESUME_AT]
    assert save["state"]["params"]["tied"] == [["embed.weight", "out.weight"]]
    optimized = set(save["state"]["optimizer"]["by_param"])
    assert optimized == {"embed.weight", "hidden.weight", "hidden.bias"}
    assert set(save["state"]["rng"]) >= {"python", "numpy", "torch_cpu"}
    assert steps["reference"][0]["memory"]["source"] == "host_rss"


def test_a_resume_that_skips_the_rng_differs_from_the_reference(
    tmp_path: Path, validator: Any
) -> None:
    """The comparison above can fail: without the torch generator restored, dropout draws other
    masks and the resumed losses leave the reference's."""
    record = tmp_path / "run.jsonl"
    train(record, tmp_path, "reference", 0)
    ckpt = tmp_path / f"step-{RESUME_AT}.pt"
    saved = torch.load(ckpt, weights_only=False)
    saved["torch"] = torch.manual_seed(plain_loop.SEED + 1).get_state()
    torch.save(saved, ckpt)
    train(record, tmp_path, "resume-mid", RESUME_AT)
    lines = read_record(record, validator)
    with pytest.raises(AssertionError, match="resume-mid step 3: loss"):
        assert_resumed_steps_equal_reference(lines, ["resume-mid"])


def test_the_loss_is_written_as_the_exact_float(tmp_path: Path) -> None:
    path = tmp_path / "r.jsonl"
    rec = Recorder.open(path, "reference")
    third = torch.tensor(1.0, dtype=torch.float32) / 3
    rec.step(0, third, 1e-3, grad_norm=float("nan"))
    rec.phase_end()
    step = json.loads(path.read_text().splitlines()[1])
    assert struct.pack("<f", step["loss"]) == struct.pack("<f", third.item())
    assert step["loss"] == third.item() and step["loss"] != 1 / 3
    assert step["loss_dtype"] == "float32"
    assert step["grad_norm"] is None


def test_the_device_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CPU unless `CKPT_EXAMPLE_DEVICE` names another; on the CPU the saved generators are
    the three a CPU step draws from."""
    monkeypatch.delenv("CKPT_EXAMPLE_DEVICE", raising=False)
    assert plain_loop.device() == torch.device("cpu")
    assert set(plain_loop.rng_states()) == {"python", "numpy", "torch"}
    monkeypatch.setenv("CKPT_EXAMPLE_DEVICE", "cuda")
    assert plain_loop.device() == torch.device("cuda")
