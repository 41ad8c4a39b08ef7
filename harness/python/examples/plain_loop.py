"""A plain PyTorch training loop that writes its run record: a tiny model with tied weights and
dropout, AdamW with a warmup-then-cosine schedule, a seeded shuffled dataset, checkpoints that
hold the model, optimizer, schedule, every generator and the data position. The model trains
on the CPU unless `CKPT_EXAMPLE_DEVICE=cuda`.

`ckpt-harness` runs it through its phases from a suite's `engine: {command}` (see
`harness/python/suites/`); `--fault` breaks its resume the ways trainers do, for the negative
controls. Run one phase by hand:

    python plain_loop.py --phase reference --record run.jsonl --run-dir ckpts \\
        --total-steps 8 --horizon 6 --save-steps 3,6
"""

from __future__ import annotations

import argparse
import math
import os
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ckpt_record import Recorder

VOCAB, HIDDEN, SEQ, BATCH, SAMPLES = 32, 16, 8, 4, 10
SEED = 7
FAULTS = ("none", "rng_not_restored", "data_position_lost", "optimizer_not_restored")


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
    """`SAMPLES` rows of `SEQ + 1` tokens, the same in every process."""
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


def schedule(horizon: int) -> Any:
    """Warmup over two steps, then cosine decay pinned at `horizon`."""

    def factor(step: int) -> float:
        warmup = min(1.0, (step + 1) / 2)
        return warmup * 0.5 * (1 + math.cos(math.pi * min(step, horizon) / horizon))

    return factor


def device() -> torch.device:
    """Where the model trains: `CKPT_EXAMPLE_DEVICE` (`cpu` or `cuda`), the CPU by default."""
    return torch.device(os.environ.get("CKPT_EXAMPLE_DEVICE", "cpu"))


def rng_states() -> dict[str, Any]:
    """Every generator a step draws from: Python's, NumPy's, torch's on the CPU and, where the
    model trains on CUDA, torch's on its GPU (dropout draws there)."""
    states: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if device().type == "cuda":
        states["torch_cuda"] = torch.cuda.get_rng_state(device())
    return states


def restore_rng(ckpt: dict[str, Any], fault: str) -> None:
    """Puts back the generators `rng_states` saved in `ckpt`; torch's stay as seeded under the
    `rng_not_restored` fault."""
    random.setstate(ckpt["python"])
    np.random.set_state(ckpt["numpy"])
    if fault == "rng_not_restored":
        return
    torch.set_rng_state(ckpt["torch"])
    if "torch_cuda" in ckpt:
        torch.cuda.set_rng_state(ckpt["torch_cuda"], device())


def restore(
    path: Path,
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    sched: Any,
    fault: str,
) -> tuple[int, int]:
    """Loads the checkpoint at `path` into `model`, `opt` (not under the
    `optimizer_not_restored` fault) and `sched`, puts back the generators, and returns the data
    position (the first epoch's start under `data_position_lost`). The file is read onto the CPU
    and dropped on return: a checkpoint loaded onto the GPU and kept would hold a second copy of
    the weights there for the whole phase."""
    ckpt: dict[str, Any] = torch.load(path, map_location="cpu", weights_only=False)
    model.load_state_dict(ckpt["model"])
    if fault != "optimizer_not_restored":
        opt.load_state_dict(ckpt["optimizer"])
    sched.load_state_dict(ckpt["scheduler"])
    restore_rng(ckpt, fault)
    if fault == "data_position_lost":
        return 0, 0
    epoch, position = ckpt["data"]
    return int(epoch), int(position)


def checkpoint(run_dir: Path, step: int) -> Path:
    """The checkpoint file of `step` steps in `run_dir`."""
    return run_dir / f"step-{step}.pt"


def train(
    record: Path,
    run_dir: Path,
    phase: str,
    *,
    end: int,
    horizon: int,
    save_steps: set[int],
    resume_dir: Path | None = None,
    start: int = 0,
    fault: str = "none",
) -> None:
    """Trains from step `start` (a fresh start at 0, else the checkpoint of `start` steps in
    `resume_dir`) to `end`, saving into `run_dir` after each step in `save_steps`, and records
    the phase in `record`."""
    random.seed(SEED)
    np.random.seed(SEED)
    torch.manual_seed(SEED)
    model = Tiny().to(device())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule(horizon))
    epoch, position = 0, 0
    rec = Recorder.open(
        record,
        phase,
        seeds={"python": SEED, "numpy": SEED, "torch": SEED},
        resumed_from=start if start else None,
        checkpoint=f"step-{start}" if start else None,
        planned={"from": start, "end": end, "horizon": horizon},
        device=device(),
    )
    if start:
        assert resume_dir is not None, "a resumed phase needs --resume"
        epoch, position = restore(checkpoint(resume_dir, start), model, opt, sched, fault)
        rec.resume(
            start,
            model,
            optimizer=opt,
            scheduler=sched,
            data={"epoch": epoch, "position": position},
        )
    data = dataset().to(device())
    for step in range(start, end):
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
        if step + 1 in save_steps:
            torch.save(
                {
                    "model": model.state_dict(),
                    "optimizer": opt.state_dict(),
                    "scheduler": sched.state_dict(),
                    **rng_states(),
                    "data": (epoch, position),
                },
                checkpoint(run_dir, step + 1),
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


def steps(text: str) -> set[int]:
    """`3,6` as `{3, 6}`; the empty text as no step."""
    return {int(s) for s in text.split(",") if s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--phase", required=True)
    parser.add_argument("--record", type=Path, required=True)
    parser.add_argument("--run-dir", type=Path, required=True)
    parser.add_argument("--total-steps", type=int, required=True)
    parser.add_argument("--horizon", type=int, required=True)
    parser.add_argument("--save-steps", type=steps, default=set())
    parser.add_argument("--resume", type=Path, default=None)
    parser.add_argument("--resume-step", type=int, default=0)
    parser.add_argument("--fault", choices=FAULTS, default="none")
    args = parser.parse_args()
    train(
        args.record,
        args.run_dir,
        args.phase,
        end=args.total_steps,
        horizon=args.horizon,
        save_steps=args.save_steps,
        resume_dir=args.resume,
        start=args.resume_step,
        fault=args.fault,
    )


if __name__ == "__main__":
    main()
