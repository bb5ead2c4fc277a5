//! Where optimizer moments live: host RAM, or a memory-mapped file (NVMe offload in the spirit
//! of ZeRO-Infinity). The optimizer sees both as one byte region; the file survives the process
//! and can be reopened to continue a run.
//!
//! A store file belongs to one optimizer at a time: it is held under an exclusive advisory
//! lock (`flock`) for the store's lifetime, so a second run pointed at the same path (two runs
//! with the default `optimizer-state.bin` in one directory) is refused with
//! [`OffloadError::StateFileInUse`] instead of truncating the moments the first one is
//! training on.
//!
//! A store file's disk blocks are reserved when it is created or reopened (Linux): a mapping
//! over a sparse file on a full disk would kill the process with SIGBUS at the first store
//! that needs a block; reserved, a disk without room is [`OffloadError::StateFileNoSpace`]
//! before the first step.

use std::fs::{File, OpenOptions, TryLockError};
use std::path::{Path, PathBuf};

use headroom_tensor::{Backend, Cpu, CpuTensor, DType, MemoryCategory};
use memmap2::MmapMut;

use crate::{OffloadError, Result};

/// File layout: a header page, then the payload (page-aligned, so f32 views are aligned).
const HEADER_BYTES: usize = 4096;
const MAGIC: &[u8; 8] = b"HRMOMENT";
const VERSION: u32 = 1;

/// What a store file must say about itself to be reopened by a given optimizer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StoreIdentity {
    /// 0 for f32 moments, 1 for 8-bit.
    pub precision_code: u32,
    /// Payload size in bytes.
    pub payload_bytes: u64,
    /// Hash of the parameter sizes, so a file of another model is refused.
    pub layout_fingerprint: u64,
}

impl StoreIdentity {
    fn encode(&self) -> [u8; 36] {
        let mut h = [0u8; 36];
        h[..8].copy_from_slice(MAGIC);
        h[8..12].copy_from_slice(&VERSION.to_le_bytes());
        h[12..16].copy_from_slice(&self.precision_code.to_le_bytes());
        h[16..24].copy_from_slice(&self.payload_bytes.to_le_bytes());
        h[24..32].copy_from_slice(&self.layout_fingerprint.to_le_bytes());
        h[32..36].copy_from_slice(&0u32.to_le_bytes());
        h
    }
}

/// The byte region holding the moments.
pub enum StateStore {
    /// Host memory allocated through the CPU backend (reported as optimizer state).
    Ram(CpuTensor),
    /// A shared, writable mapping of a file.
    File {
        /// The mapping (header page + payload).
        map: MmapMut,
        /// The file's path, for errors.
        path: PathBuf,
        /// The open file holding the exclusive lock: the lock lasts as long as this handle,
        /// not as long as the mapping, so it is kept for the store's lifetime.
        lock: File,
    },
}

impl StateStore {
    /// Zeroed moments in RAM, allocated through `cpu` under [`MemoryCategory::OptimizerState`].
    pub fn ram(cpu: &Cpu, bytes: usize) -> Result<Self> {
        let _g = MemoryCategory::OptimizerState.enter();
        Ok(StateStore::Ram(cpu.zeros([bytes], DType::U8)?))
    }

    /// Create (or truncate) a store file of the right size, zero-filled, and map it. A file
    /// another store holds (in this process or another) is refused with
    /// [`OffloadError::StateFileInUse`] and left as it is.
    pub fn create_file(path: &Path, id: StoreIdentity) -> Result<Self> {
        let io = |source| OffloadError::Io {
            path: path.to_path_buf(),
            source,
        };
        // Not truncated on open: the file may be another live store's, and only the lock
        // can tell.
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(path)
            .map_err(io)?;
        lock_exclusive(&file, path)?;
        let len = HEADER_BYTES as u64 + id.payload_bytes;
        // Truncating to 0 first zero-fills a file that already had this length.
        file.set_len(0).map_err(io)?;
        file.set_len(len).map_err(io)?;
        if let Err(e) = reserve(&file, path, len) {
            // Give back whatever part of the space was reserved.
            let _ = file.set_len(0);
            return Err(e);
        }
        let mut map = Self::map(&file, path)?;
        map[..36].copy_from_slice(&id.encode());
        Ok(StateStore::File {
            map,
            path: path.to_path_buf(),
            lock: file,
        })
    }

    /// Reopen a store file written by an optimizer of the same identity. A file another store
    /// holds is refused with [`OffloadError::StateFileInUse`].
    pub fn open_file(path: &Path, id: StoreIdentity) -> Result<Self> {
        let io = |source| OffloadError::Io {
            path: path.to_path_buf(),
            source,
        };
        let corrupt = |reason: String| OffloadError::CorruptStateFile {
            path: path.to_path_buf(),
            reason,
        };
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)
            .map_err(io)?;
        lock_exclusive(&file, path)?;
        let len = file.metadata().map_err(io)?.len();
        let want = HEADER_BYTES as u64 + id.payload_bytes;
        if len < HEADER_BYTES as u64 {
            return Err(corrupt(format!("{len} bytes is shorter than the header")));
        }
        let map = Self::map(&file, path)?;
        let header = &map[..36];
        if &header[..8] != MAGIC {
            return Err(corrupt("wrong magic".into()));
        }
        let found = id_from_header(header);
        if found.0 != VERSION {
            return Err(corrupt(format!("version {} (expected {VERSION})", found.0)));
        }
        if found.1 != id {
            return Err(corrupt(format!(
                "written for {:?}, this optimizer needs {:?}",
                found.1, id
            )));
        }
        if len != want {
            return Err(corrupt(format!("{len} bytes, expected {want}")));
        }
        // A file written by another tool, copied or restored may be sparse.
        reserve(&file, path, len)?;
        Ok(StateStore::File {
            map,
            path: path.to_path_buf(),
            lock: file,
        })
    }

    fn map(file: &File, path: &Path) -> Result<MmapMut> {
        // SAFETY: the mapping is shared with the file. Another process truncating or writing
        // the file while it is mapped would be undefined behaviour; the store file is private
        // to this optimizer, which is the documented contract of a file store, and the
        // exclusive lock taken before mapping keeps every other store off it (a program that
        // ignores advisory locks is outside that contract).
        unsafe { MmapMut::map_mut(file) }.map_err(|source| OffloadError::Io {
            path: path.to_path_buf(),
            source,
        })
    }

    /// The payload bytes.
    pub fn bytes(&self) -> &[u8] {
        match self {
            StateStore::Ram(t) => t.as_bytes(),
            StateStore::File { map, .. } => &map[HEADER_BYTES..],
        }
    }

    /// The payload bytes, mutably.
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        match self {
            StateStore::Ram(t) => t.as_bytes_mut(),
            StateStore::File { map, .. } => &mut map[HEADER_BYTES..],
        }
    }

    /// Write dirty pages of a file store to disk (a no-op in RAM).
    pub fn flush(&mut self) -> Result<()> {
        match self {
            StateStore::Ram(_) => Ok(()),
            StateStore::File { map, path, .. } => map.flush().map_err(|source| OffloadError::Io {
                path: path.clone(),
                source,
            }),
        }
    }

    /// True for a file store.
    pub fn is_file(&self) -> bool {
        matches!(self, StateStore::File { .. })
    }
}

/// Allocate the disk blocks of `file`'s first `len` bytes. `set_len` alone makes a sparse
/// file: on a disk without room for it the mapping then works until a store into a page the
/// file system cannot back, which kills the process with SIGBUS mid-step. Reserved up front,
/// a disk that is too small is [`OffloadError::StateFileNoSpace`] before the first step, and
/// the mapping never faults for space. Only Linux is asked (`posix_fallocate`, which glibc
/// emulates where a file system lacks `fallocate`); elsewhere the file stays sparse.
fn reserve(file: &File, path: &Path, len: u64) -> Result<()> {
    #[cfg(target_os = "linux")]
    {
        use std::os::fd::AsRawFd;
        let no_space = || OffloadError::StateFileNoSpace {
            path: path.to_path_buf(),
            bytes: len,
        };
        let Ok(off_len) = libc::off_t::try_from(len) else {
            return Err(no_space());
        };
        // SAFETY: `file` is an open, writable descriptor for the duration of the call.
        match unsafe { libc::posix_fallocate(file.as_raw_fd(), 0, off_len) } {
            0 => Ok(()),
            libc::ENOSPC | libc::EFBIG | libc::EDQUOT => Err(no_space()),
            // Not supported here, even by emulation: the file stays sparse, as elsewhere.
            libc::EINVAL | libc::EOPNOTSUPP => Ok(()),
            code => Err(OffloadError::Io {
                path: path.to_path_buf(),
                source: std::io::Error::from_raw_os_error(code),
            }),
        }
    }
    #[cfg(not(target_os = "linux"))]
    {
        let _ = (file, path, len);
        Ok(())
    }
}

/// Take `file`'s exclusive advisory lock without waiting: a store file held by another store
/// is refused, never shared.
fn lock_exclusive(file: &File, path: &Path) -> Result<()> {
    match file.try_lock() {
        Ok(()) => Ok(()),
        Err(TryLockError::WouldBlock) => Err(OffloadError::StateFileInUse {
            path: path.to_path_buf(),
        }),
        Err(TryLockError::Error(source)) => Err(OffloadError::Io {
            path: path.to_path_buf(),
            source,
        }),
    }
}

fn id_from_header(h: &[u8]) -> (u32, StoreIdentity) {
    let u32_at = |o: usize| u32::from_le_bytes([h[o], h[o + 1], h[o + 2], h[o + 3]]);
    let u64_at = |o: usize| {
        let mut b = [0u8; 8];
        b.copy_from_slice(&h[o..o + 8]);
        u64::from_le_bytes(b)
    };
    (
        u32_at(8),
        StoreIdentity {
            precision_code: u32_at(12),
            payload_bytes: u64_at(16),
            layout_fingerprint: u64_at(24),
        },
    )
}
