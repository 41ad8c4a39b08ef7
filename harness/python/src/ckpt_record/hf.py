"""`CkptRecordCallback`: the Hugging Face Trainer writes a `ckpt-record/1` record.

The Trainer logs a loss averaged over the logging interval and rounded; the record needs each
step's loss exactly. So the callback is attached to the trainer (`attach`), which wraps the
trainer's `training_step` to take each micro-batch's loss as it was back-propagated, with the
batch it was computed on; the gradient norm is read once a step's last micro-batch has been
back-propagated, before the Trainer clips it; the learning rate when the optimizer has stepped,
before the scheduler moves it.

A dataset whose items carry their index under `SAMPLE_KEY` (`ckpt_sample`; with
`remove_unused_columns=False`, so that the Trainer's collator keeps it) has each step's samples
recorded, `(epoch, index)` per row; the callback takes the column out of the batch before the
model sees it. The data position (`epoch`, `position`: samples of the epoch handed out) is counted
from the micro-batches trained; a resumed phase starts from the position the Trainer skips to
(the start of the epoch under `ignore_data_skip`). The live training state (`live`) is counted
when the callback is made, before the model, and again at `finish`.

    callback = CkptRecordCallback("run.jsonl", "resume-mid", checkpoint="out/checkpoint-3")
    model = build_model()
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

from . import live, memory
from .recorder import Recorder

IGNORE_INDEX = -100
SAMPLE_KEY = "ckpt_sample"


def counted_tokens(inputs: Mapping[str, Any]) -> int:
    """Tokens a causal language model's loss counts in `inputs`: labels after the shift by one
    that are not the ignore index."""
    labels = inputs.get("labels")
    if not isinstance(labels, torch.Tensor):
        return 0
    return int((labels[..., 1:] != IGNORE_INDEX).sum())


def rows_of(inputs: Mapping[str, Any]) -> int:
    """Rows (samples) of a micro-batch: the first dimension of its first tensor."""
    for value in inputs.values():
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            return int(value.shape[0])
    return 0


def batches_per_epoch(loader: Any) -> int:
    """Micro-batches of one pass over `loader`; 0 when it has no length (an iterable dataset)."""
    try:
        return len(loader) if loader is not None else 0
    except TypeError:
        return 0


class CkptRecordCallback(TrainerCallback):
    """Writes one phase of a Trainer's run to the record at `path`: `phase` names it, `seeds`
    the seeds set, `checkpoint` the checkpoint it resumes from (the Trainer's step when it
    begins tells the step), `horizon` the schedule's horizon where it is not `max_steps`.
    Create it before the model and the trainer: it counts the live training state then, as the
    memory held before the trainer was built, and again at `finish`."""

    def __init__(
        self,
        path: str | Path,
        phase: str,
        *,
        seeds: Mapping[str, int] | None = None,
        checkpoint: str | None = None,
        trial: str | None = None,
        horizon: int | None = None,
    ) -> None:
        self.path = Path(path)
        self.phase = phase
        self.seeds = dict(seeds or {})
        self.checkpoint = checkpoint
        self.trial = trial
        self.horizon = horizon
        self._live_before = live.by_category()
        self.recorder: Recorder | None = None
        self._resume_pending = False
        self._loss: torch.Tensor | None = None
        self._micro: list[Mapping[str, torch.Tensor]] = []
        self._tokens = 0
        self._grad_norm: float | None = None
        self._lr = math.nan
        self._samples: list[tuple[int, int]] | None = None
        self._epoch = 0
        self._position = 0
        self._batches = 0
        self._per_epoch = 0

    def attach(self, trainer: Trainer) -> None:
        """Adds the callback to `trainer` and wraps its `training_step` so that each step's exact
        loss, batch and gradient norm reach the record, and its `_load_rng_state` so that a
        resumed state is recorded the moment the Trainer has restored the checkpoint's
        generators (before it draws from them: a new epoch's loader does). The callback keeps no
        reference to the trainer or its model."""
        trainer.add_callback(self)
        step = trainer.training_step
        record = self._micro_batch
        load_rng = getattr(trainer, "_load_rng_state", None)
        if load_rng is not None:

            def load_rng_state(checkpoint: str | None) -> None:
                load_rng(checkpoint)
                if trainer.optimizer is not None and trainer.model is not None:
                    self._write_resume(
                        trainer.state.global_step,
                        trainer.model,
                        trainer.optimizer,
                        trainer.lr_scheduler,
                    )

            trainer._load_rng_state = load_rng_state  # type: ignore[method-assign]

        def training_step(model: torch.nn.Module, inputs: Any, *args: Any, **kwargs: Any) -> Any:
            samples = inputs.pop(SAMPLE_KEY, None)
            loss = step(model, inputs, *args, **kwargs)
            last = len(self._micro) + 1 == trainer.current_gradient_accumulation_steps
            record(model, inputs, loss, last, samples)
            return loss

        trainer.training_step = training_step  # type: ignore[method-assign]

    def _micro_batch(
        self,
        model: torch.nn.Module,
        inputs: Mapping[str, Any],
        loss: torch.Tensor,
        last: bool,
        samples: torch.Tensor | None,
    ) -> None:
        """Adds one back-propagated micro-batch: its loss, tokens, tensors, samples and rows
        handed out; after the step's last, the gradient norm before clipping."""
        self._loss = loss if self._loss is None else self._loss + loss
        self._tokens += counted_tokens(inputs)
        self._micro.append({k: v for k, v in inputs.items() if isinstance(v, torch.Tensor)})
        if samples is not None:
            rows = [(self._epoch, int(i)) for i in samples.reshape(-1).tolist()]
            self._samples = (self._samples or []) + rows
        self._position += rows_of(inputs)
        self._batches += 1
        if last:
            grads = [p.grad for p in model.parameters() if p.grad is not None]
            self._grad_norm = float(torch.nn.utils.get_total_norm(grads)) if grads else None

    def _open(self, args: TrainingArguments, state: TrainerState, loader: Any) -> Recorder:
        resumed = state.global_step if state.global_step > 0 else None
        dataset = getattr(loader, "dataset", None)
        run = None
        if resumed is None and dataset is not None and hasattr(dataset, "__len__"):
            run = {"samples_per_epoch": len(dataset)}
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
            planned={
                "from": state.global_step,
                "end": state.max_steps,
                "horizon": self.horizon or state.max_steps,
            },
            trial=self.trial,
            run=run,
            memory_before={"source": memory.source(args.device), "by_category": self._live_before},
        )

    def _data(self) -> dict[str, int]:
        """The data position: epochs completed and samples of the current epoch handed out."""
        if self._per_epoch and self._batches == self._per_epoch:
            return {"epoch": self._epoch + 1, "position": 0}
        return {"epoch": self._epoch, "position": self._position}

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """Writes the phase line and finds where the loader starts: the epoch and the batches
        the Trainer skips in it when resuming (none under `ignore_data_skip`); a resumed phase's
        state is written before its first step, once the Trainer has restored its random
        generators."""
        loader = kwargs.get("train_dataloader")
        self.recorder = self._open(args, state, loader)
        self._resume_pending = state.global_step > 0
        self._per_epoch = batches_per_epoch(loader)
        steps_per_epoch = -(-self._per_epoch // args.gradient_accumulation_steps)
        self._epoch, skipped = divmod(state.global_step, steps_per_epoch or state.max_steps or 1)
        if args.ignore_data_skip:
            skipped = 0
        self._batches = skipped * args.gradient_accumulation_steps
        self._position = self._batches * args.per_device_train_batch_size

    def on_epoch_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """A new pass over the data, after the first: its samples count from the start."""
        if self._per_epoch and self._batches == self._per_epoch:
            self._epoch, self._position, self._batches = self._epoch + 1, 0, 0

    def on_step_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """Writes the resumed state before the first resumed step, where the Trainer did not
        restore generators through `_load_rng_state`; starts a step's sums."""
        self._write_resume(
            state.global_step,
            kwargs["model"],
            kwargs.get("optimizer"),
            kwargs.get("lr_scheduler"),
        )
        self._loss, self._micro, self._tokens, self._grad_norm = None, [], 0, None
        self._samples = None

    def _write_resume(
        self, step: int, model: torch.nn.Module, optimizer: Any, scheduler: Any
    ) -> None:
        """Writes the resumed state once, in a resumed phase, before its first step."""
        if not self._resume_pending or self.recorder is None:
            return
        self.recorder.resume(
            step,
            model,
            optimizer=optimizer,
            scheduler=scheduler,
            data=self._data(),
            checkpoint=self.checkpoint,
        )
        self._resume_pending = False

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
            samples=self._samples,
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
            data=self._data(),
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


__all__ = ["SAMPLE_KEY", "CkptRecordCallback", "batches_per_epoch", "counted_tokens", "rows_of"]
