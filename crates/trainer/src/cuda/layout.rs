//! Moving contiguous row ranges between device tensors with copy-engine commands
//! (`cuMemcpyDtoDAsync`): the LM head's loss chunks take rows of the final layer norm, the
//! targets and the losses in and out of per-chunk buffers.
//!
//! Attention heads do not move here: `[B, T, parts·C]` ⇄ `[B, NH, T, hs]` is one
//! `permute_heads` kernel launch per part ([`headroom_cuda::Cuda::split_heads`] /
//! [`headroom_cuda::Cuda::merge_heads`]), where it used to be `B·min(NH, T)` strided copy
//! commands. The copy *plans* here are plain data, tested on the CPU.

use cudarc::driver::sys::{self, CUresult};
use cudarc::driver::{DevicePtr, DevicePtrMut};
use headroom_cuda::{cudarc, Cuda, CudaError, CudaTensor, DriverErrorCode};
use headroom_tensor::{Backend, Error, Result, Tensor};

/// One contiguous copy of `bytes` bytes from `src_offset` to `dst_offset`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct RowCopy {
    pub src_offset: usize,
    pub dst_offset: usize,
    pub bytes: usize,
}

impl RowCopy {
    /// One past the last byte read from (`src`) or written to (`dst`); `None` on overflow.
    fn ends(&self) -> Option<(usize, usize)> {
        Some((
            self.src_offset.checked_add(self.bytes)?,
            self.dst_offset.checked_add(self.bytes)?,
        ))
    }
}

/// The copy of `rows` contiguous rows of `row_bytes` from row `from` of the source to row
/// `to` of the destination.
pub(crate) fn row_copy(from: usize, to: usize, rows: usize, row_bytes: usize) -> RowCopy {
    RowCopy {
        src_offset: from * row_bytes,
        dst_offset: to * row_bytes,
        bytes: rows * row_bytes,
    }
}

/// Run `copies` from `src` into `dst` on the backend's stream, after checking devices, dtypes
/// and every copy's bounds (nothing runs if one is out of bounds).
pub(crate) fn run_copies(
    cuda: &Cuda,
    dst: &mut CudaTensor,
    src: &CudaTensor,
    copies: &[RowCopy],
) -> Result<()> {
    const OP: &str = "row copy";
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
        let in_bounds = c.ends().is_some_and(|(s, d)| s <= src_len && d <= dst_len);
        if !in_bounds {
            return Err(Error::InvalidShape {
                op: OP,
                shape: src.shape().clone(),
                reason: "a copy reaches past the end of its source or destination",
            });
        }
    }
    let copies: Vec<&RowCopy> = copies.iter().filter(|c| c.bytes > 0).collect();
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
        // SAFETY: both pointers are live device allocations of this context, the copied range
        // lies inside both (checked above), the destination is borrowed mutably and so aliases
        // nothing, and the copy is ordered on the backend's stream like every kernel.
        let code = unsafe {
            sys::cuMemcpyDtoDAsync_v2(
                dst_ptr + c.dst_offset as u64,
                src_ptr + c.src_offset as u64,
                c.bytes,
                stream.cu_stream(),
            )
        };
        if code != CUresult::CUDA_SUCCESS {
            return Err(fail("cuMemcpyDtoDAsync", code));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Apply copies to host byte buffers, as the copy engine would.
    fn apply(dst: &mut [u8], src: &[u8], copies: &[RowCopy]) {
        for c in copies {
            dst[c.dst_offset..c.dst_offset + c.bytes]
                .copy_from_slice(&src[c.src_offset..c.src_offset + c.bytes]);
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]

        #[test]
        fn row_copies_stay_in_bounds(rows in 1usize..9, from in 0usize..9, row_bytes in 1usize..16) {
            let c = row_copy(from, 0, rows, row_bytes);
            let (s, d) = c.ends().unwrap();
            prop_assert_eq!(s, (from + rows) * row_bytes);
            prop_assert_eq!(d, rows * row_bytes);
        }

        /// A row copy moves exactly rows `from..from + rows` of the source to rows
        /// `to..to + rows` of the destination, and nothing else.
        #[test]
        fn row_copies_move_exactly_their_rows(
            rows in 1usize..6, from in 0usize..5, to in 0usize..5, row_bytes in 1usize..9,
        ) {
            let src: Vec<u8> = (0..(from + rows) * row_bytes).map(|i| (i % 251) as u8 + 1).collect();
            let mut dst = vec![0u8; (to + rows + 1) * row_bytes];
            apply(&mut dst, &src, &[row_copy(from, to, rows, row_bytes)]);
            for (i, &byte) in dst.iter().enumerate() {
                let row = i / row_bytes;
                let want = if (to..to + rows).contains(&row) {
                    src[(row - to + from) * row_bytes + i % row_bytes]
                } else {
                    0
                };
                prop_assert_eq!(byte, want, "byte {}", i);
            }
        }
    }
}
