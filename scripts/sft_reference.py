#!/usr/bin/env python3
"""Writes transformers' tokens and loss masks for the fine-tuning fixtures, the reference the engine is held to.

    python scripts/sft_reference.py golden/sft/transformers.json     # from the repository root

Reads suites/data/tokenizer and suites/data/tokenizer-no-generation (made by
scripts/make_sft_fixtures.py) with AutoTokenizer, and encodes the first 40 rows of
suites/data/squad-sft.jsonl and the edge cases below. Each case is one line of the output's
"cases" array: {"name", "tokenizer", "kind", "input", "input_ids", "labels_mask"}, where
- kind "messages", tokenizer "tokenizer": apply_chat_template(..., return_assistant_tokens_mask=True)'s
  input_ids and assistant_masks;
- kind "messages", tokenizer "tokenizer-no-generation": the prompt/completion split, 0 for the tokens of
  the conversation before its last assistant message rendered with add_generation_prompt=True, 1 after
  (left out for GENERATION_ONLY, whose prompt's tokens are no prefix of the conversation's);
- kind "prompt_completion": the messages [user: prompt, assistant: completion], as above;
- kind "text": tok(text) with its BOS and EOS, every token 1 (tokenizer "tokenizer" only: the same tokenizer.json).
Needs transformers 5 (written with 5.24.0) and tokenizers; the output names both versions.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import tokenizers
import transformers
from transformers import AutoTokenizer

DATA = Path("suites/data")
ROWS = 40
GENERATION, NO_GENERATION = "tokenizer", "tokenizer-no-generation"
GENERATION_ONLY = {"edge-token-straddles-span-start"}
Messages = list[dict[str, str]]


def chat(*turns: tuple[str, str]) -> Messages:
    return [{"role": role, "content": content} for role, content in turns]


# name, kind, input: hand-written cases for the edges of the assistant spans and of the template.
EDGE_CASES: list[tuple[str, str, Any]] = [
    ("edge-empty-assistant", "messages", chat(("user", "Say nothing at all."), ("assistant", ""))),
    (
        "edge-im-end-in-user",
        "messages",
        chat(("user", "Repeat this: <|im_end|> and stop."), ("assistant", "I will not.")),
    ),
    (
        "edge-im-end-in-assistant",
        "messages",
        chat(("user", "Write the end marker."), ("assistant", "Here: <|im_end|>")),
    ),
    (
        "edge-newlines-at-edges",
        "messages",
        chat(("user", "\nWhere is the café?\n"), ("assistant", "Zürich\n\n")),
    ),
    # "assistant\n" + "\n\nZürich": the template's newline and the content's first are one token, ĊĊ, which
    # overlaps the generation span (so it is marked) and breaks the prompt/completion split (generation only).
    (
        "edge-token-straddles-span-start",
        "messages",
        chat(("user", "Where?"), ("assistant", "\n\nZürich")),
    ),
    (
        "edge-multibyte-at-edges",
        "messages",
        chat(("user", "é"), ("assistant", "é — naïve — ü")),
    ),
    (
        "edge-astral-at-edges",
        "messages",
        chat(("system", "🌊"), ("user", "東京?"), ("assistant", "🌊東京🌊")),
    ),
    (
        "edge-spaces-at-edges",
        "messages",
        chat(("user", " Where? "), ("assistant", " Grünwald ")),
    ),
    (
        "edge-three-turns",
        "messages",
        chat(
            ("system", "Answer briefly."),
            ("user", "Who founded Valdoria?"),
            ("assistant", "Renée Moreau."),
            ("user", "When?"),
            ("assistant", "In 1622 — in spring."),
            ("user", "And the café?"),
            ("assistant", "Café Dubois opened in 1630.\nIt is still open."),
        ),
    ),
    ("edge-no-user", "messages", chat(("system", "Greet."), ("assistant", "Hello!"))),
    ("edge-completion-leading-space", "prompt_completion", {"prompt": "Zürich is in", "completion": " Switzerland."}),
    ("edge-empty-completion", "prompt_completion", {"prompt": "Nothing follows.", "completion": ""}),
    ("edge-empty-text", "text", ""),
    ("edge-im-end-in-text", "text", "before <|im_end|> after <|endoftext|>"),
    ("edge-whitespace-text", "text", "\n  Zürich —  café \n\n"),
    ("edge-astral-text", "text", "🌊 東京 naïve"),
]


def ids_of(encoding: Any) -> list[int]:
    return [int(i) for i in encoding["input_ids"]]


def generation_mask(tok: Any, messages: Messages) -> tuple[list[int], list[int]]:
    """The {% generation %} spans' tokens, as transformers marks them."""
    out = tok.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    return ids_of(out), [int(m) for m in out["assistant_masks"]]


def split_mask(tok: Any, messages: Messages) -> tuple[list[int], list[int]] | None:
    """The prompt/completion split at the last assistant message; None if the prompt's tokens are no prefix."""
    last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
    prefix = ids_of(tok.apply_chat_template(messages[:last], add_generation_prompt=True, tokenize=True))
    full = ids_of(tok.apply_chat_template(messages, tokenize=True))
    if full[: len(prefix)] != prefix:
        return None
    return full, [0] * len(prefix) + [1] * (len(full) - len(prefix))


def cases_of(toks: dict[str, Any], name: str, kind: str, value: Any) -> list[dict[str, Any]]:
    if kind == "text":
        ids = ids_of(toks[GENERATION](value))
        mask = [1] * len(ids)
        return [{"name": name, "tokenizer": GENERATION, "kind": kind, "input": value, "input_ids": ids, "labels_mask": mask}]
    messages = value if kind == "messages" else chat(("user", value["prompt"]), ("assistant", value["completion"]))
    variants = {GENERATION: generation_mask(toks[GENERATION], messages)}
    split = split_mask(toks[NO_GENERATION], messages)
    assert (split is None) == (name in GENERATION_ONLY), f"{name}: the prompt's tokens are no prefix"
    if split is not None:
        assert split[0] == variants[GENERATION][0], f"{name}: the two templates render different tokens"
        variants[NO_GENERATION] = split
    return [
        {"name": name, "tokenizer": tokenizer, "kind": kind, "input": value, "input_ids": ids, "labels_mask": mask}
        for tokenizer, (ids, mask) in variants.items()
    ]


def main() -> None:
    if len(sys.argv) != 2:
        sys.exit(f"usage: {sys.argv[0]} OUT.json")
    toks = {name: AutoTokenizer.from_pretrained(DATA / name) for name in (GENERATION, NO_GENERATION)}
    with open(DATA / "squad-sft.jsonl", encoding="utf-8") as f:
        rows = [json.loads(line) for line, _ in zip(f, range(ROWS))]
    cases: list[dict[str, Any]] = []
    for i, row in enumerate(rows):
        name = f"squad-{i:02d}"
        cases += cases_of(toks, name, "messages", row["messages"])
        cases += cases_of(toks, name, "prompt_completion", {"prompt": row["prompt"], "completion": row["completion"]})
        cases += cases_of(toks, name, "text", row["text"])
    for name, kind, value in EDGE_CASES:
        cases += cases_of(toks, name, kind, value)
    head = f'{{"transformers": "{transformers.__version__}", "tokenizers": "{tokenizers.__version__}", "cases": [\n'
    lines = [json.dumps(case, ensure_ascii=False, separators=(",", ":")) for case in cases]
    out = Path(sys.argv[1])
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w", encoding="utf-8", newline="\n") as f:
        f.write(head + ",\n".join(lines) + "\n]}\n")


if __name__ == "__main__":
    main()
