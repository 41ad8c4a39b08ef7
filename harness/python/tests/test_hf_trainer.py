"""The Hugging Face Trainer on a tiny random Llama with the callback, through reference,
resume-mid and resume-end from its checkpoints: the records validate, the resumed steps equal
the reference's bit for bit, and each resumed state is the saved one."""

from __future__ import annotations

import gc
import json
import struct
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import read_record
from phases import (
    assert_resumed_states_equal_saved,
    assert_resumed_steps_equal_reference,
    by_phase,
)
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

from ckpt_record.hf import CkptRecordCallback

MAX_STEPS, SAVE_EVERY, SEED = 6, 2, 3


class Tokens(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """Random sequences, their labels the inputs with the first position ignored."""

    def __init__(self) -> None:
        self.ids = torch.randint(0, 64, (24, 8), generator=torch.Generator().manual_seed(5))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        labels = self.ids[i].clone()
        labels[0] = -100
        return {"input_ids": self.ids[i], "labels": labels}


def train(out: Path, record: Path, phase: str, resume: int | None) -> None:
    """One phase: a fresh trainer, resumed from `out/checkpoint-<resume>` when given."""
    config = LlamaConfig(
        vocab_size=64,
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
    model = LlamaForCausalLM(config)
    args = TrainingArguments(
        output_dir=str(out),
        max_steps=MAX_STEPS,
        per_device_train_batch_size=4,
        learning_rate=5e-3,
        lr_scheduler_type="cosine",
        warmup_steps=1,
        max_grad_norm=0.5,
        save_strategy="steps",
        save_steps=SAVE_EVERY,
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        seed=SEED,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    checkpoint = str(out / f"checkpoint-{resume}") if resume else None
    callback = CkptRecordCallback(record, phase, checkpoint=checkpoint)
    trainer = Trainer(model=model, args=args, train_dataset=Tokens())
    callback.attach(trainer)
    trainer.train(resume_from_checkpoint=checkpoint)
    del trainer, model
    gc.collect()
    callback.finish()


def test_a_resumed_trainer_records_the_reference_s_steps_and_state(
    tmp_path: Path, validator: Any
) -> None:
    record = tmp_path / "run.jsonl"
    train(tmp_path / "out", record, "reference", None)
    train(tmp_path / "out", record, "resume-mid", 2)
    train(tmp_path / "out", record, "resume-end", 4)
    lines = read_record(record, validator)
    steps = by_phase(lines, "step")
    assert [s["step"] for s in steps["reference"]] == list(range(MAX_STEPS))
    assert [s["step"] for s in steps["resume-mid"]] == list(range(2, MAX_STEPS))
    assert_resumed_steps_equal_reference(lines, ["resume-mid", "resume-end"])
    assert_resumed_states_equal_saved(lines, ["resume-mid", "resume-end"])
    for s in steps["reference"]:
        assert s["loss_dtype"] == "float32" and s["tokens"] == 4 * 7
        assert s["grad_norm"] is not None and s["grad_norm"] > 0
    saves = by_phase(lines, "save")["reference"]
    assert [s["step"] for s in saves] == [2, 4, 6]
    assert saves[0]["state"]["params"]["tied"] == [["model.embed_tokens.weight", "lm_head.weight"]]
    assert "lm_head.weight" not in saves[0]["state"]["params"]["by_name"]
    (end,) = by_phase(lines, "phase_end")["reference"]
    assert end["memory_after"]["source"] == "host_rss"


def test_the_recorded_loss_is_the_back_propagated_one_not_the_logged_one(
    tmp_path: Path, validator: Any
) -> None:
    """The Trainer's log rounds the loss; the record holds the float32 computed, and the
    logged figure is that loss rounded."""
    record = tmp_path / "run.jsonl"
    train(tmp_path / "out", record, "reference", None)
    state = (tmp_path / "out" / f"checkpoint-{MAX_STEPS}" / "trainer_state.json").read_text()
    logged = [h["loss"] for h in json.loads(state)["log_history"] if "loss" in h]
    recorded = [s["loss"] for s in by_phase(read_record(record, validator), "step")["reference"]]
    assert len(logged) == len(recorded) == MAX_STEPS
    for got, shown in zip(recorded, logged):
        assert struct.unpack("<f", struct.pack("<f", got))[0] == got
        assert got == pytest.approx(shown, abs=1e-3)
