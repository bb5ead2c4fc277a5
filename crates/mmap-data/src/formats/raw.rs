//! Raw little-endian token files (nanoGPT's `train.bin`): no header, just tokens.

use std::path::Path;

use crate::dataset::{map_file, Segment, TokenDataset};
use crate::formats::writer::TokenWriter;
use crate::formats::TokenFileFormat;
use crate::tokens::TokenType;
use crate::{DataError, Result};

/// Check that `byte_len` bytes of a raw file hold whole tokens; return the token count.
pub fn raw_token_count(byte_len: u64, token_type: TokenType, what: &str) -> Result<u64> {
    if byte_len == 0 {
        return Err(DataError::Empty { what: what.into() });
    }
    let width = token_type.width();
    if !byte_len.is_multiple_of(width as u64) {
        return Err(DataError::OddLength {
            what: what.into(),
            bytes: byte_len,
            width,
        });
    }
    Ok(byte_len / width as u64)
}

pub(crate) fn raw_segment(path: &Path, token_type: TokenType) -> Result<Segment> {
    let what = path.display().to_string();
    let backing = map_file(path)?;
    let count = raw_token_count(backing.bytes().len() as u64, token_type, &what)?;
    Segment::new(backing, 0, count as usize, token_type, &what)
}

/// Open a raw token file of `token_type` (nanoGPT writes `u16`).
pub fn open_raw(path: impl AsRef<Path>, token_type: TokenType) -> Result<TokenDataset> {
    TokenDataset::from_segments(vec![raw_segment(path.as_ref(), token_type)?], None)
}

/// Write `tokens` as a raw file of `token_type`, atomically (see [`TokenWriter`]); fails
/// (writing nothing) if a token does not fit the type or there are no tokens.
pub fn write_raw(path: impl AsRef<Path>, tokens: &[u32], token_type: TokenType) -> Result<()> {
    let mut writer = TokenWriter::create(path, TokenFileFormat::Raw(token_type))?;
    writer.write(tokens)?;
    writer.finish().map(drop)
}
