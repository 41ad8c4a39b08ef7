//! A rank's passes of a step as bytes, for ranks in processes of their own: each rank ends a
//! step with every rank's passes ([`PassOutput`]), from which it makes the step's output in
//! global micro-batch order, as one process holding every rank does. Floats travel as their
//! bits, so a NaN or an infinite loss arrives as it was.

use crate::error::{EngineError, Result};
use crate::model::PassOutput;

/// `passes` as bytes: their count, then each pass's fields in order, little-endian.
pub fn encode_passes(passes: &[PassOutput]) -> Vec<u8> {
    let mut out = Vec::new();
    let u64s = |out: &mut Vec<u8>, v: u64| out.extend_from_slice(&v.to_le_bytes());
    let lists = |out: &mut Vec<u8>, lists: &[Vec<u32>]| {
        u64s(out, lists.len() as u64);
        for list in lists {
            u64s(out, list.len() as u64);
            list.iter()
                .for_each(|v| out.extend_from_slice(&v.to_le_bytes()));
        }
    };
    u64s(&mut out, passes.len() as u64);
    for p in passes {
        out.extend_from_slice(&p.loss.to_le_bytes());
        out.extend_from_slice(&p.ce.to_le_bytes());
        out.extend_from_slice(&p.ce_sum.to_le_bytes());
        out.push(p.aux.is_some() as u8);
        out.extend_from_slice(&p.aux.unwrap_or(0.0).to_le_bytes());
        lists(&mut out, &p.tokens_per_expert);
        lists(&mut out, &p.experts_chosen);
        u64s(&mut out, p.tokens as u64);
        u64s(&mut out, p.recomputed_blocks as u64);
    }
    out
}

/// The passes rank `from` encoded with [`encode_passes`]; an error naming it where the bytes
/// are not such passes (a build of another version on that rank).
pub fn decode_passes(from: usize, bytes: &[u8]) -> Result<Vec<PassOutput>> {
    let mut at = Reader { bytes, at: 0 };
    let passes = read_passes(&mut at).filter(|_| at.at == bytes.len());
    passes.ok_or_else(|| {
        EngineError::Config(format!(
            "rank {from}'s passes of the step are not in this build's layout ({} bytes); run one build on every rank",
            bytes.len()
        ))
    })
}

fn read_passes(r: &mut Reader<'_>) -> Option<Vec<PassOutput>> {
    let count = r.u64()?;
    (0..count)
        .map(|_| {
            Some(PassOutput {
                loss: f32::from_le_bytes(r.take()?),
                ce: f32::from_le_bytes(r.take()?),
                ce_sum: f64::from_le_bytes(r.take()?),
                aux: {
                    let [some] = r.take()?;
                    let aux = f64::from_le_bytes(r.take()?);
                    (some == 1).then_some(aux)
                },
                tokens_per_expert: r.lists()?,
                experts_chosen: r.lists()?,
                tokens: r.u64()? as usize,
                recomputed_blocks: r.u64()? as usize,
            })
        })
        .collect()
}

/// Bytes read from the front.
struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl Reader<'_> {
    fn take<const N: usize>(&mut self) -> Option<[u8; N]> {
        let taken = self.bytes.get(self.at..self.at + N)?.try_into().ok()?;
        self.at += N;
        Some(taken)
    }

    fn u64(&mut self) -> Option<u64> {
        self.take().map(u64::from_le_bytes)
    }

    fn lists(&mut self) -> Option<Vec<Vec<u32>>> {
        let count = self.u64()?;
        (0..count)
            .map(|_| {
                let len = self.u64()?;
                let left = (self.bytes.len() - self.at) as u64 / 4;
                (len <= left).then_some(())?;
                (0..len)
                    .map(|_| self.take().map(u32::from_le_bytes))
                    .collect()
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pass(loss: f32, aux: Option<f64>) -> PassOutput {
        PassOutput {
            loss,
            ce: loss - 0.25,
            ce_sum: 12.5,
            aux,
            tokens_per_expert: vec![vec![3, 1, 0, 4], vec![]],
            experts_chosen: vec![vec![0, 3, 3, 1], vec![]],
            tokens: 8,
            recomputed_blocks: 2,
        }
    }

    #[test]
    fn passes_arrive_as_they_were_sent_nan_and_infinities_too() {
        let passes = vec![
            pass(2.5, Some(0.125)),
            pass(f32::NAN, None),
            pass(f32::INFINITY, Some(f64::NEG_INFINITY)),
        ];
        let got = decode_passes(1, &encode_passes(&passes)).unwrap();
        assert_eq!(got.len(), 3);
        for (got, sent) in got.iter().zip(&passes) {
            assert_eq!(got.loss.to_bits(), sent.loss.to_bits());
            assert_eq!(got.aux.map(f64::to_bits), sent.aux.map(f64::to_bits));
            assert_eq!(
                (&got.tokens_per_expert, &got.experts_chosen, got.tokens),
                (&sent.tokens_per_expert, &sent.experts_chosen, sent.tokens)
            );
        }
        assert_eq!(got[0], passes[0]);
        assert!(decode_passes(0, &encode_passes(&[])).unwrap().is_empty());
    }

    #[test]
    fn bytes_that_are_not_passes_are_refused_naming_the_rank() {
        let bytes = encode_passes(&[pass(1.0, None)]);
        for bad in [
            &bytes[..bytes.len() - 1],
            &[bytes.as_slice(), &[0]].concat()[..],
        ] {
            let e = decode_passes(2, bad).unwrap_err().to_string();
            assert!(
                e.contains("rank 2's passes of the step are not in this build's layout"),
                "{e}"
            );
        }
        let mut huge = encode_passes(&[]);
        huge[..8].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(decode_passes(2, &huge).is_err());
    }
}
