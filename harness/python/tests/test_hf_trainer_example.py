"""The example Hugging Face Trainer (`examples/hf_trainer.py`), driven as its suite's command
drives it: resumed mid-epoch and at the end of an epoch, it records the reference's steps, its
samples and its saved states; resumed with `ignore_data_skip`, the record says the loader started
the epoch again."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import hf_trainer
from conftest import read_record
from phases import (
    assert_resumed_states_equal_saved,
    assert_resumed_steps_equal_reference,
    by_phase,
)

# Six steps of four samples make the dataset's epoch: resuming at 6 starts the second.
MAX_STEPS, EXTRA, RESUME_AT = 6, 2, 3


def train(record: Path, tmp_path: Path, phase: str, start: int, fault: str = "none") -> None:
    """One phase to `MAX_STEPS + EXTRA`, the reference saving at `RESUME_AT` and `MAX_STEPS`
    into `tmp_path/reference`, a resumed phase from there."""
    hf_trainer.train(
        record,
        tmp_path / phase,
        phase,
        end=MAX_STEPS + EXTRA,
        horizon=MAX_STEPS,
        save_steps={RESUME_AT, MAX_STEPS} if phase == "reference" else set(),
        resume_dir=tmp_path / "reference",
        start=start,
        fault=fault,
    )


def test_resumed_mid_epoch_and_at_its_end_the_trainer_records_the_reference(
    tmp_path: Path, validator: Any
) -> None:
    """At the end of an epoch the Trainer restores its generators before the next epoch's loader
    draws from them: the resumed state is the saved one only if it is taken at the restore."""
    record = tmp_path / "run.jsonl"
    train(record, tmp_path, "reference", 0)
    train(record, tmp_path, "resume-mid", RESUME_AT)
    train(record, tmp_path, "resume-end", MAX_STEPS)
    lines = read_record(record, validator)
    assert_resumed_steps_equal_reference(lines, ["resume-mid", "resume-end"])
    assert_resumed_states_equal_saved(lines, ["resume-mid", "resume-end"])
    (start,) = by_phase(lines, "phase")["reference"]
    assert start["run"] == {"samples_per_epoch": hf_trainer.SAMPLES}
    assert start["planned"] == {"from": 0, "end": MAX_STEPS + EXTRA, "horizon": MAX_STEPS}
    steps = by_phase(lines, "step")
    reference = [s["samples"] for s in steps["reference"]]
    first_epoch = [x["index"] for rows in reference[:MAX_STEPS] for x in rows]
    assert sorted(first_epoch) == list(range(hf_trainer.SAMPLES))
    assert {x["epoch"] for rows in reference[MAX_STEPS:] for x in rows} == {1}
    for phase, start_step in (("resume-mid", RESUME_AT), ("resume-end", MAX_STEPS)):
        assert [s["samples"] for s in steps[phase]] == reference[start_step:]
    positions = {phase: r["state"]["data"] for phase, (r,) in by_phase(lines, "resume").items()}
    assert positions == {
        "resume-mid": {"epoch": 0, "position": RESUME_AT * hf_trainer.BATCH},
        "resume-end": {"epoch": 1, "position": 0},
    }


def test_ignore_data_skip_is_recorded_as_the_epoch_starting_again(
    tmp_path: Path, validator: Any
) -> None:
    """The Trainer's own state says it resumed at step 3 either way; the record's data
    position and samples say the loader handed out the epoch's first batches again."""
    record = tmp_path / "run.jsonl"
    train(record, tmp_path, "reference", 0)
    train(record, tmp_path, "resume-mid", RESUME_AT, fault="ignore_data_skip")
    lines = read_record(record, validator)
    (resume,) = by_phase(lines, "resume")["resume-mid"]
    assert resume["state"]["data"] == {"epoch": 0, "position": 0}
    steps = by_phase(lines, "step")
    resumed = [s["samples"] for s in steps["resume-mid"]]
    assert resumed[:RESUME_AT] == [s["samples"] for s in steps["reference"][:RESUME_AT]]
