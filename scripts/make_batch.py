#!/usr/bin/env python3
"""Writes a random token batch for a Llama config, in the layout `ckpt-harness eval` reads.

    python3 scripts/make_batch.py CONFIG_JSON OUT.safetensors [--rows 2] [--seq 16] [--seed 0]

`input_ids` and `labels` are int64 [rows, seq]; labels are the next token, -100 at each row's end.
"""
import argparse
import json

import torch
from safetensors.torch import save_file

ap = argparse.ArgumentParser()
ap.add_argument("config")
ap.add_argument("out")
ap.add_argument("--rows", type=int, default=2)
ap.add_argument("--seq", type=int, default=16)
ap.add_argument("--seed", type=int, default=0)
args = ap.parse_args()

vocab = json.load(open(args.config))["vocab_size"]
ids = torch.randint(0, vocab, (args.rows, args.seq), generator=torch.Generator().manual_seed(args.seed))
labels = torch.cat([ids[:, 1:], torch.full((args.rows, 1), -100)], dim=1)
save_file({"input_ids": ids, "labels": labels}, args.out)
