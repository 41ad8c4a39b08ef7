"""Shared helpers: the record schema from the checkout, and reading a record validated line by
line against it."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import jsonschema
import pytest

SCHEMA = Path(__file__).resolve().parents[2] / "record" / "ckpt-record-1.schema.json"

# The example trainers (`harness/python/examples`), which the tests drive as a suite's command does.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))


def load_schema() -> dict[str, Any]:
    """The `ckpt-record/1` schema, checked against the draft it names."""
    schema: dict[str, Any] = json.loads(SCHEMA.read_text(encoding="utf-8"))
    jsonschema.Draft202012Validator.check_schema(schema)
    return schema


def read_record(path: Path, validator: jsonschema.Draft202012Validator) -> list[dict[str, Any]]:
    """Every line of the record at `path`, each validated; a line that does not validate fails
    the test naming the file, the line and the first error."""
    lines = []
    for n, text in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        line = json.loads(text)
        errors = sorted(validator.iter_errors(line), key=lambda e: list(e.absolute_path))
        assert not errors, f"{path}:{n}: {errors[0].json_path}: {errors[0].message}"
        lines.append(line)
    assert lines, f"{path}: empty record"
    return lines


@pytest.fixture(scope="session")
def validator() -> jsonschema.Draft202012Validator:
    """A validator of record lines."""
    return jsonschema.Draft202012Validator(load_schema())
