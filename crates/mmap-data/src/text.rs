//! Byte-level tokenisation: every byte of a UTF-8 text is one token in `0..256`, and
//! optionally one end-of-text token, [`BYTE_EOT`] = 256, that separates documents.
//!
//! This is the only tokenizer the crate has (no BPE merges are bundled, and nothing is
//! downloaded); it is lossless, so [`decode_bytes`] inverts it exactly.

use std::path::Path;

use crate::formats::TokenFileFormat;
use crate::tools::{build_from_text, BuildSpec};
use crate::{DataError, Result};

/// Vocabulary size of byte-level tokens.
pub const BYTE_VOCAB: u32 = 256;

/// The end-of-text token: the id right after the bytes. Text with documents separated by it
/// has a vocabulary of [`BYTE_VOCAB_WITH_EOT`].
pub const BYTE_EOT: u32 = BYTE_VOCAB;

/// Vocabulary size of byte-level tokens plus [`BYTE_EOT`].
pub const BYTE_VOCAB_WITH_EOT: u32 = BYTE_VOCAB + 1;

/// Tokenise the UTF-8 file `text` byte by byte and write the tokens to `out` in `format`.
/// Returns the token count. Invalid UTF-8 is an error naming the first bad byte.
///
/// The simple case of [`crate::tools::build_from_text`] (no document separator), which
/// streams the conversion in bounded memory and writes atomically.
pub fn tokenize_text_file(
    text: impl AsRef<Path>,
    out: impl AsRef<Path>,
    format: TokenFileFormat,
) -> Result<u64> {
    build_from_text(text.as_ref(), &BuildSpec::new(format), out.as_ref()).map(|s| s.tokens)
}

/// The byte-level tokens of `bytes`.
pub fn tokenize_bytes(bytes: &[u8]) -> Vec<u32> {
    bytes.iter().map(|&b| u32::from(b)).collect()
}

/// The bytes behind byte-level `tokens`, with each [`BYTE_EOT`] written as `separator` (the
/// inverse of tokenising with that separator). An id outside the bytes — or [`BYTE_EOT`] when
/// `separator` is `None` — is [`DataError::TokenOutOfRange`].
pub fn decode_bytes(tokens: &[u32], separator: Option<&[u8]>) -> Result<Vec<u8>> {
    let mut out = Vec::with_capacity(tokens.len());
    for (position, &t) in tokens.iter().enumerate() {
        match (u8::try_from(t), separator) {
            (Ok(b), _) => out.push(b),
            (Err(_), Some(sep)) if t == BYTE_EOT => out.extend_from_slice(sep),
            _ => {
                return Err(DataError::TokenOutOfRange {
                    what: "byte-level tokens".into(),
                    position: position as u64,
                    value: i128::from(t),
                    vocab_size: u64::from(if separator.is_some() {
                        BYTE_VOCAB_WITH_EOT
                    } else {
                        BYTE_VOCAB
                    }),
                })
            }
        }
    }
    Ok(out)
}
