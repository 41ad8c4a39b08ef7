//! Experts as an expert-parallel layout would own them, for one deliberate bug
//! ([`Fault::OnlyRankZeroExpertsSaved`]): rank `r` of `N` owns the experts the shard plan gives
//! it as rows of a block's `E` experts (`ceil(E / N)` a rank), and a checkpoint that kept rank
//! 0's experts only writes each rank's `i`-th expert as rank 0's `i`-th.
//!
//! [`Fault::OnlyRankZeroExpertsSaved`]: crate::Fault::OnlyRankZeroExpertsSaved

use crate::checkpoint::Entry;
use crate::parallel::plan;
use std::collections::HashMap;

/// The parts of a checkpoint entry's name around its expert index: `(block, expert, rest)` for
/// `{block}.experts.{expert}.{rest}`; `None` for a tensor of no expert.
fn expert_of(name: &str) -> Option<(&str, usize, &str)> {
    const EXPERTS: &str = ".experts.";
    let at = name.find(EXPERTS)?;
    let after = &name[at + EXPERTS.len()..];
    let (index, rest) = after.split_once('.')?;
    Some((&name[..at], index.parse().ok()?, rest))
}

/// `entries` with every expert's tensor (a weight, a moment or a master weight) holding the
/// bytes of rank 0's expert of the same index within its owner's experts, as a checkpoint that
/// kept rank 0's experts for every rank of `world`; a block's experts are counted from the
/// entries.
pub fn as_rank_zero_s(mut entries: Vec<Entry<'_>>, world: usize) -> Vec<Entry<'_>> {
    let mut experts: HashMap<&str, usize> = HashMap::new();
    for e in &entries {
        if let Some((block, x, _)) = expert_of(&e.name) {
            let n = experts.entry(block).or_default();
            *n = (*n).max(x + 1);
        }
    }
    let experts: HashMap<String, usize> = experts
        .into_iter()
        .map(|(block, n)| (block.to_string(), n))
        .collect();
    let at: HashMap<String, usize> = entries
        .iter()
        .enumerate()
        .map(|(i, e)| (e.name.clone(), i))
        .collect();
    let sources: Vec<(usize, usize)> = entries
        .iter()
        .enumerate()
        .filter_map(|(i, e)| {
            let (block, x, rest) = expert_of(&e.name)?;
            let owned = plan::rows(experts[block], world, 0).len();
            let local = x % owned.max(1);
            let source = at.get(&format!("{block}.experts.{local}.{rest}"))?;
            (local != x).then_some((i, *source))
        })
        .collect();
    for (i, source) in sources {
        entries[i].data = entries[source].data.clone();
    }
    entries
}

#[cfg(test)]
mod tests {
    use super::*;
    use safetensors::Dtype;
    use std::borrow::Cow;

    fn entry(name: &str, byte: u8) -> Entry<'static> {
        Entry {
            name: name.into(),
            dtype: Dtype::U8,
            shape: vec![1],
            data: Cow::Owned(vec![byte]),
        }
    }

    #[test]
    fn each_rank_s_experts_are_written_as_rank_zero_s_of_the_same_index() {
        let names = |block: &str, n: usize| {
            (0..n)
                .map(|x| format!("{block}.experts.{x}.w1.weight.exp_avg"))
                .collect::<Vec<_>>()
        };
        let mut all: Vec<String> = names("layers.0.mlp", 5);
        all.push("layers.0.mlp.gate.weight".into());
        all.extend(names("layers.1.mlp", 2));
        let entries = all
            .iter()
            .enumerate()
            .map(|(i, n)| entry(n, i as u8))
            .collect();
        let bytes: Vec<u8> = as_rank_zero_s(entries, 2)
            .iter()
            .map(|e| e.data[0])
            .collect();
        // 5 experts over 2 ranks: rank 0 owns 0..3, rank 1 owns 3..5 (written as 0 and 1);
        // 2 experts: one each, expert 1 written as expert 0; the router is no expert.
        assert_eq!(bytes, [0, 1, 2, 0, 1, 5, 6, 6]);
        let one: Vec<u8> = as_rank_zero_s(vec![entry("b.experts.1.w", 7)], 1)
            .iter()
            .map(|e| e.data[0])
            .collect();
        assert_eq!(one, [7]);
    }
}
