//! [`Device`] for [`CudaDevice`]: typed launches of the kernels in `kernels.cu`, each passing
//! exactly the parameter types its kernel declares (`u64` for addresses and sizes, `u32`, `f32`,
//! and the `#[repr(C)]` structs), and cuBLAS products.

use super::attention::{
    attention_delta, attention_tiles, check_attention, dkv_shared, dq_shared, forward_shared,
    tensor_core_keys, tensor_core_shared, Attn, BLOCK, TC_ROWS, TC_THREADS,
};
use super::device::{cards_of_ranks, CudaDevice};
use super::gemm;
use super::tensor::{from_bytes, Buffer, CudaTensor};
use crate::backend::span;
use crate::device::dropout::{DropoutMask, DRAW_SHIFT};
use crate::device::rope::RopeSpec;
use crate::device::{AdamWArgs, AttnShape, Device, DeviceTensor, Operand, Out};
use crate::environment::ExecutionEnv;
use crate::error::{EngineError, Result};
use crate::memory::{Category, MemoryTracker};
use crate::optim::CHUNK;
use crate::tensor::{DType, Elem, Tensor};
use std::borrow::Cow;
use std::ffi::c_void;

/// Pointers to each argument, in order, as `cuLaunchKernel` takes them.
macro_rules! args {
    ($($a:expr),* $(,)?) => {
        &mut [$((&$a) as *const _ as *mut c_void),*]
    };
}

fn kernel<E: Elem>(base: &str) -> String {
    let suffix = match E::DTYPE {
        DType::F32 => "f32",
        DType::Bf16 => "bf16",
    };
    format!("{base}_{suffix}")
}

fn grid(n: usize, what: &str) -> Result<(u32, u32, u32)> {
    let b = u32::try_from(n).map_err(|_| {
        EngineError::Config(format!("{n} {what} are too many for one kernel launch"))
    })?;
    Ok((b, 1, 1))
}

/// One thread per element.
fn blocks(n: usize) -> Result<(u32, u32, u32)> {
    grid(n.div_ceil(BLOCK as usize), "elements")
}

/// One block per row.
fn rows_grid(rows: usize) -> Result<(u32, u32, u32)> {
    grid(rows, "rows")
}

/// The lengths (u32 elements) of the three uploads of the embedding's backward pass: the token
/// positions grouped by id, the group starts, and the groups' ids, padded to the batch's length
/// so that their size does not depend on the data.
pub(crate) fn grouped_lengths(rows: usize) -> [usize; 3] {
    [rows, rows + 1, rows]
}

/// Warps of a block of the RMSNorm weight gradient (`DW_WARPS` in kernels.cu): each sums a
/// share of the rows for the block's 32 columns.
const DW_WARPS: u32 = 32;

/// The bytes of the gradient norm's partial sums: one f64 per [`CHUNK`] elements of each tensor.
pub(crate) fn norm_partials_bytes(numels: impl Iterator<Item = usize>) -> u64 {
    numels.map(|n| n.div_ceil(CHUNK) as u64 * 8).sum()
}

/// Tensors in one launch of `sumsq_chunks` (`SUMSQ_TENSORS` in kernels.cu).
const SUMSQ_TENSORS: usize = 64;

/// The tensors of one launch of `sumsq_chunks`, laid out as its `SumsqList`: their addresses
/// and lengths, and where each one's chunks start in the launch's numbering of them.
#[repr(C)]
#[derive(Clone, Copy)]
struct SumsqList {
    x: [u64; SUMSQ_TENSORS],
    n: [u64; SUMSQ_TENSORS],
    first: [u64; SUMSQ_TENSORS + 1],
    count: u32,
}

impl SumsqList {
    /// The list of `tensors` (at most [`SUMSQ_TENSORS`]) and how many chunks they have in all.
    fn of(tensors: &[&CudaTensor<f32>]) -> (Self, usize) {
        let mut list = SumsqList {
            x: [0; SUMSQ_TENSORS],
            n: [0; SUMSQ_TENSORS],
            first: [0; SUMSQ_TENSORS + 1],
            count: tensors.len() as u32,
        };
        let mut chunks = 0;
        for (i, t) in tensors.iter().enumerate() {
            list.x[i] = t.ptr();
            list.n[i] = t.numel() as u64;
            chunks += t.numel().div_ceil(CHUNK);
            list.first[i + 1] = chunks as u64;
        }
        (list, chunks)
    }
}

/// The rotary tables on the device (counted as params).
pub struct RopeTables {
    cos: Buffer,
    sin: Buffer,
    half: usize,
}

/// Token ids on the device, and on the host for the embedding's backward grouping.
pub struct DeviceIds {
    host: Vec<u32>,
    buf: Buffer,
}

/// The device address of a packed batch's positions, 0 (a null pointer to the kernels) for none.
fn address(positions: Option<&DeviceIds>) -> u64 {
    positions.map_or(0, |p| p.buf.ptr())
}

/// A dropout mask as kernels.cu's `DropoutMask`.
#[repr(C)]
#[derive(Clone, Copy)]
struct DeviceMask {
    key: u64,
    threshold: u64,
    shift: u32,
    scale: f32,
}

impl DeviceMask {
    fn new(m: &DropoutMask) -> Self {
        DeviceMask {
            key: m.key(),
            threshold: m.threshold(),
            shift: DRAW_SHIFT,
            scale: m.scale(),
        }
    }
}

impl CudaDevice {
    /// Launches an element-wise kernel over `n` elements.
    fn each(&self, name: &str, n: usize, args: &mut [*mut c_void]) -> Result<()> {
        self.launch(name, blocks(n)?, BLOCK, 0, args)
    }

    /// Every chunk's f64 sum of squares of `tensors`, in order: one partial per [`CHUNK`]
    /// elements of each tensor, in a workspace of [`norm_partials_bytes`] (as the counting
    /// device leases it), summed by `sumsq_chunks` in launches of [`SUMSQ_TENSORS`] tensors.
    fn sum_squares_partials(&self, tensors: &[&CudaTensor<f32>]) -> Result<Vec<f64>> {
        let numels = tensors.iter().map(|t| t.numel());
        let partial = self.alloc(norm_partials_bytes(numels) as usize, Category::Workspace)?;
        let mut at = partial.ptr();
        for group in tensors.chunks(SUMSQ_TENSORS) {
            let (list, chunks) = SumsqList::of(group);
            let c = CHUNK as u64;
            self.each("sumsq_chunks", chunks, args![list, at, c])?;
            at += chunks as u64 * 8;
        }
        Ok(from_bytes(&self.download_bytes(&partial)?))
    }

    /// The rows the tensor-core attention kernels stream at a time for `s`, where they run:
    /// bf16 storage where [`CudaDevice::uses_tensor_core_attention`], a head width they have
    /// kernels for, and `pointers` (the tensors' data) aligned to the 16 bytes of a `cp.async`.
    fn tensor_core_tile<E: Elem>(&self, s: AttnShape, pointers: &[u64]) -> Option<usize> {
        let usable = E::DTYPE == DType::Bf16
            && self.uses_tensor_core_attention()
            && pointers.iter().all(|p| p % 16 == 0);
        usable.then(|| tensor_core_keys(s.head_dim)).flatten()
    }
}

impl Device for CudaDevice {
    type Tensor<E: Elem> = CudaTensor<E>;
    type Rope = RopeTables;
    type Ids = DeviceIds;
    type Labels = Buffer;

    fn tracker(&self) -> &MemoryTracker {
        CudaDevice::tracker(self)
    }

    fn host(&self) -> MemoryTracker {
        self.staging().clone()
    }

    fn execution_env(&self) -> ExecutionEnv {
        CudaDevice::execution_env(self)
    }

    fn zeros<E: Elem>(&self, shape: &[usize], category: Category) -> Result<CudaTensor<E>> {
        CudaDevice::zeros(self, shape, category)
    }

    fn uninit<E: Elem>(&self, shape: &[usize], category: Category) -> Result<CudaTensor<E>> {
        CudaDevice::uninit(self, shape, category)
    }

    fn upload<E: Elem>(&self, host: Tensor<E>) -> Result<CudaTensor<E>> {
        self.upload_copy(&host, host.category())
    }

    fn to_host<E: Elem>(&self, t: &CudaTensor<E>) -> Result<Vec<E>> {
        self.download(t)
    }

    fn raw_bytes<'a, E: Elem>(&self, t: &'a CudaTensor<E>) -> Result<Cow<'a, [u8]>> {
        Ok(Cow::Owned(self.download_bytes(t.buffer())?))
    }

    fn read_bytes<E: Elem>(&self, t: &CudaTensor<E>, offset: usize, len: usize) -> Result<Vec<u8>> {
        let range = span(t.buffer().bytes(), offset, len)?;
        self.download_from(t.ptr() + range.start as u64, range.len())
    }

    fn write_bytes<E: Elem>(
        &self,
        t: &mut CudaTensor<E>,
        offset: usize,
        bytes: &[u8],
    ) -> Result<()> {
        let range = span(t.buffer().bytes(), offset, bytes.len())?;
        self.upload_into(t.ptr() + range.start as u64, bytes)
    }

    fn ranks(&self, world: usize) -> Result<Vec<Self>> {
        match world {
            1 => Ok(vec![self.clone()]),
            _ => match cards_of_ranks(world, self.ordinal(), CudaDevice::count()) {
                Some(cards) => self.on_cards(cards),
                None => self.share(world),
            },
        }
    }

    /// This device's where each rank has a GPU of its own; else an equal share of it.
    fn rank_capacity(&self, world: usize) -> u64 {
        let capacity = self.tracker().stats().capacity;
        match cards_of_ranks(world, self.ordinal(), CudaDevice::count()) {
            Some(_) => capacity,
            None => capacity / world.max(1) as u64,
        }
    }

    fn copy<E: Elem>(&self, src: &CudaTensor<E>, dst: &mut CudaTensor<E>) -> Result<()> {
        CudaDevice::copy(self, src.ptr(), dst.ptr(), dst.bytes() as usize)
    }

    fn fill_zero(&self, t: &mut CudaTensor<f32>) -> Result<()> {
        self.memset_zero(t.ptr(), t.bytes() as usize)
    }

    fn round<E: Elem>(&self, src: &CudaTensor<f32>, dst: &mut CudaTensor<E>) -> Result<()> {
        let (n, s, d) = (src.numel() as u64, src.ptr(), dst.ptr());
        match E::DTYPE {
            DType::F32 => CudaDevice::copy(self, s, d, dst.bytes() as usize),
            DType::Bf16 => self.each("f32_to_bf16", src.numel(), args![s, d, n]),
        }
    }

    fn rope_tables(&self, spec: RopeSpec) -> Result<RopeTables> {
        let table = spec.table()?;
        Ok(RopeTables {
            cos: self.upload_slice(&table.cos, Category::Params)?,
            sin: self.upload_slice(&table.sin, Category::Params)?,
            half: table.half,
        })
    }

    fn ids(&self, ids: &[u32]) -> Result<DeviceIds> {
        Ok(DeviceIds {
            buf: self.upload_slice(ids, Category::Io)?,
            host: ids.to_vec(),
        })
    }

    fn labels(&self, labels: &[i64]) -> Result<Buffer> {
        self.upload_slice(labels, Category::Io)
    }

    fn check_attention(&self, shape: AttnShape) -> Result<()> {
        check_attention(shape)
    }

    fn matmul<A: Elem, B: Elem, C: Elem>(
        &self,
        dims: (usize, usize, usize),
        a: Operand<'_, CudaTensor<A>>,
        b: Operand<'_, CudaTensor<B>>,
        c: Out<'_, CudaTensor<C>>,
        accumulate: bool,
    ) -> Result<()> {
        let c = Operand {
            tensor: &*c.tensor,
            offset: c.offset,
            transposed: false,
        };
        gemm::matmul(self, dims, a.into(), b.into(), c.into(), accumulate)
    }

    fn embedding_forward<E: Elem>(
        &self,
        table: &CudaTensor<E>,
        ids: &DeviceIds,
        out: &mut CudaTensor<E>,
    ) -> Result<()> {
        let rows = ids.host.len() as u64;
        let width = out.numel() as u64 / rows.max(1);
        let (t, i, o) = (table.ptr(), ids.buf.ptr(), out.ptr());
        self.each(
            &kernel::<E>("embedding_fwd"),
            out.numel(),
            args![t, i, o, rows, width],
        )
    }

    /// Each id's rows are summed in token order by one block. The positions are grouped by id
    /// here on the host, where the ids are known.
    fn embedding_backward<E: Elem>(
        &self,
        dout: &CudaTensor<E>,
        ids: &DeviceIds,
        dtable: &mut CudaTensor<f32>,
    ) -> Result<()> {
        let ids = &ids.host;
        let mut order: Vec<u32> = (0..ids.len() as u32).collect();
        order.sort_by_key(|&p| (ids[p as usize], p));
        let mut distinct = Vec::new();
        let mut starts = Vec::new();
        for (k, &p) in order.iter().enumerate() {
            let id = ids[p as usize];
            if distinct.last() != Some(&id) {
                distinct.push(id);
                starts.push(k as u32);
            }
        }
        let groups = distinct.len();
        let [_, starts_len, ids_len] = grouped_lengths(ids.len());
        starts.resize(starts_len, order.len() as u32);
        distinct.resize(ids_len, 0);
        let positions = self.upload_slice(&order, Category::Io)?;
        let starts = self.upload_slice(&starts, Category::Io)?;
        let id_buf = self.upload_slice(&distinct, Category::Io)?;
        let width = dout.numel() as u64 / ids.len().max(1) as u64;
        let (d, p, s, i, t) = (
            dout.ptr(),
            positions.ptr(),
            starts.ptr(),
            id_buf.ptr(),
            dtable.ptr(),
        );
        self.launch(
            &kernel::<E>("embedding_bwd"),
            rows_grid(groups)?,
            BLOCK,
            0,
            args![d, p, s, i, t, width],
        )
    }

    fn rmsnorm_forward<E: Elem>(
        &self,
        x: &CudaTensor<E>,
        w: &CudaTensor<E>,
        eps: f32,
        y: &mut CudaTensor<E>,
        rinv: &mut CudaTensor<f32>,
    ) -> Result<()> {
        let h = w.numel() as u32;
        let (xp, wp, yp, rp) = (x.ptr(), w.ptr(), y.ptr(), rinv.ptr());
        self.launch(
            &kernel::<E>("rmsnorm_fwd"),
            rows_grid(rinv.numel())?,
            BLOCK,
            0,
            args![xp, wp, yp, rp, h, eps],
        )
    }

    /// `dw`'s rows are summed per column in `DW_WARPS` contiguous shares, each in row order,
    /// and the shares in order.
    fn rmsnorm_backward<E: Elem>(
        &self,
        dy: &CudaTensor<E>,
        x: &CudaTensor<E>,
        w: &CudaTensor<E>,
        rinv: &CudaTensor<f32>,
        dx: &mut CudaTensor<E>,
        dw: &mut CudaTensor<f32>,
    ) -> Result<()> {
        let h = w.numel() as u32;
        let rows = rinv.numel() as u64;
        let (dyp, xp, wp, rp) = (dy.ptr(), x.ptr(), w.ptr(), rinv.ptr());
        let (dxp, dwp) = (dx.ptr(), dw.ptr());
        self.launch(
            &kernel::<E>("rmsnorm_bwd_dx"),
            rows_grid(rinv.numel())?,
            BLOCK,
            0,
            args![dyp, xp, wp, rp, dxp, h],
        )?;
        self.launch(
            &kernel::<E>("rmsnorm_bwd_dw"),
            grid(w.numel().div_ceil(32), "column slabs")?,
            DW_WARPS * 32,
            0,
            args![dyp, xp, rp, dwp, rows, h],
        )
    }

    fn rope<E: Elem>(
        &self,
        x: &mut CudaTensor<E>,
        (width, seq): (usize, usize),
        tables: &RopeTables,
        positions: Option<&DeviceIds>,
        inverse: bool,
    ) -> Result<()> {
        let rows = (x.numel() / width) as u64;
        let (w, s, half) = (width as u32, seq as u32, tables.half as u32);
        let sign: f32 = if inverse { -1.0 } else { 1.0 };
        let (xp, c, sn) = (x.ptr(), tables.cos.ptr(), tables.sin.ptr());
        let pos = address(positions);
        self.each(
            &kernel::<E>("rope"),
            x.numel() / 2,
            args![xp, c, sn, rows, w, s, half, sign, pos],
        )
    }

    fn add_bias<E: Elem>(&self, y: &mut CudaTensor<E>, b: &CudaTensor<E>) -> Result<()> {
        let (n, width) = (y.numel() as u64, b.numel() as u32);
        let (yp, bp) = (y.ptr(), b.ptr());
        self.each(&kernel::<E>("add_bias"), y.numel(), args![yp, bp, n, width])
    }

    fn bias_grad<E: Elem>(&self, dy: &CudaTensor<E>, db: &mut CudaTensor<f32>) -> Result<()> {
        let width = db.numel() as u32;
        let rows = (dy.numel() / db.numel().max(1)) as u64;
        let (dyp, dbp) = (dy.ptr(), db.ptr());
        let name = kernel::<E>("bias_grad");
        self.each(&name, db.numel(), args![dyp, dbp, rows, width])
    }

    fn scale_rows<E: Elem>(&self, x: &mut CudaTensor<E>, w: &CudaTensor<E>) -> Result<()> {
        let n = x.numel() as u64;
        let width = n / w.numel().max(1) as u64;
        let (xp, wp) = (x.ptr(), w.ptr());
        self.each(
            &kernel::<E>("scale_rows"),
            x.numel(),
            args![xp, wp, n, width],
        )
    }

    fn scatter_add_rows<E: Elem>(
        &self,
        src: &CudaTensor<E>,
        rows: &DeviceIds,
        weights: Option<&CudaTensor<E>>,
        dst: &mut CudaTensor<E>,
    ) -> Result<()> {
        let n = src.numel() as u64;
        let width = n / rows.host.len().max(1) as u64;
        let (sp, rp, dp) = (src.ptr(), rows.buf.ptr(), dst.ptr());
        let wp = weights.map_or(0, |w| w.ptr());
        let name = kernel::<E>("scatter_add_rows");
        self.each(&name, src.numel(), args![sp, rp, wp, dp, n, width])
    }

    fn row_dots<E: Elem>(
        &self,
        a: &CudaTensor<E>,
        b: &CudaTensor<E>,
        out: &mut CudaTensor<f32>,
    ) -> Result<()> {
        let width = (a.numel() / out.numel().max(1)) as u32;
        let (ap, bp, op) = (a.ptr(), b.ptr(), out.ptr());
        self.launch(
            &kernel::<E>("row_dots"),
            rows_grid(out.numel())?,
            BLOCK,
            0,
            args![ap, bp, op, width],
        )
    }

    fn swiglu_forward<E: Elem>(
        &self,
        gate: &CudaTensor<E>,
        up: &CudaTensor<E>,
        act: &mut CudaTensor<E>,
    ) -> Result<()> {
        let n = act.numel() as u64;
        let (g, u, a) = (gate.ptr(), up.ptr(), act.ptr());
        self.each(&kernel::<E>("swiglu_fwd"), act.numel(), args![g, u, a, n])
    }

    fn swiglu_backward<E: Elem>(
        &self,
        dact: &CudaTensor<E>,
        (gate, up): (&CudaTensor<E>, &CudaTensor<E>),
        dgate: &mut CudaTensor<E>,
        dup: &mut CudaTensor<E>,
    ) -> Result<()> {
        let n = dact.numel() as u64;
        let (da, g, u, dg, du) = (dact.ptr(), gate.ptr(), up.ptr(), dgate.ptr(), dup.ptr());
        let name = kernel::<E>("swiglu_bwd");
        self.each(&name, dact.numel(), args![da, g, u, dg, du, n])
    }

    fn dropout_add<E: Elem>(
        &self,
        mask: &DropoutMask,
        x: &CudaTensor<E>,
        y: &CudaTensor<E>,
        out: &mut CudaTensor<E>,
    ) -> Result<()> {
        let (n, m) = (out.numel() as u64, DeviceMask::new(mask));
        let (xp, yp, op) = (x.ptr(), y.ptr(), out.ptr());
        let name = kernel::<E>("dropout_add");
        self.each(&name, out.numel(), args![xp, yp, op, n, m])
    }

    fn dropout_backward<E: Elem>(
        &self,
        mask: &DropoutMask,
        dout: &CudaTensor<E>,
        dy: &mut CudaTensor<E>,
    ) -> Result<()> {
        let (n, m) = (dy.numel() as u64, DeviceMask::new(mask));
        let (dp, yp) = (dout.ptr(), dy.ptr());
        self.each(&kernel::<E>("dropout_bwd"), dy.numel(), args![dp, yp, n, m])
    }

    fn attention_forward<E: Elem>(
        &self,
        s: AttnShape,
        positions: Option<&DeviceIds>,
        q: &CudaTensor<E>,
        k: &CudaTensor<E>,
        v: &CudaTensor<E>,
        out: &mut CudaTensor<E>,
        lse: &mut CudaTensor<f32>,
    ) -> Result<()> {
        check_attention(s)?;
        let (qp, kp, vp, op, lp) = (q.ptr(), k.ptr(), v.ptr(), out.ptr(), lse.ptr());
        if let Some(keys) = self.tensor_core_tile::<E>(s, &[qp, kp, vp, op]) {
            let a = Attn::new(s, (TC_ROWS, keys), address(positions));
            return self.launch(
                &format!("attn_tc_fwd_d{}", s.head_dim),
                a.grid(a.br, a.heads),
                TC_THREADS,
                tensor_core_shared(s.head_dim, keys) as u32,
                args![qp, kp, vp, op, lp, a],
            );
        }
        let tiles = attention_tiles(s.head_dim).expect("checked above");
        let (br, bc) = (tiles.forward_queries, tiles.forward_keys);
        let a = Attn::new(s, (br, bc), address(positions));
        let shared = forward_shared(s.head_dim, br, bc) as u32;
        self.launch(
            &kernel::<E>("attn_fwd"),
            a.grid(a.br, a.heads),
            BLOCK,
            shared,
            args![qp, kp, vp, op, lp, a],
        )
    }

    fn attention_backward<E: Elem>(
        &self,
        s: AttnShape,
        positions: Option<&DeviceIds>,
        q: &CudaTensor<E>,
        k: &CudaTensor<E>,
        v: &CudaTensor<E>,
        (out, lse): (&CudaTensor<E>, &CudaTensor<f32>),
        dout: &CudaTensor<E>,
        dq: &mut CudaTensor<E>,
        dk: &mut CudaTensor<E>,
        dv: &mut CudaTensor<E>,
    ) -> Result<()> {
        check_attention(s)?;
        let delta = attention_delta(self, &s)?;
        let (qp, kp, vp, op, lp) = (q.ptr(), k.ptr(), v.ptr(), out.ptr(), lse.ptr());
        let (dop, dp, dqp, dkp, dvp) = (dout.ptr(), delta.ptr(), dq.ptr(), dk.ptr(), dv.ptr());
        let pointers = [qp, kp, vp, dop, dqp, dkp, dvp];
        let d = s.head_dim;
        // The shape with each kernel's tile, the threads of a block, and each kernel's name and
        // shared memory; a block of either kernel owns `a.br` rows.
        let (a, threads, (dq_name, dq_bytes), (dkv_name, dkv_bytes)) =
            match self.tensor_core_tile::<E>(s, &pointers) {
                Some(keys) => {
                    let shared = tensor_core_shared(d, keys) as u32;
                    (
                        Attn::new(s, (TC_ROWS, keys), address(positions)),
                        TC_THREADS,
                        (format!("attn_tc_dq_d{d}"), shared),
                        (format!("attn_tc_dkv_d{d}"), shared),
                    )
                }
                None => {
                    let t = attention_tiles(d).expect("checked above").backward;
                    (
                        Attn::new(s, (t, t), address(positions)),
                        BLOCK,
                        (kernel::<E>("attn_bwd_dq"), dq_shared(d, t, t) as u32),
                        (kernel::<E>("attn_bwd_dkv"), dkv_shared(d, t, t) as u32),
                    )
                }
            };
        self.each(
            &kernel::<E>("attn_delta"),
            delta.numel(),
            args![op, dop, dp, a],
        )?;
        self.launch(
            &dq_name,
            a.grid(a.br, a.heads),
            threads,
            dq_bytes,
            args![qp, kp, vp, dop, lp, dp, dqp, a],
        )?;
        self.launch(
            &dkv_name,
            a.grid(a.br, a.kv_heads),
            threads,
            dkv_bytes,
            args![qp, kp, vp, dop, lp, dp, dkp, dvp, a],
        )
    }

    fn cross_entropy_rows<E: Elem>(
        &self,
        logits: &mut CudaTensor<E>,
        labels: &Buffer,
        row_loss: &mut CudaTensor<f32>,
        (start, len, vocab): (usize, usize, usize),
        scale: f32,
    ) -> Result<()> {
        let v = vocab as u32;
        let l = logits.ptr();
        let lab = labels.ptr() + (start * 8) as u64;
        let r = row_loss.ptr() + (start * 4) as u64;
        self.launch(
            &kernel::<E>("xent"),
            rows_grid(len)?,
            BLOCK,
            0,
            args![l, lab, r, v, scale],
        )
    }

    fn sum_squares(&self, t: &CudaTensor<f32>) -> Result<f64> {
        let partial = self.sum_squares_partials(&[t])?;
        Ok(partial.iter().sum::<f64>())
    }

    fn norm(&self, tensors: &[&CudaTensor<f32>]) -> Result<f64> {
        let partial = self.sum_squares_partials(tensors)?;
        let mut total = 0.0f64;
        let mut rest = partial.as_slice();
        for g in tensors {
            let (mine, tail) = rest.split_at(g.numel().div_ceil(CHUNK));
            total += mine.iter().sum::<f64>();
            rest = tail;
        }
        Ok(total.sqrt())
    }

    fn scale(&self, x: &mut CudaTensor<f32>, coef: f32) -> Result<()> {
        let (xp, n) = (x.ptr(), x.numel() as u64);
        self.each("scale_f32", x.numel(), args![xp, n, coef])
    }

    fn adamw_range(
        &self,
        p: &mut CudaTensor<f32>,
        g: &CudaTensor<f32>,
        (m, v): (&mut CudaTensor<f32>, &mut CudaTensor<f32>),
        a: AdamWArgs,
        (p_offset, g_offset): (usize, usize),
    ) -> Result<()> {
        let n = m.numel();
        let inside =
            |total: usize, offset: usize| offset.checked_add(n).is_some_and(|e| e <= total);
        if !inside(p.numel(), p_offset) || !inside(g.numel(), g_offset) || v.numel() != n {
            return Err(EngineError::Config(format!(
                "an AdamW range of {n} elements from {p_offset} (parameters of {}) and {g_offset} (gradients of {}) runs past them",
                p.numel(),
                g.numel()
            )));
        }
        let f32_bytes = std::mem::size_of::<f32>() as u64;
        let pp = p.ptr() + p_offset as u64 * f32_bytes;
        let gp = g.ptr() + g_offset as u64 * f32_bytes;
        let (mp, vp, count) = (m.ptr(), v.ptr(), n as u64);
        self.each("adamw", n, args![pp, gp, mp, vp, count, a])
    }

    fn adamw(
        &self,
        p: &mut CudaTensor<f32>,
        g: &CudaTensor<f32>,
        (m, v): (&mut CudaTensor<f32>, &mut CudaTensor<f32>),
        a: AdamWArgs,
    ) -> Result<()> {
        let n = p.numel() as u64;
        let (pp, gp, mp, vp) = (p.ptr(), g.ptr(), m.ptr(), v.ptr());
        self.each("adamw", p.numel(), args![pp, gp, mp, vp, n, a])
    }
}
