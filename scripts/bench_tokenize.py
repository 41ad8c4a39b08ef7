#!/usr/bin/env python3
"""transformers tokenizing a fine-tuning dataset, the reference the engine's tokenize bench is held to.

    python scripts/bench_tokenize.py DATASET.jsonl TOKENIZER_DIR

Reads every row's `messages` and times `apply_chat_template(..., tokenize=True, return_dict=True,
return_assistant_tokens_mask=True)` over all of them (the template rendered, the text tokenized
by the fast tokenizer in batches, the assistant masks made), as the engine's loader does for each
row. Prints one JSON object: the rows and the rows a second.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

from transformers import AutoTokenizer


def main() -> None:
    if len(sys.argv) != 3:
        sys.exit(f"usage: {sys.argv[0]} DATASET.jsonl TOKENIZER_DIR")
    tok: Any = AutoTokenizer.from_pretrained(sys.argv[2])
    with open(sys.argv[1], encoding="utf-8") as f:
        conversations = [json.loads(line)["messages"] for line in f if line.strip()]
    start = time.perf_counter()
    out = tok.apply_chat_template(
        conversations, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    seconds = time.perf_counter() - start
    assert len(out["input_ids"]) == len(conversations)
    print(json.dumps({"rows": len(conversations), "tokenize_rows_per_s": len(conversations) / seconds}))


if __name__ == "__main__":
    main()
