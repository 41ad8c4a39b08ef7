//! Progress while `run` runs. On a terminal, one bar per phase, advancing per step, left on the
//! screen as the phase's line when it ends. In logs (no terminal, or `CI` set), plain lines: one
//! when a phase ends, and while it runs one at most every [`LINE_INTERVAL`] with the step reached.
//! Never both.

use crate::checks::bytes;
use crate::record::{Phase, PhaseRecord, StepRecord};
use crate::run::phases::Watch;
use ckpt_engine::memory::MemoryTracker;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use std::ffi::OsStr;
use std::io::{self, Write};
use std::time::{Duration, Instant};

/// The least time between two plain lines of one phase.
pub const LINE_INTERVAL: Duration = Duration::from_secs(2);

/// How progress is shown.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Style {
    /// Bars redrawn in place.
    Bars,
    /// Plain lines at a steady rate.
    Lines,
}

impl Style {
    /// Bars when the output is a terminal and `CI` is unset or empty; lines otherwise.
    pub fn detect(terminal: bool, ci: Option<&OsStr>) -> Style {
        match (terminal, ci) {
            (true, None) => Style::Bars,
            (true, Some(v)) if v.is_empty() => Style::Bars,
            _ => Style::Lines,
        }
    }
}

/// The line a phase ends with: steps, last loss, peak, and an out-of-memory. On several ranks
/// the peak is the highest rank's, named with the world size.
pub fn phase_line(trial: &str, width: usize, ph: &PhaseRecord) -> String {
    let last = ph.steps.last();
    let (rank, peak) = highest_rank_peak(ph);
    let on_rank = match ph.ranks.len() {
        0 => String::new(),
        world => format!(" on rank {rank} of {world}"),
    };
    format!(
        "{trial:<width$} {:<10} {:>3} steps  last loss {:>9}  peak {}{on_rank}{}",
        ph.phase.to_string(),
        ph.steps.len(),
        last.map_or("-".into(), |s| format!("{:.5}", s.loss)),
        bytes(peak),
        ph.oom
            .as_ref()
            .map_or(String::new(), |e| format!("  OOM: {}", e.message)),
    )
}

/// The rank whose peak over `ph` (building its trainer and every step) is highest, the first
/// of those where several tie, and that peak; rank 0 on one device. A rank's figures are its
/// own where the record has them, the phase's (rank 0's) where it has none.
fn highest_rank_peak(ph: &PhaseRecord) -> (usize, u64) {
    let rank_peak = |r: usize| {
        let setup = ph
            .ranks
            .get(r)
            .map_or(ph.setup.peak, |mine| mine.setup.peak);
        let step = |s: &StepRecord| {
            s.ranks
                .get(r)
                .map_or(&s.memory, |mine| &mine.memory)
                .allocated
                .peak
        };
        ph.steps.iter().map(step).fold(setup, u64::max)
    };
    (0..ph.ranks.len().max(1))
        .map(|r| (r, rank_peak(r)))
        .fold((0, 0), |best, r| if r.1 > best.1 { r } else { best })
}

/// Makes the draw target of each new bar.
pub type Target = Box<dyn Fn() -> ProgressDrawTarget>;

/// Where progress goes for a whole run.
pub enum Reporter<W: Write> {
    /// Plain lines to `out`; the first failed write is kept and stops further lines.
    Lines {
        /// Where lines go.
        out: W,
        /// The first write that failed.
        failed: Option<io::Error>,
    },
    /// Bars drawn on the targets `target` makes.
    Bars {
        /// The draw target of each bar.
        target: Target,
    },
}

impl<W: Write> Reporter<W> {
    /// Plain lines to `out`.
    pub fn lines(out: W) -> Self {
        Reporter::Lines { out, failed: None }
    }

    /// The watch of one trial, named `trial`, padded to `width`.
    pub fn trial<'a>(&'a mut self, trial: &'a str, width: usize) -> TrialProgress<'a, W> {
        TrialProgress {
            reporter: self,
            trial,
            width,
            bar: None,
            last_line: Instant::now(),
            steps: 0,
            done: 0,
        }
    }

    /// The first write that failed, if one did (a closed pipe).
    pub fn take_error(&mut self) -> Option<io::Error> {
        match self {
            Reporter::Lines { failed, .. } => failed.take(),
            Reporter::Bars { .. } => None,
        }
    }

    fn line(&mut self, text: &str) {
        if let Reporter::Lines { out, failed } = self {
            if failed.is_none() {
                if let Err(e) = writeln!(out, "{text}") {
                    *failed = Some(e);
                }
            }
        }
    }
}

/// Progress of one trial: a [`Watch`] over its phases.
pub struct TrialProgress<'a, W: Write> {
    reporter: &'a mut Reporter<W>,
    trial: &'a str,
    width: usize,
    bar: Option<ProgressBar>,
    last_line: Instant,
    steps: u64,
    done: u64,
}

impl<W: Write> Watch for TrialProgress<'_, W> {
    fn phase_started(&mut self, phase: Phase, from: u64, end: u64, _tracker: &MemoryTracker) {
        self.steps = end.saturating_sub(from);
        self.done = 0;
        self.last_line = Instant::now();
        if let Reporter::Bars { target } = &*self.reporter {
            let bar = ProgressBar::with_draw_target(Some(self.steps), target());
            let running =
                ProgressStyle::with_template("{prefix} [{bar:30}] {pos:>3}/{len} steps  {msg}")
                    .map(|s| s.progress_chars("=> "))
                    .unwrap_or_else(|_| ProgressStyle::default_bar());
            bar.set_style(running);
            bar.set_prefix(format!(
                "{:<w$} {:<10}",
                self.trial,
                phase.to_string(),
                w = self.width
            ));
            bar.tick();
            self.bar = Some(bar);
        }
    }

    fn step_done(&mut self, phase: Phase, step: &StepRecord) {
        self.done += 1;
        if let Some(bar) = &self.bar {
            bar.set_message(format!("loss {:.5}", step.loss));
            bar.inc(1);
            return;
        }
        if self.last_line.elapsed() >= LINE_INTERVAL {
            self.last_line = Instant::now();
            let text = format!(
                "{:<w$} {:<10} step {} ({}/{})  loss {:.5}",
                self.trial,
                phase.to_string(),
                step.step,
                self.done,
                self.steps,
                step.loss,
                w = self.width
            );
            self.reporter.line(&text);
        }
    }

    fn phase_done(&mut self, record: &PhaseRecord, _tracker: &MemoryTracker) {
        let text = phase_line(self.trial, self.width, record);
        match self.bar.take() {
            Some(bar) => {
                bar.set_style(
                    ProgressStyle::with_template("{msg}")
                        .unwrap_or_else(|_| ProgressStyle::default_bar()),
                );
                bar.finish_with_message(text);
            }
            None => self.reporter.line(&text),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checks::fixtures;
    use indicatif::TermLike;
    use std::sync::{Arc, Mutex};

    #[test]
    fn bars_on_a_terminal_lines_in_logs_and_in_ci() {
        assert_eq!(Style::detect(true, None), Style::Bars);
        assert_eq!(Style::detect(true, Some(OsStr::new(""))), Style::Bars);
        assert_eq!(Style::detect(true, Some(OsStr::new("true"))), Style::Lines);
        assert_eq!(Style::detect(false, None), Style::Lines);
    }

    /// A terminal that keeps every line written to it.
    #[derive(Debug, Default, Clone)]
    struct Screen(Arc<Mutex<Vec<String>>>);

    impl TermLike for Screen {
        fn width(&self) -> u16 {
            120
        }
        fn move_cursor_up(&self, _: usize) -> io::Result<()> {
            Ok(())
        }
        fn move_cursor_down(&self, _: usize) -> io::Result<()> {
            Ok(())
        }
        fn move_cursor_right(&self, _: usize) -> io::Result<()> {
            Ok(())
        }
        fn move_cursor_left(&self, _: usize) -> io::Result<()> {
            Ok(())
        }
        fn write_line(&self, s: &str) -> io::Result<()> {
            self.0.lock().unwrap().push(s.to_string());
            Ok(())
        }
        fn write_str(&self, s: &str) -> io::Result<()> {
            self.write_line(s)
        }
        fn clear_line(&self) -> io::Result<()> {
            Ok(())
        }
        fn flush(&self) -> io::Result<()> {
            Ok(())
        }
    }

    /// Runs the fixture's reference phase through `reporter`'s watch.
    fn drive(reporter: &mut Reporter<&mut Vec<u8>>) {
        let run = fixtures::run();
        let tracker = MemoryTracker::unlimited();
        let mut watch = reporter.trial("cpu::s", 8);
        let phase = &run.phases[0];
        watch.phase_started(Phase::Reference, 0, 6, &tracker);
        for s in &phase.steps {
            watch.step_started(Phase::Reference, s.step);
            watch.step_done(Phase::Reference, s);
        }
        watch.phase_done(phase, &tracker);
    }

    #[test]
    fn a_bar_advances_per_step_and_ends_as_the_phase_line_with_no_plain_line() {
        let screen = Screen::default();
        let drawn = screen.clone();
        let target: Target =
            Box::new(move || ProgressDrawTarget::term_like_with_hz(Box::new(drawn.clone()), 200));
        let mut reporter = Reporter::Bars { target };
        drive(&mut reporter);
        let lines = screen.0.lock().unwrap().clone();
        assert!(
            lines
                .iter()
                .any(|l| l.contains("cpu::s   reference") && l.contains("/6 steps")),
            "{lines:?}"
        );
        let last = lines.iter().rev().find(|l| !l.trim().is_empty()).unwrap();
        assert!(
            last.starts_with("cpu::s   reference    6 steps  last loss"),
            "{lines:?}"
        );
        assert!(reporter.take_error().is_none());
    }

    #[test]
    fn lines_say_each_phase_once_and_draw_no_bar() {
        let mut out = Vec::new();
        let mut reporter = Reporter::lines(&mut out);
        drive(&mut reporter);
        let text = String::from_utf8(out).unwrap();
        assert_eq!(text.lines().count(), 1, "{text}");
        assert!(
            text.starts_with("cpu::s   reference    6 steps  last loss   3.37500  peak"),
            "{text}"
        );
        assert!(!text.contains('['), "{text}");
    }

    #[test]
    fn on_several_ranks_the_line_gives_the_highest_ranks_peak_and_names_it() {
        let mut run = fixtures::ranked(3);
        let phase = &mut run.phases[0];
        let peak = |ph: &PhaseRecord| {
            let line = phase_line("cpu::s", 6, ph);
            line.split_once("  peak ")
                .map(|(_, p)| p.to_owned())
                .unwrap()
        };
        let even = bytes(
            phase
                .steps
                .iter()
                .map(|s| s.memory.allocated.peak)
                .fold(phase.setup.peak, u64::max),
        );
        assert_eq!(peak(phase), format!("{even} on rank 0 of 3"));
        phase.steps[2].ranks[2].memory.allocated.peak += 4096;
        phase.steps[4].ranks[1].memory.allocated.peak += 2048;
        let higher = phase.steps[2].ranks[2].memory.allocated.peak;
        assert_eq!(peak(phase), format!("{} on rank 2 of 3", bytes(higher)));
        phase.ranks[1].setup.peak = higher + 1;
        assert_eq!(peak(phase), format!("{} on rank 1 of 3", bytes(higher + 1)));
        assert!(!peak(&fixtures::run().phases[0]).contains("rank"));
    }

    #[test]
    fn a_long_phase_gets_a_line_per_interval() {
        let run = fixtures::run();
        let tracker = MemoryTracker::unlimited();
        let mut out = Vec::new();
        let mut reporter = Reporter::lines(&mut out);
        let mut watch = reporter.trial("cpu::s", 6);
        watch.phase_started(Phase::Reference, 0, 6, &tracker);
        watch.last_line -= LINE_INTERVAL;
        watch.step_done(Phase::Reference, &run.phases[0].steps[0]);
        watch.step_done(Phase::Reference, &run.phases[0].steps[1]);
        drop(watch);
        let text = String::from_utf8(out).unwrap();
        assert_eq!(
            text, "cpu::s reference  step 0 (1/6)  loss 4.00000\n",
            "one line for the interval that passed, none for the step right after"
        );
    }
}
