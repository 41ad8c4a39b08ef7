//! Which job runs what: mutation testing (`scripts/mutants.sh`, hours of rebuilds) is part of the
//! nightly job and of nothing CI runs; CI runs every tier's CPU suites, and the suites that judge
//! other trainers; the nightly job's summary carries its benchmarks' figures, and its workflow
//! runs the CPU suites under the FMA kernels too, as CI replays the frozen checkpoints.

use std::path::{Path, PathBuf};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The lines of `script` that run something: neither blank nor comments.
fn commands(script: &str) -> Vec<String> {
    let text = std::fs::read_to_string(root().join(script)).unwrap();
    text.lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .map(String::from)
        .collect()
}

#[test]
fn the_nightly_job_runs_the_mutants_and_ci_does_not() {
    let runs_mutants = |script: &str| {
        commands(script)
            .iter()
            .any(|l| l.contains("scripts/mutants.sh"))
    };
    assert!(runs_mutants("scripts/nightly.sh"));
    let ci = commands(".ci/run");
    assert!(ci.iter().any(|l| l == "scripts/test.sh"), "{ci:?}");
    for script in [".ci/run", "scripts/test.sh"] {
        assert!(!runs_mutants(script), "{script} runs the mutants");
        let cargo_mutants = commands(script)
            .iter()
            .any(|l| l.contains("cargo mutants") || l.contains("cargo-mutants"));
        assert!(!cargo_mutants, "{script} runs cargo-mutants");
    }
}

/// CI installs PyTorch and transformers and runs the nightly job's CI tier with them, whose
/// script loads a checkpoint of every family in transformers: the check cannot be skipped there.
#[test]
fn ci_loads_every_family_s_checkpoint_in_transformers() {
    let ci = commands(".ci/run");
    assert!(
        ci.iter()
            .any(|l| l.contains("pip install") && l.contains("scripts/requirements-ci.txt")),
        "{ci:?}"
    );
    assert!(
        ci.iter()
            .any(|l| l.contains("ci-python/bin:$PATH") && l.contains("scripts/nightly.sh")),
        "{ci:?}"
    );
    let nightly = commands("scripts/nightly.sh");
    assert!(
        nightly
            .iter()
            .any(|l| l.starts_with("scripts/check_hf_families.sh")),
        "{nightly:?}"
    );
    let requirements = std::fs::read_to_string(root().join("scripts/requirements-ci.txt")).unwrap();
    for package in ["torch==", "transformers==", "safetensors=="] {
        assert!(requirements.contains(package), "{package} is not pinned");
    }
}

/// CI runs the nightly tier's CPU suites (the nightly job's CI tier covers the others), so their
/// snapshots are checked on every change, not only where the nightly job runs.
#[test]
fn ci_runs_the_nightly_tier_s_cpu_suites() {
    let ci = commands(".ci/run");
    assert!(
        ci.iter()
            .any(|l| l.starts_with("target/release/ckpt-harness run suites")
                && l.contains("--tier nightly")
                && l.contains("--device cpu")),
        "{ci:?}"
    );
    let nightly = ci.iter().position(|l| l.contains("scripts/nightly.sh"));
    let tier = ci.iter().position(|l| l.contains("--tier nightly"));
    assert!(
        nightly.is_some() && nightly < tier,
        "after scripts/nightly.sh, which builds the release CLI: {ci:?}"
    );
}

/// CI installs the Python recorder from the checkout and runs its tests once scripts/nightly.sh
/// has built the release CLI, whose records they validate (the binary named by `CKPT_HARNESS`),
/// with the packages they need pinned.
#[test]
fn ci_runs_the_python_recorder_s_tests_against_the_release_cli() {
    let ci = commands(".ci/run");
    let at = |pred: &dyn Fn(&str) -> bool| ci.iter().position(|l| pred(l));
    let nightly = at(&|l| l.contains("scripts/nightly.sh"));
    let install = at(&|l| l.contains("pip install") && l.contains("./harness/python"));
    let binary = at(&|l| l.starts_with("CKPT_HARNESS=\"$PWD/target/release/ckpt-harness\""));
    let pytest = at(&|l| l.contains("-m pytest") && l.contains("harness/python"));
    assert!(
        nightly.is_some() && nightly < install && install < binary && binary < pytest,
        "{ci:?}"
    );
    let requirements = std::fs::read_to_string(root().join("scripts/requirements-ci.txt")).unwrap();
    for package in ["accelerate==", "jsonschema==", "pytest=="] {
        assert!(requirements.contains(package), "{package} is not pinned");
    }
}

/// CI runs the suites that judge another trainer (`harness/python/suites`, each phase a Python
/// command writing its record) once the recorder is installed, with the environment that has it
/// first on the PATH; and those suites hold negative controls.
#[test]
fn ci_judges_the_pytorch_trainers_suites_with_the_recorder_installed() {
    let ci = commands(".ci/run");
    let at = |pred: &dyn Fn(&str) -> bool| ci.iter().position(|l| pred(l));
    let install = at(&|l| l.contains("pip install") && l.contains("./harness/python"));
    let suites = at(&|l| {
        l.contains("ci-python/bin:$PATH") && l.contains("ckpt-harness run harness/python/suites")
    });
    assert!(install.is_some() && install < suites, "{ci:?}");
    let controls = std::fs::read_dir(root().join("harness/python/suites/faults"))
        .unwrap()
        .filter(|e| {
            let text = std::fs::read_to_string(e.as_ref().unwrap().path()).unwrap();
            text.contains("expect_fail:") && text.contains("--fault ")
        })
        .count();
    assert!(controls >= 3, "{controls} negative controls");
}

/// The nightly job measures the benchmarks first, each night afresh (last night's figures file
/// removed), and gives their figures to the run, whose summary.json and trends then hold them.
#[test]
fn the_nightly_job_puts_its_benchmarks_figures_in_its_summary() {
    let nightly = commands("scripts/nightly.sh");
    let at = |pred: &dyn Fn(&str) -> bool| nightly.iter().position(|l| pred(l));
    let removed = at(&|l| l == "rm -f \"$out/bench.json\"");
    let bench =
        at(&|l| l.starts_with("scripts/bench.sh") && l.contains("--json \"$out/bench.json\""));
    let given = at(&|l| l == "run_args+=(--bench \"$out/bench.json\")");
    let run = at(&|l| l.starts_with("target/release/ckpt-harness run suites"));
    assert!(
        removed.is_some() && removed < bench && bench < given && given < run,
        "{nightly:?}"
    );
    let continued = nightly[run.unwrap()..]
        .iter()
        .take_while(|l| l.ends_with('\\'))
        .count();
    let run_command = nightly[run.unwrap()..=run.unwrap() + continued].join(" ");
    assert!(run_command.contains("\"${run_args[@]}\""), "{run_command}");
}

/// CI compiles the CUDA kernels with the NVRTC its Python environment brings, and runs that
/// trial even where it would be ignored, so a missing NVRTC fails CI instead of skipping it.
#[test]
fn ci_compiles_the_cuda_kernels_with_nvrtc() {
    let ci = commands(".ci/run");
    let compile = ci
        .iter()
        .position(|l| l.contains("cargo test -p ckpt-engine --test cuda"))
        .unwrap_or_else(|| panic!("CI does not run the CUDA test binary: {ci:?}"));
    let call = ci[compile..=compile + 1].join(" ");
    for part in [
        "LD_LIBRARY_PATH=",
        "nvrtc_compiles_the_kernels",
        "--include-ignored",
    ] {
        assert!(call.contains(part), "{part} missing from {call}");
    }
    let venv = ci
        .iter()
        .position(|l| l.contains("scripts/requirements-ci.txt"))
        .unwrap();
    assert!(
        venv < compile,
        "NVRTC is compiled with before it is installed"
    );
    let requirements = std::fs::read_to_string(root().join("scripts/requirements-ci.txt")).unwrap();
    assert!(
        requirements.contains("nvidia-cuda-nvrtc=="),
        "NVRTC is not pinned"
    );
}

/// The nightly workflow fails on a regression, against the last night that passed: a
/// regression neither turns green by itself the next night nor passes as a drift of nights each
/// under the threshold after a red one.
#[test]
fn the_nightly_workflow_fails_on_a_regression_against_the_last_green_night() {
    let workflow = commands(".github/workflows/nightly.yml");
    let line = |part: &str| workflow.iter().position(|l| l.contains(part));
    let listed = line("gh run list").unwrap_or_else(|| panic!("{workflow:?}"));
    let listing = workflow[listed..(listed + 3).min(workflow.len())].join(" ");
    assert!(listing.contains("--status success"), "{listing}");
    let args = line("args=(").map(|i| &workflow[i]);
    assert!(
        args.is_some_and(|l| l.contains("--fail-on-regression")),
        "{args:?}"
    );
    let nightly = line("scripts/nightly.sh \"${args[@]}\"");
    assert!(nightly > line("args=("), "{workflow:?}");
}

#[test]
fn the_nightly_workflow_runs_every_cpu_suite_with_the_fma_kernels_too() {
    let workflow = commands(".github/workflows/nightly.yml");
    let line = |part: &str| workflow.iter().position(|l| l.contains(part));
    let build = line("--no-default-features").map(|i| &workflow[i]);
    assert!(
        build.is_some_and(|l| l.contains("cargo build") && l.contains("--target-dir target/fma")),
        "{workflow:?}"
    );
    let run = line("target/fma/release/ckpt-harness run suites --tier all --device cpu");
    assert!(run > line("--no-default-features"), "{workflow:?}");
    let manifest = std::fs::read_to_string(root().join("engine/Cargo.toml")).unwrap();
    assert!(
        manifest.contains("default = [\"avx512\"]")
            && manifest.contains("avx512 = [\"gemm/x86-v4\"]"),
        "the engine's AVX-512 kernels are a default feature the FMA build leaves out"
    );
}

/// Where CI's CPU has AVX-512, CI replays the frozen checkpoints under the FMA kernels as well,
/// so a checkpoint whose steps differ there and that lacks their record (`losses.x86_64-fma.json`)
/// fails CI, not the first resume on a CPU without AVX-512.
#[test]
fn ci_replays_the_frozen_checkpoints_with_the_fma_kernels_too() {
    let ci = commands(".ci/run");
    let replay = ci
        .iter()
        .position(|l| {
            l.starts_with("cargo test -p ckpt-harness --no-default-features")
                && l.ends_with("--test golden_checkpoints")
        })
        .unwrap_or_else(|| panic!("CI does not replay them with the FMA kernels: {ci:?}"));
    assert_eq!(
        ci[replay - 1],
        "if grep -qw avx512f /proc/cpuinfo; then",
        "only where the tests before ran the AVX-512 kernels"
    );
    let tests = ci.iter().position(|l| l == "scripts/test.sh");
    assert!(tests.is_some() && tests < Some(replay), "{ci:?}");
}
