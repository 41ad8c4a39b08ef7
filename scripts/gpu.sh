#!/usr/bin/env bash
# Runs the GPU half of the project on a machine with an NVIDIA GPU but no Rust toolchain.
#
#   scripts/gpu.sh pack DIR          on the build machine: release-builds the CLI, the CUDA test
#                                    binary and the training benchmark and copies them, with
#                                    suites/, golden/, scripts/ and the Python recorder with its
#                                    suites, into DIR (copy DIR to the GPU machine)
#   DIR/scripts/gpu.sh run [OUT]     on the GPU machine: the CUDA tests (again with the tiled
#                                    attention kernels), the CI tier's suites and negative
#                                    controls on cuda, and the Hugging Face load check; report,
#                                    JUnit and logs in OUT (default DIR/report-gpu)
#   DIR/scripts/gpu.sh nightly [OUT] the nightly tier on cuda (the 1B suites save and digest
#                                    13 GB states: minutes each), then the PyTorch trainers'
#                                    suites with their models on the GPU
#   DIR/scripts/gpu.sh bench [OUT]   the engine's training step at Llama-3.2-1B's shape
#                                    (bf16-mixed, chunked loss) and PyTorch's reference on the
#                                    same card, one after the other, with full checkpointing,
#                                    without, and at sequence 8192; tokens/s, peak memory and MFU
#                                    of both, and their ratios; then the engine with the tiled
#                                    attention kernels
#   DIR/scripts/gpu.sh profile [OUT] one step of that shape cut to 2 layers under Nsight Compute:
#                                    each kernel's time, summed by kernel, in OUT/profile.txt
#   DIR/scripts/gpu.sh lease [OUT]   for a card lent for minutes: the CUDA tests with each
#                                    attention kernel, the CI tier on cuda with --bless (its
#                                    checks and negative controls, and this GPU's snapshots,
#                                    copied to OUT/golden-cuda), then the nightly tier's 1B
#                                    suites on cuda one after another (their checkpoints in
#                                    /dev/shm where it has 48 GiB free) while the PyTorch trainers'
#                                    suites and negative controls run on the GPU beside them, a
#                                    process each; everything ends by $LEASE_SECONDS (default
#                                    540) after the start, with a line a step in
#                                    OUT/timeline.txt (seconds since the start, exit status)
#
# On an H200 (2026-11-26) `run` took about 45 s (the first NVRTC compile 25 s of it, cached in
# $CKPT_HARNESS_CACHE after) besides the Hugging Face check, `bench` with BENCH_STEPS=3
# BENCH_WARMUP=1 170 s and `profile` 10 s; on an H100 the same day 50 s, 154 s and 9 s. In
# `nightly` the PyTorch trainers' suites run one trial after another, about 45 s a Hugging Face
# Trainer trial and 30 s a plain-loop one there: some 7 minutes for the ten. `lease` on an H200
# (2026-11-26): the CUDA tests 52 s with both kernels, the CI tier 21 s, the ten trainers' trials
# side by side 64 s, `long-batch-cuda` 284 s; a 1B suite takes about 5 minutes. Again on an H200
# (2026-11-27), its checkpoints in /dev/shm: the CUDA tests 42 s with both kernels, the CI tier
# 27 s, the trainers' trials 57 s, `tied-1b-cuda` 272 s and, alone, `llama-1b-cuda` 240 s.
#
# The scripts find CUDA's libraries through the loader's path; when the toolkit sits in
# /usr/local/cuda (or $CUDA_HOME) its lib64 and bin are added. Exit status: 0 when everything
# passed.
set -euo pipefail

usage() {
    sed -n '2,41p' "$0" >&2
    exit 2
}

pack() {
    local dir="$1"
    cd "$(dirname "$0")/.."
    cargo build --release --locked -p ckpt-harness
    mkdir -p "$dir/bin"
    cp target/release/ckpt-harness "$dir/bin/"
    # The test binaries with GPU trials, named after their targets.
    cargo test --release --locked -p ckpt-engine --test cuda --no-run --message-format=json 2>/dev/null |
        python3 -c '
import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["profile"]["test"]:
        print(m["target"]["name"], m["executable"])
' | while read -r name exe; do
        cp "$exe" "$dir/bin/test-$name"
    done
    cargo bench --locked -p ckpt-engine --bench train_step --no-run --message-format=json 2>/dev/null |
        python3 -c '
import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == "train_step":
        print(m["executable"])
' | while read -r exe; do
        cp "$exe" "$dir/bin/bench-train_step"
    done
    rm -rf "$dir/suites" "$dir/golden" "$dir/scripts" "$dir/python"
    cp -r suites golden scripts "$dir/"
    mkdir -p "$dir/python"
    cp -r harness/python/src harness/python/examples harness/python/suites "$dir/python/"
    strip "$dir"/bin/* 2>/dev/null || true
    echo "packed into $dir: $(ls "$dir/bin" | tr '\n' ' ')"
}

# Puts the CUDA toolkit's lib64 ($CUDA_HOME, default /usr/local/cuda) on the loader's path and
# its bin (ncu) on the path; then, after everything else on the loader's path, the NCCL that
# PyTorch's wheels bring, where the toolkit has none.
cuda_libraries() {
    local cuda="${CUDA_HOME:-/usr/local/cuda}" nccl
    if [[ -d "$cuda/lib64" ]]; then
        export LD_LIBRARY_PATH="$cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    fi
    if nccl=$(python3 -c 'import nvidia.nccl as n; print(list(n.__path__)[0] + "/lib")' 2>/dev/null); then
        export LD_LIBRARY_PATH="${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}$nccl"
    fi
    [[ -d "$cuda/bin" ]] && export PATH="$PATH:$cuda/bin"
    return 0
}

run() {
    local root out status=0
    root="$(cd "$(dirname "$0")/.." && pwd)"
    out="${1:-$root/report-gpu}"
    mkdir -p "$out"
    cuda_libraries
    export CKPT_REPO_ROOT="$root" CKPT_GOLDEN_DIR="$root/golden"
    cd "$root"
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"

    echo "== bin/test-cuda"
    bin/test-cuda --test-threads 1 2>&1 | tee "$out/test-cuda.log" || status=1
    echo "== bin/test-cuda with the tiled attention kernels in place of the tensor-core ones"
    CKPT_CUDA_ATTENTION=tiled bin/test-cuda --test-threads 1 2>&1 | tee "$out/test-cuda-tiled.log" || status=1

    echo "== suites on cuda"
    bin/ckpt-harness run suites --device cuda --report "$out" --junit "$out/junit.xml" 2>&1 |
        tee "$out/suites.log" || status=1

    if python3 -c "import torch, transformers" 2>/dev/null; then
        echo "== Hugging Face transformers loads a checkpoint of every family"
        scripts/check_hf_families.sh bin/ckpt-harness "$out/hf-check" || status=1
    else
        echo "== Hugging Face check skipped: python3 cannot import torch and transformers"
    fi
    echo "gpu.sh: $([[ $status == 0 ]] && echo passed || echo FAILED); report in $out"
    return "$status"
}

nightly() {
    local root out status=0
    root="$(cd "$(dirname "$0")/.." && pwd)"
    out="${1:-$root/report-gpu}"
    mkdir -p "$out"
    cuda_libraries
    cd "$root"
    echo "== the nightly tier on cuda"
    bin/ckpt-harness run suites --device cuda --tier nightly --report "$out/nightly" \
        --junit "$out/nightly-junit.xml" 2>&1 | tee "$out/nightly.log" || status=1
    echo "== the PyTorch trainers' suites, their models on the GPU"
    CKPT_EXAMPLE_DEVICE=cuda PYTHONPATH="$root/python/src${PYTHONPATH:+:$PYTHONPATH}" \
        bin/ckpt-harness run python/suites --report "$out/python" --junit "$out/python-junit.xml" 2>&1 |
        tee "$out/python.log" || status=1
    echo "gpu.sh nightly: $([[ $status == 0 ]] && echo passed || echo FAILED); report in $out"
    return "$status"
}

profile() {
    local root out
    root="$(cd "$(dirname "$0")/.." && pwd)"
    out="${1:-$root/report-gpu}"
    mkdir -p "$out"
    cuda_libraries
    cd "$root"
    ncu --clock-control none --metrics gpu__time_duration.sum --csv --print-units base \
        bin/bench-train_step --device cuda --model llama-1b --layers 2 --precision bf16-mixed \
        --checkpointing full --loss chunked:1024 --steps 1 --warmup 0 >"$out/profile.csv"
    python3 - "$out/profile.csv" <<'PY' | tee "$out/profile.txt"
import csv, sys
from collections import defaultdict
total, calls = defaultdict(float), defaultdict(int)
for row in csv.reader(open(sys.argv[1])):
    if len(row) >= 15 and row[0].isdigit():
        name = row[4].split("(")[0]
        total[name] += float(row[14].replace(",", ""))
        calls[name] += 1
whole = sum(total.values())
print(f"{len(total)} kernels, {sum(calls.values())} launches, {whole / 1e6:.2f} ms")
for name, ns in sorted(total.items(), key=lambda kv: -kv[1]):
    print(f"{ns / 1e6:9.3f} ms {100 * ns / whole:5.1f}% {calls[name]:5d}  {name}")
PY
}

# Runs "$@" under a limit of $1 seconds with its output in $out/$name.log, where name is $2
# and the command the rest; adds a line to $out/timeline.txt. Fails as the command did.
step() {
    local limit="$1" name="$2" rc=0
    shift 2
    timeout "$limit" "$@" >"$out/$name.log" 2>&1 || rc=$?
    echo "[$((SECONDS - started))s] $name: exit $rc$([[ $rc == 124 ]] && echo " (past its $limit s)")" |
        tee -a "$out/timeline.txt"
    return "$rc"
}

lease() {
    local root status=0 deadline left suite name file
    root="$(cd "$(dirname "$0")/.." && pwd)"
    out="${1:-$root/report-gpu}"
    mkdir -p "$out"
    rm -f "$out/timeline.txt"
    cuda_libraries
    export CKPT_REPO_ROOT="$root" CKPT_GOLDEN_DIR="$root/golden" PYTHONUNBUFFERED=1
    cd "$root"
    started=$SECONDS
    deadline=$((started + ${LEASE_SECONDS:-540}))
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt" ||
        status=1
    step 100 test-cuda bin/test-cuda --test-threads 1 || status=1
    step 40 test-cuda-tiled env CKPT_CUDA_ATTENTION=tiled bin/test-cuda --test-threads 1 || status=1
    step 120 suites bin/ckpt-harness run suites --device cuda --bless --report "$out/suites" \
        --junit "$out/suites/junit.xml" || status=1
    rm -rf "$out/golden-cuda" && cp -r golden/cuda "$out/golden-cuda"
    # Each trainer's trial in a process of its own: their memory figures are the process's own
    # (torch.cuda), so they neither see nor disturb the engine's beside them.
    local trainers=()
    for file in python/suites/*.yaml python/suites/faults/*.yaml; do
        name="trainer-$(basename "$file" .yaml)"
        step $((deadline - SECONDS)) "$name" env CKPT_EXAMPLE_DEVICE=cuda \
            PYTHONPATH="$root/python/src${PYTHONPATH:+:$PYTHONPATH}" \
            bin/ckpt-harness run "$file" --report "$out/trainers/$name" &
        trainers+=("$!")
    done
    # A 1B suite's checkpoints (two of 13 GB) go to memory where it has room: on an H200's disk
    # long-batch-cuda's reference spent 195 of its 204 s in its two saves (its steps 9 s). Each
    # suite gets a directory of its own, removed after it, also when its time limit stopped it.
    local scratch=/dev/shm avail tmp
    avail=$(df --output=avail -B1 /dev/shm 2>/dev/null | tail -n 1) || avail=0
    ((avail > 48 << 30)) || scratch="${TMPDIR:-/tmp}"
    echo "the 1B suites' checkpoints in $scratch" | tee -a "$out/timeline.txt"
    # Those that have not yet passed on a card first (long-batch-cuda, tied-1b-cuda and
    # llama-1b-cuda have passed on an H200).
    for suite in long-seq-8k-cuda tied-1b-cuda llama-1b-cuda long-batch-cuda; do
        left=$((deadline - SECONDS))
        if ((left < 30)); then
            echo "[$((SECONDS - started))s] nightly-$suite: not run, $left s left" | tee -a "$out/timeline.txt"
            continue
        fi
        tmp=$(mktemp -d "$scratch/ckpt-lease.XXXXXX")
        step "$left" "nightly-$suite" env TMPDIR="$tmp" bin/ckpt-harness run "suites/$suite.yaml" \
            --device cuda --report "$out/nightly/$suite" || status=1
        rm -rf "$tmp"
    done
    for pid in "${trainers[@]}"; do wait "$pid" || status=1; done
    echo "gpu.sh lease: $([[ $status == 0 ]] && echo passed || echo FAILED); logs in $out"
    return "$status"
}

# The first number after "key": in a line of JSON.
json_number() {
    sed -nE "s/.*\"$1\": *([-0-9.eE+]+).*/\1/p" <<<"$2" | head -n 1
}

# One configuration of the Llama-3.2-1B-shaped step on both sides: NAME, then the engine's
# options and PyTorch's, separated by `--`. Prints tokens/s, reserved peak and MFU of both and
# their ratios; the JSON of each side lands in $out/bench-NAME-{engine,torch}.json.
compare() {
    local name="$1" ours theirs
    shift
    local engine_args=() torch_args=()
    while [[ $# -gt 0 && "$1" != "--" ]]; do engine_args+=("$1") && shift; done
    [[ $# -gt 0 ]] && shift
    torch_args=("$@")
    echo "== $name: engine ${engine_args[*]}"
    if ! ours="$(bin/bench-train_step --device cuda --model llama-1b --precision bf16-mixed \
        --loss chunked:1024 --steps "$steps" --warmup "$warmup" "${engine_args[@]}" | tail -n 1)"; then
        echo "$name: the engine's benchmark failed" | tee -a "$out/bench-summary.txt"
        return 1
    fi
    echo "$ours" | tee "$out/bench-$name-engine.json"
    echo "== $name: PyTorch ${torch_args[*]}"
    if ! theirs="$(python3 scripts/bench_gpu_torch.py --steps "$steps" --warmup "$warmup" \
        "${torch_args[@]}" | tail -n 1)"; then
        echo "$name: PyTorch's benchmark failed" | tee -a "$out/bench-summary.txt"
        return 1
    fi
    echo "$theirs" | tee "$out/bench-$name-torch.json"
    awk -v name="$name" -v a="$(json_number tokens_per_s "$ours")" -v b="$(json_number tokens_per_s "$theirs")" \
        -v pa="$(json_number pool_reserved_high_bytes "$ours")" -v pb="$(json_number peak_reserved_bytes "$theirs")" \
        -v ma="$(json_number mfu "$ours")" -v mb="$(json_number mfu "$theirs")" 'BEGIN {
        printf "%s: tokens/s engine %.0f, pytorch %.0f: %.2fx (target >= 1.0x); ", name, a, b, a / b
        printf "reserved peak engine %.2f GiB, pytorch %.2f GiB: %.2fx (target <= 1.0x); ", pa / 2^30, pb / 2^30, pa / pb
        printf "MFU engine %.1f%%, pytorch %.1f%%\n", 100 * ma, 100 * mb
    }' | tee -a "$out/bench-summary.txt"
}

bench() {
    local root
    root="$(cd "$(dirname "$0")/.." && pwd)"
    out="${1:-$root/report-gpu}"
    mkdir -p "$out"
    rm -f "$out/bench-summary.txt"
    cuda_libraries
    cd "$root"
    steps="${BENCH_STEPS:-5}" warmup="${BENCH_WARMUP:-2}"
    local status=0 tiled
    compare full-checkpointing --checkpointing full || status=1
    compare no-checkpointing --checkpointing none -- --no-checkpointing || status=1
    compare seq-8192 --checkpointing full --batch 2 --seq 8192 -- --batch 2 --seq 8192 || status=1
    echo "== the engine with the tiled attention kernels in place of the tensor-core ones"
    if tiled="$(CKPT_CUDA_ATTENTION=tiled bin/bench-train_step --device cuda --model llama-1b \
        --precision bf16-mixed --checkpointing full --loss chunked:1024 --steps "$steps" \
        --warmup "$warmup" | tail -n 1)"; then
        echo "$tiled" | tee "$out/bench-tiled-engine.json"
        echo "tiled attention kernels, full checkpointing: $(json_number tokens_per_s "$tiled") tokens/s" |
            tee -a "$out/bench-summary.txt"
    else
        echo "the engine's benchmark with the tiled attention kernels failed" | tee -a "$out/bench-summary.txt"
        status=1
    fi
    return "$status"
}

case "${1:-}" in
pack) [[ $# == 2 ]] || usage; pack "$2" ;;
run) shift; run "$@" ;;
nightly) shift; nightly "$@" ;;
bench) shift; bench "$@" ;;
profile) shift; profile "$@" ;;
lease) shift; lease "$@" ;;
*) usage ;;
esac
