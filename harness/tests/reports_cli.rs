//! The reports from the command line: `run` writes index.html and every step into summary.json,
//! `run --memory-trace` writes PyTorch snapshots that read back, `diff` and `run --baseline` say
//! what changed, and `report merge` puts a run split over machines back together.

// Each test binary uses part of what the tests share.
#[allow(dead_code)]
mod common;

use common::{first_difference, without_timings};
use serde::Deserialize;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

const BIN: &str = env!("CARGO_BIN_EXE_ckpt-harness");

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn harness(args: &[&str]) -> Output {
    Command::new(BIN)
        .args(args)
        .current_dir(root())
        .env_remove("CI")
        .output()
        .unwrap()
}

fn text(out: &Output) -> String {
    format!(
        "{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

fn json(file: &Path) -> serde_json::Value {
    serde_json::from_slice(&std::fs::read(file).unwrap()).unwrap()
}

fn recorded(name: &str) -> String {
    root()
        .join(format!("harness/tests/data/recorded/{name}.json"))
        .display()
        .to_string()
}

/// `run --device cpu` of `suites` with its report in `dir`, and `extra` arguments.
fn run(dir: &Path, suites: &[&str], extra: &[&str]) -> Output {
    let mut args = vec!["run", "--device", "cpu", "--report", dir.to_str().unwrap()];
    args.extend(extra);
    args.extend(suites);
    harness(&args)
}

#[test]
fn run_writes_index_html_and_every_step_into_the_summary() {
    let dir = tempfile::tempdir().unwrap();
    let out = run(dir.path(), &["suites/tiny-fp32.yaml"], &[]);
    assert!(out.status.success(), "{}", text(&out));
    let page = std::fs::read_to_string(dir.path().join("index.html")).unwrap();
    assert!(page.contains("data-trial=\"cpu::tiny-fp32\""), "{page}");
    assert_eq!(page.matches("<figure class=\"plot").count(), 3);
    let summary = json(&dir.path().join("summary.json"));
    let phases = summary["trials"][0]["record"]["phases"].as_array().unwrap();
    assert_eq!(phases.len(), 3);
    let step = &phases[0]["steps"][3];
    assert_eq!(step["step"], 3);
    for key in ["loss", "lr", "grad_norm", "seconds"] {
        assert!(step[key].as_f64().is_some(), "{key}: {step}");
    }
    let peak = step["memory"]["allocated"]["peak"].as_u64().unwrap();
    let at_peak: u64 = [
        "params",
        "grads",
        "optimizer",
        "activations",
        "workspace",
        "io",
    ]
    .iter()
    .map(|c| step["memory"]["at_peak"][c].as_u64().unwrap())
    .sum();
    assert_eq!(peak, at_peak, "the peak's bytes per category: {step}");
}

/// The parts of PyTorch's snapshot the test reads.
#[derive(Deserialize)]
struct Snapshot {
    segments: Vec<Segment>,
    device_traces: Vec<Vec<Entry>>,
}

#[derive(Deserialize)]
struct Segment {
    total_size: u64,
    blocks: Vec<Block>,
}

#[derive(Deserialize)]
struct Block {
    size: u64,
    state: String,
}

#[derive(Deserialize)]
struct Entry {
    action: String,
    addr: u64,
    size: u64,
    category: String,
    frames: Vec<Frame>,
}

#[derive(Deserialize)]
struct Frame {
    filename: String,
    name: String,
}

#[test]
fn a_memory_trace_reads_back_as_a_pytorch_snapshot_of_every_allocation_and_free() {
    let dir = tempfile::tempdir().unwrap();
    let out = run(dir.path(), &["suites/tiny-fp32.yaml"], &["--memory-trace"]);
    assert!(out.status.success(), "{}", text(&out));
    let summary = json(&dir.path().join("summary.json"));
    let page = std::fs::read_to_string(dir.path().join("index.html")).unwrap();
    for (i, phase) in ["reference", "resume-mid", "resume-end"].iter().enumerate() {
        let file = dir
            .path()
            .join(format!("memory/cpu.tiny-fp32/{phase}.pickle"));
        assert!(page.contains(&format!("href=\"memory/cpu.tiny-fp32/{phase}.pickle\"")));
        let snap: Snapshot =
            serde_pickle::from_reader(std::fs::File::open(&file).unwrap(), Default::default())
                .unwrap();
        let trace = &snap.device_traces[0];
        let (mut held, mut peak) = (0u64, 0u64);
        let mut live: Vec<(u64, u64)> = Vec::new();
        let mut markers = Vec::new();
        for e in trace {
            match e.action.as_str() {
                "alloc" => {
                    let end = e.addr + e.size.max(1);
                    assert!(
                        live.iter().all(|&(a, b)| end <= a || e.addr >= b),
                        "{phase}: allocations overlap at {}",
                        e.addr
                    );
                    live.push((e.addr, end));
                    held += e.size;
                    peak = peak.max(held);
                    assert_ne!(e.category, "unknown");
                }
                "free_completed" => {
                    let at = live.iter().position(|&(a, _)| a == e.addr);
                    live.remove(at.unwrap_or_else(|| panic!("{phase}: a free of nothing")));
                    held -= e.size;
                }
                "snapshot" => markers.push(e.frames.last().unwrap().name.clone()),
                "free_requested" => {}
                other => panic!("{phase}: action {other}"),
            }
        }
        assert_eq!(held, 0, "{phase}: every byte given back");
        let record = &summary["trials"][0]["record"]["phases"][i];
        let measured = record["steps"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| s["memory"]["allocated"]["peak"].as_u64().unwrap())
            .chain([record["setup"]["peak"].as_u64().unwrap()])
            .max()
            .unwrap();
        assert_eq!(peak, measured, "{phase}: the trace's peak is the run's");
        let first = record["steps"][0]["step"].as_u64().unwrap();
        assert_eq!(markers[0], format!("{phase} step {first}"), "{markers:?}");
        assert_eq!(
            markers.last().unwrap(),
            &format!("{phase}: dropping the trainer")
        );
        let engine_frame = trace.iter().any(|e| {
            e.frames.iter().any(|f| {
                f.filename.starts_with("engine/src/model/") && f.name.contains("ckpt_engine::model")
            })
        });
        assert!(
            engine_frame,
            "{phase}: the frames name the model's functions"
        );
        for category in ["params", "grads", "activations"] {
            assert!(
                trace.iter().any(|e| e.category == category),
                "{phase}: {category}"
            );
        }
        let seg = &snap.segments[0];
        assert_eq!(
            seg.blocks.iter().map(|b| b.size).sum::<u64>(),
            seg.total_size
        );
        assert!(seg.blocks.iter().all(|b| b.state == "inactive"));
    }
}

#[test]
fn diff_names_each_regression_and_exits_1() {
    let out = harness(&["diff", &recorded("passing"), &recorded("regressed")]);
    let all = text(&out);
    assert_eq!(out.status.code(), Some(1), "{all}");
    assert!(all.contains(": 3 regressions, 3 changes"), "{all}");
    assert!(
        all.contains("REGRESSION: cpu::tiny-fp32 step peak up: resume-end step 10 peak: 1.1 MiB -> 1.1 MiB (+5.1%)"),
        "{all}"
    );
    assert!(
        all.contains("REGRESSION: cpu::tiny-fp32 newly failing: golden: passed -> failed"),
        "{all}"
    );
    assert!(
        all.contains("REGRESSION: cpu::tiny-fp32 loss moved: reference loss from step 0"),
        "{all}"
    );
    let same = harness(&["diff", &recorded("passing"), &recorded("passing")]);
    assert_eq!(same.status.code(), Some(0), "{}", text(&same));
    assert!(text(&same).contains(": 0 regressions, 0 changes"));
    let bad = harness(&["diff", &recorded("passing"), "suites/tiny-fp32.yaml"]);
    assert_eq!(bad.status.code(), Some(2), "{}", text(&bad));
    assert!(
        text(&bad).contains("suites/tiny-fp32.yaml:1:1: not a summary"),
        "{}",
        text(&bad)
    );
}

#[test]
fn a_run_against_a_baseline_says_what_changed_and_fails_on_regression_when_asked() {
    let dir = tempfile::tempdir().unwrap();
    let baseline = recorded("regressed");
    let out = run(
        dir.path(),
        &["suites/tiny-fp32.yaml"],
        &["--baseline", &baseline],
    );
    let all = text(&out);
    assert_eq!(
        out.status.code(),
        Some(0),
        "regressions alone do not fail the run: {all}"
    );
    assert!(
        all.contains("REGRESSION: cpu::tiny-fp32 loss moved"),
        "{all}"
    );
    assert!(
        all.contains("change: cpu::tiny-fp32 newly passing"),
        "{all}"
    );
    let summary = json(&dir.path().join("summary.json"));
    let kinds: Vec<&str> = summary["trends"]["changes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["kind"].as_str().unwrap())
        .collect();
    assert!(kinds.contains(&"loss_moved"), "{kinds:?}");
    let page = std::fs::read_to_string(dir.path().join("index.html")).unwrap();
    assert!(page.find("<td>loss moved</td>").unwrap() < page.find("data-trial=").unwrap());
    let out = run(
        dir.path(),
        &["suites/tiny-fp32.yaml"],
        &["--baseline", &baseline, "--fail-on-regression"],
    );
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
}

#[test]
fn merging_two_partitions_gives_the_report_of_the_whole_run() {
    let dir = tempfile::tempdir().unwrap();
    let at = |name: &str| dir.path().join(name);
    let suites = [
        "suites/tiny-fp32.yaml",
        "suites/faults/moments_not_saved.yaml",
    ];
    assert!(run(&at("whole"), &suites, &[]).status.success());
    assert!(run(&at("part1"), &suites[1..], &[]).status.success());
    assert!(run(&at("part2"), &suites[..1], &[]).status.success());
    let junit = at("merged/junit.xml");
    let out = harness(&[
        "report",
        "merge",
        at("part1").to_str().unwrap(),
        at("part2").to_str().unwrap(),
        "--out",
        at("merged").to_str().unwrap(),
        "--junit",
        junit.to_str().unwrap(),
    ]);
    assert!(out.status.success(), "{}", text(&out));
    assert!(text(&out).contains("2 passed, 0 failed"), "{}", text(&out));
    let (mut whole, mut merged) = (
        json(&at("whole/summary.json")),
        json(&at("merged/summary.json")),
    );
    without_timings(&mut whole);
    without_timings(&mut merged);
    assert!(
        whole == merged,
        "{}",
        first_difference(&whole, &merged, String::new())
    );
    let order = |file: PathBuf| {
        let page = std::fs::read_to_string(file).unwrap();
        page.split("data-trial=\"")
            .skip(1)
            .map(|s| s.split('"').next().unwrap().to_string())
            .collect::<Vec<_>>()
    };
    assert_eq!(
        order(at("whole/index.html")),
        order(at("merged/index.html"))
    );
    assert_eq!(
        order(at("merged/index.html")),
        ["cpu::tiny-fp32", "cpu::faults::moments_not_saved"]
    );
    assert!(std::fs::read_to_string(junit)
        .unwrap()
        .contains("name=\"cpu::faults::moments_not_saved\""));
    let twice = harness(&[
        "report",
        "merge",
        at("part1").to_str().unwrap(),
        at("whole").to_str().unwrap(),
        "--out",
        at("bad").to_str().unwrap(),
    ]);
    assert_eq!(twice.status.code(), Some(2), "{}", text(&twice));
    assert!(
        text(&twice).contains("trial cpu::faults::moments_not_saved is also in"),
        "{}",
        text(&twice)
    );
}

#[test]
fn a_report_that_cannot_be_written_whole_leaves_the_previous_one() {
    let dir = tempfile::tempdir().unwrap();
    let (part, out) = (dir.path().join("part"), dir.path().join("out"));
    std::fs::create_dir_all(&part).unwrap();
    std::fs::create_dir_all(&out).unwrap();
    std::fs::copy(recorded("passing"), part.join("summary.json")).unwrap();
    let baseline = std::fs::read(recorded("regressed")).unwrap();
    std::fs::write(out.join("summary.json"), &baseline).unwrap();
    // A disk that fills after 4 KiB: writes past it fail (SIGXFSZ ignored, as a full disk's
    // ENOSPC would).
    let merge = Command::new("sh")
        .args([
            "-c",
            "trap '' XFSZ; exec prlimit --fsize=4096 -- \"$@\"",
            "sh",
        ])
        .args([BIN, "report", "merge", part.to_str().unwrap()])
        .args(["--out", out.to_str().unwrap()])
        .output()
        .unwrap();
    assert_eq!(merge.status.code(), Some(2), "{}", text(&merge));
    assert!(
        text(&merge).contains("summary.json: cannot write"),
        "{}",
        text(&merge)
    );
    assert!(
        std::fs::read(out.join("summary.json")).unwrap() == baseline,
        "the previous summary was damaged"
    );
    let names: Vec<String> = std::fs::read_dir(&out)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(names, ["summary.json"]);
}

#[test]
fn terminal_escapes_read_from_a_summary_are_printed_as_escapes() {
    let dir = tempfile::tempdir().unwrap();
    let part = dir.path().join("part");
    std::fs::create_dir_all(&part).unwrap();
    let mut summary = json(Path::new(&recorded("failing-negative-control")));
    summary["trials"][0]["verdict"] = "\u{1b}[2J\u{1b}]0;TITLE\u{7}".into();
    let file = part.join("summary.json");
    std::fs::write(&file, serde_json::to_vec(&summary).unwrap()).unwrap();
    let out_dir = dir.path().join("merged");
    let merged = harness(&[
        "report",
        "merge",
        part.to_str().unwrap(),
        "--out",
        out_dir.to_str().unwrap(),
    ]);
    let diff = harness(&["diff", &recorded("passing"), file.to_str().unwrap()]);
    for out in [merged, diff] {
        let all = text(&out);
        assert!(
            !all.contains(['\u{1b}', '\u{7}']),
            "raw control characters printed: {all:?}"
        );
        assert!(all.contains("\\u{1b}[2J\\u{1b}]0;TITLE\\u{7}"), "{all}");
    }
}

#[test]
fn a_merged_trial_passes_only_by_its_checks_not_by_its_own_word() {
    type Edit = fn(&mut serde_json::Value);
    let edits: [(&str, Edit); 3] = [
        ("failed: loss_continuity", |t| {
            t["checks"][0]["status"] = "failed".into()
        }),
        ("no check outcomes recorded", |t| {
            t["checks"] = serde_json::json!([])
        }),
        ("no run recorded", |t| {
            t["record"]["phases"] = serde_json::json!([])
        }),
    ];
    for (why, edit) in edits {
        let dir = tempfile::tempdir().unwrap();
        let part = dir.path().join("part");
        std::fs::create_dir_all(&part).unwrap();
        let mut summary = json(Path::new(&recorded("passing")));
        assert_eq!(
            summary["trials"][0]["checks"][0]["check"],
            "loss_continuity"
        );
        edit(&mut summary["trials"][0]);
        assert_eq!(summary["trials"][0]["passed"], true);
        std::fs::write(
            part.join("summary.json"),
            serde_json::to_vec(&summary).unwrap(),
        )
        .unwrap();
        let out_dir = dir.path().join("merged");
        let out = harness(&[
            "report",
            "merge",
            part.to_str().unwrap(),
            "--out",
            out_dir.to_str().unwrap(),
        ]);
        let all = text(&out);
        assert_eq!(out.status.code(), Some(1), "{why}: {all}");
        assert!(all.contains("0 passed, 1 failed"), "{why}: {all}");
        assert!(all.contains(why), "{why}: {all}");
        let merged = json(&out_dir.join("summary.json"));
        assert_eq!(merged["trials"][0]["passed"], false, "{why}");
    }
}

/// The figures `scripts/bench.sh --json` writes, with `load` as the checkpoint load's GB/s.
fn figures(load: f64) -> serde_json::Value {
    serde_json::json!({
        "command": "scripts/bench.sh --rounds 3",
        "machine": "a test machine, 2 cores",
        "figures": [
            {"name": "training, engine (fp32, 2 threads)", "unit": "tokens/s", "value": 4506.0},
            {"name": "checkpoint load", "unit": "GB/s", "value": load},
            {"name": "streaming read", "unit": "GB/s", "value": 17.6, "reference": true}
        ]
    })
}

/// `recorded(name)` with `bench` as its figures, written into `dir`.
fn with_figures(dir: &Path, name: &str, bench: serde_json::Value) -> String {
    let mut summary = json(Path::new(&recorded("passing")));
    summary["bench"] = bench;
    let file = dir.join(name);
    std::fs::write(&file, serde_json::to_vec(&summary).unwrap()).unwrap();
    file.display().to_string()
}

#[test]
fn diff_flags_a_benchmark_figure_down_more_than_10_percent_against_a_doctored_baseline() {
    let dir = tempfile::tempdir().unwrap();
    let now = with_figures(dir.path(), "now.json", figures(1.37));
    let doctored = with_figures(dir.path(), "doctored.json", figures(1.37 * 1.2));
    let out = harness(&["diff", &doctored, &now]);
    let all = text(&out);
    assert_eq!(out.status.code(), Some(1), "{all}");
    assert!(all.contains(": 1 regressions, 1 changes"), "{all}");
    assert!(
        all.contains(
            "REGRESSION: benchmarks figure down: checkpoint load: 1.64 GB/s -> 1.37 GB/s (-16.7%)"
        ),
        "{all}"
    );
    let near = with_figures(dir.path(), "near.json", figures(1.37 * 1.05));
    let out = harness(&["diff", &near, &now]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    assert!(text(&out).contains(": 0 regressions, 0 changes"));
    let out = harness(&["diff", &recorded("passing"), &now]);
    let all = text(&out);
    assert_eq!(out.status.code(), Some(0), "{all}");
    assert!(
        all.contains("change: benchmarks figure not compared: figures: not measured -> 2 measured"),
        "{all}"
    );
}

#[test]
fn a_run_with_bench_figures_keeps_them_and_fails_on_a_figure_down_when_asked() {
    let dir = tempfile::tempdir().unwrap();
    let bench = dir.path().join("bench.json");
    std::fs::write(&bench, serde_json::to_vec(&figures(1.37)).unwrap()).unwrap();
    let doctored = with_figures(dir.path(), "doctored.json", figures(2.0));
    let report = dir.path().join("report");
    let out = run(
        &report,
        &["suites/tiny-fp32.yaml"],
        &[
            "--bench",
            bench.to_str().unwrap(),
            "--baseline",
            &doctored,
            "--fail-on-regression",
        ],
    );
    let all = text(&out);
    assert_eq!(out.status.code(), Some(1), "{all}");
    assert!(
        all.contains(
            "REGRESSION: benchmarks figure down: checkpoint load: 2.00 GB/s -> 1.37 GB/s (-31.5%)"
        ),
        "{all}"
    );
    let summary = json(&report.join("summary.json"));
    assert_eq!(summary["bench"], figures(1.37));
    let kinds: Vec<&str> = summary["trends"]["changes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["kind"].as_str().unwrap())
        .collect();
    assert!(kinds.contains(&"figure_down"), "{kinds:?}");
    let page = std::fs::read_to_string(report.join("index.html")).unwrap();
    let table = page
        .find("<section id=\"benchmarks\">")
        .expect("no benchmarks section");
    assert!(page.find("<td>figure down</td>").unwrap() < table);
    assert!(table < page.find("data-trial=").unwrap());
    assert!(
        page.contains("<td>checkpoint load</td><td class=\"num\">1.37 GB/s</td>"),
        "{page}"
    );
    assert!(page.contains("streaming read <span class=\"note\">(reference)</span>"));

    let merged = dir.path().join("merged");
    let out = harness(&[
        "report",
        "merge",
        report.to_str().unwrap(),
        "--out",
        merged.to_str().unwrap(),
    ]);
    assert!(out.status.success(), "{}", text(&out));
    assert_eq!(json(&merged.join("summary.json"))["bench"], figures(1.37));
    std::fs::write(&bench, serde_json::to_vec(&figures(3.0)).unwrap()).unwrap();
    let out = harness(&[
        "report",
        "merge",
        report.to_str().unwrap(),
        "--bench",
        bench.to_str().unwrap(),
        "--out",
        merged.to_str().unwrap(),
    ]);
    assert!(out.status.success(), "{}", text(&out));
    assert_eq!(json(&merged.join("summary.json"))["bench"], figures(3.0));

    std::fs::write(&bench, "{\"figures\": []}").unwrap();
    let out = run(
        &dir.path().join("bad"),
        &["suites/tiny-fp32.yaml"],
        &["--bench", bench.to_str().unwrap()],
    );
    let all = text(&out);
    assert_eq!(out.status.code(), Some(2), "{all}");
    assert!(
        all.contains(
            "bench.json: figures: no figure; give the file `scripts/bench.sh --json FILE` wrote"
        ),
        "{all}"
    );
}
