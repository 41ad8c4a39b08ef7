//! `memory:` of a suite: the device's capacity, the per-step budget (bytes or a fraction of the
//! capacity) and the resident host bytes a phase may add.

use serde::de::{self, Visitor};
use serde::{Deserialize, Deserializer};
use serde_saphyr::Spanned;
use std::fmt;

/// A per-step memory budget: bytes, or a fraction of the device's capacity.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Budget {
    /// Bytes.
    Bytes(u64),
    /// A fraction in (0, 1] of the device's capacity.
    Fraction(f64),
}

impl Budget {
    /// The budget in bytes on a device of `capacity` bytes.
    pub fn bytes(self, capacity: u64) -> u64 {
        match self {
            Budget::Bytes(b) => b,
            Budget::Fraction(f) => (capacity as f64 * f).floor() as u64,
        }
    }
}

const BUDGET_HINT: &str = "bytes (an integer such as 67108864) or a fraction of the device capacity in quotes such as \"0.5\"";

fn fraction<E: de::Error>(f: f64) -> Result<Budget, E> {
    if f.is_finite() && f > 0.0 && f <= 1.0 {
        Ok(Budget::Fraction(f))
    } else {
        Err(E::custom(format!(
            "budget fraction {f} is outside (0, 1]; write {BUDGET_HINT}"
        )))
    }
}

impl<'de> Deserialize<'de> for Budget {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = Budget;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str(BUDGET_HINT)
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<Budget, E> {
                Ok(Budget::Bytes(v))
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<Budget, E> {
                u64::try_from(v)
                    .map(Budget::Bytes)
                    .map_err(|_| E::custom(format!("budget {v} is negative; write {BUDGET_HINT}")))
            }
            fn visit_f64<E: de::Error>(self, v: f64) -> Result<Budget, E> {
                fraction(v)
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Budget, E> {
                match v.trim().parse::<f64>() {
                    Ok(f) => fraction(f),
                    Err(_) => Err(E::custom(format!(
                        "budget {v:?} is not a number; write {BUDGET_HINT}"
                    ))),
                }
            }
        }
        d.deserialize_any(V)
    }
}

/// Memory settings of a suite.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MemorySpec {
    /// Capacity of the device in bytes: simulated on the CPU (unlimited when absent), a cap
    /// under the card's own on CUDA.
    #[serde(default)]
    pub capacity: Option<Spanned<u64>>,
    /// Every step's peak, and checkpoint loading's, must stay at or under this.
    #[serde(default)]
    pub budget: Option<Spanned<Budget>>,
    /// The resident host bytes each phase may add: its peak above the resident bytes at its
    /// start must stay at or under this many bytes.
    #[serde(default)]
    pub rss_budget: Option<u64>,
}
