//! A record's `by_category` object read into the engine's [`Breakdown`]: a writer names the
//! categories it counts, and a category it leaves out holds no bytes (the Python recorder
//! counts only the live training state: `params`, `grads`, `optimizer`).

use ckpt_engine::memory::Breakdown;
use serde::{Deserialize, Deserializer};

/// The categories a record names, each absent one 0.
#[derive(Default, Deserialize)]
#[serde(default)]
struct Counted {
    params: u64,
    grads: u64,
    optimizer: u64,
    activations: u64,
    workspace: u64,
    io: u64,
}

/// Reads an optional `by_category` whose categories may be left out (serde's
/// `deserialize_with`).
pub fn optional<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Breakdown>, D::Error> {
    let counted = Option::<Counted>::deserialize(d)?;
    Ok(counted.map(|c| Breakdown {
        params: c.params,
        grads: c.grads,
        optimizer: c.optimizer,
        activations: c.activations,
        workspace: c.workspace,
        io: c.io,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Deserialize)]
    struct Holder {
        #[serde(default, deserialize_with = "optional")]
        by_category: Option<Breakdown>,
    }

    fn read(text: &str) -> Option<Breakdown> {
        serde_json::from_str::<Holder>(text).unwrap().by_category
    }

    #[test]
    fn categories_left_out_hold_nothing() {
        let b = read(r#"{"by_category": {"params": 9216, "optimizer": 18432}}"#).unwrap();
        assert_eq!(
            b,
            Breakdown {
                params: 9216,
                optimizer: 18432,
                ..Breakdown::default()
            }
        );
        assert_eq!(b.total(), 27648);
    }

    #[test]
    fn absent_stays_absent_and_a_wrong_type_is_an_error() {
        assert_eq!(read("{}"), None);
        let e = serde_json::from_str::<Holder>(r#"{"by_category": {"params": -1}}"#)
            .err()
            .unwrap();
        assert!(e.to_string().contains("invalid value"), "{e}");
    }
}
