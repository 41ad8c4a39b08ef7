#!/usr/bin/env bash
# Mutation testing of the code that decides verdicts and state, with cargo-mutants (nightly, not
# CI: every mutant is a rebuild and a test run). Each area's mutants are tested by the tests that
# can see them:
#
#   checks      harness/src/checks/*.rs   the harness's unit tests
#   optim       engine/src/optim.rs       the engine's unit, training, fault and determinism tests
#   data        engine/src/data/          the same, and the text data's and transformers' token tests
#   checkpoint  engine/src/checkpoint/    the engine's unit and fault tests and the harness's
#                                         checkpoint and frozen-checkpoint tests
#
#   scripts/mutants.sh [OUT [AREA...]]    OUT defaults to report/mutants, AREA to all four
#
# Writes OUT/<area>/mutants.out/ (cargo-mutants' own output: caught.txt, missed.txt, timeout.txt,
# unviable.txt, outcomes.json), OUT/survivors.txt (every missed or timed-out mutant as
# `file: mutation`, without line numbers), OUT/unexplained.txt (the survivors docs/TESTING.md
# does not list with a reason) and OUT/summary.txt (the counts and wall time of every area
# run into OUT, one line each, also in OUT/<area>/summary.txt).
# Exit status 1 if a survivor is unexplained or an area could not run. One job at a time, with
# light optimisation and no debug information: mutants rebuild faster, tests stay quick.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-report/mutants}"
shift || true
areas=("$@")
[[ ${#areas[@]} -gt 0 ]] || areas=(checks optim data checkpoint)
command -v cargo-mutants >/dev/null || cargo install cargo-mutants --locked
mkdir -p "$out"

# Only the test targets named are built and run (--cargo-arg reaches `cargo test` when it builds
# and when it runs).
engine_tests=(--test-package ckpt-engine --cargo-arg=--lib --cargo-arg=--test=training
    --cargo-arg=--test=faults --cargo-arg=--test=determinism)
args_for() {
    case "$1" in
        checks) args=(-p ckpt-harness -f 'harness/src/checks/*.rs' --cargo-arg=--lib) ;;
        optim) args=(-f engine/src/optim.rs "${engine_tests[@]}") ;;
        data) args=(-f 'engine/src/data/*.rs' -f 'engine/src/data/text/*.rs' -f engine/src/validation.rs
            "${engine_tests[@]}" --cargo-arg=--test=text_data --cargo-arg=--test=transformers_tokens
            --cargo-arg=--test=validation) ;;
        checkpoint)
            # cargo-mutants names only the mutated package; --package adds the harness's tests.
            args=(-f 'engine/src/checkpoint/*.rs' --test-package ckpt-engine --cargo-arg=--package=ckpt-harness
                --cargo-arg=--lib --cargo-arg=--test=checkpoint --cargo-arg=--test=retention
                --cargo-arg=--test=golden_checkpoints --cargo-arg=--test=faults)
            ;;
        *)
            echo "mutants: unknown area $1 (checks, optim, data, checkpoint)" >&2
            exit 2
            ;;
    esac
}

export CARGO_PROFILE_TEST_OPT_LEVEL=1 CARGO_PROFILE_TEST_DEBUG=0 CARGO_PROFILE_DEV_DEBUG=0
status=0
for area in "${areas[@]}"; do
    args_for "$area"
    started=$SECONDS
    rc=0
    cargo mutants --jobs 1 --timeout-multiplier 3 --output "$out/$area" "${args[@]}" || rc=$?
    # 0: every mutant caught; 2: some missed; 3: some timed out; anything else: it did not run.
    [[ $rc == 0 || $rc == 2 || $rc == 3 ]] || status=1
    dir="$out/$area/mutants.out"
    count() { [[ -f "$dir/$1.txt" ]] && wc -l <"$dir/$1.txt" || echo 0; }
    echo "$area: caught $(count caught), missed $(count missed), timeouts $(count timeout), unviable $(count unviable), $((SECONDS - started)) s" |
        tee "$out/$area/summary.txt"
done
# Every area run into OUT so far, this run's and earlier ones'.
cat "$out"/*/summary.txt >"$out/summary.txt"

cat "$out"/*/mutants.out/missed.txt "$out"/*/mutants.out/timeout.txt 2>/dev/null |
    sed -E 's/:[0-9]+:[0-9]+:/:/' | sort -u >"$out/survivors.txt"
: >"$out/unexplained.txt"
while IFS= read -r survivor; do
    grep -qF -- "$survivor" docs/TESTING.md || echo "$survivor" >>"$out/unexplained.txt"
done <"$out/survivors.txt"
echo "mutants: $(wc -l <"$out/survivors.txt") survivors, $(wc -l <"$out/unexplained.txt") not explained in docs/TESTING.md (listed in $out/unexplained.txt)"
[[ -s "$out/unexplained.txt" ]] && status=1
exit "$status"
