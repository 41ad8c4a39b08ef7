#!/usr/bin/env bash
# Training throughput on the CPU: the engine's train_step bench and, when python3 can import torch
# and transformers, Hugging Face LlamaForCausalLM with the same model, batch and optimizer, run
# one after the other in the same invocation; prints both and the ratio. Then checkpoint save and
# load throughput next to a plain write + fsync and read of the same bytes (checkpoint_io bench).
#
#   scripts/bench.sh [--threads N] [--steps N] [--warmup N] [--rounds N]
#
# Environment: PYTHON picks the interpreter (default python3). With --rounds N > 1 the two
# benchmarks alternate N times and the medians are compared, which steadies figures on a busy
# machine.
set -euo pipefail
cd "$(dirname "$0")/.."

threads=2 steps=10 warmup=2 rounds=1
while [[ $# -gt 0 ]]; do
    case "$1" in
    --threads) threads="$2" ;;
    --steps) steps="$2" ;;
    --warmup) warmup="$2" ;;
    --rounds) rounds="$2" ;;
    *)
        echo "bench.sh: unknown argument $1" >&2
        exit 2
        ;;
    esac
    shift 2
done
python="${PYTHON:-python3}"

# The first number after "key": in a line of JSON.
json_number() {
    sed -nE "s/.*\"$1\": *([-0-9.eE+]+).*/\1/p" <<<"$2" | head -n 1
}

# The median of numbers given one per line.
median() {
    sort -g | awk '{ v[NR] = $1 } END { if (NR % 2) print v[(NR + 1) / 2]; else print (v[NR / 2] + v[NR / 2 + 1]) / 2 }'
}

echo "building the engine bench..." >&2
cargo bench -p ckpt-engine --bench train_step --no-run --locked -q

have_torch=0
if command -v "$python" >/dev/null 2>&1 && "$python" -c "import torch, transformers" >/dev/null 2>&1; then
    have_torch=1
fi

ours=() theirs=()
for ((round = 1; round <= rounds; round++)); do
    line=$(cargo bench -p ckpt-engine --bench train_step --locked -q -- \
        --threads "$threads" --steps "$steps" --warmup "$warmup" --checkpointing none | tail -n 1)
    echo "engine:  $line"
    ours+=("$(json_number tokens_per_s "$line")")
    if [[ $have_torch == 1 ]]; then
        line=$("$python" scripts/bench_torch.py --threads "$threads" --steps "$steps" --warmup "$warmup")
        echo "pytorch: $line"
        theirs+=("$(json_number tokens_per_s "$line")")
    fi
done

ours_tps=$(printf '%s\n' "${ours[@]}" | median)
printf 'engine tokens/s:  %.1f (%d thread(s), median of %d round(s))\n' "$ours_tps" "$threads" "$rounds"
if [[ $have_torch == 0 ]]; then
    echo "pytorch reference skipped: $python cannot import torch and transformers"
else
    theirs_tps=$(printf '%s\n' "${theirs[@]}" | median)
    printf 'pytorch tokens/s: %.1f\n' "$theirs_tps"
    awk -v a="$ours_tps" -v b="$theirs_tps" 'BEGIN { printf "ratio engine/pytorch: %.2fx (target >= 1.0x)\n", a / b }'
fi

echo "checkpoint save and load..." >&2
io=$(cargo bench -p ckpt-harness --bench checkpoint_io --locked -q | tail -n 1)
echo "checkpoint_io: $io"
printf 'save %.2f GB/s, plain write + fsync %.2f GB/s: %.2fx (target >= 0.70x)\n' \
    "$(json_number save_gb_s "$io")" "$(json_number plain_write_gb_s "$io")" "$(json_number save_vs_plain "$io")"
printf 'load %.2f GB/s, plain read into memory %.2f GB/s: %.2fx (target >= 0.70x); streaming read %.2f GB/s: %.2fx\n' \
    "$(json_number load_gb_s "$io")" "$(json_number plain_read_gb_s "$io")" "$(json_number load_vs_plain "$io")" \
    "$(json_number stream_read_gb_s "$io")" "$(json_number load_vs_stream "$io")"
