//! llm.c token shards: a 256 × i32 little-endian header (magic, version, token count), then
//! the tokens.
//!
//! llm.c's `dev/data/data_common.py` writes two flavours: GPT-2 (magic 20240520, version 1,
//! `u16` tokens) and Llama 3 (magic 20240801, version 7, `u32` tokens). Both are read and
//! written here.

use std::path::Path;

use crate::dataset::{map_file, Segment, TokenDataset};
use crate::formats::writer::TokenWriter;
use crate::formats::TokenFileFormat;
use crate::tokens::TokenType;
use crate::{DataError, Result};

/// Header size in bytes: 256 little-endian `i32`.
pub const LLMC_HEADER_BYTES: usize = 256 * 4;
/// Magic number of GPT-2 (`u16`) shards.
pub const LLMC_MAGIC_GPT2: i32 = 20240520;
/// Magic number of Llama 3 (`u32`) shards.
pub const LLMC_MAGIC_LLAMA3: i32 = 20240801;

/// Which llm.c shard flavour to write.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum LlmcFlavor {
    /// Magic 20240520, version 1, `u16` tokens.
    Gpt2,
    /// Magic 20240801, version 7, `u32` tokens.
    Llama3,
}

impl LlmcFlavor {
    /// The token type of this flavour (`u16` for GPT-2, `u32` for Llama 3).
    pub fn token_type(self) -> TokenType {
        self.magic_version_type().2
    }

    /// Magic number and version of this flavour's header.
    pub(crate) fn magic_version(self) -> (i32, i32) {
        let (m, v, _) = self.magic_version_type();
        (m, v)
    }

    fn magic_version_type(self) -> (i32, i32, TokenType) {
        match self {
            LlmcFlavor::Gpt2 => (LLMC_MAGIC_GPT2, 1, TokenType::U16),
            LlmcFlavor::Llama3 => (LLMC_MAGIC_LLAMA3, 7, TokenType::U32),
        }
    }
}

/// A parsed and validated llm.c header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LlmcHeader {
    /// The flavour, from magic and version.
    pub flavor: LlmcFlavor,
    /// Number of tokens after the header.
    pub num_tokens: u64,
}

impl LlmcHeader {
    /// Storage type of the tokens.
    pub fn token_type(&self) -> TokenType {
        self.flavor.magic_version_type().2
    }
}

fn header_word(bytes: &[u8], i: usize) -> Option<i32> {
    let b = bytes.get(i * 4..i * 4 + 4)?;
    Some(i32::from_le_bytes([b[0], b[1], b[2], b[3]]))
}

/// True when `bytes` starts with an llm.c magic number.
pub fn looks_like_llmc(bytes: &[u8]) -> bool {
    matches!(
        header_word(bytes, 0),
        Some(LLMC_MAGIC_GPT2 | LLMC_MAGIC_LLAMA3)
    )
}

/// Parse and validate a whole shard held in `bytes`: header, version, count, exact length.
pub fn parse_llmc(bytes: &[u8], what: &str) -> Result<LlmcHeader> {
    if bytes.is_empty() {
        return Err(DataError::Empty { what: what.into() });
    }
    let magic = header_word(bytes, 0)
        .ok_or_else(|| DataError::truncated(what, LLMC_HEADER_BYTES as u64, bytes.len() as u64))?;
    let flavor = match magic {
        LLMC_MAGIC_GPT2 => LlmcFlavor::Gpt2,
        LLMC_MAGIC_LLAMA3 => LlmcFlavor::Llama3,
        other => {
            return Err(DataError::BadMagic {
                what: what.into(),
                found: other.to_string(),
                expected: format!("{LLMC_MAGIC_GPT2} or {LLMC_MAGIC_LLAMA3}"),
            })
        }
    };
    if bytes.len() < LLMC_HEADER_BYTES {
        return Err(DataError::truncated(
            what,
            LLMC_HEADER_BYTES as u64,
            bytes.len() as u64,
        ));
    }
    let version = header_word(bytes, 1).unwrap_or(-1);
    let (_, expected_version, token_type) = flavor.magic_version_type();
    if version != expected_version {
        return Err(DataError::UnsupportedVersion {
            what: what.into(),
            found: version as u64,
        });
    }
    let count = header_word(bytes, 2).unwrap_or(-1);
    if count < 0 {
        return Err(DataError::corrupt(
            what,
            format!("negative token count {count}"),
        ));
    }
    if count == 0 {
        return Err(DataError::Empty { what: what.into() });
    }
    let num_tokens = count as u64;
    let needed = LLMC_HEADER_BYTES as u64 + num_tokens * token_type.width() as u64;
    let have = bytes.len() as u64;
    if have < needed {
        return Err(DataError::truncated(what, needed, have));
    }
    if have > needed {
        return Err(DataError::corrupt(
            what,
            format!(
                "{} bytes after the {num_tokens} tokens the header announces",
                have - needed
            ),
        ));
    }
    Ok(LlmcHeader { flavor, num_tokens })
}

pub(crate) fn llmc_segment(path: &Path) -> Result<Segment> {
    let what = path.display().to_string();
    let backing = map_file(path)?;
    let header = parse_llmc(backing.bytes(), &what)?;
    Segment::new(
        backing,
        LLMC_HEADER_BYTES,
        header.num_tokens as usize,
        header.token_type(),
        &what,
    )
}

/// Open one llm.c shard.
pub fn open_llmc(path: impl AsRef<Path>) -> Result<TokenDataset> {
    TokenDataset::from_segments(vec![llmc_segment(path.as_ref())?], None)
}

/// Write `tokens` as an llm.c shard of `flavor`, atomically (see [`TokenWriter`]).
pub fn write_llmc(path: impl AsRef<Path>, tokens: &[u32], flavor: LlmcFlavor) -> Result<()> {
    let mut writer = TokenWriter::create(path, TokenFileFormat::Llmc(flavor))?;
    writer.write(tokens)?;
    writer.finish().map(drop)
}
