//! The files that say how to use a model, beside its weights: the tokenizer's, as
//! transformers' `tokenizer.save_pretrained` writes them (with the chat template), and the
//! model's `generation_config.json`. A Hugging Face Trainer checkpoint holds them, and so does
//! every checkpoint and export of a run started from a Hugging Face directory
//! (`train --init-from`), so `sample --from ROOT --chat` and transformers'
//! `AutoTokenizer.from_pretrained(step_dir)` work on a step directory as on the base.
//!
//! ```
//! use headroom_trainer::companions::Companions;
//! let base = tempfile::tempdir().unwrap();
//! std::fs::write(base.path().join("tokenizer.json"), b"{}").unwrap();
//! std::fs::write(base.path().join("model.safetensors"), b"weights are not companions").unwrap();
//! let companions = Companions::beside(base.path()).unwrap();
//! let names: Vec<&str> = companions.files().map(|(name, _)| name).collect();
//! assert_eq!(names, ["tokenizer.json"]);
//! assert_eq!(companions.bytes(), 2);
//! ```
//!
//! They are read once, when a run starts (or from the checkpoint it resumes), and written
//! into every checkpoint from memory: the base directory may change or disappear during a long
//! run, and a checkpoint must not pair weights with a tokenizer edited after they were
//! trained. The cost is their bytes held for the run, a few MiB (Llama 3's `tokenizer.json` is
//! 9 MiB), never more than [`MAX_COMPANION_BYTES`].

use std::path::Path;

use crate::checkpoint::{self, Manifest, ManifestFile};
use crate::{Result, TrainError};

/// The tokenizer's files as transformers saves them (the fast tokenizer's `tokenizer.json`,
/// the slow tokenizers' vocabularies, the configuration and the chat template in either of its
/// files), and the model's generation config. Any of them may be absent.
pub const COMPANION_FILES: [&str; 10] = [
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    crate::sample::GENERATION_CONFIG,
];

/// The directory of a tokenizer's named chat templates (`tool_use.jinja`, …), transformers
/// 5's layout; at most [`crate::chat_template::MAX_NAMED_TEMPLATES`] of them are carried.
pub const NAMED_TEMPLATES_DIR: &str = "additional_chat_templates";

/// The most bytes all companion files together may hold (Gemma 3's `tokenizer.json`, among
/// the largest, is 33 MiB).
pub const MAX_COMPANION_BYTES: u64 = 256 << 20;

/// A model's companion files, name and bytes, in name order. Empty for a model without any
/// (a run from scratch).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Companions {
    files: Vec<(String, Vec<u8>)>,
}

impl Companions {
    /// None: what a run from scratch carries.
    pub fn none() -> Self {
        Self::default()
    }

    /// The companion files of the model directory `dir` (a Hugging Face directory; symbolic
    /// links, as the Hub's cache has, are followed). A `generation_config.json` must read as
    /// one ([`crate::sample::GenerationConfig::parse`]): a checkpoint carries no file `sample`
    /// would refuse. Other files are copied as they are.
    pub fn beside(dir: &Path) -> Result<Self> {
        Self::beside_within(dir, MAX_COMPANION_BYTES)
    }

    /// [`Companions::beside`], all files together at most `limit` bytes.
    fn beside_within(dir: &Path, limit: u64) -> Result<Self> {
        let generation = crate::sample::GENERATION_CONFIG;
        let mut names: Vec<String> = COMPANION_FILES
            .iter()
            .filter(|&&name| name != generation && dir.join(name).is_file())
            .map(|name| name.to_string())
            .collect();
        let named = dir.join(NAMED_TEMPLATES_DIR);
        if named.is_dir() {
            let entries = std::fs::read_dir(&named).map_err(|e| input(&named, e))?;
            for entry in entries {
                let entry = entry.map_err(|e| input(&named, e))?;
                let Some(file) = entry.file_name().to_str().map(str::to_owned) else {
                    continue;
                };
                let name = format!("{NAMED_TEMPLATES_DIR}/{file}");
                if is_named_template(&name) && entry.path().is_file() {
                    names.push(name);
                }
            }
        }
        let mut files = Vec::with_capacity(names.len() + 1);
        // Read, bounded and parsed as `sample` reads it.
        if let Some(bytes) = crate::sample::GenerationConfig::file_beside(dir)? {
            files.push((generation.to_string(), bytes));
        }
        let mut left = limit.saturating_sub(files.iter().map(|(_, b)| b.len() as u64).sum());
        for name in names {
            let path = dir.join(&name);
            let bytes = crate::bounded::read_file(&path, left).map_err(|why| {
                input(
                    &path,
                    format!("{why} (the model's tokenizer and generation files together)"),
                )
            })?;
            left -= bytes.len() as u64;
            files.push((name, bytes));
        }
        Self::from_files(files, dir)
    }

    /// What every checkpoint and export of a run carries: the resumed checkpoint's files
    /// (`saved`) if it has any, else those of the Hugging Face directory the run started
    /// from; with `tokenizer`'s tokenizer files ([`Companions::of_tokenizer`]) in place of
    /// theirs when one is given.
    pub fn of_run(
        saved: Option<Companions>,
        init_from: Option<&Path>,
        tokenizer: Option<&Path>,
    ) -> Result<Self> {
        let carried = match (saved, init_from) {
            (Some(saved), _) if !saved.is_empty() => saved,
            (_, Some(dir)) => Self::beside(dir)?,
            (_, None) => Self::none(),
        };
        match tokenizer {
            Some(t) => Ok(carried.with_tokenizer(Self::of_tokenizer(t)?)),
            None => Ok(carried),
        }
    }

    /// The tokenizer files of the Hugging Face tokenizer at `path` (its `tokenizer.json`, or
    /// the directory holding it): [`Companions::beside`] of that directory without its
    /// `generation_config.json`, which is a model's.
    pub fn of_tokenizer(path: &Path) -> Result<Self> {
        let dir = if path.is_dir() {
            path
        } else if path.file_name() == Some(std::ffi::OsStr::new("tokenizer.json")) {
            path.parent().unwrap_or(Path::new("."))
        } else {
            return Err(input(
                path,
                "not a tokenizer.json or a directory holding one: a checkpoint carries the \
                 tokenizer's files under their own names",
            ));
        };
        if !dir.join("tokenizer.json").is_file() {
            return Err(input(dir, "no tokenizer.json"));
        }
        let mut files = Self::beside(dir)?;
        files
            .files
            .retain(|(name, _)| name != crate::sample::GENERATION_CONFIG);
        Ok(files)
    }

    /// These files with `tokenizer`'s in place of every tokenizer file (a generation config
    /// stays).
    pub fn with_tokenizer(mut self, tokenizer: Companions) -> Self {
        self.files
            .retain(|(name, _)| name == crate::sample::GENERATION_CONFIG);
        self.files.extend(tokenizer.files);
        self.files.sort();
        self
    }

    /// The companion files a checkpoint's manifest lists, each read and checked against it
    /// (size and checksum). Files the manifest does not list are not the checkpoint's.
    pub(crate) fn listed_in(dir: &Path, manifest: &Manifest) -> Result<Self> {
        let listed: Vec<&ManifestFile> = manifest
            .files
            .iter()
            .filter(|f| is_companion(&f.name))
            .collect();
        let total = listed
            .iter()
            .try_fold(0u64, |sum, f| sum.checked_add(f.bytes))
            .filter(|&sum| sum <= MAX_COMPANION_BYTES);
        if total.is_none() {
            return Err(checkpoint::err(
                &dir.join(checkpoint::MANIFEST),
                format!(
                    "lists tokenizer and generation files of more than {MAX_COMPANION_BYTES} \
                     bytes together"
                ),
            ));
        }
        let files = listed
            .into_iter()
            .map(|f| Ok((f.name.clone(), checkpoint::read_verified(dir, f)?)))
            .collect::<Result<Vec<_>>>()?;
        Self::from_files(files, dir)
    }

    fn from_files(mut files: Vec<(String, Vec<u8>)>, dir: &Path) -> Result<Self> {
        files.sort();
        let named = files
            .iter()
            .filter(|(name, _)| name.starts_with(NAMED_TEMPLATES_DIR))
            .count();
        if named > crate::chat_template::MAX_NAMED_TEMPLATES {
            return Err(input(
                &dir.join(NAMED_TEMPLATES_DIR),
                format!(
                    "more than {} templates",
                    crate::chat_template::MAX_NAMED_TEMPLATES
                ),
            ));
        }
        Ok(Companions { files })
    }

    /// Each file's name (relative to the model directory) and bytes, in name order.
    pub fn files(&self) -> impl Iterator<Item = (&str, &[u8])> {
        self.files.iter().map(|(n, b)| (n.as_str(), b.as_slice()))
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.files.is_empty()
    }

    /// Their bytes together: what they add to every checkpoint.
    pub fn bytes(&self) -> u64 {
        self.files.iter().map(|(_, b)| b.len() as u64).sum()
    }

    /// Write every file into `dir` (a directory being prepared for publishing), each fsynced,
    /// and return their manifest entries.
    pub(crate) fn write_into(&self, dir: &Path) -> Result<Vec<ManifestFile>> {
        let mut entries = Vec::with_capacity(self.files.len());
        let mut made_named_dir = false;
        for (name, bytes) in &self.files {
            if name.starts_with(NAMED_TEMPLATES_DIR) && !made_named_dir {
                let sub = dir.join(NAMED_TEMPLATES_DIR);
                std::fs::create_dir(&sub).map_err(checkpoint::io(&sub))?;
                made_named_dir = true;
            }
            let mut entry = checkpoint::write_synced(&dir.join(name), bytes)?;
            entry.name = name.clone();
            entries.push(entry);
        }
        if made_named_dir {
            checkpoint::sync_dir(&dir.join(NAMED_TEMPLATES_DIR))?;
        }
        Ok(entries)
    }
}

/// Whether a file of a model directory, named relative to it, is a companion file: one of
/// [`COMPANION_FILES`], or a named chat template.
pub fn is_companion(name: &str) -> bool {
    COMPANION_FILES.contains(&name) || is_named_template(name)
}

/// `additional_chat_templates/NAME.jinja`, NAME a plain file name (no directories, not
/// hidden): never a path out of the directory.
fn is_named_template(name: &str) -> bool {
    name.strip_prefix(NAMED_TEMPLATES_DIR)
        .and_then(|rest| rest.strip_prefix('/'))
        .and_then(|file| file.strip_suffix(".jinja"))
        .is_some_and(|stem| {
            !stem.is_empty() && !stem.starts_with('.') && !stem.contains(['/', '\\'])
        })
}

fn input(path: &Path, why: impl std::fmt::Display) -> TrainError {
    TrainError::Input(format!("{}: {why}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_known_names_and_plain_named_templates_are_companions() {
        for name in COMPANION_FILES {
            assert!(is_companion(name), "{name}");
        }
        assert!(is_companion("additional_chat_templates/tool_use.jinja"));
        for name in [
            "model.safetensors",
            "config.json",
            "optimizer.bin",
            "state.json",
            "manifest.json",
            "additional_chat_templates/.jinja",
            "additional_chat_templates/.hidden.jinja",
            "additional_chat_templates/../../etc/x.jinja",
            "additional_chat_templates/a/b.jinja",
            "additional_chat_templates/tool_use.txt",
            "additional_chat_templatesx/tool_use.jinja",
            "../tokenizer.json",
            "sub/tokenizer.json",
        ] {
            assert!(!is_companion(name), "{name}");
        }
    }

    #[test]
    fn a_directory_s_companions_are_read_and_bounded() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        std::fs::write(d.join("tokenizer.json"), b"{\"model\": {}}").unwrap();
        std::fs::write(d.join("merges.txt"), b"a b\n").unwrap();
        std::fs::write(d.join("config.json"), b"{}").unwrap();
        std::fs::create_dir(d.join(NAMED_TEMPLATES_DIR)).unwrap();
        std::fs::write(
            d.join("additional_chat_templates/tool_use.jinja"),
            b"{{ x }}",
        )
        .unwrap();
        std::fs::write(d.join("additional_chat_templates/notes.txt"), b"no").unwrap();
        let c = Companions::beside(d).unwrap();
        let names: Vec<&str> = c.files().map(|(n, _)| n).collect();
        assert_eq!(
            names,
            [
                "additional_chat_templates/tool_use.jinja",
                "merges.txt",
                "tokenizer.json"
            ]
        );
        assert_eq!(c.bytes(), 7 + 4 + 13);

        let out = tempfile::tempdir().unwrap();
        let entries = c.write_into(out.path()).unwrap();
        assert_eq!(
            entries.iter().map(|e| e.name.as_str()).collect::<Vec<_>>(),
            names
        );
        for (name, bytes) in c.files() {
            assert_eq!(std::fs::read(out.path().join(name)).unwrap(), bytes);
        }

        // Together over the bound: refused, naming the file that crossed it.
        let e = Companions::beside_within(d, 20).unwrap_err().to_string();
        assert!(
            e.contains("tool_use.jinja") && e.contains("together"),
            "{e}"
        );
        assert_eq!(Companions::beside_within(d, 24).unwrap(), c);

        // A generation config sample would refuse is refused here, naming the file.
        std::fs::write(
            d.join("generation_config.json"),
            b"{\"do_sample\": \"yes\"}",
        )
        .unwrap();
        let e = Companions::beside(d).unwrap_err().to_string();
        assert!(e.contains("generation_config.json"), "{e}");
    }

    #[test]
    fn a_checkpoint_s_companions_are_the_listed_ones_checked() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        std::fs::write(d.join("tokenizer.json"), b"{}").unwrap();
        std::fs::write(d.join("vocab.json"), b"unlisted").unwrap();
        let entry = |name: &str, bytes: u64, xxh3: String| ManifestFile {
            name: name.into(),
            bytes,
            xxh3,
        };
        let manifest = |files| Manifest {
            format_version: checkpoint::FORMAT_VERSION,
            step: 1,
            files,
        };
        let good = entry("tokenizer.json", 2, checkpoint::checksum(b"{}"));
        let state = entry("state.json", 2, checkpoint::checksum(b"{}"));
        let c = Companions::listed_in(d, &manifest(vec![good.clone(), state])).unwrap();
        assert_eq!(
            c.files().collect::<Vec<_>>(),
            [("tokenizer.json", &b"{}"[..])]
        );

        let wrong = entry("tokenizer.json", 2, checkpoint::checksum(b"[]"));
        let e = Companions::listed_in(d, &manifest(vec![wrong])).unwrap_err();
        assert!(e.to_string().contains("tokenizer.json"), "{e}");
        // Sizes are added without overflow and bounded before anything is read.
        let huge = entry("vocab.json", u64::MAX, String::new());
        for files in [
            vec![good.clone(), huge],
            vec![entry("merges.txt", MAX_COMPANION_BYTES + 1, String::new())],
        ] {
            let e = Companions::listed_in(d, &manifest(files)).unwrap_err();
            assert!(e.to_string().contains("more than"), "{e}");
        }
    }

    #[test]
    fn a_run_s_tokenizer_replaces_the_base_s_and_keeps_its_generation_config() {
        let base = tempfile::tempdir().unwrap();
        std::fs::write(base.path().join("tokenizer.json"), b"base").unwrap();
        std::fs::write(base.path().join("chat_template.jinja"), b"base").unwrap();
        std::fs::write(base.path().join("generation_config.json"), b"{}").unwrap();
        let tok = tempfile::tempdir().unwrap();
        std::fs::write(tok.path().join("tokenizer.json"), b"own").unwrap();
        std::fs::write(tok.path().join("generation_config.json"), b"{\"top_k\": 5}").unwrap();
        let names = |c: &Companions| {
            c.files()
                .map(|(n, b)| (n.to_owned(), b.to_vec()))
                .collect::<Vec<_>>()
        };
        let file = tok.path().join("tokenizer.json");
        for given in [tok.path(), file.as_path()] {
            let c = Companions::of_run(None, Some(base.path()), Some(given)).unwrap();
            assert_eq!(
                names(&c),
                [
                    ("generation_config.json".to_owned(), b"{}".to_vec()),
                    ("tokenizer.json".to_owned(), b"own".to_vec())
                ]
            );
        }
        // A resumed checkpoint's files come first; none at all without a base.
        let saved = Companions::of_tokenizer(tok.path()).unwrap();
        let c = Companions::of_run(Some(saved.clone()), Some(base.path()), None).unwrap();
        assert_eq!(c, saved);
        assert!(Companions::of_run(None, None, None).unwrap().is_empty());
        // Not a tokenizer.json, or a directory without one.
        std::fs::write(tok.path().join("vocab.txt"), b"x").unwrap();
        for bad in [tok.path().join("vocab.txt"), base.path().join("missing")] {
            assert!(Companions::of_tokenizer(&bad).is_err(), "{}", bad.display());
        }
        let empty = tempfile::tempdir().unwrap();
        let e = Companions::of_tokenizer(empty.path())
            .unwrap_err()
            .to_string();
        assert!(e.contains("no tokenizer.json"), "{e}");
    }

    #[cfg(unix)]
    #[test]
    fn a_device_posing_as_a_tokenizer_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        std::os::unix::fs::symlink("/dev/zero", dir.path().join("tokenizer.json")).unwrap();
        // `is_file` follows the link to a device: not a regular file, so not listed at all.
        assert!(Companions::beside(dir.path()).unwrap().is_empty());
    }
}
