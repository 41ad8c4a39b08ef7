"""The phases of a test run and the comparisons between them: every resumed step against the
reference's step of the same index, every resumed state against the reference's saved state."""

from __future__ import annotations

import struct
from typing import Any

Line = dict[str, Any]


def by_phase(lines: list[Line], kind: str) -> dict[str, list[Line]]:
    """The lines of `kind`, grouped by phase in record order."""
    out: dict[str, list[Line]] = {}
    for line in lines:
        if line["kind"] == kind:
            out.setdefault(line["phase"], []).append(line)
    return out


def bits(x: float | None) -> bytes | None:
    """The float64 bits of a recorded float."""
    return None if x is None else struct.pack("<d", x)


def assert_resumed_steps_equal_reference(lines: list[Line], phases: list[str]) -> None:
    """Every step of each resumed phase equals the reference's step of the same index, loss and
    learning rate bit for bit, and each resumed phase trains at least one step."""
    steps = by_phase(lines, "step")
    reference = {s["step"]: s for s in steps["reference"]}
    for phase in phases:
        assert steps.get(phase), f"{phase}: no steps recorded"
        for s in steps[phase]:
            want = reference[s["step"]]
            for field in ("loss", "lr"):
                assert bits(s[field]) == bits(want[field]), (
                    f"{phase} step {s['step']}: {field}: expected {want[field]!r}, got {s[field]!r}"
                )


def assert_resumed_states_equal_saved(lines: list[Line], phases: list[str]) -> None:
    """Each resumed phase's state equals the reference's saved state at the same step."""
    saved = {s["step"]: s["state"] for s in by_phase(lines, "save")["reference"]}
    resumes = by_phase(lines, "resume")
    for phase in phases:
        (resume,) = resumes[phase]
        assert resume["state"] == saved[resume["step"]], f"{phase}: state differs from the save"
