//! Residual dropout with a counter-based generator: whether an element is kept is a pure function
//! of (seed, step offset, layer, site, element index), so the backward pass and a recomputed
//! forward pass regenerate the same mask without storing it, on any number of threads.

/// The dropout of one training pass: probability and where the generator stands.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Dropout {
    /// Probability of zeroing an element (in `(0, 1)`).
    pub p: f32,
    /// The run's generator seed.
    pub seed: u64,
    /// The generator's offset: one per micro-batch (per training step without accumulation).
    pub offset: u64,
}

/// Where in a block dropout is applied.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Site {
    /// The attention output projection, before it joins the residual stream.
    Attention = 0,
    /// The MLP output projection, before it joins the residual stream.
    Mlp = 1,
}

/// The mask of one site of one layer in one step.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DropoutMask {
    key: u64,
    threshold: u64,
    scale: f32,
}

/// Bits of each draw compared with the threshold.
const DRAW_BITS: u32 = 24;

/// How far a 64-bit draw is shifted right to keep its top `DRAW_BITS` bits.
pub const DRAW_SHIFT: u32 = 64 - DRAW_BITS;

const GOLDEN: u64 = 0x9E37_79B9_7F4A_7C15;

/// SplitMix64's output function: a bijective mix of 64 bits.
fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

impl Dropout {
    /// The mask of `site` in block `layer`.
    pub fn mask(&self, layer: usize, site: Site) -> DropoutMask {
        let mut key = mix(self.seed.wrapping_add(GOLDEN));
        for word in [self.offset, layer as u64, site as u64] {
            key = mix(key ^ word.wrapping_add(GOLDEN));
        }
        DropoutMask {
            key,
            threshold: (f64::from(self.p) * f64::from(1u32 << DRAW_BITS)) as u64,
            scale: 1.0 / (1.0 - self.p),
        }
    }
}

impl DropoutMask {
    /// Whether element `index` is kept: the `index`-th draw of a SplitMix64 stream keyed by the
    /// mask, compared with the probability.
    #[inline(always)]
    pub fn keeps(&self, index: u64) -> bool {
        let draw = mix(self
            .key
            .wrapping_add(index.wrapping_add(1).wrapping_mul(GOLDEN)));
        draw >> DRAW_SHIFT >= self.threshold
    }

    /// The key of the mask's draw stream (the GPU kernels draw from it too).
    pub fn key(&self) -> u64 {
        self.key
    }

    /// The smallest draw (of `DRAW_BITS` bits) that keeps an element.
    pub fn threshold(&self) -> u64 {
        self.threshold
    }

    /// The factor kept elements are multiplied by, `1 / (1 − p)`.
    pub fn scale(&self) -> f32 {
        self.scale
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn masks_drop_about_p_and_differ_by_step_layer_and_site() {
        let d = Dropout {
            p: 0.25,
            seed: 9,
            offset: 4,
        };
        let kept = |m: DropoutMask| (0..100_000u64).map(|i| m.keeps(i) as u32).sum::<u32>();
        let base = d.mask(1, Site::Attention);
        let share = kept(base) as f64 / 100_000.0;
        assert!((share - 0.75).abs() < 0.01, "kept {share}");
        let bits = |m: DropoutMask| (0..256u64).map(|i| m.keeps(i)).collect::<Vec<_>>();
        assert_eq!(bits(base), bits(d.mask(1, Site::Attention)));
        assert_ne!(bits(base), bits(d.mask(1, Site::Mlp)));
        assert_ne!(bits(base), bits(d.mask(2, Site::Attention)));
        assert_ne!(
            bits(base),
            bits(Dropout { offset: 5, ..d }.mask(1, Site::Attention))
        );
        assert_ne!(
            bits(base),
            bits(Dropout { seed: 8, ..d }.mask(1, Site::Attention))
        );
        assert!((base.scale() - 4.0 / 3.0).abs() < 1e-6);
    }
}
