//! A suite's `checks:` settings: which checks run (all by default, `name: false` turns one off)
//! and how closely resumed steps must follow the reference (`loss_continuity`).

use super::Check;
use serde::de::{self, MapAccess, Visitor};
use serde::{Deserialize, Deserializer, Serialize};
use std::collections::BTreeSet;
use std::fmt;

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
#[derive(Clone, Debug, Default)]
pub struct ChecksSpec {
    /// Resumed steps against the reference: on (bitwise), off, or within a tolerance.
    pub loss_continuity: ContinuitySetting,
    /// The other checks the suite turns off (`name: false`).
    off: BTreeSet<Check>,
}

impl ChecksSpec {
    /// Whether `check` runs.
    pub fn enabled(&self, check: Check) -> bool {
        match check {
            Check::LossContinuity => self.loss_continuity.0.is_some(),
            other => !self.off.contains(&other),
        }
    }
}

impl<'de> Deserialize<'de> for ChecksSpec {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Settings;
        impl<'de> Visitor<'de> for Settings {
            type Value = ChecksSpec;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a mapping of check names to true or false")
            }

            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<ChecksSpec, A::Error> {
                let mut spec = ChecksSpec::default();
                while let Some(key) = map.next_key::<String>()? {
                    let Some(check) = Check::ALL.into_iter().find(|c| c.name() == key) else {
                        return Err(de::Error::unknown_field(&key, &Check::NAMES));
                    };
                    if check == Check::LossContinuity {
                        spec.loss_continuity = map.next_value()?;
                    } else if map.next_value::<bool>()? {
                        spec.off.remove(&check);
                    } else {
                        spec.off.insert(check);
                    }
                }
                Ok(spec)
            }
        }
        d.deserialize_struct("ChecksSpec", &Check::NAMES, Settings)
    }
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

    #[test]
    fn a_check_set_false_is_off_and_every_other_stays_on() {
        let spec: ChecksSpec = serde_saphyr::from_str("{golden: false, no_leak: true}").unwrap();
        for check in Check::ALL {
            let off = check == Check::Golden;
            assert_eq!(spec.enabled(check), !off, "{check}");
        }
        let none: ChecksSpec = serde_saphyr::from_str("{loss_continuity: false}").unwrap();
        assert!(!none.enabled(Check::LossContinuity) && none.enabled(Check::Golden));
    }

    #[test]
    fn a_name_that_is_no_check_is_refused_with_every_check_s_name() {
        let err = serde_saphyr::from_str::<ChecksSpec>("{gold: false}")
            .unwrap_err()
            .to_string();
        let names = Check::NAMES.join(", ");
        assert!(
            err.contains(&format!("unknown field `gold`, expected one of {names}")),
            "{err}"
        );
    }
}
