//! Host memory for CPU tensors: 64-byte aligned (a cache line, an AVX-512 register), zeroed,
//! and allocated fallibly so an impossible request is an error instead of an abort.

use bytemuck::{Pod, Zeroable};

use crate::Element;

/// One cache line. Buffers are slices of these so their alignment comes from the type, with no
/// unsafe allocation code.
#[derive(Clone, Copy, Pod, Zeroable)]
#[repr(C, align(64))]
struct CacheLine([u8; 64]);

/// A zero-initialised, 64-byte-aligned host allocation of exactly `len` bytes (rounded up to
/// whole cache lines internally).
pub(crate) struct HostBuffer {
    lines: Box<[CacheLine]>,
    len: usize,
}

impl HostBuffer {
    /// `None` when the allocator has no memory for the request.
    pub(crate) fn zeroed(len: usize) -> Option<Self> {
        let lines = len.div_ceil(64);
        let lines = bytemuck::allocation::try_zeroed_slice_box::<CacheLine>(lines).ok()?;
        Some(HostBuffer { lines, len })
    }

    pub(crate) fn bytes(&self) -> &[u8] {
        &bytemuck::cast_slice::<CacheLine, u8>(&self.lines)[..self.len]
    }

    pub(crate) fn bytes_mut(&mut self) -> &mut [u8] {
        &mut bytemuck::cast_slice_mut::<CacheLine, u8>(&mut self.lines)[..self.len]
    }

    /// The buffer as elements of `T`. The caller has checked that `T` matches the tensor's
    /// dtype, so the byte length is a multiple of `size_of::<T>()`; alignment always holds.
    pub(crate) fn typed<T: Element>(&self) -> &[T] {
        bytemuck::cast_slice(self.bytes())
    }

    pub(crate) fn typed_mut<T: Element>(&mut self) -> &mut [T] {
        bytemuck::cast_slice_mut(self.bytes_mut())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aligned_zeroed_exact_length() {
        for len in [0usize, 1, 63, 64, 65, 4096 + 12] {
            let b = HostBuffer::zeroed(len).unwrap();
            assert_eq!(b.bytes().len(), len);
            assert!(b.bytes().iter().all(|&x| x == 0));
            assert_eq!(b.bytes().as_ptr() as usize % 64, 0);
        }
    }

    #[test]
    fn impossible_request_is_none() {
        assert!(HostBuffer::zeroed(usize::MAX - 64).is_none());
    }
}
