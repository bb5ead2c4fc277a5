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

/// The keys of a model's `config.json` that name tokens. transformers' `generate` falls back
/// on them where a model has no `generation_config.json`, and other tools (serving engines,
/// converters) read them, so every `config.json` a run writes carries its base's.
pub const CONFIG_TOKEN_KEYS: [&str; 3] = ["bos_token_id", "eos_token_id", "pad_token_id"];

/// The most ids one of [`CONFIG_TOKEN_KEYS`] may list (Llama 3.1's `eos_token_id` lists 3).
const MAX_IDS_PER_KEY: usize = 64;

/// A model's companion files, name and bytes, in name order, and the token ids of its
/// `config.json`. Empty for a model without any (a run from scratch).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Companions {
    files: Vec<(String, Vec<u8>)>,
    /// Those of [`CONFIG_TOKEN_KEYS`] the base's `config.json` has, as it has them (an id, a
    /// list of ids, or null); a key it lacks stays absent, so transformers applies the same
    /// class default to the export as to the base. `None` without a base config (a run from
    /// scratch with no tokenizer): [`crate::checkpoint`] then writes its own stand-in.
    token_ids: Option<serde_json::Map<String, serde_json::Value>>,
}

/// What a run does to the tokenizer its checkpoints carry, as TRL's `SFTConfig` does: the
/// tokenizer the data was built with, the token that ends each example, the chat template the
/// conversations were rendered with. A `data build` made with `--eos-token` or
/// `--chat-template` needs the same option on `train`, so that the checkpoint samples and
/// loads as the data was made.
#[derive(Clone, Copy, Debug, Default)]
pub struct TokenizerSettings<'a> {
    /// A Hugging Face tokenizer (its `tokenizer.json` or directory) whose files replace the
    /// base's (a Trainer's `processing_class`).
    pub tokenizer: Option<&'a Path>,
    /// TRL's `eos_token`: the tokenizer's `eos_token` becomes it, `config.json`'s
    /// `eos_token_id` its id, and the generation config's eos ids gain it in front.
    pub eos_token: Option<&'a str>,
    /// TRL's `chat_template_path` (a Jinja file): it becomes the tokenizer's only chat
    /// template.
    pub chat_template: Option<&'a Path>,
}

impl TokenizerSettings<'_> {
    /// Whether it changes the carried files at all.
    pub fn changes_anything(&self) -> bool {
        self.tokenizer.is_some() || self.eos_token.is_some() || self.chat_template.is_some()
    }
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
    /// The token ids of its `config.json` ([`CONFIG_TOKEN_KEYS`]) come with them.
    pub fn beside(dir: &Path) -> Result<Self> {
        let mut companions = Self::beside_within(dir, MAX_COMPANION_BYTES)?;
        companions.token_ids = config_token_ids(dir)?;
        Ok(companions)
    }

    /// [`Companions::beside`]'s files (not the token ids), all together at most `limit`
    /// bytes.
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
    /// from, and the token ids likewise; then `settings` applied: the given tokenizer's files
    /// ([`Companions::of_tokenizer`]) in place of theirs, TRL's `eos_token`
    /// ([`Companions::with_eos_token`]) and chat template ([`Companions::with_chat_template`]).
    /// Applying them again to a resumed checkpoint's files changes nothing. A run from
    /// scratch with a tokenizer takes its `config.json` ids from the tokenizer's special
    /// tokens.
    pub fn of_run(
        saved: Option<Companions>,
        init_from: Option<&Path>,
        settings: &TokenizerSettings<'_>,
    ) -> Result<Self> {
        let mut carried = saved.unwrap_or_default();
        if let Some(dir) =
            init_from.filter(|_| carried.files.is_empty() || carried.token_ids.is_none())
        {
            let base = Self::beside(dir)?;
            if carried.files.is_empty() {
                carried.files = base.files;
            }
            if carried.token_ids.is_none() {
                carried.token_ids = base.token_ids;
            }
        }
        if let Some(t) = settings.tokenizer {
            carried = carried.with_tokenizer(Self::of_tokenizer(t)?);
        }
        if carried.token_ids.is_none() {
            carried.token_ids = carried.ids_of_tokenizer()?;
        }
        if let Some(token) = settings.eos_token {
            carried = carried.with_eos_token(token)?;
        }
        if let Some(template) = settings.chat_template {
            carried = carried.with_chat_template(template)?;
        }
        Ok(carried)
    }

    /// The tokenizer these files hold (their `tokenizer.json`), if any.
    pub fn tokenizer(&self) -> Result<Option<crate::tokenize::Tokenizer>> {
        self.file(TOKENIZER_JSON)
            .map(|bytes| {
                crate::tokenize::Tokenizer::from_json_bytes(bytes, Path::new(TOKENIZER_JSON))
            })
            .transpose()
    }

    /// The tokenizer, required by `what`.
    fn required_tokenizer(&self, what: &str) -> Result<crate::tokenize::Tokenizer> {
        self.tokenizer()?.ok_or_else(|| {
            TrainError::Input(format!(
                "{what} changes the run's tokenizer, and the run carries none: start from a \
                 Hugging Face directory with a tokenizer.json (--init-from) or name one with \
                 --tokenizer"
            ))
        })
    }

    /// `config.json`'s ids of a model whose only source is its tokenizer (a run from scratch
    /// with `--tokenizer`): the ids of the special tokens its `tokenizer_config.json` names,
    /// the end of text standing in for a missing `eos_token`, as one would configure the
    /// model by hand. `None` without a `tokenizer.json`.
    fn ids_of_tokenizer(&self) -> Result<Option<serde_json::Map<String, serde_json::Value>>> {
        let Some(tok) = self.tokenizer()? else {
            return Ok(None);
        };
        let special = match self.file(TOKENIZER_CONFIG) {
            Some(bytes) => crate::chat_template::special_tokens_in(
                &String::from_utf8_lossy(bytes),
                Path::new(TOKENIZER_CONFIG),
            )?,
            None => Default::default(),
        };
        let id_of = |name: &str| -> Result<Option<u32>> {
            match special.get(name) {
                None => Ok(None),
                Some(text) => tok.token_id(text).map(Some).ok_or_else(|| {
                    TrainError::Input(format!(
                        "{TOKENIZER_CONFIG}: its {name} {text:?} is not in the tokenizer's \
                         vocabulary"
                    ))
                }),
            }
        };
        let mut ids = serde_json::Map::new();
        let eos = id_of("eos_token")?.or(tok.end_of_text());
        for (key, id) in [
            ("bos_token_id", id_of("bos_token")?),
            ("eos_token_id", eos),
            ("pad_token_id", id_of("pad_token")?),
        ] {
            if let Some(id) = id {
                ids.insert(key.into(), id.into());
            }
        }
        Ok(Some(ids))
    }

    /// TRL's `eos_token`: `token` (in the tokenizer's vocabulary) becomes the tokenizer's
    /// `eos_token` (in `tokenizer_config.json`, and in `special_tokens_map.json` where there
    /// is one, which transformers 4 reads over it), its id `config.json`'s `eos_token_id`,
    /// and the generation config's `eos_token_id` a list with it first, the earlier ids kept
    /// (a generation config made from `config.json`'s ids when there is none). Idempotent.
    pub fn with_eos_token(mut self, token: &str) -> Result<Self> {
        let id = self
            .required_tokenizer("--eos-token")?
            .token_id(token)
            .ok_or_else(|| {
                TrainError::Input(format!(
                    "--eos-token {token:?} is not in the tokenizer's vocabulary (TRL refuses it \
                     too: add it to the tokenizer first)"
                ))
            })?;
        self.edit_json(TOKENIZER_CONFIG, true, |config| {
            config.insert("eos_token".into(), token.into());
        })?;
        self.edit_json(SPECIAL_TOKENS_MAP, false, |map| {
            map.insert("eos_token".into(), token.into());
        })?;
        let ids = self.token_ids.get_or_insert_with(Default::default);
        let config_eos = ids
            .insert("eos_token_id".into(), id.into())
            .unwrap_or(serde_json::Value::Null);
        let ids = ids.clone();
        let generation = crate::sample::GENERATION_CONFIG;
        if self.file(generation).is_none() {
            let mut made = serde_json::Map::new();
            for key in ["bos_token_id", "pad_token_id"] {
                if let Some(v) = ids.get(key).filter(|v| !v.is_null()) {
                    made.insert(key.into(), v.clone());
                }
            }
            made.insert("eos_token_id".into(), config_eos);
            self.put(generation, json_bytes(&made)?);
        }
        self.edit_json(generation, false, |config| {
            let mut eos: Vec<serde_json::Value> = match config.remove("eos_token_id") {
                Some(serde_json::Value::Array(list)) => list,
                None | Some(serde_json::Value::Null) => Vec::new(),
                Some(one) => vec![one],
            };
            if !eos.iter().any(|e| e.as_u64() == Some(u64::from(id))) {
                eos.insert(0, id.into());
            }
            config.insert("eos_token_id".into(), eos.into());
        })?;
        // As `sample` reads it: a carried generation config is never one it refuses.
        let bytes = self.file(generation).unwrap_or_default();
        crate::sample::GenerationConfig::parse(
            &String::from_utf8_lossy(bytes),
            Path::new(generation),
        )?;
        Ok(self)
    }

    /// TRL's `chat_template_path` with a Jinja file: `template` (which must parse) becomes the
    /// tokenizer's one chat template, `chat_template.jinja`, as transformers 5 saves a
    /// tokenizer whose `chat_template` was set to a string; the templates it had (in
    /// `tokenizer_config.json`, `chat_template.json` or `additional_chat_templates/`) go.
    pub fn with_chat_template(mut self, template: &Path) -> Result<Self> {
        self.required_tokenizer("--chat-template")?;
        crate::chat_template::ChatTemplate::from_file(template, None)?;
        let text = crate::bounded::read_file(template, crate::chat_template::MAX_CONFIG_BYTES)
            .map_err(|why| input(template, why))?;
        self.files
            .retain(|(name, _)| name != "chat_template.json" && !is_named_template(name));
        self.put("chat_template.jinja", text);
        self.edit_json(TOKENIZER_CONFIG, false, |config| {
            config.remove("chat_template");
        })?;
        Ok(self)
    }

    /// The bytes of the file `name`, if carried.
    fn file(&self, name: &str) -> Option<&[u8]> {
        self.files
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, b)| b.as_slice())
    }

    /// Carry `bytes` as the file `name`, in place of any it had.
    fn put(&mut self, name: &str, bytes: Vec<u8>) {
        match self.files.iter_mut().find(|(n, _)| n == name) {
            Some((_, old)) => *old = bytes,
            None => {
                self.files.push((name.to_owned(), bytes));
                self.files.sort();
            }
        }
    }

    /// `edit` applied to the JSON object of the file `name`; an absent file is made (from
    /// `{}`) only when `create`. The file is rewritten with its keys in order.
    fn edit_json(
        &mut self,
        name: &str,
        create: bool,
        edit: impl FnOnce(&mut serde_json::Map<String, serde_json::Value>),
    ) -> Result<()> {
        let mut object = match self.file(name) {
            Some(bytes) => match serde_json::from_slice(bytes) {
                Ok(serde_json::Value::Object(o)) => o,
                _ => {
                    return Err(TrainError::Input(format!(
                        "{name}: not a JSON object, so it cannot be changed"
                    )))
                }
            },
            None if create => serde_json::Map::new(),
            None => return Ok(()),
        };
        edit(&mut object);
        self.put(name, json_bytes(&object)?);
        Ok(())
    }

    /// The token ids `config.json` is written with ([`CONFIG_TOKEN_KEYS`]); `None` without a
    /// base config or a tokenizer to take them from.
    pub fn token_ids(&self) -> Option<&serde_json::Map<String, serde_json::Value>> {
        self.token_ids.as_ref()
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
        // A tokenizer's directory may be a model's: its generation config and token ids are
        // that model's, not the tokenizer's.
        let mut files = Self::beside_within(dir, MAX_COMPANION_BYTES)?;
        files
            .files
            .retain(|(name, _)| name != crate::sample::GENERATION_CONFIG);
        Ok(files)
    }

    /// These files with `tokenizer`'s in place of every tokenizer file (a generation config
    /// and the token ids stay).
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
        let mut companions = Self::from_files(files, dir)?;
        if let Some(config) = manifest.files.iter().find(|f| f.name == "config.json") {
            let path = dir.join(&config.name);
            if config.bytes > checkpoint::MAX_JSON_BYTES {
                return Err(checkpoint::err(
                    &path,
                    "larger than any model configuration",
                ));
            }
            let bytes = checkpoint::read_verified(dir, config)?;
            companions.token_ids = Some(token_ids_in(&bytes, &path)?);
        }
        Ok(companions)
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
        Ok(Companions {
            files,
            token_ids: None,
        })
    }

    /// Each file's name (relative to the model directory) and bytes, in name order.
    pub fn files(&self) -> impl Iterator<Item = (&str, &[u8])> {
        self.files.iter().map(|(n, b)| (n.as_str(), b.as_slice()))
    }

    /// Whether there are no files and no token ids.
    pub fn is_empty(&self) -> bool {
        self.files.is_empty() && self.token_ids.is_none()
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

const TOKENIZER_JSON: &str = "tokenizer.json";
const TOKENIZER_CONFIG: &str = "tokenizer_config.json";
const SPECIAL_TOKENS_MAP: &str = "special_tokens_map.json";

/// `object` as the carried files are rewritten: indented JSON.
fn json_bytes(object: &serde_json::Map<String, serde_json::Value>) -> Result<Vec<u8>> {
    serde_json::to_vec_pretty(object).map_err(|e| TrainError::Input(e.to_string()))
}

/// The [`CONFIG_TOKEN_KEYS`] a model's `config.json` (its bytes, read from `path`) has: each
/// an id, a list of at most [`MAX_IDS_PER_KEY`] ids, or null, as transformers takes them;
/// another value is refused, as `hf` refuses a setting of the wrong type.
/// The token ids of the `config.json` in `dir` ([`CONFIG_TOKEN_KEYS`], each an id, a list of
/// ids or null, checked), if it has one.
pub(crate) fn config_token_ids(
    dir: &Path,
) -> Result<Option<serde_json::Map<String, serde_json::Value>>> {
    let config = dir.join("config.json");
    if !config.is_file() {
        return Ok(None);
    }
    let bytes = crate::bounded::read_file(&config, checkpoint::MAX_JSON_BYTES)
        .map_err(|why| input(&config, why))?;
    token_ids_in(&bytes, &config).map(Some)
}

fn token_ids_in(bytes: &[u8], path: &Path) -> Result<serde_json::Map<String, serde_json::Value>> {
    let config: serde_json::Value =
        serde_json::from_slice(bytes).map_err(|e| input(path, format!("not JSON: {e}")))?;
    let object = config
        .as_object()
        .ok_or_else(|| input(path, "not a JSON object"))?;
    let is_id = |v: &serde_json::Value| v.as_u64().is_some_and(|id| id <= u64::from(u32::MAX));
    let mut ids = serde_json::Map::new();
    for key in CONFIG_TOKEN_KEYS {
        let Some(value) = object.get(key) else {
            continue;
        };
        let valid = match value {
            serde_json::Value::Null => true,
            serde_json::Value::Array(list) => {
                list.len() <= MAX_IDS_PER_KEY && list.iter().all(is_id)
            }
            one => is_id(one),
        };
        if !valid {
            let shown: String = value.to_string().chars().take(40).collect();
            return Err(input(
                path,
                format!(
                    "{key} is {shown}: expected a token id, a list of at most \
                     {MAX_IDS_PER_KEY} ids, or null"
                ),
            ));
        }
        ids.insert(key.into(), value.clone());
    }
    Ok(ids)
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
        assert_eq!(Companions::beside_within(d, 24).unwrap().files, c.files);

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
        std::fs::write(base.path().join("config.json"), b"{\"eos_token_id\": 7}").unwrap();
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
            let c = Companions::of_run(
                None,
                Some(base.path()),
                &TokenizerSettings {
                    tokenizer: Some(given),
                    ..Default::default()
                },
            )
            .unwrap();
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
        let c = Companions::of_run(Some(saved.clone()), Some(base.path()), &Default::default())
            .unwrap();
        assert_eq!(c.files, saved.files);
        // The saved files hold no config.json ids here: the base's fill in.
        assert_eq!(
            serde_json::Value::Object(c.token_ids().unwrap().clone()),
            serde_json::json!({"eos_token_id": 7})
        );
        assert!(Companions::of_run(None, None, &Default::default())
            .unwrap()
            .is_empty());
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

    #[test]
    fn config_token_ids_are_carried_as_the_base_has_them_and_odd_ones_refused() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        std::fs::write(
            d.join("config.json"),
            br#"{"bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009],
                 "pad_token_id": null, "vocab_size": 128256}"#,
        )
        .unwrap();
        let c = Companions::beside(d).unwrap();
        let ids = serde_json::Value::Object(c.token_ids().unwrap().clone());
        assert_eq!(
            ids,
            serde_json::json!({"bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009],
                               "pad_token_id": null})
        );
        // Written into config.json as they are; a key the base lacks stays absent, but for a
        // Llama's pad_token_id, which is the model's padding index (none here: null).
        let cfg = crate::model::ModelConfig::llama_tiny(97);
        let written = |ids: Option<&serde_json::Map<String, serde_json::Value>>| {
            serde_json::from_slice::<serde_json::Value>(
                &checkpoint::hf_config(&cfg, ids, d).unwrap(),
            )
            .unwrap()
        };
        let out = written(c.token_ids());
        for key in CONFIG_TOKEN_KEYS {
            assert_eq!(out[key], ids[key], "{key}");
        }
        let mut only_eos = serde_json::Map::new();
        only_eos.insert("eos_token_id".into(), 2.into());
        let out = written(Some(&only_eos));
        assert!(out.get("bos_token_id").is_none());
        assert_eq!(out["pad_token_id"], serde_json::Value::Null);
        // No base: the last id stands in for both.
        let out = written(None);
        assert_eq!(
            (&out["bos_token_id"], &out["eos_token_id"]),
            (&96.into(), &96.into())
        );

        for (value, key) in [
            (r#"{"eos_token_id": "</s>"}"#, "eos_token_id"),
            (r#"{"bos_token_id": -1}"#, "bos_token_id"),
            (r#"{"pad_token_id": 4294967296}"#, "pad_token_id"),
            (r#"{"eos_token_id": [1, 2.5]}"#, "eos_token_id"),
            (r#"{"eos_token_id": {"id": 1}}"#, "eos_token_id"),
        ] {
            std::fs::write(d.join("config.json"), value).unwrap();
            let e = Companions::beside(d).unwrap_err().to_string();
            assert!(e.contains(key) && e.contains("config.json"), "{value}: {e}");
        }
        let long: Vec<u32> = (0..=MAX_IDS_PER_KEY as u32).collect();
        std::fs::write(
            d.join("config.json"),
            serde_json::json!({ "eos_token_id": long }).to_string(),
        )
        .unwrap();
        assert!(Companions::beside(d).is_err());
        std::fs::write(d.join("config.json"), b"[1]").unwrap();
        assert!(Companions::beside(d).is_err());

        // A checkpoint's: from the config.json its manifest lists, checked against it.
        let bytes = br#"{"eos_token_id": 5}"#;
        std::fs::write(d.join("config.json"), bytes).unwrap();
        let manifest = |bytes: u64, xxh3: String| Manifest {
            format_version: checkpoint::FORMAT_VERSION,
            step: 1,
            files: vec![ManifestFile {
                name: "config.json".into(),
                bytes,
                xxh3,
            }],
        };
        let c = Companions::listed_in(
            d,
            &manifest(bytes.len() as u64, checkpoint::checksum(bytes)),
        )
        .unwrap();
        assert_eq!(c.token_ids().unwrap()["eos_token_id"], 5);
        assert!(c.files().next().is_none() && !c.is_empty());
        let e = Companions::listed_in(
            d,
            &manifest(bytes.len() as u64, checkpoint::checksum(b"{}")),
        )
        .unwrap_err();
        assert!(e.to_string().contains("config.json"), "{e}");
        let e = Companions::listed_in(d, &manifest(u64::MAX, String::new())).unwrap_err();
        assert!(e.to_string().contains("larger"), "{e}");
    }

    /// A base with the story tokenizer (`</s>` is id 1, `▁near` a plain token), `config`'s
    /// ids and `generation`'s generation config, read as a run reads it.
    fn story_base(config: &str, generation: Option<&str>) -> (tempfile::TempDir, Companions) {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        std::fs::copy(
            Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("tests/fixtures/tokenizer/story/tokenizer.json"),
            d.join("tokenizer.json"),
        )
        .unwrap();
        std::fs::write(d.join("tokenizer_config.json"), r#"{"eos_token": "</s>"}"#).unwrap();
        std::fs::write(d.join("config.json"), config).unwrap();
        if let Some(g) = generation {
            std::fs::write(d.join("generation_config.json"), g).unwrap();
        }
        let c = Companions::beside(d).unwrap();
        (dir, c)
    }

    fn file_json(c: &Companions, name: &str) -> serde_json::Value {
        serde_json::from_slice(c.file(name).unwrap()).unwrap()
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(24))]
        /// Whatever eos ids the base had (none, one, a list, null), the new eos goes in front
        /// of them once, they all stay, and applying it again changes nothing: a resume with
        /// the same `--eos-token` writes the same files.
        #[test]
        fn eos_token_goes_in_front_once_and_keeps_the_earlier_ids(
            token in proptest::sample::select(vec!["</s>", "<unk>", "▁near", ".", "▁the"]),
            config_eos in proptest::option::of(proptest::collection::vec(0u32..90, 0..4)),
            generation_eos in proptest::option::of(proptest::option::of(
                proptest::collection::vec(0u32..90, 0..4))),
            scalar in proptest::bool::ANY,
        ) {
            let as_value = |ids: &[u32]| -> serde_json::Value {
                if scalar && ids.len() == 1 { ids[0].into() } else { ids.to_vec().into() }
            };
            let config = match &config_eos {
                Some(ids) => serde_json::json!({"bos_token_id": 1, "eos_token_id": as_value(ids)}),
                None => serde_json::json!({"bos_token_id": 1}),
            };
            let generation = generation_eos.as_ref().map(|g| match g {
                Some(ids) => serde_json::json!({"eos_token_id": as_value(ids), "top_k": 5}),
                None => serde_json::json!({"eos_token_id": null}),
            }.to_string());
            let (_dir, base) = story_base(&config.to_string(), generation.as_deref());
            let id = base.tokenizer().unwrap().unwrap().token_id(token).unwrap();
            let once = base.clone().with_eos_token(token).unwrap();
            let twice = once.clone().with_eos_token(token).unwrap();
            proptest::prop_assert_eq!(&once, &twice);

            proptest::prop_assert_eq!(&once.token_ids().unwrap()["eos_token_id"], &serde_json::Value::from(id));
            proptest::prop_assert_eq!(&once.token_ids().unwrap()["bos_token_id"], &serde_json::Value::from(1));
            proptest::prop_assert_eq!(&file_json(&once, TOKENIZER_CONFIG)["eos_token"], token);
            let earlier: Vec<u32> = match &generation_eos {
                Some(Some(ids)) => ids.clone(),
                Some(None) => vec![],
                // Made from config.json's, as transformers makes one.
                None => config_eos.clone().unwrap_or_default(),
            };
            let stops = file_json(&once, crate::sample::GENERATION_CONFIG);
            let stops: Vec<u32> = stops["eos_token_id"].as_array().unwrap().iter()
                .map(|v| v.as_u64().unwrap() as u32).collect();
            let expected: Vec<u32> = if earlier.contains(&id) {
                earlier.clone()
            } else {
                std::iter::once(id).chain(earlier.iter().copied()).collect()
            };
            proptest::prop_assert_eq!(stops, expected);
            if generation_eos.is_none() {
                // A made generation config takes config.json's bos too.
                proptest::prop_assert_eq!(&file_json(&once, crate::sample::GENERATION_CONFIG)["bos_token_id"], 1);
            } else if let Some(Some(_)) = &generation_eos {
                // Other settings stay.
                proptest::prop_assert_eq!(&file_json(&once, crate::sample::GENERATION_CONFIG)["top_k"], 5);
            }
        }
    }

    #[test]
    fn eos_token_and_chat_template_need_a_tokenizer_that_has_them() {
        let (dir, base) = story_base(r#"{"eos_token_id": 2}"#, None);
        let e = base
            .clone()
            .with_eos_token("<|im_end|>")
            .unwrap_err()
            .to_string();
        assert!(e.contains("<|im_end|>") && e.contains("vocabulary"), "{e}");
        let no_tokenizer = Companions::none();
        for e in [
            no_tokenizer.clone().with_eos_token("</s>").unwrap_err(),
            no_tokenizer
                .with_chat_template(Path::new("t.jinja"))
                .unwrap_err(),
        ] {
            assert!(e.to_string().contains("carries none"), "{e}");
        }
        // special_tokens_map.json (transformers 4 reads it over tokenizer_config.json) changes
        // too where there is one; a tokenizer_config.json that is not an object is refused.
        let d = dir.path();
        std::fs::write(
            d.join("special_tokens_map.json"),
            r#"{"eos_token": "</s>", "unk_token": "<unk>"}"#,
        )
        .unwrap();
        let c = Companions::beside(d)
            .unwrap()
            .with_eos_token("▁near")
            .unwrap();
        let map = file_json(&c, SPECIAL_TOKENS_MAP);
        assert_eq!(
            (&map["eos_token"], &map["unk_token"]),
            (&"▁near".into(), &"<unk>".into())
        );
        std::fs::write(d.join("tokenizer_config.json"), "[]").unwrap();
        let e = Companions::beside(d)
            .unwrap()
            .with_eos_token("</s>")
            .unwrap_err();
        assert!(e.to_string().contains("tokenizer_config.json"), "{e}");

        // A chat template replaces every template the tokenizer had; one that does not parse
        // is refused.
        std::fs::write(
            d.join("tokenizer_config.json"),
            r#"{"eos_token": "</s>", "chat_template": [{"name": "default", "template": "x"}]}"#,
        )
        .unwrap();
        std::fs::write(d.join("chat_template.json"), r#"{"chat_template": "y"}"#).unwrap();
        std::fs::create_dir(d.join(NAMED_TEMPLATES_DIR)).unwrap();
        std::fs::write(d.join("additional_chat_templates/tool_use.jinja"), "z").unwrap();
        let template = d.join("train.jinja");
        std::fs::write(&template, "{{ messages | length }}").unwrap();
        let c = Companions::beside(d)
            .unwrap()
            .with_chat_template(&template)
            .unwrap();
        let names: Vec<&str> = c.files().map(|(n, _)| n).collect();
        assert_eq!(
            names,
            [
                "chat_template.jinja",
                "special_tokens_map.json",
                "tokenizer.json",
                "tokenizer_config.json"
            ]
        );
        assert_eq!(
            c.file("chat_template.jinja").unwrap(),
            b"{{ messages | length }}"
        );
        assert!(file_json(&c, TOKENIZER_CONFIG)
            .get("chat_template")
            .is_none());
        std::fs::write(&template, "{% if %}").unwrap();
        assert!(Companions::beside(d)
            .unwrap()
            .with_chat_template(&template)
            .is_err());
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
