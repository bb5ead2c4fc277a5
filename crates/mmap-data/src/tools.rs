//! Dataset tools behind `headroom data synth|build|inspect`: write the synthetic source to a
//! token file ([`synthesize`]), tokenise a text file ([`build_from_text`]), and describe any
//! token file ([`inspect`]).
//!
//! Writers stream through [`TokenWriter`] (bounded memory, temp file + fsync + rename) and
//! readers go through the crate's memory-mapped datasets, so a tool's heap stays small
//! whatever the file size.
//!
//! ```
//! use headroom_mmap_data::tools::{inspect, synthesize, InspectOptions, SynthSpec};
//! use headroom_mmap_data::{TokenFileFormat, TokenType};
//!
//! # fn main() -> headroom_mmap_data::Result<()> {
//! let dir = tempfile::tempdir().unwrap();
//! let path = dir.path().join("train.bin");
//! let spec = SynthSpec {
//!     vocab: 512,
//!     branching: 4,
//!     tokens: 10_000,
//!     chain_seed: 1,
//!     stream_seed: 2,
//!     format: TokenFileFormat::Raw(TokenType::U16),
//! };
//! let written = synthesize(&spec, &path)?;
//! assert_eq!((written.tokens, written.file_bytes), (10_000, 20_000));
//! let floor = written.entropy_rate.unwrap(); // nats/token: the loss floor on this data
//! assert!(floor > 0.0 && floor < 4f64.ln());
//!
//! let described = inspect(&path, &InspectOptions::default())?;
//! assert_eq!(described.tokens, 10_000);
//! assert!(described.max_id < 512);
//! println!("{described}");
//! # Ok(())
//! # }
//! ```

use std::fmt;
use std::fs;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::dataset::{map_file, TokenDataset};
use crate::formats::llmc::{self, LlmcFlavor};
use crate::formats::megatron;
use crate::formats::raw;
use crate::formats::writer::{check_room, TokenWriter, WrittenFiles};
use crate::formats::{is_megatron_path, TokenFileFormat};
use crate::synthetic::MarkovChain;
use crate::text::{BYTE_EOT, BYTE_VOCAB, BYTE_VOCAB_WITH_EOT};
use crate::tokens::TokenType;
use crate::{DataError, Result};

/// Tokens generated, converted or scanned per step: bounds the tools' heap (256 KiB of `u32`)
/// while keeping per-call overhead negligible.
const CHUNK_TOKENS: usize = 1 << 16;

/// What [`synthesize`] writes: `tokens` tokens of a [`MarkovChain`] in `format`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SynthSpec {
    /// Vocabulary size (≥ 2); every id written is `< vocab`.
    pub vocab: u32,
    /// Successors per token (`2..=vocab`): fewer means a lower entropy rate.
    pub branching: u32,
    /// Tokens to write (≥ 1).
    pub tokens: u64,
    /// Seed of the chain's transition table ([`MarkovChain::random`]).
    pub chain_seed: u64,
    /// Seed of the token stream drawn from the chain ([`MarkovChain::stream`]).
    pub stream_seed: u64,
    /// File format, including the on-disk token type.
    pub format: TokenFileFormat,
}

/// How [`build_from_text`] tokenises and writes a text file.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct BuildSpec {
    /// File format, including the on-disk token type.
    pub format: TokenFileFormat,
    /// Bytes that separate documents in the input (for example `b"<|endoftext|>"`, as in
    /// TinyStories, or `b"\n\n"`). Each occurrence becomes one [`BYTE_EOT`] token and ends a
    /// Megatron document; the vocabulary is then [`BYTE_VOCAB_WITH_EOT`] (257, which does not
    /// fit `u8`). `None`: the file is one document of plain bytes, vocabulary 256.
    pub document_separator: Option<Vec<u8>>,
    /// Refuse input that is not valid UTF-8 ([`DataError::InvalidUtf8`]); `false` tokenises
    /// arbitrary bytes.
    pub require_utf8: bool,
}

impl BuildSpec {
    /// UTF-8 input, no document separator, written in `format`.
    pub fn new(format: TokenFileFormat) -> Self {
        BuildSpec {
            format,
            document_separator: None,
            require_utf8: true,
        }
    }

    /// The vocabulary of the tokens this spec produces: 256, or 257 with a separator.
    pub fn vocab_size(&self) -> u32 {
        if self.document_separator.is_some() {
            BYTE_VOCAB_WITH_EOT
        } else {
            BYTE_VOCAB
        }
    }
}

/// What a tool wrote.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct DatasetSummary {
    /// Each file written with its size in bytes (Megatron: the `.bin`, then the `.idx`).
    pub files: Vec<(PathBuf, u64)>,
    /// The format written.
    pub format: TokenFileFormat,
    /// The on-disk token type.
    pub token_type: TokenType,
    /// Tokens written.
    pub tokens: u64,
    /// Documents in the file's index (Megatron); `None` for formats without one.
    pub documents: Option<u64>,
    /// Bytes over all files written.
    pub file_bytes: u64,
    /// Every id written is `< vocab_size`.
    pub vocab_size: u32,
    /// The source's entropy rate in nats per token — the expected loss floor of a model
    /// trained on this data. Known for synthetic data only.
    pub entropy_rate: Option<f64>,
}

impl DatasetSummary {
    fn new(
        written: WrittenFiles,
        format: TokenFileFormat,
        vocab_size: u32,
        entropy_rate: Option<f64>,
    ) -> Self {
        DatasetSummary {
            file_bytes: written.total_bytes(),
            files: written.files,
            format,
            token_type: format.token_type(),
            tokens: written.tokens,
            documents: written.documents,
            vocab_size,
            entropy_rate,
        }
    }

    /// The entropy rate in bits per token.
    pub fn entropy_rate_bits(&self) -> Option<f64> {
        self.entropy_rate.map(|h| h / std::f64::consts::LN_2)
    }
}

impl fmt::Display for DatasetSummary {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (path, bytes) in &self.files {
            writeln!(f, "{:<13}{} ({} bytes)", "wrote", path.display(), bytes)?;
        }
        writeln!(f, "{:<13}{}", "format", self.format)?;
        writeln!(f, "{:<13}{}", "tokens", self.tokens)?;
        if let Some(d) = self.documents {
            writeln!(f, "{:<13}{d}", "documents")?;
        }
        writeln!(f, "{:<13}{} ids", "vocabulary", self.vocab_size)?;
        write!(f, "{:<13}{} bytes", "total size", self.file_bytes)?;
        if let (Some(nats), Some(bits)) = (self.entropy_rate, self.entropy_rate_bits()) {
            write!(
                f,
                "\n{:<13}{nats:.6} nats/token ({bits:.4} bits): the loss floor",
                "entropy rate"
            )?;
        }
        Ok(())
    }
}

/// Refuse a vocabulary whose largest id does not fit `token_type`
/// ([`DataError::VocabTooLarge`]).
pub fn check_vocab_fits(vocab: u64, token_type: TokenType) -> Result<()> {
    if vocab.saturating_sub(1) > token_type.max_token() {
        return Err(DataError::VocabTooLarge {
            vocab,
            width: token_type.name(),
            max_id: token_type.max_token(),
        });
    }
    Ok(())
}

/// The bytes `tokens` tokens take in `format`, without the headers and indices: what
/// [`check_room`] is asked for.
fn token_bytes(tokens: u64, format: TokenFileFormat) -> u64 {
    tokens.saturating_mul(format.token_type().width() as u64)
}

/// Refuse more tokens than `format` can record (an llm.c header counts in `i32`).
fn check_token_capacity(tokens: u64, format: TokenFileFormat) -> Result<()> {
    if matches!(format, TokenFileFormat::Llmc(_)) && tokens > i32::MAX as u64 {
        return Err(DataError::InvalidConfig(format!(
            "llm.c shards hold at most {} tokens, asked for {tokens}",
            i32::MAX
        )));
    }
    Ok(())
}

/// Write `spec.tokens` tokens of the [`MarkovChain`] `(vocab, branching, chain_seed)`, drawn
/// with `stream_seed`, to `out` in `spec.format`.
///
/// The tokens are exactly `MarkovChain::random(vocab, branching, chain_seed)?
/// .generate(tokens, stream_seed)`, so the same spec always gives the same bytes. They are
/// generated and written in chunks: memory stays bounded for any token count. The write is
/// atomic (temp file in the same directory, fsync, rename); on any error no file appears at
/// `out` and an existing one is left as it was.
///
/// Errors: zero tokens ([`DataError::Empty`]); a vocabulary too large for the token type
/// ([`DataError::VocabTooLarge`], checked before anything else); an invalid chain or format
/// ([`DataError::InvalidConfig`]); more bytes than the output's file system has free
/// ([`DataError::NoSpace`], before anything is written); I/O ([`DataError::Io`]).
pub fn synthesize(spec: &SynthSpec, out: &Path) -> Result<DatasetSummary> {
    if spec.tokens == 0 {
        return Err(DataError::Empty {
            what: "synthetic dataset of 0 tokens".into(),
        });
    }
    check_vocab_fits(u64::from(spec.vocab), spec.format.token_type())?;
    check_token_capacity(spec.tokens, spec.format)?;
    let chain = MarkovChain::random(spec.vocab, spec.branching, spec.chain_seed)?;
    check_room(out, token_bytes(spec.tokens, spec.format))?;
    let mut writer = TokenWriter::create(out, spec.format)?;
    let mut stream = chain.stream(spec.stream_seed);
    let mut buffer =
        vec![0u32; usize::try_from(spec.tokens).map_or(CHUNK_TOKENS, |n| n.min(CHUNK_TOKENS))];
    let mut left = spec.tokens;
    while left > 0 {
        let n = usize::try_from(left).map_or(buffer.len(), |l| l.min(buffer.len()));
        let chunk = &mut buffer[..n];
        stream.fill(chunk);
        writer.write(chunk)?;
        left -= n as u64;
    }
    let written = writer.finish()?;
    Ok(DatasetSummary::new(
        written,
        spec.format,
        spec.vocab,
        Some(chain.entropy_rate()),
    ))
}

/// Tokenise the file `input` byte by byte (see [`crate::text`]) and write the tokens to `out`
/// in `spec.format`, atomically.
///
/// With a document separator, each occurrence is replaced by one [`BYTE_EOT`] token (so
/// documents are *separated*, not terminated: text → tokens → [`crate::text::decode_bytes`]
/// with the same separator gives the text back exactly), and in Megatron output each document
/// ends after its separator token (and, as for any Megatron output, at most every
/// `document_len` tokens). The input is memory-mapped and converted in chunks: memory stays
/// bounded (Megatron output keeps 4 bytes per document for the index).
///
/// Errors: a missing input ([`DataError::Io`]); an empty input ([`DataError::Empty`]); invalid
/// UTF-8 when required ([`DataError::InvalidUtf8`]); an empty separator
/// ([`DataError::InvalidConfig`]); a token type too narrow for the vocabulary, such as `u8`
/// with a separator ([`DataError::VocabTooLarge`]); an output that cannot fit the free space
/// of its file system ([`DataError::NoSpace`], before anything is written).
pub fn build_from_text(input: &Path, spec: &BuildSpec, out: &Path) -> Result<DatasetSummary> {
    let separator = spec.document_separator.as_deref();
    if separator.is_some_and(<[u8]>::is_empty) {
        return Err(DataError::InvalidConfig(
            "the document separator must not be empty".into(),
        ));
    }
    let vocab = spec.vocab_size();
    check_vocab_fits(u64::from(vocab), spec.format.token_type())?;
    let backing = map_file(input)?;
    let bytes = backing.bytes();
    if spec.require_utf8 {
        if let Err(e) = std::str::from_utf8(bytes) {
            return Err(DataError::InvalidUtf8 {
                path: input.to_path_buf(),
                offset: e.valid_up_to() as u64,
            });
        }
    }
    // Every byte is at most one token, so this bounds the count before writing anything.
    check_token_capacity(bytes.len() as u64, spec.format)?;
    // And at least one token per separator's length of text (a separator becomes one).
    let fewest_tokens = bytes.len() as u64 / separator.map_or(1, |s| s.len() as u64);
    check_room(out, token_bytes(fewest_tokens, spec.format))?;
    let mut writer = TokenWriter::create(out, spec.format)?;
    let mut buffer = Vec::with_capacity(CHUNK_TOKENS.min(bytes.len()));
    let mut rest = bytes;
    if let Some(sep) = separator {
        while let Some(at) = find_subslice(rest, sep) {
            let (document, after) = rest.split_at(at);
            write_byte_tokens(&mut writer, &mut buffer, document)?;
            writer.write(&[BYTE_EOT])?;
            writer.end_document()?;
            rest = after.get(sep.len()..).unwrap_or(&[]);
        }
    }
    write_byte_tokens(&mut writer, &mut buffer, rest)?;
    let written = writer.finish()?;
    Ok(DatasetSummary::new(written, spec.format, vocab, None))
}

fn write_byte_tokens(writer: &mut TokenWriter, buffer: &mut Vec<u32>, bytes: &[u8]) -> Result<()> {
    for piece in bytes.chunks(CHUNK_TOKENS) {
        buffer.clear();
        buffer.extend(piece.iter().map(|&b| u32::from(b)));
        writer.write(buffer)?;
    }
    Ok(())
}

/// First position of `needle` (non-empty) in `haystack`. A first-byte scan then a compare:
/// O(n·m) in the worst case, fine for the short separators this is used with.
fn find_subslice(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    let (&first, tail) = needle.split_first()?;
    let mut from = 0;
    while let Some(offset) = haystack.get(from..)?.iter().position(|&b| b == first) {
        let at = from + offset;
        if haystack.get(at + 1..at + needle.len()) == Some(tail) {
            return Some(at);
        }
        from = at + 1;
    }
    None
}

/// How [`inspect`] reads a file.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct InspectOptions {
    /// Token type of a headerless raw file; `None` guesses (see [`DtypeSource::Guessed`]).
    /// For llm.c and Megatron files the header decides, and a different type given here is
    /// [`DataError::InvalidConfig`].
    pub raw_token_type: Option<TokenType>,
    /// Distinct ids are counted exactly below this id, with one bit each (the default, 2²⁴,
    /// costs 2 MiB); ids at or above it make the count a lower bound.
    pub distinct_id_limit: u32,
    /// How many leading tokens to keep in [`FileDescription::first_tokens`].
    pub preview_tokens: usize,
}

impl Default for InspectOptions {
    fn default() -> Self {
        InspectOptions {
            raw_token_type: None,
            distinct_id_limit: 1 << 24,
            preview_tokens: 16,
        }
    }
}

/// The format [`inspect`] found.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum DetectedFormat {
    /// A headerless raw token file (nanoGPT `.bin`).
    Raw,
    /// An llm.c shard of this flavour.
    Llmc(LlmcFlavor),
    /// A Megatron `.idx` + `.bin` pair.
    Megatron,
}

impl fmt::Display for DetectedFormat {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            DetectedFormat::Raw => "raw tokens, no header (nanoGPT .bin)",
            DetectedFormat::Llmc(LlmcFlavor::Gpt2) => "llm.c shard, GPT-2 header (magic 20240520)",
            DetectedFormat::Llmc(LlmcFlavor::Llama3) => {
                "llm.c shard, Llama-3 header (magic 20240801)"
            }
            DetectedFormat::Megatron => "Megatron-LM indexed dataset (.idx + .bin)",
        })
    }
}

/// Where [`FileDescription::token_type`] came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum DtypeSource {
    /// The file's header (llm.c magic, Megatron dtype code).
    Header,
    /// [`InspectOptions::raw_token_type`].
    Given,
    /// Guessed for a raw file: `u8` for an odd byte length; `u32` when the file is a whole
    /// number of 4-byte words, holds at least 64 of them, and every word among the first 2¹⁶
    /// has a zero high half while some low half is not zero (`u16` data very rarely looks
    /// like that, but `u32` files of ids ≥ 65 536 are guessed `u16`); otherwise `u16`
    /// (nanoGPT's type). Give the type when in doubt.
    Guessed,
}

/// What [`inspect`] found in a token file.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileDescription {
    /// The path inspected.
    pub path: PathBuf,
    /// The format detected.
    pub format: DetectedFormat,
    /// Storage type of the tokens.
    pub token_type: TokenType,
    /// Whether the token type was read, given or guessed.
    pub dtype_source: DtypeSource,
    /// The files read with their sizes (Megatron: `.idx`, then `.bin`; a set: every shard's).
    pub files: Vec<(PathBuf, u64)>,
    /// Token files (shards) described: 1 for a file or a Megatron pair, more for a set (a
    /// directory or a glob of shards, as `train --data` reads one).
    pub shards: usize,
    /// Bytes over all files.
    pub file_bytes: u64,
    /// Tokens in the file.
    pub tokens: u64,
    /// Documents in the index (Megatron); `None` for formats without one.
    pub documents: Option<u64>,
    /// Smallest token id.
    pub min_id: u32,
    /// Largest token id (a model's vocabulary must exceed it).
    pub max_id: u32,
    /// Number of distinct ids: exact when `distinct_ids_exact`, else a lower bound.
    pub distinct_ids: u64,
    /// False when some id reached [`InspectOptions::distinct_id_limit`].
    pub distinct_ids_exact: bool,
    /// The first tokens, at most [`InspectOptions::preview_tokens`].
    pub first_tokens: Vec<u32>,
    /// The loss mask beside the token file, if there is one: its path and the tokens it
    /// counts as targets (checked against the file's token count).
    pub loss_mask: Option<(PathBuf, u64)>,
}

impl fmt::Display for FileDescription {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.files.len() > 6 {
            let (first, last) = (&self.files[0].0, &self.files[self.files.len() - 1].0);
            writeln!(
                f,
                "{:<12}{} files, {} … {} ({} bytes)",
                "files",
                self.files.len(),
                first.display(),
                last.display(),
                self.file_bytes
            )?;
        } else {
            for (path, bytes) in &self.files {
                writeln!(f, "{:<12}{} ({} bytes)", "file", path.display(), bytes)?;
            }
        }
        if self.shards > 1 {
            writeln!(
                f,
                "{:<12}{} (read as one dataset, in name order)",
                "shards", self.shards
            )?;
        }
        writeln!(f, "{:<12}{}", "format", self.format)?;
        let source = match self.dtype_source {
            DtypeSource::Header => "from the header",
            DtypeSource::Given => "as given",
            DtypeSource::Guessed => "guessed; give the type to be sure",
        };
        writeln!(f, "{:<12}{} ({source})", "dtype", self.token_type)?;
        writeln!(f, "{:<12}{}", "tokens", self.tokens)?;
        if let Some(d) = self.documents {
            writeln!(f, "{:<12}{d}", "documents")?;
        }
        let distinct = if self.distinct_ids_exact {
            format!("{}", self.distinct_ids)
        } else {
            format!("at least {} (large ids not tracked)", self.distinct_ids)
        };
        writeln!(
            f,
            "{:<12}min {}, max {}, {distinct} distinct",
            "ids", self.min_id, self.max_id
        )?;
        let shown: Vec<String> = self.first_tokens.iter().map(u32::to_string).collect();
        let more = if (self.first_tokens.len() as u64) < self.tokens {
            ", …"
        } else {
            ""
        };
        write!(f, "{:<12}[{}{more}]", "first", shown.join(", "))?;
        if let Some((path, counted)) = &self.loss_mask {
            write!(
                f,
                "\n{:<12}{}: {counted} of {} tokens count as targets ({:.1}%)",
                "loss mask",
                path.display(),
                self.tokens,
                100.0 * *counted as f64 / self.tokens.max(1) as f64
            )?;
        }
        Ok(())
    }
}

/// Detect the format of the token file at `path` and describe it (see [`FileDescription`]).
///
/// Detection, in order: a Megatron dataset (a `.idx` path, or a `.bin`/prefix with its `.idx`
/// beside it); a file starting with an llm.c magic number; otherwise raw tokens of
/// `options.raw_token_type`, or of a guessed type ([`DtypeSource::Guessed`]). A file whose
/// header is recognised but wrong is an error, never a guess.
///
/// Every token is read once through the crate's memory-mapped readers, in chunks; memory is
/// O(1) apart from the distinct-id bitset, one bit per id up to the largest id seen and never
/// more than `options.distinct_id_limit` bits.
///
/// Errors: a missing file ([`DataError::Io`]); a directory ([`DataError::InvalidConfig`]);
/// truncated or corrupt headers and indexes ([`DataError::Truncated`],
/// [`DataError::Corrupt`], [`DataError::BadMagic`], [`DataError::UnsupportedVersion`],
/// [`DataError::UnsupportedDtype`], [`DataError::PointerOutOfBounds`]); an empty file
/// ([`DataError::Empty`]); a raw length that is not whole tokens ([`DataError::OddLength`]);
/// a stored id that is negative or beyond `u32` ([`DataError::TokenOutOfRange`]).
pub fn inspect(path: &Path, options: &InspectOptions) -> Result<FileDescription> {
    let glob = path
        .file_name()
        .and_then(|n| n.to_str())
        .is_some_and(|n| n.contains(['*', '?']));
    if path.is_dir() || glob {
        return inspect_set(path, options);
    }
    let (dataset, format, dtype_source, files) = open_detected(path, options)?;
    let token_type = dataset
        .segments()
        .first()
        .map(|s| s.token_type())
        .ok_or_else(|| DataError::Empty {
            what: path.display().to_string(),
        })?;
    if let Some(given) = options.raw_token_type {
        if dtype_source == DtypeSource::Header && given != token_type {
            return Err(DataError::InvalidConfig(format!(
                "{}: the header says {token_type} tokens, but {given} was given",
                path.display()
            )));
        }
    }
    let stats = scan_ids(&dataset, options)?;
    // The token file a mask sits beside: the `.bin` of a Megatron pair (listed last).
    let token_file = files.last().map_or(path, |(p, _)| p.as_path());
    let mask_path = crate::loss_mask_path(token_file);
    let loss_mask = if mask_path.is_file() {
        let mask = crate::LossMask::open(&mask_path)?;
        if mask.len() as u64 != dataset.total_tokens() {
            return Err(DataError::InvalidConfig(format!(
                "{}: the loss mask covers {} tokens, the file holds {}",
                mask_path.display(),
                mask.len(),
                dataset.total_tokens()
            )));
        }
        Some((mask_path, mask.counted()))
    } else {
        None
    };
    Ok(FileDescription::of(
        path,
        &dataset,
        (format, token_type, dtype_source),
        files,
        stats,
        loss_mask,
    ))
}

impl FileDescription {
    /// The description of `dataset`, read from `files` at `path`, given what was detected,
    /// its ids' statistics and its loss mask.
    fn of(
        path: &Path,
        dataset: &TokenDataset,
        (format, token_type, dtype_source): (DetectedFormat, TokenType, DtypeSource),
        files: Vec<(PathBuf, u64)>,
        stats: IdStats,
        loss_mask: Option<(PathBuf, u64)>,
    ) -> FileDescription {
        FileDescription {
            loss_mask,
            path: path.to_path_buf(),
            format,
            token_type,
            dtype_source,
            file_bytes: files.iter().map(|(_, n)| n).sum(),
            files,
            shards: dataset.segments().len(),
            tokens: dataset.total_tokens(),
            documents: dataset.documents().map(|d| d.len() as u64),
            min_id: stats.min_id,
            max_id: stats.max_id,
            distinct_ids: stats.distinct_ids,
            distinct_ids_exact: stats.distinct_ids_exact,
            first_tokens: stats.first_tokens,
        }
    }
}

/// [`inspect`] of a set of shards, a directory or a glob opened as `train --data` opens it:
/// the first shard's format and token type (every shard must have that type), the ids and
/// tokens over all of them, the loss masks' counts when the shards have them.
fn inspect_set(path: &Path, options: &InspectOptions) -> Result<FileDescription> {
    let what = path.display().to_string();
    // The first shard decides how headerless shards are read: as it is detected.
    let listed = crate::formats::open(path, &crate::formats::OpenOptions::default())?;
    let first = listed
        .segments()
        .first()
        .map(|s| PathBuf::from(s.name()))
        .ok_or_else(|| DataError::Empty { what: what.clone() })?;
    let (first_dataset, format, dtype_source, _) = open_detected(&first, options)?;
    let token_type = first_dataset
        .segments()
        .first()
        .map(|s| s.token_type())
        .ok_or_else(|| DataError::Empty { what: what.clone() })?;
    let dataset = crate::formats::open(
        path,
        &crate::formats::OpenOptions {
            raw_token_type: token_type,
        },
    )?;
    let mut files = Vec::new();
    for segment in dataset.segments() {
        let name = PathBuf::from(segment.name());
        if segment.token_type() != token_type {
            return Err(DataError::InvalidConfig(format!(
                "{what}: {} holds {} tokens, {} holds {token_type}",
                name.display(),
                segment.token_type(),
                first.display()
            )));
        }
        if format == DetectedFormat::Megatron {
            let idx = megatron::megatron_paths(&name).0;
            files.push((idx.clone(), file_size(&idx)?));
        }
        files.push((name.clone(), file_size(&name)?));
    }
    let stats = scan_ids(&dataset, options)?;
    let loss_mask = dataset
        .has_loss_mask()
        .then(|| (path.to_path_buf(), dataset.counted_tokens()));
    Ok(FileDescription::of(
        path,
        &dataset,
        (format, token_type, dtype_source),
        files,
        stats,
        loss_mask,
    ))
}

type Detected = (
    TokenDataset,
    DetectedFormat,
    DtypeSource,
    Vec<(PathBuf, u64)>,
);

fn file_size(path: &Path) -> Result<u64> {
    fs::metadata(path)
        .map(|m| m.len())
        .map_err(|e| DataError::io(path, e))
}

fn open_detected(path: &Path, options: &InspectOptions) -> Result<Detected> {
    if is_megatron_path(path) {
        let dataset = megatron::open_megatron(path)?;
        let (idx, bin) = megatron::megatron_paths(path);
        let files = vec![
            (idx.clone(), file_size(&idx)?),
            (bin.clone(), file_size(&bin)?),
        ];
        return Ok((
            dataset,
            DetectedFormat::Megatron,
            DtypeSource::Header,
            files,
        ));
    }
    let bytes = file_size(path)?;
    let files = vec![(path.to_path_buf(), bytes)];
    let mut head = [0u8; 4];
    let n = fs::File::open(path)
        .and_then(|mut f| std::io::Read::read(&mut f, &mut head))
        .map_err(|e| DataError::io(path, e))?;
    if n == 4 && llmc::looks_like_llmc(&head) {
        let dataset = llmc::open_llmc(path)?;
        let flavor = match dataset.segments().first().map(|s| s.token_type()) {
            Some(TokenType::U32) => LlmcFlavor::Llama3,
            _ => LlmcFlavor::Gpt2,
        };
        return Ok((
            dataset,
            DetectedFormat::Llmc(flavor),
            DtypeSource::Header,
            files,
        ));
    }
    let (dataset, source) = match options.raw_token_type {
        Some(t) => (raw::open_raw(path, t)?, DtypeSource::Given),
        None => (guess_raw(path, bytes)?, DtypeSource::Guessed),
    };
    Ok((dataset, DetectedFormat::Raw, source, files))
}

/// Open a raw file of unknown type by the rule documented on [`DtypeSource::Guessed`].
fn guess_raw(path: &Path, bytes: u64) -> Result<TokenDataset> {
    const MIN_WORDS: usize = 64;
    const SAMPLE_WORDS: usize = 1 << 16;
    if bytes % 2 == 1 {
        return raw::open_raw(path, TokenType::U8);
    }
    let as_u16 = raw::open_raw(path, TokenType::U16)?;
    if !bytes.is_multiple_of(4) || bytes < (MIN_WORDS * 4) as u64 {
        return Ok(as_u16);
    }
    let looks_u32 = as_u16.segments().first().is_some_and(|segment| {
        let tokens = segment.tokens();
        let words = (tokens.len() / 2).min(SAMPLE_WORDS);
        let (mut any_low, mut any_high) = (false, false);
        for w in 0..words {
            any_low |= tokens.get(2 * w).is_some_and(|v| v != 0);
            any_high |= tokens.get(2 * w + 1).is_some_and(|v| v != 0);
        }
        any_low && !any_high
    });
    if looks_u32 {
        raw::open_raw(path, TokenType::U32)
    } else {
        Ok(as_u16)
    }
}

struct IdStats {
    min_id: u32,
    max_id: u32,
    distinct_ids: u64,
    distinct_ids_exact: bool,
    first_tokens: Vec<u32>,
}

fn scan_ids(dataset: &TokenDataset, options: &InspectOptions) -> Result<IdStats> {
    let limit = options.distinct_id_limit;
    let max_words = (limit as usize).div_ceil(64);
    let mut seen: Vec<u64> = Vec::new();
    let mut above_limit = false;
    let (mut min_id, mut max_id) = (u32::MAX, 0u32);
    let mut first_tokens = Vec::with_capacity(options.preview_tokens.min(CHUNK_TOKENS));
    let mut scratch = vec![0u32; CHUNK_TOKENS];
    for segment in dataset.segments() {
        let tokens = segment.tokens();
        let mut start = 0;
        while start < tokens.len() {
            let n = CHUNK_TOKENS.min(tokens.len() - start);
            let chunk = &mut scratch[..n];
            let decoded = tokens
                .sub(start, n)
                .map(|sub| sub.decode_into(chunk, 1 << 32));
            match decoded {
                Some(Ok(())) => {}
                Some(Err((i, value))) => {
                    return Err(DataError::TokenOutOfRange {
                        what: segment.name().to_string(),
                        position: (start + i) as u64,
                        value: i128::from(value),
                        vocab_size: 1 << 32,
                    })
                }
                None => {
                    return Err(DataError::corrupt(
                        segment.name(),
                        "token range outside the mapped file",
                    ))
                }
            }
            for &t in chunk.iter() {
                min_id = min_id.min(t);
                max_id = max_id.max(t);
                if t < limit {
                    let word = (t / 64) as usize;
                    if word >= seen.len() {
                        // Grow geometrically but never past the limit.
                        let grown = (word + 1).max(seen.len() * 2).min(max_words);
                        seen.resize(grown, 0);
                    }
                    if let Some(bits) = seen.get_mut(word) {
                        *bits |= 1 << (t % 64);
                    }
                } else {
                    above_limit = true;
                }
            }
            let want = options.preview_tokens.saturating_sub(first_tokens.len());
            first_tokens.extend(chunk.iter().take(want));
            start += n;
        }
    }
    if dataset.total_tokens() == 0 {
        return Err(DataError::Empty {
            what: "dataset".into(),
        });
    }
    let below: u64 = seen.iter().map(|w| u64::from(w.count_ones())).sum();
    Ok(IdStats {
        min_id,
        max_id,
        distinct_ids: below + u64::from(above_limit),
        distinct_ids_exact: !above_limit,
        first_tokens,
    })
}

#[cfg(test)]
mod tests {
    use super::find_subslice;
    use proptest::prelude::*;

    /// The obvious quadratic search, as the reference.
    fn naive_find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
        (0..=haystack.len().checked_sub(needle.len())?).find(|&i| haystack[i..].starts_with(needle))
    }

    proptest! {
        #[test]
        fn subslice_search_matches_the_naive_reference(
            haystack in prop::collection::vec(0u8..3, 0..60),
            needle in prop::collection::vec(0u8..3, 1..4),
        ) {
            prop_assert_eq!(find_subslice(&haystack, &needle), naive_find(&haystack, &needle));
        }
    }

    #[test]
    fn subslice_search_edges() {
        assert_eq!(find_subslice(b"abc", b""), None);
        assert_eq!(find_subslice(b"", b"a"), None);
        assert_eq!(find_subslice(b"ab", b"abc"), None);
        assert_eq!(find_subslice(b"aab", b"ab"), Some(1));
        assert_eq!(find_subslice(b"xyab", b"ab"), Some(2));
    }
}
