//! The report builder on recorded runs (`tests/data/recorded/`, the `summary.json` of real runs):
//! a passing run, a failing negative control (a fault suite expecting fewer failures than its
//! fault causes), and a regression (tiny-fp32 with a wider FFN and another learning rate)
//! against the passing run as its baseline.

use ckpt_harness::report::html;
use ckpt_harness::report::summary::Summary;
use ckpt_harness::report::trends::Trends;
use std::path::{Path, PathBuf};

fn recorded(name: &str) -> Summary {
    let file =
        Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("tests/data/recorded/{name}.json"));
    Summary::read(&file).unwrap()
}

/// The page of `summary`, with no memory traces to link.
fn page(summary: &Summary) -> String {
    html::render(summary, &PathBuf::from("no-such-report")).unwrap()
}

/// The section of trial `name` in `page`.
fn section<'a>(page: &'a str, name: &str) -> &'a str {
    let start = page
        .find(&format!("data-trial=\"{name}\""))
        .unwrap_or_else(|| panic!("no section for {name}"));
    let end = page[start..].find("</section>").unwrap() + start;
    &page[start..end]
}

#[test]
fn a_passing_run_shows_every_check_passed_and_every_plot() {
    let summary = recorded("passing");
    let page = page(&summary);
    assert!(page.contains("<title>ckpt-harness report: 1 passed, 0 failed</title>"));
    assert!(!page.contains("<script"), "the page needs no script");
    assert!(!page.contains("src="), "nothing loaded from elsewhere");
    assert!(!page.contains("href=\"http"), "no link off the page");
    let s = section(&page, "cpu::tiny-fp32");
    // The recorded summary's own checks (written before later checks existed).
    let checks = summary.trials[0].checks.len();
    assert!(checks >= 10, "{checks}");
    assert_eq!(s.matches("<tr class=\"check\">").count(), checks, "{s}");
    assert_eq!(s.matches("status-passed").count(), checks, "{s}");
    assert!(!s.contains("<tr class=\"failure\">"), "{s}");
    for plot in ["plot loss", "plot memory", "plot time"] {
        assert_eq!(
            s.matches(&format!("<figure class=\"{plot}\">\n<figcaption>"))
                .count(),
            1,
            "{plot}"
        );
    }
    assert_eq!(s.matches("<svg ").count(), 3);
    let steps: usize = summary.trials[0]
        .record
        .phases
        .iter()
        .map(|p| p.steps.len())
        .sum();
    assert_eq!(steps, 21, "the summary keeps every step");
    assert!(
        s.contains("<td>reference</td><td class=\"num\">11</td>"),
        "{s}"
    );
    assert!(
        s.contains("<td class=\"num\">4.07</td>"),
        "params' bytes per parameter: {s}"
    );
    assert!(page.contains("No baseline given"), "{page}");
}

#[test]
fn a_failing_negative_control_shows_each_failure_expected_against_actual() {
    let summary = recorded("failing-negative-control");
    let t = &summary.trials[0];
    assert!(!t.passed);
    let page = page(&summary);
    let s = section(&page, "cpu::faults::moments_not_saved");
    assert!(s.contains("<span class=\"badge fail\">FAIL</span>"), "{s}");
    assert!(s.contains("also failed: loss_continuity"), "{s}");
    let failures: Vec<_> = t.checks.iter().flat_map(|o| &o.failures).collect();
    let shown = s.matches("<tr class=\"failure\">").count();
    assert_eq!(
        shown,
        10 + 1 + 2,
        "ten of loss_continuity's, the line saying how many more, state_digest's two"
    );
    for f in failures.iter().filter(|f| f.step == Some(4)) {
        assert!(
            s.contains(&format!("<td>{}</td><td>{}</td>", f.expected, f.actual)),
            "{f}: {s}"
        );
    }
    let first = t.checks[0]
        .failures
        .iter()
        .map(|f| f.step.unwrap())
        .min()
        .unwrap();
    assert!(
        s.contains(&format!("first divergence at resume-mid step {first}")),
        "the loss plot marks the first divergent step: {s}"
    );
    assert!(
        s.contains(&format!("first divergence: resume-mid step {first}")),
        "in the plot's legend"
    );
}

#[test]
fn a_regression_against_a_baseline_is_said_at_the_top() {
    let baseline = recorded("passing");
    let mut now = recorded("regressed");
    let trends = Trends::new("last-night/summary.json", &baseline, &now);
    assert_eq!(trends.regressions(), 3, "{trends:?}");
    now.trends = Some(trends);
    let page = page(&now);
    let changes = page.find("id=\"changes\"").unwrap();
    let first_trial = page.find("data-trial=").unwrap();
    assert!(changes < first_trial, "the changes come before the trials");
    let top = &page[changes..first_trial];
    assert!(
        top.contains("<span class=\"fail\">3 regressions</span>"),
        "{top}"
    );
    for kind in ["newly failing", "step peak up", "loss moved"] {
        assert!(top.contains(&format!("<td>{kind}</td>")), "{kind}: {top}");
    }
    assert!(top.contains("resume-end step 10 peak"), "{top}");
    assert!(top.contains("(+5.1%)"), "{top}");
}

#[test]
fn a_recorded_summary_reads_back_as_it_was_written() {
    let dir = tempfile::tempdir().unwrap();
    for name in ["passing", "failing-negative-control", "regressed"] {
        let summary = recorded(name);
        summary.write_json(dir.path()).unwrap();
        let again = Summary::read(&dir.path().join("summary.json")).unwrap();
        assert_eq!(
            serde_json::to_value(&summary).unwrap(),
            serde_json::to_value(&again).unwrap(),
            "{name}"
        );
    }
}

#[test]
fn every_number_reads_back_bit_for_bit() {
    // Values family-mistral's run records, which a best-effort float parser reads one unit in
    // the last place off: a merged report would then differ from the whole run's.
    let lr = 0.0023250000000000002_f64;
    let grad_norm = 1.5078365134917961_f64;
    let mut summary = recorded("passing");
    let step = &mut summary.trials[0].record.phases[0].steps[4];
    (step.lr, step.grad_norm) = (lr, grad_norm);
    let dir = tempfile::tempdir().unwrap();
    summary.write_json(dir.path()).unwrap();
    let again = Summary::read(&dir.path().join("summary.json")).unwrap();
    let step = &again.trials[0].record.phases[0].steps[4];
    assert_eq!(step.lr.to_bits(), lr.to_bits(), "{} against {lr}", step.lr);
    assert_eq!(
        step.grad_norm.to_bits(),
        grad_norm.to_bits(),
        "{} against {grad_norm}",
        step.grad_norm
    );
}

#[test]
fn a_file_that_is_not_a_summary_is_refused_with_its_place() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("summary.json");
    std::fs::write(&file, "{\"passed\": 1,\n \"failed\": \"x\"}").unwrap();
    let e = Summary::read(&file).unwrap_err().to_string();
    assert!(e.starts_with(&format!("{}:2:", file.display())), "{e}");
    assert!(e.contains("give the summary.json a run wrote"), "{e}");
}
