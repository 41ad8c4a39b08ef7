"""`Recorder`: writes a `ckpt-record/1` record (docs/RECORD.md) from a training loop, one JSON
line per phase start, step, save, resume and phase end."""

from __future__ import annotations

import gc
import json
import math
import platform
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import IO, Any

import numpy as np
import torch

from . import digests, live, memory

RECORD_VERSION = "ckpt-record/1"

Line = dict[str, Any]


def exact(value: float | torch.Tensor | None) -> float | None:
    """The value as the float64 that holds it exactly; `None` when it is NaN or infinite."""
    if value is None:
        return None
    number = float(value.detach().item()) if isinstance(value, torch.Tensor) else float(value)
    return number if math.isfinite(number) else None


def dtype_name(value: float | torch.Tensor) -> str:
    """The record's name of the dtype `value` was computed in."""
    if isinstance(value, torch.Tensor):
        return str(value.dtype).removeprefix("torch.")
    return "float64"


def training_state(
    step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Any = None,
    data: Mapping[str, int | str] | None = None,
    optimizer_steps: int | None = None,
) -> dict[str, Any]:
    """The `state` of a save or resume line: parameters by name (with tied names), optimizer
    state by parameter name, the schedule, every random generator and the data position."""
    by_name = digests.params_by_name(model)
    state: dict[str, Any] = {
        "step": step,
        "params": {"digest": digests.combined(by_name), "by_name": by_name},
        "rng": digests.rng_states(),
    }
    tied = digests.tied_groups(model)
    if tied:
        state["params"]["tied"] = tied
    if optimizer_steps is not None:
        state["optimizer_steps"] = optimizer_steps
    if optimizer is not None:
        by_param = digests.optimizer_by_param(optimizer, model)
        state["optimizer"] = {
            "digest": digests.combined(by_param),
            "by_param": by_param,
            "hyper": digests.optimizer_hyper(optimizer),
        }
        state["schedule"] = {"next_lr": exact(optimizer.param_groups[0]["lr"])}
    if scheduler is not None:
        state.setdefault("schedule", {})["digest"] = digests.state_digest(scheduler.state_dict())
    if data is not None:
        state["data"] = dict(data)
    return state


class Recorder:
    """Writes one phase of a run record to a JSON-lines file.

    Open it when the phase starts, call `step` after each optimizer step, `save` after saving a
    checkpoint, `resume` after loading one (before the first resumed step), and `phase_end` once
    the trainer is released. Memory peaks are reset at `open` and after each `step`, so each
    step's peak covers that step.
    """

    def __init__(self, out: IO[str], phase: str, device: torch.device | str) -> None:
        """A recorder writing the lines of `phase` to `out`; see `open`."""
        self._out = out
        self.phase = phase
        self.device = device
        self._peak_reset = memory.reset_peak(device)
        self._count_live = False

    @classmethod
    def open(
        cls,
        path: str | Path,
        phase: str,
        *,
        device: torch.device | str = "cpu",
        engine: str = "pytorch",
        engine_version: str = torch.__version__,
        seeds: Mapping[str, int] | None = None,
        resumed_from: int | None = None,
        checkpoint: str | None = None,
        world_size: int = 1,
        planned: Mapping[str, int] | None = None,
        trial: str | None = None,
        run: Mapping[str, Any] | None = None,
        memory_before: memory.Memory | None = None,
    ) -> Recorder:
        """Appends to the record at `path` and writes the `phase` line: which phase, the engine,
        the device, the world size, the seeds, the step (and checkpoint) resumed from, and the
        facts of the run the checks need (`run`: `samples_per_epoch`, `layers`, ...; the
        reference's) and the memory held before the trainer was built (`memory_before`,
        `memory.held`): where it counts the live training state by category, so does the phase's
        end."""
        out = open(path, "a", encoding="utf-8")
        rec = cls(out, phase, device)
        resumed: dict[str, Any] | None = None
        if resumed_from is not None:
            resumed = {"step": resumed_from}
            if checkpoint is not None:
                resumed["checkpoint"] = checkpoint
        line: Line = {
            "kind": "phase",
            "record": RECORD_VERSION,
            "phase": phase,
            "engine": {
                "name": engine,
                "version": engine_version,
                "libraries": {
                    "python": platform.python_version(),
                    "torch": torch.__version__,
                    "numpy": np.__version__,
                },
            },
            "device": str(device),
            "world_size": world_size,
            "seeds": dict(seeds or {}),
            "resumed_from": resumed,
        }
        if trial is not None:
            line["trial"] = trial
        if planned is not None:
            line["planned"] = dict(planned)
        if run is not None:
            line["run"] = dict(run)
        if memory_before is not None:
            line["memory_before"] = dict(memory_before)
            rec._count_live = "by_category" in memory_before
        if memory.uses_cuda(device):
            line["device_name"] = torch.cuda.get_device_name(device)
        rec.write(line)
        return rec

    def write(self, line: Line) -> None:
        """Writes one line of the record and flushes it."""
        self._out.write(json.dumps(line, allow_nan=False) + "\n")
        self._out.flush()

    def step(
        self,
        step: int,
        loss: float | torch.Tensor,
        lr: float,
        *,
        grad_norm: float | torch.Tensor | None = None,
        tokens: int | None = None,
        batch: Mapping[str, torch.Tensor] | Iterable[torch.Tensor] | None = None,
        samples: Iterable[tuple[int, int]] | None = None,
        seconds: float | None = None,
    ) -> None:
        """Records step `step`: the loss back-propagated (exactly: pass the tensor), the learning
        rate the optimizer applied (`optimizer.param_groups[0]["lr"]` read before the scheduler
        steps), the gradient norm before clipping, the tokens the loss counted, the batch's
        digest, its samples as `(epoch, index)` pairs, and the step's memory."""
        line: Line = {
            "kind": "step",
            "phase": self.phase,
            "step": step,
            "loss": exact(loss),
            "loss_dtype": dtype_name(loss),
            "lr": exact(lr),
        }
        if grad_norm is not None:
            line["grad_norm"] = exact(grad_norm)
        if tokens is not None:
            line["tokens"] = int(tokens)
        if batch is not None:
            line["batch_digest"] = digests.batch_digest(batch)
        if samples is not None:
            line["samples"] = [{"epoch": int(e), "index": int(i)} for e, i in samples]
        line["memory"] = memory.snapshot(self.device, self._peak_reset)
        if seconds is not None:
            line["seconds"] = seconds
        self.write(line)
        self._peak_reset = memory.reset_peak(self.device)

    def save(
        self, step: int, model: torch.nn.Module, *, checkpoint: str | None = None, **state: Any
    ) -> None:
        """Records the state saved after `step` steps: `state` holds `training_state`'s
        `optimizer`, `scheduler`, `data` and `optimizer_steps`."""
        self._state_line("save", step, checkpoint, training_state(step, model, **state))

    def resume(
        self, step: int, model: torch.nn.Module, *, checkpoint: str | None = None, **state: Any
    ) -> None:
        """Records the state loaded from the checkpoint of `step` steps, before the first resumed
        step: `state` as for `save`."""
        self._state_line("resume", step, checkpoint, training_state(step, model, **state))

    def _state_line(
        self, kind: str, step: int, checkpoint: str | None, state: dict[str, Any]
    ) -> None:
        line: Line = {"kind": kind, "phase": self.phase, "step": step}
        if checkpoint is not None:
            line["checkpoint"] = checkpoint
        line["state"] = state
        self.write(line)

    def phase_end(self, seconds: float | None = None) -> None:
        """Records the memory held once the trainer is released (call it after dropping every
        reference to the model, optimizer and data), after a garbage collection, with the live
        training state by category where the phase's start counted it, and closes the record."""
        gc.collect()
        if memory.uses_cuda(self.device):
            torch.cuda.empty_cache()
        after = memory.snapshot(self.device, self._peak_reset)
        if self._count_live:
            after["by_category"] = live.by_category()
        line: Line = {"kind": "phase_end", "phase": self.phase, "memory_after": after}
        if seconds is not None:
            line["seconds"] = seconds
        self.write(line)
        self._out.close()
