//! The [`Cuda`] backend handle: device probe, context and stream, kernel function cache,
//! allocation and launch helpers.

use std::collections::HashMap;
use std::fmt;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, Mutex};

use cudarc::driver::sys::CUdevice_attribute;
use cudarc::driver::{
    result as driver, CudaContext, CudaFunction, CudaSlice, CudaStream, DriverError, LaunchConfig,
};
use cudarc::nvrtc::Ptx;
use headroom_tensor::{
    AllocHook, DType, Device, Error, MemoryCategory, Result, Shape, Tensor, TrackedAllocation,
};

use crate::error::{CudaError, CudaResult};
use crate::nvrtc;
use crate::tensor::CudaTensor;

/// Oldest driver API this crate accepts (CUDA 12.0). cudarc is built against CUDA 13 headers
/// and panics when it calls a symbol an old driver lacks, so older drivers are reported as
/// "no device" up front instead.
const MIN_DRIVER_VERSION: i32 = 12000;

/// Blocks per multiprocessor for grid-stride elementwise kernels: enough resident warps to
/// saturate memory bandwidth; beyond it each thread simply loops.
const BLOCKS_PER_SM: u32 = 16;

/// True when the CUDA driver library (libcuda) can be loaded. Says nothing about devices.
pub fn driver_library_present() -> bool {
    // SAFETY: only tries to dlopen each candidate name and closes it again.
    unsafe { cudarc::driver::sys::is_culib_present() }
}

/// Number of CUDA devices; 0 when there is no driver library, `cuInit` fails, or the driver is
/// older than CUDA 12. Never panics.
pub fn device_count() -> usize {
    probe().map(|(count, _)| count).unwrap_or(0)
}

/// Load the driver, initialise it and count devices: `(count, driver_version)`.
fn probe() -> CudaResult<(usize, i32)> {
    if !driver_library_present() {
        return Err(CudaError::NoDevice {
            reason: "the CUDA driver library (libcuda.so) could not be loaded".into(),
        });
    }
    // cudarc panics if the library lacks a symbol it binds; none of these calls should, but a
    // machine without a usable GPU must get an error, never a panic.
    let probed = catch_unwind(AssertUnwindSafe(|| -> CudaResult<(usize, i32)> {
        let mut version: std::ffi::c_int = 0;
        // SAFETY: `version` is valid for writes; cuDriverGetVersion may be called before cuInit.
        unsafe { cudarc::driver::sys::cuDriverGetVersion(&mut version) }
            .result()
            .map_err(|e| no_device("cuDriverGetVersion failed", e))?;
        if version < MIN_DRIVER_VERSION {
            return Err(CudaError::NoDevice {
                reason: format!(
                    "the driver supports CUDA {}, headroom needs at least {}",
                    version_string(version),
                    version_string(MIN_DRIVER_VERSION)
                ),
            });
        }
        driver::init().map_err(|e| no_device("cuInit failed", e))?;
        let count =
            driver::device::get_count().map_err(|e| no_device("cuDeviceGetCount failed", e))?;
        Ok((usize::try_from(count).unwrap_or(0), version))
    }));
    probed.unwrap_or_else(|_| {
        Err(CudaError::NoDevice {
            reason: "the CUDA driver library is missing a required function".into(),
        })
    })
}

fn no_device(what: &str, e: DriverError) -> CudaError {
    CudaError::NoDevice {
        reason: format!("{what}: {:?}", e.0),
    }
}

/// Raise the release threshold of the device's default memory pool (where cudarc's
/// stream-ordered allocations come from) from its default of 0 to "never".
///
/// With 0, every stream, event or context synchronisation — a download, a loss readback, the
/// overflow check of every step — hands all freed pool memory back to the driver, and the next
/// step's allocations map fresh physical memory again. Keeping it is what NVIDIA's
/// stream-ordered allocator guide recommends and what PyTorch's `cudaMallocAsync` backend does.
/// Trade-off: the pool keeps its high-water mark reserved for the life of the process (as a
/// caching allocator does); [`Cuda::pool_reserved_bytes`] reports it and the allocation hook
/// still sees exact live bytes.
fn keep_pool_memory(context: &CudaContext) -> CudaResult<()> {
    use cudarc::driver::sys;
    let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
    // SAFETY: `pool` is valid for writes and the device handle comes from a live context.
    unsafe { sys::cuDeviceGetDefaultMemPool(&mut pool, context.cu_device()) }
        .result()
        .map_err(|e| CudaError::driver("cuDeviceGetDefaultMemPool", e))?;
    let mut threshold: u64 = u64::MAX;
    // SAFETY: RELEASE_THRESHOLD reads one cuuint64_t from the pointer.
    unsafe {
        sys::cuMemPoolSetAttribute(
            pool,
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
            (&mut threshold as *mut u64).cast(),
        )
    }
    .result()
    .map_err(|e| CudaError::driver("cuMemPoolSetAttribute", e))
}

/// The driver's `free` bytes plus the pool's idle reserve (`reserved − used`), at most `total`.
fn with_idle_pool_memory(free: usize, total: usize, reserved: u64, used: u64) -> usize {
    let idle = usize::try_from(reserved.saturating_sub(used)).unwrap_or(usize::MAX);
    free.saturating_add(idle).min(total)
}

/// `12040` → `"12.4"`.
fn version_string(v: i32) -> String {
    format!("{}.{}", v / 1000, (v % 1000) / 10)
}

/// State shared by every clone of a [`Cuda`] handle.
struct CudaInner {
    /// The cuBLASLt handle, created on the first GEMM. First, so it is destroyed while the
    /// context below is still alive (fields drop in declaration order).
    cublaslt: Mutex<Option<crate::gemm::LtHandle>>,
    ordinal: usize,
    context: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    name: String,
    compute_capability: (i32, i32),
    arch: String,
    multiprocessors: u32,
    driver_version: i32,
    /// Entry points already loaded into this context, by name.
    functions: Mutex<HashMap<&'static str, CudaFunction>>,
}

/// The CUDA backend for one device. Cheap to clone (the context, stream and kernel cache are
/// shared); every operation is queued on one stream, in order.
#[derive(Clone)]
pub struct Cuda {
    inner: Arc<CudaInner>,
    hook: Option<Arc<dyn AllocHook>>,
}

impl fmt::Debug for Cuda {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Cuda")
            .field("ordinal", &self.inner.ordinal)
            .field("name", &self.inner.name)
            .field("arch", &self.inner.arch)
            .field("hooked", &self.hook.is_some())
            .finish()
    }
}

impl Cuda {
    /// Open device `ordinal`. Returns [`CudaError::NoDevice`] — never panics — when the driver
    /// library is missing, `cuInit` fails, there are no devices or `ordinal` is out of range.
    pub fn new(ordinal: usize) -> CudaResult<Cuda> {
        let (count, driver_version) = probe()?;
        if count == 0 {
            return Err(CudaError::NoDevice {
                reason: "the driver reports no CUDA devices".into(),
            });
        }
        if ordinal >= count {
            return Err(CudaError::NoDevice {
                reason: format!("device ordinal {ordinal} out of range ({count} devices)"),
            });
        }
        let context =
            CudaContext::new(ordinal).map_err(|e| CudaError::driver("CudaContext::new", e))?;
        let name = context
            .name()
            .map_err(|e| CudaError::driver("cuDeviceGetName", e))?;
        let compute_capability = context
            .compute_capability()
            .map_err(|e| CudaError::driver("compute capability", e))?;
        let multiprocessors = context
            .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(|e| CudaError::driver("multiprocessor count", e))?;
        if context.has_async_alloc() {
            // Best effort: failing to raise the threshold costs speed, never correctness.
            let _ = keep_pool_memory(&context);
        }
        let stream = context.default_stream();
        Ok(Cuda {
            inner: Arc::new(CudaInner {
                ordinal,
                arch: nvrtc::arch_for(compute_capability),
                context,
                stream,
                name,
                compute_capability,
                multiprocessors: u32::try_from(multiprocessors).unwrap_or(1).max(1),
                driver_version,
                functions: Mutex::new(HashMap::new()),
                cublaslt: Mutex::new(None),
            }),
            hook: None,
        })
    }

    /// The same backend, reporting every device allocation to `hook`.
    pub fn with_alloc_hook(mut self, hook: Arc<dyn AllocHook>) -> Self {
        self.hook = Some(hook);
        self
    }

    /// The device ordinal.
    pub fn ordinal(&self) -> usize {
        self.inner.ordinal
    }

    /// The device's name, e.g. `"NVIDIA H100 80GB HBM3"`.
    pub fn device_name(&self) -> &str {
        &self.inner.name
    }

    /// Compute capability as `(major, minor)`, e.g. `(9, 0)`.
    pub fn compute_capability(&self) -> (i32, i32) {
        self.inner.compute_capability
    }

    /// The architecture kernels are compiled for, e.g. `"sm_90"`.
    pub fn arch(&self) -> &str {
        &self.inner.arch
    }

    /// The newest CUDA version the driver supports, as the driver encodes it (`13000` = 13.0).
    pub fn driver_version(&self) -> i32 {
        self.inner.driver_version
    }

    /// Free and total device memory in bytes. "Free" is what this process can still allocate:
    /// the driver's free memory plus what the default memory pool holds reserved but unused
    /// (the pool keeps freed memory instead of returning it, see `keep_pool_memory`; its own
    /// allocations reuse it first).
    pub fn mem_info(&self) -> CudaResult<(usize, usize)> {
        let (free, total) = self
            .inner
            .context
            .mem_get_info()
            .map_err(|e| CudaError::driver("cuMemGetInfo", e))?;
        if !self.inner.context.has_async_alloc() {
            return Ok((free, total));
        }
        use cudarc::driver::sys::CUmemPool_attribute as PoolAttr;
        let reserved = self.pool_attribute(PoolAttr::CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT);
        let used = self.pool_attribute(PoolAttr::CU_MEMPOOL_ATTR_USED_MEM_CURRENT);
        match (reserved, used) {
            (Ok(reserved), Ok(used)) => {
                Ok((with_idle_pool_memory(free, total, reserved, used), total))
            }
            // A runtime that cannot read pool counters still has the driver's figure, which
            // only understates what is free; failing the caller over it would be worse.
            _ => Ok((free, total)),
        }
    }

    /// Bytes the device's default memory pool holds reserved (live allocations plus memory the
    /// pool keeps cached), which is where stream-ordered allocations come from.
    pub fn pool_reserved_bytes(&self) -> CudaResult<u64> {
        self.pool_attribute(
            cudarc::driver::sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT,
        )
    }

    /// One 64-bit attribute of the device's default memory pool.
    fn pool_attribute(
        &self,
        attribute: cudarc::driver::sys::CUmemPool_attribute,
    ) -> CudaResult<u64> {
        use cudarc::driver::sys;
        let context = &self.inner.context;
        context
            .bind_to_thread()
            .map_err(|e| CudaError::driver("bind_to_thread", e))?;
        let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
        // SAFETY: `pool` is valid for writes and the device handle comes from a live context.
        unsafe { sys::cuDeviceGetDefaultMemPool(&mut pool, context.cu_device()) }
            .result()
            .map_err(|e| CudaError::driver("cuDeviceGetDefaultMemPool", e))?;
        let mut value: u64 = 0;
        // SAFETY: the RESERVED/USED_MEM_CURRENT attributes write one cuuint64_t into `value`.
        unsafe { sys::cuMemPoolGetAttribute(pool, attribute, (&mut value as *mut u64).cast()) }
            .result()
            .map_err(|e| CudaError::driver("cuMemPoolGetAttribute", e))?;
        Ok(value)
    }

    /// The cudarc context, for crates that launch their own kernels.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.inner.context
    }

    /// The stream every operation of this backend is queued on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.inner.stream
    }

    /// Compile and load every kernel module now, so the first operation does not pay for NVRTC
    /// (call it before timing anything). Without it modules load on first use.
    pub fn load_all_kernels(&self) -> CudaResult<()> {
        for kernel in headroom_kernels::ALL
            .iter()
            .chain(headroom_kernels::TRAINER_OPS)
        {
            for &function in kernel.functions {
                self.function(function)?;
            }
        }
        Ok(())
    }

    /// The loaded entry point `function` of any `headroom_kernels` list, compiling and loading
    /// its module on first use (compilation is cached per process; loaded modules per backend
    /// handle, shared by its clones).
    pub fn function(&self, function: &'static str) -> CudaResult<CudaFunction> {
        let mut loaded = self
            .inner
            .functions
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        if let Some(f) = loaded.get(function) {
            return Ok(f.clone());
        }
        let source = headroom_kernels::find(function).ok_or_else(|| CudaError::UnknownKernel {
            function: function.to_string(),
        })?;
        let compiled = nvrtc::compile_cached(source, &self.inner.arch)?;
        let module = self
            .inner
            .context
            .load_module(Ptx::from_binary(compiled.cubin.clone()))
            .map_err(|e| CudaError::ModuleLoad {
                kernel: source.name,
                nvrtc_version: nvrtc::nvrtc_version()
                    .map(|(a, b)| format!("{a}.{b}"))
                    .unwrap_or_else(|_| "unknown".into()),
                driver_version: version_string(self.inner.driver_version),
                source: e.into(),
            })?;
        // Load every entry point of the module at once: the module stays alive through them.
        for &name in source.functions {
            let f = module
                .load_function(name)
                .map_err(|e| CudaError::driver("cuModuleGetFunction", e))?;
            loaded.insert(name, f);
        }
        loaded
            .get(function)
            .cloned()
            .ok_or_else(|| CudaError::UnknownKernel {
                function: function.to_string(),
            })
    }

    /// A grid-stride launch configuration for `n` elements (n > 0).
    pub(crate) fn elementwise_config(&self, n: usize) -> LaunchConfig {
        let threads = headroom_kernels::BLOCK_THREADS;
        let cap = self
            .inner
            .multiprocessors
            .saturating_mul(BLOCKS_PER_SM)
            .max(1);
        let needed = n.div_ceil(threads as usize);
        let blocks = u32::try_from(needed).unwrap_or(u32::MAX).clamp(1, cap);
        LaunchConfig {
            grid_dim: (blocks, 1, 1),
            block_dim: (threads, 1, 1),
            shared_mem_bytes: 0,
        }
    }

    /// A device failure in `op` as the shared tensor error.
    pub(crate) fn fail(&self, op: &'static str) -> impl Fn(CudaError) -> Error + '_ {
        move |e| e.into_tensor_error(self.device_tag(), op)
    }

    /// A driver failure in `op` as the shared tensor error.
    pub(crate) fn driver_fail(&self, op: &'static str) -> impl Fn(DriverError) -> Error + '_ {
        move |e| CudaError::driver(op, e).into_tensor_error(self.device_tag(), op)
    }

    pub(crate) fn device_tag(&self) -> Device {
        Device::Cuda(self.inner.ordinal)
    }

    pub(crate) fn check_device(&self, op: &'static str, t: &CudaTensor) -> Result<()> {
        if t.ordinal != self.inner.ordinal {
            return Err(Error::DeviceMismatch {
                op,
                expected: self.device_tag(),
                got: t.device(),
            });
        }
        Ok(())
    }

    /// Allocate `bytes` of device memory as `T` elements, mapping out-of-memory to the shared
    /// error. `zeroed` chooses a memset; otherwise the contents are unspecified.
    fn device_alloc<T: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits>(
        &self,
        len: usize,
        zeroed: bool,
    ) -> Result<CudaSlice<T>> {
        let stream = &self.inner.stream;
        let allocated = if zeroed {
            stream.alloc_zeros::<T>(len)
        } else {
            // SAFETY: the caller overwrites the memory before reading it (`uninit` documents that
            // its contents are unspecified; they are plain bytes either way, never Rust values).
            unsafe { stream.alloc::<T>(len) }
        };
        allocated.map_err(|e| {
            let bytes = len.saturating_mul(std::mem::size_of::<T>());
            if e.0 == cudarc::driver::sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY {
                Error::OutOfMemory {
                    device: self.device_tag(),
                    bytes,
                }
            } else {
                CudaError::driver("device allocation", e)
                    .into_tensor_error(self.device_tag(), "alloc")
            }
        })
    }

    /// A tensor of `shape`/`dtype`, reported to the hook in the thread's current category.
    pub(crate) fn alloc_tensor(
        &self,
        shape: Shape,
        dtype: DType,
        zeroed: bool,
    ) -> Result<CudaTensor> {
        let bytes = shape.checked_bytes(dtype)?;
        // Report first: a refused allocation never touches the device. If the device then has
        // no memory, dropping `allocation` reports the free, keeping the hook balanced.
        let allocation =
            TrackedAllocation::register(self.hook.as_ref(), bytes, dtype, self.device_tag())?;
        let data = if bytes == 0 {
            None
        } else {
            Some(self.device_alloc::<u8>(bytes, zeroed)?)
        };
        Ok(CudaTensor {
            data,
            shape,
            dtype,
            ordinal: self.inner.ordinal,
            allocation,
        })
    }

    /// Scratch memory for one operation, reported as [`MemoryCategory::Workspace`] with
    /// `dtype` as its tag.
    pub(crate) fn workspace<T: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits>(
        &self,
        len: usize,
        dtype: DType,
        zeroed: bool,
    ) -> Result<Workspace<T>> {
        let bytes = len.saturating_mul(std::mem::size_of::<T>());
        let token = TrackedAllocation::register_as(
            self.hook.as_ref(),
            bytes,
            dtype,
            self.device_tag(),
            MemoryCategory::Workspace,
        )?;
        let buffer = self.device_alloc::<T>(len, zeroed)?;
        Ok(Workspace {
            buffer,
            _token: token,
        })
    }

    /// The cuBLASLt handle slot, locked: GEMMs on one backend run their cuBLASLt calls one at
    /// a time (they are queued on one stream anyway).
    pub(crate) fn cublaslt_slot(&self) -> std::sync::MutexGuard<'_, Option<crate::gemm::LtHandle>> {
        self.inner
            .cublaslt
            .lock()
            .unwrap_or_else(|p| p.into_inner())
    }

    pub(crate) fn hook(&self) -> Option<&Arc<dyn AllocHook>> {
        self.hook.as_ref()
    }
}

/// A scratch buffer and its allocation-hook token.
pub(crate) struct Workspace<T> {
    // Before `_token`: the memory is released before the hook hears of the free.
    pub(crate) buffer: CudaSlice<T>,
    _token: TrackedAllocation,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn idle_pool_memory_counts_as_free_up_to_the_total() {
        // 10 free, the pool holds 8 of which 5 are live: 3 more can be allocated.
        assert_eq!(with_idle_pool_memory(10, 100, 8, 5), 13);
        // Nothing idle, or counters read a moment apart (used > reserved): the driver's figure.
        assert_eq!(with_idle_pool_memory(10, 100, 5, 5), 10);
        assert_eq!(with_idle_pool_memory(10, 100, 5, 9), 10);
        // Never more than the device has.
        assert_eq!(with_idle_pool_memory(90, 100, 50, 0), 100);
        assert_eq!(
            with_idle_pool_memory(usize::MAX, usize::MAX, u64::MAX, 0),
            usize::MAX
        );
    }

    #[test]
    fn versions_and_arch_names() {
        assert_eq!(version_string(13000), "13.0");
        assert_eq!(version_string(12040), "12.4");
        assert_eq!(nvrtc::arch_for((9, 0)), "sm_90");
        assert_eq!(nvrtc::arch_for((12, 0)), "sm_120");
    }
}
