//! The crate's error type: every way a file, a configuration or a request can be wrong.

use std::path::PathBuf;

/// Everything that can go wrong reading, sampling or loading token data.
///
/// Parsers never panic on bad bytes; they return one of these with enough context (file, offset,
/// value) to find the problem.
#[derive(Debug, thiserror::Error)]
pub enum DataError {
    /// An operating-system error while opening, mapping, reading or writing a file.
    #[error("I/O error on {path}: {source}")]
    Io {
        /// The file involved.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// A file, shard, document set or dataset holds no tokens.
    #[error("{what} is empty")]
    Empty {
        /// What was empty (a file name or a description).
        what: String,
    },
    /// The file ends before a structure that its header promises.
    #[error("{what}: truncated: need {needed} bytes, have {available}")]
    Truncated {
        /// What was being read.
        what: String,
        /// Bytes required.
        needed: u64,
        /// Bytes present.
        available: u64,
    },
    /// A byte length that is not a multiple of the token width.
    #[error("{what}: {bytes} bytes is not a multiple of the {width}-byte token width")]
    OddLength {
        /// What was being read.
        what: String,
        /// The byte length found.
        bytes: u64,
        /// The token width in bytes.
        width: usize,
    },
    /// A file whose magic number is not the one its format requires.
    #[error("{what}: bad magic {found:?}, expected {expected:?}")]
    BadMagic {
        /// What was being read.
        what: String,
        /// The bytes (or number) found, as text.
        found: String,
        /// The bytes (or number) expected, as text.
        expected: String,
    },
    /// A format version this crate does not read.
    #[error("{what}: unsupported version {found}")]
    UnsupportedVersion {
        /// What was being read.
        what: String,
        /// The version found.
        found: u64,
    },
    /// A token element type code this crate does not read (floats, int8, …).
    #[error("{what}: unsupported token dtype code {code}")]
    UnsupportedDtype {
        /// What was being read.
        what: String,
        /// The dtype code found.
        code: u64,
    },
    /// A header field or index entry that is inconsistent with the rest of the file.
    #[error("{what}: corrupt: {detail}")]
    Corrupt {
        /// What was being read.
        what: String,
        /// What is wrong.
        detail: String,
    },
    /// A Megatron `.idx` sequence that points outside its `.bin` file.
    #[error("{what}: sequence {sequence} spans bytes {start}..{end} but the .bin has {bin_len}")]
    PointerOutOfBounds {
        /// The index file.
        what: String,
        /// The offending sequence number.
        sequence: u64,
        /// First byte of the sequence.
        start: u64,
        /// One past its last byte.
        end: u64,
        /// Length of the `.bin` file.
        bin_len: u64,
    },
    /// A token id outside `0..vocab_size` (or negative, or beyond `u32`).
    #[error(
        "token {value} at position {position} of {what} is outside the vocabulary 0..{vocab_size}"
    )]
    TokenOutOfRange {
        /// The segment it was found in.
        what: String,
        /// Token position inside that segment.
        position: u64,
        /// The value found (negative values are shown as such).
        value: i128,
        /// The vocabulary bound it broke.
        vocab_size: u64,
    },
    /// A token that does not fit the requested on-disk width (writing).
    #[error("token {value} at index {index} does not fit a {width}")]
    TokenTooWide {
        /// Index in the input.
        index: usize,
        /// The value.
        value: u64,
        /// The width it had to fit (`"u16"`, …).
        width: &'static str,
    },
    /// A vocabulary whose largest id does not fit the chosen on-disk token type (writing):
    /// refused before any file is touched.
    #[error(
        "a vocabulary of {vocab} ids does not fit {width} tokens (largest storable id {max_id})"
    )]
    VocabTooLarge {
        /// The vocabulary size.
        vocab: u64,
        /// The storage type (`"u16"`, …).
        width: &'static str,
        /// The largest id that type stores.
        max_id: u64,
    },
    /// A window of `window` tokens cannot be cut from data this short.
    #[error("window of {window} tokens does not fit: longest usable run is {longest} tokens")]
    WindowTooLong {
        /// Tokens per window (sequence length + 1).
        window: u64,
        /// The longest segment or document.
        longest: u64,
    },
    /// A configuration value that makes no sense (zero batch, rank ≥ world, …).
    #[error("invalid configuration: {0}")]
    InvalidConfig(String),
    /// A saved position that belongs to another dataset or configuration.
    #[error("cannot resume: {0}")]
    ResumeMismatch(String),
    /// The text given for byte tokenisation is not UTF-8.
    #[error("{path}: not valid UTF-8 at byte {offset}")]
    InvalidUtf8 {
        /// The text file.
        path: PathBuf,
        /// First invalid byte.
        offset: u64,
    },
    /// Memory could not be had: the allocation hook refused the loader's batch buffers (a
    /// memory budget), or the system had no memory for a buffer whose size the data decides
    /// (batch buffers, the tables of a Megatron index). Never an abort.
    #[error("could not allocate: {0}")]
    Allocation(#[from] headroom_tensor::Error),
    /// A file about to be written would not fit the free space of its file system: refused
    /// before anything is written, so that a mistyped size does not fill the disk other
    /// processes (a training run's checkpoints) write to.
    #[error(
        "{path}: writing it needs at least {} but its file system has {} free",
        crate::error::human_bytes(*needed),
        crate::error::human_bytes(*available)
    )]
    NoSpace {
        /// The file that would have been written.
        path: PathBuf,
        /// Bytes it needs at least.
        needed: u64,
        /// Bytes free for an unprivileged writer on its file system.
        available: u64,
    },
    /// A loader worker thread stopped (it panicked or was shut down).
    #[error("loader worker {0} stopped unexpectedly")]
    WorkerStopped(usize),
}

/// Shorthand for results in this crate.
pub type Result<T, E = DataError> = std::result::Result<T, E>;

impl DataError {
    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        DataError::Io {
            path: path.into(),
            source,
        }
    }

    pub(crate) fn corrupt(what: impl Into<String>, detail: impl Into<String>) -> Self {
        DataError::Corrupt {
            what: what.into(),
            detail: detail.into(),
        }
    }

    pub(crate) fn truncated(what: impl Into<String>, needed: u64, available: u64) -> Self {
        DataError::Truncated {
            what: what.into(),
            needed,
            available,
        }
    }
}

/// `bytes` in the largest binary unit that keeps a digit before the point: `512 bytes`,
/// `3.0 KiB`, `1.5 GiB`, `2.0 EiB`.
pub(crate) fn human_bytes(bytes: u64) -> String {
    const UNITS: [&str; 6] = ["KiB", "MiB", "GiB", "TiB", "PiB", "EiB"];
    if bytes < 1024 {
        return format!("{bytes} bytes");
    }
    let mut value = bytes as f64 / 1024.0;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    format!("{value:.1} {}", UNITS[unit])
}
