//! bf16 to and from f32 without branches, so that loops over them vectorise: the bits of the
//! `half` crate's conversions (round to nearest even, NaN kept quiet and its sign and top
//! mantissa bits kept), which branch per element.

/// All ones when `b`, else zero.
#[inline(always)]
fn mask(b: bool) -> u32 {
    (b as u32).wrapping_neg()
}

/// `x` rounded to bf16's bits, to nearest even; a NaN keeps its top bits, made quiet.
#[inline(always)]
pub(crate) fn from_f32(x: f32) -> u16 {
    let b = x.to_bits();
    let nan = mask(b & 0x7FFF_FFFF > 0x7F80_0000);
    let rounded = b.wrapping_add(0x7FFF + ((b >> 16) & 1)) >> 16;
    let quiet = (b >> 16) | 0x0040;
    ((nan & quiet) | (!nan & rounded)) as u16
}

/// bf16's bits widened to f32 (exact); a NaN made quiet.
#[inline(always)]
pub(crate) fn to_f32(bits: u16) -> f32 {
    let b = u32::from(bits);
    let nan = mask(b & 0x7FFF > 0x7F80);
    f32::from_bits(((nan & 0x0040) | b) << 16)
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::bf16;

    #[test]
    fn every_bf16_widens_to_the_bits_half_gives() {
        for bits in 0..=u16::MAX {
            let want = bf16::from_bits(bits).to_f32().to_bits();
            assert_eq!(to_f32(bits).to_bits(), want, "{bits:#06x}");
        }
    }

    #[test]
    fn f32s_round_to_the_bits_half_gives() {
        // Every 61st bit pattern (61 is prime, so all low 16 bits and ties come round), and
        // each tie, its neighbours and the NaN and infinity edges at every high half.
        let strided = (0..=u32::MAX).step_by(61);
        let edges = (0..=u32::from(u16::MAX)).flat_map(|hi| {
            let base = hi << 16;
            [0, 1, 0x7FFF, 0x8000, 0x8001, 0xFFFF].map(|low| base | low)
        });
        for b in strided.chain(edges) {
            let x = f32::from_bits(b);
            assert_eq!(from_f32(x), bf16::from_f32(x).to_bits(), "{b:#010x}");
        }
    }
}
