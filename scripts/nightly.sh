#!/usr/bin/env bash
# The nightly job: every suite of every tier (the CI suites, the nightly ones and the negative
# controls) on every device present, then the CPU benchmarks, then mutation testing of the code
# that decides verdicts and state (scripts/mutants.sh: hours, so never in CI).
#
#   scripts/nightly.sh [OUT]     report, JUnit and logs in OUT (default report/nightly), the
#                                mutants' in OUT/mutants
#
# Exit status: 1 if a trial failed, a benchmark could not run, or a surviving mutant is not
# explained in docs/TESTING.md; 2 for bad input.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-report/nightly}"
mkdir -p "$out"

cargo build --release --locked -p ckpt-harness
status=0
target/release/ckpt-harness run suites --tier all --device auto \
    --report "$out" --junit "$out/junit.xml" 2>&1 | tee "$out/suites.log" || status=$?

scripts/bench.sh --rounds 3 2>&1 | tee "$out/bench.log" || status=1

scripts/mutants.sh "$out/mutants" 2>&1 | tee "$out/mutants.log" || status=1

echo "nightly: $([[ $status == 0 ]] && echo passed || echo FAILED); report in $out"
exit "$status"
