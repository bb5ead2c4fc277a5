//! Whole-file reads whose size limit holds whatever the path names.

use std::fs::File;
use std::io::Read;
use std::path::Path;

/// The bytes of the regular file at `path`, or why they were not read (for the caller to put
/// in its own error with the path): not a regular file, more than `limit` bytes, or an I/O
/// error. A device, FIFO or `/proc` file reports a length of 0 whatever it yields, so such
/// paths are refused, and a regular file is read through a bound in case it grows.
pub(crate) fn read_file(path: &Path, limit: u64) -> Result<Vec<u8>, String> {
    let not_regular = || {
        "not a regular file (a device, FIFO or /proc file has no size to bound a read by)"
            .to_string()
    };
    // Checked before opening too: opening a FIFO blocks until something writes to it.
    if !std::fs::metadata(path)
        .map_err(|e| e.to_string())?
        .is_file()
    {
        return Err(not_regular());
    }
    let file = File::open(path).map_err(|e| e.to_string())?;
    // The handle's own metadata: the path may name something else by now.
    let meta = file.metadata().map_err(|e| e.to_string())?;
    if !meta.is_file() {
        return Err(not_regular());
    }
    let too_large = |len: u64| format!("{len} bytes, more than the {limit} read");
    if meta.len() > limit {
        return Err(too_large(meta.len()));
    }
    let mut bytes = Vec::new();
    let len = usize::try_from(meta.len()).map_err(|_| too_large(meta.len()))?;
    bytes
        .try_reserve_exact(len)
        .map_err(|_| format!("cannot allocate {len} bytes to read it"))?;
    file.take(limit.saturating_add(1))
        .read_to_end(&mut bytes)
        .map_err(|e| e.to_string())?;
    if bytes.len() as u64 > limit {
        return Err(format!("grew past {limit} bytes while being read"));
    }
    Ok(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_file_is_read_up_to_its_limit() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f");
        std::fs::write(&path, b"12345").unwrap();
        assert_eq!(read_file(&path, 5).unwrap(), b"12345");
        assert!(read_file(&path, 4).unwrap_err().contains("5 bytes"));
        assert!(read_file(dir.path(), 5)
            .unwrap_err()
            .contains("not a regular file"));
    }

    #[cfg(unix)]
    #[test]
    fn a_device_is_refused_without_reading_it() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("zero");
        std::os::unix::fs::symlink("/dev/zero", &path).unwrap();
        assert!(read_file(&path, 1 << 20)
            .unwrap_err()
            .contains("not a regular file"));
    }
}
