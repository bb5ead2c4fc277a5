//! [`TokenDataset`]: token segments viewed in place (memory maps or owned buffers), with an
//! optional document index.

use std::fs::File;
use std::path::Path;
use std::sync::Arc;

use memmap2::Mmap;

use crate::rng::derive_seed;
use crate::tokens::{encode_tokens, TokenSlice, TokenType};
use crate::{DataError, Result};

/// Where a segment's bytes live.
pub(crate) enum Backing {
    /// A read-only memory map: costs page cache, not heap.
    Mapped(Mmap),
    /// Bytes in memory (synthetic data, tests).
    Owned(Vec<u8>),
}

impl Backing {
    pub(crate) fn bytes(&self) -> &[u8] {
        match self {
            Backing::Mapped(m) => m,
            Backing::Owned(v) => v,
        }
    }
}

/// Map `path` read-only. Empty files are an error (a zero-length map is not portable and an
/// empty token file is never what a user meant).
pub(crate) fn map_file(path: &Path) -> Result<Arc<Backing>> {
    let file = File::open(path).map_err(|e| DataError::io(path, e))?;
    let len = file.metadata().map_err(|e| DataError::io(path, e))?.len();
    if len == 0 {
        return Err(DataError::Empty {
            what: path.display().to_string(),
        });
    }
    // SAFETY: the map is read-only and we never create a mutable view. Another process
    // truncating or rewriting the file while it is mapped is undefined behaviour for any
    // memory-mapped reader (numpy.memmap included); the crate documents that dataset files must
    // not be modified while open.
    let map = unsafe { Mmap::map(&file) }.map_err(|e| DataError::io(path, e))?;
    Ok(Arc::new(Backing::Mapped(map)))
}

/// A contiguous run of tokens: one raw file, one llm.c shard, or the token area of a Megatron
/// `.bin`. Windows never cross segment boundaries.
#[derive(Clone)]
pub struct Segment {
    backing: Arc<Backing>,
    byte_offset: usize,
    len: usize,
    token_type: TokenType,
    name: Arc<str>,
}

impl std::fmt::Debug for Segment {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Segment")
            .field("name", &self.name)
            .field("len", &self.len)
            .field("token_type", &self.token_type)
            .finish()
    }
}

impl Segment {
    /// A segment of `len` tokens at `byte_offset` in `backing`; checked to lie inside it.
    pub(crate) fn new(
        backing: Arc<Backing>,
        byte_offset: usize,
        len: usize,
        token_type: TokenType,
        name: &str,
    ) -> Result<Self> {
        let end = len
            .checked_mul(token_type.width())
            .and_then(|b| b.checked_add(byte_offset));
        match end {
            Some(end) if end <= backing.bytes().len() => Ok(Segment {
                backing,
                byte_offset,
                len,
                token_type,
                name: name.into(),
            }),
            _ => Err(DataError::truncated(
                name,
                end.map_or(u64::MAX, |e| e as u64),
                backing.bytes().len() as u64,
            )),
        }
    }

    /// The tokens, in place.
    pub fn tokens(&self) -> TokenSlice<'_> {
        let w = self.token_type.width();
        let bytes = self
            .backing
            .bytes()
            .get(self.byte_offset..self.byte_offset + self.len * w)
            .unwrap_or(&[]);
        TokenSlice::truncating(bytes, self.token_type)
    }

    /// Number of tokens.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when the segment holds no tokens (never, for segments a dataset accepted).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Storage type of the tokens.
    pub fn token_type(&self) -> TokenType {
        self.token_type
    }

    /// Where the segment came from (file name, or a description for in-memory data).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// True when the tokens are read through a memory map.
    pub fn is_mapped(&self) -> bool {
        matches!(*self.backing, Backing::Mapped(_))
    }
}

/// A document: `len` tokens starting at token `start` of segment `segment`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Document {
    /// Index into [`TokenDataset::segments`].
    pub segment: usize,
    /// First token, relative to the segment.
    pub start: u64,
    /// Number of tokens.
    pub len: u64,
}

/// Token data ready to be sampled: one or more segments, the vocabulary bound every token must
/// respect, and (for Megatron indexed data) a document index.
#[derive(Clone, Debug)]
pub struct TokenDataset {
    segments: Vec<Segment>,
    documents: Option<Vec<Document>>,
    vocab_size: u64,
}

impl TokenDataset {
    /// A dataset over `segments` (at least one token in total). The vocabulary bound starts at
    /// 2^32 (any id a `u32` can hold); narrow it with [`TokenDataset::with_vocab_size`].
    pub(crate) fn from_segments(
        segments: Vec<Segment>,
        documents: Option<Vec<Document>>,
    ) -> Result<Self> {
        // Empty segments are kept (document indices refer to segment positions); samplers
        // simply find no window in them.
        if segments.iter().all(|s| s.len == 0) {
            return Err(DataError::Empty {
                what: "dataset".into(),
            });
        }
        Ok(TokenDataset {
            segments,
            documents,
            vocab_size: 1 << 32,
        })
    }

    /// An in-memory dataset of one segment holding `tokens` stored as `token_type`.
    pub fn from_tokens(tokens: &[u32], token_type: TokenType) -> Result<Self> {
        if tokens.is_empty() {
            return Err(DataError::Empty {
                what: "token list".into(),
            });
        }
        let bytes = encode_tokens(tokens, token_type)?;
        let seg = Segment::new(
            Arc::new(Backing::Owned(bytes)),
            0,
            tokens.len(),
            token_type,
            "<memory>",
        )?;
        Self::from_segments(vec![seg], None)
    }

    /// An in-memory dataset with one segment per document and a document index over them.
    pub fn from_documents(documents: &[Vec<u32>], token_type: TokenType) -> Result<Self> {
        let all: Vec<u32> = documents.iter().flatten().copied().collect();
        let mut ds = Self::from_tokens(&all, token_type)?;
        let mut start = 0u64;
        let docs = documents
            .iter()
            .map(|d| {
                let doc = Document {
                    segment: 0,
                    start,
                    len: d.len() as u64,
                };
                start += d.len() as u64;
                doc
            })
            .collect();
        ds.documents = Some(docs);
        Ok(ds)
    }

    /// Set the vocabulary size: every token handed out is checked to be `< vocab_size`
    /// (cheaply, during the batch copy). Use [`TokenDataset::validate_tokens`] to check the
    /// whole dataset up front.
    pub fn with_vocab_size(mut self, vocab_size: u32) -> Self {
        self.vocab_size = u64::from(vocab_size);
        self
    }

    /// The vocabulary bound tokens are checked against.
    pub fn vocab_size(&self) -> u64 {
        self.vocab_size
    }

    /// The segments, in dataset order.
    pub fn segments(&self) -> &[Segment] {
        &self.segments
    }

    /// The document index, if the format has one.
    pub fn documents(&self) -> Option<&[Document]> {
        self.documents.as_deref()
    }

    /// Total tokens over all segments.
    pub fn total_tokens(&self) -> u64 {
        self.segments.iter().map(|s| s.len as u64).sum()
    }

    /// Token `index` of segment `segment` as stored; `None` out of range.
    pub fn token(&self, segment: usize, index: u64) -> Option<i64> {
        self.segments
            .get(segment)?
            .tokens()
            .get(usize::try_from(index).ok()?)
    }

    /// Scan every token and fail on the first one outside `0..vocab_size`.
    pub fn validate_tokens(&self) -> Result<()> {
        for seg in &self.segments {
            if let Some((position, value)) = seg.tokens().find_out_of_range(self.vocab_size) {
                return Err(DataError::TokenOutOfRange {
                    what: seg.name().to_string(),
                    position: position as u64,
                    value: i128::from(value),
                    vocab_size: self.vocab_size,
                });
            }
        }
        Ok(())
    }

    /// A hash of the dataset's shape (segment lengths and types, documents, vocabulary), stored
    /// in a saved loader position so it cannot be resumed against different data.
    pub fn fingerprint(&self) -> u64 {
        let mut words = vec![self.vocab_size, self.segments.len() as u64];
        for s in &self.segments {
            words.push(s.len as u64);
            words.push(s.token_type.width() as u64);
        }
        if let Some(docs) = &self.documents {
            words.push(docs.len() as u64);
            for d in docs {
                words.extend([d.segment as u64, d.start, d.len]);
            }
        }
        derive_seed(&words)
    }
}
