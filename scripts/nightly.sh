#!/usr/bin/env bash
# The nightly job: the CPU benchmarks (scripts/bench.sh, on a machine not yet busy with the
# suites), their figures written to OUT/bench.json; then every suite of every tier (the CI suites,
# the nightly ones and the negative controls) on every device present, with memory traces, the
# benchmarks' figures put in its summary.json; the report rendered in headless Chromium (a
# screenshot; fails at 2 MB or more; the time it took to lay out is printed, not judged), the
# traces read by PyTorch's _memory_viz and a checkpoint of every model family loaded by Hugging
# Face transformers (scripts/check_hf_families.sh) where python3 has torch and transformers
# (.ci/run installs scripts/requirements-ci.txt); then mutation testing of the code that decides
# verdicts and state (scripts/mutants.sh: hours, so never in CI).
#
#   scripts/nightly.sh [--tier ci|nightly|all] [--baseline SUMMARY] [--fail-on-regression]
#                      [--no-bench] [--no-mutants] [OUT]
#
# OUT (default report/nightly) gets summary.json, index.html (+ index.png), junit.xml, memory/,
# bench.json and the logs, the mutants' in OUT/mutants. --baseline names last night's
# summary.json: what changed is at the top of the report, a benchmark figure down more than 10%
# among the regressions. CI runs `--tier ci --no-bench --no-mutants`, then the nightly tier's CPU
# suites by themselves.
#
# Exit status: 1 if a trial failed (or regressed, with --fail-on-regression), the report did
# not render, torch could not read a trace, transformers did not give a family's loss, a
# benchmark could not run, or a surviving mutant is
# not explained in docs/TESTING.md; 2 for bad input.
set -euo pipefail
cd "$(dirname "$0")/.."
tier=all bench=1 mutants=1 out=report/nightly run_args=()
while [[ $# -gt 0 ]]; do
    case "$1" in
    --tier) tier="$2" && shift ;;
    --baseline) run_args+=(--baseline "$2") && shift ;;
    --fail-on-regression) run_args+=(--fail-on-regression) ;;
    --no-bench) bench=0 ;;
    --no-mutants) mutants=0 ;;
    -*)
        echo "nightly.sh: unknown option $1" >&2
        exit 2
        ;;
    *) out="$1" ;;
    esac
    shift
done
mkdir -p "$out"

cargo build --release --locked -p ckpt-harness
status=0
rm -f "$out/bench.json"
if [[ $bench == 1 ]]; then
    scripts/bench.sh --rounds 3 --json "$out/bench.json" 2>&1 | tee "$out/bench.log" || status=1
fi
if [[ -f "$out/bench.json" ]]; then
    run_args+=(--bench "$out/bench.json")
fi
target/release/ckpt-harness run suites --tier "$tier" --device auto --memory-trace \
    --report "$out" --junit "$out/junit.xml" "${run_args[@]}" 2>&1 | tee "$out/suites.log" ||
    status=$?
[[ $status == 2 ]] && exit 2

if command -v chromium >/dev/null || command -v chromium-browser >/dev/null ||
    command -v google-chrome >/dev/null || [[ -n "${CHROMIUM:-}" ]]; then
    scripts/render_report.sh "$out" >"$out/render.json" || status=1
    layout_ms=$(sed -n 's/.*"layout_ms":\([0-9]*\).*/\1/p' "$out/render.json")
    echo "nightly: $out/index.html laid out in ${layout_ms:-?} ms in headless Chromium (a figure, not a gate: $out/render.json)"
else
    echo "nightly: no Chromium on PATH; $out/index.html was not rendered (apt-get install chromium)"
fi
scripts/memory_viz.sh "$out/memory" 2>&1 | tee "$out/memory_viz.log" || status=1
if python3 -c "import torch, transformers, safetensors" >/dev/null 2>&1; then
    scripts/check_hf_families.sh target/release/ckpt-harness "$out/hf-check" 2>&1 |
        tee "$out/hf-check.log" || status=1
else
    echo "nightly: python3 cannot import torch, transformers and safetensors; the Hugging Face load check did not run"
fi

if [[ $mutants == 1 ]]; then
    scripts/mutants.sh "$out/mutants" 2>&1 | tee "$out/mutants.log" || status=1
fi

echo "nightly: $([[ $status == 0 ]] && echo passed || echo FAILED); report in $out/index.html"
exit "$status"
