//! `training:` and `schedule:` of a suite: how long the run is, where it is resumed, how often
//! it saves and how many checkpoints it keeps, and the learning rate's warmup and decay.

use serde::de::{self, Visitor};
use serde::{Deserialize, Deserializer};
use serde_saphyr::Spanned;
use std::fmt;

/// Learning-rate warmup and decay; the harness pins the decay's horizon at `max_steps`.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ScheduleSpec {
    /// Steps of linear warmup.
    #[serde(default)]
    pub warmup_steps: u64,
    /// Final learning rate as a fraction of the peak.
    #[serde(default)]
    pub min_lr_ratio: f64,
}

/// How long to train and where to save.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Training {
    /// Steps of the nominal run (the schedule's horizon).
    pub max_steps: Spanned<u64>,
    /// Steps trained past `max_steps` after resuming from its checkpoint.
    #[serde(default = "default_extra")]
    pub extra_steps: u64,
    /// The mid-run checkpoint to resume from, or a chain of them (each resume saves the next
    /// one); `max_steps / 2` when absent.
    #[serde(default)]
    pub resume_from: Option<Spanned<ResumeFrom>>,
    /// Also save every this many steps (at least 1).
    #[serde(default, deserialize_with = "save_every")]
    pub save_every: Option<u64>,
    /// Checkpoints to keep (at least 1).
    #[serde(default, deserialize_with = "keep_last")]
    pub keep_last: Option<usize>,
    /// Micro-batches of `batch_size` rows per optimizer step (at least 1); 1 when absent.
    #[serde(default, deserialize_with = "accumulation")]
    pub accumulation: Option<usize>,
    /// Save the reference phase's checkpoints in the background (`Trainer::save_async`):
    /// the state is staged in host buffers, training goes on, and a writer thread writes it.
    #[serde(default)]
    pub async_save: bool,
}

/// `training.resume_from`: one step, or a strictly increasing list of steps: the reference's
/// checkpoint at the first is resumed, that run saves at the second and is resumed there, and
/// so on.
#[derive(Clone, Debug)]
pub enum ResumeFrom {
    /// One resume point.
    Step(u64),
    /// A chain of resume points, each written where it is.
    Chain(Vec<Spanned<u64>>),
}

const RESUME_FROM_HINT: &str =
    "a step such as resume_from: 4, or a strictly increasing list of steps such as resume_from: [3, 5, 7]";

impl<'de> Deserialize<'de> for ResumeFrom {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = ResumeFrom;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str(RESUME_FROM_HINT)
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<ResumeFrom, E> {
                Ok(ResumeFrom::Step(v))
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<ResumeFrom, E> {
                u64::try_from(v).map(ResumeFrom::Step).map_err(|_| {
                    E::custom(format!(
                        "resume_from ({v}) is negative; write {RESUME_FROM_HINT}"
                    ))
                })
            }
            fn visit_seq<A: de::SeqAccess<'de>>(self, mut seq: A) -> Result<ResumeFrom, A::Error> {
                let mut steps = Vec::new();
                while let Some(step) = seq.next_element::<Spanned<u64>>()? {
                    steps.push(step);
                }
                Ok(ResumeFrom::Chain(steps))
            }
        }
        d.deserialize_any(V)
    }
}

/// A count of at least 1, or absent; `zero` says what to write instead of 0.
fn at_least_one<'de, D, T>(d: D, zero: &str) -> Result<Option<T>, D::Error>
where
    D: Deserializer<'de>,
    T: Deserialize<'de> + Default + PartialEq,
{
    let n = Option::<T>::deserialize(d)?;
    if n == Some(T::default()) {
        return Err(de::Error::custom(zero));
    }
    Ok(n)
}

fn save_every<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
    at_least_one(
        d,
        "save_every is 0; write save_every: 1 or more, or leave it out to save only at resume_from and max_steps",
    )
}

fn keep_last<'de, D: Deserializer<'de>>(d: D) -> Result<Option<usize>, D::Error> {
    at_least_one(
        d,
        "keep_last is 0, but the newest checkpoint is always kept; write keep_last: 1 or more, or leave it out to keep every checkpoint",
    )
}

fn accumulation<'de, D: Deserializer<'de>>(d: D) -> Result<Option<usize>, D::Error> {
    at_least_one(
        d,
        "accumulation is 0; write the micro-batches per optimizer step, accumulation: 1 or more, or leave it out for one batch per step",
    )
}

/// `extra_steps` when absent: three steps past the old end.
fn default_extra() -> u64 {
    3
}
