//! File formats: raw token files, llm.c shards, Megatron indexed datasets, and sets of shards
//! (a directory or a glob) opened as one dataset. Readers and writers for each.

pub mod llmc;
pub mod megatron;
pub mod raw;
pub mod shards;
pub mod writer;

use std::fs;
use std::path::{Path, PathBuf};

use crate::dataset::{Segment, TokenDataset};
use crate::tokens::TokenType;
use crate::{DataError, Result};

/// How [`open`] treats files that are neither llm.c shards nor Megatron indexes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OpenOptions {
    /// Token type of headerless raw files (nanoGPT: `u16`).
    pub raw_token_type: TokenType,
}

impl Default for OpenOptions {
    fn default() -> Self {
        OpenOptions {
            raw_token_type: TokenType::U16,
        }
    }
}

/// Open `path` as one dataset, whatever it is:
///
/// - a glob (`data/shard_*.bin`: `*` and `?` in the file name) or a directory: every matching
///   regular file in name order, each as its own segment (hidden files are skipped; in a
///   directory, a `.idx`/`.bin` pair is one Megatron dataset);
/// - a Megatron prefix, `.idx` or `.bin` with its `.idx` beside it;
/// - a file starting with an llm.c magic number: an llm.c shard;
/// - any other file: raw tokens of `options.raw_token_type`.
///
/// A loss mask beside a token file (`<file>.lossmask`, see [`crate::loss_mask`]) is attached
/// to its segment; in a set of shards, either every shard has one or none may (a missing mask
/// would silently train one shard on its prompts).
pub fn open(path: impl AsRef<Path>, options: &OpenOptions) -> Result<TokenDataset> {
    let path = path.as_ref();
    let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
    if name.contains(['*', '?']) {
        let dir = path
            .parent()
            .filter(|p| !p.as_os_str().is_empty())
            .unwrap_or(Path::new("."));
        let mut files: Vec<PathBuf> = list_files(dir)?
            .into_iter()
            .filter(|p| {
                p.file_name()
                    .and_then(|n| n.to_str())
                    .is_some_and(|n| glob_match(name, n))
            })
            .collect();
        files.sort();
        return open_shards(&files, options, &path.display().to_string());
    }
    if path.is_dir() {
        let mut files = list_files(path)?;
        files.retain(|p| {
            !p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with('.'))
        });
        files.sort();
        return open_shards(&files, options, &path.display().to_string());
    }
    if is_megatron_path(path) {
        return open_megatron_masked(path);
    }
    let segment = open_file_segment(path, options)?;
    TokenDataset::from_segments(vec![segment], None)
}

/// `segment` of the token file `file`, with the loss mask beside the file when there is one.
fn attach_loss_mask(segment: Segment, file: &Path) -> Result<Segment> {
    let mask = crate::loss_mask::loss_mask_path(file);
    if mask.is_file() {
        segment.with_loss_mask(crate::LossMask::open(&mask)?)
    } else {
        Ok(segment)
    }
}

/// A Megatron pair, its `.bin`'s loss mask attached.
fn open_megatron_masked(path: &Path) -> Result<TokenDataset> {
    let bin = megatron::megatron_paths(path).1;
    megatron::open_megatron(path)?.map_segments(|s| attach_loss_mask(s, &bin))
}

/// True when [`open`] reads `path` as a Megatron dataset: a `.idx` path, or a `.bin` path or
/// a prefix (that is not itself a file) with a `.idx` beside it.
pub fn is_megatron_path(path: &Path) -> bool {
    let (idx, _) = megatron::megatron_paths(path);
    let ext = path.extension().and_then(|e| e.to_str());
    matches!(ext, Some("idx")) || (idx.is_file() && (matches!(ext, Some("bin")) || !path.exists()))
}

fn open_file_segment(path: &Path, options: &OpenOptions) -> Result<Segment> {
    let mut head = [0u8; 4];
    let n = fs::File::open(path)
        .and_then(|mut f| std::io::Read::read(&mut f, &mut head))
        .map_err(|e| DataError::io(path, e))?;
    let segment = if n == 4 && llmc::looks_like_llmc(&head) {
        llmc::llmc_segment(path)?
    } else {
        raw::raw_segment(path, options.raw_token_type)?
    };
    attach_loss_mask(segment, path)
}

/// Open `files` (in the given order) as one dataset, one segment per shard. A `.idx` file
/// opens its Megatron pair (its `.bin` is then not read again as a raw shard); documents are
/// kept only when every shard has them.
pub fn open_shards(files: &[PathBuf], options: &OpenOptions, what: &str) -> Result<TokenDataset> {
    // A set: a directory of many pairs must not cost (files × pairs) path comparisons.
    let megatron_bins: std::collections::HashSet<PathBuf> = files
        .iter()
        .filter(|p| p.extension().is_some_and(|e| e == "idx"))
        .map(|p| megatron::megatron_paths(p).1)
        .collect();
    // Each pair or file as a dataset of its own, then one after another: a Megatron pair
    // keeps its documents (renumbered) while every file has an index, as `concat` does.
    let mut parts = Vec::new();
    for file in files {
        if megatron_bins.contains(file) {
            continue;
        }
        if file.extension().is_some_and(|e| e == "idx") {
            parts.push(open_megatron_masked(file)?);
        } else {
            parts.push(TokenDataset::from_segments(
                vec![open_file_segment(file, options)?],
                None,
            )?);
        }
    }
    if parts.is_empty() {
        return Err(DataError::Empty { what: what.into() });
    }
    let dataset = TokenDataset::concat(parts)?;
    let segments = dataset.segments();
    let masked = segments.iter().filter(|s| s.loss_mask().is_some()).count();
    if masked > 0 && masked < segments.len() {
        let bare = segments
            .iter()
            .find(|s| s.loss_mask().is_none())
            .map_or("a shard", |s| s.name());
        return Err(DataError::InvalidConfig(format!(
            "{what}: {masked} of {} shards have a loss mask but {bare} has none: give every \
             shard its mask, or none",
            segments.len()
        )));
    }
    Ok(dataset)
}

fn list_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let entries = fs::read_dir(dir).map_err(|e| DataError::io(dir, e))?;
    let mut files = Vec::new();
    for entry in entries {
        let entry = entry.map_err(|e| DataError::io(dir, e))?;
        let path = entry.path();
        // A loss mask belongs to the token file it is named after, never a shard of its own.
        if path.is_file() && !crate::loss_mask::is_loss_mask_path(&path) {
            files.push(path);
        }
    }
    Ok(files)
}

/// Shell-style match of a file name: `*` is any run of characters, `?` any one character.
pub fn glob_match(pattern: &str, name: &str) -> bool {
    let p: Vec<char> = pattern.chars().collect();
    let n: Vec<char> = name.chars().collect();
    let (mut pi, mut ni) = (0, 0);
    // Where the last `*` was and which name position it is currently standing for.
    let mut star: Option<(usize, usize)> = None;
    while ni < n.len() {
        match p.get(pi) {
            Some('*') => {
                star = Some((pi, ni));
                pi += 1;
            }
            Some(&c) if c == '?' || c == n[ni] => {
                pi += 1;
                ni += 1;
            }
            _ => match star {
                Some((sp, sn)) => {
                    pi = sp + 1;
                    ni = sn + 1;
                    star = Some((sp, sn + 1));
                }
                None => return false,
            },
        }
    }
    p[pi..].iter().all(|&c| c == '*')
}

/// A file format to write tokens in.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum TokenFileFormat {
    /// A raw little-endian token file.
    Raw(TokenType),
    /// An llm.c shard.
    Llmc(llmc::LlmcFlavor),
    /// A Megatron `.idx` + `.bin` pair (the path is the prefix); the tokens are cut into
    /// documents of `document_len` tokens (the last may be shorter).
    Megatron {
        /// Storage type of the `.bin`.
        token_type: TokenType,
        /// Tokens per document.
        document_len: usize,
    },
}

impl TokenFileFormat {
    /// The on-disk token type.
    pub fn token_type(&self) -> TokenType {
        match *self {
            TokenFileFormat::Raw(t) => t,
            TokenFileFormat::Llmc(f) => f.token_type(),
            TokenFileFormat::Megatron { token_type, .. } => token_type,
        }
    }
}

impl std::fmt::Display for TokenFileFormat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match *self {
            TokenFileFormat::Raw(t) => write!(f, "raw {} (nanoGPT .bin)", t.name()),
            TokenFileFormat::Llmc(llmc::LlmcFlavor::Gpt2) => f.write_str("llm.c GPT-2 shard (u16)"),
            TokenFileFormat::Llmc(llmc::LlmcFlavor::Llama3) => {
                f.write_str("llm.c Llama-3 shard (u32)")
            }
            TokenFileFormat::Megatron {
                token_type,
                document_len,
            } => write!(
                f,
                "Megatron .idx/.bin {} (documents of at most {document_len} tokens)",
                token_type.name()
            ),
        }
    }
}

/// The file holding the tokens a writer of `format` makes at `path`: `path` itself, or a
/// Megatron pair's `.bin` (where a loss mask sits beside the tokens).
pub fn token_file_path(path: &Path, format: TokenFileFormat) -> PathBuf {
    match format {
        TokenFileFormat::Megatron { .. } => megatron::megatron_paths(path).1,
        _ => path.to_path_buf(),
    }
}

/// Write `tokens` to `path` in `format`, atomically (see [`writer::TokenWriter`], which
/// also streams when the tokens do not fit in memory at once).
pub fn write_tokens(path: impl AsRef<Path>, tokens: &[u32], format: TokenFileFormat) -> Result<()> {
    let mut writer = writer::TokenWriter::create(path, format)?;
    writer.write(tokens)?;
    writer.finish().map(drop)
}

#[cfg(test)]
mod tests {
    use super::glob_match;

    #[test]
    fn glob_matches_like_a_shell() {
        assert!(glob_match("shard_*.bin", "shard_000.bin"));
        assert!(glob_match("shard_*.bin", "shard_.bin"));
        assert!(!glob_match("shard_*.bin", "shard_000.idx"));
        assert!(glob_match("a?c", "abc"));
        assert!(!glob_match("a?c", "ac"));
        assert!(glob_match("*a*b*", "xxaxxbxx"));
        assert!(!glob_match("*a*b", "xxbxxa"));
        assert!(glob_match("*", ""));
    }
}
