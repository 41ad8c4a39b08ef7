//! Ranks in processes of their own (`parallel: {processes: true}`) against the same ranks as
//! threads of one process: every data-parallel suite and negative control gives the same
//! verdict, the same outcome of every check and the same record, each rank's bytes of every
//! step included; and a rank that fails is named with what it printed.

use ckpt_harness::devices::DeviceKind;
use ckpt_harness::run::trial::{self, GoldenMode, TrialResult};
use ckpt_harness::suite::Suite;
use common::{first_difference, root, suites_in, without_timings};
use std::path::Path;
use std::process::Command;

// Each test binary uses part of what the tests share.
#[allow(dead_code)]
mod common;

/// `suite`'s file with `processes: true` in its `parallel`, written into `dir` (into
/// `dir/faults` for a negative control, so that its trial keeps its name), beside a link to the
/// `data/` directory beside it, where its suite's paths lead.
fn in_processes(suite: &Suite, dir: &Path) -> Suite {
    let text = std::fs::read_to_string(&suite.path).unwrap();
    let changed = text.replacen("\nparallel: {", "\nparallel: {processes: true, ", 1);
    assert_ne!(
        changed,
        text,
        "{}: write parallel as a flow mapping on a line of its own",
        suite.path.display()
    );
    let in_faults = suite.path.parent().and_then(Path::file_name) == Some("faults".as_ref());
    let dir = if in_faults {
        dir.join("faults")
    } else {
        dir.to_path_buf()
    };
    std::fs::create_dir_all(&dir).unwrap();
    let data = suite.path.parent().unwrap().join("data");
    if data.is_dir() && !dir.join("data").exists() {
        std::os::unix::fs::symlink(data.canonicalize().unwrap(), dir.join("data")).unwrap();
    }
    let path = dir.join(suite.path.file_name().unwrap());
    std::fs::write(&path, changed).unwrap();
    Suite::load(&path).unwrap()
}

/// The trial of `suite` on the CPU, judged against the project's snapshots.
fn trial(suite: &Suite) -> TrialResult {
    trial::run(
        suite,
        DeviceKind::Cpu,
        &root().join("golden"),
        GoldenMode::Check,
        &mut (),
    )
}

/// What a trial observed and concluded, but for what differs between two runs of it; for the
/// memory model's staging of an asynchronous save, which rank 0 does alone in one process and
/// each rank for its own rows in processes of their own; for the allocations a tracker has
/// counted since it opened (a phase on one rank counts on the device every phase before it
/// used in one process, and on a fresh one in a process of its own); and for the ranks'
/// figures of a phase that ran out of memory.
fn observed(t: &TrialResult) -> serde_json::Value {
    let outcomes: Vec<_> = t.checks.iter().map(|o| (o.check, o.status)).collect();
    let mut v = serde_json::json!({
        "passed": t.passed,
        "verdict": t.verdict,
        "outcomes": outcomes,
        "record": t.record,
    });
    without_timings(&mut v);
    for world in v["record"]["worlds"].as_array_mut().into_iter().flatten() {
        for rank in world["ranks"].as_array_mut().into_iter().flatten() {
            rank.as_object_mut().unwrap().remove("predicted_staging");
        }
    }
    for phase in v["record"]["phases"].as_array_mut().into_iter().flatten() {
        if !phase["oom"].is_null() {
            // Ranks in processes of their own: the others fail for want of the rank that ran out
            // of memory, and the phase is that rank's record alone.
            phase.as_object_mut().unwrap().remove("ranks");
        }
    }
    without_key(&mut v, "alloc_count");
    serde_json::from_str(&without_work_dirs(&v.to_string())).unwrap()
}

/// `text` with each trial's temporary work directory (`.tmp` and six characters, as tempfile
/// names them) written as `WORK`.
fn without_work_dirs(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(at) = rest.find("/.tmp") {
        out.push_str(&rest[..at]);
        out.push_str("/WORK");
        let after = &rest[at + "/.tmp".len()..];
        let name_end = after
            .char_indices()
            .find(|(_, c)| !c.is_ascii_alphanumeric())
            .map_or(after.len(), |(i, _)| i);
        rest = &after[name_end..];
    }
    out.push_str(rest);
    out
}

/// `v` without `key` wherever it is.
fn without_key(v: &mut serde_json::Value, key: &str) {
    match v {
        serde_json::Value::Object(map) => {
            map.remove(key);
            map.values_mut().for_each(|v| without_key(v, key));
        }
        serde_json::Value::Array(items) => items.iter_mut().for_each(|v| without_key(v, key)),
        _ => {}
    }
}

#[test]
fn every_parallel_suite_and_control_gives_in_processes_what_it_gives_in_threads() {
    let dir = tempfile::tempdir().unwrap();
    let suites: Vec<Suite> = [suites_in("suites"), suites_in("suites/faults")]
        .concat()
        .into_iter()
        .filter(|s| s.world_sizes().iter().any(|&w| w > 1) && !s.rank_processes())
        .filter(|s| s.file.devices.value.contains(&DeviceKind::Cpu))
        .collect();
    assert!(suites.len() >= 15, "{} data-parallel suites", suites.len());
    for suite in &suites {
        let threads = trial(suite);
        let processes = trial(&in_processes(suite, dir.path()));
        assert!(threads.passed, "{}: {}", threads.name, threads.verdict);
        assert!(
            processes.passed,
            "{}: {}",
            processes.name, processes.verdict
        );
        let (a, b) = (observed(&threads), observed(&processes));
        assert!(
            a == b,
            "{}: in processes, {}",
            threads.name,
            first_difference(&a, &b, String::new())
        );
    }
}

#[test]
fn the_processes_suite_records_each_rank_s_own_host_memory() {
    let suite = Suite::load(&root().join("suites/parallel-processes.yaml")).unwrap();
    assert!(suite.rank_processes());
    let t = trial(&suite);
    assert!(t.passed, "{}", t.verdict);
    for phase in &t.record.phases {
        let world = t.record.planned.iter().find(|p| p.phase == phase.phase);
        assert_eq!(Some(phase.ranks.len()), world.map(|p| p.world_size));
        for (rank, mine) in phase.ranks.iter().enumerate() {
            let host = mine.host.as_ref().expect("a rank's own host memory");
            assert!(
                host.peak_rss.is_some_and(|p| p > 0),
                "{} rank {rank}",
                phase.phase
            );
        }
    }
}

/// A program standing in for `ckpt-harness` whose rank 1 prints a line and exits 3 before it
/// meets the others; every other rank is the real one.
fn failing_rank_one(dir: &Path) -> std::path::PathBuf {
    use std::os::unix::fs::PermissionsExt;
    let script = dir.join("ckpt-harness-rank-1-fails");
    let real = env!("CARGO_BIN_EXE_ckpt-harness");
    std::fs::write(
        &script,
        format!(
            "#!/bin/sh\ncase \" $* \" in *\" --rank 1 \"*) echo 'rank 1 fell over' >&2; exit 3;; esac\nexec '{real}' \"$@\"\n"
        ),
    )
    .unwrap();
    std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).unwrap();
    script
}

#[test]
fn a_rank_that_fails_fails_the_trial_naming_it_and_what_it_printed() {
    let dir = tempfile::tempdir().unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_ckpt-harness"))
        .args(["run", "suites/parallel-processes.yaml", "--report"])
        .arg(dir.path().join("report"))
        .current_dir(root())
        .env("CKPT_HARNESS", failing_rank_one(dir.path()))
        .output()
        .unwrap();
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{text}");
    let summary: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.path().join("report/summary.json")).unwrap())
            .unwrap();
    let verdict = summary["trials"][0]["verdict"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(
        verdict.contains("phase reference on 4 ranks in processes of their own: rank 1 failed (exit status: 3): rank 1 fell over; rank 0 stopped 5 s after"),
        "{verdict}"
    );
}
