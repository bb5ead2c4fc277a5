//! Moving rows and heads between layouts on the device with strided 2-D copies
//! (`cuMemcpy2DAsync`): `[B, T, parts·C]` (a linear layer's output, heads side by side in each
//! row) ↔ `parts` tensors `[B, NH, T, hs]` (what flash attention reads), and contiguous row
//! ranges for the head's loss chunks.
//!
//! Trade-off: headroom-kernels has no permute kernel, and the trainer may not ship CUDA C of
//! its own, so a permute is `B·min(NH, T)` copy commands per part instead of one kernel. The
//! copy engine moves the bytes exactly (these are bitwise), but at GPT-2 sizes the command
//! count costs launch overhead; a `permute_heads` kernel in headroom-kernels would replace
//! [`head_copies`] one for one. The copy *plans* are plain data, tested on the CPU against the
//! CPU model's own loops.

use cudarc::driver::sys::{self, CUmemorytype, CUresult};
use cudarc::driver::{DevicePtr, DevicePtrMut};
use headroom_cuda::{cudarc, Cuda, CudaError, CudaTensor, DriverErrorCode};
use headroom_tensor::{Backend, Error, Result, Tensor};

use crate::model::Geometry;

/// One strided 2-D copy, in bytes: `height` rows of `width` bytes, row `i` from
/// `src_offset + i·src_pitch` to `dst_offset + i·dst_pitch`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Copy2d {
    pub src_offset: usize,
    pub src_pitch: usize,
    pub dst_offset: usize,
    pub dst_pitch: usize,
    pub width: usize,
    pub height: usize,
}

impl Copy2d {
    /// The same bytes moved the other way.
    pub fn inverse(self) -> Copy2d {
        Copy2d {
            src_offset: self.dst_offset,
            src_pitch: self.dst_pitch,
            dst_offset: self.src_offset,
            dst_pitch: self.src_pitch,
            ..self
        }
    }

    /// One past the last byte read from (`src`) or written to (`dst`); `None` on overflow.
    fn ends(&self) -> Option<(usize, usize)> {
        if self.height == 0 || self.width == 0 {
            return Some((0, 0));
        }
        let last = self.height - 1;
        let end = |offset: usize, pitch: usize| {
            last.checked_mul(pitch)?
                .checked_add(offset)?
                .checked_add(self.width)
        };
        Some((
            end(self.src_offset, self.src_pitch)?,
            end(self.dst_offset, self.dst_pitch)?,
        ))
    }
}

/// The copies that move part `part` of a packed `[B, T, parts·NH·hs]` tensor into a
/// `[B, NH, T, hs]` tensor (elements of `elem` bytes); [`Copy2d::inverse`] of each moves it
/// back. Whichever of `B·NH` copies of `T` rows or `B·T` copies of `NH` rows is fewer.
pub(crate) fn head_copies(
    g: Geometry,
    nh: usize,
    hs: usize,
    parts: usize,
    part: usize,
    elem: usize,
) -> Vec<Copy2d> {
    let c = nh * hs;
    let packed_row = parts * c * elem;
    let width = hs * elem;
    let mut out = Vec::new();
    if nh <= g.t {
        // One copy per (sequence, head): its T rows, strided by a packed row.
        for b in 0..g.b {
            for h in 0..nh {
                out.push(Copy2d {
                    src_offset: b * g.t * packed_row + (part * c + h * hs) * elem,
                    src_pitch: packed_row,
                    dst_offset: (b * nh + h) * g.t * width,
                    dst_pitch: width,
                    width,
                    height: g.t,
                });
            }
        }
    } else {
        // One copy per (sequence, position): its NH heads, strided by a head's T rows.
        for b in 0..g.b {
            for t in 0..g.t {
                out.push(Copy2d {
                    src_offset: (b * g.t + t) * packed_row + part * c * elem,
                    src_pitch: width,
                    dst_offset: (b * nh * g.t + t) * width,
                    dst_pitch: g.t * width,
                    width,
                    height: nh,
                });
            }
        }
    }
    out
}

/// The copy of `rows` contiguous rows of `row_bytes` from row `from` of the source to row
/// `to` of the destination.
pub(crate) fn row_copy(from: usize, to: usize, rows: usize, row_bytes: usize) -> Copy2d {
    Copy2d {
        src_offset: from * row_bytes,
        src_pitch: row_bytes,
        dst_offset: to * row_bytes,
        dst_pitch: row_bytes,
        width: rows * row_bytes,
        height: 1,
    }
}

/// Run `copies` from `src` into `dst` on the backend's stream, after checking devices, dtypes
/// and every copy's bounds (nothing runs if one is out of bounds).
pub(crate) fn run_copies(
    cuda: &Cuda,
    dst: &mut CudaTensor,
    src: &CudaTensor,
    copies: &[Copy2d],
) -> Result<()> {
    const OP: &str = "strided copy";
    for t in [&*dst, src] {
        if t.device() != cuda.device() {
            return Err(Error::DeviceMismatch {
                op: OP,
                expected: cuda.device(),
                got: t.device(),
            });
        }
    }
    if dst.dtype() != src.dtype() {
        return Err(Error::DTypeMismatch {
            op: OP,
            expected: dst.dtype(),
            got: src.dtype(),
        });
    }
    let (src_len, dst_len) = (src.size_in_bytes(), dst.size_in_bytes());
    for c in copies {
        // The driver needs pitches of at least the width (a single row has no pitch).
        let in_bounds = c.ends().is_some_and(|(s, d)| s <= src_len && d <= dst_len)
            && (c.height <= 1 || (c.src_pitch >= c.width && c.dst_pitch >= c.width));
        if !in_bounds {
            return Err(Error::InvalidShape {
                op: OP,
                shape: src.shape().clone(),
                reason: "a copy reaches past the end of its source or destination",
            });
        }
    }
    let copies: Vec<&Copy2d> = copies
        .iter()
        .filter(|c| c.width > 0 && c.height > 0)
        .collect();
    if copies.is_empty() {
        return Ok(());
    }
    let fail = |op: &'static str, code: CUresult| Error::Backend {
        device: cuda.device(),
        op: OP,
        source: Box::new(CudaError::Driver {
            op,
            source: DriverErrorCode(code),
        }),
    };
    cuda.context()
        .bind_to_thread()
        .map_err(|e| fail("cuCtxSetCurrent", e.0))?;
    let empty = || Error::InvalidShape {
        op: OP,
        shape: src.shape().clone(),
        reason: "empty tensor",
    };
    let stream = cuda.stream();
    let src_slice = src.slice().ok_or_else(empty)?;
    let dst_slice = dst.slice_mut().ok_or_else(empty)?;
    let (src_ptr, _src_sync) = src_slice.device_ptr(stream);
    let (dst_ptr, _dst_sync) = dst_slice.device_ptr_mut(stream);
    for c in copies {
        if c.height == 1 {
            // A single row is a plain copy (no pitch limit on its width).
            // SAFETY: as below; the row lies inside both allocations (checked above).
            let code = unsafe {
                sys::cuMemcpyDtoDAsync_v2(
                    dst_ptr + c.dst_offset as u64,
                    src_ptr + c.src_offset as u64,
                    c.width,
                    stream.cu_stream(),
                )
            };
            if code != CUresult::CUDA_SUCCESS {
                return Err(fail("cuMemcpyDtoDAsync", code));
            }
            continue;
        }
        let params = sys::CUDA_MEMCPY2D {
            srcXInBytes: 0,
            srcY: 0,
            srcMemoryType: CUmemorytype::CU_MEMORYTYPE_DEVICE,
            srcHost: std::ptr::null(),
            srcDevice: src_ptr + c.src_offset as u64,
            srcArray: std::ptr::null_mut(),
            srcPitch: c.src_pitch,
            dstXInBytes: 0,
            dstY: 0,
            dstMemoryType: CUmemorytype::CU_MEMORYTYPE_DEVICE,
            dstHost: std::ptr::null_mut(),
            dstDevice: dst_ptr + c.dst_offset as u64,
            dstArray: std::ptr::null_mut(),
            dstPitch: c.dst_pitch,
            WidthInBytes: c.width,
            Height: c.height,
        };
        // SAFETY: both pointers are live device allocations of this context, every row of the
        // copy lies inside them (checked above), the destination is borrowed mutably and so
        // aliases nothing, and the copy is ordered on the backend's stream like every kernel.
        let code = unsafe { sys::cuMemcpy2DAsync_v2(&params, stream.cu_stream()) };
        if code != CUresult::CUDA_SUCCESS {
            return Err(fail("cuMemcpy2DAsync", code));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Apply copies to host byte buffers, as the copy engine would.
    fn apply(dst: &mut [u8], src: &[u8], copies: &[Copy2d]) {
        for c in copies {
            for i in 0..c.height {
                let s = c.src_offset + i * c.src_pitch;
                let d = c.dst_offset + i * c.dst_pitch;
                dst[d..d + c.width].copy_from_slice(&src[s..s + c.width]);
            }
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]

        /// The plans move exactly the elements the CPU model's `split_heads` moves (the
        /// `[B, T, parts·C] → [B, NH, T, hs]` permutation), and their inverses move them back.
        #[test]
        fn head_copies_are_the_cpu_permutation(
            b in 1usize..3, t in 1usize..6, nh in 1usize..5, hs in 1usize..4, parts in 1usize..4,
        ) {
            let g = Geometry { b, t };
            let c = nh * hs;
            let elem = 2;
            let packed: Vec<u8> = (0..b * t * parts * c * elem).map(|i| (i % 251) as u8).collect();
            let mut rebuilt = vec![0u8; packed.len()];
            for part in 0..parts {
                let copies = head_copies(g, nh, hs, parts, part, elem);
                let mut heads = vec![0u8; b * nh * t * hs * elem];
                apply(&mut heads, &packed, &copies);
                for bi in 0..b {
                    for ti in 0..t {
                        for h in 0..nh {
                            for e in 0..hs * elem {
                                let want = packed[(bi * t + ti) * parts * c * elem + (part * c + h * hs) * elem + e];
                                let got = heads[((bi * nh + h) * t + ti) * hs * elem + e];
                                prop_assert_eq!(got, want);
                            }
                        }
                    }
                }
                let back: Vec<Copy2d> = copies.iter().map(|c| c.inverse()).collect();
                apply(&mut rebuilt, &heads, &back);
                prop_assert_eq!(copies.len(), b * nh.min(t));
            }
            prop_assert_eq!(rebuilt, packed);
        }

        #[test]
        fn row_copies_stay_in_bounds(rows in 1usize..9, from in 0usize..9, row_bytes in 1usize..16) {
            let c = row_copy(from, 0, rows, row_bytes);
            let (s, d) = c.ends().unwrap();
            prop_assert_eq!(s, (from + rows) * row_bytes);
            prop_assert_eq!(d, rows * row_bytes);
        }
    }
}
