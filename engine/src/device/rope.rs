//! Rotary position tables in Hugging Face's convention: for position `p` and pair `i < d/2`, the
//! angle `p · theta^(−2i/d)`, computed in f32 as Hugging Face does.

use crate::error::{try_vec, Result};

/// What the rotary tables are built from.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RopeSpec {
    /// Width of one head (even).
    pub head_dim: usize,
    /// The rotary base.
    pub theta: f64,
    /// Positions the tables cover.
    pub positions: usize,
}

impl RopeSpec {
    /// Elements of each of the two tables (`cos`, `sin`): `[positions, head_dim / 2]`.
    pub fn elements(&self) -> usize {
        self.positions.saturating_mul(self.head_dim / 2)
    }

    /// The tables, on the host.
    pub fn table(&self) -> Result<RopeTable> {
        let half = self.head_dim / 2;
        if half == 0 {
            return Ok(RopeTable {
                cos: Vec::new(),
                sin: Vec::new(),
                half,
            });
        }
        let inv_freq: Vec<f32> = (0..half)
            .map(|i| (1.0 / self.theta.powf((2 * i) as f64 / self.head_dim as f64)) as f32)
            .collect();
        let mut cos = try_vec(self.elements(), 0f32, "the rotary tables")?;
        let mut sin = try_vec(self.elements(), 0f32, "the rotary tables")?;
        for (p, (cos, sin)) in cos.chunks_mut(half).zip(sin.chunks_mut(half)).enumerate() {
            for ((c, s), &f) in cos.iter_mut().zip(sin.iter_mut()).zip(&inv_freq) {
                let angle = p as f32 * f;
                *c = angle.cos();
                *s = angle.sin();
            }
        }
        Ok(RopeTable { cos, sin, half })
    }
}

/// The rotary tables on the host.
#[derive(Clone, Debug)]
pub struct RopeTable {
    /// cos of every angle, `[positions, half]`.
    pub cos: Vec<f32>,
    /// sin of every angle, `[positions, half]`.
    pub sin: Vec<f32>,
    /// Half the head dimension.
    pub half: usize,
}

impl RopeTable {
    /// Tables for `positions` positions of heads of width `head_dim` with base `theta`.
    pub fn new(head_dim: usize, theta: f64, positions: usize) -> Result<Self> {
        RopeSpec {
            head_dim,
            theta,
            positions,
        }
        .table()
    }

    /// Bytes the tables hold.
    pub fn bytes(&self) -> u64 {
        ((self.cos.len() + self.sin.len()) * 4) as u64
    }
}
