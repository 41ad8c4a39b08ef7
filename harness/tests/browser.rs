//! The report as a person sees it: `scripts/render_report.sh` opens `index.html` in headless
//! Chromium, saves a screenshot and reads the page's structure from the rendered DOM. Needs
//! Chromium (`scripts/test.sh` installs it); without one the test fails, naming the fix. The
//! page's size is a gate; the time it took to lay out is a figure the script prints, never one.

use ckpt_harness::checks::Check;
use std::path::{Path, PathBuf};
use std::process::Command;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

#[test]
fn the_rendered_page_shows_every_trial_every_plot_the_failures_and_the_changes_first() {
    let dir = tempfile::tempdir().unwrap();
    let faults = dir.path().join("faults");
    std::fs::create_dir(&faults).unwrap();
    let control = std::fs::read_to_string(root().join("suites/faults/moments_not_saved.yaml"))
        .unwrap()
        .replace(
            "expect_fail: [loss_continuity, state_digest, checkpoint_equivalence]",
            "expect_fail: [state_digest]",
        );
    assert!(control.contains("expect_fail: [state_digest]"), "{control}");
    std::fs::write(faults.join("moments_not_saved.yaml"), control).unwrap();
    let report = dir.path().join("report");
    let baseline = root().join("harness/tests/data/recorded/regressed.json");
    let out = Command::new(env!("CARGO_BIN_EXE_ckpt-harness"))
        .args(["run", "--device", "cpu", "--report"])
        .arg(&report)
        .arg("--baseline")
        .arg(&baseline)
        .arg(root().join("suites/tiny-fp32.yaml"))
        .arg(faults.join("moments_not_saved.yaml"))
        .current_dir(root())
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1), "the control fails: {out:?}");

    let png = dir.path().join("page.png");
    let rendered = Command::new(root().join("scripts/render_report.sh"))
        .arg(&report)
        .arg(&png)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&rendered.stderr);
    assert!(rendered.status.success(), "{stderr}");
    let page: serde_json::Value = serde_json::from_slice(&rendered.stdout).unwrap();
    assert!(
        std::fs::metadata(&png).unwrap().len() > 10_000,
        "a screenshot of the page"
    );

    let trials = page["trials"].as_array().unwrap();
    let names: Vec<&str> = trials.iter().map(|t| t["name"].as_str().unwrap()).collect();
    assert_eq!(names, ["cpu::tiny-fp32", "cpu::faults::moments_not_saved"]);
    for t in trials {
        let kinds: Vec<&str> = t["plots"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| {
                assert!(p["width"].as_u64().unwrap() >= 600, "{p}");
                assert!(p["height"].as_u64().unwrap() >= 150, "{p}");
                p["kind"].as_str().unwrap()
            })
            .collect();
        assert_eq!(kinds, ["loss", "memory", "time"], "{t}");
        assert_eq!(
            t["checks"].as_array().unwrap().len(),
            Check::ALL.len(),
            "{t}"
        );
    }
    assert_eq!(trials[0]["verdict"], "PASS");
    let control = &trials[1];
    assert_eq!(control["verdict"], "FAIL");
    let shown: Vec<&str> = control["failures"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| f.as_str().unwrap())
        .collect();
    let summary: serde_json::Value =
        serde_json::from_slice(&std::fs::read(report.join("summary.json")).unwrap()).unwrap();
    let digest = &summary["trials"][1]["checks"][1]["failures"][0];
    let (expected, actual) = (
        digest["expected"].as_str().unwrap(),
        digest["actual"].as_str().unwrap(),
    );
    assert!(
        shown
            .iter()
            .any(|line| line.contains(expected) && line.contains(actual)),
        "{expected} against {actual} in {shown:?}"
    );
    assert!(
        control["plots"][0]["caption"]
            .as_str()
            .unwrap()
            .contains("first divergence at resume-mid step"),
        "{control}"
    );
    assert_eq!(page["changes_first"], true, "{page}");
    let regressions = page["regressions"].as_array().unwrap();
    assert!(
        regressions
            .iter()
            .any(|r| r.as_str().unwrap().contains("loss moved")),
        "{regressions:?}"
    );
    assert!(page["layout_ms"].as_u64().is_some(), "{page}");
    assert!(page["bytes"].as_u64().unwrap() < 2 * 1024 * 1024, "{page}");
}

/// Runs `scripts/render_report.sh` over a directory whose `index.html` is `html`.
fn render(html: &str) -> (std::process::Output, serde_json::Value) {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("index.html"), html).unwrap();
    let out = Command::new(root().join("scripts/render_report.sh"))
        .arg(dir.path())
        .output()
        .unwrap();
    let page = serde_json::from_slice(&out.stdout).unwrap_or_default();
    (out, page)
}

/// The least the probe reads: the changes' section, `extra` before it, and `</body>` on a line
/// of its own (the script puts its probe before that line).
fn page_with(extra: &str) -> String {
    format!(
        "<!doctype html><html><head><title>t</title></head><body>\n{extra}<section id=\"changes\"></section>\n</body></html>\n"
    )
}

#[test]
fn a_page_slow_to_lay_out_is_reported_with_its_time_and_a_page_of_2_mb_fails() {
    // A script that keeps the page from finishing for 1.2 s: a slow moment of a busy machine.
    let busy =
        "<script>const t0 = performance.now(); while (performance.now() - t0 < 1200) {}</script>";
    let (out, page) = render(&page_with(busy));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "a slow layout is no failure: {stderr}"
    );
    let layout_ms = page["layout_ms"].as_u64().unwrap();
    assert!(layout_ms >= 1200, "{page}");
    assert!(
        stderr.contains(&format!("laid out in {layout_ms} ms")),
        "{stderr}"
    );

    let padding = format!("<!--{}-->", "x".repeat(2 * 1024 * 1024));
    let (out, page) = render(&page_with(&padding));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("2 MB or more"), "{stderr}");
    assert!(page["bytes"].as_u64().unwrap() >= 2 * 1024 * 1024, "{page}");
}
