//! The CPU backend: host tensors, rayon-threaded vectorised kernels, and the numerical reference
//! every other backend is tested against.

mod host_buffer;
pub mod kernels;

use std::fmt;
use std::sync::Arc;

use half::{bf16, f16};

use crate::{
    AllocHook, Backend, DType, Device, Element, Error, Result, Shape, Tensor, TrackedAllocation,
};
use host_buffer::HostBuffer;
use kernels::{FloatSlice, FloatSliceMut};

/// A tensor in host memory, 64-byte aligned.
pub struct CpuTensor {
    data: HostBuffer,
    shape: Shape,
    dtype: DType,
    allocation: TrackedAllocation,
}

impl CpuTensor {
    /// The data as a slice of `T`; `T` must match the dtype.
    pub fn as_slice<T: Element>(&self) -> Result<&[T]> {
        self.expect_dtype("as_slice", T::DTYPE)?;
        Ok(self.data.typed())
    }

    /// The data as a mutable slice of `T`; `T` must match the dtype.
    pub fn as_mut_slice<T: Element>(&mut self) -> Result<&mut [T]> {
        self.expect_dtype("as_mut_slice", T::DTYPE)?;
        Ok(self.data.typed_mut())
    }

    /// The raw little-endian bytes.
    pub fn as_bytes(&self) -> &[u8] {
        self.data.bytes()
    }

    /// The raw bytes, mutably.
    pub fn as_bytes_mut(&mut self) -> &mut [u8] {
        self.data.bytes_mut()
    }

    /// The data as a float slice of its own precision; errors for integer dtypes.
    pub fn float_slice(&self, op: &'static str) -> Result<FloatSlice<'_>> {
        Ok(match self.dtype {
            DType::F32 => FloatSlice::F32(self.data.typed()),
            DType::F16 => FloatSlice::F16(self.data.typed::<f16>()),
            DType::BF16 => FloatSlice::BF16(self.data.typed::<bf16>()),
            dtype => return Err(Error::UnsupportedDType { op, dtype }),
        })
    }

    /// The data as a mutable float slice of its own precision; errors for integer dtypes.
    pub fn float_slice_mut(&mut self, op: &'static str) -> Result<FloatSliceMut<'_>> {
        Ok(match self.dtype {
            DType::F32 => FloatSliceMut::F32(self.data.typed_mut()),
            DType::F16 => FloatSliceMut::F16(self.data.typed_mut::<f16>()),
            DType::BF16 => FloatSliceMut::BF16(self.data.typed_mut::<bf16>()),
            dtype => return Err(Error::UnsupportedDType { op, dtype }),
        })
    }

    /// The allocation event this tensor was reported with.
    pub fn allocation(&self) -> &TrackedAllocation {
        &self.allocation
    }

    fn expect_dtype(&self, op: &'static str, expected: DType) -> Result<()> {
        if self.dtype != expected {
            return Err(Error::DTypeMismatch {
                op,
                expected,
                got: self.dtype,
            });
        }
        Ok(())
    }
}

impl Tensor for CpuTensor {
    fn shape(&self) -> &Shape {
        &self.shape
    }
    fn dtype(&self) -> DType {
        self.dtype
    }
    fn device(&self) -> Device {
        Device::Cpu
    }
    fn reshape(&mut self, shape: Shape) -> Result<()> {
        self.shape = self.shape.reshape_to(shape)?;
        Ok(())
    }
}

impl fmt::Debug for CpuTensor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CpuTensor")
            .field("shape", &self.shape)
            .field("dtype", &self.dtype)
            .field("category", &self.allocation.event().category)
            .finish()
    }
}

/// The CPU backend. Cheap to clone (the pool and hook are shared).
///
/// By default kernels run on rayon's global pool; [`Cpu::with_threads`] gives the backend a pool
/// of its own (results are bitwise identical either way).
#[derive(Clone, Default)]
pub struct Cpu {
    pool: Option<Arc<rayon::ThreadPool>>,
    hook: Option<Arc<dyn AllocHook>>,
    cache: Option<Arc<host_buffer::BufferCache>>,
}

impl fmt::Debug for Cpu {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Cpu")
            .field("threads", &self.num_threads())
            .field("hooked", &self.hook.is_some())
            .field("cached_bytes", &self.cached_bytes())
            .finish()
    }
}

impl Cpu {
    /// A CPU backend on rayon's global thread pool, with no allocation hook.
    pub fn new() -> Self {
        Cpu::default()
    }

    /// A CPU backend with a dedicated pool of `threads` threads.
    pub fn with_threads(threads: usize) -> Result<Self> {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .thread_name(|i| format!("headroom-cpu-{i}"))
            .build()
            .map_err(|e| Error::Backend {
                device: Device::Cpu,
                op: "thread pool",
                source: Box::new(e),
            })?;
        Ok(Cpu {
            pool: Some(Arc::new(pool)),
            hook: None,
            cache: None,
        })
    }

    /// The same backend, reporting every allocation to `hook`.
    pub fn with_alloc_hook(mut self, hook: Arc<dyn AllocHook>) -> Self {
        self.hook = Some(hook);
        self
    }

    /// The same backend, keeping freed tensor buffers (up to `max_bytes`) for reuse by later
    /// allocations of the same size. A training loop that allocates the same shapes every step
    /// then stops paying page faults and kernel page-clearing for them. Allocation hooks see
    /// exactly what they see without the cache (cached bytes are not live tensors); the cache
    /// is shared by clones of this backend.
    pub fn with_buffer_cache(mut self, max_bytes: usize) -> Self {
        self.cache = Some(Arc::new(host_buffer::BufferCache::new(max_bytes)));
        self
    }

    /// Bytes of freed buffers held for reuse (0 without a cache).
    pub fn cached_bytes(&self) -> usize {
        self.cache.as_ref().map_or(0, |c| c.cached_bytes())
    }

    /// Threads the kernels run on.
    pub fn num_threads(&self) -> usize {
        match &self.pool {
            Some(p) => p.current_num_threads(),
            None => rayon::current_num_threads(),
        }
    }

    /// Run `f` on this backend's pool, so rayon work inside it uses the backend's threads.
    pub fn install<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R {
        match &self.pool {
            Some(p) => p.install(f),
            None => f(),
        }
    }

    /// A tensor of zeros, or (`zeroed` false) of unspecified but initialised contents.
    fn alloc(&self, shape: Shape, dtype: DType, zeroed: bool) -> Result<CpuTensor> {
        let bytes = shape.checked_bytes(dtype)?;
        // Report first: a refused allocation never touches memory.
        let allocation =
            TrackedAllocation::register(self.hook.as_ref(), bytes, dtype, Device::Cpu)?;
        let data =
            HostBuffer::new_in(bytes, self.cache.as_ref(), zeroed).ok_or(Error::OutOfMemory {
                device: Device::Cpu,
                bytes,
            })?;
        Ok(CpuTensor {
            data,
            shape,
            dtype,
            allocation,
        })
    }

    fn check_device(op: &'static str, t: &CpuTensor) -> Result<()> {
        // A CpuTensor can only live on the CPU; kept so the checks read the same as on CUDA.
        debug_assert_eq!(t.device(), Device::Cpu, "{op}");
        Ok(())
    }
}

impl Backend for Cpu {
    type Tensor = CpuTensor;

    fn device(&self) -> Device {
        Device::Cpu
    }

    fn alloc_hook(&self) -> Option<&Arc<dyn AllocHook>> {
        self.hook.as_ref()
    }

    fn zeros(&self, shape: impl Into<Shape>, dtype: DType) -> Result<CpuTensor> {
        self.alloc(shape.into(), dtype, true)
    }

    /// Host memory handed out by the CPU backend is always initialised (reading uninitialised
    /// memory through a slice is undefined behaviour in Rust): zeros when fresh, and, with a
    /// buffer cache, a reused buffer's old values, which `zeros` would clear first. Together
    /// with the trainer's logits moving to `uninit`, this took `memset` from 2.2% to 1.0% of
    /// a bf16 training step's samples (casts and widened views overwrite every element).
    fn uninit(&self, shape: impl Into<Shape>, dtype: DType) -> Result<CpuTensor> {
        self.alloc(shape.into(), dtype, false)
    }

    fn upload<T: Element>(&self, data: &[T], shape: impl Into<Shape>) -> Result<CpuTensor> {
        let shape = shape.into();
        Error::check_len("upload", shape.numel(), data.len())?;
        let mut t = self.alloc(shape, T::DTYPE, false)?;
        t.as_bytes_mut().copy_from_slice(bytemuck::cast_slice(data));
        Ok(t)
    }

    fn download_into<T: Element>(&self, src: &CpuTensor, dst: &mut [T]) -> Result<()> {
        Self::check_device("download", src)?;
        let s = src.as_slice::<T>()?;
        Error::check_len("download", s.len(), dst.len())?;
        dst.copy_from_slice(s);
        Ok(())
    }

    fn fill_zero(&self, x: &mut CpuTensor) -> Result<()> {
        // A memset: memory-bound, and the buffers it clears are written again right after.
        x.as_bytes_mut().fill(0);
        Ok(())
    }

    fn copy(&self, src: &CpuTensor, dst: &mut CpuTensor) -> Result<()> {
        if src.dtype != dst.dtype {
            return Err(Error::DTypeMismatch {
                op: "copy",
                expected: dst.dtype,
                got: src.dtype,
            });
        }
        Error::check_len("copy", dst.numel(), src.numel())?;
        dst.as_bytes_mut().copy_from_slice(src.as_bytes());
        Ok(())
    }

    fn cast(&self, src: &CpuTensor, dst: &mut CpuTensor) -> Result<()> {
        Error::check_len("cast", dst.numel(), src.numel())?;
        if src.dtype == dst.dtype {
            return self.copy(src, dst);
        }
        let s = src.float_slice("cast")?;
        let d = dst.float_slice_mut("cast")?;
        self.install(|| kernels::cast(s, d));
        Ok(())
    }

    fn scale(&self, x: &mut CpuTensor, alpha: f32) -> Result<()> {
        let x = x.float_slice_mut("scale")?;
        self.install(|| kernels::scale(x, alpha));
        Ok(())
    }

    fn axpy(&self, alpha: f32, x: &CpuTensor, y: &mut CpuTensor) -> Result<()> {
        Error::check_len("axpy", y.numel(), x.numel())?;
        let xs = x.float_slice("axpy")?;
        let y_dtype = y.dtype;
        let ys = y.as_mut_slice::<f32>().map_err(|_| Error::DTypeMismatch {
            op: "axpy (y)",
            expected: DType::F32,
            got: y_dtype,
        })?;
        self.install(|| kernels::axpy(alpha, xs, ys));
        Ok(())
    }

    fn sum_squares(&self, x: &CpuTensor) -> Result<f64> {
        let x = x.float_slice("sum_squares")?;
        Ok(self.install(|| kernels::sum_squares(x)))
    }

    fn unscale_and_check(&self, tensors: &mut [&mut CpuTensor], inv_scale: f32) -> Result<bool> {
        // Validate every tensor before touching any, so an error leaves all of them unchanged.
        for t in tensors.iter() {
            t.float_slice("unscale_and_check")?;
        }
        let mut found = false;
        for t in tensors.iter_mut() {
            let x = t.float_slice_mut("unscale_and_check")?;
            found |= self.install(|| kernels::unscale_and_check(x, inv_scale));
        }
        Ok(found)
    }

    fn synchronize(&self) -> Result<()> {
        Ok(())
    }
}
