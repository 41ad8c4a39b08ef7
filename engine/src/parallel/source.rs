//! Where the ranks' tensors come from when they are built: rows of each whole f32 tensor (a
//! parameter's master weight or one of its AdamW moments), read either from whole tensors on
//! the host (fresh weights, one device's checkpoint) or from a sharded checkpoint's files, where
//! each rank reads only the rows it holds (`checkpoint::RankReads`).

use crate::error::Result;
use crate::model::Params;
use crate::tensor::Tensor;
use std::borrow::Cow;
use std::ops::Range;

/// Which of a parameter's whole f32 tensors a rank's tensor is built from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Which {
    /// The master weight (the weights themselves in fp32).
    Master,
    /// AdamW's first moment.
    ExpAvg,
    /// AdamW's second moment.
    ExpAvgSq,
}

impl Which {
    /// Every kind, in the order a rank is built from them.
    pub const ALL: [Which; 3] = [Which::Master, Which::ExpAvg, Which::ExpAvgSq];
}

/// Each rank's rows of one tensor as it holds them, and their little-endian bytes, in rank order.
pub type Placed<'a> = Vec<(Range<usize>, Cow<'a, [u8]>)>;

/// The rows of the whole tensors the ranks are built from.
pub trait RowSource: Sync {
    /// Writes rows `rows` of parameter `param`'s `which` tensor into `dst`, which holds exactly
    /// those rows (native-endian f32 bytes). The rank keeps rows `keep` of them (inside `rows`;
    /// the rest, such as a bf16 compute weight's f32 rows, are freed once used).
    fn read_rows(
        &self,
        which: Which,
        param: usize,
        rows: Range<usize>,
        keep: Range<usize>,
        dst: &mut [u8],
    ) -> Result<()>;
}

/// Whole tensors on the host: the master weights and, when resuming, the moments.
pub struct HostTensors<'a> {
    /// The f32 master weights.
    pub master: &'a Params<Tensor<f32>>,
    /// AdamW's first and second moments, if any.
    pub moments: Option<&'a [Params<Tensor<f32>>; 2]>,
}

impl RowSource for HostTensors<'_> {
    fn read_rows(
        &self,
        which: Which,
        param: usize,
        rows: Range<usize>,
        _keep: Range<usize>,
        dst: &mut [u8],
    ) -> Result<()> {
        let params = match (which, self.moments) {
            (Which::Master, _) => self.master,
            (Which::ExpAvg, Some([avg, _])) => avg,
            (Which::ExpAvgSq, Some([_, sq])) => sq,
            (_, None) => return Ok(()),
        };
        let t = params.tensors()[param];
        let row = t.as_bytes().len() / t.shape().first().copied().unwrap_or(1).max(1);
        dst.copy_from_slice(&t.as_bytes()[rows.start * row..rows.end * row]);
        Ok(())
    }
}
