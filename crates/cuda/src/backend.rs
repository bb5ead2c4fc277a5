//! `impl Backend for Cuda`: the shared primitives as NVRTC-compiled kernels, with the same
//! argument checks, in the same order, and the same errors as the CPU backend.

use std::sync::Arc;

use cudarc::driver::{LaunchConfig, PushKernelArg};
use headroom_kernels::{BLOCK_THREADS, SUM_SQUARES_BLOCKS};
use headroom_tensor::{AllocHook, Backend, DType, Device, Element, Error, Result, Shape, Tensor};

use crate::device::Cuda;
use crate::tensor::CudaTensor;

/// The kernel name suffix of a float dtype.
fn float_suffix(dtype: DType) -> Option<&'static str> {
    match dtype {
        DType::F32 => Some("f32"),
        DType::F16 => Some("f16"),
        DType::BF16 => Some("bf16"),
        _ => None,
    }
}

/// The entry point casting `src` to `dst` (two different float dtypes).
pub(crate) fn cast_function(src: DType, dst: DType) -> Option<&'static str> {
    use DType::*;
    Some(match (src, dst) {
        (F32, F16) => "cast_f32_f16",
        (F32, BF16) => "cast_f32_bf16",
        (F16, F32) => "cast_f16_f32",
        (BF16, F32) => "cast_bf16_f32",
        (F16, BF16) => "cast_f16_bf16",
        (BF16, F16) => "cast_bf16_f16",
        _ => return None,
    })
}

/// The per-dtype entry point of a one-input kernel family (`scale`, `axpy`, …).
pub(crate) fn typed_function(family: &str, dtype: DType) -> Option<&'static str> {
    let suffix = float_suffix(dtype)?;
    // Names are matched against the registry instead of formatted, so they stay `&'static`.
    headroom_kernels::ALL
        .iter()
        .flat_map(|k| k.functions.iter().copied())
        .find(|f| f.strip_prefix(family).and_then(|r| r.strip_prefix('_')) == Some(suffix))
}

fn require_float(op: &'static str, dtype: DType) -> Result<&'static str> {
    float_suffix(dtype).ok_or(Error::UnsupportedDType { op, dtype })
}

impl Cuda {
    fn kernel(
        &self,
        op: &'static str,
        family: &str,
        dtype: DType,
    ) -> Result<cudarc::driver::CudaFunction> {
        let name = typed_function(family, dtype).ok_or(Error::UnsupportedDType { op, dtype })?;
        self.function(name).map_err(self.fail(op))
    }
}

impl Backend for Cuda {
    type Tensor = CudaTensor;

    fn device(&self) -> Device {
        self.device_tag()
    }

    fn alloc_hook(&self) -> Option<&Arc<dyn AllocHook>> {
        self.hook()
    }

    fn zeros(&self, shape: impl Into<Shape>, dtype: DType) -> Result<CudaTensor> {
        self.alloc_tensor(shape.into(), dtype, true)
    }

    /// Device memory is not cleared: unlike host memory, reading it back is defined (it is copied
    /// as bytes), so skipping the memset is safe.
    fn uninit(&self, shape: impl Into<Shape>, dtype: DType) -> Result<CudaTensor> {
        self.alloc_tensor(shape.into(), dtype, false)
    }

    fn upload<T: Element>(&self, data: &[T], shape: impl Into<Shape>) -> Result<CudaTensor> {
        let shape = shape.into();
        Error::check_len("upload", shape.numel(), data.len())?;
        let mut t = self.alloc_tensor(shape, T::DTYPE, false)?;
        if let Some(dst) = t.data.as_mut() {
            // From pageable memory the driver stages the bytes before returning, so `data` may be
            // reused as soon as this call returns.
            self.stream()
                .memcpy_htod(bytemuck::cast_slice::<T, u8>(data), dst)
                .map_err(self.driver_fail("upload"))?;
        }
        Ok(t)
    }

    fn download_into<T: Element>(&self, src: &CudaTensor, dst: &mut [T]) -> Result<()> {
        self.check_device("download", src)?;
        if src.dtype != T::DTYPE {
            return Err(Error::DTypeMismatch {
                op: "download",
                expected: T::DTYPE,
                got: src.dtype,
            });
        }
        Error::check_len("download", src.numel(), dst.len())?;
        if let Some(data) = src.data.as_ref() {
            let stream = self.stream();
            stream
                .memcpy_dtoh(data, bytemuck::cast_slice_mut::<T, u8>(dst))
                .map_err(self.driver_fail("download"))?;
            // The copy is queued on the stream; `dst` is only valid once it has finished.
            stream.synchronize().map_err(self.driver_fail("download"))?;
        }
        Ok(())
    }

    fn fill_zero(&self, x: &mut CudaTensor) -> Result<()> {
        self.check_device("fill_zero", x)?;
        if let Some(d) = x.data.as_mut() {
            self.stream()
                .memset_zeros(d)
                .map_err(self.driver_fail("fill_zero"))?;
        }
        Ok(())
    }

    fn copy(&self, src: &CudaTensor, dst: &mut CudaTensor) -> Result<()> {
        self.check_device("copy", src)?;
        self.check_device("copy", dst)?;
        if src.dtype != dst.dtype {
            return Err(Error::DTypeMismatch {
                op: "copy",
                expected: dst.dtype,
                got: src.dtype,
            });
        }
        Error::check_len("copy", dst.numel(), src.numel())?;
        if let (Some(s), Some(d)) = (src.data.as_ref(), dst.data.as_mut()) {
            self.stream()
                .memcpy_dtod(s, d)
                .map_err(self.driver_fail("copy"))?;
        }
        Ok(())
    }

    fn cast(&self, src: &CudaTensor, dst: &mut CudaTensor) -> Result<()> {
        self.check_device("cast", src)?;
        self.check_device("cast", dst)?;
        Error::check_len("cast", dst.numel(), src.numel())?;
        if src.dtype == dst.dtype {
            return self.copy(src, dst);
        }
        require_float("cast", src.dtype)?;
        require_float("cast", dst.dtype)?;
        let name = cast_function(src.dtype, dst.dtype).ok_or(Error::UnsupportedDType {
            op: "cast",
            dtype: src.dtype,
        })?;
        let n = src.numel();
        let (Some(s), Some(d)) = (src.data.as_ref(), dst.data.as_mut()) else {
            return Ok(()); // empty
        };
        let func = self.function(name).map_err(self.fail("cast"))?;
        let n64 = n as u64;
        let mut launch = self.stream().launch_builder(&func);
        launch.arg(s).arg(d).arg(&n64);
        // SAFETY: cast_<src>_<dst>(const SRC*, DST*, u64 n): both buffers hold exactly n elements
        // of their dtypes (checked above) and do not alias (one is borrowed mutably).
        unsafe { launch.launch(self.elementwise_config(n)) }.map_err(self.driver_fail("cast"))?;
        Ok(())
    }

    fn scale(&self, x: &mut CudaTensor, alpha: f32) -> Result<()> {
        self.check_device("scale", x)?;
        require_float("scale", x.dtype)?;
        let n = x.numel();
        let Some(d) = x.data.as_mut() else {
            return Ok(()); // empty: nothing to launch, and no NVRTC needed
        };
        let func = self.kernel("scale", "scale", x.dtype)?;
        let n64 = n as u64;
        let mut launch = self.stream().launch_builder(&func);
        launch.arg(d).arg(&alpha).arg(&n64);
        // SAFETY: scale_<t>(T*, float, u64 n) on a buffer of exactly n elements of t.
        unsafe { launch.launch(self.elementwise_config(n)) }.map_err(self.driver_fail("scale"))?;
        Ok(())
    }

    fn axpy(&self, alpha: f32, x: &CudaTensor, y: &mut CudaTensor) -> Result<()> {
        self.check_device("axpy", x)?;
        self.check_device("axpy", y)?;
        Error::check_len("axpy", y.numel(), x.numel())?;
        require_float("axpy", x.dtype)?;
        if y.dtype != DType::F32 {
            return Err(Error::DTypeMismatch {
                op: "axpy (y)",
                expected: DType::F32,
                got: y.dtype,
            });
        }
        let n = x.numel();
        let (Some(xs), Some(ys)) = (x.data.as_ref(), y.data.as_mut()) else {
            return Ok(()); // empty
        };
        let func = self.kernel("axpy", "axpy", x.dtype)?;
        let n64 = n as u64;
        let mut launch = self.stream().launch_builder(&func);
        launch.arg(&alpha).arg(xs).arg(ys).arg(&n64);
        // SAFETY: axpy_<t>(float, const T*, float*, u64 n): x holds n elements of t, y n f32s;
        // they do not alias.
        unsafe { launch.launch(self.elementwise_config(n)) }.map_err(self.driver_fail("axpy"))?;
        Ok(())
    }

    fn sum_squares(&self, x: &CudaTensor) -> Result<f64> {
        const OP: &str = "sum_squares";
        self.check_device(OP, x)?;
        require_float(OP, x.dtype)?;
        let n = x.numel();
        let Some(xs) = x.data.as_ref() else {
            return Ok(0.0); // empty
        };
        let partials_fn = self.kernel(OP, "sum_squares_partials", x.dtype)?;
        let finish_fn = self.function("sum_squares_finish").map_err(self.fail(OP))?;

        let blocks = SUM_SQUARES_BLOCKS as usize;
        // One buffer: `blocks` partials, then the result. f64 has no DType; the hook sees bytes.
        let mut workspace = self.workspace::<f64>(blocks + 1, DType::U8, false)?;
        let n64 = n as u64;
        let stream = self.stream();
        {
            let mut launch = stream.launch_builder(&partials_fn);
            launch.arg(xs).arg(&n64).arg(&mut workspace.buffer);
            // The grid is fixed (never derived from the device): it defines the summation order.
            let cfg = LaunchConfig {
                grid_dim: (SUM_SQUARES_BLOCKS, 1, 1),
                block_dim: (BLOCK_THREADS, 1, 1),
                shared_mem_bytes: 0,
            };
            // SAFETY: sum_squares_partials_<t>(const T*, u64 n, double* partials): x holds n
            // elements; the workspace holds SUM_SQUARES_BLOCKS + 1 doubles, one per block plus
            // the result slot this kernel does not touch.
            unsafe { launch.launch(cfg) }.map_err(self.driver_fail(OP))?;
        }
        let (mut partials, mut result) = workspace.buffer.split_at_mut(blocks);
        {
            let count = SUM_SQUARES_BLOCKS;
            let mut launch = stream.launch_builder(&finish_fn);
            launch.arg(&mut partials).arg(&count).arg(&mut result);
            let cfg = LaunchConfig {
                grid_dim: (1, 1, 1),
                block_dim: (BLOCK_THREADS, 1, 1),
                shared_mem_bytes: 0,
            };
            // SAFETY: sum_squares_finish(const double* partials, u32 count, double* out) with
            // `count` partials and a one-element output, in disjoint halves of the workspace.
            unsafe { launch.launch(cfg) }.map_err(self.driver_fail(OP))?;
        }
        let mut total = [0f64; 1];
        stream
            .memcpy_dtoh(&result, &mut total)
            .map_err(self.driver_fail(OP))?;
        stream.synchronize().map_err(self.driver_fail(OP))?;
        Ok(total[0])
    }

    fn unscale_and_check(&self, tensors: &mut [&mut CudaTensor], inv_scale: f32) -> Result<bool> {
        const OP: &str = "unscale_and_check";
        // Validate every tensor before touching any, so an error leaves all of them unchanged.
        for t in tensors.iter() {
            self.check_device(OP, t)?;
            require_float(OP, t.dtype)?;
        }
        if tensors.iter().all(|t| t.data.is_none()) {
            return Ok(false);
        }
        // Resolve (compile) every kernel before launching any: a failure here must leave every
        // tensor unchanged, like the argument checks above.
        let mut kernels = Vec::with_capacity(tensors.len());
        for t in tensors.iter() {
            kernels.push(match t.data {
                Some(_) => Some(self.kernel(OP, "unscale_check", t.dtype)?),
                None => None, // empty: nothing to launch
            });
        }
        // One device flag for all tensors: zeroed once, read once.
        let mut flag = self.workspace::<i32>(1, DType::I32, true)?;
        let stream = self.stream();
        for (t, func) in tensors.iter_mut().zip(&kernels) {
            let n = t.numel();
            let (Some(d), Some(func)) = (t.data.as_mut(), func) else {
                continue;
            };
            let n64 = n as u64;
            let mut launch = stream.launch_builder(func);
            launch
                .arg(d)
                .arg(&inv_scale)
                .arg(&n64)
                .arg(&mut flag.buffer);
            // SAFETY: unscale_check_<t>(T*, float, u64 n, int* found): the tensor holds n
            // elements of t; the flag is one int in a separate allocation.
            unsafe { launch.launch(self.elementwise_config(n)) }.map_err(self.driver_fail(OP))?;
        }
        let mut found = [0i32; 1];
        stream
            .memcpy_dtoh(&flag.buffer, &mut found)
            .map_err(self.driver_fail(OP))?;
        stream.synchronize().map_err(self.driver_fail(OP))?;
        Ok(found[0] != 0)
    }

    fn synchronize(&self) -> Result<()> {
        self.stream()
            .synchronize()
            .map_err(self.driver_fail("synchronize"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const FLOATS: [DType; 3] = [DType::F32, DType::F16, DType::BF16];

    #[test]
    fn every_kernel_the_backend_names_is_registered() {
        let mut used = Vec::new();
        for s in FLOATS {
            for d in FLOATS {
                match cast_function(s, d) {
                    Some(f) => used.push(f),
                    None => assert_eq!(s, d, "no cast kernel for {s} -> {d}"),
                }
            }
            for family in ["scale", "axpy", "sum_squares_partials", "unscale_check"] {
                let f = typed_function(family, s);
                assert!(f.is_some(), "no {family} kernel for {s}");
                used.extend(f);
            }
        }
        used.push("sum_squares_finish");
        for f in &used {
            assert!(headroom_kernels::find(f).is_some(), "{f} is not registered");
        }
        // And nothing registered is unused.
        let registered: usize = headroom_kernels::ALL
            .iter()
            .map(|k| k.functions.len())
            .sum();
        used.sort();
        used.dedup();
        assert_eq!(used.len(), registered);
    }

    #[test]
    fn typed_function_matches_whole_suffixes_only() {
        // "scale_f16" must not be found for bf16 and integer dtypes have no kernels.
        assert_eq!(typed_function("scale", DType::BF16), Some("scale_bf16"));
        assert_eq!(typed_function("scale", DType::F16), Some("scale_f16"));
        assert_eq!(typed_function("scale", DType::U8), None);
        assert_eq!(typed_function("sum_squares", DType::F32), None);
        assert_eq!(cast_function(DType::U8, DType::F32), None);
    }
}
