"""A plain PyTorch loop on a tiny model with tied weights and dropout, through reference,
resume-mid and resume-end: its records validate, and the resumed phases record the reference's
losses and learning rates bit for bit and its saved state at their resume points."""

from __future__ import annotations

import json
import math
import random
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import read_record
from phases import (
    assert_resumed_states_equal_saved,
    assert_resumed_steps_equal_reference,
    by_phase,
)

from ckpt_record import Recorder

VOCAB, HIDDEN, SEQ, BATCH, SAMPLES = 32, 16, 8, 4, 10
MAX_STEPS, EXTRA, RESUME_AT = 6, 2, 3
SEED = 7


class Tiny(torch.nn.Module):
    """An embedding, a hidden layer with dropout, and an output tied to the embedding."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, HIDDEN)
        self.hidden = torch.nn.Linear(HIDDEN, HIDDEN)
        self.drop = torch.nn.Dropout(0.2)
        self.out = torch.nn.Linear(HIDDEN, VOCAB, bias=False)
        self.out.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.out(self.drop(torch.tanh(self.hidden(self.embed(ids)))))
        return logits


def dataset() -> torch.Tensor:
    return torch.randint(0, VOCAB, (SAMPLES, SEQ + 1), generator=torch.Generator().manual_seed(1))


def batch_at(
    data: torch.Tensor, epoch: int, position: int
) -> tuple[list[tuple[int, int]], int, int]:
    """The samples of the next batch from `(epoch, position)` and the position after it."""
    samples = []
    for _ in range(BATCH):
        if position == SAMPLES:
            epoch, position = epoch + 1, 0
        order = torch.randperm(SAMPLES, generator=torch.Generator().manual_seed(SEED + epoch))
        samples.append((epoch, int(order[position])))
        position += 1
    return samples, epoch, position


def schedule(step: int) -> float:
    """Warmup over two steps, then cosine decay pinned at its horizon `MAX_STEPS`."""
    warmup = min(1.0, (step + 1) / 2)
    return warmup * 0.5 * (1 + math.cos(math.pi * min(step, MAX_STEPS) / MAX_STEPS))


def train(record: Path, ckpts: Path, phase: str, start: int) -> None:
    """Trains from step `start` (a fresh start at 0, else the checkpoint of `start` steps) to
    `MAX_STEPS + EXTRA`, saving at `RESUME_AT` and `MAX_STEPS` in the reference."""
    random.seed(SEED)
    np.random.seed(SEED)
    torch.manual_seed(SEED)
    model = Tiny()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    epoch, position = 0, 0
    rec = Recorder.open(
        record,
        phase,
        seeds={"python": SEED, "numpy": SEED, "torch": SEED},
        resumed_from=start if start else None,
        checkpoint=f"step-{start}" if start else None,
        planned={"from": start, "end": MAX_STEPS + EXTRA, "horizon": MAX_STEPS},
    )
    if start:
        ckpt: dict[str, Any] = torch.load(ckpts / f"step-{start}.pt", weights_only=False)
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["optimizer"])
        sched.load_state_dict(ckpt["scheduler"])
        random.setstate(ckpt["python"])
        np.random.set_state(ckpt["numpy"])
        torch.set_rng_state(ckpt["torch"])
        epoch, position = ckpt["data"]
        position_now = {"epoch": epoch, "position": position}
        rec.resume(start, model, optimizer=opt, scheduler=sched, data=position_now)
    data = dataset()
    for step in range(start, MAX_STEPS + EXTRA):
        samples, epoch, position = batch_at(data, epoch, position)
        rows = data[[i for _, i in samples]]
        ids, labels = rows[:, :-1], rows[:, 1:]
        loss = torch.nn.functional.cross_entropy(model(ids).reshape(-1, VOCAB), labels.reshape(-1))
        opt.zero_grad()
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        lr = opt.param_groups[0]["lr"]
        opt.step()
        rec.step(
            step,
            loss,
            lr,
            grad_norm=grad_norm,
            tokens=labels.numel(),
            batch={"input_ids": ids, "labels": labels},
            samples=samples,
        )
        sched.step()
        if phase == "reference" and step + 1 in (RESUME_AT, MAX_STEPS):
            torch.save(
                {
                    "model": model.state_dict(),
                    "optimizer": opt.state_dict(),
                    "scheduler": sched.state_dict(),
                    "python": random.getstate(),
                    "numpy": np.random.get_state(),
                    "torch": torch.get_rng_state(),
                    "data": (epoch, position),
                },
                ckpts / f"step-{step + 1}.pt",
            )
            rec.save(
                step + 1,
                model,
                optimizer=opt,
                scheduler=sched,
                data={"epoch": epoch, "position": position},
                checkpoint=f"step-{step + 1}",
            )
    del model, opt, sched
    rec.phase_end()


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
    saved["torch"] = torch.manual_seed(SEED + 1).get_state()
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
