#!/usr/bin/env python3
"""Checks that transformers loads a ckpt-harness checkpoint (of any family: the class comes from
config.json's model_type) and computes the engine's loss.

    python3 scripts/check_hf_load.py CHECKPOINT_DIR BATCH.safetensors ENGINE_LOSS [--rtol X]

CHECKPOINT_DIR is one step directory (model.safetensors + config.json). BATCH holds int64
`input_ids` and `labels` [B, T] (labels aligned, -100 ignored), as `ckpt-harness eval` reads it;
ENGINE_LOSS is the loss `ckpt-harness eval --model CHECKPOINT_DIR --batch BATCH` printed.

Fails (exit 1) when from_pretrained reports missing, unexpected or mismatched tensors, when a
loaded tensor differs from the file's bytes, or when the losses differ by more than rtol.
Needs torch, transformers and safetensors.
"""
import argparse
import json
import sys

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("checkpoint")
    ap.add_argument("batch")
    ap.add_argument("engine_loss", type=float)
    ap.add_argument("--rtol", type=float, default=1e-5)
    args = ap.parse_args()

    model, info = AutoModelForCausalLM.from_pretrained(
        args.checkpoint, output_loading_info=True, torch_dtype="auto"
    )
    problems = {k: v for k, v in info.items() if v}
    if problems:
        print(f"{args.checkpoint}: from_pretrained reported {problems}", file=sys.stderr)
        return 1
    saved = load_file(f"{args.checkpoint}/model.safetensors")
    state = model.state_dict()
    for name, tensor in saved.items():
        if not torch.equal(state[name], tensor):
            print(f"{args.checkpoint}: {name} differs after loading", file=sys.stderr)
            return 1

    model = model.float().eval()
    batch = load_file(args.batch)
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"]).logits
    loss = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), batch["labels"].reshape(-1), ignore_index=-100
    ).item()
    rel = abs(loss - args.engine_loss) / max(abs(loss), 1e-12)
    print(json.dumps({"checkpoint": args.checkpoint, "dtype": str(next(iter(saved.values())).dtype),
                      "tensors": len(saved), "hf_loss": loss, "engine_loss": args.engine_loss,
                      "rel_err": rel}))
    return 0 if rel <= args.rtol else 1


if __name__ == "__main__":
    sys.exit(main())
