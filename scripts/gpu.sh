#!/usr/bin/env bash
# Runs the GPU half of the project on a machine with an NVIDIA GPU but no Rust toolchain.
#
#   scripts/gpu.sh pack DIR        on the build machine: release-builds the CLI and the test
#                                  binaries and copies them, with suites/, golden/ and scripts/,
#                                  into DIR (copy DIR to the GPU machine)
#   DIR/scripts/gpu.sh run [OUT]   on the GPU machine: the CUDA tests, every suite on cuda, and
#                                  the Hugging Face load check; report, JUnit and logs in OUT
#                                  (default DIR/report-gpu)
#
# `run` finds CUDA's libraries through the loader's path; when the toolkit sits in
# /usr/local/cuda (or $CUDA_HOME) its lib64 is added. Exit status: 0 when everything passed.
set -euo pipefail

usage() {
    sed -n '2,12p' "$0" >&2
    exit 2
}

pack() {
    local dir="$1"
    cd "$(dirname "$0")/.."
    cargo build --release --locked -p ckpt-harness
    mkdir -p "$dir/bin"
    cp target/release/ckpt-harness "$dir/bin/"
    # The test binaries with GPU trials, named after their targets.
    cargo test --release --locked -p ckpt-engine --test cuda -p ckpt-harness --test suites \
        --no-run --message-format=json 2>/dev/null |
        python3 -c '
import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["profile"]["test"]:
        print(m["target"]["name"], m["executable"])
' | while read -r name exe; do
        cp "$exe" "$dir/bin/test-$name"
    done
    rm -rf "$dir/suites" "$dir/golden" "$dir/scripts"
    cp -r suites golden scripts "$dir/"
    strip "$dir"/bin/* 2>/dev/null || true
    echo "packed into $dir: $(ls "$dir/bin" | tr '\n' ' ')"
}

run() {
    local root out status=0
    root="$(cd "$(dirname "$0")/.." && pwd)"
    out="${1:-$root/report-gpu}"
    mkdir -p "$out"
    local cuda="${CUDA_HOME:-/usr/local/cuda}"
    if [[ -d "$cuda/lib64" ]]; then
        export LD_LIBRARY_PATH="$cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    fi
    export CKPT_REPO_ROOT="$root" CKPT_GOLDEN_DIR="$root/golden"
    cd "$root"
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"

    for t in bin/test-*; do
        echo "== $t"
        "$t" --test-threads 1 2>&1 | tee "$out/$(basename "$t").log" || status=1
    done

    echo "== suites on cuda"
    bin/ckpt-harness run suites --device cuda --report "$out" --junit "$out/junit.xml" 2>&1 |
        tee "$out/suites.log" || status=1

    if python3 -c "import torch, transformers" 2>/dev/null; then
        echo "== Hugging Face transformers loads a checkpoint"
        local run_dir="$out/hf-check"
        rm -rf "$run_dir"
        bin/ckpt-harness train suites/tiny-fp32.yaml --out "$run_dir" >/dev/null
        local ckpt
        ckpt="$(ls -d "$run_dir"/step-* | tail -1)"
        python3 scripts/make_batch.py "$ckpt/config.json" "$run_dir/batch.safetensors"
        local loss
        loss="$(bin/ckpt-harness eval --model "$ckpt" --batch "$run_dir/batch.safetensors" |
            python3 -c 'import json, sys; print(json.load(sys.stdin)["loss"])')"
        python3 scripts/check_hf_load.py "$ckpt" "$run_dir/batch.safetensors" "$loss" 2>&1 |
            tee "$out/hf-check.log" || status=1
    else
        echo "== Hugging Face check skipped: python3 cannot import torch and transformers"
    fi
    echo "gpu.sh: $([[ $status == 0 ]] && echo passed || echo FAILED); report in $out"
    return "$status"
}

case "${1:-}" in
pack) [[ $# == 2 ]] || usage; pack "$2" ;;
run) shift; run "$@" ;;
*) usage ;;
esac
