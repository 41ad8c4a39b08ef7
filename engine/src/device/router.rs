//! A mixture-of-experts router's host arithmetic, as transformers does it: the softmax of each
//! row's logits in f32, the top-k experts (highest probability first, the lower index on a tie),
//! their weights optionally renormalised to sum to one; the dispatch of rows to experts in token
//! order; and the load-balancing loss over every MoE layer of a pass
//! (`load_balancing_loss_func`). The routing decision is data the host keeps: it is small
//! (`rows × experts` floats) and the dispatch is planned from it.

use crate::error::{EngineError, Result};

/// What one MoE layer's routing needs to know.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RouteSpec {
    /// Experts in the layer.
    pub experts: usize,
    /// Experts each row goes to.
    pub top_k: usize,
    /// Whether the chosen experts' weights are renormalised to sum to one.
    pub normalize: bool,
    /// The block's index in the model (the counting device's recorded routes are keyed by it).
    pub layer: usize,
}

/// One MoE layer's routing of a batch's rows.
#[derive(Clone, Debug, PartialEq)]
pub struct Routing {
    spec: RouteSpec,
    /// `[rows, experts]`: each row's softmax over the experts.
    probs: Vec<f32>,
    /// `[rows, top_k]`: each row's experts, highest probability first.
    chosen: Vec<u32>,
    /// `[rows, top_k]`: the weight of each chosen expert's output.
    weights: Vec<f32>,
}

/// The rows one expert processes, in token order.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Dispatch {
    /// Row indices into the batch.
    pub rows: Vec<u32>,
    /// The weight of the expert's output for each row.
    pub weights: Vec<f32>,
    /// Where each row's weight is in the routing's `[rows, top_k]` table.
    pub slots: Vec<u32>,
}

/// `exp(x − max) / Σ exp(x − max)` of one row, in f64, rounded to f32.
fn softmax(row: &[f32]) -> Vec<f32> {
    let max = row.iter().fold(f64::NEG_INFINITY, |m, &x| m.max(x as f64));
    let exps: Vec<f64> = row.iter().map(|&x| (x as f64 - max).exp()).collect();
    let sum: f64 = exps.iter().sum();
    exps.iter().map(|e| (e / sum) as f32).collect()
}

impl Routing {
    /// The routing of `logits` (`[rows, experts]`, row-major).
    pub fn from_logits(logits: &[f32], spec: RouteSpec) -> Self {
        let (e, k) = (spec.experts, spec.top_k);
        let rows = logits.len() / e;
        let mut probs = Vec::with_capacity(rows * e);
        let mut chosen = Vec::with_capacity(rows * k);
        let mut weights = Vec::with_capacity(rows * k);
        for row in logits.chunks(e) {
            let p = softmax(row);
            let mut order: Vec<u32> = (0..e as u32).collect();
            order.sort_by(|&a, &b| p[b as usize].total_cmp(&p[a as usize]).then(a.cmp(&b)));
            order.truncate(k);
            let sum: f32 = order.iter().map(|&i| p[i as usize]).sum();
            for &i in &order {
                let w = p[i as usize];
                weights.push(if spec.normalize { w / sum } else { w });
            }
            chosen.extend(order);
            probs.extend(p);
        }
        Routing {
            spec,
            probs,
            chosen,
            weights,
        }
    }

    /// A routing of `rows` rows that sends `counts[e]` rows to expert `e`, with uniform
    /// probabilities: what the memory model runs when it knows how many rows each expert got but
    /// not which. The counts must add up to `rows × top_k`, none above `rows`.
    pub fn from_counts(rows: usize, counts: &[u32], spec: RouteSpec) -> Result<Self> {
        let (e, k) = (spec.experts, spec.top_k);
        let total: u64 = counts.iter().map(|&c| c as u64).sum();
        if counts.len() != e
            || total != (rows * k) as u64
            || counts.iter().any(|&c| c as usize > rows)
        {
            return Err(EngineError::Config(format!(
                "layer {}: tokens per expert {counts:?} are not a top-{k} routing of {rows} rows \
                 over {e} experts (each at most {rows}, {} in all)",
                spec.layer,
                rows * k
            )));
        }
        // Expert e's rows are a run of the list below, which has at most `rows` entries, so
        // consecutive positions modulo `rows` never give one row the same expert twice.
        let order: Vec<u32> = (0..e as u32)
            .flat_map(|x| std::iter::repeat_n(x, counts[x as usize] as usize))
            .collect();
        let mut chosen = vec![0; rows * k];
        for (i, &x) in order.iter().enumerate() {
            chosen[(i % rows) * k + i / rows] = x;
        }
        Ok(Routing {
            spec,
            probs: vec![1.0 / e as f32; rows * e],
            chosen,
            weights: vec![1.0 / k as f32; rows * k],
        })
    }

    /// The layer's shape and index.
    pub fn spec(&self) -> RouteSpec {
        self.spec
    }

    /// Rows routed.
    pub fn rows(&self) -> usize {
        self.chosen.len() / self.spec.top_k
    }

    /// `[rows, top_k]`: each row's experts, highest probability first.
    pub fn chosen(&self) -> &[u32] {
        &self.chosen
    }

    /// How many rows each expert got.
    pub fn tokens_per_expert(&self) -> Vec<u32> {
        let mut counts = vec![0; self.spec.experts];
        for &x in &self.chosen {
            counts[x as usize] += 1;
        }
        counts
    }

    /// Each expert's rows in token order, with their weights.
    pub fn dispatch(&self) -> Vec<Dispatch> {
        let k = self.spec.top_k;
        let mut out = vec![Dispatch::default(); self.spec.experts];
        for (slot, (&x, &w)) in self.chosen.iter().zip(&self.weights).enumerate() {
            let d = &mut out[x as usize];
            d.rows.push((slot / k) as u32);
            d.weights.push(w);
            d.slots.push(slot as u32);
        }
        out
    }

    /// ∂L/∂logits (`[rows, experts]`) from ∂L/∂weights (`dweights`, `[rows, top_k]`) and the
    /// load-balancing loss's gradient with respect to every probability (`dprob`, one value per
    /// expert, the same for every row): through the renormalisation, then the softmax.
    pub fn logits_grad(&self, dweights: &[f32], dprob: &[f64]) -> Vec<f32> {
        let (e, k) = (self.spec.experts, self.spec.top_k);
        let mut out = Vec::with_capacity(self.probs.len());
        for (r, p) in self.probs.chunks(e).enumerate() {
            let mut dp: Vec<f64> = dprob.to_vec();
            let chosen = &self.chosen[r * k..(r + 1) * k];
            let dw = &dweights[r * k..(r + 1) * k];
            if self.spec.normalize {
                let w = &self.weights[r * k..(r + 1) * k];
                let sum: f64 = chosen.iter().map(|&x| p[x as usize] as f64).sum();
                let dot: f64 = dw.iter().zip(w).map(|(&d, &w)| d as f64 * w as f64).sum();
                for (&x, &d) in chosen.iter().zip(dw) {
                    dp[x as usize] += (d as f64 - dot) / sum;
                }
            } else {
                for (&x, &d) in chosen.iter().zip(dw) {
                    dp[x as usize] += d as f64;
                }
            }
            let mean: f64 = p.iter().zip(&dp).map(|(&p, &d)| p as f64 * d).sum();
            out.extend(
                p.iter()
                    .zip(&dp)
                    .map(|(&p, &d)| (p as f64 * (d - mean)) as f32),
            );
        }
        out
    }
}

/// The load-balancing loss of a pass, accumulated over its MoE layers:
/// `experts · Σ_e f_e · P_e`, with `f_e` the fraction of top-k slots routed to expert `e` and
/// `P_e` its mean probability, both over every row of every MoE layer.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct LoadBalance {
    counts: Vec<u64>,
    prob_sums: Vec<f64>,
    rows: usize,
}

impl LoadBalance {
    /// Adds one layer's routing.
    pub fn add(&mut self, r: &Routing) {
        let e = r.spec.experts;
        self.counts.resize(e, 0);
        self.prob_sums.resize(e, 0.0);
        for (c, n) in self.counts.iter_mut().zip(r.tokens_per_expert()) {
            *c += n as u64;
        }
        for p in r.probs.chunks(e) {
            for (s, &p) in self.prob_sums.iter_mut().zip(p) {
                *s += p as f64;
            }
        }
        self.rows += r.rows();
    }

    /// Whether no layer was added.
    pub fn is_empty(&self) -> bool {
        self.rows == 0
    }

    /// The loss.
    pub fn loss(&self) -> f64 {
        let t = self.rows as f64;
        let e = self.counts.len() as f64;
        e * self
            .counts
            .iter()
            .zip(&self.prob_sums)
            .map(|(&c, &s)| (c as f64 / t) * (s / t))
            .sum::<f64>()
    }

    /// `coef · ∂loss/∂p` for a probability of each expert (the same for every row and layer:
    /// the counts are not differentiable).
    pub fn prob_grad(&self, coef: f64) -> Vec<f64> {
        let t = self.rows as f64;
        let e = self.counts.len() as f64;
        self.counts
            .iter()
            .map(|&c| coef * e * c as f64 / (t * t))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn spec(experts: usize, top_k: usize, normalize: bool) -> RouteSpec {
        RouteSpec {
            experts,
            top_k,
            normalize,
            layer: 0,
        }
    }

    #[test]
    fn top_k_takes_the_highest_probabilities_and_the_lower_index_on_a_tie() {
        let r = Routing::from_logits(&[0.0, 2.0, 2.0, 1.0], spec(4, 2, true));
        assert_eq!(r.chosen, vec![1, 2]);
        assert_eq!(r.weights, vec![0.5, 0.5]);
        assert_eq!(r.tokens_per_expert(), vec![0, 1, 1, 0]);
    }

    #[test]
    fn unnormalised_weights_are_the_probabilities() {
        let r = Routing::from_logits(&[0.0, 1.0, 3.0], spec(3, 2, false));
        let p = softmax(&[0.0, 1.0, 3.0]);
        assert_eq!(r.weights, vec![p[2], p[1]]);
    }

    #[test]
    fn dispatch_lists_each_experts_rows_in_token_order() {
        let logits = [
            5.0, 0.0, 1.0, /**/ 0.0, 5.0, 1.0, /**/ 5.0, 1.0, 0.0,
        ];
        let d = Routing::from_logits(&logits, spec(3, 2, true)).dispatch();
        assert_eq!(d[0].rows, vec![0, 2]);
        assert_eq!(d[0].slots, vec![0, 4]);
        assert_eq!(d[1].rows, vec![1, 2]);
        assert_eq!(d[2].rows, vec![0, 1]);
    }

    #[test]
    fn counts_that_are_not_a_routing_are_refused() {
        assert!(Routing::from_counts(4, &[4, 4, 1], spec(3, 2, true)).is_err());
        assert!(Routing::from_counts(4, &[5, 3, 0], spec(3, 2, true)).is_err());
    }

    /// The loss and the gradient of a small function of the routing, against central differences.
    fn objective(logits: &[f32], s: RouteSpec, c: &[f32], coef: f64) -> f64 {
        let r = Routing::from_logits(logits, s);
        let mut lb = LoadBalance::default();
        lb.add(&r);
        let weighted: f64 = r
            .weights
            .iter()
            .zip(&r.chosen)
            .map(|(&w, &x)| w as f64 * c[x as usize] as f64)
            .sum();
        weighted + coef * lb.loss()
    }

    proptest! {
        #[test]
        fn counts_give_a_routing_with_those_counts(
            rows in 1usize..20, experts in 2usize..6, k in 1usize..3, seed in any::<u64>()
        ) {
            let k = k.min(experts);
            let mut counts = vec![0u32; experts];
            let mut s = seed;
            for r in 0..rows {
                // Any k distinct experts of each row.
                let mut xs: Vec<usize> = (0..experts).collect();
                for i in 0..k {
                    s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407 + r as u64);
                    let j = i + (s >> 33) as usize % (experts - i);
                    xs.swap(i, j);
                    counts[xs[i]] += 1;
                }
            }
            let r = Routing::from_counts(rows, &counts, spec(experts, k, true)).unwrap();
            prop_assert_eq!(r.tokens_per_expert(), counts);
            for row in r.chosen.chunks(k) {
                let mut row = row.to_vec();
                row.sort();
                row.dedup();
                prop_assert_eq!(row.len(), k);
            }
        }

        #[test]
        fn logits_grad_matches_finite_differences(
            logits in prop::collection::vec(-2.0f32..2.0, 12),
            c in prop::collection::vec(-1.0f32..1.0, 4),
            normalize in any::<bool>(),
        ) {
            let s = spec(4, 2, normalize);
            let coef = 0.3;
            let r = Routing::from_logits(&logits, s);
            // A top-k choice that a small step flips has no derivative: skip near-ties.
            for row in r.probs.chunks(4) {
                let mut p = row.to_vec();
                p.sort_by(|a, b| b.total_cmp(a));
                prop_assume!(p[1] - p[2] > 1e-3);
            }
            let dweights: Vec<f32> = r.chosen.iter().map(|&x| c[x as usize]).collect();
            let mut lb = LoadBalance::default();
            lb.add(&r);
            let grad = r.logits_grad(&dweights, &lb.prob_grad(coef));
            let h = 1e-3f32;
            for i in 0..logits.len() {
                let (mut up, mut down) = (logits.clone(), logits.clone());
                up[i] += h;
                down[i] -= h;
                let fd = (objective(&up, s, &c, coef) - objective(&down, s, &c, coef)) / (2.0 * h as f64);
                prop_assert!((fd - grad[i] as f64).abs() < 2e-3, "logit {i}: {fd} vs {}", grad[i]);
            }
        }
    }
}
