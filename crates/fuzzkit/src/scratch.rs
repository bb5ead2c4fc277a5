//! Files for fuzz targets whose reader takes a path: a private directory that hands out a
//! fresh name per input, so no input reuses a file that another (possibly abandoned, hung)
//! input still has open or mapped.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// A directory removed with everything in it when dropped. It lives in `/dev/shm` where
/// there is one: every input is a few file creations, maps and deletions, which a RAM file
/// system makes several times cheaper; elsewhere in the system's temporary directory.
#[derive(Debug)]
pub struct ScratchDir {
    dir: PathBuf,
    next: AtomicU64,
}

impl ScratchDir {
    /// A new, empty directory named after `prefix`, the process and a counter. Shared between
    /// the runner's worker threads, hence the `Arc`.
    pub fn new(prefix: &str) -> std::io::Result<Arc<Self>> {
        static CREATED: AtomicU64 = AtomicU64::new(0);
        let shm = Path::new("/dev/shm");
        let bases = [shm.to_path_buf(), std::env::temp_dir()];
        let name = format!(
            "{prefix}-{}-{}",
            std::process::id(),
            CREATED.fetch_add(1, Ordering::Relaxed)
        );
        let mut last = None;
        for base in bases.iter().filter(|b| b.is_dir()) {
            let dir = base.join(&name);
            match std::fs::create_dir(&dir) {
                Ok(()) => {
                    return Ok(Arc::new(ScratchDir {
                        dir,
                        next: AtomicU64::new(0),
                    }))
                }
                Err(e) => last = Some(e),
            }
        }
        Err(last.unwrap_or_else(|| std::io::Error::other("no temporary directory")))
    }

    /// The directory.
    pub fn path(&self) -> &Path {
        &self.dir
    }

    /// A new, unused path inside the directory (nothing is created).
    pub fn fresh(&self) -> PathBuf {
        let n = self.next.fetch_add(1, Ordering::Relaxed);
        self.dir.join(format!("in{n}"))
    }
}

impl Drop for ScratchDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Removes the files or directories of one input when it goes out of scope (also after a
/// panic), so a long campaign does not fill the scratch directory.
#[derive(Debug)]
pub struct Cleanup(pub Vec<PathBuf>);

impl Drop for Cleanup {
    fn drop(&mut self) {
        for p in &self.0 {
            if p.is_dir() {
                let _ = std::fs::remove_dir_all(p);
            } else {
                let _ = std::fs::remove_file(p);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fresh_names_differ_and_everything_goes_on_drop() {
        let s = ScratchDir::new("fuzzkit-test").unwrap();
        let (a, b) = (s.fresh(), s.fresh());
        assert_ne!(a, b);
        std::fs::write(&a, b"x").unwrap();
        {
            let _c = Cleanup(vec![a.clone()]);
        }
        assert!(!a.exists());
        std::fs::write(&b, b"y").unwrap();
        let dir = s.path().to_path_buf();
        drop(s);
        assert!(!dir.exists());
    }
}
