//! Megatron-LM indexed datasets (`MMapIndexedDataset`): an `.idx` index beside a `.bin` of
//! tokens.
//!
//! `.idx` layout, all little-endian, as written by `megatron/core/datasets/indexed_dataset.py`:
//!
//! | bytes | field |
//! |---|---|
//! | 9 | magic `MMIDIDX\x00\x00` |
//! | 8 | version `u64` = 1 |
//! | 1 | dtype code `u8` (1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64, 7 float32, 8 uint16) |
//! | 8 | sequence count S `u64` |
//! | 8 | document count D `u64` (entries in the document index, including its leading 0) |
//! | 4·S | sequence lengths, `i32` tokens |
//! | 8·S | sequence pointers, `i64` byte offsets into `.bin` |
//! | 8·D | document index, `i64`: document d is sequences `[idx[d], idx[d+1])` |
//! | S (optional) | sequence modes, `i8` (multimodal datasets; ignored here) |
//!
//! The pointer array starts at byte 34 + 4·S, which is generally not 8-aligned, so every field
//! is decoded from bytes rather than reinterpreted in place.

use std::path::{Path, PathBuf};

use crate::dataset::{map_file, try_with_capacity, Document, Segment, SequenceIndex, TokenDataset};
use crate::formats::writer::TokenWriter;
use crate::formats::TokenFileFormat;
use crate::tokens::TokenType;
use crate::{DataError, Result};

/// The `.idx` magic bytes.
pub const MEGATRON_MAGIC: &[u8; 9] = b"MMIDIDX\x00\x00";
/// The only `.idx` version Megatron-LM writes.
pub const MEGATRON_VERSION: u64 = 1;
pub(crate) const FIXED_HEADER: usize = 9 + 8 + 1 + 8 + 8;

/// Megatron's dtype code for a token type.
pub fn megatron_dtype_code(token_type: TokenType) -> Option<u8> {
    match token_type {
        TokenType::U8 => Some(1),
        TokenType::I32 => Some(4),
        TokenType::I64 => Some(5),
        TokenType::U16 => Some(8),
        TokenType::U32 => None,
    }
}

fn token_type_from_code(code: u8) -> Option<TokenType> {
    match code {
        1 => Some(TokenType::U8),
        4 => Some(TokenType::I32),
        5 => Some(TokenType::I64),
        8 => Some(TokenType::U16),
        _ => None,
    }
}

/// A parsed, fully validated `.idx`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MegatronIndex {
    /// Storage type of the `.bin` tokens.
    pub token_type: TokenType,
    /// Tokens per sequence.
    pub sequence_lengths: Vec<u32>,
    /// Byte offset of each sequence in `.bin`.
    pub sequence_pointers: Vec<u64>,
    /// Document boundaries in sequences, starting with 0 and ending with the sequence count.
    pub document_indices: Vec<u64>,
}

struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl Reader<'_> {
    fn take<const N: usize>(&mut self) -> [u8; N] {
        // Callers check the total length first; a short read yields zeros, never a panic.
        let mut out = [0u8; N];
        if let Some(b) = self.bytes.get(self.at..self.at + N) {
            out.copy_from_slice(b);
        }
        self.at += N;
        out
    }
    fn u64(&mut self) -> u64 {
        u64::from_le_bytes(self.take())
    }
    fn i64(&mut self) -> i64 {
        i64::from_le_bytes(self.take())
    }
    fn i32(&mut self) -> i32 {
        i32::from_le_bytes(self.take())
    }
}

impl MegatronIndex {
    /// Parse `idx` and check it against a `.bin` of `bin_len` bytes: magic, version, dtype,
    /// array lengths, non-negative sizes, pointers that are aligned, contiguous and inside
    /// `.bin` (which they must exactly fill), and a monotone document index from 0 to S.
    pub fn parse(idx: &[u8], bin_len: u64, what: &str) -> Result<Self> {
        if idx.is_empty() {
            return Err(DataError::Empty { what: what.into() });
        }
        let magic_len = idx.len().min(MEGATRON_MAGIC.len());
        if idx.get(..magic_len) != MEGATRON_MAGIC.get(..magic_len) {
            return Err(DataError::BadMagic {
                what: what.into(),
                found: format!(
                    "{:?}",
                    String::from_utf8_lossy(idx.get(..magic_len).unwrap_or(&[]))
                ),
                expected: "MMIDIDX\\0\\0".into(),
            });
        }
        if idx.len() < FIXED_HEADER {
            return Err(DataError::truncated(
                what,
                FIXED_HEADER as u64,
                idx.len() as u64,
            ));
        }
        let mut r = Reader { bytes: idx, at: 9 };
        let version = r.u64();
        if version != MEGATRON_VERSION {
            return Err(DataError::UnsupportedVersion {
                what: what.into(),
                found: version,
            });
        }
        let [code] = r.take::<1>();
        let token_type = token_type_from_code(code).ok_or(DataError::UnsupportedDtype {
            what: what.into(),
            code: u64::from(code),
        })?;
        let sequences = r.u64();
        let doc_entries = r.u64();
        let needed = sequences
            .checked_mul(12)
            .and_then(|s| doc_entries.checked_mul(8).and_then(|d| s.checked_add(d)))
            .and_then(|n| n.checked_add(FIXED_HEADER as u64));
        let have = idx.len() as u64;
        let needed = match needed {
            Some(n) if n <= have => n,
            Some(n) => return Err(DataError::truncated(what, n, have)),
            None => return Err(DataError::truncated(what, u64::MAX, have)),
        };
        // Multimodal datasets append one i8 mode per sequence; anything else is garbage.
        if have != needed && have != needed + sequences {
            return Err(DataError::corrupt(
                what,
                format!(
                    "{} unexpected bytes after the document index",
                    have - needed
                ),
            ));
        }
        if sequences == 0 {
            return Err(DataError::Empty { what: what.into() });
        }
        if doc_entries == 0 {
            return Err(DataError::corrupt(
                what,
                "document index has no entries (needs at least [0])",
            ));
        }
        // Lengths are now bounded by the file size, so these allocations are too; they are
        // still fallible, since a large index may not fit in memory.
        let s = usize::try_from(sequences).map_err(|_| DataError::truncated(what, needed, have))?;
        let mut sequence_lengths = try_with_capacity(s)?;
        for i in 0..s {
            let n = r.i32();
            if n < 0 {
                return Err(DataError::corrupt(
                    what,
                    format!("sequence {i} has negative length {n}"),
                ));
            }
            sequence_lengths.push(n as u32);
        }
        let width = token_type.width() as u64;
        let mut sequence_pointers = try_with_capacity(s)?;
        let mut expected_next = 0u64;
        for (i, &len) in sequence_lengths.iter().enumerate() {
            let p = r.i64();
            let start = u64::try_from(p).map_err(|_| {
                DataError::corrupt(what, format!("sequence {i} has negative pointer {p}"))
            })?;
            let end = start.saturating_add(u64::from(len) * width);
            if end > bin_len {
                return Err(DataError::PointerOutOfBounds {
                    what: what.into(),
                    sequence: i as u64,
                    start,
                    end,
                    bin_len,
                });
            }
            // Megatron writes sequences back to back; requiring that keeps windows within real
            // token data (a gap would be bytes no index entry vouches for).
            if start != expected_next {
                return Err(DataError::corrupt(
                    what,
                    format!("sequence {i} starts at byte {start}, expected {expected_next} (sequences must be contiguous)"),
                ));
            }
            expected_next = end;
            sequence_pointers.push(start);
        }
        if expected_next != bin_len {
            return Err(DataError::corrupt(
                what,
                format!("sequences cover {expected_next} bytes but the .bin has {bin_len}"),
            ));
        }
        let mut document_indices = try_with_capacity(
            usize::try_from(doc_entries).map_err(|_| DataError::truncated(what, needed, have))?,
        )?;
        let mut previous = 0u64;
        for d in 0..doc_entries {
            let v = r.i64();
            let v = u64::try_from(v)
                .ok()
                .filter(|&v| v >= previous && v <= sequences && (d > 0 || v == 0))
                .ok_or_else(|| {
                    DataError::corrupt(
                        what,
                        format!("document index entry {d} = {v} is not monotone within 0..={sequences} starting at 0"),
                    )
                })?;
            previous = v;
            document_indices.push(v);
        }
        if previous != sequences {
            return Err(DataError::corrupt(
                what,
                format!("document index ends at {previous}, expected {sequences}"),
            ));
        }
        Ok(MegatronIndex {
            token_type,
            sequence_lengths,
            sequence_pointers,
            document_indices,
        })
    }

    /// Total tokens over all sequences.
    pub fn total_tokens(&self) -> u64 {
        self.sequence_lengths.iter().map(|&n| u64::from(n)).sum()
    }

    /// Documents as token spans of segment 0. O(S + D): the total is computed once (it used
    /// to be recomputed for every document ending at the last sequence, which made an index
    /// with many trailing empty documents take O(S·D) time to open).
    pub fn documents(&self) -> Vec<Document> {
        let mut out = Vec::new();
        self.extend_documents(&mut out);
        out
    }

    /// [`documents`](Self::documents), allocated fallibly ([`DataError::Allocation`]).
    fn try_documents(&self) -> Result<Vec<Document>> {
        let mut out = try_with_capacity(self.document_indices.len().saturating_sub(1))?;
        self.extend_documents(&mut out);
        Ok(out)
    }

    fn extend_documents(&self, out: &mut Vec<Document>) {
        let w = self.token_type.width() as u64;
        let total = self.total_tokens();
        let starts_at = |seq: u64| -> u64 {
            usize::try_from(seq)
                .ok()
                .and_then(|i| self.sequence_pointers.get(i))
                .map_or(total, |&p| p / w)
        };
        out.extend(self.document_indices.windows(2).map(|pair| {
            let start = starts_at(pair[0]);
            Document {
                segment: 0,
                start,
                // A validated index is monotone; saturating keeps a hand-built one from
                // panicking.
                len: starts_at(pair[1]).saturating_sub(start),
            }
        }));
    }
}

/// `.idx` and `.bin` paths for a prefix given with or without either extension.
pub fn megatron_paths(path: &Path) -> (PathBuf, PathBuf) {
    let prefix = match path.extension().and_then(|e| e.to_str()) {
        Some("idx" | "bin") => path.with_extension(""),
        _ => path.to_path_buf(),
    };
    let mut idx = prefix.clone().into_os_string();
    idx.push(".idx");
    let mut bin = prefix.into_os_string();
    bin.push(".bin");
    (PathBuf::from(idx), PathBuf::from(bin))
}

/// Open a Megatron indexed dataset from its prefix (`data/corpus_text_document`), or from the
/// path of its `.idx` or `.bin`. The dataset has one segment, a document index
/// ([`TokenDataset::documents`]) and the sequence table ([`TokenDataset::sequence_index`],
/// read in place: the `.idx` stays mapped while the dataset is open).
pub fn open_megatron(path: impl AsRef<Path>) -> Result<TokenDataset> {
    let (idx_path, bin_path) = megatron_paths(path.as_ref());
    let what = idx_path.display().to_string();
    let idx = map_file(&idx_path)?;
    let bin = map_file(&bin_path)?;
    let index = MegatronIndex::parse(idx.bytes(), bin.bytes().len() as u64, &what)?;
    let total = usize::try_from(index.total_tokens())
        .map_err(|_| DataError::corrupt(&what, "more tokens than this platform can address"))?;
    let sequences = SequenceIndex::new(
        idx,
        FIXED_HEADER,
        index.sequence_lengths.len(),
        index.document_indices.len(),
        index.token_type.width(),
    )
    .ok_or_else(|| DataError::corrupt(&what, "sequence table outside the index file"))?;
    let segment = Segment::new(
        bin,
        0,
        total,
        index.token_type,
        &bin_path.display().to_string(),
    )?
    .with_sequences(sequences);
    TokenDataset::from_segments(vec![segment], Some(index.try_documents()?))
}

/// Write `documents` (one sequence each) as `prefix.idx` + `prefix.bin`, atomically (see
/// [`TokenWriter`]). Empty documents are kept as zero-length sequences.
pub fn write_megatron(
    prefix: impl AsRef<Path>,
    documents: &[Vec<u32>],
    token_type: TokenType,
) -> Result<()> {
    let format = TokenFileFormat::Megatron {
        token_type,
        document_len: usize::MAX,
    };
    let mut writer = TokenWriter::create(prefix, format)?;
    for d in documents {
        writer.write(d)?;
        writer.close_document(true)?;
    }
    writer.finish().map(drop)
}
