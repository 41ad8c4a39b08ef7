//! A training state as a record names it (docs/RECORD.md, `save` and `resume` lines): digests
//! of the parameters by name, the optimizer state by parameter name, the schedule, every random
//! generator and the data position. Any trainer's state reads into it; `state_digest` compares
//! two of them name by name.

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// The parameters' digests.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Params {
    /// One digest over every parameter.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub digest: Option<String>,
    /// Each parameter's digest by name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub by_name: Option<BTreeMap<String, String>>,
    /// Groups of names that share storage.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tied: Option<Vec<Vec<String>>>,
}

/// The optimizer state's digests.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OptimizerState {
    /// One digest over the whole optimizer state.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub digest: Option<String>,
    /// Each parameter's optimizer state by the parameter's name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub by_param: Option<BTreeMap<String, String>>,
    /// The parameter groups without their parameters.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hyper: Option<String>,
}

/// The learning-rate schedule's state.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Schedule {
    /// The learning rate the next step applies; `None` when not finite.
    pub next_lr: Option<f64>,
    /// A digest of the learning-rate scheduler's state.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub digest: Option<String>,
}

/// A training state.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct State {
    /// Steps taken.
    pub step: u64,
    /// Optimizer updates taken.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub optimizer_steps: Option<u64>,
    /// The parameters.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub params: Option<Params>,
    /// The optimizer's state.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub optimizer: Option<OptimizerState>,
    /// The schedule, where recorded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub schedule: Option<Schedule>,
    /// Every random generator, by name, where recorded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rng: Option<BTreeMap<String, serde_json::Value>>,
    /// The data position, where recorded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data: Option<BTreeMap<String, serde_json::Value>>,
}

/// One difference between two states: what differs (`params embed.weight`), the value in each
/// (`None` where one state does not record it) and how many others of its kind differ too.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Difference {
    /// The part of the state, named as the record names it.
    pub what: String,
    /// Its value in the state expected.
    pub expected: Option<String>,
    /// Its value in the state seen.
    pub actual: Option<String>,
    /// Further parts of the same kind that differ (other parameters, say), after this first one.
    pub more: usize,
}

impl State {
    /// Every recorded part, grouped by kind in a fixed order, each as `(name, value)`: the
    /// step, the parameters by name, the optimizer state by parameter name, the schedule, each
    /// generator and each data position field.
    fn parts(&self) -> Vec<(&'static str, Vec<(String, String)>)> {
        let one = |name: &str, v: Option<String>| v.map(|v| (name.to_string(), v));
        let named = |prefix: &str, m: Option<&BTreeMap<String, String>>| -> Vec<(String, String)> {
            m.into_iter()
                .flatten()
                .map(|(k, v)| (format!("{prefix} {k}"), v.clone()))
                .collect()
        };
        let p = self.params.as_ref();
        let o = self.optimizer.as_ref();
        let s = self.schedule.as_ref();
        let json = |m: Option<&BTreeMap<String, serde_json::Value>>, prefix: &str| {
            m.into_iter()
                .flatten()
                .map(|(k, v)| {
                    let value = v.as_str().map_or_else(|| v.to_string(), str::to_string);
                    (format!("{prefix} {k}"), value)
                })
                .collect::<Vec<_>>()
        };
        vec![
            ("step", vec![("step".into(), self.step.to_string())]),
            (
                "optimizer steps",
                one(
                    "optimizer steps",
                    self.optimizer_steps.map(|n| n.to_string()),
                )
                .into_iter()
                .collect(),
            ),
            (
                "parameters",
                named("params", p.and_then(|p| p.by_name.as_ref())),
            ),
            (
                "parameter digest",
                one("params digest", p.and_then(|p| p.digest.clone()))
                    .into_iter()
                    .collect(),
            ),
            (
                "tied parameters",
                one(
                    "tied parameters",
                    p.and_then(|p| p.tied.as_ref()).map(|t| format!("{t:?}")),
                )
                .into_iter()
                .collect(),
            ),
            (
                "optimizer state",
                named("optimizer state of", o.and_then(|o| o.by_param.as_ref())),
            ),
            (
                "optimizer digest",
                one("optimizer digest", o.and_then(|o| o.digest.clone()))
                    .into_iter()
                    .chain(one(
                        "optimizer hyperparameters",
                        o.and_then(|o| o.hyper.clone()),
                    ))
                    .collect(),
            ),
            (
                "schedule",
                one(
                    "next lr",
                    s.map(|s| s.next_lr.map_or("null".into(), |x| format!("{x:e}"))),
                )
                .into_iter()
                .chain(one("schedule digest", s.and_then(|s| s.digest.clone())))
                .collect(),
            ),
            ("generators", json(self.rng.as_ref(), "rng")),
            ("data position", json(self.data.as_ref(), "data")),
        ]
    }

    /// How `other` differs from `self`, part by part: of each kind, the first part (in name
    /// order) whose value differs or that only one state records, and how many more of that
    /// kind do. Equal states give none.
    pub fn differences(&self, other: &State) -> Vec<Difference> {
        let theirs: BTreeMap<&'static str, Vec<(String, String)>> =
            other.parts().into_iter().collect();
        let mut out = Vec::new();
        for (kind, mine) in self.parts() {
            let mine: BTreeMap<String, String> = mine.into_iter().collect();
            let other: BTreeMap<String, String> = theirs
                .get(kind)
                .cloned()
                .unwrap_or_default()
                .into_iter()
                .collect();
            let names: std::collections::BTreeSet<&String> =
                mine.keys().chain(other.keys()).collect();
            let differing: Vec<Difference> = names
                .into_iter()
                .filter(|n| mine.get(*n) != other.get(*n))
                .map(|n| Difference {
                    what: n.clone(),
                    expected: mine.get(n).cloned(),
                    actual: other.get(n).cloned(),
                    more: 0,
                })
                .collect();
            let more = differing.len().saturating_sub(1);
            out.extend(
                differing
                    .into_iter()
                    .next()
                    .map(|d| Difference { more, ..d }),
            );
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn state() -> State {
        State {
            step: 3,
            optimizer_steps: Some(3),
            params: Some(Params {
                digest: Some("all".into()),
                by_name: Some(BTreeMap::from([
                    ("a.weight".into(), "pa".into()),
                    ("b.weight".into(), "pb".into()),
                    ("c.weight".into(), "pc".into()),
                ])),
                tied: Some(vec![vec!["a.weight".into(), "out.weight".into()]]),
            }),
            optimizer: Some(OptimizerState {
                digest: Some("opt".into()),
                by_param: Some(BTreeMap::from([("a.weight".into(), "oa".into())])),
                hyper: Some("h".into()),
            }),
            schedule: Some(Schedule {
                next_lr: Some(0.005),
                digest: Some("sched".into()),
            }),
            rng: Some(BTreeMap::from([
                ("python".into(), serde_json::json!("r1")),
                ("torch_cpu".into(), serde_json::json!("r2")),
            ])),
            data: Some(BTreeMap::from([("position".into(), serde_json::json!(12))])),
        }
    }

    #[test]
    fn equal_states_have_no_differences() {
        assert_eq!(state().differences(&state()), []);
    }

    #[test]
    fn the_first_differing_tensor_is_named_with_how_many_more_differ() {
        let mut got = state();
        let by_name = got.params.as_mut().unwrap().by_name.as_mut().unwrap();
        by_name.insert("b.weight".into(), "x".into());
        by_name.insert("c.weight".into(), "y".into());
        got.params.as_mut().unwrap().digest = Some("other".into());
        let d = state().differences(&got);
        let what: Vec<&str> = d.iter().map(|d| d.what.as_str()).collect();
        assert_eq!(what, ["params b.weight", "params digest"]);
        assert_eq!(d[0].expected.as_deref(), Some("pb"));
        assert_eq!(d[0].actual.as_deref(), Some("x"));
        assert_eq!(d[0].more, 1);
    }

    /// Each part of the state is compared on its own: changing one gives one difference,
    /// named for it.
    #[test]
    fn every_part_of_the_state_is_compared() {
        type Change = fn(&mut State);
        let changes: [(&str, Change); 11] = [
            ("step", |s| s.step += 1),
            ("optimizer steps", |s| s.optimizer_steps = Some(2)),
            ("tied parameters", |s| {
                s.params.as_mut().unwrap().tied = None
            }),
            ("optimizer state of a.weight", |s| {
                s.optimizer.as_mut().unwrap().by_param = Some(BTreeMap::new())
            }),
            ("optimizer digest", |s| {
                s.optimizer.as_mut().unwrap().digest = Some("z".into())
            }),
            ("optimizer hyperparameters", |s| {
                s.optimizer.as_mut().unwrap().hyper = None
            }),
            ("next lr", |s| {
                s.schedule.as_mut().unwrap().next_lr = Some(0.5)
            }),
            ("schedule digest", |s| {
                s.schedule.as_mut().unwrap().digest = Some("z".into())
            }),
            ("rng python", |s| {
                s.rng.as_mut().unwrap().insert("python".into(), "z".into());
            }),
            ("rng torch_cpu", |s| {
                s.rng.as_mut().unwrap().remove("torch_cpu");
            }),
            ("data position", |s| {
                s.data.as_mut().unwrap().insert("position".into(), 0.into());
            }),
        ];
        for (what, change) in changes {
            let mut got = state();
            change(&mut got);
            let d = state().differences(&got);
            let seen: Vec<&str> = d.iter().map(|d| d.what.as_str()).collect();
            assert_eq!(seen, [what]);
        }
    }
}
