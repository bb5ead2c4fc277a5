//! [`TokenWriter`]: the one writer behind every format — tokens are streamed in chunks to a
//! temporary file beside the target, which is fsynced and renamed into place only when the
//! whole file is written.
//!
//! Streaming keeps memory bounded whatever the token count (the synthetic and text tools write
//! files far larger than they could hold), and the rename means a reader never sees a
//! half-written file and a failed or abandoned write leaves any previous file intact. A write
//! that dies with its process (a kill, Ctrl-C) cannot remove its temporary file; the next
//! write of the same file does.

use std::fs::{self, File};
use std::io::{BufWriter, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use crate::formats::llmc::LLMC_HEADER_BYTES;
use crate::formats::megatron::{megatron_dtype_code, megatron_paths, FIXED_HEADER};
use crate::formats::megatron::{MEGATRON_MAGIC, MEGATRON_VERSION};
use crate::formats::TokenFileFormat;
use crate::tokens::TokenType;
use crate::{DataError, Result};

/// Largest token count an llm.c header (an `i32`) and a Megatron sequence length (an `i32`)
/// can record.
const I32_MAX_TOKENS: u64 = i32::MAX as u64;

/// Files written by a finished [`TokenWriter`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WrittenFiles {
    /// Every file written with its size in bytes (Megatron: the `.bin`, then the `.idx`).
    pub files: Vec<(PathBuf, u64)>,
    /// Tokens written.
    pub tokens: u64,
    /// Documents in the file's index (Megatron); `None` for formats without one.
    pub documents: Option<u64>,
}

impl WrittenFiles {
    /// Total bytes over all files.
    pub fn total_bytes(&self) -> u64 {
        self.files.iter().map(|(_, n)| n).sum()
    }
}

/// A streaming, atomic writer of one token file (or Megatron pair) in any
/// [`TokenFileFormat`].
///
/// ```
/// use headroom_mmap_data::formats::{open, writer::TokenWriter, OpenOptions, TokenFileFormat};
/// use headroom_mmap_data::TokenType;
///
/// # fn main() -> headroom_mmap_data::Result<()> {
/// let dir = tempfile::tempdir().unwrap();
/// let path = dir.path().join("tokens.bin");
/// let mut writer = TokenWriter::create(&path, TokenFileFormat::Raw(TokenType::U16))?;
/// writer.write(&[1, 2, 3])?;
/// writer.write(&[4])?;
/// assert!(!path.exists()); // nothing is visible until `finish`
/// let written = writer.finish()?;
/// assert_eq!((written.tokens, written.total_bytes()), (4, 8));
/// assert_eq!(open(&path, &OpenOptions::default())?.total_tokens(), 4);
/// # Ok(())
/// # }
/// ```
///
/// Megatron output: tokens accumulate in the current document; a document is closed by
/// [`TokenWriter::end_document`], by reaching the format's `document_len`, or by `finish`.
/// Each document is one sequence. Both files are written and synced under temporary names,
/// then the `.bin` and the `.idx` are renamed one right after the other: two renames cannot be
/// one atomic step, so a crash between them leaves a new `.bin` beside the old `.idx`, which
/// the parser refuses unless the sizes happen to agree (they must cover the `.bin` exactly).
#[derive(Debug)]
pub struct TokenWriter {
    format: TokenFileFormat,
    token_type: TokenType,
    target: PathBuf,
    temp: PathBuf,
    file: Option<BufWriter<File>>,
    scratch: Vec<u8>,
    tokens: u64,
    /// Megatron only: the `.idx` path, closed document lengths, the open document's length
    /// and the cut length.
    index_target: Option<PathBuf>,
    document_lengths: Vec<u32>,
    open_document: u64,
    document_limit: u64,
}

impl TokenWriter {
    /// Start writing `path` (a Megatron prefix, or its `.bin`/`.idx` path) in `format`.
    ///
    /// The format is checked first (a Megatron token type needs a dtype code, `document_len`
    /// must be positive); then a temporary file is created in the target's directory.
    pub fn create(path: impl AsRef<Path>, format: TokenFileFormat) -> Result<Self> {
        let path = path.as_ref();
        let (token_type, target, index_target, document_limit) = match format {
            TokenFileFormat::Raw(t) => (t, path.to_path_buf(), None, u64::MAX),
            TokenFileFormat::Llmc(f) => (f.token_type(), path.to_path_buf(), None, u64::MAX),
            TokenFileFormat::Megatron {
                token_type,
                document_len,
            } => {
                if megatron_dtype_code(token_type).is_none() {
                    return Err(DataError::InvalidConfig(format!(
                        "Megatron has no dtype code for {}",
                        token_type.name()
                    )));
                }
                if document_len == 0 {
                    return Err(DataError::InvalidConfig(
                        "document_len must be at least 1".into(),
                    ));
                }
                let (idx, bin) = megatron_paths(path);
                (token_type, bin, Some(idx), document_len as u64)
            }
        };
        remove_abandoned_temps(&target);
        if let Some(idx) = &index_target {
            remove_abandoned_temps(idx);
        }
        let temp = temp_path_for(&target);
        // Errors name the file being written; the temporary name means nothing to a user, and
        // the file is removed on any error.
        let file = File::create(&temp).map_err(|e| DataError::io(&target, e))?;
        let mut writer = TokenWriter {
            format,
            token_type,
            target,
            temp,
            file: Some(BufWriter::with_capacity(1 << 20, file)),
            scratch: Vec::new(),
            tokens: 0,
            index_target,
            document_lengths: Vec::new(),
            open_document: 0,
            document_limit,
        };
        if matches!(format, TokenFileFormat::Llmc(_)) {
            // Placeholder: the token count is patched in by `finish`.
            writer.put(&[0u8; LLMC_HEADER_BYTES])?;
        }
        Ok(writer)
    }

    /// The on-disk token type.
    pub fn token_type(&self) -> TokenType {
        self.token_type
    }

    /// The format being written.
    pub fn format(&self) -> TokenFileFormat {
        self.format
    }

    /// Tokens written so far.
    pub fn tokens_written(&self) -> u64 {
        self.tokens
    }

    /// Append `tokens`. A token that does not fit the token type is
    /// [`DataError::TokenTooWide`] (its index counts from the start of the file), more tokens
    /// than an llm.c header can count is [`DataError::InvalidConfig`]; either way nothing of
    /// this call is written.
    pub fn write(&mut self, tokens: &[u32]) -> Result<()> {
        let max = self.token_type.max_token();
        if let Some(i) = tokens.iter().position(|&t| u64::from(t) > max) {
            return Err(DataError::TokenTooWide {
                index: usize::try_from(self.tokens).unwrap_or(usize::MAX) + i,
                value: u64::from(tokens[i]),
                width: self.token_type.name(),
            });
        }
        let limited = matches!(self.format, TokenFileFormat::Llmc(_));
        if limited && self.tokens + tokens.len() as u64 > I32_MAX_TOKENS {
            return Err(DataError::InvalidConfig(format!(
                "llm.c shards hold at most {} tokens, got {}",
                i32::MAX,
                self.tokens + tokens.len() as u64
            )));
        }
        let mut rest = tokens;
        while !rest.is_empty() {
            let room = self.document_limit - self.open_document;
            let take = usize::try_from(room).map_or(rest.len(), |r| r.min(rest.len()));
            let (now, later) = rest.split_at(take);
            self.write_unsplit(now)?;
            self.open_document += now.len() as u64;
            if self.open_document == self.document_limit {
                self.close_document(false)?;
            }
            rest = later;
        }
        Ok(())
    }

    /// Encode and write tokens already checked by `write`.
    fn write_unsplit(&mut self, tokens: &[u32]) -> Result<()> {
        let mut scratch = std::mem::take(&mut self.scratch);
        scratch.clear();
        scratch.reserve(tokens.len() * self.token_type.width());
        for (i, &t) in tokens.iter().enumerate() {
            if let Err(value) = self.token_type.encode(t, &mut scratch) {
                self.scratch = scratch;
                return Err(DataError::TokenTooWide {
                    index: usize::try_from(self.tokens).unwrap_or(usize::MAX) + i,
                    value,
                    width: self.token_type.name(),
                });
            }
        }
        let result = self.put(&scratch);
        self.scratch = scratch;
        result?;
        self.tokens += tokens.len() as u64;
        Ok(())
    }

    /// End the current document (Megatron; a no-op for formats without a document index).
    /// A document with no tokens is not recorded.
    pub fn end_document(&mut self) -> Result<()> {
        self.close_document(false)
    }

    /// Close the open Megatron document; `keep_empty` records it even with no tokens (what
    /// [`crate::formats::megatron::write_megatron`] does for an empty input document).
    pub(crate) fn close_document(&mut self, keep_empty: bool) -> Result<()> {
        if self.index_target.is_none() || (self.open_document == 0 && !keep_empty) {
            return Ok(());
        }
        let len = u32::try_from(self.open_document)
            .ok()
            .filter(|&n| u64::from(n) <= I32_MAX_TOKENS)
            .ok_or_else(|| {
                DataError::InvalidConfig(format!(
                    "a sequence of {} tokens exceeds i32",
                    self.open_document
                ))
            })?;
        self.document_lengths.push(len);
        self.open_document = 0;
        Ok(())
    }

    fn put(&mut self, bytes: &[u8]) -> Result<()> {
        let Some(file) = self.file.as_mut() else {
            return Err(DataError::InvalidConfig("writer already finished".into()));
        };
        file.write_all(bytes)
            .map_err(|e| DataError::io(&self.target, e))
    }

    /// Complete the file: patch the header (llm.c), flush, fsync, rename into place, then write
    /// the index (Megatron). No tokens at all is [`DataError::Empty`] (no reader accepts an
    /// empty token file) and nothing is written.
    pub fn finish(mut self) -> Result<WrittenFiles> {
        self.close_document(false)?;
        if self.tokens == 0 {
            return Err(DataError::Empty {
                what: self.target.display().to_string(),
            });
        }
        let index = match &self.index_target {
            Some(path) => Some((
                path.clone(),
                megatron_index_bytes(self.token_type, &self.document_lengths)?,
            )),
            None => None,
        };
        let Some(writer) = self.file.take() else {
            return Err(DataError::InvalidConfig("writer already finished".into()));
        };
        let result = self.complete(writer, index);
        if result.is_err() {
            let _ = fs::remove_file(&self.temp);
        }
        result
    }

    /// Patch, sync and rename; the index (if any) is written and synced before the `.bin` is
    /// renamed, so the two renames follow each other with nothing in between.
    fn complete(
        &self,
        writer: BufWriter<File>,
        index: Option<(PathBuf, Vec<u8>)>,
    ) -> Result<WrittenFiles> {
        let io = |e| DataError::io(&self.target, e);
        let mut file = writer.into_inner().map_err(|e| io(e.into_error()))?;
        if let TokenFileFormat::Llmc(flavor) = self.format {
            let mut header = [0u8; 12];
            let (magic, version) = flavor.magic_version();
            // `write` keeps the count within i32.
            let count = i32::try_from(self.tokens).unwrap_or(i32::MAX);
            for (i, v) in [magic, version, count].into_iter().enumerate() {
                header[i * 4..i * 4 + 4].copy_from_slice(&v.to_le_bytes());
            }
            file.seek(SeekFrom::Start(0)).map_err(io)?;
            file.write_all(&header).map_err(io)?;
        }
        file.sync_all().map_err(io)?;
        let bytes = file.metadata().map_err(io)?.len();
        drop(file);
        let mut files = vec![(self.target.clone(), bytes)];
        let index_temp = match &index {
            Some((path, idx)) => Some(write_synced_temp(path, &[idx])?),
            None => None,
        };
        let renamed = fs::rename(&self.temp, &self.target)
            .map_err(|e| DataError::io(&self.target, e))
            .and_then(|()| match (&index, &index_temp) {
                (Some((path, _)), Some(temp)) => {
                    fs::rename(temp, path).map_err(|e| DataError::io(path, e))
                }
                _ => Ok(()),
            });
        if let Err(e) = renamed {
            if let Some(temp) = &index_temp {
                let _ = fs::remove_file(temp);
            }
            return Err(e);
        }
        sync_parent_dir(&self.target);
        let documents = index.map(|(path, idx)| {
            files.push((path, idx.len() as u64));
            self.document_lengths.len() as u64
        });
        Ok(WrittenFiles {
            files,
            tokens: self.tokens,
            documents,
        })
    }
}

impl Drop for TokenWriter {
    fn drop(&mut self) {
        // Unfinished (an error, or the caller gave up): remove the partial temporary file.
        if self.file.take().is_some() {
            let _ = fs::remove_file(&self.temp);
        }
    }
}

/// The `.idx` of documents with `lengths` tokens each, one sequence per document, stored back
/// to back in the `.bin`.
fn megatron_index_bytes(token_type: TokenType, lengths: &[u32]) -> Result<Vec<u8>> {
    let code = megatron_dtype_code(token_type).ok_or_else(|| {
        DataError::InvalidConfig(format!(
            "Megatron has no dtype code for {}",
            token_type.name()
        ))
    })?;
    let n = lengths.len() as u64;
    let mut idx = Vec::with_capacity(FIXED_HEADER + lengths.len() * 20 + 8);
    idx.extend_from_slice(MEGATRON_MAGIC);
    idx.extend_from_slice(&MEGATRON_VERSION.to_le_bytes());
    idx.push(code);
    idx.extend_from_slice(&n.to_le_bytes());
    idx.extend_from_slice(&(n + 1).to_le_bytes());
    for &len in lengths {
        // `close_document` keeps every length within i32.
        idx.extend_from_slice(&(len as i32).to_le_bytes());
    }
    let mut pointer = 0i64;
    for &len in lengths {
        idx.extend_from_slice(&pointer.to_le_bytes());
        pointer += i64::from(len) * token_type.width() as i64;
    }
    for i in 0..=n {
        idx.extend_from_slice(&(i as i64).to_le_bytes());
    }
    Ok(idx)
}

/// Refuse to write a file of at least `bytes` at `path` when its file system has less free
/// space than that ([`DataError::NoSpace`]): a writer that streams would otherwise run until
/// the disk is full, and only then fail (removing its file, but having starved everything
/// else writing there). `bytes` should be a lower bound of what will be written, so that the
/// check never refuses a file that fits. Where the free space cannot be learnt (no such
/// directory yet, a platform without `statvfs`) nothing is refused here: the write reports
/// the real error.
pub fn check_room(path: &Path, bytes: u64) -> Result<()> {
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    match free_space(dir) {
        Some(available) if available < bytes => Err(DataError::NoSpace {
            path: path.to_path_buf(),
            needed: bytes,
            available,
        }),
        _ => Ok(()),
    }
}

/// Bytes an unprivileged writer may still use on the file system holding `dir` (`df`'s
/// "Avail"), if the platform says (`statvfs`; `None` elsewhere, or for a path that does not
/// exist).
#[cfg(unix)]
pub fn free_space(dir: &Path) -> Option<u64> {
    use std::os::unix::ffi::OsStrExt;
    let c_path = std::ffi::CString::new(dir.as_os_str().as_bytes()).ok()?;
    let mut stat = std::mem::MaybeUninit::<libc::statvfs>::uninit();
    // SAFETY: `c_path` is a NUL-terminated string and `stat` is writable memory of the type
    // `statvfs` fills; it is read only after the call reported success.
    let stat = unsafe {
        if libc::statvfs(c_path.as_ptr(), stat.as_mut_ptr()) != 0 {
            return None;
        }
        stat.assume_init()
    };
    #[allow(clippy::unnecessary_cast)] // the field types differ between platforms
    Some((stat.f_bavail as u64).saturating_mul(stat.f_frsize as u64))
}

/// Bytes free on the file system holding `dir`: unknown on this platform.
#[cfg(not(unix))]
pub fn free_space(_dir: &Path) -> Option<u64> {
    None
}

/// A temporary name beside `path`, unique within this process and across processes and
/// machines: `<path>.tmp-<host>-<pid>-<n>`. The host is in it because a directory may be
/// shared between machines, where a process id means nothing (see
/// [`remove_abandoned_temps`]).
pub(crate) fn temp_path_for(path: &Path) -> PathBuf {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(format!(
        ".tmp-{}-{}-{}",
        host_name(),
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    ));
    PathBuf::from(tmp)
}

/// This machine's name as it goes into a file name: letters, digits, `.` and `_` kept, any
/// other character `_` (so the `-` that separate the fields stay unambiguous), `unknown`
/// where the platform does not say.
fn host_name() -> String {
    #[cfg(unix)]
    {
        let mut buf = [0u8; 256];
        // SAFETY: `buf` is writable for its length; the name is NUL-terminated within it on
        // success (truncated names are cut at the first NUL below regardless).
        if unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) } == 0 {
            let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
            if end > 0 {
                return buf[..end]
                    .iter()
                    .map(|&b| match b {
                        b'a'..=b'z' | b'A'..=b'Z' | b'0'..=b'9' | b'.' | b'_' => b as char,
                        _ => '_',
                    })
                    .collect();
            }
        }
    }
    "unknown".into()
}

/// Remove the temporary files that writers of `path` left when their process was killed
/// (an interrupted `headroom data synth` of many GiB leaves one as large as it got): siblings
/// named as [`temp_path_for`] names them, written on this machine by a process that no longer
/// exists. Another machine's file (a shared directory), a live process's, another name, or
/// anything that cannot be told for sure is left alone; failures are ignored (this is tidying,
/// the write does not depend on it).
pub(crate) fn remove_abandoned_temps(path: &Path) {
    let (Some(name), dir) = (path.file_name(), path.parent()) else {
        return;
    };
    let dir = match dir {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    let Ok(entries) = fs::read_dir(dir) else {
        return;
    };
    let prefix = format!("{}.tmp-{}-", name.to_string_lossy(), host_name());
    for entry in entries.flatten() {
        let file_name = entry.file_name();
        let Some(rest) = file_name.to_str().and_then(|n| n.strip_prefix(&prefix)) else {
            continue;
        };
        let Some((pid, counter)) = rest.split_once('-') else {
            continue;
        };
        let (Ok(pid), true) = (
            pid.parse::<u32>(),
            !counter.is_empty() && counter.bytes().all(|b| b.is_ascii_digit()),
        ) else {
            continue;
        };
        if process_is_gone(pid) && entry.file_type().is_ok_and(|t| t.is_file()) {
            let _ = fs::remove_file(entry.path());
        }
    }
}

/// Whether no process `pid` exists (only a definite "no such process" counts).
#[cfg(unix)]
fn process_is_gone(pid: u32) -> bool {
    let Ok(pid) = libc::pid_t::try_from(pid) else {
        return false;
    };
    if pid <= 0 {
        return false;
    }
    // SAFETY: signal 0 sends nothing; it only asks whether `pid` could be signalled.
    let r = unsafe { libc::kill(pid, 0) };
    r == -1 && std::io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH)
}

#[cfg(not(unix))]
fn process_is_gone(_pid: u32) -> bool {
    false
}

/// Make a rename durable. Best effort: some platforms and file systems cannot fsync a
/// directory, and the file itself is already synced.
pub(crate) fn sync_parent_dir(path: &Path) {
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    if let Ok(d) = File::open(dir) {
        let _ = d.sync_all();
    }
}

/// Write `parts` to a new temporary file beside `path` and fsync it; returns its name. On
/// error nothing is left behind.
fn write_synced_temp(path: &Path, parts: &[&[u8]]) -> Result<PathBuf> {
    let tmp = temp_path_for(path);
    let result = (|| {
        let mut f = File::create(&tmp)?;
        for p in parts {
            f.write_all(p)?;
        }
        f.sync_all()
    })();
    match result {
        Ok(()) => Ok(tmp),
        Err(e) => {
            let _ = fs::remove_file(&tmp);
            Err(DataError::io(path, e))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A writer killed mid-file leaves its temporary file behind (nothing runs at a kill); the
    /// next write of the same file removes such leftovers of this machine whose process is
    /// gone, and leaves a live process's (here this one's), another machine's (its process id
    /// means nothing here) and other files alone.
    #[cfg(unix)]
    #[test]
    fn a_new_write_removes_the_temporary_files_of_killed_writers() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("tokens.bin");
        let host = host_name();
        // i32::MAX exceeds every system's largest process id: no such process.
        let dead = dir
            .path()
            .join(format!("tokens.bin.tmp-{host}-2147483647-0"));
        let live = dir
            .path()
            .join(format!("tokens.bin.tmp-{host}-{}-99", std::process::id()));
        let elsewhere = dir
            .path()
            .join(format!("tokens.bin.tmp-{host}x-2147483647-0"));
        let other = dir.path().join("tokens.bin.tmp-notes");
        for f in [&dead, &live, &elsewhere, &other] {
            fs::write(f, b"leftover").unwrap();
        }
        let mut w = TokenWriter::create(&out, TokenFileFormat::Raw(TokenType::U16)).unwrap();
        assert!(!dead.exists());
        w.write(&[1, 2, 3]).unwrap();
        w.finish().unwrap();
        assert!(out.exists());
        assert!(live.exists() && elsewhere.exists() && other.exists());
        // The writer's own temporary file is of the form removed above.
        let own = temp_path_for(&out);
        let name = own.file_name().unwrap().to_str().unwrap();
        assert!(name.starts_with(&format!("tokens.bin.tmp-{host}-{}-", std::process::id())));
    }

    /// The `.idx` layout spelled out field by field from the table in `megatron.rs`.
    #[test]
    fn megatron_index_matches_the_documented_layout() {
        let idx = megatron_index_bytes(TokenType::U16, &[3, 0, 2]).unwrap();
        let mut want = b"MMIDIDX\x00\x00".to_vec();
        want.extend(1u64.to_le_bytes()); // version
        want.push(8); // uint16
        want.extend(3u64.to_le_bytes()); // sequences
        want.extend(4u64.to_le_bytes()); // document index entries
        for len in [3i32, 0, 2] {
            want.extend(len.to_le_bytes());
        }
        for pointer in [0i64, 6, 6] {
            want.extend(pointer.to_le_bytes());
        }
        for d in [0i64, 1, 2, 3] {
            want.extend(d.to_le_bytes());
        }
        assert_eq!(idx, want);
        assert!(megatron_index_bytes(TokenType::U32, &[1]).is_err());
    }

    #[test]
    fn llmc_header_is_patched_with_the_final_count() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s.bin");
        let mut w =
            TokenWriter::create(&path, TokenFileFormat::Llmc(crate::LlmcFlavor::Llama3)).unwrap();
        w.write(&[1, 70_000]).unwrap();
        w.write(&[3]).unwrap();
        let written = w.finish().unwrap();
        let bytes = fs::read(&path).unwrap();
        assert_eq!(written.files, vec![(path.clone(), bytes.len() as u64)]);
        let word = |i: usize| i32::from_le_bytes(bytes[i * 4..i * 4 + 4].try_into().unwrap());
        assert_eq!((word(0), word(1), word(2)), (20240801, 7, 3));
        assert!(bytes[12..LLMC_HEADER_BYTES].iter().all(|&b| b == 0));
        let body: Vec<u32> = bytes[LLMC_HEADER_BYTES..]
            .chunks_exact(4)
            .map(|c| u32::from_le_bytes(c.try_into().unwrap()))
            .collect();
        assert_eq!(body, [1, 70_000, 3]);
    }

    #[test]
    fn megatron_pair_is_written_with_no_temporary_left() {
        let dir = tempfile::tempdir().unwrap();
        let prefix = dir.path().join("m");
        let format = TokenFileFormat::Megatron {
            token_type: TokenType::U16,
            document_len: 4,
        };
        let mut w = TokenWriter::create(&prefix, format).unwrap();
        w.write(&[1, 2, 3, 4, 5]).unwrap();
        w.end_document().unwrap();
        w.end_document().unwrap(); // no empty document
        w.write(&[6]).unwrap();
        let written = w.finish().unwrap();
        assert_eq!(written.documents, Some(3));
        let idx = fs::read(prefix.with_extension("idx")).unwrap();
        assert_eq!(
            idx,
            megatron_index_bytes(TokenType::U16, &[4, 1, 1]).unwrap()
        );
        let mut names: Vec<_> = fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        names.sort();
        assert_eq!(names, ["m.bin", "m.idx"]);
        assert_eq!(written.total_bytes(), 12 + idx.len() as u64);
    }
}
