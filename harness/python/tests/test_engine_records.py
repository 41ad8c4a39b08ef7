"""The built-in engine writes the same contract: `ckpt-harness run` on small suites (one plain,
one with a chain of resumes and asynchronous saves, one evaluating a validation split on 1 and 3
ranks) writes a record per trial that validates against the schema, with every phase's lines in
order. The binary is the one `CKPT_HARNESS`
names (CI builds it before these tests); without it the test fails saying how to build it."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

from conftest import read_record
from phases import assert_resumed_steps_equal_reference, by_phase

ROOT = Path(__file__).resolve().parents[3]
SUITES = ["tiny-fp32.yaml", "chained-resumes.yaml", "async-save.yaml", "sft-chat.yaml"]


def harness() -> Path:
    """The release binary `CKPT_HARNESS` names."""
    named = os.environ.get("CKPT_HARNESS")
    assert named, (
        "CKPT_HARNESS is not set: build the binary (cargo build --release -p ckpt-harness) and "
        "set CKPT_HARNESS=target/release/ckpt-harness"
    )
    path = Path(named)
    assert path.is_file(), (
        f"CKPT_HARNESS={named}: no such file; build it with cargo build --release -p ckpt-harness"
    )
    return path


def test_the_engine_s_records_validate_and_resume_its_reference(
    tmp_path: Path, validator: Any
) -> None:
    report = tmp_path / "report"
    run = subprocess.run(
        [str(harness()), "run", *(str(ROOT / "suites" / s) for s in SUITES),
         "--device", "cpu", "--report", str(report)],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    files = sorted(p.name for p in (report / "records").iterdir())
    assert files == sorted(f"cpu.{s.removesuffix('.yaml')}.jsonl" for s in SUITES)
    for name in files:
        lines = read_record(report / "records" / name, validator)
        phases = [line["phase"] for line in lines if line["kind"] == "phase"]
        assert phases[0] == "reference" and len(phases) >= 3, f"{name}: {phases}"
        ends = [line["phase"] for line in lines if line["kind"] == "phase_end"]
        assert ends == phases, f"{name}: phases {phases} end as {ends}"
        resumes = by_phase(lines, "resume")
        assert sorted(resumes) == sorted(phases[1:]), f"{name}: resumes {sorted(resumes)}"
        assert_resumed_steps_equal_reference(lines, phases[1:])
        for phase, (resume,) in resumes.items():
            assert resume["state"] == resume["reference_state"], f"{name}: {phase}"
    chained = read_record(report / "records" / "cpu.chained-resumes.jsonl", validator)
    assert "resume-mid-2" in by_phase(chained, "phase")
    validated = read_record(report / "records" / "cpu.sft-chat.jsonl", validator)
    evaluations = by_phase(validated, "eval")
    assert [e["step"] for e in evaluations["reference"]] == [4, 8, 12, 16, 18, 20]
    assert [e["step"] for e in evaluations["resume-end"]] == [20]
    assert evaluations["resume-end"][0]["loss"] == evaluations["reference"][-1]["loss"]
