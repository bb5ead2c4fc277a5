//! Byte-level tokenisation: every byte of a UTF-8 text is one token in `0..256`.

use std::path::Path;

use crate::dataset::map_file;
use crate::formats::{write_tokens, TokenFileFormat};
use crate::{DataError, Result};

/// Vocabulary size of byte-level tokens.
pub const BYTE_VOCAB: u32 = 256;

/// Tokenise the UTF-8 file `text` byte by byte and write the tokens to `out` in `format`.
/// Returns the token count. Invalid UTF-8 is an error naming the first bad byte.
pub fn tokenize_text_file(
    text: impl AsRef<Path>,
    out: impl AsRef<Path>,
    format: TokenFileFormat,
) -> Result<u64> {
    let text = text.as_ref();
    let backing = map_file(text)?;
    let bytes = backing.bytes();
    if let Err(e) = std::str::from_utf8(bytes) {
        return Err(DataError::InvalidUtf8 {
            path: text.to_path_buf(),
            offset: e.valid_up_to() as u64,
        });
    }
    let tokens = tokenize_bytes(bytes);
    write_tokens(out, &tokens, format)?;
    Ok(tokens.len() as u64)
}

/// The byte-level tokens of `bytes`.
pub fn tokenize_bytes(bytes: &[u8]) -> Vec<u32> {
    bytes.iter().map(|&b| u32::from(b)).collect()
}
