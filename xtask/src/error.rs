//! The one error type of every task.

use std::path::PathBuf;

/// Why a task stopped.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The command line was not understood.
    #[error("{0}")]
    Usage(String),
    /// A file or directory could not be read or written.
    #[error("{action} {}: {source}", path.display())]
    Io {
        /// What was being done (`"reading"`, `"creating"`, …).
        action: &'static str,
        /// The path it was done to.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
    /// A program could not be started at all.
    #[error("could not start `{program}`: {source}")]
    Spawn {
        /// The program.
        program: String,
        /// The underlying error.
        source: std::io::Error,
    },
    /// A step ran and failed.
    #[error("step `{step}` failed ({status})")]
    StepFailed {
        /// The command line of the step.
        step: String,
        /// Its exit status, in words.
        status: String,
    },
    /// A JSON file or message did not have the expected shape.
    #[error("malformed JSON in {what}: {source}")]
    Json {
        /// Which file or stream.
        what: String,
        /// The parser's error.
        source: serde_json::Error,
    },
    /// Cargo reported something xtask cannot use.
    #[error("unexpected cargo output: {0}")]
    Cargo(String),
    /// The device bundle is larger than the limit it has to fit in.
    #[error("device bundle is {bytes} bytes ({:.1} MiB), over the {limit} byte limit", *bytes as f64 / (1u64 << 20) as f64)]
    BundleTooLarge {
        /// Total size of the bundle.
        bytes: u64,
        /// The limit.
        limit: u64,
    },
}

/// Result of every task.
pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    /// An I/O error with the path it concerns.
    pub fn io(
        action: &'static str,
        path: impl Into<PathBuf>,
    ) -> impl FnOnce(std::io::Error) -> Error {
        let path = path.into();
        move |source| Error::Io {
            action,
            path,
            source,
        }
    }
}
