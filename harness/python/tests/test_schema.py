"""The schema refuses broken records: each broken line below fails validation at the field
that is wrong, while the well-formed line it was made from passes."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Callable

import jsonschema
import pytest
from conftest import read_record

STEP: dict[str, Any] = {
    "kind": "step",
    "phase": "resume-mid",
    "step": 3,
    "loss": 2.4849066734313965,
    "lr": 0.001,
    "grad_norm": None,
    "tokens": 32,
    "samples": [{"epoch": 0, "index": 5}],
    "memory": {"source": "cuda", "allocated_peak": 1024, "peak_reset": True},
}

PHASE: dict[str, Any] = {
    "kind": "phase",
    "record": "ckpt-record/1",
    "phase": "reference",
    "engine": {"name": "pytorch", "version": "2.15.0"},
    "device": "cpu",
    "world_size": 1,
    "seeds": {},
    "resumed_from": None,
}


def without(field: str) -> Callable[[dict[str, Any]], None]:
    return lambda line: line.pop(field)


def setting(field: str, value: Any) -> Callable[[dict[str, Any]], None]:
    return lambda line: line.__setitem__(field, value)


BROKEN: list[tuple[str, dict[str, Any], Callable[[dict[str, Any]], None]]] = [
    ("step without its loss", STEP, without("loss")),
    ("step without its learning rate", STEP, without("lr")),
    ("loss as a string", STEP, setting("loss", "2.48")),
    ("step index as a string", STEP, setting("step", "3")),
    ("negative step index", STEP, setting("step", -1)),
    ("a field the contract does not know", STEP, setting("losses", [1.0])),
    ("a memory figure of no source", STEP, setting("memory", {"allocated": 1})),
    ("a memory source not in the contract", STEP, setting("memory", {"source": "nvml"})),
    ("a sample without its epoch", STEP, setting("samples", [{"index": 5}])),
    ("an unknown phase", STEP, setting("phase", "resume-mid-1")),
    ("an unknown kind", STEP, setting("kind", "steps")),
    ("another record version", PHASE, setting("record", "ckpt-record/2")),
    ("a phase without its engine", PHASE, without("engine")),
    ("a world size of zero", PHASE, setting("world_size", 0)),
    ("a resume point without its step", PHASE, setting("resumed_from", {"checkpoint": "x"})),
]


@pytest.mark.parametrize("line", [STEP, PHASE], ids=["step", "phase"])
def test_the_well_formed_lines_validate(line: dict[str, Any], validator: Any) -> None:
    validator.validate(line)


@pytest.mark.parametrize(("what", "line", "break_it"), BROKEN, ids=[b[0] for b in BROKEN])
def test_a_broken_line_fails_validation(
    what: str,
    line: dict[str, Any],
    break_it: Callable[[dict[str, Any]], None],
    validator: Any,
) -> None:
    broken = copy.deepcopy(line)
    break_it(broken)
    with pytest.raises(jsonschema.ValidationError):
        validator.validate(broken)


EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "record" / "examples").glob("*.jsonl"))


@pytest.mark.parametrize("example", EXAMPLES, ids=[e.name for e in EXAMPLES])
def test_the_example_records_validate(example: Path, validator: Any) -> None:
    lines = read_record(example, validator)
    assert lines[0]["kind"] == "phase"


def test_there_are_example_records() -> None:
    assert EXAMPLES, "harness/record/examples holds no record"
