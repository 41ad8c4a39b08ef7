#!/usr/bin/env python3
"""Checks that transformers loads a ckpt-harness checkpoint (of any family: the class comes from
config.json's model_type) and computes the engine's loss.

    python3 scripts/check_hf_load.py CHECKPOINT_DIR BATCH.safetensors ENGINE_EVAL_JSON [--rtol X]

CHECKPOINT_DIR is one step directory (model.safetensors + config.json). BATCH holds int64
`input_ids` and `labels` [B, T] (labels aligned, -100 ignored), as `ckpt-harness eval` reads it;
ENGINE_EVAL_JSON is the line `ckpt-harness eval --model CHECKPOINT_DIR --batch BATCH` printed:
its `loss`, and for a MoE model its `ce` and `aux` (the load-balancing loss), each compared.

Fails (exit 1) when from_pretrained reports missing, unexpected or mismatched tensors, when a
loaded tensor differs from the file's bytes, or when a loss differs by more than rtol.
transformers holds a MoE layer's experts fused (`mlp.experts.gate_up_proj` [experts, 2·ffn,
hidden], `mlp.experts.down_proj` [experts, hidden, ffn]) while the file has one tensor per expert
and projection, as on the Hub: each of those is compared with its slice of the fused tensor.
Needs torch, transformers and safetensors.
"""
import argparse
import json
import re
import sys

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

# A per-expert tensor's name: layer, block (mlp or Mixtral's block_sparse_moe), expert, projection.
EXPERT = re.compile(r"model\.layers\.(\d+)\.(mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight")
# Each projection's place in transformers' fused tensors: gate and up are the halves of
# gate_up_proj, down is down_proj.
PART = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down",
        "w2": "down"}


def loaded(state: dict, name: str) -> torch.Tensor:
    """The loaded tensor that the file's tensor `name` should equal."""
    if name in state:
        return state[name]
    # transformers names Mixtral's block_sparse_moe `mlp` once loaded.
    renamed = name.replace(".block_sparse_moe.", ".mlp.")
    if renamed in state:
        return state[renamed]
    m = EXPERT.fullmatch(name)
    if m is None:
        raise KeyError(name)
    layer, _, expert, proj = m.groups()
    prefix = f"model.layers.{layer}.mlp.experts"
    part = PART[proj]
    if part == "down":
        return state[f"{prefix}.down_proj"][int(expert)]
    fused = state[f"{prefix}.gate_up_proj"][int(expert)]
    half = fused.shape[0] // 2
    return fused[:half] if part == "gate" else fused[half:]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("checkpoint")
    ap.add_argument("batch")
    ap.add_argument("engine_eval", help="the JSON line ckpt-harness eval printed")
    ap.add_argument("--rtol", type=float, default=1e-5)
    args = ap.parse_args()
    engine = json.loads(args.engine_eval)

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
        try:
            same = torch.equal(loaded(state, name), tensor)
        except KeyError:
            print(f"{args.checkpoint}: {name} has no place in the loaded model", file=sys.stderr)
            return 1
        if not same:
            print(f"{args.checkpoint}: {name} differs after loading", file=sys.stderr)
            return 1

    model = model.float().eval()
    batch = load_file(args.batch)
    moe = "aux" in engine
    with torch.no_grad():
        # No labels: transformers would shift them, and these are already the next tokens.
        out = model(input_ids=batch["input_ids"], output_router_logits=moe)
    logits = out.logits
    ce = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), batch["labels"].reshape(-1), ignore_index=-100
    ).item()
    hf = {"loss": ce}
    if moe:
        aux = out.aux_loss.item()
        hf = {"ce": ce, "aux": aux, "loss": ce + model.config.router_aux_loss_coef * aux}
    rel = {k: abs(v - engine[k]) / max(abs(v), 1e-12) for k, v in hf.items()}
    print(json.dumps({"checkpoint": args.checkpoint, "dtype": str(next(iter(saved.values())).dtype),
                      "tensors": len(saved), "hf": hf, "engine": engine, "rel_err": rel}))
    return 0 if max(rel.values()) <= args.rtol else 1


if __name__ == "__main__":
    sys.exit(main())
