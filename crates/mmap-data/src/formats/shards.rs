//! [`ShardedWriter`]: one stream of tokens written as numbered shards of a fixed token count,
//! the layout llm.c's `fineweb.py` gives FineWeb (`fineweb_val_000000.bin`,
//! `fineweb_train_000001.bin`, …), which [`crate::open`] reads back as one dataset from a glob
//! or a directory.
//!
//! Why shards: an llm.c header counts tokens in an `i32`, so no single llm.c file holds more
//! than 2³¹ − 1 tokens (FineWeb's 10B sample is five times that); a set of shards also lets a
//! validation split be set aside by name, and a build that dies keeps the shards it finished.
//!
//! Shards are cut at exactly `shard_tokens` tokens, as llm.c cuts them: a document that
//! straddles the cut continues at the start of the next shard. Each shard is its own
//! [`TokenWriter`] file, renamed into place when full, so a crash leaves complete shards (a
//! prefix of the stream) and never a partial one.

use std::fs;
use std::path::{Path, PathBuf};

use crate::formats::megatron::megatron_paths;
use crate::formats::writer::{TokenWriter, WrittenFiles};
use crate::formats::TokenFileFormat;
use crate::{DataError, Result};

/// How a [`ShardedWriter`] cuts its stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Sharding {
    /// Tokens in every shard but the last (llm.c's `--shard_size`, 10⁸ by default there).
    pub shard_tokens: u64,
    /// How many of the first shards are the validation split, named `_val_` (llm.c's
    /// `fineweb.py` sets aside one); the rest are `_train_`. With 0, shards are named by
    /// their index alone.
    pub val_shards: u64,
}

/// The path of shard `index` of the output `out` in `format`: `{stem}_{index:06}{.ext}`, or
/// with validation shards `{stem}_val_{index:06}{.ext}` / `{stem}_train_{index:06}{.ext}`
/// (llm.c's names). A Megatron output's shards are pairs named after its prefix; the path
/// returned is the shard's `.bin`.
///
/// ```
/// use std::path::Path;
/// use headroom_mmap_data::formats::shards::{shard_path, Sharding};
/// use headroom_mmap_data::{LlmcFlavor, TokenFileFormat};
///
/// let sharding = Sharding { shard_tokens: 100_000_000, val_shards: 1 };
/// let llmc = TokenFileFormat::Llmc(LlmcFlavor::Gpt2);
/// let out = Path::new("data/fineweb.bin");
/// assert_eq!(shard_path(out, llmc, &sharding, 0), Path::new("data/fineweb_val_000000.bin"));
/// assert_eq!(shard_path(out, llmc, &sharding, 1), Path::new("data/fineweb_train_000001.bin"));
/// ```
pub fn shard_path(out: &Path, format: TokenFileFormat, sharding: &Sharding, index: u64) -> PathBuf {
    let (stem, ext) = stem_and_extension(out, format);
    let split = match sharding.val_shards {
        0 => "",
        k if index < k => "val_",
        _ => "train_",
    };
    let mut name = format!("{stem}_{split}{index:06}");
    if let Some(ext) = ext {
        name.push('.');
        name.push_str(&ext);
    }
    out.with_file_name(name)
}

/// The name shards are numbered after, and the extension each shard keeps: a Megatron
/// prefix's name and `bin`; else the file's stem and its extension (none for a bare name).
fn stem_and_extension(out: &Path, format: TokenFileFormat) -> (String, Option<String>) {
    let lossy = |p: Option<&std::ffi::OsStr>| p.map(|s| s.to_string_lossy().into_owned());
    match format {
        TokenFileFormat::Megatron { .. } => {
            let bin = megatron_paths(out).1;
            (
                lossy(bin.file_stem()).unwrap_or_default(),
                Some("bin".to_owned()),
            )
        }
        _ => (
            lossy(out.file_stem()).unwrap_or_default(),
            lossy(out.extension()),
        ),
    }
}

/// The index of the shard the file name `name` is, among those [`shard_path`] names for
/// `out` (any index, with or without a split), counting a Megatron shard's `.idx` and a
/// shard's loss mask as the shard; `None` for any other name.
fn shard_index(name: &str, stem: &str, ext: Option<&str>, megatron: bool) -> Option<u64> {
    let name = name
        .strip_suffix(crate::loss_mask::LOSS_MASK_SUFFIX)
        .unwrap_or(name);
    let rest = name.strip_prefix(stem)?.strip_prefix('_')?;
    let rest = rest
        .strip_prefix("val_")
        .or_else(|| rest.strip_prefix("train_"))
        .unwrap_or(rest);
    let digits = rest.bytes().take_while(u8::is_ascii_digit).count();
    if digits < 6 {
        return None;
    }
    let tail = &rest[digits..];
    let ours = match (ext, megatron) {
        (_, true) => tail == ".bin" || tail == ".idx",
        (Some(ext), false) => tail.strip_prefix('.') == Some(ext),
        (None, false) => tail.is_empty(),
    };
    ours.then(|| rest[..digits].parse().ok()).flatten()
}

fn is_shard_name(name: &str, stem: &str, ext: Option<&str>, megatron: bool) -> bool {
    shard_index(name, stem, ext, megatron).is_some()
}

/// A token stream written as one file, or as numbered shards of [`Sharding::shard_tokens`]
/// tokens each (see the module's documentation).
///
/// ```
/// use headroom_mmap_data::formats::{open, shards::{Sharding, ShardedWriter}, TokenFileFormat};
/// use headroom_mmap_data::{LlmcFlavor, OpenOptions};
///
/// # fn main() -> headroom_mmap_data::Result<()> {
/// let dir = tempfile::tempdir().unwrap();
/// let out = dir.path().join("corpus.bin");
/// let sharding = Sharding { shard_tokens: 4, val_shards: 1 };
/// let mut writer =
///     ShardedWriter::create(&out, TokenFileFormat::Llmc(LlmcFlavor::Gpt2), Some(sharding))?;
/// writer.write(&[50256, 1, 2, 3, 4, 5])?; // the first cut falls inside, after 4 tokens
/// writer.end_document()?;
/// writer.write(&[50256, 6, 7])?; // and the second here
/// let written = writer.finish()?;
/// assert_eq!((written.shards.len(), written.tokens, written.cuts_inside_documents), (3, 9, 2));
/// let train = open(dir.path().join("corpus_train_*.bin"), &OpenOptions::default())?;
/// assert_eq!(train.total_tokens(), 5);
/// # Ok(())
/// # }
/// ```
#[derive(Debug)]
pub struct ShardedWriter {
    out: PathBuf,
    format: TokenFileFormat,
    sharding: Option<Sharding>,
    /// The open file: the one output, or the shard being filled (`None` between a full shard
    /// and the next token, so that a stream ending on a cut leaves no empty shard).
    current: Option<TokenWriter>,
    /// Index of the next shard to open.
    next_index: u64,
    /// Tokens in the open shard.
    in_current: u64,
    written: ShardedFiles,
    /// A shard was closed inside a document: if the next token continues it, the cut
    /// counts in `cuts_inside_documents`.
    cut_inside_document: bool,
}

/// What a finished [`ShardedWriter`] wrote.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ShardedFiles {
    /// Every file written with its size in bytes, in order (a Megatron shard's `.bin`, then
    /// its `.idx`).
    pub files: Vec<(PathBuf, u64)>,
    /// The token files (shards, or the one output), in order.
    pub shards: Vec<PathBuf>,
    /// Tokens written.
    pub tokens: u64,
    /// Documents in the Megatron indexes (a split document counts once per shard); `None`
    /// for formats without one.
    pub documents: Option<u64>,
    /// Cuts between two shards that fall inside a document (its tokens continue in the next
    /// shard); a document longer than a shard holds several.
    pub cuts_inside_documents: u64,
    /// Earlier shards of the same name that were removed before writing (with their loss
    /// masks), so that a glob over the new set cannot pick up an old run's tail.
    pub removed: Vec<PathBuf>,
}

impl ShardedWriter {
    /// Start writing `out` in `format`: one file when `sharding` is `None` (created now, as
    /// [`TokenWriter::create`]), else shards named by [`shard_path`], opened as tokens come.
    ///
    /// Sharded, the files of an earlier set with the same names (any index, any split, their
    /// loss masks too) are removed first: a set that a new run only partly overwrote would
    /// read as one dataset mixing two runs. A shard size of 0, or above an llm.c header's
    /// `i32` count, is [`DataError::InvalidConfig`].
    pub fn create(
        out: impl AsRef<Path>,
        format: TokenFileFormat,
        sharding: Option<Sharding>,
    ) -> Result<ShardedWriter> {
        let out = out.as_ref().to_path_buf();
        let mut written = ShardedFiles {
            documents: matches!(format, TokenFileFormat::Megatron { .. }).then_some(0),
            ..ShardedFiles::default()
        };
        let current = match &sharding {
            None => Some(TokenWriter::create(&out, format)?),
            Some(s) => {
                check_sharding(format, s)?;
                written.removed = remove_earlier_shards(&out, format)?;
                None
            }
        };
        Ok(ShardedWriter {
            out,
            format,
            sharding,
            current,
            next_index: 0,
            in_current: 0,
            written,
            cut_inside_document: false,
        })
    }

    /// Continue a sharded set whose first `kept` shards are complete (a build that died, or
    /// stopped, after finishing them): those are kept as they are, the set's later shards
    /// (and their loss masks) are removed, and writing starts at shard `kept`. Every kept
    /// shard must exist ([`DataError::Io`] otherwise); each counts as full. The caller knows
    /// where in its input the kept shards end (see `headroom data build --resume`);
    /// `continues_document` says the first token written continues a document the last kept
    /// shard ends inside, so that the cut counts in [`ShardedFiles::cuts_inside_documents`] as
    /// in the uninterrupted build (pass `false` when the earlier run had already written that
    /// continuation, and counted the cut).
    pub fn resume(
        out: impl AsRef<Path>,
        format: TokenFileFormat,
        sharding: Sharding,
        kept: u64,
        continues_document: bool,
    ) -> Result<ShardedWriter> {
        let out = out.as_ref().to_path_buf();
        check_sharding(format, &sharding)?;
        let mut files = Vec::new();
        let mut shards = Vec::new();
        // A kept shard is full: its size says so, or it was changed since (truncated,
        // replaced) and the set cannot continue from it.
        let header = match format {
            TokenFileFormat::Llmc(_) => crate::formats::llmc::LLMC_HEADER_BYTES as u64,
            _ => 0,
        };
        let full = (format.token_type().width() as u64)
            .checked_mul(sharding.shard_tokens)
            .and_then(|b| b.checked_add(header))
            .ok_or_else(|| DataError::InvalidConfig("shards too large to address".into()))?;
        for index in 0..kept {
            let path = shard_path(&out, format, &sharding, index);
            let bytes = fs::metadata(&path)
                .map_err(|e| DataError::io(&path, e))?
                .len();
            if bytes != full {
                return Err(DataError::corrupt(
                    path.display().to_string(),
                    format!(
                        "a finished shard of {} tokens is {full} bytes, this is {bytes}: it \
                         changed since it was written",
                        sharding.shard_tokens
                    ),
                ));
            }
            files.push((path.clone(), bytes));
            if let TokenFileFormat::Megatron { .. } = format {
                let idx = megatron_paths(&path).0;
                let idx_bytes = fs::metadata(&idx)
                    .map_err(|e| DataError::io(&idx, e))?
                    .len();
                files.push((idx, idx_bytes));
            }
            shards.push(path);
        }
        let removed = remove_shards(&out, format, |index| index >= kept)?;
        let written = ShardedFiles {
            files,
            shards,
            tokens: kept.saturating_mul(sharding.shard_tokens),
            // The kept shards' indexes are not read again: only new shards' documents count.
            documents: matches!(format, TokenFileFormat::Megatron { .. }).then_some(0),
            cuts_inside_documents: 0,
            removed,
        };
        Ok(ShardedWriter {
            out,
            format,
            sharding: Some(sharding),
            current: None,
            next_index: kept,
            in_current: 0,
            written,
            cut_inside_document: continues_document,
        })
    }

    /// The format being written.
    pub fn format(&self) -> TokenFileFormat {
        self.format
    }

    /// Shards finished and in place (kept ones of a resumed set included).
    pub fn shards_finished(&self) -> u64 {
        self.written.shards.len() as u64
    }

    /// Tokens in the shard being filled (0 right after a cut).
    pub fn tokens_in_open_shard(&self) -> u64 {
        self.in_current
    }

    /// Cuts that fell inside a document so far.
    pub fn cuts_inside_documents(&self) -> u64 {
        self.written.cuts_inside_documents
    }

    /// Tokens written so far, over every shard.
    pub fn tokens_written(&self) -> u64 {
        self.written.tokens + self.in_current
    }

    /// Append `tokens`, cutting them across shards where a shard fills. A shard that fills
    /// is finished (synced and renamed into place) at once. Errors as [`TokenWriter::write`]:
    /// nothing of the failing piece is written.
    pub fn write(&mut self, tokens: &[u32]) -> Result<()> {
        let Some(sharding) = self.sharding else {
            let writer = self.current.as_mut().ok_or_else(finished)?;
            writer.write(tokens)?;
            self.in_current += tokens.len() as u64;
            return Ok(());
        };
        let mut rest = tokens;
        while !rest.is_empty() {
            if self.current.is_none() {
                let path = shard_path(&self.out, self.format, &sharding, self.next_index);
                self.current = Some(TokenWriter::create(&path, self.format)?);
                self.next_index += 1;
                self.in_current = 0;
            }
            if std::mem::take(&mut self.cut_inside_document) {
                self.written.cuts_inside_documents += 1;
            }
            let room = sharding.shard_tokens - self.in_current;
            let take = usize::try_from(room).map_or(rest.len(), |r| r.min(rest.len()));
            let (now, later) = rest.split_at(take);
            self.current.as_mut().ok_or_else(finished)?.write(now)?;
            self.in_current += now.len() as u64;
            if self.in_current == sharding.shard_tokens {
                self.finish_current()?;
                self.cut_inside_document = true;
            }
            rest = later;
        }
        Ok(())
    }

    /// End the current document: a Megatron shard's index records it; other formats have no
    /// index, and a document's end is its end-of-text token.
    pub fn end_document(&mut self) -> Result<()> {
        self.cut_inside_document = false;
        match self.current.as_mut() {
            Some(w) => w.end_document(),
            None => Ok(()),
        }
    }

    /// Stop without finishing the open shard (its temporary file is removed): what the
    /// finished shards hold, for a build to be resumed later.
    pub fn abandon(mut self) -> ShardedFiles {
        drop(self.current.take());
        std::mem::take(&mut self.written)
    }

    /// Finish the open file. No tokens at all is [`DataError::Empty`], and nothing is left
    /// behind.
    pub fn finish(mut self) -> Result<ShardedFiles> {
        if self.current.is_some() {
            self.finish_current()?;
        }
        if self.written.shards.is_empty() {
            return Err(DataError::Empty {
                what: self.out.display().to_string(),
            });
        }
        Ok(std::mem::take(&mut self.written))
    }

    fn finish_current(&mut self) -> Result<()> {
        let writer = self.current.take().ok_or_else(finished)?;
        let WrittenFiles {
            files,
            tokens,
            documents,
        } = writer.finish()?;
        if let Some((token_file, _)) = files.first() {
            self.written.shards.push(token_file.clone());
        }
        self.written.files.extend(files);
        self.written.tokens += tokens;
        if let (Some(all), Some(d)) = (self.written.documents.as_mut(), documents) {
            *all += d;
        }
        self.in_current = 0;
        Ok(())
    }
}

/// A shard size of 0, or above an llm.c header's `i32` count, is refused.
fn check_sharding(format: TokenFileFormat, s: &Sharding) -> Result<()> {
    if s.shard_tokens == 0 {
        return Err(DataError::InvalidConfig(
            "a shard must hold at least one token".into(),
        ));
    }
    if matches!(format, TokenFileFormat::Llmc(_)) && s.shard_tokens > i32::MAX as u64 {
        return Err(DataError::InvalidConfig(format!(
            "llm.c shards hold at most {} tokens, asked for {}",
            i32::MAX,
            s.shard_tokens
        )));
    }
    Ok(())
}

fn finished() -> DataError {
    DataError::InvalidConfig("writer already finished".into())
}

/// True when `path` is one of the files [`ShardedWriter::create`] would remove for `out`: in
/// `out`'s directory and named as one of its shards (any index, any split) or a shard's loss
/// mask. A caller reading inputs checks them with this before creating the writer.
pub fn is_shard_of(out: &Path, format: TokenFileFormat, path: &Path) -> bool {
    let (stem, ext) = stem_and_extension(out, format);
    let megatron = matches!(format, TokenFileFormat::Megatron { .. });
    let named = path
        .file_name()
        .and_then(|n| n.to_str())
        .is_some_and(|n| is_shard_name(n, &stem, ext.as_deref(), megatron));
    named && same_directory(out, path)
}

/// Whether `a` and `b` name files of one directory.
fn same_directory(a: &Path, b: &Path) -> bool {
    let dir = |p: &Path| match p.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let (da, db) = (dir(a), dir(b));
    match (fs::canonicalize(&da), fs::canonicalize(&db)) {
        (Ok(x), Ok(y)) => x == y,
        _ => da == db,
    }
}

/// Remove every file in `out`'s directory named as one of its shards (or a shard's loss
/// mask); returns them.
fn remove_earlier_shards(out: &Path, format: TokenFileFormat) -> Result<Vec<PathBuf>> {
    remove_shards(out, format, |_| true)
}

/// Remove the files of `out`'s shards whose index `remove` picks; returns them, sorted.
fn remove_shards(
    out: &Path,
    format: TokenFileFormat,
    remove: impl Fn(u64) -> bool,
) -> Result<Vec<PathBuf>> {
    let dir = match out.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    let (stem, ext) = stem_and_extension(out, format);
    let megatron = matches!(format, TokenFileFormat::Megatron { .. });
    let entries = match fs::read_dir(dir) {
        Ok(entries) => entries,
        // No directory yet: nothing to remove, and the first shard's create says why.
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(DataError::io(dir, e)),
    };
    let mut removed = Vec::new();
    for entry in entries {
        let entry = entry.map_err(|e| DataError::io(dir, e))?;
        let name = entry.file_name();
        let Some(name) = name.to_str() else { continue };
        let is_file = entry.file_type().map(|t| t.is_file()).unwrap_or(false);
        let index = shard_index(name, &stem, ext.as_deref(), megatron);
        if is_file && index.is_some_and(&remove) {
            let path = entry.path();
            fs::remove_file(&path).map_err(|e| DataError::io(&path, e))?;
            removed.push(path);
        }
    }
    removed.sort();
    Ok(removed)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tokens::TokenType;

    #[test]
    fn shard_names_are_recognised_and_nothing_else() {
        let raw = |n: &str| is_shard_name(n, "fineweb", Some("bin"), false);
        assert!(raw("fineweb_000000.bin"));
        assert!(raw("fineweb_val_000000.bin"));
        assert!(raw("fineweb_train_1234567.bin"));
        assert!(raw("fineweb_train_000001.bin.lossmask"));
        assert!(!raw("fineweb.bin"));
        assert!(!raw("fineweb_train_00001.bin"));
        assert!(!raw("fineweb_train_000001.idx"));
        assert!(!raw("fineweb_edu_000001.bin"));
        assert!(!raw("fineweb2_000001.bin"));
        assert!(!raw("fineweb_000001.bin.tmp"));
        assert!(is_shard_name("c_000002", "c", None, false));
        assert!(!is_shard_name("c_000002.bin", "c", None, false));
        let meg = |n: &str| is_shard_name(n, "c", Some("bin"), true);
        assert!(meg("c_000002.idx") && meg("c_000002.bin") && !meg("c_000002.txt"));
    }

    #[test]
    fn megatron_shards_are_pairs_named_after_the_prefix() {
        let format = TokenFileFormat::Megatron {
            token_type: TokenType::U16,
            document_len: 1 << 30,
        };
        let s = Sharding {
            shard_tokens: 10,
            val_shards: 0,
        };
        for out in ["d/corpus", "d/corpus.bin", "d/corpus.idx"] {
            assert_eq!(
                shard_path(Path::new(out), format, &s, 3),
                Path::new("d/corpus_000003.bin")
            );
        }
    }
}
