//! [`TokenDataset`]: token segments viewed in place (memory maps or owned buffers), with an
//! optional document index.

use std::fs::File;
use std::path::Path;
use std::sync::Arc;

use memmap2::Mmap;
use serde::{Deserialize, Serialize};

use crate::rng::derive_seed_iter;
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

/// An empty vector with room for `n` elements, or [`DataError::Allocation`] (never an abort)
/// when the memory cannot be had: for buffers whose size comes from the data.
pub(crate) fn try_with_capacity<T>(n: usize) -> Result<Vec<T>> {
    let mut v = Vec::new();
    try_reserve(&mut v, n)?;
    Ok(v)
}

/// Room for `n` more elements in `v`, or [`DataError::Allocation`] (never an abort).
pub(crate) fn try_reserve<T>(v: &mut Vec<T>, n: usize) -> Result<()> {
    v.try_reserve_exact(n).map_err(|_| {
        DataError::Allocation(headroom_tensor::Error::OutOfMemory {
            device: headroom_tensor::Device::Cpu,
            bytes: n.saturating_mul(std::mem::size_of::<T>()),
        })
    })
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

fn le_word<const N: usize>(bytes: &[u8], at: usize) -> Option<[u8; N]> {
    bytes.get(at..at.checked_add(N)?)?.try_into().ok()
}

/// The sequence table of a Megatron `.idx` (per-sequence lengths and starts) and its document
/// index, read in place from the mapped index file: no heap copy, however many sequences.
///
/// A sequence is a run of tokens Megatron-LM's preprocessing wrote as one unit (a sentence
/// with `--split-sentences`, usually a whole document); a document is a run of consecutive
/// sequences. Offsets are token positions inside the dataset segment the index belongs to.
/// The index was validated when the dataset was opened (lengths non-negative, sequences
/// contiguous from token 0 and covering the segment exactly, document index monotone from 0 to
/// the sequence count), so the boundaries are sorted.
///
/// ```
/// use headroom_mmap_data::formats::megatron::{open_megatron, write_megatron};
/// use headroom_mmap_data::TokenType;
///
/// # fn main() -> headroom_mmap_data::Result<()> {
/// let dir = tempfile::tempdir().unwrap();
/// let prefix = dir.path().join("corpus");
/// write_megatron(&prefix, &[vec![5, 6, 7], vec![], vec![8, 9]], TokenType::U16)?;
/// let data = open_megatron(&prefix)?;
/// let sequences = data.sequence_index(0).unwrap();
/// assert_eq!(sequences.boundaries().collect::<Vec<_>>(), [0, 3, 3, 5]);
/// assert_eq!(sequences.span(2), Some(3..5));
/// assert_eq!(sequences.sequence_at(4), Some(2)); // token 4 lies in sequence 2
/// assert_eq!(sequences.document_sequences(1), Some(1..2));
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
pub struct SequenceIndex {
    idx: Arc<Backing>,
    sequences: usize,
    lengths_at: usize,
    pointers_at: usize,
    documents_at: usize,
    document_entries: usize,
    width: u64,
}

impl std::fmt::Debug for SequenceIndex {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SequenceIndex")
            .field("sequences", &self.sequences)
            .field("documents", &self.document_count())
            .finish()
    }
}

impl SequenceIndex {
    /// The table of a `.idx` already validated by `MegatronIndex::parse` (`sequences` entries,
    /// `document_entries` document-index entries, tokens `width` bytes wide).
    pub(crate) fn new(
        idx: Arc<Backing>,
        header: usize,
        sequences: usize,
        document_entries: usize,
        width: usize,
    ) -> Option<Self> {
        let pointers_at = sequences.checked_mul(4)?.checked_add(header)?;
        let documents_at = sequences.checked_mul(8)?.checked_add(pointers_at)?;
        let end = document_entries.checked_mul(8)?.checked_add(documents_at)?;
        (end <= idx.bytes().len() && width > 0).then_some(SequenceIndex {
            idx,
            sequences,
            lengths_at: header,
            pointers_at,
            documents_at,
            document_entries,
            width: width as u64,
        })
    }

    /// Number of sequences.
    pub fn len(&self) -> usize {
        self.sequences
    }

    /// True when the index has no sequence (never, for an index a dataset accepted).
    pub fn is_empty(&self) -> bool {
        self.sequences == 0
    }

    /// Tokens in sequence `i`; `None` past the end.
    pub fn length(&self, i: usize) -> Option<u64> {
        if i >= self.sequences {
            return None;
        }
        let at = self.lengths_at.checked_add(i.checked_mul(4)?)?;
        let n = i32::from_le_bytes(le_word(self.idx.bytes(), at)?);
        u64::try_from(n).ok()
    }

    /// First token of sequence `i` in the segment; `None` past the end.
    pub fn start(&self, i: usize) -> Option<u64> {
        if i >= self.sequences {
            return None;
        }
        let at = self.pointers_at.checked_add(i.checked_mul(8)?)?;
        let byte = i64::from_le_bytes(le_word(self.idx.bytes(), at)?);
        u64::try_from(byte).ok().map(|b| b / self.width)
    }

    /// The tokens of sequence `i` as a range of segment positions; `None` past the end.
    pub fn span(&self, i: usize) -> Option<std::ops::Range<u64>> {
        let start = self.start(i)?;
        Some(start..start.checked_add(self.length(i)?)?)
    }

    /// The `len() + 1` sequence boundaries: the start of every sequence, then the end of the
    /// last; sequence `i` is `b[i]..b[i + 1]` (an empty sequence repeats a boundary).
    pub fn boundaries(&self) -> impl Iterator<Item = u64> + '_ {
        let end = self
            .sequences
            .checked_sub(1)
            .and_then(|last| self.span(last))
            .map_or(0, |r| r.end);
        (0..self.sequences)
            .map(move |i| self.start(i).unwrap_or(end))
            .chain(std::iter::once(end))
    }

    /// The non-empty sequence that holds segment token `token`; `None` past the last one.
    /// A binary search over the mapped pointers.
    pub fn sequence_at(&self, token: u64) -> Option<usize> {
        // Sequences starting at or before `token`; of several starting at the same token
        // (empty ones first), the last is the only one that can hold it.
        let (mut lo, mut hi) = (0usize, self.sequences);
        while lo < hi {
            let mid = lo + (hi - lo) / 2;
            if self.start(mid)? <= token {
                lo = mid + 1;
            } else {
                hi = mid;
            }
        }
        let i = lo.checked_sub(1)?;
        self.span(i)?.contains(&token).then_some(i)
    }

    /// Number of documents in the index.
    pub fn document_count(&self) -> usize {
        self.document_entries.saturating_sub(1)
    }

    /// The sequences of document `d`, `None` past the end.
    pub fn document_sequences(&self, d: usize) -> Option<std::ops::Range<usize>> {
        if d >= self.document_count() {
            return None;
        }
        Some(self.document_entry(d)?..self.document_entry(d.checked_add(1)?)?)
    }

    fn document_entry(&self, k: usize) -> Option<usize> {
        let at = self.documents_at.checked_add(k.checked_mul(8)?)?;
        usize::try_from(i64::from_le_bytes(le_word(self.idx.bytes(), at)?)).ok()
    }

    /// First segment token of document `d` (the start of its first sequence; an empty
    /// document starts where the next one does); `None` past the end.
    pub fn document_start(&self, d: usize) -> Option<u64> {
        let first = self.document_sequences(d)?.start;
        if first < self.sequences {
            self.start(first)
        } else {
            // Past the last sequence: the end of the tokens.
            Some(
                self.sequences
                    .checked_sub(1)
                    .and_then(|l| self.span(l))
                    .map_or(0, |r| r.end),
            )
        }
    }

    /// The document whose tokens include segment token `token`: the last one starting at or
    /// before it (a binary search over the mapped document table); `None` before the first
    /// document.
    pub fn document_at(&self, token: u64) -> Option<usize> {
        let (mut lo, mut hi) = (0usize, self.document_count());
        while lo < hi {
            let mid = lo + (hi - lo) / 2;
            if self.document_start(mid)? <= token {
                lo = mid + 1;
            } else {
                hi = mid;
            }
        }
        lo.checked_sub(1)
    }

    /// Position ids of segment tokens `start .. start + out.len()`, as a packed batch gives
    /// them to a model (transformers' `position_ids`, Megatron's `--reset-position-ids`): 0
    /// at `start` and at the first token of every document, else the previous token's + 1.
    /// `None` when the index cannot say (a corrupt document table).
    pub fn document_positions(&self, start: u64, out: &mut [u32]) -> Option<()> {
        let mut next = self
            .document_at(start)
            .map_or(Some(0), |d| d.checked_add(1))?;
        let mut next_start = self.document_start(next);
        let mut position = 0u32;
        for (i, p) in out.iter_mut().enumerate() {
            let token = start.checked_add(i as u64)?;
            let mut begins = i == 0;
            // Several (empty) documents may start at the same token.
            while next_start.is_some_and(|s| s <= token) {
                begins |= next_start == Some(token);
                next = next.checked_add(1)?;
                next_start = self.document_start(next);
            }
            position = if begins { 0 } else { position.checked_add(1)? };
            *p = position;
        }
        Some(())
    }
}

/// Where the documents of packed data begin: what position ids restart at and what a document
/// mask keeps apart (see [`Segment::document_positions`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DocumentBoundaries {
    /// The documents of the data's Megatron index: every segment must have one.
    Index,
    /// Each document ends with this token, and the token after it begins the next: the
    /// end-of-text separator of nanoGPT, llm.c and `headroom data build` files (GPT-2's
    /// `<|endoftext|>`, 50256), as Megatron's `--reset-position-ids --reset-attention-mask
    /// --eod-mask-loss` read its EOD token. The separator stays with the document it ends, so
    /// a model learns to predict it.
    EndsWith(u32),
}

impl std::fmt::Display for DocumentBoundaries {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DocumentBoundaries::Index => f.write_str("the data's document index"),
            DocumentBoundaries::EndsWith(t) => write!(f, "documents ending with token {t}"),
        }
    }
}

/// Position ids of `ids` (as many as `out` holds) for documents that end with `separator`: 0 at
/// the first id and after every separator, else the previous position + 1 (at most
/// `out.len() − 1`, so it cannot wrap). The one statement of [`DocumentBoundaries::EndsWith`]:
/// a segment's tokens and the loader's decoded inputs both go through it.
pub(crate) fn positions_after_separator(
    ids: impl IntoIterator<Item = u64>,
    separator: u32,
    out: &mut [u32],
) {
    let separator = u64::from(separator);
    let mut begins = true;
    let mut position = 0u32;
    for (id, p) in ids.into_iter().zip(out) {
        position = if begins { 0 } else { position + 1 };
        *p = position;
        begins = id == separator;
    }
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
    sequences: Option<SequenceIndex>,
    loss_mask: Option<crate::LossMask>,
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
                sequences: None,
                loss_mask: None,
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

    /// The Megatron sequence table of this segment; `None` for segments without one (raw
    /// files, llm.c shards, in-memory tokens).
    pub fn sequence_index(&self) -> Option<&SequenceIndex> {
        self.sequences.as_ref()
    }

    /// Position ids of tokens `start .. start + out.len()` of this segment, as a packed batch
    /// gives them to a model (transformers' `position_ids`, Megatron's `--reset-position-ids`):
    /// 0 at `start` (a window's first token starts its first document, whatever came before
    /// it) and at the first token of every document, else the previous token's + 1. `None`
    /// when the tokens are not all there, or for [`DocumentBoundaries::Index`] when the
    /// segment has no index or a corrupt one.
    pub fn document_positions(
        &self,
        boundaries: DocumentBoundaries,
        start: u64,
        out: &mut [u32],
    ) -> Option<()> {
        match boundaries {
            DocumentBoundaries::Index => self.sequence_index()?.document_positions(start, out),
            DocumentBoundaries::EndsWith(separator) => {
                let first = usize::try_from(start).ok()?;
                let tokens = self.tokens().sub(first, out.len())?;
                // Within the slice just checked, so every read succeeds; u64::MAX is no id.
                let ids = (0..out.len()).map(|i| tokens.get(i).map_or(u64::MAX, |t| t as u64));
                positions_after_separator(ids, separator, out);
                Some(())
            }
        }
    }

    /// This segment with `sequences` as its sequence table.
    pub(crate) fn with_sequences(mut self, sequences: SequenceIndex) -> Self {
        self.sequences = Some(sequences);
        self
    }

    /// Which of this segment's tokens count as targets in the loss; `None`: all of them.
    pub fn loss_mask(&self) -> Option<&crate::LossMask> {
        self.loss_mask.as_ref()
    }

    /// This segment with `mask` as its loss mask, which must cover exactly its tokens.
    pub fn with_loss_mask(mut self, mask: crate::LossMask) -> Result<Self> {
        if mask.len() != self.len {
            return Err(DataError::InvalidConfig(format!(
                "{}: the loss mask covers {} tokens, the file holds {} (written for another \
                 version of the file?)",
                mask.name(),
                mask.len(),
                self.len
            )));
        }
        self.loss_mask = Some(mask);
        Ok(self)
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
    blend: Option<crate::blend::Blend>,
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
            blend: None,
        })
    }

    /// Several datasets drawn from in proportion to their weights (Megatron-LM's
    /// `--data-path 0.7 web 0.3 code`): `(name, weight, dataset)` per source, at least one. The
    /// segments are the sources' in order, and so are the documents when every source has a
    /// document index. The vocabulary bound is the smallest of the sources'. Samplers draw
    /// each source's share of the samples by [`crate::blend::BlendSchedule`], each source
    /// through its own sampler. A source may have a loss mask while another has none (its
    /// targets all count).
    ///
    /// ```
    /// use headroom_mmap_data::{TokenDataset, TokenType};
    ///
    /// # fn main() -> headroom_mmap_data::Result<()> {
    /// let web = TokenDataset::from_tokens(&[1; 1000], TokenType::U16)?;
    /// let code = TokenDataset::from_tokens(&[2; 100], TokenType::U16)?;
    /// let blend = TokenDataset::from_blend(vec![
    ///     ("web".into(), 0.7, web),
    ///     ("code".into(), 0.3, code),
    /// ])?;
    /// let sources = blend.blend().unwrap();
    /// assert_eq!(sources.period(), 10);
    /// assert_eq!(sources.shares(), [7, 3]);
    /// assert_eq!(blend.segments().len(), 2);
    /// # Ok(())
    /// # }
    /// ```
    pub fn from_blend(parts: Vec<(String, f64, TokenDataset)>) -> Result<Self> {
        let weights: Vec<f64> = parts.iter().map(|(_, w, _)| *w).collect();
        let mut names = Vec::with_capacity(parts.len());
        let mut ranges = Vec::with_capacity(parts.len());
        let mut datasets = Vec::with_capacity(parts.len());
        let mut end = 0;
        for (name, _, ds) in parts {
            ranges.push(end..end + ds.segments.len());
            end += ds.segments.len();
            names.push(name);
            datasets.push(ds);
        }
        // Before concatenating: a blend's weights are checked first, and a nested blend
        // refused by `concat`.
        let blend = crate::blend::Blend::new(names, &weights, ranges)?;
        let mut ds = Self::concat(datasets)?;
        ds.blend = Some(blend);
        Ok(ds)
    }

    /// Several datasets as one: their segments one after another (and their documents, when
    /// every part has a document index), sampled as one dataset, every window of every part
    /// once per epoch. The vocabulary bound is the smallest of the parts'; a part may have a
    /// loss mask while another has none (its targets all count). Blends cannot be parts.
    ///
    /// ```
    /// use headroom_mmap_data::{TokenDataset, TokenType};
    ///
    /// # fn main() -> headroom_mmap_data::Result<()> {
    /// let a = TokenDataset::from_tokens(&[1; 1000], TokenType::U16)?;
    /// let b = TokenDataset::from_tokens(&[2; 100], TokenType::U32)?;
    /// let both = TokenDataset::concat(vec![a, b])?;
    /// assert_eq!((both.segments().len(), both.total_tokens()), (2, 1100));
    /// assert!(both.blend().is_none());
    /// # Ok(())
    /// # }
    /// ```
    pub fn concat(parts: Vec<TokenDataset>) -> Result<Self> {
        if parts.iter().any(|ds| ds.blend.is_some()) {
            return Err(DataError::InvalidConfig(
                "a blend cannot be part of another dataset: list its sources in one blend".into(),
            ));
        }
        let mut segments = Vec::new();
        let mut documents = Some(Vec::new());
        let mut vocab_size = 1u64 << 32;
        for ds in parts {
            let base = segments.len();
            match (documents.as_mut(), ds.documents.as_ref()) {
                (Some(all), Some(docs)) => {
                    try_reserve(all, docs.len())?;
                    all.extend(docs.iter().map(|d| Document {
                        segment: d.segment + base,
                        ..*d
                    }));
                }
                _ => documents = None,
            }
            try_reserve(&mut segments, ds.segments.len())?;
            segments.extend(ds.segments);
            vocab_size = vocab_size.min(ds.vocab_size);
        }
        let mut ds = Self::from_segments(segments, documents)?;
        ds.vocab_size = vocab_size;
        Ok(ds)
    }

    /// The sources and shares of a blended dataset ([`TokenDataset::from_blend`]); `None` for one
    /// that is not a blend.
    pub fn blend(&self) -> Option<&crate::blend::Blend> {
        self.blend.as_ref()
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

    /// The document index, if the format has one: every document as a token span (for a
    /// Megatron dataset, the `.idx` document index resolved to tokens).
    pub fn documents(&self) -> Option<&[Document]> {
        self.documents.as_deref()
    }

    /// The Megatron sequence boundaries of segment `segment` (per-sequence lengths and starts,
    /// and the document index in sequences), read in place from its `.idx`; `None` for a
    /// segment that has none (raw files, llm.c shards, in-memory data) or does not exist. In a
    /// shard set every Megatron pair keeps its own table.
    pub fn sequence_index(&self, segment: usize) -> Option<&SequenceIndex> {
        self.segments.get(segment)?.sequence_index()
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

    /// True when some segment carries a loss mask (then every segment does, for datasets
    /// [`crate::open`] made).
    pub fn has_loss_mask(&self) -> bool {
        self.segments.iter().any(|s| s.loss_mask.is_some())
    }

    /// Tokens whose loss counts as targets over the whole dataset (every token without a
    /// mask).
    pub fn counted_tokens(&self) -> u64 {
        self.segments
            .iter()
            .map(|s| s.loss_mask.as_ref().map_or(s.len as u64, |m| m.counted()))
            .sum()
    }

    /// A hash of the dataset's shape (segment lengths and types, documents, vocabulary, a
    /// blend's shares) and of its loss masks, stored in a saved loader position so it cannot be resumed against
    /// different data (or the same tokens under another mask). Data without masks hashes
    /// the words it always did, so positions saved before masks existed still resume.
    ///
    /// Streamed: no allocation however many documents the index holds.
    pub fn fingerprint(&self) -> u64 {
        let head = [self.vocab_size, self.segments.len() as u64];
        let segments = self
            .segments
            .iter()
            .flat_map(|s| [s.len as u64, s.token_type.width() as u64]);
        let documents = self.documents.iter().flat_map(|docs| {
            std::iter::once(docs.len() as u64)
                .chain(docs.iter().flat_map(|d| [d.segment as u64, d.start, d.len]))
        });
        // "lossmask", then each segment's mask hash (0 for a segment without one).
        let masks = self.has_loss_mask().then(|| {
            std::iter::once(0x6c6f_7373_6d61_736b).chain(
                self.segments
                    .iter()
                    .map(|s| s.loss_mask.as_ref().map_or(0, |m| m.hash())),
            )
        });
        // A blend adds its shares; data that is not a blend hashes the words it always did.
        let blend = self.blend.iter().flat_map(|b| b.fingerprint_words());
        derive_seed_iter(
            head.into_iter()
                .chain(segments)
                .chain(documents)
                .chain(masks.into_iter().flatten())
                .chain(blend),
        )
    }

    /// This dataset with every segment passed through `f` (documents unchanged).
    pub(crate) fn map_segments(
        mut self,
        f: impl FnMut(Segment) -> Result<Segment>,
    ) -> Result<Self> {
        self.segments = std::mem::take(&mut self.segments)
            .into_iter()
            .map(f)
            .collect::<Result<_>>()?;
        Ok(self)
    }

    /// This dataset with `masks[i]` as segment `i`'s loss mask (each checked against its
    /// segment's length).
    pub fn with_loss_masks(self, masks: Vec<crate::LossMask>) -> Result<Self> {
        if masks.len() != self.segments.len() {
            return Err(DataError::InvalidConfig(format!(
                "{} loss masks for {} segments",
                masks.len(),
                self.segments.len()
            )));
        }
        let mut masks = masks.into_iter();
        self.map_segments(|s| match masks.next() {
            Some(m) => s.with_loss_mask(m),
            None => Ok(s),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::derive_seed;

    /// The streamed fingerprint hashes exactly the words the collected one did, so positions
    /// saved before it changed still resume.
    #[test]
    fn fingerprint_hashes_the_documented_words() {
        let ds = TokenDataset::from_documents(&[vec![1, 2, 3], vec![], vec![4]], TokenType::U16)
            .unwrap()
            .with_vocab_size(10);
        let words = [10, 1, 4, 2, 3, 0, 0, 3, 0, 3, 0, 0, 3, 1];
        assert_eq!(ds.fingerprint(), derive_seed(&words));
        let plain = TokenDataset::from_tokens(&[1, 2], TokenType::U32).unwrap();
        assert_eq!(plain.fingerprint(), derive_seed(&[1 << 32, 1, 2, 4]));
    }
}
