//! Run-time compilation of `headroom-kernels` with NVRTC, cached once per process.
//!
//! Kernels are compiled for the real architecture of the device (`sm_XY`) and loaded as CUBIN
//! (machine code), not PTX. That is how the "PTX newer than the driver" problem is avoided: a
//! driver refuses PTX whose ISA version is newer than it knows (NVRTC 13.5 emits PTX a CUDA
//! 13.0 driver cannot JIT), while CUBIN from any NVRTC of the driver's major version loads
//! under CUDA's minor-version compatibility. The PTX is kept too, for inspection and tests.

use std::collections::HashMap;
use std::ffi::{c_char, c_int, CStr, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::nvrtc::{result, sys};
use headroom_kernels::KernelSource;

use crate::error::{CudaError, CudaResult};

/// Options every kernel is compiled with.
///
/// `--fmad=false`: no multiply-add contraction anywhere, so every elementwise result rounds
/// exactly like the CPU backend (the sources also use `__fmul_rn`/`__fadd_rn` where it matters).
/// `--ftz=false`: subnormals are kept, as on the CPU. The kernels are memory-bound, so neither
/// costs measurable time.
pub const COMPILE_OPTIONS: &[&str] = &["--fmad=false", "--ftz=false"];

/// True when libnvrtc can be loaded (cudarc's library name candidates, through the dynamic
/// loader's search path, e.g. `LD_LIBRARY_PATH`).
pub fn nvrtc_available() -> bool {
    // SAFETY: only tries to dlopen each candidate name and closes it again.
    unsafe { sys::is_culib_present() }
}

/// The loaded NVRTC's version as `(major, minor)`.
pub fn nvrtc_version() -> CudaResult<(i32, i32)> {
    ensure_loadable()?;
    let mut major: c_int = 0;
    let mut minor: c_int = 0;
    // cudarc panics if a symbol is missing from the library it found; turn that into an error.
    let status = catch_unwind(AssertUnwindSafe(|| {
        // SAFETY: both pointers are valid for writes for the duration of the call.
        unsafe { sys::nvrtcVersion(&mut major, &mut minor) }
    }))
    .map_err(|_| CudaError::NvrtcUnavailable {
        reason: "libnvrtc lacks nvrtcVersion".into(),
    })?;
    status.result().map_err(|e| CudaError::NvrtcUnavailable {
        reason: format!("nvrtcVersion failed: {e:?}"),
    })?;
    Ok((major, minor))
}

fn ensure_loadable() -> CudaResult<()> {
    if nvrtc_available() {
        Ok(())
    } else {
        Err(CudaError::NvrtcUnavailable {
            reason: "libnvrtc could not be loaded (not on the library search path; on a machine \
                     without a CUDA toolkit, `source .ci/nvrtc-env.sh`)"
                .into(),
        })
    }
}

/// One kernel module compiled for one architecture.
#[derive(Clone, Debug)]
pub struct CompiledKernel {
    /// The module's name (`KernelSource::name`).
    pub kernel: &'static str,
    /// The architecture it was compiled for, e.g. `sm_90`.
    pub arch: String,
    /// The PTX NVRTC produced.
    pub ptx: String,
    /// Machine code for `arch`; this is what gets loaded.
    pub cubin: Vec<u8>,
    /// NVRTC's compilation log (warnings); empty for a clean compile.
    pub log: String,
}

/// Destroys an NVRTC program on every path out of [`compile`].
struct ProgramGuard(sys::nvrtcProgram);

impl Drop for ProgramGuard {
    fn drop(&mut self) {
        // SAFETY: the program was created by `create_program` and is destroyed only here.
        let _ = unsafe { result::destroy_program(self.0) };
    }
}

/// Compile one kernel module for `arch` (`"sm_90"`, `"sm_80"`, …) with [`COMPILE_OPTIONS`].
/// Uncached; see [`compile_cached`].
pub fn compile(kernel: &KernelSource, arch: &str) -> CudaResult<CompiledKernel> {
    let nvrtc_error = |log: String| CudaError::Nvrtc {
        kernel: kernel.name,
        arch: arch.to_string(),
        log,
    };
    if !arch.starts_with("sm_") || !arch[3..].chars().all(|c| c.is_ascii_alphanumeric()) {
        return Err(nvrtc_error(format!(
            "`{arch}` is not a real architecture name like sm_90"
        )));
    }
    ensure_loadable()?;
    let source = CString::new(kernel.source)
        .map_err(|_| nvrtc_error("kernel source contains a NUL byte".into()))?;
    let name = CString::new(format!("{}.cu", kernel.name))
        .map_err(|_| nvrtc_error("kernel name contains a NUL byte".into()))?;
    let mut options: Vec<String> = COMPILE_OPTIONS.iter().map(|s| s.to_string()).collect();
    options.push(format!("--gpu-architecture={arch}"));

    // cudarc's loader panics on a missing symbol; NVRTC builds that load at all have them, but a
    // panic here must still not take the caller down.
    catch_unwind(AssertUnwindSafe(|| {
        compile_program(kernel.name, arch, &source, &name, &options)
    }))
    .unwrap_or_else(|_| {
        Err(CudaError::NvrtcUnavailable {
            reason: "libnvrtc is missing a required symbol".into(),
        })
    })
}

fn compile_program(
    kernel: &'static str,
    arch: &str,
    source: &CStr,
    name: &CStr,
    options: &[String],
) -> CudaResult<CompiledKernel> {
    let nvrtc_error = |log: String| CudaError::Nvrtc {
        kernel,
        arch: arch.to_string(),
        log,
    };
    let program = result::create_program(source, Some(name))
        .map_err(|e| nvrtc_error(format!("nvrtcCreateProgram: {e:?}")))?;
    let program = ProgramGuard(program);

    // SAFETY: `program.0` is a live program (destroyed only by the guard, after this).
    let compiled = unsafe { result::compile_program(program.0, options) };
    // SAFETY: as above.
    let log = unsafe { result::get_program_log(program.0) }
        .map(|raw| c_chars_to_string(&raw))
        .unwrap_or_default();
    if let Err(e) = compiled {
        return Err(nvrtc_error(format!("{e:?}\n{log}")));
    }

    // SAFETY: as above; the program compiled successfully.
    let ptx = unsafe { result::get_ptx(program.0) }
        .map_err(|e| nvrtc_error(format!("nvrtcGetPTX: {e:?}")))?;
    let ptx = c_chars_to_string(&ptx);

    let mut cubin_len: usize = 0;
    // SAFETY: live program; `cubin_len` is valid for writes.
    unsafe { sys::nvrtcGetCUBINSize(program.0, &mut cubin_len) }
        .result()
        .map_err(|e| nvrtc_error(format!("nvrtcGetCUBINSize: {e:?}")))?;
    let mut cubin = vec![0u8; cubin_len];
    if cubin_len > 0 {
        // SAFETY: `cubin` has exactly the size NVRTC reported.
        unsafe { sys::nvrtcGetCUBIN(program.0, cubin.as_mut_ptr().cast::<c_char>()) }
            .result()
            .map_err(|e| nvrtc_error(format!("nvrtcGetCUBIN: {e:?}")))?;
    }
    Ok(CompiledKernel {
        kernel,
        arch: arch.to_string(),
        ptx,
        cubin,
        log: log.trim().to_string(),
    })
}

/// Text NVRTC returned as a NUL-terminated `c_char` buffer.
fn c_chars_to_string(raw: &[c_char]) -> String {
    let bytes: Vec<u8> = raw
        .iter()
        .take_while(|&&c| c != 0)
        .map(|&c| c as u8)
        .collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

type CacheKey = (&'static str, String);

fn cache() -> &'static Mutex<HashMap<CacheKey, Arc<CompiledKernel>>> {
    static CACHE: OnceLock<Mutex<HashMap<CacheKey, Arc<CompiledKernel>>>> = OnceLock::new();
    CACHE.get_or_init(Default::default)
}

/// [`compile`], at most once per (module, architecture) in this process. Failures are not
/// cached, so a caller that fixes its environment can retry.
pub fn compile_cached(kernel: &KernelSource, arch: &str) -> CudaResult<Arc<CompiledKernel>> {
    let key = (kernel.name, arch.to_string());
    // Holding the lock while compiling serialises compiles: simple, and it guarantees each
    // module is compiled once even when several threads ask at the same moment.
    let mut cache = cache().lock().unwrap_or_else(|p| p.into_inner());
    if let Some(hit) = cache.get(&key) {
        return Ok(Arc::clone(hit));
    }
    let compiled = Arc::new(compile(kernel, arch)?);
    cache.insert(key, Arc::clone(&compiled));
    Ok(compiled)
}

/// The `sm_XY` architecture name of a compute capability.
pub fn arch_for(compute_capability: (i32, i32)) -> String {
    format!("sm_{}{}", compute_capability.0, compute_capability.1)
}
