#!/usr/bin/env python3
"""Reference training throughput: Hugging Face LlamaForCausalLM on the CPU with the benchmark
model of engine/benches/train_step.rs (vocab 4096, hidden 256, 4 layers, 8 heads, 4 KV heads,
FFN 688, batch 8 x 256 tokens, fp32, AdamW, clipping at 1.0). Prints one JSON object with the
median step time and tokens/s.

`--precision bf16-mixed` runs the forward and backward passes under CPU autocast to bfloat16
(f32 weights and optimizer, matrix products in bf16 where the CPU has bf16 instructions), the
counterpart of the engine's bf16-mixed.

Exits with status 3 when torch or transformers cannot be imported.
"""

import argparse
import json
import statistics
import sys
import time


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--precision", choices=["fp32", "bf16-mixed"], default="fp32")
    return p.parse_args()


def main():
    args = parse_args()
    try:
        import torch
        import transformers
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError as e:
        print(f"bench_torch: cannot import torch/transformers: {e}", file=sys.stderr)
        sys.exit(3)

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    batch, seq = 8, 256
    cfg = LlamaConfig(
        vocab_size=4096,
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=seq,
        tie_word_embeddings=False,
        attention_bias=False,
        mlp_bias=False,
        attn_implementation="sdpa",
    )
    model = LlamaForCausalLM(cfg).to(torch.float32)
    model.train()
    opt = torch.optim.AdamW(
        model.parameters(), lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1
    )
    gen = torch.Generator().manual_seed(0)

    def step():
        ids = torch.randint(0, cfg.vocab_size, (batch, seq), generator=gen)
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.precision == "bf16-mixed"):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        return time.perf_counter() - start, loss.item()

    for _ in range(args.warmup):
        step()
    times, loss = [], float("nan")
    for _ in range(args.steps):
        t, loss = step()
        times.append(t)
    median = statistics.median(times)
    print(
        json.dumps(
            {
                "engine": "pytorch",
                "torch": torch.__version__,
                "transformers": transformers.__version__,
                "attn_implementation": model.config._attn_implementation,
                "threads": torch.get_num_threads(),
                "cpu_capability": torch.backends.cpu.get_cpu_capability(),
                "precision": args.precision,
                "steps": args.steps,
                "warmup": args.warmup,
                "tokens_per_step": batch * seq,
                "median_step_ms": median * 1e3,
                "min_step_ms": min(times) * 1e3,
                "tokens_per_s": batch * seq / median,
                "last_loss": loss,
            }
        )
    )


if __name__ == "__main__":
    main()
