//! Loss masks: which targets of a token file count in the loss (supervised fine-tuning's
//! "completion only" loss, Hugging Face's `labels = -100` on the prompt).
//!
//! A mask lives beside its token file as `<token file>.lossmask` (for a Megatron pair, beside
//! the `.bin`), and [`crate::open`] attaches it to the file's segment; every reader of the
//! dataset then sees it. The file:
//!
//! | bytes | field |
//! |---|---|
//! | 0..8 | magic `HRLMASK1` |
//! | 8..16 | token count `n`, u64 little-endian: the token file's |
//! | 16..24 | counted tokens (ones in the bits), u64 little-endian |
//! | 24.. | `⌈n/8⌉` bytes of bits, token `i` in bit `i % 8` of byte `i / 8` (least significant first, numpy's `packbits(mask, bitorder="little")`); the bits past `n` are zero |
//!
//! Bit `i` says whether token `i` *as a target* counts: the window `[s, s + T]` trains on
//! predicting tokens `s+1 ..= s+T`, so its targets' counted flags are bits `s+1 ..= s+T`.
//! Everything is checked at open (size, count, padding, the count of ones), so a truncated or
//! corrupt mask is an error, not a silently different loss.

use std::fs::{self, File};
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::dataset::{map_file, Backing};
use crate::formats::writer::{remove_abandoned_temps, sync_parent_dir, temp_path_for};
use crate::rng::derive_seed_iter;
use crate::{DataError, Result};

/// The first eight bytes of a loss-mask file.
pub const LOSS_MASK_MAGIC: [u8; 8] = *b"HRLMASK1";
/// Bytes before the bits.
pub const LOSS_MASK_HEADER_BYTES: usize = 24;
/// What a token file's mask is called beside it: `<file name>.lossmask`.
pub const LOSS_MASK_SUFFIX: &str = ".lossmask";

/// The mask file that belongs to `token_file` (`train.bin` → `train.bin.lossmask`).
pub fn loss_mask_path(token_file: &Path) -> PathBuf {
    let mut name = token_file.as_os_str().to_owned();
    name.push(LOSS_MASK_SUFFIX);
    PathBuf::from(name)
}

/// True for a file name that is a loss mask (never a token shard of its own).
pub fn is_loss_mask_path(path: &Path) -> bool {
    path.file_name()
        .and_then(|n| n.to_str())
        .is_some_and(|n| n.ends_with(LOSS_MASK_SUFFIX))
}

/// One token file's loss mask, read in place (a memory map or owned bytes).
///
/// ```
/// use headroom_mmap_data::LossMask;
///
/// let mask = LossMask::from_flags(&[false, false, true, true, true]).unwrap();
/// assert_eq!((mask.len(), mask.counted()), (5, 3));
/// let mut flags = [false; 3];
/// mask.copy_to(1, &mut flags).unwrap();
/// assert_eq!(flags, [false, true, true]);
/// ```
#[derive(Clone)]
pub struct LossMask {
    backing: Arc<Backing>,
    len: usize,
    counted: u64,
    hash: u64,
    name: Arc<str>,
}

impl std::fmt::Debug for LossMask {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LossMask")
            .field("name", &self.name)
            .field("len", &self.len)
            .field("counted", &self.counted)
            .finish()
    }
}

/// The file's bytes for `flags`.
fn encode(flags: &[bool]) -> Result<Vec<u8>> {
    let body = flags.len().div_ceil(8);
    let mut bytes = crate::dataset::try_with_capacity(LOSS_MASK_HEADER_BYTES + body)?;
    bytes.extend_from_slice(&LOSS_MASK_MAGIC);
    bytes.extend_from_slice(&(flags.len() as u64).to_le_bytes());
    let counted = flags.iter().filter(|&&f| f).count() as u64;
    bytes.extend_from_slice(&counted.to_le_bytes());
    bytes.extend(flags.chunks(8).map(pack_byte));
    Ok(bytes)
}

fn pack_byte(flags: &[bool]) -> u8 {
    flags
        .iter()
        .enumerate()
        .fold(0u8, |b, (i, &f)| b | (u8::from(f) << i))
}

impl LossMask {
    /// An in-memory mask (tests, and masks built before they are written).
    pub fn from_flags(flags: &[bool]) -> Result<Self> {
        Self::parse(Arc::new(Backing::Owned(encode(flags)?)), "loss mask")
    }

    /// Read and check the mask file at `path`.
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        Self::parse(map_file(path)?, &path.display().to_string())
    }

    fn parse(backing: Arc<Backing>, name: &str) -> Result<Self> {
        let bytes = backing.bytes();
        let header = bytes.get(..LOSS_MASK_HEADER_BYTES).ok_or_else(|| {
            DataError::truncated(name, LOSS_MASK_HEADER_BYTES as u64, bytes.len() as u64)
        })?;
        if header[..8] != LOSS_MASK_MAGIC {
            return Err(DataError::BadMagic {
                what: name.into(),
                found: format!("{:?}", String::from_utf8_lossy(&header[..8])),
                expected: format!("{:?}", String::from_utf8_lossy(&LOSS_MASK_MAGIC)),
            });
        }
        let word = |at: usize| {
            let mut w = [0u8; 8];
            w.copy_from_slice(&header[at..at + 8]);
            u64::from_le_bytes(w)
        };
        let (n, declared) = (word(8), word(16));
        let body = n.div_ceil(8);
        let needed = body.checked_add(LOSS_MASK_HEADER_BYTES as u64);
        match needed {
            Some(needed) if needed == bytes.len() as u64 => {}
            Some(needed) if needed > bytes.len() as u64 => {
                return Err(DataError::truncated(name, needed, bytes.len() as u64))
            }
            _ => {
                return Err(DataError::corrupt(
                    name,
                    format!(
                        "{} bytes of bits where a mask of {n} tokens has {body}",
                        bytes.len() - LOSS_MASK_HEADER_BYTES
                    ),
                ))
            }
        }
        if n == 0 {
            return Err(DataError::Empty { what: name.into() });
        }
        // `n` bits fit the file, which fits the address space.
        let len = n as usize;
        let bits = &bytes[LOSS_MASK_HEADER_BYTES..];
        if !len.is_multiple_of(8) && bits[bits.len() - 1] >> (len % 8) != 0 {
            return Err(DataError::corrupt(name, "bits set past the last token"));
        }
        let counted: u64 = bits.iter().map(|b| u64::from(b.count_ones())).sum();
        if counted != declared {
            return Err(DataError::corrupt(
                name,
                format!("the header says {declared} counted tokens, the bits hold {counted}"),
            ));
        }
        let hash = derive_seed_iter([n, counted].into_iter().chain(bits.chunks(8).map(|c| {
            let mut w = [0u8; 8];
            w[..c.len()].copy_from_slice(c);
            u64::from_le_bytes(w)
        })));
        Ok(LossMask {
            backing,
            len,
            counted,
            hash,
            name: name.into(),
        })
    }

    /// Tokens covered (the token file's count).
    pub fn len(&self) -> usize {
        self.len
    }

    /// True for a mask of no tokens (never, for a mask that was opened).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Tokens whose loss counts.
    pub fn counted(&self) -> u64 {
        self.counted
    }

    /// A hash of the whole mask, part of the dataset's fingerprint.
    pub fn hash(&self) -> u64 {
        self.hash
    }

    /// Where the mask came from.
    pub fn name(&self) -> &str {
        &self.name
    }

    fn bits(&self) -> &[u8] {
        self.backing
            .bytes()
            .get(LOSS_MASK_HEADER_BYTES..)
            .unwrap_or(&[])
    }

    /// Whether token `i` counts; `None` past the end.
    pub fn get(&self, i: usize) -> Option<bool> {
        (i < self.len).then(|| self.bits()[i / 8] >> (i % 8) & 1 == 1)
    }

    /// Tokens `start .. start + out.len()`'s flags into `out`; `None` (nothing written) when
    /// the range passes the end.
    pub fn copy_to(&self, start: usize, out: &mut [bool]) -> Option<()> {
        let end = start.checked_add(out.len())?;
        if end > self.len {
            return None;
        }
        let bits = self.bits();
        for (k, o) in out.iter_mut().enumerate() {
            let i = start + k;
            *o = bits[i / 8] >> (i % 8) & 1 == 1;
        }
        Some(())
    }

    /// The counted tokens among `start .. start + len`; `None` past the end.
    pub fn counted_in(&self, start: usize, len: usize) -> Option<u64> {
        let end = start.checked_add(len)?;
        if end > self.len {
            return None;
        }
        Some(
            (start..end)
                .map(|i| u64::from(self.bits()[i / 8] >> (i % 8) & 1))
                .sum(),
        )
    }
}

/// Streams a mask to `path` as flags arrive; [`LossMaskWriter::finish`] syncs it and renames it
/// into place (a reader never sees a partial mask, and a failed write leaves the old one).
#[derive(Debug)]
pub struct LossMaskWriter {
    target: PathBuf,
    temp: PathBuf,
    file: Option<BufWriter<File>>,
    len: u64,
    counted: u64,
    partial: u8,
}

impl LossMaskWriter {
    /// Start writing the mask file `path`.
    pub fn create(path: impl AsRef<Path>) -> Result<Self> {
        let target = path.as_ref().to_path_buf();
        remove_abandoned_temps(&target);
        let temp = temp_path_for(&target);
        let file = File::create(&temp).map_err(|e| DataError::io(&target, e))?;
        let mut w = LossMaskWriter {
            target,
            temp,
            file: Some(BufWriter::with_capacity(1 << 20, file)),
            len: 0,
            counted: 0,
            partial: 0,
        };
        // Placeholder header; `finish` writes the real one.
        w.put(&[0u8; LOSS_MASK_HEADER_BYTES])?;
        Ok(w)
    }

    fn put(&mut self, bytes: &[u8]) -> Result<()> {
        let r = match self.file.as_mut() {
            Some(f) => f.write_all(bytes),
            None => {
                return Err(DataError::InvalidConfig(
                    "mask writer already finished".into(),
                ))
            }
        };
        r.map_err(|e| {
            self.abandon();
            DataError::io(&self.target, e)
        })
    }

    fn abandon(&mut self) {
        self.file = None;
        let _ = fs::remove_file(&self.temp);
    }

    /// Append `flags` (`true`: the token's loss counts).
    pub fn write(&mut self, flags: &[bool]) -> Result<()> {
        for &f in flags {
            let bit = (self.len % 8) as u8;
            self.partial |= u8::from(f) << bit;
            self.counted += u64::from(f);
            self.len += 1;
            if bit == 7 {
                let b = std::mem::take(&mut self.partial);
                self.put(&[b])?;
            }
        }
        Ok(())
    }

    /// Flags written so far.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// True before the first flag.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Complete the file: header, sync, rename into place. Returns (tokens, counted).
    pub fn finish(mut self) -> Result<(u64, u64)> {
        if self.len == 0 {
            self.abandon();
            return Err(DataError::Empty {
                what: self.target.display().to_string(),
            });
        }
        if !self.len.is_multiple_of(8) {
            let b = self.partial;
            self.put(&[b])?;
        }
        let result = self.complete();
        if result.is_err() {
            self.abandon();
        }
        result.map(|()| (self.len, self.counted))
    }

    fn complete(&mut self) -> Result<()> {
        use std::io::{Seek, SeekFrom};
        let io = |e| DataError::io(&self.target, e);
        let Some(writer) = self.file.take() else {
            return Err(DataError::InvalidConfig(
                "mask writer already finished".into(),
            ));
        };
        let mut file = writer.into_inner().map_err(|e| io(e.into_error()))?;
        let mut header = [0u8; LOSS_MASK_HEADER_BYTES];
        header[..8].copy_from_slice(&LOSS_MASK_MAGIC);
        header[8..16].copy_from_slice(&self.len.to_le_bytes());
        header[16..].copy_from_slice(&self.counted.to_le_bytes());
        file.seek(SeekFrom::Start(0)).map_err(io)?;
        file.write_all(&header).map_err(io)?;
        file.sync_all().map_err(io)?;
        drop(file);
        fs::rename(&self.temp, &self.target).map_err(io)?;
        sync_parent_dir(&self.target);
        Ok(())
    }
}

impl Drop for LossMaskWriter {
    fn drop(&mut self) {
        if self.file.is_some() {
            self.abandon();
        }
    }
}

/// Write `flags` as the mask file `path`, atomically (see [`LossMaskWriter`]).
pub fn write_loss_mask(path: impl AsRef<Path>, flags: &[bool]) -> Result<()> {
    let mut w = LossMaskWriter::create(path)?;
    w.write(flags)?;
    w.finish().map(drop)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// The file round-trips, `copy_to` and `counted_in` agree with the flags, and the
        /// in-memory encoding is the streamed file's bytes.
        #[test]
        fn masks_round_trip(flags in proptest::collection::vec(any::<bool>(), 1..200),
                            start in 0usize..200, len in 0usize..50) {
            let dir = tempfile::tempdir().unwrap();
            let path = dir.path().join("m.lossmask");
            write_loss_mask(&path, &flags).unwrap();
            prop_assert_eq!(fs::read(&path).unwrap(), encode(&flags).unwrap());
            let m = LossMask::open(&path).unwrap();
            prop_assert_eq!(m.len(), flags.len());
            prop_assert_eq!(m.counted(), flags.iter().filter(|&&f| f).count() as u64);
            let mut out = vec![false; len];
            match flags.get(start..start + len) {
                Some(want) => {
                    prop_assert_eq!(m.copy_to(start, &mut out), Some(()));
                    prop_assert_eq!(&out[..], want);
                    prop_assert_eq!(m.counted_in(start, len),
                                    Some(want.iter().filter(|&&f| f).count() as u64));
                }
                None => {
                    prop_assert_eq!(m.copy_to(start, &mut out), None);
                    prop_assert_eq!(m.counted_in(start, len), None);
                }
            }
            prop_assert_eq!(m.hash(), LossMask::from_flags(&flags).unwrap().hash());
        }
    }

    #[test]
    fn damaged_masks_are_refused() {
        let good = encode(&[true, false, true, true, false, false, true, true, true]).unwrap();
        let parse = |b: Vec<u8>| LossMask::parse(Arc::new(Backing::Owned(b)), "m");
        assert!(parse(good.clone()).is_ok());
        assert!(matches!(
            parse(good[..good.len() - 1].to_vec()),
            Err(DataError::Truncated { .. })
        ));
        let mut longer = good.clone();
        longer.push(0);
        assert!(matches!(parse(longer), Err(DataError::Corrupt { .. })));
        let mut magic = good.clone();
        magic[0] = b'X';
        assert!(matches!(parse(magic), Err(DataError::BadMagic { .. })));
        let mut count = good.clone();
        count[16] ^= 1;
        assert!(matches!(parse(count), Err(DataError::Corrupt { .. })));
        let mut pad = good.clone();
        *pad.last_mut().unwrap() |= 0x80;
        assert!(matches!(parse(pad), Err(DataError::Corrupt { .. })));
        let mut huge = good.clone();
        huge[8..16].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(parse(huge).is_err());
        let mut flipped = good;
        flipped[LOSS_MASK_HEADER_BYTES] ^= 2;
        assert!(matches!(parse(flipped), Err(DataError::Corrupt { .. })));
        assert!(parse(Vec::new()).is_err());
    }
}
