//! The crate's error type: every malformed input is one of these, never a panic.

use headroom_tensor::Error as TensorError;

/// Everything that can go wrong quantizing, loading or multiplying.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum QuantError {
    /// A block size that is not a power of two in 32..=4096.
    #[error("block size {0} is not a power of two in 32..=4096")]
    InvalidBlockSize(u64),
    /// A quantization type other than `nf4` / `fp4`.
    #[error("unknown 4-bit quantization type {0:?} (expected \"nf4\" or \"fp4\")")]
    UnknownQuantType(String),
    /// A shape with no elements, or no dimensions.
    #[error("a quantized tensor needs at least one element (shape {0:?})")]
    EmptyShape(Vec<u64>),
    /// Sizes whose product or byte count does not fit in memory addresses.
    #[error("size overflow: {0}")]
    SizeOverflow(&'static str),
    /// A buffer whose length disagrees with the shape and block size.
    #[error("{what}: expected {expected} elements, got {got}")]
    LengthMismatch {
        /// Which buffer.
        what: &'static str,
        /// What the shape and block size require.
        expected: u64,
        /// What was given.
        got: u64,
    },
    /// A NaN or infinite value where a finite one is required.
    #[error("{what}: element {index} is not finite ({value})")]
    NonFinite {
        /// Which buffer.
        what: &'static str,
        /// Its position.
        index: u64,
        /// The value.
        value: f32,
    },
    /// A negative per-block absmax.
    #[error("absmax {index} is negative ({value})")]
    NegativeAbsmax {
        /// Its position.
        index: u64,
        /// The value.
        value: f32,
    },
    /// A stored code map that is not the one this crate encodes and decodes with.
    #[error("{what} differs from bitsandbytes' {expected} code map at entry {index}")]
    CodeMapMismatch {
        /// Which map.
        what: &'static str,
        /// The map it should equal.
        expected: &'static str,
        /// The first differing entry (or the length, when the lengths differ).
        index: u64,
    },
    /// A matrix operation on operands whose shapes do not fit together.
    #[error("{op}: {detail}")]
    ShapeMismatch {
        /// The operation.
        op: &'static str,
        /// What does not fit.
        detail: String,
    },
    /// A safetensors file (or bytes) that cannot be read as bitsandbytes' 4-bit layout.
    #[error("safetensors: {0}")]
    Format(String),
    /// A tensor the layout requires is absent.
    #[error("missing tensor {0:?}")]
    MissingTensor(String),
    /// A tensor of the wrong element type or shape.
    #[error("tensor {name:?}: {detail}")]
    BadTensor {
        /// The tensor's name.
        name: String,
        /// What is wrong.
        detail: String,
    },
    /// The `quant_state.bitsandbytes__*` JSON blob is not what bitsandbytes writes.
    #[error("quant state: {0}")]
    BadQuantState(String),
    /// Reading a file failed.
    #[error("reading {path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// A SIMD path was asked for on a CPU without the instructions.
    #[error("the CPU does not support {0}")]
    UnsupportedIsa(&'static str),
    /// An allocation (refused by a hook, out of memory) or another backend failure.
    #[error(transparent)]
    Tensor(#[from] TensorError),
}

/// Result with [`QuantError`].
pub type Result<T, E = QuantError> = std::result::Result<T, E>;
