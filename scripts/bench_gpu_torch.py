#!/usr/bin/env python3
"""Reference GPU training throughput: Hugging Face LlamaForCausalLM shaped like Llama-3.2-1B
(vocab 128256, hidden 2048, 16 layers, 32 heads, 8 KV heads, FFN 8192, tied embeddings) at
sequence 2048, bf16 autocast over fp32 weights, SDPA attention, gradient checkpointing, AdamW
(fused) with clipping at 1.0. Prints one JSON object: median step time, tokens/s, peak allocated
and reserved bytes, and model-FLOPs utilisation against the card's dense bf16 peak.

    python3 scripts/bench_gpu_torch.py [--batch 8] [--seq 2048] [--steps 10] [--warmup 3]
                                       [--peak-tflops 989]

Exits with status 3 when torch, transformers or a CUDA device is missing.
"""

import argparse
import json
import statistics
import sys
import time


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--no-checkpointing", action="store_true")
    p.add_argument("--peak-tflops", type=float, default=989.0,
                   help="dense bf16 peak of the card (H100 SXM: 989)")
    return p.parse_args()


def model_flops_per_token(cfg, seq):
    """6·N for the matrix products plus causal attention's score and value products."""
    h, f, layers = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers
    kv = cfg.num_key_value_heads * (h // cfg.num_attention_heads)
    per_layer = h * h * 2 + h * kv * 2 + 3 * h * f
    dense = layers * per_layer + cfg.vocab_size * h
    attention = layers * 2 * seq * h  # causal: half of QK^T and PV, forward only
    return 6 * dense + 3 * attention


def main():
    args = parse_args()
    try:
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError as e:
        print(f"bench_gpu_torch: cannot import torch/transformers: {e}", file=sys.stderr)
        sys.exit(3)
    if not torch.cuda.is_available():
        print("bench_gpu_torch: no CUDA device", file=sys.stderr)
        sys.exit(3)

    torch.manual_seed(0)
    torch.backends.cuda.matmul.allow_tf32 = False
    cfg = LlamaConfig(
        vocab_size=128256,
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=args.layers,
        num_attention_heads=32,
        num_key_value_heads=8,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        max_position_embeddings=args.seq,
        tie_word_embeddings=True,
        attention_bias=False,
        mlp_bias=False,
        attn_implementation="sdpa",
    )
    dev = torch.device("cuda")
    model = LlamaForCausalLM(cfg).to(dev, torch.float32)
    model.train()
    if not args.no_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), eps=1e-8,
                            weight_decay=0.1, fused=True)
    gen = torch.Generator(device=dev).manual_seed(0)

    def step():
        ids = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), device=dev, generator=gen)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    for _ in range(args.warmup):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        loss = step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    med = statistics.median(times)
    tokens = args.batch * args.seq
    flops = model_flops_per_token(cfg, args.seq) * tokens
    print(json.dumps({
        "bench": "torch_gpu_train_step",
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "batch": args.batch,
        "seq": args.seq,
        "layers": args.layers,
        "checkpointing": not args.no_checkpointing,
        "median_step_s": med,
        "tokens_per_s": tokens / med,
        "peak_allocated_bytes": torch.cuda.max_memory_allocated(),
        "peak_reserved_bytes": torch.cuda.max_memory_reserved(),
        "mfu": flops / med / (args.peak_tflops * 1e12),
        "final_loss": float(loss),
    }))


if __name__ == "__main__":
    main()
