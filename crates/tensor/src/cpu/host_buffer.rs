//! Host memory for CPU tensors: 64-byte aligned (a cache line, an AVX-512 register), zeroed,
//! and allocated fallibly so an impossible request is an error instead of an abort.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use bytemuck::{Pod, Zeroable};

use crate::Element;

/// One cache line. Buffers are slices of these so their alignment comes from the type, with no
/// unsafe allocation code.
#[derive(Clone, Copy, Pod, Zeroable)]
#[repr(C, align(64))]
struct CacheLine([u8; 64]);

/// Freed buffers kept for reuse, by size in cache lines, up to a byte cap.
///
/// Why: a training step allocates the same shapes every time, and large fresh allocations come
/// from the kernel as untouched pages, so each step pays a page fault and a kernel page-clear
/// per 4 KiB on top of our own zeroing. Reusing a freed buffer of the same size costs only the
/// zeroing. Like a caching GPU allocator, cached bytes are not live tensors: allocation hooks
/// see every tensor's allocation and free exactly as without the cache.
pub(crate) struct BufferCache {
    inner: Mutex<CacheInner>,
}

struct CacheInner {
    free: HashMap<usize, Vec<Box<[CacheLine]>>>,
    bytes: usize,
    cap: usize,
}

impl BufferCache {
    pub(crate) fn new(cap: usize) -> Self {
        BufferCache {
            inner: Mutex::new(CacheInner {
                free: HashMap::new(),
                bytes: 0,
                cap,
            }),
        }
    }

    /// Bytes held by freed buffers waiting for reuse.
    pub(crate) fn cached_bytes(&self) -> usize {
        self.inner.lock().map_or(0, |c| c.bytes)
    }

    fn take(&self, lines: usize) -> Option<Box<[CacheLine]>> {
        // A poisoned lock only means another thread panicked mid-update: allocate fresh.
        let mut c = self.inner.lock().ok()?;
        let buf = c.free.get_mut(&lines)?.pop()?;
        c.bytes -= lines * 64;
        Some(buf)
    }

    fn put(&self, buf: Box<[CacheLine]>) {
        let bytes = buf.len() * 64;
        if let Ok(mut c) = self.inner.lock() {
            if bytes > 0 && c.bytes + bytes <= c.cap {
                c.bytes += bytes;
                c.free.entry(buf.len()).or_default().push(buf);
            }
        }
    }
}

/// A zero-initialised, 64-byte-aligned host allocation of exactly `len` bytes (rounded up to
/// whole cache lines internally).
pub(crate) struct HostBuffer {
    lines: Box<[CacheLine]>,
    len: usize,
    /// Where the lines go when the buffer is dropped.
    cache: Option<Arc<BufferCache>>,
}

impl HostBuffer {
    /// A zeroed buffer, reusing (and later returning to) `cache` when given; `None` when the
    /// allocator has no memory for the request.
    pub(crate) fn zeroed_in(len: usize, cache: Option<&Arc<BufferCache>>) -> Option<Self> {
        let n = len.div_ceil(64);
        let lines = match cache.and_then(|c| c.take(n)) {
            Some(mut reused) => {
                reused.fill(CacheLine::zeroed());
                reused
            }
            None => bytemuck::allocation::try_zeroed_slice_box::<CacheLine>(n).ok()?,
        };
        Some(HostBuffer {
            lines,
            len,
            cache: cache.cloned(),
        })
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

impl Drop for HostBuffer {
    fn drop(&mut self) {
        if let Some(cache) = self.cache.take() {
            cache.put(std::mem::take(&mut self.lines));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cache_reuses_same_sized_buffers_zeroed_and_respects_its_cap() {
        let cache = Arc::new(BufferCache::new(10 * 64));
        let mut a = HostBuffer::zeroed_in(300, Some(&cache)).unwrap();
        a.bytes_mut().fill(7);
        let ptr = a.bytes().as_ptr();
        drop(a);
        assert_eq!(cache.cached_bytes(), 5 * 64);
        let b = HostBuffer::zeroed_in(301, Some(&cache)).unwrap(); // also 5 lines
        assert_eq!(b.bytes().as_ptr(), ptr, "the freed buffer is reused");
        assert!(b.bytes().iter().all(|&x| x == 0), "and zeroed again");
        assert_eq!(cache.cached_bytes(), 0);
        let c = HostBuffer::zeroed_in(64 * 11, Some(&cache)).unwrap();
        drop(c); // 11 lines exceed the cap of 10: freed, not kept
        assert_eq!(cache.cached_bytes(), 0);
        drop(b);
        assert_eq!(cache.cached_bytes(), 5 * 64);
        let d = HostBuffer::zeroed_in(64, Some(&cache)).unwrap(); // other size: fresh
        assert_ne!(d.bytes().as_ptr(), ptr);
        assert_eq!(cache.cached_bytes(), 5 * 64);
    }

    #[test]
    fn aligned_zeroed_exact_length() {
        for len in [0usize, 1, 63, 64, 65, 4096 + 12] {
            let b = HostBuffer::zeroed_in(len, None).unwrap();
            assert_eq!(b.bytes().len(), len);
            assert!(b.bytes().iter().all(|&x| x == 0));
            assert_eq!(b.bytes().as_ptr() as usize % 64, 0);
        }
    }

    #[test]
    fn impossible_request_is_none() {
        assert!(HostBuffer::zeroed_in(usize::MAX - 64, None).is_none());
    }
}
