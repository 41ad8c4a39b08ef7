"""`CkptRecordCallback`: the Hugging Face Trainer writes a `ckpt-record/1` record.

The Trainer logs a loss averaged over the logging interval and rounded; the record needs each
step's loss exactly. So the callback is attached to the trainer (`attach`), which wraps the
trainer's `training_step` to take each micro-batch's loss as it was back-propagated, with the
batch it was computed on; the gradient norm is read once a step's last micro-batch has been
back-propagated, before the Trainer clips it; the learning rate when the optimizer has stepped,
before the scheduler moves it.

    callback = CkptRecordCallback("run.jsonl", "resume-mid", checkpoint="out/checkpoint-3")
    trainer = Trainer(model=model, args=args, train_dataset=data)
    callback.attach(trainer)
    trainer.train(resume_from_checkpoint="out/checkpoint-3")
    del trainer, model
    callback.finish()  # memory after the trainer was released
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers import Trainer, TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from .recorder import Recorder

IGNORE_INDEX = -100


def counted_tokens(inputs: Mapping[str, Any]) -> int:
    """Tokens a causal language model's loss counts in `inputs`: labels after the shift by one
    that are not the ignore index."""
    labels = inputs.get("labels")
    if not isinstance(labels, torch.Tensor):
        return 0
    return int((labels[..., 1:] != IGNORE_INDEX).sum())


class CkptRecordCallback(TrainerCallback):
    """Writes one phase of a Trainer's run to the record at `path`: `phase` names it, `seeds`
    the seeds set, `checkpoint` the checkpoint it resumes from (the Trainer's step when it
    begins tells the step)."""

    def __init__(
        self,
        path: str | Path,
        phase: str,
        *,
        seeds: Mapping[str, int] | None = None,
        checkpoint: str | None = None,
        trial: str | None = None,
    ) -> None:
        self.path = Path(path)
        self.phase = phase
        self.seeds = dict(seeds or {})
        self.checkpoint = checkpoint
        self.trial = trial
        self.recorder: Recorder | None = None
        self._resume_pending = False
        self._loss: torch.Tensor | None = None
        self._micro: list[Mapping[str, torch.Tensor]] = []
        self._tokens = 0
        self._grad_norm: float | None = None
        self._lr = math.nan

    def attach(self, trainer: Trainer) -> None:
        """Adds the callback to `trainer` and wraps its `training_step` so that each step's exact
        loss, batch and gradient norm reach the record. The callback keeps no reference to the
        trainer or its model."""
        trainer.add_callback(self)
        step = trainer.training_step
        record = self._micro_batch

        def training_step(model: torch.nn.Module, inputs: Any, *args: Any, **kwargs: Any) -> Any:
            loss = step(model, inputs, *args, **kwargs)
            last = len(self._micro) + 1 == trainer.current_gradient_accumulation_steps
            record(model, inputs, loss, last)
            return loss

        trainer.training_step = training_step  # type: ignore[method-assign]

    def _micro_batch(
        self, model: torch.nn.Module, inputs: Mapping[str, Any], loss: torch.Tensor, last: bool
    ) -> None:
        """Adds one back-propagated micro-batch: its loss, tokens and tensors; after the step's
        last, the gradient norm before clipping."""
        self._loss = loss if self._loss is None else self._loss + loss
        self._tokens += counted_tokens(inputs)
        self._micro.append({k: v for k, v in inputs.items() if isinstance(v, torch.Tensor)})
        if last:
            grads = [p.grad for p in model.parameters() if p.grad is not None]
            self._grad_norm = float(torch.nn.utils.get_total_norm(grads)) if grads else None

    def _open(self, args: TrainingArguments, state: TrainerState) -> Recorder:
        resumed = state.global_step if state.global_step > 0 else None
        return Recorder.open(
            self.path,
            self.phase,
            device=args.device,
            engine="transformers",
            engine_version=transformers.__version__,
            seeds={"trainer": args.seed, **self.seeds},
            resumed_from=resumed,
            checkpoint=self.checkpoint if resumed is not None else None,
            world_size=args.world_size,
            planned={"from": state.global_step, "end": state.max_steps, "horizon": state.max_steps},
            trial=self.trial,
        )

    def _data(self, args: TrainingArguments, state: TrainerState, loader: Any) -> dict[str, int]:
        """The data position: epochs completed and micro-batches of the current epoch taken."""
        taken = state.global_step * args.gradient_accumulation_steps
        per_epoch = len(loader) if loader is not None else 0
        if per_epoch == 0:
            return {"epoch": 0, "position": taken}
        return {"epoch": taken // per_epoch, "position": taken % per_epoch}

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """Writes the phase line; a resumed phase's state is written before its first step, once
        the Trainer has restored its random generators."""
        self.recorder = self._open(args, state)
        self._resume_pending = state.global_step > 0

    def on_step_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """Writes the resumed state before the first resumed step; starts a step's sums."""
        if self._resume_pending and self.recorder is not None:
            self.recorder.resume(
                state.global_step,
                kwargs["model"],
                optimizer=kwargs.get("optimizer"),
                scheduler=kwargs.get("lr_scheduler"),
                data=self._data(args, state, kwargs.get("train_dataloader")),
                checkpoint=self.checkpoint,
            )
            self._resume_pending = False
        self._loss, self._micro, self._tokens, self._grad_norm = None, [], 0, None

    def on_optimizer_step(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """Reads the learning rate the optimizer applied, before the scheduler steps."""
        self._lr = float(kwargs["optimizer"].param_groups[0]["lr"])

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """Writes the step's line."""
        if self.recorder is None or self._loss is None:
            return
        batch = {
            f"{i}.{name}": t for i, micro in enumerate(self._micro) for name, t in micro.items()
        }
        self.recorder.step(
            state.global_step - 1,
            self._loss,
            self._lr,
            grad_norm=self._grad_norm,
            tokens=self._tokens,
            batch=batch,
        )
        self._micro = []

    def on_save(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """Writes the state the checkpoint just saved holds."""
        if self.recorder is None:
            return
        self.recorder.save(
            state.global_step,
            kwargs["model"],
            optimizer=kwargs.get("optimizer"),
            scheduler=kwargs.get("lr_scheduler"),
            data=self._data(args, state, kwargs.get("train_dataloader")),
            checkpoint=f"checkpoint-{state.global_step}",
        )

    def finish(self) -> None:
        """Writes the phase's end: the memory held once the trainer was released. Call it after
        dropping the trainer and the model."""
        if self.recorder is None:
            raise RuntimeError(
                f"{self.path}: phase {self.phase} never began: call finish() after trainer.train()"
            )
        self.recorder.phase_end()
        self.recorder = None


__all__ = ["CkptRecordCallback", "counted_tokens"]
