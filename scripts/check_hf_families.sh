#!/usr/bin/env bash
# Hugging Face transformers loads a checkpoint of every family the engine trains and computes the
# engine's loss on it: `train` writes the checkpoint of each family suite, `eval` gives the
# engine's loss on a random batch (for a MoE model its cross-entropy and load-balancing loss too),
# scripts/check_hf_load.py loads the checkpoint with AutoModelForCausalLM and compares, within
# a relative 1e-5 (and, as a negative control, must fail against the engine's loss off by ten
# times the tolerance). A checkpoint saved by several ranks (a file per rank and an index) is
# first consolidated by `export`, and the export is what transformers loads, within 1e-6.
# Needs python3 with torch, transformers and safetensors.
#
#     scripts/check_hf_families.sh BIN OUT [SUITE...]
#
# BIN is the ckpt-harness binary; OUT collects the checkpoints and hf-check.log; the suites
# default to every suites/family-*.yaml, tiny-fp32, the bf16-mixed gqa-bf16-ac and the 4-rank
# parallel-resharded (its checkpoint sharded).
set -euo pipefail
cd "$(dirname "$0")/.."
bin="$1" out="$2"
shift 2
suites=("$@")
[[ ${#suites[@]} -gt 0 ]] ||
    suites=(suites/family-*.yaml suites/tiny-fp32.yaml suites/gqa-bf16-ac.yaml suites/parallel-resharded.yaml)
mkdir -p "$out"
status=0
for suite in "${suites[@]}"; do
    name="$(basename "$suite" .yaml)"
    run_dir="$out/$name"
    rm -rf "$run_dir"
    "$bin" train "$suite" --out "$run_dir" >/dev/null
    ckpt="$(ls -d "$run_dir"/step-* | tail -1)"
    rtol=() off_by=1e-4
    if [[ -f "$ckpt/shards.json" ]]; then
        "$bin" export "$ckpt" --out "$run_dir/exported" >/dev/null
        ckpt="$run_dir/exported"
        rtol=(--rtol 1e-6) off_by=1e-5
        echo "$name: a sharded checkpoint, exported" | tee -a "$out/hf-check.log"
    fi
    python3 scripts/make_batch.py "$ckpt/config.json" "$run_dir/batch.safetensors"
    engine="$("$bin" eval --model "$ckpt" --batch "$run_dir/batch.safetensors")"
    python3 scripts/check_hf_load.py "$ckpt" "$run_dir/batch.safetensors" "$engine" "${rtol[@]}" 2>&1 |
        tee -a "$out/hf-check.log" || status=1
    # The negative control: the same comparison against the engine's loss off by ten times the
    # tolerance must fail.
    off="$(python3 -c 'import json, sys; d = json.loads(sys.argv[1]); d["loss"] *= 1 + float(sys.argv[2]); print(json.dumps(d))' "$engine" "$off_by")"
    if python3 scripts/check_hf_load.py "$ckpt" "$run_dir/batch.safetensors" "$off" "${rtol[@]}" >/dev/null 2>&1; then
        echo "$name: a loss off by $off_by passed the transformers comparison" | tee -a "$out/hf-check.log"
        status=1
    else
        echo "$name: the comparison fails against a loss off by $off_by, as it should" | tee -a "$out/hf-check.log"
    fi
done
exit "$status"
