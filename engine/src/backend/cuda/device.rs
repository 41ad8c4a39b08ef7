//! The CUDA device: a context and one stream, the device's default memory pool, a cuBLAS handle,
//! the compiled kernels, and the tracker that counts every byte handed out.

use super::tensor::{Buffer, CudaTensor};
use super::{env, nvrtc};
use crate::environment::ExecutionEnv;
use crate::error::{EngineError, Result};
use crate::memory::{Category, MemoryTracker, OutOfMemory};
use crate::tensor::{Elem, Tensor};
use cudarc::cublas::{result as blas, sys as blas_sys};
use cudarc::driver::{
    result as drv, sys as drv_sys, CudaContext, CudaFunction, CudaModule, CudaStream,
};
use serde::Serialize;
use std::collections::HashMap;
use std::ffi::c_void;
use std::ops::Range;
use std::sync::{Arc, Mutex};

/// The memory pool's and the driver's figures, in bytes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct PoolStats {
    /// Bytes the pool holds from the driver now.
    pub reserved_current: u64,
    /// Most bytes the pool has held.
    pub reserved_high: u64,
    /// Bytes of the pool in live allocations now.
    pub used_current: u64,
    /// Most bytes of the pool in live allocations at once.
    pub used_high: u64,
    /// Free device memory the driver reports.
    pub driver_free: u64,
    /// Total device memory the driver reports.
    pub driver_total: u64,
}

/// Why the CUDA backend cannot run here, if it cannot: a library that does not load.
pub(crate) fn libraries_missing() -> Option<String> {
    // SAFETY: each call only tries to open a shared library.
    if !unsafe { drv_sys::is_culib_present() } {
        return Some("libcuda could not be loaded; install the NVIDIA driver".into());
    }
    // SAFETY: as above.
    if !unsafe { blas_sys::is_culib_present() } {
        return Some("libcublas could not be loaded; install cuBLAS (libcublas.so.13) and put its directory on LD_LIBRARY_PATH".into());
    }
    nvrtc::available().err()
}

/// The GPUs of ranks `0..world` opened on GPU `first` of a machine with `gpus`: one each,
/// `first..first + world`, when there are that many from `first` on; else `None`, and they
/// share `first`. The ranks exchange through the host either way, so on GPUs of one model where
/// they run moves no bit of a step.
pub(crate) fn cards_of_ranks(world: usize, first: usize, gpus: usize) -> Option<Range<usize>> {
    (world > 1 && first + world <= gpus).then_some(first..first + world)
}

fn cuda_err(what: &str) -> impl FnOnce(drv::DriverError) -> EngineError + '_ {
    move |e| EngineError::Cuda(format!("{what}: {e}"))
}

fn blas_err(what: &str) -> impl FnOnce(blas::CublasError) -> EngineError + '_ {
    move |e| EngineError::Cuda(format!("{what}: {e}"))
}

/// A cuBLAS handle bound to the device's stream, destroyed with the device.
struct Blas(blas_sys::cublasHandle_t);

impl Drop for Blas {
    fn drop(&mut self) {
        // SAFETY: the handle was created by `CudaDevice::new` and is destroyed once. A failure
        // here cannot be reported and leaks nothing the process keeps.
        let _ = unsafe { blas::destroy_handle(self.0) };
    }
}

/// A new stream on `ctx` and a cuBLAS handle bound to it, with no workspace of its own (so
/// cuBLAS allocates nothing outside the tracker) and the default math mode.
fn stream_and_blas(ctx: &Arc<CudaContext>) -> Result<(Arc<CudaStream>, Blas)> {
    let stream = ctx.new_stream().map_err(cuda_err("cuStreamCreate"))?;
    let handle = Blas(blas::create_handle().map_err(blas_err("cublasCreate"))?);
    // SAFETY: the handle and the stream are live; a null workspace of 0 bytes makes cuBLAS
    // allocate nothing outside the tracker.
    unsafe {
        blas::set_stream(handle.0, stream.cu_stream() as _).map_err(blas_err("cublasSetStream"))?;
        blas_sys::cublasSetWorkspace_v2(handle.0, std::ptr::null_mut(), 0)
            .result()
            .map_err(blas_err("cublasSetWorkspace"))?;
        blas_sys::cublasSetMathMode(handle.0, blas_sys::cublasMath_t::CUBLAS_DEFAULT_MATH)
            .result()
            .map_err(blas_err("cublasSetMathMode"))?;
    }
    Ok((stream, handle))
}

struct Inner {
    blas: Mutex<Blas>,
    functions: Mutex<HashMap<String, CudaFunction>>,
    module: Arc<CudaModule>,
    pool: drv_sys::CUmemoryPool,
    stream: Arc<CudaStream>,
    ctx: Arc<CudaContext>,
    tracker: MemoryTracker,
    staging: MemoryTracker,
    name: String,
    tensor_core_attention: bool,
    env: ExecutionEnv,
}

// SAFETY: the pool is a driver handle usable from any thread once the context is current (every
// entry point binds it); the cuBLAS handle is only used under its mutex.
unsafe impl Send for Inner {}
// SAFETY: as above.
unsafe impl Sync for Inner {}

/// One GPU. Cloning shares it. Every tensor it hands out is leased from its tracker and
/// allocated stream-ordered from the device's default memory pool, which keeps freed memory
/// cached (its release threshold is unlimited) until [`CudaDevice::empty_pool`].
#[derive(Clone)]
pub struct CudaDevice {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for CudaDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "CudaDevice({}, {})",
            self.inner.ctx.ordinal(),
            self.inner.name
        )
    }
}

impl CudaDevice {
    /// The name of GPU 0 when the CUDA backend can run here, else why not.
    pub fn probe() -> Result<String, String> {
        if let Some(why) = libraries_missing() {
            return Err(why);
        }
        drv::init().map_err(|e| format!("cuInit failed ({e}); is an NVIDIA GPU present?"))?;
        let count = drv::device::get_count().map_err(|e| format!("cuDeviceGetCount: {e}"))?;
        if count < 1 {
            return Err("the driver reports no CUDA device".into());
        }
        let dev = drv::device::get(0).map_err(|e| format!("cuDeviceGet(0): {e}"))?;
        drv::device::get_name(dev).map_err(|e| format!("cuDeviceGetName: {e}"))
    }

    /// Opens GPU `ordinal` with a tracker of `capacity` bytes (the card's total when `None`),
    /// compiling or loading the kernels.
    pub fn new(ordinal: usize, capacity: Option<u64>) -> Result<Self> {
        if let Some(why) = libraries_missing() {
            return Err(EngineError::NoGpu(why));
        }
        let ctx = CudaContext::new(ordinal)
            .map_err(|e| EngineError::NoGpu(format!("cannot open CUDA device {ordinal}: {e}")))?;
        let name = ctx.name().map_err(cuda_err("cuDeviceGetName"))?;
        let (major, minor) = ctx
            .compute_capability()
            .map_err(cuda_err("compute capability"))?;
        let total = ctx.total_mem().map_err(cuda_err("cuDeviceTotalMem"))? as u64;
        let tensor_core_attention =
            major >= 8 && super::attention::tensor_core_attention_allowed()?;
        // SAFETY: the device handle comes from a live context.
        let pool = unsafe { drv::device::get_default_mem_pool(ctx.cu_device()) }
            .map_err(cuda_err("cuDeviceGetDefaultMemPool"))?;
        let mut threshold = u64::MAX;
        // SAFETY: the release threshold attribute is a u64.
        unsafe {
            drv::mem_pool::set_attribute(
                pool,
                drv_sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                (&mut threshold as *mut u64).cast(),
            )
        }
        .map_err(cuda_err("setting the pool's release threshold"))?;
        let cubin = nvrtc::cubin(&name, &env::arch(major, minor)).map_err(EngineError::Cuda)?;
        let module = ctx
            .load_module(cudarc::nvrtc::Ptx::from_binary(cubin))
            .map_err(cuda_err("loading the kernels"))?;
        let (stream, blas_handle) = stream_and_blas(&ctx)?;
        let env = env::record(
            &ctx,
            &name,
            (major, minor),
            blas_handle.0,
            tensor_core_attention,
        )?;
        Ok(CudaDevice {
            inner: Arc::new(Inner {
                blas: Mutex::new(blas_handle),
                functions: Mutex::new(HashMap::new()),
                module,
                pool,
                stream,
                ctx,
                tracker: MemoryTracker::new(capacity.unwrap_or(total)),
                staging: MemoryTracker::new(crate::memory::host_available().unwrap_or(u64::MAX)),
                name,
                tensor_core_attention,
                env,
            }),
        })
    }

    /// The devices of `world` data-parallel ranks sharing this GPU, as ranks on a machine with
    /// one card run: each with its own stream, cuBLAS handle and tracker of an equal share of
    /// this device's capacity; the context, the kernels and the memory pool shared. Their
    /// exchanges pass through the host, so the bits and each rank's memory are those of ranks on
    /// cards of their own.
    pub(crate) fn share(&self, world: usize) -> Result<Vec<Self>> {
        self.bind()?;
        let capacity = self.inner.tracker.stats().capacity / world.max(1) as u64;
        (0..world)
            .map(|_| {
                let (stream, blas) = stream_and_blas(&self.inner.ctx)?;
                Ok(CudaDevice {
                    inner: Arc::new(Inner {
                        blas: Mutex::new(blas),
                        functions: Mutex::new(HashMap::new()),
                        module: self.inner.module.clone(),
                        pool: self.inner.pool,
                        stream,
                        ctx: self.inner.ctx.clone(),
                        tracker: MemoryTracker::new(capacity),
                        staging: MemoryTracker::new(self.inner.staging.stats().capacity),
                        name: self.inner.name.clone(),
                        tensor_core_attention: self.inner.tensor_core_attention,
                        env: self.inner.env.clone(),
                    }),
                })
            })
            .collect()
    }

    /// The devices of data-parallel ranks on GPUs `cards` ([`cards_of_ranks`]), a GPU each,
    /// the first this one: each with a tracker of this device's capacity. GPUs of another model
    /// than this one are refused: cuBLAS picks its kernels by GPU, so their bits would differ.
    pub(crate) fn on_cards(&self, cards: Range<usize>) -> Result<Vec<Self>> {
        let capacity = Some(self.inner.tracker.stats().capacity);
        let mut ranks = self.share(1)?;
        for ordinal in cards.skip(1) {
            let rank = CudaDevice::new(ordinal, capacity)?;
            if rank.name() != self.name() {
                return Err(EngineError::Config(format!(
                    "the ranks would run on GPU {} ({}) and GPU {ordinal} ({}): GPUs of \
                     different models do not compute the same bits; list GPUs of one model in \
                     CUDA_VISIBLE_DEVICES",
                    self.ordinal(),
                    self.name(),
                    rank.name()
                )));
            }
            ranks.push(rank);
        }
        Ok(ranks)
    }

    /// The tracker counting this device's bytes.
    pub fn tracker(&self) -> &MemoryTracker {
        &self.inner.tracker
    }

    /// The GPU's index among the machine's.
    pub fn ordinal(&self) -> usize {
        self.inner.ctx.ordinal()
    }

    /// How many GPUs the driver sees; 0 where the CUDA backend cannot run.
    pub fn count() -> usize {
        if libraries_missing().is_some() || drv::init().is_err() {
            return 0;
        }
        drv::device::get_count().map_or(0, |n| n.max(0) as usize)
    }

    /// The GPU's name.
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// Whether bf16 attention runs on tensor cores here: the GPU runs bf16 `mma.sync` (compute
    /// capability 8.0 or later) and `CKPT_CUDA_ATTENTION` does not ask for the tiled kernels.
    pub fn uses_tensor_core_attention(&self) -> bool {
        self.inner.tensor_core_attention
    }

    /// What the device's results depend on: the GPU, the driver, NVRTC, cuBLAS and the kernels.
    pub fn execution_env(&self) -> ExecutionEnv {
        self.inner.env.clone()
    }

    /// The tracker of the host tensors read or drawn before they are uploaded.
    pub fn staging(&self) -> &MemoryTracker {
        &self.inner.staging
    }

    /// The pool's reserved and used bytes (current and high-water) and the driver's free and
    /// total memory.
    pub fn pool_stats(&self) -> Result<PoolStats> {
        self.bind()?;
        let attr = |a: drv_sys::CUmemPool_attribute| -> Result<u64> {
            let mut v = 0u64;
            // SAFETY: these pool attributes are u64s.
            unsafe {
                drv::mem_pool::get_attribute(self.inner.pool, a, (&mut v as *mut u64).cast())
            }
            .map_err(cuda_err("cuMemPoolGetAttribute"))?;
            Ok(v)
        };
        use drv_sys::CUmemPool_attribute as A;
        let (free, total) = drv::mem_get_info().map_err(cuda_err("cuMemGetInfo"))?;
        Ok(PoolStats {
            reserved_current: attr(A::CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT)?,
            reserved_high: attr(A::CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH)?,
            used_current: attr(A::CU_MEMPOOL_ATTR_USED_MEM_CURRENT)?,
            used_high: attr(A::CU_MEMPOOL_ATTR_USED_MEM_HIGH)?,
            driver_free: free as u64,
            driver_total: total as u64,
        })
    }

    /// Waits for the stream, then gives every cached byte of the pool back to the driver.
    pub fn empty_pool(&self) -> Result<()> {
        self.sync()?;
        // SAFETY: the pool is the device's default pool.
        unsafe { drv::mem_pool::trim_to(self.inner.pool, 0) }.map_err(cuda_err("cuMemPoolTrimTo"))
    }

    /// Waits until every queued operation has finished.
    pub fn sync(&self) -> Result<()> {
        self.bind()?;
        self.inner
            .stream
            .synchronize()
            .map_err(cuda_err("cuStreamSynchronize"))
    }

    /// Makes the device's context current on the calling thread.
    pub(crate) fn bind(&self) -> Result<()> {
        self.inner
            .ctx
            .bind_to_thread()
            .map_err(cuda_err("binding the CUDA context"))
    }

    pub(crate) fn stream(&self) -> drv_sys::CUstream {
        self.inner.stream.cu_stream()
    }

    /// `bytes` of device memory counted under `category`: a tracker lease first (so the
    /// configured capacity is enforced), then a stream-ordered allocation from the pool.
    pub(crate) fn alloc(&self, bytes: usize, category: Category) -> Result<Buffer> {
        let lease = self.inner.tracker.allocate(bytes as u64, category)?;
        if bytes == 0 {
            return Ok(Buffer::new(0, lease, self.clone()));
        }
        self.bind()?;
        // SAFETY: the pool and the stream belong to this device's context, which is current.
        match unsafe { drv::mem_pool::alloc_async(self.inner.pool, bytes, self.stream()) } {
            Ok(ptr) => Ok(Buffer::new(ptr, lease, self.clone())),
            Err(e) if e.0 == drv_sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY => {
                let s = self.inner.tracker.stats();
                drop(lease);
                Err(OutOfMemory {
                    requested: bytes as u64,
                    category,
                    capacity: s.capacity,
                    allocated: s.allocated.current,
                    reserved: self.pool_stats().map_or(0, |p| p.reserved_current),
                    by_category: s.current,
                }
                .into())
            }
            Err(e) => Err(EngineError::Cuda(format!(
                "cuMemAllocFromPoolAsync({bytes} bytes): {e}"
            ))),
        }
    }

    /// Returns a buffer to the pool, after the work queued so far.
    pub(crate) fn free(&self, ptr: drv_sys::CUdeviceptr) {
        if self.bind().is_ok() {
            // SAFETY: `ptr` came from `alloc` and is freed once, stream-ordered after its uses.
            // A failure cannot be reported from a destructor; the pool is trimmed later anyway.
            let _ = unsafe { drv::free_async(ptr, self.stream()) };
        }
    }

    /// A zero-filled tensor of `shape`, counted under `category`.
    pub fn zeros<E: Elem>(&self, shape: &[usize], category: Category) -> Result<CudaTensor<E>> {
        let t = self.uninit(shape, category)?;
        self.memset_zero(t.ptr(), t.buffer().bytes())?;
        Ok(t)
    }

    /// A tensor of `shape` whose memory is left as the pool hands it out, counted under
    /// `category`: for outputs written in full before they are read.
    pub fn uninit<E: Elem>(&self, shape: &[usize], category: Category) -> Result<CudaTensor<E>> {
        let Some(bytes) = crate::tensor::bytes_of::<E>(shape) else {
            return Err(self.inner.tracker.refuse(u64::MAX, category).into());
        };
        let buf = self.alloc(bytes, category)?;
        Ok(CudaTensor::from_parts(buf, shape.to_vec()))
    }

    /// A device copy of the host tensor `t`, counted under `category`.
    pub fn upload_copy<E: Elem>(&self, t: &Tensor<E>, category: Category) -> Result<CudaTensor<E>> {
        let buf = self.upload_slice(t.as_slice(), category)?;
        Ok(CudaTensor::from_parts(buf, t.shape().to_vec()))
    }

    /// A device copy of `data`, counted under `category`.
    pub(crate) fn upload_slice<T: bytemuck::Pod>(
        &self,
        data: &[T],
        category: Category,
    ) -> Result<Buffer> {
        let buf = self.alloc(std::mem::size_of_val(data), category)?;
        if !data.is_empty() {
            // SAFETY: the buffer holds exactly `data`'s bytes; a copy from pageable memory has
            // taken them before it returns.
            unsafe { drv::memcpy_htod_async(buf.ptr(), data, self.stream()) }
                .map_err(cuda_err("cuMemcpyHtoDAsync"))?;
        }
        Ok(buf)
    }

    /// Copies `bytes` to device memory at `ptr`, which holds at least as many (checked by
    /// callers).
    pub(crate) fn upload_into(&self, ptr: drv_sys::CUdeviceptr, bytes: &[u8]) -> Result<()> {
        if bytes.is_empty() {
            return Ok(());
        }
        self.bind()?;
        // SAFETY: the destination holds `bytes.len()` bytes; a copy from pageable memory has
        // taken them before it returns.
        unsafe { drv::memcpy_htod_async(ptr, bytes, self.stream()) }
            .map_err(cuda_err("cuMemcpyHtoDAsync"))
    }

    /// The bytes of a device buffer, after every queued operation.
    pub(crate) fn download_bytes(&self, buf: &Buffer) -> Result<Vec<u8>> {
        self.download_from(buf.ptr(), buf.bytes())
    }

    /// `len` bytes of device memory from `ptr` (which must hold them), after every queued
    /// operation.
    pub(crate) fn download_from(&self, ptr: drv_sys::CUdeviceptr, len: usize) -> Result<Vec<u8>> {
        let mut out = vec![0u8; len];
        self.bind()?;
        if !out.is_empty() {
            // SAFETY: the caller's `ptr` holds `len` bytes, as `out` does; the stream is
            // synchronised before `out` is read.
            unsafe { drv::memcpy_dtoh_async(&mut out, ptr, self.stream()) }
                .map_err(cuda_err("cuMemcpyDtoHAsync"))?;
        }
        self.sync()?;
        Ok(out)
    }

    /// The elements of a device tensor on the host.
    pub fn download<E: Elem>(&self, t: &CudaTensor<E>) -> Result<Vec<E>> {
        let bytes = self.download_bytes(t.buffer())?;
        Ok(super::tensor::from_bytes(&bytes))
    }

    /// `dst = src` for two buffers of the same size.
    pub(crate) fn copy(
        &self,
        src: drv_sys::CUdeviceptr,
        dst: drv_sys::CUdeviceptr,
        bytes: usize,
    ) -> Result<()> {
        if bytes == 0 {
            return Ok(());
        }
        self.bind()?;
        // SAFETY: both buffers hold `bytes` bytes (checked by callers).
        unsafe { drv::memcpy_dtod_async(dst, src, bytes, self.stream()) }
            .map_err(cuda_err("cuMemcpyDtoDAsync"))
    }

    /// Zeroes `bytes` bytes at `ptr`.
    pub(crate) fn memset_zero(&self, ptr: drv_sys::CUdeviceptr, bytes: usize) -> Result<()> {
        if bytes == 0 {
            return Ok(());
        }
        self.bind()?;
        // SAFETY: `ptr` holds `bytes` bytes.
        unsafe { drv::memset_d8_async(ptr, 0, bytes, self.stream()) }
            .map_err(cuda_err("cuMemsetD8Async"))
    }

    /// Queues kernel `name` on the stream. `args` point at values of exactly the kernel's
    /// parameter types.
    pub(crate) fn launch(
        &self,
        name: &str,
        grid: (u32, u32, u32),
        block: u32,
        shared_bytes: u32,
        args: &mut [*mut c_void],
    ) -> Result<()> {
        if grid.0 == 0 || grid.1 == 0 || grid.2 == 0 {
            return Ok(());
        }
        self.bind()?;
        let f = {
            let mut fns = self
                .inner
                .functions
                .lock()
                .unwrap_or_else(|e| e.into_inner());
            match fns.get(name) {
                Some(f) => f.cu_function(),
                None => {
                    let f = self
                        .inner
                        .module
                        .load_function(name)
                        .map_err(|e| EngineError::Cuda(format!("kernel {name}: {e}")))?;
                    let raw = f.cu_function();
                    fns.insert(name.to_string(), f);
                    raw
                }
            }
        };
        // SAFETY: `f` is a kernel of the loaded module; `args` match its parameters (each
        // wrapper in `kernels.rs` is written against its signature in kernels.cu).
        unsafe { drv::launch_kernel(f, grid, (block, 1, 1), shared_bytes, self.stream(), args) }
            .map_err(|e| EngineError::Cuda(format!("launching {name}: {e}")))
    }

    /// Runs `f` with the cuBLAS handle, held exclusively.
    pub(crate) fn with_blas<R>(
        &self,
        f: impl FnOnce(blas_sys::cublasHandle_t) -> Result<R>,
    ) -> Result<R> {
        self.bind()?;
        let guard = self.inner.blas.lock().unwrap_or_else(|e| e.into_inner());
        f(guard.0)
    }
}

#[cfg(test)]
mod tests {
    use super::cards_of_ranks;

    #[test]
    fn ranks_get_cards_of_their_own_only_where_there_are_enough_from_the_first() {
        assert_eq!(cards_of_ranks(4, 0, 8), Some(0..4));
        assert_eq!(cards_of_ranks(3, 5, 8), Some(5..8));
        assert_eq!(cards_of_ranks(4, 5, 8), None);
        assert_eq!(cards_of_ranks(2, 0, 1), None);
        assert_eq!(cards_of_ranks(1, 0, 8), None);
    }
}
