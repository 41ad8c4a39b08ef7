#!/usr/bin/env bash
# Training throughput on the CPU: the engine's train_step bench and, when python3 can import torch
# and transformers, Hugging Face LlamaForCausalLM with the same model, batch and optimizer, run
# one after the other in the same invocation; prints both and the ratio. Then fine-tuning data:
# a step on the fixture conversations against one of the same shape on synthetic data, and
# tokenizing 100,000 conversations against transformers' apply_chat_template (and the token
# cache's read back against the first run). Then the plan of every step of a 1,000-step run over
# those conversations against drawing its batches alone (plan bench). Then checkpoint save and
# load throughput next to a plain write + fsync and read of the same bytes (checkpoint_io bench).
#
#   scripts/bench.sh [--threads N] [--steps N] [--warmup N] [--rounds N] [--precision P]
#                    [--kernels native|fma] [--json FILE]
#
# Environment: PYTHON picks the interpreter (default python3). With --rounds N > 1 the two
# training benchmarks alternate N times, the checkpoint bench runs N times, and the medians are
# compared, which steadies figures on a busy machine. --precision bf16-mixed (default fp32) trains
# both in bf16-mixed: the engine's, and PyTorch's CPU autocast to bfloat16. --kernels fma holds
# both to AVX2 and FMA on a CPU with AVX-512 (the engine built without its `avx512` feature;
# PyTorch's ATen, MKL and oneDNN capped at AVX2), a stand-in for an AVX2 machine's instruction
# set, though not for its caches or clock. --json FILE also writes the figures for
# `ckpt-harness run --bench FILE` (the nightly job's summary.json): the engine's (tokens/s of each
# configuration, save and load GB/s, and their ratios to PyTorch and to plain input/output),
# which trends compare night to night, and the references they are held to.
set -euo pipefail
cd "$(dirname "$0")/.."

command="scripts/bench.sh${*:+ $*}"
threads=2 steps=10 warmup=2 rounds=1 precision=fp32 kernels=native json=""
while [[ $# -gt 0 ]]; do
    case "$1" in
    --threads) threads="$2" ;;
    --steps) steps="$2" ;;
    --warmup) warmup="$2" ;;
    --rounds) rounds="$2" ;;
    --precision) precision="$2" ;;
    --kernels) kernels="$2" ;;
    --json) json="$2" ;;
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

# The median of numbers given one per line; nothing for none.
median() {
    sort -g | awk '{ v[NR] = $1 } END { if (NR == 0) exit; if (NR % 2) print v[(NR + 1) / 2]; else print (v[NR / 2] + v[NR / 2 + 1]) / 2 }'
}

# The median of the figure named KEY over JSON lines given one per line.
median_of() {
    local key="$1" line
    while IFS= read -r line; do json_number "$key" "$line"; done | median
}

# harness_bench NAME: the harness's bench NAME run `rounds` times, each run's last line (its
# JSON figures) written on a line of standard output and shown as "NAME: LINE" on standard error.
harness_bench() {
    local round line
    for ((round = 1; round <= rounds; round++)); do
        line=$(cargo bench -p ckpt-harness --bench "$1" --locked -q | tail -n 1)
        echo "$1: $line" >&2
        echo "$line"
    done
}

# figure NAME UNIT VALUE [reference]: one figure for --json; a value that is not a number stops
# the script, so a figure the benches did not print is never written as something else.
figures=()
figure() {
    if ! [[ $3 =~ ^[0-9]+(\.[0-9]+)?([eE][-+]?[0-9]+)?$ ]]; then
        echo "bench.sh: $1: no figure measured (got '$3')" >&2
        exit 1
    fi
    local reference=""
    [[ ${4:-} == reference ]] && reference=', "reference": true'
    figures+=("    {\"name\": \"$1\", \"unit\": \"$2\", \"value\": $3$reference}")
}

# What holds each side to the kernels asked for: the engine's build features, PyTorch's
# environment.
engine_features=() torch_env=()
case "$kernels" in
native) ;;
fma)
    engine_features=(--no-default-features)
    torch_env=(ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2)
    ;;
*)
    echo "bench.sh: --kernels takes native or fma, not '$kernels'" >&2
    exit 2
    ;;
esac

echo "building the engine bench..." >&2
cargo bench -p ckpt-engine "${engine_features[@]}" --bench train_step --no-run --locked -q

have_torch=0
if command -v "$python" >/dev/null 2>&1 && "$python" -c "import torch, transformers" >/dev/null 2>&1; then
    have_torch=1
fi

ours_lines=() theirs=()
for ((round = 1; round <= rounds; round++)); do
    line=$(cargo bench -p ckpt-engine "${engine_features[@]}" --bench train_step --locked -q -- \
        --threads "$threads" --steps "$steps" --warmup "$warmup" --checkpointing none \
        --precision "$precision" | tail -n 1)
    echo "engine:  $line"
    ours_lines+=("$line")
    if [[ $have_torch == 1 ]]; then
        line=$(env "${torch_env[@]}" "$python" scripts/bench_torch.py --threads "$threads" --steps "$steps" --warmup "$warmup" \
            --precision "$precision")
        echo "pytorch: $line"
        theirs+=("$(json_number tokens_per_s "$line")")
    fi
done

config="$precision, $threads thread$([[ $threads == 1 ]] || echo s)"
[[ $kernels == native ]] || config+=", $kernels kernels"
ours_tps=$(printf '%s\n' "${ours_lines[@]}" | median_of tokens_per_s)
printf 'engine tokens/s:  %.1f (%d thread(s), median of %d round(s))\n' "$ours_tps" "$threads" "$rounds"
fraction=$(printf '%s\n' "${ours_lines[@]}" | median_of fraction_of_cpu_peak)
if [[ -n $fraction ]]; then
    printf 'engine at %.0f%% of the CPU'"'"'s fp32 peak (%.0f GFLOP/s measured on %d thread(s))\n' \
        "$(awk -v f="$fraction" 'BEGIN { print 100 * f }')" \
        "$(printf '%s\n' "${ours_lines[@]}" | median_of cpu_peak_gflops)" "$threads"
fi
figure "training, engine ($config)" tokens/s "$ours_tps"
if [[ $have_torch == 0 ]]; then
    echo "pytorch reference skipped: $python cannot import torch and transformers"
else
    theirs_tps=$(printf '%s\n' "${theirs[@]}" | median)
    printf 'pytorch tokens/s: %.1f\n' "$theirs_tps"
    ratio=$(awk -v a="$ours_tps" -v b="$theirs_tps" 'BEGIN { printf "%.4f", a / b }')
    target="(target >= 1.2x)"
    [[ $precision == fp32 ]] || target="(the 1.2x target is fp32's)"
    printf 'ratio engine/pytorch: %.2fx %s\n' "$ratio" "$target"
    figure "training, PyTorch ($config)" tokens/s "$theirs_tps" reference
    figure "training, engine / PyTorch ($config)" x "$ratio"
fi

echo "fine-tuning data..." >&2
# A training step on the fixture conversations (rows padded to the bench's length) against the
# same shape of synthetic data, alternated; tokenizing 100,000 conversations against
# transformers' apply_chat_template on the same file, and the cache's read back against the first.
data_lines=() synthetic_lines=() tokenize_lines=() theirs_tokenize=()
for ((round = 1; round <= rounds; round++)); do
    for data in squad synthetic; do
        line=$(cargo bench -p ckpt-engine "${engine_features[@]}" --bench train_step --locked -q -- \
            --threads "$threads" --steps "$steps" --warmup "$warmup" --checkpointing none \
            --precision "$precision" --data "$data" | tail -n 1)
        echo "engine ($data data): $line"
        if [[ $data == squad ]]; then data_lines+=("$line"); else synthetic_lines+=("$line"); fi
    done
    line=$(cargo bench -p ckpt-engine "${engine_features[@]}" --bench tokenize --locked -q | tail -n 1)
    echo "tokenize: $line"
    tokenize_lines+=("$line")
    if [[ $have_torch == 1 ]]; then
        line=$("$python" scripts/bench_tokenize.py target/bench/squad-sft-100k.jsonl suites/data/tokenizer)
        echo "transformers tokenize: $line"
        theirs_tokenize+=("$(json_number tokenize_rows_per_s "$line")")
    fi
done
squad_tps=$(printf '%s\n' "${data_lines[@]}" | median_of tokens_per_s)
synthetic_tps=$(printf '%s\n' "${synthetic_lines[@]}" | median_of tokens_per_s)
data_ratio=$(awk -v a="$squad_tps" -v b="$synthetic_tps" 'BEGIN { printf "%.4f", a / b }')
printf 'training on real data %.1f tokens/s, synthetic %.1f: %.3fx (target >= 0.95x)\n' \
    "$squad_tps" "$synthetic_tps" "$data_ratio"
figure "training on fine-tuning text, engine ($config)" tokens/s "$squad_tps"
figure "training on fine-tuning text / synthetic data ($config)" x "$data_ratio"
ours_rows=$(printf '%s\n' "${tokenize_lines[@]}" | median_of tokenize_rows_per_s)
read_back=$(printf '%s\n' "${tokenize_lines[@]}" | median_of read_back_vs_first)
printf 'tokenizing: %.0f rows/s; the cache read back %.1fx faster than the first run (target >= 20x)\n' \
    "$ours_rows" "$read_back"
figure "tokenizing chat samples, engine" rows/s "$ours_rows"
figure "tokenized samples read back / tokenized and kept" x "$read_back"
if [[ $have_torch == 1 ]]; then
    theirs_rows=$(printf '%s\n' "${theirs_tokenize[@]}" | median)
    tokenize_ratio=$(awk -v a="$ours_rows" -v b="$theirs_rows" 'BEGIN { printf "%.4f", a / b }')
    printf 'transformers apply_chat_template: %.0f rows/s; engine/transformers: %.2fx (target >= 1x)\n' \
        "$theirs_rows" "$tokenize_ratio"
    figure "tokenizing chat samples, transformers" rows/s "$theirs_rows" reference
    figure "tokenizing chat samples, engine / transformers" x "$tokenize_ratio"
fi

echo "the plan of every step..." >&2
# Every step's batches and memory planned over the tokenize bench's 100,000 conversations in a
# 1,000-step run, at the phi4-squad suite's shape and at phi-4's real one, against drawing the
# batches alone.
plan_out=$(harness_bench plan)
mapfile -t plan_lines <<<"$plan_out"
plan_median() { printf '%s\n' "${plan_lines[@]}" | median_of "$1"; }
printf 'the plan of 100,000 samples over 1,000 steps: %.2f s (target < 2 s on 2 cores); at phi-4'"'"'s real shape %.2f s (target < 5 s); drawing the batches alone %.2f s\n' \
    "$(plan_median plan_s)" "$(plan_median plan_phi4_s)" "$(plan_median draw_s)"
steps_per_s() { awk -v s="$(plan_median "$1")" 'BEGIN { printf "%.4f", 1000 / s }'; }
figure "planning every step, phi4-squad's shape" steps/s "$(steps_per_s plan_s)"
figure "planning every step, phi-4's real shape" steps/s "$(steps_per_s plan_phi4_s)"
figure "drawing every step's batches" steps/s "$(steps_per_s draw_s)" reference
figure "planning every step / drawing the batches, phi4-squad's shape" x \
    "$(awk -v a="$(plan_median plan_s)" -v b="$(plan_median draw_s)" 'BEGIN { printf "%.4f", b / a }')"

echo "checkpoint save and load..." >&2
io_out=$(harness_bench checkpoint_io)
mapfile -t io_lines <<<"$io_out"
io_median() { printf '%s\n' "${io_lines[@]}" | median_of "$1"; }
printf 'save %.2f GB/s, plain write + fsync %.2f GB/s: %.2fx (target >= 0.80x)\n' \
    "$(io_median save_gb_s)" "$(io_median plain_write_gb_s)" "$(io_median save_vs_plain)"
printf 'load %.2f GB/s, plain read into memory %.2f GB/s: %.2fx; streaming read %.2f GB/s: %.2fx (target >= 0.50x)\n' \
    "$(io_median load_gb_s)" "$(io_median plain_read_gb_s)" "$(io_median load_vs_plain)" "$(io_median stream_read_gb_s)" "$(io_median load_vs_stream)"
printf 'sharded save (4 ranks) %.2f GB/s: %.2fx a plain write + fsync (target >= 0.80x)\n' \
    "$(io_median sharded_save_gb_s)" "$(io_median sharded_save_vs_plain)"
printf 'sharded checkpoint read / one device'"'"'s, per byte: %.2fx on one device, %.2fx on 3 ranks (target >= 1x)\n' \
    "$(io_median sharded_vs_single_device_read_on_one_device)" "$(io_median sharded_vs_single_device_read_on_3_ranks)"
printf 'state digest %.2f GB/s: %.2fx one sha256 stream over the same tensors\n' \
    "$(io_median state_digest_gb_s)" "$(io_median state_digest_vs_one_sha256_stream)"
[[ $rounds == 1 ]] || echo "(checkpoint figures: medians of $rounds runs)"
figure "checkpoint save" GB/s "$(io_median save_gb_s)"
figure "plain write + fsync" GB/s "$(io_median plain_write_gb_s)" reference
figure "checkpoint save / plain write + fsync" x "$(io_median save_vs_plain)"
figure "checkpoint load" GB/s "$(io_median load_gb_s)"
figure "plain read into memory" GB/s "$(io_median plain_read_gb_s)" reference
figure "streaming read" GB/s "$(io_median stream_read_gb_s)" reference
figure "checkpoint load / plain read" x "$(io_median load_vs_plain)"
figure "checkpoint load / streaming read" x "$(io_median load_vs_stream)"
figure "sharded checkpoint save / plain write + fsync" x "$(io_median sharded_save_vs_plain)"
figure "sharded checkpoint read / one device's, on one device" x "$(io_median sharded_vs_single_device_read_on_one_device)"
figure "sharded checkpoint read / one device's, on 3 ranks" x "$(io_median sharded_vs_single_device_read_on_3_ranks)"
figure "state digest" GB/s "$(io_median state_digest_gb_s)"
figure "state digest / one sha256 stream" x "$(io_median state_digest_vs_one_sha256_stream)"

if [[ -n $json ]]; then
    cpu=$(sed -n 's/^model name[[:space:]]*: //p' /proc/cpuinfo 2>/dev/null | head -n 1)
    machine="${cpu:-unknown CPU}, $(nproc 2>/dev/null || echo '?') cores"
    mkdir -p "$(dirname "$json")"
    {
        printf '{\n  "command": "%s",\n  "machine": "%s",\n  "figures": [\n' \
            "${command//[\"\\]/}" "${machine//[\"\\]/}"
        for ((i = 0; i < ${#figures[@]}; i++)); do
            printf '%s%s\n' "${figures[i]}" "$([[ $i -lt $((${#figures[@]} - 1)) ]] && echo ,)"
        done
        printf '  ]\n}\n'
    } >"$json.tmp"
    mv "$json.tmp" "$json"
    echo "figures written to $json" >&2
fi
