"""The Hugging Face Trainer on a tiny random Llama that writes its run record: tied embeddings and
attention dropout, AdamW with a warmup-then-cosine schedule pinned at the horizon, a shuffled
dataset of 24 sequences whose items carry their index (so each step's samples are recorded),
checkpoints saved by the Trainer and resumed with `trainer.train(resume_from_checkpoint=...)`.
Everything is built in the process: no download, no tokenizer.

`ckpt-harness` runs it through its phases from a suite's `engine: {command}` (see
`harness/python/suites/hf-trainer.yaml`); `--fault` breaks its resume the ways Trainer users
do, for the negative controls. Run one phase by hand:

    python hf_trainer.py --phase reference --record run.jsonl --run-dir out \\
        --total-steps 8 --horizon 6 --save-steps 3,6
"""

from __future__ import annotations

import argparse
import gc
import os
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    Trainer,
    TrainerCallback,
    TrainerControl,
    TrainerState,
    TrainingArguments,
)

from ckpt_record.hf import SAMPLE_KEY, CkptRecordCallback

VOCAB, SEQ, SAMPLES, BATCH = 64, 8, 24, 4
SEED = 3
FAULTS = (
    "none",
    "ignore_data_skip",
    "rng_file_removed",
    "save_only_model",
    "accumulation_changed",
    "model_kept_alive",
)


class Tokens(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """`SAMPLES` random sequences, the same in every process; labels are the inputs with the
    first position ignored, and each item carries its index under `SAMPLE_KEY`."""

    def __init__(self) -> None:
        seeded = torch.Generator().manual_seed(5)
        self.ids = torch.randint(0, VOCAB, (SAMPLES, SEQ), generator=seeded)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        labels = self.ids[i].clone()
        labels[0] = -100
        return {"input_ids": self.ids[i], "labels": labels, SAMPLE_KEY: torch.tensor(i)}


def model() -> LlamaForCausalLM:
    """A two-layer Llama with tied embeddings and attention dropout, seeded."""
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=16,
        attention_dropout=0.25,
        tie_word_embeddings=True,
    )
    torch.manual_seed(SEED)
    return LlamaForCausalLM(config)


class SaveAt(TrainerCallback):
    """Asks the Trainer to save after each step in `steps`, whatever its save strategy."""

    def __init__(self, steps: set[int]) -> None:
        self.steps = steps

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """Sets `should_save` after a step in `steps`."""
        if state.global_step in self.steps:
            control.should_save = True


class KeepsModel(TrainerCallback):
    """Keeps the model it was handed at the end of training (for a later evaluation, say): while
    the script holds the callback, the model outlives the trainer."""

    def __init__(self) -> None:
        self.model: torch.nn.Module | None = None

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """Takes the model."""
        self.model = kwargs["model"]


class HorizonTrainer(Trainer):
    """A Trainer whose schedule is pinned at `horizon` steps rather than `max_steps`."""

    def __init__(self, *args: Any, horizon: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.horizon = horizon

    def create_scheduler(
        self, num_training_steps: int, optimizer: torch.optim.Optimizer | None = None
    ) -> Any:
        """The Trainer's schedule over the horizon."""
        return super().create_scheduler(self.horizon, optimizer)


def arguments(run_dir: Path, end: int, resumed: bool, fault: str) -> TrainingArguments:
    """The Trainer's arguments: the CPU unless `CKPT_EXAMPLE_DEVICE=cuda`, no reporting, no
    workers, saves only where `SaveAt` asks, and the fault's change (in the resumed phases, or
    from the start for `save_only_model`)."""
    batch, accumulation = BATCH, 1
    if fault == "accumulation_changed" and resumed:
        batch, accumulation = BATCH // 2, 2
    return TrainingArguments(
        output_dir=str(run_dir),
        max_steps=end,
        per_device_train_batch_size=batch,
        gradient_accumulation_steps=accumulation,
        learning_rate=5e-3,
        lr_scheduler_type="cosine",
        warmup_steps=2,
        weight_decay=0.1,
        max_grad_norm=0.5,
        save_strategy="no",
        logging_steps=1,
        report_to=[],
        use_cpu=os.environ.get("CKPT_EXAMPLE_DEVICE", "cpu") != "cuda",
        seed=SEED,
        disable_tqdm=True,
        dataloader_num_workers=0,
        remove_unused_columns=False,
        ignore_data_skip=fault == "ignore_data_skip" and resumed,
        save_only_model=fault == "save_only_model",
    )


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
    """Trains from step `start` (a fresh start at 0, else `resume_dir/checkpoint-<start>`) to
    `end`, saving into `run_dir` after each step in `save_steps`, and records the phase. The
    recorder's callback is made first, so that it counts what was held before the model."""
    checkpoint: Path | None = None
    if start:
        if resume_dir is None:
            raise SystemExit(f"{phase}: --resume-step {start} needs --resume DIR")
        checkpoint = resume_dir / f"checkpoint-{start}"
        if fault == "rng_file_removed":
            (checkpoint / "rng_state.pth").unlink(missing_ok=True)
    callback = CkptRecordCallback(
        record,
        phase,
        seeds={"torch": SEED},
        checkpoint=str(checkpoint) if checkpoint else None,
        horizon=horizon,
    )
    # The script holds its callbacks until the phase is recorded: one that keeps the model keeps
    # it past the trainer.
    callbacks: list[TrainerCallback] = [SaveAt(save_steps)]
    if fault == "model_kept_alive":
        callbacks.append(KeepsModel())
    net = model()
    trainer = HorizonTrainer(
        model=net,
        args=arguments(run_dir, end, checkpoint is not None, fault),
        train_dataset=Tokens(),
        callbacks=list(callbacks),
        horizon=horizon,
    )
    callback.attach(trainer)
    trainer.train(resume_from_checkpoint=str(checkpoint) if checkpoint else None)
    del trainer, net
    gc.collect()
    callback.finish()


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
    transformers.logging.set_verbosity_warning()
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
