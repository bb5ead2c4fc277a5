//! Host memory for CPU tensors: 64-byte aligned (a cache line, an AVX-512 register), zeroed,
//! and allocated fallibly so an impossible request is an error instead of an abort.
//!
//! Large buffers are anonymous mappings advised to use transparent huge pages (Linux's
//! `MADV_HUGEPAGE`). Why: the big tensors of a training step (moments, master weights,
//! activations, logits) are streamed end to end, and with 4 KiB pages that stream takes a TLB
//! miss every 4 KiB and the hardware prefetchers stop at every page boundary. On the project's
//! VM, CPU AdamW over 10M–50M parameters runs 4–7% faster on huge pages. The advice is
//! best-effort: where huge pages are off or unsupported the mapping behaves as ordinary memory.
//! PyTorch's CPU allocator does the same only when `THP_MEM_ALLOC_ENABLE=1` is set.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use bytemuck::{Pod, Zeroable};
use memmap2::MmapMut;

use crate::Element;

/// One cache line. Buffers are slices of these so their alignment comes from the type, with no
/// unsafe allocation code.
#[derive(Clone, Copy, Pod, Zeroable)]
#[repr(C, align(64))]
struct CacheLine([u8; 64]);

/// Buffers of at least this many bytes are huge-page-advised mappings: one 2 MiB huge page, so
/// smaller buffers, which could not fill one, keep the allocator's cheaper path.
pub(crate) const HUGE_PAGE_MIN_BYTES: usize = 2 << 20;

/// The cache lines a buffer of `lines` lines takes: a mapping is a whole number of 2 MiB
/// huge pages. Why: a buffer whose size changes a little each time (a KV cache grown by one
/// position per decode step, a batch of another length) then reuses the mapping freed a
/// moment before instead of faulting in and clearing fresh pages; at 900 cached positions
/// of GPT-2 124M those faults were about 30% of a decode step. The rounding is address
/// space: pages past the requested bytes are not touched, and only the whole huge pages of
/// the first request are advised as such, so the tail is not backed by a huge page.
fn size_class(lines: usize) -> usize {
    const HUGE_LINES: usize = HUGE_PAGE_MIN_BYTES / 64;
    if lines < HUGE_LINES {
        lines
    } else {
        lines.div_ceil(HUGE_LINES).saturating_mul(HUGE_LINES)
    }
}

/// The memory behind a buffer.
enum Storage {
    /// From the global allocator, aligned by the element type.
    Lines(Box<[CacheLine]>),
    /// An anonymous mapping (page-aligned, zero-filled by the kernel on first touch).
    Mapped(MmapMut),
}

impl Storage {
    /// Zeroed storage for `lines` cache lines (a mapping rounded up to its [`size_class`]);
    /// `None` when the system has no memory for it.
    fn zeroed(lines: usize) -> Option<Storage> {
        let requested = lines.checked_mul(64)?;
        let lines = size_class(lines);
        let bytes = lines.checked_mul(64)?;
        if bytes < HUGE_PAGE_MIN_BYTES {
            return bytemuck::allocation::try_zeroed_slice_box::<CacheLine>(lines)
                .ok()
                .map(Storage::Lines);
        }
        let map = MmapMut::map_anon(bytes).ok()?;
        #[cfg(target_os = "linux")]
        {
            // Best-effort: a kernel without transparent huge pages refuses the advice, and the
            // mapping then works as ordinary pages.
            let huge = requested / HUGE_PAGE_MIN_BYTES * HUGE_PAGE_MIN_BYTES;
            let _ = map.advise_range(memmap2::Advice::HugePage, 0, huge);
        }
        Some(Storage::Mapped(map))
    }

    fn bytes(&self) -> &[u8] {
        match self {
            Storage::Lines(lines) => bytemuck::cast_slice(lines),
            Storage::Mapped(map) => map,
        }
    }

    fn bytes_mut(&mut self) -> &mut [u8] {
        match self {
            Storage::Lines(lines) => bytemuck::cast_slice_mut(lines),
            Storage::Mapped(map) => map,
        }
    }
}

/// Freed buffers kept for reuse, by size class in cache lines ([`size_class`]), up to a byte
/// cap.
///
/// Why: a training step allocates the same shapes every time, and large fresh allocations come
/// from the kernel as untouched pages, so each step pays a page fault and a kernel page-clear
/// per 4 KiB on top of our own zeroing. Reusing a freed buffer of the same size costs only the
/// zeroing. Like a caching GPU allocator, cached bytes are not live tensors: allocation hooks
/// see every tensor's allocation and free exactly as without the cache. A buffer that would
/// take the cache past its cap pushes out the longest-kept ones first, so sizes a run no
/// longer allocates (a model load's) do not hold the room a loop's sizes need.
pub(crate) struct BufferCache {
    inner: Mutex<CacheInner>,
}

struct CacheInner {
    /// By size class: each buffer with the order it was kept in, oldest first.
    free: HashMap<usize, std::collections::VecDeque<(u64, Storage)>>,
    bytes: usize,
    cap: usize,
    kept: u64,
}

impl BufferCache {
    pub(crate) fn new(cap: usize) -> Self {
        BufferCache {
            inner: Mutex::new(CacheInner {
                free: HashMap::new(),
                bytes: 0,
                cap,
                kept: 0,
            }),
        }
    }

    /// Bytes held by freed buffers waiting for reuse.
    pub(crate) fn cached_bytes(&self) -> usize {
        self.inner.lock().map_or(0, |c| c.bytes)
    }

    fn take(&self, lines: usize) -> Option<Storage> {
        // A poisoned lock only means another thread panicked mid-update: allocate fresh.
        let class = size_class(lines);
        let mut c = self.inner.lock().ok()?;
        // The most recently kept: the likeliest to still be in the CPU's caches.
        let (_, buf) = c.free.get_mut(&class)?.pop_back()?;
        c.bytes -= class * 64;
        Some(buf)
    }

    fn put(&self, buf: Storage) {
        let bytes = buf.bytes().len();
        let Ok(mut c) = self.inner.lock() else { return };
        if bytes == 0 || bytes > c.cap {
            return;
        }
        while c.bytes + bytes > c.cap {
            // The longest-kept buffer goes (a scan over the size classes, which are few).
            let oldest = c
                .free
                .iter()
                .filter_map(|(&class, q)| q.front().map(|(order, _)| (*order, class)))
                .min();
            let Some((_, class)) = oldest else { break };
            if let Some(q) = c.free.get_mut(&class) {
                q.pop_front();
                if q.is_empty() {
                    c.free.remove(&class);
                }
            }
            c.bytes -= class * 64;
        }
        c.kept += 1;
        let order = c.kept;
        c.bytes += bytes;
        c.free
            .entry(bytes / 64)
            .or_default()
            .push_back((order, buf));
    }
}

/// A zero-initialised, 64-byte-aligned host allocation of exactly `len` bytes (rounded up to
/// whole cache lines internally).
pub(crate) struct HostBuffer {
    /// `None` only while being dropped into the cache.
    storage: Option<Storage>,
    len: usize,
    /// Where the lines go when the buffer is dropped.
    cache: Option<Arc<BufferCache>>,
}

impl HostBuffer {
    /// A buffer of `len` bytes, reusing (and later returning to) `cache` when given; `None`
    /// when the allocator has no memory for the request. Zeroed when `clear`; otherwise its
    /// contents are unspecified: zeros when freshly allocated, a reused buffer's old bytes.
    /// Always initialised memory (a reused buffer was written as some earlier tensor), so
    /// reading it is defined; `clear` false only skips clearing a reused buffer that the
    /// caller overwrites anyway.
    ///
    /// Debug builds (the tests) fill an uncleared buffer with `0xff` bytes, NaN in every float
    /// dtype, so an op that leaves part of such an output unwritten shows up in any test that
    /// reads it, not only when a reused buffer happens to hold other values.
    pub(crate) fn new_in(
        len: usize,
        cache: Option<&Arc<BufferCache>>,
        clear: bool,
    ) -> Option<Self> {
        let n = len.div_ceil(64);
        let mut storage = match cache.and_then(|c| c.take(n)) {
            Some(mut reused) => {
                // Only the requested bytes: a mapping's tail past them stays untouched (not
                // resident), whatever an earlier, larger buffer of its class wrote there.
                if clear {
                    reused.bytes_mut()[..len].fill(0);
                }
                reused
            }
            // Fresh memory comes zeroed from the allocator either way (pages the kernel
            // clears on first touch), so there is nothing to skip.
            None => Storage::zeroed(n)?,
        };
        if !clear && cfg!(debug_assertions) {
            storage.bytes_mut()[..len].fill(0xff);
        }
        Some(HostBuffer {
            storage: Some(storage),
            len,
            cache: cache.cloned(),
        })
    }

    pub(crate) fn bytes(&self) -> &[u8] {
        match &self.storage {
            Some(s) => &s.bytes()[..self.len],
            None => &[],
        }
    }

    pub(crate) fn bytes_mut(&mut self) -> &mut [u8] {
        match &mut self.storage {
            Some(s) => &mut s.bytes_mut()[..self.len],
            None => &mut [],
        }
    }

    /// Whether the buffer is a huge-page-advised mapping (for tests).
    #[cfg(test)]
    fn is_mapped(&self) -> bool {
        matches!(self.storage, Some(Storage::Mapped(_)))
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
        if let (Some(cache), Some(storage)) = (self.cache.take(), self.storage.take()) {
            cache.put(storage);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cache_reuses_same_sized_buffers_zeroed_and_respects_its_cap() {
        let cache = Arc::new(BufferCache::new(10 * 64));
        let mut a = HostBuffer::new_in(300, Some(&cache), true).unwrap();
        a.bytes_mut().fill(7);
        let ptr = a.bytes().as_ptr();
        drop(a);
        assert_eq!(cache.cached_bytes(), 5 * 64);
        let b = HostBuffer::new_in(301, Some(&cache), true).unwrap(); // also 5 lines
        assert_eq!(b.bytes().as_ptr(), ptr, "the freed buffer is reused");
        assert!(b.bytes().iter().all(|&x| x == 0), "and zeroed again");
        assert_eq!(cache.cached_bytes(), 0);
        let c = HostBuffer::new_in(64 * 11, Some(&cache), true).unwrap();
        drop(c); // 11 lines exceed the cap of 10: freed, not kept
        assert_eq!(cache.cached_bytes(), 0);
        drop(b);
        assert_eq!(cache.cached_bytes(), 5 * 64);
        let d = HostBuffer::new_in(64, Some(&cache), true).unwrap(); // other size: fresh
        assert_ne!(d.bytes().as_ptr(), ptr);
        assert_eq!(cache.cached_bytes(), 5 * 64);
    }

    /// Without clearing: a reused buffer, not cleared — its old bytes in a release build, NaN
    /// bytes in a debug one (the tests' poison); a fresh one zero, or the poison.
    #[test]
    fn an_unspecified_buffer_is_reused_without_clearing() {
        let unspecified = if cfg!(debug_assertions) { 0xff } else { 9 };
        let cache = Arc::new(BufferCache::new(10 * 64));
        let fresh = HostBuffer::new_in(200, Some(&cache), false).unwrap();
        let fresh_byte = if cfg!(debug_assertions) { 0xff } else { 0 };
        assert!(fresh.bytes().iter().all(|&x| x == fresh_byte));
        assert_eq!(fresh.bytes().len(), 200);
        drop(fresh);
        let mut a = HostBuffer::new_in(256, Some(&cache), true).unwrap(); // the same 4 lines
        assert!(a.bytes().iter().all(|&x| x == 0), "cleared when asked");
        a.bytes_mut().fill(9);
        let ptr = a.bytes().as_ptr();
        drop(a);
        let b = HostBuffer::new_in(255, Some(&cache), false).unwrap();
        assert_eq!(b.bytes().as_ptr(), ptr, "the freed buffer is reused");
        assert!(b.bytes().iter().all(|&x| x == unspecified));
        assert_eq!(b.bytes().len(), 255);
    }

    #[test]
    fn aligned_zeroed_exact_length() {
        for len in [0usize, 1, 63, 64, 65, 4096 + 12] {
            let b = HostBuffer::new_in(len, None, true).unwrap();
            assert_eq!(b.bytes().len(), len);
            assert!(b.bytes().iter().all(|&x| x == 0));
            assert_eq!(b.bytes().as_ptr() as usize % 64, 0);
        }
    }

    #[test]
    fn large_buffers_are_page_aligned_zeroed_mappings_and_are_cached_too() {
        let len = HUGE_PAGE_MIN_BYTES + 100;
        let cache = Arc::new(BufferCache::new(8 * HUGE_PAGE_MIN_BYTES));
        let mut a = HostBuffer::new_in(len, Some(&cache), true).unwrap();
        assert!(a.is_mapped());
        assert_eq!(a.bytes().len(), len);
        assert_eq!(a.bytes().as_ptr() as usize % 4096, 0);
        assert!(a.bytes().iter().all(|&x| x == 0));
        a.typed_mut::<f32>()[..(len / 4)].fill(1.5);
        let ptr = a.bytes().as_ptr();
        drop(a);
        // A whole number of huge pages.
        assert_eq!(cache.cached_bytes(), 2 * HUGE_PAGE_MIN_BYTES);
        let b = HostBuffer::new_in(len, Some(&cache), true).unwrap();
        assert!(b.is_mapped());
        assert_eq!(b.bytes().as_ptr(), ptr, "the freed mapping is reused");
        assert!(b.bytes().iter().all(|&x| x == 0), "and zeroed again");
        // Just below the threshold: the allocator's path.
        let small = HostBuffer::new_in(HUGE_PAGE_MIN_BYTES - 64, None, true).unwrap();
        assert!(!small.is_mapped());
    }

    /// A buffer that grows a little each time (a KV cache, a position per step) takes the
    /// mapping freed before it while the sizes share a huge-page size class, zeroed or not as
    /// asked, and exactly the requested length; a size past the class maps afresh.
    #[test]
    fn growing_buffers_reuse_the_mapping_freed_before() {
        let cache = Arc::new(BufferCache::new(16 * HUGE_PAGE_MIN_BYTES));
        let start = HUGE_PAGE_MIN_BYTES + 4096;
        let mut held = HostBuffer::new_in(start, Some(&cache), true).unwrap();
        let mut mappings = vec![held.bytes().as_ptr()];
        for step in 1..64 {
            let len = start + step * 3 * 1024;
            let clear = step % 2 == 0;
            let mut next = HostBuffer::new_in(len, Some(&cache), clear).unwrap();
            assert_eq!(next.bytes().len(), len);
            if clear {
                assert!(next.bytes().iter().all(|&x| x == 0), "step {step}");
            }
            next.bytes_mut().fill(step as u8);
            if !mappings.contains(&next.bytes().as_ptr()) {
                mappings.push(next.bytes().as_ptr());
            }
            drop(held);
            held = next;
        }
        // The one held and the one freed before it alternate.
        assert_eq!(mappings.len(), 2);
        assert_eq!(cache.cached_bytes(), 2 * HUGE_PAGE_MIN_BYTES);
        // Past the class (4 MiB): a fresh mapping, the cached one left for its own class.
        let bigger = HostBuffer::new_in(2 * HUGE_PAGE_MIN_BYTES + 1, Some(&cache), true).unwrap();
        assert!(bigger.is_mapped());
        assert!(!mappings.contains(&bigger.bytes().as_ptr()));
        assert_eq!(cache.cached_bytes(), 2 * HUGE_PAGE_MIN_BYTES);
    }

    /// A full cache makes room by dropping its longest-kept buffers, never exceeding its cap,
    /// and a buffer larger than the cap is not kept at all.
    #[test]
    fn a_full_cache_drops_its_longest_kept_buffers() {
        let cache = Arc::new(BufferCache::new(10 * 64));
        let a = HostBuffer::new_in(5 * 64, Some(&cache), true).unwrap();
        let b = HostBuffer::new_in(4 * 64, Some(&cache), true).unwrap();
        let c = HostBuffer::new_in(3 * 64, Some(&cache), true).unwrap();
        let (pa, pb, pc) = (a.bytes().as_ptr(), b.bytes().as_ptr(), c.bytes().as_ptr());
        drop(a);
        drop(b);
        assert_eq!(cache.cached_bytes(), 9 * 64);
        drop(c); // 12 lines: the 5-line buffer, kept first, goes.
        assert_eq!(cache.cached_bytes(), 7 * 64);
        let again = HostBuffer::new_in(5 * 64, Some(&cache), true).unwrap();
        assert_ne!(again.bytes().as_ptr(), pa, "the oldest was dropped");
        assert_eq!(cache.cached_bytes(), 7 * 64);
        let b2 = HostBuffer::new_in(4 * 64, Some(&cache), true).unwrap();
        let c2 = HostBuffer::new_in(3 * 64, Some(&cache), true).unwrap();
        assert_eq!((b2.bytes().as_ptr(), c2.bytes().as_ptr()), (pb, pc));
        assert_eq!(cache.cached_bytes(), 0);
        drop(HostBuffer::new_in(11 * 64, Some(&cache), true).unwrap());
        assert_eq!(cache.cached_bytes(), 0, "larger than the cap: not kept");
    }

    #[test]
    fn size_classes_round_mappings_to_huge_pages_only() {
        let huge = HUGE_PAGE_MIN_BYTES / 64;
        assert_eq!(size_class(1), 1);
        assert_eq!(size_class(huge - 1), huge - 1);
        assert_eq!(size_class(huge), huge);
        assert_eq!(size_class(huge + 1), 2 * huge);
        // Saturated: the allocation then fails as any impossible request does.
        assert_eq!(size_class(usize::MAX), usize::MAX);
    }

    #[test]
    fn impossible_request_is_none() {
        assert!(HostBuffer::new_in(usize::MAX - 64, None, true).is_none());
    }
}
