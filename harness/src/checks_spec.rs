//! The checks' names, and a suite's `checks:` settings: which checks run (all by default) and
//! how closely resumed steps must follow the reference. A leaf shared by the suites that set
//! them and the checks that read them, so that neither imports the other.

use serde::de::{self, MapAccess, Visitor};
use serde::{Deserialize, Deserializer, Serialize};
use std::fmt;

/// A check's name.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Check {
    /// Resumed steps equal the reference's (bitwise, or within a tolerance).
    LossContinuity,
    /// Weights, optimizer state, step, learning rate and batch equal at the first resumed step.
    StateDigest,
    /// Every phase's samples, joined at its resume point, are the reference's; none skipped or
    /// repeated within an epoch.
    DataLedger,
    /// Every byte comes back when a trainer is dropped.
    MemoryReclaimed,
    /// Every resumed step's peak at most the reference's same step's.
    MemoryParity,
    /// Every step's peak, and checkpoint loading's, under the budget.
    PeakBudget,
    /// Allocated bytes flat at step boundaries.
    NoLeak,
    /// Every block recomputed under activation checkpointing.
    AcCoverage,
    /// Measured step peaks equal the memory model's.
    MemoryModel,
    /// No allocation refused.
    OomFree,
    /// The reference trajectory equals its snapshot.
    Golden,
    /// Every step's loss and gradient norm are finite.
    Finite,
    /// Every checkpoint on disk holds the state of its step; an asynchronous save's files are a
    /// synchronous save's.
    CheckpointEquivalence,
}

impl Check {
    /// Every check, in report order.
    pub const ALL: [Check; 13] = [
        Check::LossContinuity,
        Check::StateDigest,
        Check::DataLedger,
        Check::MemoryReclaimed,
        Check::MemoryParity,
        Check::PeakBudget,
        Check::NoLeak,
        Check::AcCoverage,
        Check::MemoryModel,
        Check::OomFree,
        Check::Golden,
        Check::Finite,
        Check::CheckpointEquivalence,
    ];

    /// The name used in suites and reports.
    pub fn name(self) -> &'static str {
        match self {
            Check::LossContinuity => "loss_continuity",
            Check::StateDigest => "state_digest",
            Check::DataLedger => "data_ledger",
            Check::MemoryReclaimed => "memory_reclaimed",
            Check::MemoryParity => "memory_parity",
            Check::PeakBudget => "peak_budget",
            Check::NoLeak => "no_leak",
            Check::AcCoverage => "ac_coverage",
            Check::MemoryModel => "memory_model",
            Check::OomFree => "oom_free",
            Check::Golden => "golden",
            Check::Finite => "finite",
            Check::CheckpointEquivalence => "checkpoint_equivalence",
        }
    }
}

impl fmt::Display for Check {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// How closely resumed steps must follow the reference.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Continuity {
    /// Bit for bit (the default).
    Bitwise,
    /// `|resumed - reference| <= atol + rtol * |reference|`.
    Within(Tolerance),
}

/// An absolute and a relative tolerance.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Tolerance {
    /// Absolute tolerance.
    #[serde(default)]
    pub atol: f64,
    /// Relative tolerance, a fraction of the reference value.
    #[serde(default)]
    pub rtol: f64,
}

impl Tolerance {
    /// The `tight` profile: a few float32 ulps of a loss.
    pub const TIGHT: Tolerance = Tolerance {
        atol: 1e-7,
        rtol: 1e-6,
    };
    /// The `loose` profile: agreement to about three significant digits.
    pub const LOOSE: Tolerance = Tolerance {
        atol: 1e-5,
        rtol: 1e-3,
    };

    /// Whether `got` is within the tolerance of `want`: a difference exactly at the limit passes.
    pub fn accepts(&self, want: f64, got: f64) -> bool {
        (got - want).abs() <= self.limit(want)
    }

    /// The largest difference accepted around `want`.
    pub fn limit(&self, want: f64) -> f64 {
        self.atol + self.rtol * want.abs()
    }
}

/// The `loss_continuity` setting: `true`/`false`, a profile name, or `{atol, rtol}`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ContinuitySetting(pub Option<Continuity>);

const CONTINUITY_HINT: &str =
    "true, false, bitwise, tight, loose, or explicit tolerances such as {atol: 1e-6, rtol: 1e-5}";

impl<'de> Deserialize<'de> for ContinuitySetting {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = ContinuitySetting;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str(CONTINUITY_HINT)
            }
            fn visit_bool<E: de::Error>(self, v: bool) -> Result<Self::Value, E> {
                Ok(ContinuitySetting(v.then_some(Continuity::Bitwise)))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
                Ok(ContinuitySetting(Some(match v {
                    "bitwise" => Continuity::Bitwise,
                    "tight" => Continuity::Within(Tolerance::TIGHT),
                    "loose" => Continuity::Within(Tolerance::LOOSE),
                    other => {
                        return Err(E::custom(format!(
                            "unknown tolerance profile {other:?}; write {CONTINUITY_HINT}"
                        )))
                    }
                })))
            }
            fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Self::Value, A::Error> {
                let t = Tolerance::deserialize(de::value::MapAccessDeserializer::new(map))?;
                let ok = |x: f64| x.is_finite() && x >= 0.0;
                if !ok(t.atol) || !ok(t.rtol) {
                    return Err(de::Error::custom(format!(
                        "tolerances must be finite and not negative, got atol {} rtol {}; write {CONTINUITY_HINT}",
                        t.atol, t.rtol
                    )));
                }
                Ok(ContinuitySetting(Some(Continuity::Within(t))))
            }
        }
        d.deserialize_any(V)
    }
}

impl Default for ContinuitySetting {
    fn default() -> Self {
        ContinuitySetting(Some(Continuity::Bitwise))
    }
}

/// Which checks run, and their settings; every check is on by default.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ChecksSpec {
    /// Resumed steps against the reference.
    #[serde(default)]
    pub loss_continuity: ContinuitySetting,
    /// State digests at the first resumed step.
    #[serde(default = "on")]
    pub state_digest: bool,
    /// Every phase's samples, joined at its resume point, the reference's; no sample skipped
    /// or repeated within an epoch.
    #[serde(default = "on")]
    pub data_ledger: bool,
    /// Bytes returned when a trainer is dropped.
    #[serde(default = "on")]
    pub memory_reclaimed: bool,
    /// Resumed step peaks at most the reference's same step's.
    #[serde(default = "on")]
    pub memory_parity: bool,
    /// Peaks under `memory.budget` and `memory.rss_budget`.
    #[serde(default = "on")]
    pub peak_budget: bool,
    /// Allocated bytes flat at step boundaries.
    #[serde(default = "on")]
    pub no_leak: bool,
    /// Every block recomputed under activation checkpointing.
    #[serde(default = "on")]
    pub ac_coverage: bool,
    /// Measured peaks equal to the memory model's.
    #[serde(default = "on")]
    pub memory_model: bool,
    /// No refused allocation.
    #[serde(default = "on")]
    pub oom_free: bool,
    /// The reference trajectory equal to its snapshot in `golden/`.
    #[serde(default = "on")]
    pub golden: bool,
    /// Every step's loss and gradient norm finite.
    #[serde(default = "on")]
    pub finite: bool,
    /// Every checkpoint on disk holds the state of its step, and an asynchronous save's files
    /// are a synchronous save's.
    #[serde(default = "on")]
    pub checkpoint_equivalence: bool,
}

impl Default for ChecksSpec {
    fn default() -> Self {
        ChecksSpec {
            loss_continuity: ContinuitySetting::default(),
            state_digest: true,
            data_ledger: true,
            memory_reclaimed: true,
            memory_parity: true,
            peak_budget: true,
            no_leak: true,
            ac_coverage: true,
            memory_model: true,
            oom_free: true,
            golden: true,
            finite: true,
            checkpoint_equivalence: true,
        }
    }
}

impl ChecksSpec {
    /// Whether `check` runs.
    pub fn enabled(&self, check: Check) -> bool {
        match check {
            Check::LossContinuity => self.loss_continuity.0.is_some(),
            Check::StateDigest => self.state_digest,
            Check::DataLedger => self.data_ledger,
            Check::MemoryReclaimed => self.memory_reclaimed,
            Check::MemoryParity => self.memory_parity,
            Check::PeakBudget => self.peak_budget,
            Check::NoLeak => self.no_leak,
            Check::AcCoverage => self.ac_coverage,
            Check::MemoryModel => self.memory_model,
            Check::OomFree => self.oom_free,
            Check::Golden => self.golden,
            Check::Finite => self.finite,
            Check::CheckpointEquivalence => self.checkpoint_equivalence,
        }
    }
}

/// A check's setting when absent: on.
fn on() -> bool {
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    fn setting(yaml: &str) -> Result<Option<Continuity>, String> {
        serde_saphyr::from_str::<ContinuitySetting>(yaml)
            .map(|s| s.0)
            .map_err(|e| e.to_string())
    }

    #[test]
    fn each_form_of_the_continuity_setting_reads_as_written() {
        assert_eq!(setting("true"), Ok(Some(Continuity::Bitwise)));
        assert_eq!(setting("false"), Ok(None));
        assert_eq!(setting("bitwise"), Ok(Some(Continuity::Bitwise)));
        assert_eq!(
            setting("loose"),
            Ok(Some(Continuity::Within(Tolerance::LOOSE)))
        );
        assert_eq!(
            setting("{atol: 0.5, rtol: 0}"),
            Ok(Some(Continuity::Within(Tolerance {
                atol: 0.5,
                rtol: 0.0
            })))
        );
    }

    #[test]
    fn a_tolerance_negative_or_infinite_in_either_field_is_refused_with_the_forms_accepted() {
        for bad in [
            "{atol: -1e-6, rtol: 0}",
            "{atol: 0, rtol: -1e-6}",
            "{atol: .inf, rtol: 0}",
            "{atol: 0, rtol: .inf}",
        ] {
            let err = setting(bad).unwrap_err();
            assert!(
                err.contains("tolerances must be finite and not negative")
                    && err.contains(CONTINUITY_HINT),
                "{bad}: {err}"
            );
        }
    }

    #[test]
    fn a_setting_of_another_type_names_the_forms_accepted() {
        let err = setting("3").unwrap_err();
        assert!(err.contains(CONTINUITY_HINT), "{err}");
        let err = setting("strict").unwrap_err();
        assert!(
            err.contains("unknown tolerance profile \"strict\""),
            "{err}"
        );
    }
}
