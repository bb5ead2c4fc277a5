//! Text to token files and tokens back to text: GPT-2's byte-level BPE (its ranks ship inside
//! `tiktoken-rs`, no download) or any Hugging Face `tokenizer.json` (the `tokenizers` crate).
//!
//! [`build`] streams a UTF-8 file through a tokenizer into any format headroom-mmap-data
//! writes, threaded over pieces of the text in order; a piece boundary never changes the
//! tokens: it falls on a document separator, or for GPT-2's BPE after a newline that precedes
//! a letter or digit, where GPT-2's pre-tokenizer splits anyway (a whole-file encode gives the
//! same ids; tested). A Hugging Face tokenizer may add a prefix or special tokens per call, so
//! it is split at document separators only. Its file's truncation and padding are cleared (they
//! would cut or pad every piece) and BPE dropout is refused (it makes the ids random).

use std::collections::{BTreeMap, VecDeque};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};

use headroom_mmap_data::formats::shards::{self, Sharding};
use headroom_mmap_data::formats::writer::TokenWriter;
use headroom_mmap_data::{LlmcFlavor, TokenFileFormat, TokenType};
use rayon::prelude::*;

use crate::chat_template::{ChatRequest, ChatTemplate, ChatValue};
use crate::{Result, TrainError};

/// GPT-2's vocabulary (50 256 merges and bytes, plus `<|endoftext|>`).
pub const GPT2_VOCAB: usize = 50257;
/// GPT-2's `<|endoftext|>`.
pub const GPT2_EOT: u32 = 50256;
/// Bytes of text per piece handed to a thread.
const PIECE_BYTES: usize = 1 << 20;
/// The largest `tokenizer.json` read (real ones are tens of MiB at most).
const MAX_TOKENIZER_BYTES: u64 = 1 << 30;

fn err(path: impl Into<PathBuf>, reason: impl Into<String>) -> TrainError {
    TrainError::Tokenizer {
        path: path.into(),
        reason: reason.into(),
    }
}

/// A tokenizer: GPT-2's, or a Hugging Face `tokenizer.json`.
pub enum Tokenizer {
    /// GPT-2's byte-level BPE (`r50k_base`).
    Gpt2(Box<tiktoken_rs::CoreBPE>),
    /// A Hugging Face tokenizer, as [`Tokenizer::from_name`] loaded and checked it.
    HuggingFace(Box<HfTokenizer>),
}

/// Whether a decoder's JSON holds a decoder of type `kind`, at any depth (a `Sequence`'s).
fn json_names_type(v: &serde_json::Value, kind: &str) -> bool {
    match v {
        serde_json::Value::Object(o) => {
            o.get("type").and_then(|t| t.as_str()) == Some(kind)
                || o.values().any(|v| json_names_type(v, kind))
        }
        serde_json::Value::Array(a) => a.iter().any(|v| json_names_type(v, kind)),
        _ => false,
    }
}

/// The byte a byte-level BPE character stands for (GPT-2's `bytes_to_unicode`, inverted): the
/// printable bytes as themselves, the other 68 as U+0100 onwards in byte order.
fn byte_of_level_char(c: char) -> Option<u8> {
    let printable = |b: u8| matches!(b, 33..=126 | 161..=172 | 174..=255);
    let code = u32::from(c);
    if code < 256 && printable(code as u8) {
        return Some(code as u8);
    }
    let n = code.checked_sub(256)? as usize;
    (0..=255u8).filter(|&b| !printable(b)).nth(n)
}

/// A Hugging Face tokenizer without its truncation and padding, from a file whose model
/// tokenizes deterministically; only [`Tokenizer::from_name`] makes one.
pub struct HfTokenizer {
    tok: tokenizers::Tokenizer,
    path: PathBuf,
    /// Highest id (model vocabulary and added tokens) + 1.
    vocab: usize,
}

impl HfTokenizer {
    /// The `tokenizer.json` it was read from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// `f(tokenizer)`, a panic of the `tokenizers` crate (it has some on hostile settings: a
    /// Strip decoder that strips a one-character token from both ends, a corrupt precompiled
    /// normalizer) turned into an error naming the file.
    fn guarded<T>(
        &self,
        f: impl FnOnce(&tokenizers::Tokenizer) -> tokenizers::Result<T>,
    ) -> Result<T> {
        guarded(&self.path, || f(&self.tok))
    }
}

/// `f()`, its error or a panic inside it turned into a [`TrainError::Tokenizer`] for `path`.
fn guarded<T>(path: &Path, f: impl FnOnce() -> tokenizers::Result<T>) -> Result<T> {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(r) => r.map_err(|e| err(path, e.to_string())),
        Err(_) => Err(err(
            path,
            "the tokenizers library panicked on this tokenizer (a setting it does not check)",
        )),
    }
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Tokenizer::Gpt2(_) => write!(f, "Tokenizer::Gpt2"),
            Tokenizer::HuggingFace(t) => {
                write!(f, "Tokenizer::HuggingFace({})", t.path.display())
            }
        }
    }
}

/// The Hugging Face tokenizer of the file `path`, made to give each text's own ids and nothing
/// else: its truncation and padding (which would cut or pad every encoded piece of a token file,
/// and which the `tokenizers` crate panics on for some values) are cleared, and a BPE model
/// with dropout (a training-time augmentation: random ids) is refused.
fn load_hugging_face(path: PathBuf) -> Result<HfTokenizer> {
    let bytes = crate::bounded::read_file(&path, MAX_TOKENIZER_BYTES).map_err(|r| err(&path, r))?;
    hugging_face_of(&bytes, path)
}

/// [`load_hugging_face`] of a `tokenizer.json`'s bytes, read from `path`.
fn hugging_face_of(bytes: &[u8], path: PathBuf) -> Result<HfTokenizer> {
    let mut tok = guarded(&path, || tokenizers::Tokenizer::from_bytes(bytes))?;
    tok.with_truncation(None)
        .map_err(|e| err(&path, e.to_string()))?
        .with_padding(None);
    if let tokenizers::models::ModelWrapper::BPE(bpe) = tok.get_model() {
        if let Some(p) = bpe.dropout.filter(|&p| p != 0.0) {
            return Err(err(
                &path,
                format!(
                    "BPE dropout {p}: its encodings are random; set the model's \"dropout\" to \
                     null to tokenize data with it"
                ),
            ));
        }
    }
    // Ids need not be dense (a vocabulary {"a": 0, "b": 60000} encodes to 60000), so the size is
    // the highest id + 1, not the number of tokens.
    let highest = tok
        .get_vocab(true)
        .into_values()
        .chain(tok.get_added_tokens_decoder().into_keys())
        .max();
    let vocab = match highest {
        None => 0,
        Some(id) => usize::try_from(u64::from(id) + 1)
            .map_err(|_| err(&path, format!("id {id} does not fit this machine")))?,
    };
    Ok(HfTokenizer { tok, path, vocab })
}

impl Tokenizer {
    /// `gpt2`, or the path of a `tokenizer.json` (or of a directory holding one).
    pub fn from_name(name: &str) -> Result<Self> {
        if name == "gpt2" {
            let bpe = tiktoken_rs::r50k_base().map_err(|e| err("gpt2", e.to_string()))?;
            return Ok(Tokenizer::Gpt2(Box::new(bpe)));
        }
        let mut path = PathBuf::from(name);
        if path.is_dir() {
            path = path.join("tokenizer.json");
        }
        Ok(Tokenizer::HuggingFace(Box::new(load_hugging_face(path)?)))
    }

    /// The Hugging Face tokenizer of a `tokenizer.json`'s bytes, held in memory (a run's
    /// carried files, [`crate::companions::Companions`]); `path` names them in errors, and
    /// nothing is read beside it.
    pub fn from_json_bytes(bytes: &[u8], path: &Path) -> Result<Self> {
        if bytes.len() as u64 > MAX_TOKENIZER_BYTES {
            return Err(err(path, format!("more than {MAX_TOKENIZER_BYTES} bytes")));
        }
        Ok(Tokenizer::HuggingFace(Box::new(hugging_face_of(
            bytes,
            path.to_path_buf(),
        )?)))
    }

    /// The tokenizer a checkpoint directory carries (`tokenizer.json`), if any.
    pub fn beside(dir: &Path) -> Option<Result<Self>> {
        let file = dir.join("tokenizer.json");
        file.is_file()
            .then(|| Self::from_name(&file.to_string_lossy()))
    }

    /// Ids run from 0 to `vocab_size() - 1` (special tokens included): the highest id + 1, as a
    /// Hugging Face vocabulary's ids may leave gaps.
    pub fn vocab_size(&self) -> usize {
        match self {
            Tokenizer::Gpt2(_) => GPT2_VOCAB,
            Tokenizer::HuggingFace(t) => t.vocab,
        }
    }

    /// The end-of-text token that separates documents: GPT-2's `<|endoftext|>`; for a Hugging
    /// Face tokenizer the first of `<|endoftext|>`, `</s>`, `<|end_of_text|>`, `<eos>` it has.
    pub fn end_of_text(&self) -> Option<u32> {
        match self {
            Tokenizer::Gpt2(_) => Some(GPT2_EOT),
            Tokenizer::HuggingFace(t) => ["<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>"]
                .iter()
                .find_map(|s| t.tok.token_to_id(s)),
        }
    }

    /// The token transformers' tokenizer calls `eos_token`: a Hugging Face tokenizer's from
    /// the `tokenizer_config.json` beside its `tokenizer.json`, else (no such file, or no
    /// `eos_token` in it) [`Tokenizer::end_of_text`]. TRL ends each text and prompt-completion
    /// example with it: an instruct model's end of turn (`<|im_end|>`, `<|eot_id|>`) where the
    /// vocabulary also has a document separator. A configured token the vocabulary lacks is an
    /// error.
    pub fn eos_token(&self) -> Result<Option<u32>> {
        Ok(self.configured_token("eos_token")?.or(self.end_of_text()))
    }

    /// The token transformers' tokenizer calls `bos_token`: GPT-2's `<|endoftext|>`; a Hugging
    /// Face tokenizer's from the `tokenizer_config.json` beside its `tokenizer.json`, `None`
    /// when it names none. A configured token the vocabulary lacks is an error.
    pub fn bos_token(&self) -> Result<Option<u32>> {
        match self {
            Tokenizer::Gpt2(_) => Ok(Some(GPT2_EOT)),
            Tokenizer::HuggingFace(_) => self.configured_token("bos_token"),
        }
    }

    /// The id of the special token `name` (`eos_token`, `bos_token`) of a Hugging Face
    /// tokenizer's `tokenizer_config.json`; `None` for GPT-2's BPE, without the file, or
    /// when it does not name one.
    fn configured_token(&self, name: &str) -> Result<Option<u32>> {
        let Tokenizer::HuggingFace(t) = self else {
            return Ok(None);
        };
        let special = crate::chat_template::special_tokens_beside(t.path())?;
        match special.get(name) {
            None => Ok(None),
            Some(text) => match t.tok.token_to_id(text) {
                Some(id) => Ok(Some(id)),
                None => Err(err(
                    t.path(),
                    format!("tokenizer_config.json's {name} {text:?} is not in the vocabulary"),
                )),
            },
        }
    }

    /// The ids of `text`. GPT-2's BPE encodes special-token strings in it as ordinary text (so
    /// data cannot inject `<|endoftext|>`); a Hugging Face tokenizer, as in transformers, maps
    /// the text of each of its added tokens to that token's id.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        match self {
            Tokenizer::Gpt2(bpe) => Ok(bpe.encode_ordinary(text)),
            Tokenizer::HuggingFace(t) => {
                t.guarded(|t| Ok(t.encode(text, false)?.get_ids().to_vec()))
            }
        }
    }

    /// The ids of `text` as the model sees a sequence start: with the special tokens the
    /// tokenizer adds around a sequence (a Llama tokenizer's `<s>`; GPT-2's adds none), as
    /// transformers' `tokenizer(text)` gives them; special-token strings inside `text` as
    /// [`Tokenizer::encode`] treats them.
    pub fn encode_sequence(&self, text: &str) -> Result<Vec<u32>> {
        match self {
            Tokenizer::Gpt2(bpe) => Ok(bpe.encode_ordinary(text)),
            Tokenizer::HuggingFace(t) => {
                t.guarded(|t| Ok(t.encode(text, true)?.get_ids().to_vec()))
            }
        }
    }

    /// The chat template of a Hugging Face tokenizer: from the files beside its
    /// `tokenizer.json` where transformers reads it (`chat_template.jinja`,
    /// `additional_chat_templates/`, `tokenizer_config.json`; [`ChatTemplate::beside`]). `None` for GPT-2's built-in BPE and
    /// for a tokenizer without one.
    pub fn chat_template(&self) -> Result<Option<crate::chat_template::ChatTemplate>> {
        match self {
            Tokenizer::HuggingFace(t) => crate::chat_template::ChatTemplate::beside(t.path()),
            Tokenizer::Gpt2(_) => Ok(None),
        }
    }

    /// The ids of `text` (as [`Tokenizer::encode`] gives them) and which of them overlap any
    /// of the byte ranges `spans` (in order, not overlapping): transformers'
    /// `return_assistant_tokens_mask` over the spans of a chat template's `{% generation %}`
    /// blocks, by the tokens' offsets into `text`. Hugging Face tokenizers only (GPT-2's has no
    /// chat template).
    pub fn encode_marking(
        &self,
        text: &str,
        spans: &[std::ops::Range<usize>],
    ) -> Result<(Vec<u32>, Vec<bool>)> {
        let Tokenizer::HuggingFace(t) = self else {
            return Err(err(
                self.source(),
                "only a Hugging Face tokenizer gives token offsets",
            ));
        };
        let encoding = t.guarded(|t| t.encode(text, false))?;
        // transformers' rule: a token counts when it overlaps a span, so a token that straddles
        // a span's edge counts; one pass, as both are in order.
        let mut marked = vec![false; encoding.len()];
        let mut span = 0;
        for (flag, &(start, end)) in marked.iter_mut().zip(encoding.get_offsets()) {
            while span < spans.len() && start >= spans[span].end {
                span += 1;
            }
            if span == spans.len() {
                break;
            }
            *flag = end > spans[span].start;
        }
        Ok((encoding.get_ids().to_vec(), marked))
    }

    /// Whether `id` is one of the tokens added to the model's vocabulary (special tokens such
    /// as a chat model's end of turn); GPT-2's `<|endoftext|>`.
    pub fn is_added_token(&self, id: u32) -> bool {
        match self {
            Tokenizer::Gpt2(_) => id == GPT2_EOT,
            Tokenizer::HuggingFace(t) => t.tok.get_added_tokens_decoder().contains_key(&id),
        }
    }

    /// The Jinja chat template file `template` in place of the tokenizer's own, with the
    /// special tokens of the `tokenizer_config.json` beside its `tokenizer.json`
    /// ([`ChatTemplate::from_file`]).
    pub fn chat_template_from(&self, template: &Path) -> Result<ChatTemplate> {
        match self {
            Tokenizer::HuggingFace(t) => ChatTemplate::from_file(template, Some(t.path())),
            Tokenizer::Gpt2(_) => ChatTemplate::from_file(template, None),
        }
    }

    /// The id of a token given by its text (a special token's, such as a chat template's
    /// end of turn), if the vocabulary has it.
    pub fn token_id(&self, text: &str) -> Option<u32> {
        match self {
            Tokenizer::Gpt2(_) => (text == "<|endoftext|>").then_some(GPT2_EOT),
            Tokenizer::HuggingFace(t) => t.tok.token_to_id(text),
        }
    }

    /// The text of `ids`; bytes that are not valid UTF-8 on their own (a character split
    /// across tokens) are replaced by U+FFFD.
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.check_in_vocabulary(ids)?;
        match self {
            Tokenizer::Gpt2(bpe) => {
                let bytes = bpe
                    .decode_bytes(ids)
                    .map_err(|e| err("gpt2", e.to_string()))?;
                Ok(String::from_utf8_lossy(&bytes).into_owned())
            }
            Tokenizer::HuggingFace(t) => t.guarded(|t| t.decode(ids, false)),
        }
    }

    /// [`Tokenizer::decode`] without the special tokens (`decode(ids,
    /// skip_special_tokens=True)`, as lm-eval decodes a generation): GPT-2's `<|endoftext|>`,
    /// a Hugging Face tokenizer's added tokens marked special. Ids the vocabulary lacks (a
    /// padded embedding's rows, which a model may still pick) add nothing, as transformers
    /// skips them.
    pub fn decode_skipping_special(&self, ids: &[u32]) -> Result<String> {
        let vocab = self.vocab_size();
        let known = |id: &u32| (*id as usize) < vocab;
        match self {
            Tokenizer::Gpt2(_) => {
                let kept: Vec<u32> = ids
                    .iter()
                    .copied()
                    .filter(|id| known(id) && *id != GPT2_EOT)
                    .collect();
                self.decode(&kept)
            }
            Tokenizer::HuggingFace(t) => {
                let kept: Vec<u32> = ids.iter().copied().filter(known).collect();
                t.guarded(|t| t.decode(&kept, true))
            }
        }
    }

    /// The bytes token `id` adds to a text, as transformers' `StopStringCriteria` reads its
    /// vocabulary (`clean_tokenizer_vocab`): for a byte-level tokenizer (GPT-2's, or a
    /// `ByteLevel` decoder) the bytes its characters stand for, incomplete UTF-8 included; for a
    /// `ByteFallback` one `<0xNN>` is that byte; any other token is decoded after a fixed
    /// prefix, whose text is then cut off, so that a word-initial space is kept.
    pub fn token_bytes(&self, id: u32) -> Result<Vec<u8>> {
        self.check_in_vocabulary(&[id])?;
        let t = match self {
            Tokenizer::Gpt2(bpe) => {
                return bpe
                    .decode_bytes(&[id])
                    .map_err(|e| err("gpt2", e.to_string()))
            }
            Tokenizer::HuggingFace(t) => t,
        };
        let token = t.tok.id_to_token(id).unwrap_or_default();
        let decoder = t
            .tok
            .get_decoder()
            .and_then(|d| serde_json::to_value(d).ok())
            .unwrap_or_default();
        let names = |kind: &str| json_names_type(&decoder, kind);
        if decoder["type"] != "ByteLevel" && names("ByteFallback") {
            if let Some(byte) = token
                .strip_prefix("<0x")
                .and_then(|h| h.strip_suffix('>'))
                .filter(|h| h.len() == 2)
                .and_then(|h| u8::from_str_radix(h, 16).ok())
            {
                return Ok(vec![byte]);
            }
        } else if names("ByteLevel") {
            if let Some(bytes) = token.chars().map(byte_of_level_char).collect() {
                return Ok(bytes);
            }
        }
        const PREFIX: &str = "abcdef";
        let mut ids = t.guarded(|t| t.encode(PREFIX, false))?.get_ids().to_vec();
        ids.push(id);
        let text = t.guarded(|t| t.decode(&ids, false))?;
        Ok(match text.find(PREFIX) {
            Some(at) => text.as_bytes()[at + PREFIX.len()..].to_vec(),
            None => text.into_bytes(),
        })
    }

    /// A typed error naming the first of `ids` outside the vocabulary.
    fn check_in_vocabulary(&self, ids: &[u32]) -> Result<()> {
        let vocab = self.vocab_size();
        match ids.iter().find(|&&i| i as usize >= vocab) {
            Some(bad) => Err(err(
                self.source(),
                format!("id {bad} is outside the vocabulary of {vocab}"),
            )),
            None => Ok(()),
        }
    }

    fn source(&self) -> PathBuf {
        match self {
            Tokenizer::Gpt2(_) => "gpt2".into(),
            Tokenizer::HuggingFace(t) => t.path.clone(),
        }
    }

    /// Whether a piece boundary after byte `at` of `text` leaves the tokens unchanged.
    fn safe_cut(&self, text: &[u8], at: usize) -> bool {
        match self {
            // GPT-2's pre-tokenizer makes "\n" before a non-space its own pre-token, and a
            // letter or digit after it starts a new one without a leading space.
            Tokenizer::Gpt2(_) => {
                at > 0
                    && at < text.len()
                    && text[at - 1] == b'\n'
                    && text[at].is_ascii_alphanumeric()
            }
            Tokenizer::HuggingFace(..) => false,
        }
    }
}

/// The token type a file of `vocab` ids needs: u16 up to 65 536 ids, else u32.
pub fn token_type_for(vocab: usize) -> TokenType {
    if vocab <= 1 << 16 {
        TokenType::U16
    } else {
        TokenType::U32
    }
}

/// A file format by name, its token type chosen for `vocab`: `raw` (nanoGPT `.bin`), `llmc`
/// (llm.c's GPT-2 flavour for u16 ids, Llama 3's for u32), `megatron`; `raw-u16`, `raw-u32`
/// force the type (and are checked against the vocabulary when written).
pub fn format_for(name: &str, vocab: usize) -> Result<TokenFileFormat> {
    let t = token_type_for(vocab);
    Ok(match name {
        "raw" => TokenFileFormat::Raw(t),
        "raw-u16" | "nanogpt" => TokenFileFormat::Raw(TokenType::U16),
        "raw-u32" => TokenFileFormat::Raw(TokenType::U32),
        "llmc" => TokenFileFormat::Llmc(if t == TokenType::U16 {
            LlmcFlavor::Gpt2
        } else {
            LlmcFlavor::Llama3
        }),
        "megatron" => TokenFileFormat::Megatron {
            token_type: t,
            document_len: 1 << 20,
        },
        other => {
            return Err(TrainError::Option {
                option: "--format",
                reason: format!("{other:?}: use raw, raw-u16, raw-u32, llmc or megatron"),
            })
        }
    })
}

/// What [`build_corpus`] wrote.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BuildReport {
    /// Every file written with its size in bytes (Megatron: the `.bin`, then the `.idx`).
    pub files: Vec<(std::path::PathBuf, u64)>,
    /// The token files: the one output, or its shards in order.
    pub shards: Vec<PathBuf>,
    /// Tokens written.
    pub tokens: u64,
    /// Documents (records, separator-delimited pieces of text).
    pub documents: u64,
    /// Cuts between shards that fall inside a document (continued in the next shard, as
    /// llm.c's `fineweb.py` cuts them).
    pub cuts_inside_documents: u64,
    /// An earlier build's shards of the same name, removed before writing (resuming: the
    /// shards after those kept).
    pub removed: Vec<PathBuf>,
    /// The build stopped after [`CorpusOptions::stop_after_shards`] shards: `--resume`
    /// continues it.
    pub stopped: bool,
    /// Resuming: the shards an earlier run had finished, kept as they were.
    pub kept_shards: u64,
    /// Bytes of text read.
    pub text_bytes: u64,
    /// The format written (its token type fits the vocabulary).
    pub format: TokenFileFormat,
    /// The tokenizer's vocabulary.
    pub vocab: usize,
}

/// The text's pieces in order, each `(document, start, end)`: documents split at `separator`,
/// long documents cut where the tokenizer allows.
fn pieces(tok: &Tokenizer, text: &[u8], separator: Option<&[u8]>) -> Vec<(u64, usize, usize)> {
    let mut docs = Vec::new();
    let mut start = 0;
    if let Some(sep) = separator.filter(|s| !s.is_empty()) {
        let mut i = 0;
        while i + sep.len() <= text.len() {
            if &text[i..i + sep.len()] == sep {
                docs.push((start, i));
                i += sep.len();
                start = i;
            } else {
                i += 1;
            }
        }
    }
    docs.push((start, text.len()));
    let mut out = Vec::new();
    for (d, (s, e)) in docs.into_iter().enumerate() {
        let mut a = s;
        while e - a > PIECE_BYTES {
            let mut cut = a + PIECE_BYTES;
            while cut < e && !tok.safe_cut(text, cut) {
                cut += 1;
            }
            if cut >= e {
                break;
            }
            out.push((d as u64, a, cut));
            a = cut;
        }
        out.push((d as u64, a, e));
    }
    out
}

/// The file `input` mapped read-only, checked to be non-empty UTF-8 text.
fn map_text(input: &Path) -> Result<memmap2::Mmap> {
    let file = std::fs::File::open(input).map_err(|e| err(input, e.to_string()))?;
    if file
        .metadata()
        .map_err(|e| err(input, e.to_string()))?
        .len()
        == 0
    {
        return Err(err(input, "empty file"));
    }
    // SAFETY: a read-only map that nothing here writes through; the file must not be changed
    // while it is tokenized (as for any memory-mapped reader, headroom-mmap-data's included).
    let map = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| err(input, e.to_string()))?;
    if let Err(e) = std::str::from_utf8(&map) {
        return Err(err(
            input,
            format!(
                "not UTF-8 text (byte {}): tokenize text files",
                e.valid_up_to()
            ),
        ));
    }
    Ok(map)
}

/// A record's tokens and the length of the text they encode.
type EncodedRecord = (Vec<u32>, usize);

/// A parallel map's results in input order, or the error of the earliest input that failed.
/// rayon's `collect::<Result<_>>()` returns whichever error a worker met first, so a file with
/// several bad records would be reported at a different record from run to run; the work of a
/// batch after its first error is wasted, which only a failing build pays.
fn first_error_in_order<T>(results: Vec<Result<T>>) -> Result<Vec<T>> {
    results.into_iter().collect()
}

/// The file `input` mapped read-only, checked to be non-empty.
pub(crate) fn map_file(input: &Path) -> Result<memmap2::Mmap> {
    let file = std::fs::File::open(input).map_err(|e| err(input, e.to_string()))?;
    let len = file
        .metadata()
        .map_err(|e| err(input, e.to_string()))?
        .len();
    if len == 0 {
        return Err(err(input, "empty file"));
    }
    // SAFETY: as in `map_text`: read-only, and the file must not change while it is read.
    unsafe { memmap2::Mmap::map(&file) }.map_err(|e| err(input, e.to_string()))
}

/// The examples of a `data build --jsonl` input: its non-blank JSONL lines, or a Parquet or
/// Arrow file's rows (a Hugging Face dataset's split, as the Hub serves it or as `datasets`
/// saved it), each as the JSON object `datasets`' `to_json` would write, read a row group or
/// record batch at a time.
enum Examples<'a> {
    /// Each line numbered from 1.
    Lines(Vec<(usize, &'a str)>),
    /// The Parquet or Arrow file, parsed.
    Table(headroom_parquet::TableFile<'a>, &'a Path),
    /// gzip- or zstd-compressed JSON lines, decompressed as they are read.
    Compressed(Box<dyn std::io::BufRead + 'a>, &'a Path),
}

impl<'a> Examples<'a> {
    fn of(bytes: &'a [u8], input: &'a Path) -> Result<Examples<'a>> {
        if crate::choices::is_table(bytes) {
            let file =
                headroom_parquet::TableFile::parse(bytes).map_err(|e| err(input, e.to_string()))?;
            return Ok(Examples::Table(file, input));
        }
        if let Some(compression) = Compression::of_bytes(bytes) {
            return Ok(Examples::Compressed(
                decompressed(bytes, compression),
                input,
            ));
        }
        let text = std::str::from_utf8(bytes).map_err(|e| {
            err(
                input,
                format!(
                    "neither Parquet, Arrow nor UTF-8 JSONL (byte {})",
                    e.valid_up_to()
                ),
            )
        })?;
        Ok(Examples::Lines(
            text.lines()
                .enumerate()
                .filter(|(_, l)| !l.trim().is_empty())
                .map(|(i, l)| (i + 1, l))
                .collect(),
        ))
    }

    /// The examples, when known before reading them (not of a compressed file).
    fn len(&self) -> Option<u64> {
        match self {
            Examples::Lines(lines) => Some(lines.len() as u64),
            Examples::Table(file, _) => Some(file.num_rows()),
            Examples::Compressed(..) => None,
        }
    }

    /// What an error's number counts.
    fn unit(&self) -> &'static str {
        match self {
            Examples::Lines(_) | Examples::Compressed(..) => "line",
            Examples::Table(..) => "row",
        }
    }

    /// `each` over the examples in order, `batch` at a time; a Parquet or Arrow file is
    /// decoded one row group or record batch at a time, so memory holds one group's rows.
    fn for_each_batch(
        &mut self,
        batch: usize,
        mut each: impl FnMut(&[(usize, &str)]) -> Result<()>,
    ) -> Result<()> {
        match self {
            Examples::Lines(lines) => lines.chunks(batch).try_for_each(each),
            Examples::Compressed(reader, input) => {
                let mut number = 0u64;
                loop {
                    let mut lines = Vec::new();
                    while lines.len() < batch {
                        let Some(line) = next_line(reader.as_mut(), input, &mut number)? else {
                            break;
                        };
                        if !line.trim().is_empty() {
                            lines.push((number as usize, line));
                        }
                    }
                    if lines.is_empty() {
                        return Ok(());
                    }
                    let borrowed: Vec<(usize, &str)> =
                        lines.iter().map(|(n, l)| (*n, l.as_str())).collect();
                    each(&borrowed)?;
                }
            }
            Examples::Table(file, input) => {
                let mut number = 0;
                for g in 0..file.num_groups() {
                    let rows = file
                        .group(g, &headroom_parquet::ReadOptions::default())
                        .map_err(|e| err(*input, e.to_string()))?;
                    let lines = crate::choices::row_lines(rows);
                    let numbered: Vec<(usize, &str)> = lines
                        .iter()
                        .map(|l| {
                            number += 1;
                            (number, l.as_str())
                        })
                        .collect();
                    numbered.chunks(batch).try_for_each(&mut each)?;
                }
                Ok(())
            }
        }
    }
}

/// The next line of `reader` (without its newline), numbering it; `None` at the end. A line
/// longer than [`MAX_CORPUS_LINE_BYTES`] (a file without newlines, a decompression bomb) or
/// not UTF-8 is an error naming it.
fn next_line(
    reader: &mut dyn std::io::BufRead,
    input: &Path,
    number: &mut u64,
) -> Result<Option<String>> {
    use std::io::{BufRead, Read};
    let mut line = Vec::new();
    let n = reader
        .take(MAX_CORPUS_LINE_BYTES + 1)
        .read_until(b'\n', &mut line)
        .map_err(|e| err(input, format!("line {}: {e}", *number + 1)))?;
    if n == 0 {
        return Ok(None);
    }
    *number += 1;
    if n as u64 > MAX_CORPUS_LINE_BYTES {
        return Err(err(
            input,
            format!("line {number}: longer than {MAX_CORPUS_LINE_BYTES} bytes"),
        ));
    }
    while line.last().is_some_and(|&b| b == b'\n' || b == b'\r') {
        line.pop();
    }
    String::from_utf8(line)
        .map(Some)
        .map_err(|e| err(input, format!("line {number}: not UTF-8: {e}")))
}

/// `bytes`, decompressed as they are read.
fn decompressed<'a, R: std::io::Read + 'a>(
    source: R,
    compression: Compression,
) -> Box<dyn std::io::BufRead + 'a> {
    let raw = std::io::BufReader::new(source);
    match compression {
        Compression::None => Box::new(raw),
        Compression::Gzip => Box::new(std::io::BufReader::new(flate2::read::MultiGzDecoder::new(
            raw,
        ))),
        Compression::Zstd => Box::new(std::io::BufReader::new(ZstdFrames::new(raw))),
    }
}

/// Which token delimits a corpus's documents, and where it goes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum DocumentToken {
    /// The end-of-text token after each document (nanoGPT's `prepare.py`, Megatron's
    /// `--append-eod`). A text file's last document gets none unless another input follows
    /// it (the separator marks documents *between* others).
    #[default]
    End,
    /// The tokenizer's beginning-of-sequence token before each document, as llm.c's
    /// `fineweb.py` writes FineWeb: GPT-2's `<|endoftext|>`, Llama 3's `<|begin_of_text|>`.
    Start,
}

/// How `data build` reads its inputs and writes its output; [`Default`] is one file, each
/// document ended by the end-of-text token, records' text in `text`.
#[derive(Clone, Debug, Default)]
pub struct CorpusOptions {
    /// A text file's document separator (each becomes the delimiting token); without one a
    /// text file is one document.
    pub separator: Option<String>,
    /// The field a Parquet row's or JSON line's document is read from (default `text`).
    pub text_field: Option<String>,
    /// Read every input as JSON lines, whatever its extension (a text field was named).
    pub fields_named: bool,
    /// Which token delimits documents, and where.
    pub document_token: DocumentToken,
    /// Write numbered shards of this many tokens instead of one file.
    pub sharding: Option<Sharding>,
    /// Continue the sharded build that stopped or died here (its progress file beside the
    /// shards, of the same inputs and settings): its finished shards are kept and the rest
    /// written as the whole build would have written them.
    pub resume: bool,
    /// Sharded: stop cleanly after this many more shards, keeping the progress for
    /// [`CorpusOptions::resume`] (a build spread over jobs with a time limit).
    pub stop_after_shards: Option<u64>,
}

/// The delimiting token of a build, resolved against the tokenizer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Delimit {
    /// No token (one text file, no separator).
    Nothing,
    /// This token after each document.
    After(u32),
    /// This token before each document.
    Before(u32),
}

/// Tokenize the UTF-8 file `input` into `out` in `format`: each separator-delimited document
/// is encoded and followed by the end-of-text token (when there is a separator), documents end
/// Megatron sequences. Threaded over pieces in order; `progress` shows bytes done.
pub fn build(
    input: &Path,
    tok: &Tokenizer,
    format: TokenFileFormat,
    separator: Option<&str>,
    out: &Path,
    progress: bool,
) -> Result<BuildReport> {
    let options = CorpusOptions {
        separator: separator.map(str::to_owned),
        ..CorpusOptions::default()
    };
    build_kinds(
        &[(input.to_path_buf(), CorpusKind::Text)],
        tok,
        format,
        &options,
        out,
        progress,
    )
}

/// The files `data build` reads from `paths`, in order: a file as it is; a directory's
/// corpus files (`.parquet`, `.arrow`, `.jsonl`, `.json`, `.ndjson`, `.txt`, and `.gz` or
/// `.zst` compressed ones), its subdirectories' included, in path order, as a Hugging Face
/// dataset's shards are numbered and laid out (FineWeb's
/// `data/CC-MAIN-2024-10/000_00000.parquet`, a Hub snapshot's links to its blobs,
/// `save_to_disk`'s `data-00000-of-00004.arrow`). Hidden files and directories (`.git`,
/// `.cache`), the `datasets` library's metadata (`dataset_info.json`, `state.json`, …) and
/// the cache files its `map` and `filter` leave beside a split (`cache-*.arrow`, derived from
/// it, so reading them too would repeat it) are not read. A directory with none is an error,
/// and so is a `DatasetDict` of several splits (`dataset_dict.json`): one is to be named.
pub fn corpus_inputs(paths: &[PathBuf]) -> Result<Vec<PathBuf>> {
    let mut inputs = Vec::new();
    for path in paths {
        if !path.is_dir() {
            inputs.push(path.clone());
            continue;
        }
        let mut files = Vec::new();
        corpus_files_under(path, 0, &mut files)?;
        if files.is_empty() {
            return Err(err(
                path,
                "a directory with no corpus files (.parquet, .arrow, .jsonl, .json, .ndjson, \
                 .txt, .gz, .zst)",
            ));
        }
        files.sort();
        inputs.extend(files);
    }
    Ok(inputs)
}

/// Directory levels [`corpus_inputs`] descends: a Hub dataset nests two or three; a link
/// that loops back up must not recurse for ever.
const MAX_CORPUS_DEPTH: usize = 16;

/// The corpus files under `dir` (`depth` levels below the directory given), appended to
/// `files` in no particular order.
fn corpus_files_under(dir: &Path, depth: usize, files: &mut Vec<PathBuf>) -> Result<()> {
    // The `datasets` library's own files beside its data (`save_to_disk`, a cache directory).
    const METADATA: [&str; 4] = [
        "dataset_info.json",
        "dataset_infos.json",
        "dataset_dict.json",
        "state.json",
    ];
    if depth > MAX_CORPUS_DEPTH {
        return Err(err(
            dir,
            format!("more than {MAX_CORPUS_DEPTH} directory levels (a link that loops?)"),
        ));
    }
    refuse_several_splits(dir)?;
    for entry in std::fs::read_dir(dir).map_err(|e| err(dir, e.to_string()))? {
        let entry = entry.map_err(|e| err(dir, e.to_string()))?;
        let name = entry.file_name();
        let name = name.to_string_lossy();
        if name.starts_with('.') {
            continue;
        }
        let path = entry.path();
        if path.is_dir() {
            corpus_files_under(&path, depth + 1, files)?;
            continue;
        }
        let corpus = [
            ".parquet", ".arrow", ".jsonl", ".json", ".ndjson", ".txt", ".gz", ".zst",
        ]
        .iter()
        .any(|ext| name.ends_with(ext));
        let derived = name.starts_with("cache-") && name.ends_with(".arrow");
        if corpus && !derived && !METADATA.contains(&name.as_ref()) && path.is_file() {
            files.push(path);
        }
    }
    Ok(())
}

/// A `DatasetDict` that `datasets` saved (`dataset_dict.json` listing its splits, a
/// directory each) is refused when it holds several splits: read whole, its test split would be
/// trained on with its train split. One split's directory is read like any other.
fn refuse_several_splits(dir: &Path) -> Result<()> {
    let manifest = dir.join("dataset_dict.json");
    if !manifest.is_file() {
        return Ok(());
    }
    // A DatasetDict's manifest is a few dozen bytes; anything larger is not one.
    let Ok(text) = crate::bounded::read_file(&manifest, 1 << 20) else {
        return Ok(());
    };
    let Ok(value) = serde_json::from_slice::<serde_json::Value>(&text) else {
        return Ok(());
    };
    let splits: Vec<&str> = value["splits"]
        .as_array()
        .map(|a| a.iter().filter_map(|s| s.as_str()).collect())
        .unwrap_or_default();
    let present: Vec<&str> = splits
        .into_iter()
        .filter(|s| dir.join(s).is_dir())
        .collect();
    if present.len() > 1 {
        return Err(err(
            dir,
            format!(
                "a DatasetDict saved by `datasets`, with splits {} (its dataset_dict.json): \
                 name one split's directory, e.g. {}, so that one split is not trained on \
                 with another",
                present.join(", "),
                dir.join(present[0]).display()
            ),
        ));
    }
    Ok(())
}

/// Tokenize the corpus files `inputs`, in order, into one token stream written to `out` in
/// `format`, one file or shards ([`CorpusOptions::sharding`]). Each input is read by its kind
/// ([`CorpusKind::of`]): a Parquet or Arrow file's rows and JSON lines (plain, gzip or zstd)
/// are one document each; a text file is its separator-delimited documents. Documents are
/// delimited by [`CorpusOptions::document_token`]; with several inputs, a text file's last
/// document is delimited too, so that files never run into each other.
///
/// A build that fails leaves no partial file; a sharded one keeps the shards it finished (a
/// prefix of the stream, each shard complete).
pub fn build_corpus(
    inputs: &[PathBuf],
    tok: &Tokenizer,
    format: TokenFileFormat,
    options: &CorpusOptions,
    out: &Path,
    progress: bool,
) -> Result<BuildReport> {
    let kinds = inputs
        .iter()
        .map(|p| Ok((p.clone(), CorpusKind::of(p, options.fields_named)?)))
        .collect::<Result<Vec<_>>>()?;
    build_kinds(&kinds, tok, format, options, out, progress)
}

fn build_kinds(
    inputs: &[(PathBuf, CorpusKind)],
    tok: &Tokenizer,
    format: TokenFileFormat,
    options: &CorpusOptions,
    out: &Path,
    progress: bool,
) -> Result<BuildReport> {
    let vocab = tok.vocab_size();
    headroom_mmap_data::tools::check_vocab_fits(vocab as u64, format.token_type())?;
    if inputs.is_empty() {
        return Err(err(out, "no inputs"));
    }
    let any_records = inputs.iter().any(|(_, k)| *k != CorpusKind::Text);
    if any_records && options.separator.is_some() {
        return Err(err(
            out,
            "--separator: a Parquet, Arrow or JSONL corpus's records are its documents",
        ));
    }
    for (input, _) in inputs {
        // Sharded, the names of an earlier set are removed before writing: never an input.
        if options
            .sharding
            .is_some_and(|_| shards::is_shard_of(out, format, input))
        {
            return Err(err(
                input,
                "is named as one of the output's shards, which the build removes first",
            ));
        }
        if same_file(input, out) {
            return Err(err(input, "is the output file"));
        }
    }
    let delimit = match options.document_token {
        DocumentToken::Start => Delimit::Before(tok.bos_token()?.ok_or_else(|| {
            err(
                tok.source(),
                "no beginning-of-sequence token (tokenizer_config.json's bos_token) to start \
                 each document with",
            )
        })?),
        DocumentToken::End => {
            let needed = any_records || inputs.len() > 1 || options.separator.is_some();
            match (tok.end_of_text(), needed) {
                (_, false) => Delimit::Nothing,
                (Some(eot), true) => Delimit::After(eot),
                (None, true) => {
                    return Err(err(
                        tok.source(),
                        "no end-of-text token to end each document with",
                    ))
                }
            }
        }
    };
    let text_field = options.text_field.as_deref().unwrap_or("text");
    let mut emitter = Emitter::start(inputs, tok, format, options, out)?;
    for (i, (input, kind)) in inputs.iter().enumerate() {
        if emitter.resume_at.is_some_and(|at| at.input > i) {
            continue;
        }
        let prefix = if inputs.len() > 1 {
            format!("[{}/{}] ", i + 1, inputs.len())
        } else {
            String::new()
        };
        let last = i + 1 == inputs.len();
        let go_on = match kind {
            CorpusKind::Text => write_text(
                (i, input),
                tok,
                options.separator.as_deref(),
                delimit,
                last,
                &mut emitter,
                progress.then_some(prefix.as_str()),
            )?,
            kind => write_records(
                (i, input),
                *kind,
                tok,
                text_field,
                delimit,
                &mut emitter,
                progress.then_some(prefix.as_str()),
            )?,
        };
        if !go_on {
            break;
        }
    }
    emitter.finish(format, vocab)
}

/// Where a build stands: the unit (a record, or a piece of a text file) the next token comes
/// from, and how many of that unit's tokens are already written.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
struct Position {
    input: usize,
    unit: u64,
    tokens: u64,
    /// The unit continues a document begun before the cut.
    inside_document: bool,
}

/// A sharded build's progress, saved beside its shards (a hidden file, which neither a
/// directory nor a glob of the shards reads) each time a shard is finished, and removed when
/// the build completes: `data build --resume` continues from it.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
struct BuildState {
    /// What must be the same for the shards to continue: the inputs (path, size, modification
    /// time) and every setting that changes the tokens.
    settings: serde_json::Value,
    /// Shards finished.
    shards: u64,
    /// Where the finished shards end.
    next: Position,
    documents: u64,
    text_bytes: u64,
    cuts_inside_documents: u64,
}

/// The hidden progress file of a sharded build of `out`.
fn state_path(out: &Path) -> PathBuf {
    let name = out
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    out.with_file_name(format!(".{name}.build.json"))
}

/// Everything the tokens of a build depend on, to refuse a resume that would mix two builds.
fn build_settings(
    inputs: &[(PathBuf, CorpusKind)],
    tok: &Tokenizer,
    format: TokenFileFormat,
    options: &CorpusOptions,
) -> Result<serde_json::Value> {
    let mut files = Vec::new();
    for (path, _) in inputs {
        let meta = std::fs::metadata(path).map_err(|e| err(path, e.to_string()))?;
        let modified = meta
            .modified()
            .ok()
            .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
            .map_or(0, |d| d.as_nanos());
        files.push(serde_json::json!({
            "path": path.display().to_string(),
            "bytes": meta.len(),
            "modified_ns": modified.to_string(),
        }));
    }
    let tokenizer = match tok {
        Tokenizer::Gpt2(_) => "gpt2".to_owned(),
        Tokenizer::HuggingFace(t) => {
            let bytes = std::fs::read(t.path()).map_err(|e| err(t.path(), e.to_string()))?;
            format!(
                "{} xxh3 {:016x}",
                t.path().display(),
                xxhash_rust::xxh3::xxh3_64(&bytes)
            )
        }
    };
    Ok(serde_json::json!({
        "inputs": files,
        "tokenizer": tokenizer,
        "format": format!("{format:?}"),
        "sharding": options.sharding.map(|s| [s.shard_tokens, s.val_shards]),
        "document_token": format!("{:?}", options.document_token),
        "separator": options.separator,
        "text_field": options.text_field,
        "fields_named": options.fields_named,
    }))
}

/// The writer of a build and its progress: each unit's tokens go through [`Emitter::unit`],
/// which skips what a resumed build already has and saves the progress at every finished
/// shard.
struct Emitter {
    writer: shards::ShardedWriter,
    /// Sharded builds only: the progress file and the settings it records.
    state: Option<(PathBuf, serde_json::Value)>,
    /// Resuming: the first unit not wholly in the kept shards.
    resume_at: Option<Position>,
    saved_shards: u64,
    /// Shards finished when this run started, and how many more it may finish.
    started_shards: u64,
    stop_after: Option<u64>,
    documents: u64,
    text_bytes: u64,
    split_before: u64,
    stopped: bool,
}

impl Emitter {
    /// The writer of a fresh build (an earlier set's shards and progress removed), or of a
    /// resumed one (its finished shards kept, checked to be of the same inputs and settings).
    fn start(
        inputs: &[(PathBuf, CorpusKind)],
        tok: &Tokenizer,
        format: TokenFileFormat,
        options: &CorpusOptions,
        out: &Path,
    ) -> Result<Emitter> {
        let fresh = |writer| Emitter {
            writer,
            state: None,
            resume_at: None,
            saved_shards: 0,
            started_shards: 0,
            stop_after: options.stop_after_shards,
            documents: 0,
            text_bytes: 0,
            split_before: 0,
            stopped: false,
        };
        let Some(sharding) = options.sharding else {
            if options.resume {
                return Err(err(out, "only a sharded build (--shard-tokens) resumes"));
            }
            return Ok(fresh(shards::ShardedWriter::create(out, format, None)?));
        };
        let path = state_path(out);
        let settings = build_settings(inputs, tok, format, options)?;
        if !options.resume {
            // The progress goes first: a crash between the two must not leave progress that
            // points at removed shards.
            remove_if_present(&path)?;
            let mut emitter = fresh(shards::ShardedWriter::create(out, format, Some(sharding))?);
            emitter.state = Some((path, settings));
            return Ok(emitter);
        }
        let bytes = std::fs::read(&path).map_err(|e| {
            err(
                &path,
                format!("no build of these shards to resume ({e}): build without --resume"),
            )
        })?;
        let saved: BuildState = serde_json::from_slice(&bytes)
            .map_err(|e| err(&path, format!("not a build's progress: {e}")))?;
        if saved.settings != settings {
            let changed = settings
                .as_object()
                .into_iter()
                .flatten()
                .filter(|(k, v)| saved.settings.get(k.as_str()) != Some(v))
                .map(|(k, _)| k.as_str())
                .collect::<Vec<_>>()
                .join(", ");
            return Err(err(
                &path,
                format!(
                    "this build's {changed} changed since its shards were written: build \
                     again without --resume"
                ),
            ));
        }
        if saved.next.input >= inputs.len() {
            return Err(err(
                &path,
                "the progress points past the last input: build without --resume",
            ));
        }
        let writer = shards::ShardedWriter::resume(
            out,
            format,
            sharding,
            saved.shards,
            saved.next.inside_document && saved.next.tokens == 0,
        )?;
        Ok(Emitter {
            writer,
            state: Some((path, settings)),
            resume_at: Some(saved.next),
            saved_shards: saved.shards,
            started_shards: saved.shards,
            stop_after: options.stop_after_shards,
            documents: saved.documents,
            text_bytes: saved.text_bytes,
            split_before: saved.cuts_inside_documents,
            stopped: false,
        })
    }

    /// Whether unit `unit` of input `input` lies wholly in a resumed build's kept shards.
    fn already_written(&self, input: usize, unit: u64) -> bool {
        self.resume_at
            .is_some_and(|at| (input, unit) < (at.input, at.unit))
    }

    /// Write one unit's tokens (`sequence`: its delimiter included), which ends a document or
    /// not and read `bytes` of text. Returns `false` when the build is to stop here
    /// ([`CorpusOptions::stop_after_shards`]).
    fn unit(
        &mut self,
        (input, unit): (usize, u64),
        sequence: &[u32],
        ends_document: bool,
        bytes: u64,
    ) -> Result<bool> {
        if self.already_written(input, unit) {
            return Ok(true);
        }
        let mut skip = 0;
        if let Some(at) = self.resume_at.take() {
            if (input, unit) == (at.input, at.unit) {
                skip = usize::try_from(at.tokens).unwrap_or(usize::MAX);
            }
        }
        let Some(rest) = sequence.get(skip..) else {
            let progress = self
                .state
                .as_ref()
                .map_or(Path::new(""), |(p, _)| p.as_path());
            return Err(err(
                progress,
                "the progress points past the end of a unit: build without --resume",
            ));
        };
        if !rest.is_empty() {
            self.writer.write(rest)?;
        }
        if ends_document {
            self.writer.end_document()?;
            self.documents += 1;
        }
        self.text_bytes += bytes;
        let finished = self.writer.shards_finished();
        if finished == self.saved_shards {
            return Ok(true);
        }
        // A cut fell inside this write: the open shard holds only this unit's tail.
        let open = self.writer.tokens_in_open_shard();
        let next = if open == 0 {
            Position {
                input,
                unit: unit + 1,
                tokens: 0,
                inside_document: !ends_document,
            }
        } else {
            Position {
                input,
                unit,
                tokens: sequence.len() as u64 - open,
                inside_document: true,
            }
        };
        let whole = open == 0;
        let state = BuildState {
            settings: self
                .state
                .as_ref()
                .map_or(serde_json::Value::Null, |(_, s)| s.clone()),
            shards: finished,
            next,
            documents: self.documents - u64::from(ends_document && !whole),
            text_bytes: self.text_bytes - if whole { 0 } else { bytes },
            cuts_inside_documents: self.split_before + self.writer.cuts_inside_documents(),
        };
        if let Some((path, _)) = &self.state {
            let json = serde_json::to_vec_pretty(&state).map_err(|e| err(path, e.to_string()))?;
            write_replacing(path, &json)?;
        }
        self.saved_shards = finished;
        if self
            .stop_after
            .is_some_and(|n| finished - self.started_shards >= n)
        {
            self.stopped = true;
            return Ok(false);
        }
        Ok(true)
    }

    /// The report; the last shard finished and the progress removed, unless the build
    /// stopped early (then the open shard is dropped and the progress kept for `--resume`).
    fn finish(self, format: TokenFileFormat, vocab: usize) -> Result<BuildReport> {
        let split_before = self.split_before;
        let kept_shards = self.started_shards;
        let (written, stopped) = if self.stopped {
            (self.writer.abandon(), true)
        } else {
            let written = self.writer.finish()?;
            if let Some((path, _)) = &self.state {
                remove_if_present(path)?;
            }
            (written, false)
        };
        Ok(BuildReport {
            files: written.files,
            shards: written.shards,
            tokens: written.tokens,
            documents: self.documents,
            cuts_inside_documents: split_before + written.cuts_inside_documents,
            removed: written.removed,
            text_bytes: self.text_bytes,
            format,
            vocab,
            stopped,
            kept_shards,
        })
    }
}

/// Remove `path`; a file that is not there is fine.
fn remove_if_present(path: &Path) -> Result<()> {
    match std::fs::remove_file(path) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(err(path, e.to_string())),
        _ => Ok(()),
    }
}

/// Write `bytes` to `path` through a synced temporary file and a rename: a crash leaves the
/// old file or the new one, never a torn one.
fn write_replacing(path: &Path, bytes: &[u8]) -> Result<()> {
    use std::io::Write;
    let mut temp = path.as_os_str().to_owned();
    temp.push(".tmp");
    let temp = PathBuf::from(temp);
    let written = std::fs::File::create(&temp).and_then(|mut f| {
        f.write_all(bytes)?;
        f.sync_all()
    });
    if let Err(e) = written.and_then(|()| std::fs::rename(&temp, path)) {
        let _ = std::fs::remove_file(&temp);
        return Err(err(path, e.to_string()));
    }
    Ok(())
}

/// Whether `a` and `b` are one file (both exist and have the same identity).
fn same_file(a: &Path, b: &Path) -> bool {
    match (std::fs::canonicalize(a), std::fs::canonicalize(b)) {
        (Ok(a), Ok(b)) => a == b,
        _ => false,
    }
}

/// A progress bar: `total` units (bytes, rows) or a spinner, labelled `prefix`; hidden when
/// `prefix` is `None`.
fn progress_bar(prefix: Option<&str>, total: Option<u64>, bytes: bool) -> indicatif::ProgressBar {
    let Some(prefix) = prefix else {
        return indicatif::ProgressBar::hidden();
    };
    let bar = match total {
        Some(n) => indicatif::ProgressBar::new(n),
        None => indicatif::ProgressBar::new_spinner(),
    };
    let template = match (total, bytes) {
        (Some(_), true) => "{prefix}{bar:40} {bytes}/{total_bytes} {bytes_per_sec} eta {eta}",
        (Some(_), false) => "{prefix}{bar:40} {pos}/{len} records, eta {eta}",
        (None, _) => "{prefix}{spinner} {pos} records",
    };
    bar.set_style(
        indicatif::ProgressStyle::with_template(template)
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    bar.set_prefix(prefix.to_owned());
    bar
}

/// Write the text file `input`'s documents, a piece (the build's unit) at a time; returns
/// `false` when the build is to stop.
fn write_text(
    (index, input): (usize, &Path),
    tok: &Tokenizer,
    separator: Option<&str>,
    delimit: Delimit,
    last_input: bool,
    emitter: &mut Emitter,
    progress: Option<&str>,
) -> Result<bool> {
    let map = map_text(input)?;
    let text: &[u8] = &map;
    let pieces = pieces(tok, text, separator.map(str::as_bytes));
    let bar = progress_bar(progress, Some(text.len() as u64), true);
    // Batches of pieces encoded in parallel, written in order: memory stays bounded by a
    // batch's tokens, not the file's.
    let batch = rayon::current_num_threads().max(1) * 4;
    let mut read_to = 0;
    for (bi, group) in pieces.chunks(batch).enumerate() {
        let first = bi * batch;
        let encoded: Vec<Result<Option<Vec<u32>>>> = group
            .par_iter()
            .enumerate()
            .map(|(k, &(_, s, e))| {
                if emitter.already_written(index, (first + k) as u64) {
                    return Ok(None);
                }
                // Cuts fall on separators and ASCII bytes, so each piece is valid UTF-8.
                let piece = std::str::from_utf8(&text[s..e])
                    .map_err(|e| err(input, format!("piece is not UTF-8: {e}")))?;
                tok.encode(piece).map(Some)
            })
            .collect::<Vec<_>>();
        let encoded: Vec<Option<Vec<u32>>> = first_error_in_order(encoded)?;
        for (k, ids) in encoded.into_iter().enumerate() {
            let i = first + k;
            let (doc, _, end) = group[k];
            // The text read: up to this piece's end, and the file's tail with its last.
            let upto = if i + 1 == pieces.len() {
                text.len()
            } else {
                end
            };
            let bytes = (upto - read_to) as u64;
            read_to = upto;
            let Some(ids) = ids else { continue };
            let first_of_doc = i == 0 || pieces[i - 1].0 != doc;
            let last_of_doc = pieces.get(i + 1).is_none_or(|p| p.0 != doc);
            let mut sequence = Vec::with_capacity(ids.len() + 1);
            if let (Delimit::Before(bos), true) = (delimit, first_of_doc) {
                sequence.push(bos);
            }
            sequence.extend_from_slice(&ids);
            // Every document but the last input's tail ends with EOT.
            let more = i + 1 < pieces.len() || !last_input;
            if let (Delimit::After(eot), true, true) = (delimit, last_of_doc, more) {
                sequence.push(eot);
            }
            if !emitter.unit((index, i as u64), &sequence, last_of_doc, bytes)? {
                bar.finish_and_clear();
                return Ok(false);
            }
            bar.set_position(end as u64);
        }
    }
    bar.finish_and_clear();
    Ok(true)
}

/// What a `data build` input is, by its first bytes and its name.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CorpusKind {
    /// Text, tokenized as it is ([`build`]).
    Text,
    /// A Parquet file (`PAR1`): each row's text field a document.
    Parquet,
    /// Arrow IPC (`ARROW1`, or a stream's `ff ff ff ff`), as `datasets` caches a dataset and
    /// `save_to_disk` writes it: each row's text field a document.
    Arrow,
    /// JSON lines (`.jsonl`, `.json`, `.ndjson`, or gzip- or zstd-compressed, known by their
    /// magic bytes: Dolma's `.json.gz`, the Pile's and DCLM's `.jsonl.zst`): each line's
    /// text field a document.
    Jsonl(Compression),
}

/// How a JSONL corpus is compressed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Compression {
    /// Not.
    None,
    /// gzip (`1f 8b`).
    Gzip,
    /// Zstandard (`28 b5 2f fd`, or a skippable frame first, as `pzstd` writes).
    Zstd,
}

impl Compression {
    /// The compression a file starting with `head` has by its magic bytes: gzip (`1f 8b`),
    /// zstd (a frame, or a skippable frame first, as `pzstd` writes); `None` for neither.
    pub fn of_bytes(head: &[u8]) -> Option<Compression> {
        if head.starts_with(&[0x1f, 0x8b]) {
            return Some(Compression::Gzip);
        }
        // A skippable frame's magic is 0x184D2A50–5F.
        let skippable =
            head.len() >= 4 && head[0] & 0xf0 == 0x50 && head[1..4] == [0x2a, 0x4d, 0x18];
        (head.starts_with(&[0x28, 0xb5, 0x2f, 0xfd]) || skippable).then_some(Compression::Zstd)
    }
}

impl CorpusKind {
    /// The kind of the file `input`: Parquet, Arrow, gzip and zstd by their magic bytes (or
    /// Arrow by its `.arrow` extension), JSONL by its extension or when `fields` (a text field
    /// was named), else text.
    pub fn of(input: &Path, fields: bool) -> Result<CorpusKind> {
        use std::io::Read;
        let mut head = [0u8; 8];
        let mut file = std::fs::File::open(input).map_err(|e| err(input, e.to_string()))?;
        let n = file
            .read(&mut head)
            .map_err(|e| err(input, e.to_string()))?;
        let head = &head[..n];
        if head.starts_with(b"PAR1") {
            return Ok(CorpusKind::Parquet);
        }
        let extension = input.extension().and_then(|e| e.to_str());
        if headroom_parquet::is_arrow(head) || extension == Some("arrow") {
            return Ok(CorpusKind::Arrow);
        }
        if let Some(compression) = Compression::of_bytes(head) {
            return Ok(CorpusKind::Jsonl(compression));
        }
        let jsonl = extension.is_some_and(|e| matches!(e, "jsonl" | "json" | "ndjson"));
        Ok(if jsonl || fields {
            CorpusKind::Jsonl(Compression::None)
        } else {
            CorpusKind::Text
        })
    }
}

/// The longest JSON line a corpus may hold (a document of 256 MiB): a file without newlines,
/// or a decompression bomb, stops there instead of filling memory.
const MAX_CORPUS_LINE_BYTES: u64 = 1 << 28;

/// The documents a batch of a corpus holds at most, and its text's bytes at most.
const CORPUS_BATCH_DOCUMENTS: usize = 4096;
const CORPUS_BATCH_BYTES: usize = 64 << 20;

/// Every frame of a Zstandard stream, one after the other, skippable frames skipped: `zstd`
/// writes one frame, `pzstd` and concatenated files several, and a decoder that stopped after
/// the first would drop the rest of the corpus without a word.
struct ZstdFrames<R: std::io::BufRead> {
    source: R,
    decoder: ruzstd::decoding::FrameDecoder,
    in_frame: bool,
}

impl<R: std::io::BufRead> ZstdFrames<R> {
    fn new(source: R) -> ZstdFrames<R> {
        ZstdFrames {
            source,
            decoder: ruzstd::decoding::FrameDecoder::new(),
            in_frame: false,
        }
    }
}

impl<R: std::io::BufRead> std::io::Read for ZstdFrames<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        use ruzstd::decoding::errors::{FrameDecoderError, ReadFrameHeaderError};
        use ruzstd::decoding::BlockDecodingStrategy;
        if buf.is_empty() {
            return Ok(0);
        }
        loop {
            if !self.in_frame {
                if self.source.fill_buf()?.is_empty() {
                    return Ok(0);
                }
                match self.decoder.init(&mut self.source) {
                    Ok(()) => self.in_frame = true,
                    Err(FrameDecoderError::ReadFrameHeaderError(
                        ReadFrameHeaderError::SkipFrame { length, .. },
                    )) => {
                        let skipped = std::io::copy(
                            &mut (&mut self.source).take(u64::from(length)),
                            &mut std::io::sink(),
                        )?;
                        if skipped != u64::from(length) {
                            return Err(std::io::Error::other("a truncated skippable frame"));
                        }
                        continue;
                    }
                    Err(e) => return Err(std::io::Error::other(format!("zstd: {e}"))),
                }
            }
            // Decode until a read's worth can be collected or the frame ends.
            while self.decoder.can_collect() < buf.len() && !self.decoder.is_finished() {
                let wanted = buf.len() - self.decoder.can_collect();
                self.decoder
                    .decode_blocks(&mut self.source, BlockDecodingStrategy::UptoBytes(wanted))
                    .map_err(|e| std::io::Error::other(format!("zstd: {e}")))?;
            }
            let n = self.decoder.read(buf)?;
            if n > 0 {
                return Ok(n);
            }
            if self.decoder.is_finished() {
                self.in_frame = false;
            }
        }
    }
}

/// A Parquet or Arrow row's or JSON line's fields.
type Record = serde_json::Map<String, serde_json::Value>;

/// A corpus read in batches of `(number, record)`: a Parquet or Arrow file a row group or
/// record batch at a time (only the text column decoded), or JSON lines streamed through
/// their decompressor.
enum Corpus<'a> {
    Table {
        file: Box<headroom_parquet::TableFile<'a>>,
        options: headroom_parquet::ReadOptions,
        next_group: usize,
        number: u64,
    },
    Jsonl {
        lines: Box<dyn std::io::BufRead + 'a>,
        number: u64,
    },
}

impl Corpus<'_> {
    /// What an error's number counts.
    fn unit(&self) -> &'static str {
        match self {
            Corpus::Table { .. } => "row",
            Corpus::Jsonl { .. } => "line",
        }
    }

    /// The next batch of records (a line's or row's JSON object), numbered; `None` at the end.
    fn next_batch(&mut self, input: &Path) -> Result<Option<Vec<(u64, Record)>>> {
        match self {
            Corpus::Table {
                file,
                options,
                next_group,
                number,
            } => {
                if *next_group == file.num_groups() {
                    return Ok(None);
                }
                let rows = file
                    .group(*next_group, options)
                    .map_err(|e| err(input, e.to_string()))?;
                *next_group += 1;
                Ok(Some(
                    rows.into_iter()
                        .map(|row| {
                            *number += 1;
                            (*number, row)
                        })
                        .collect(),
                ))
            }
            Corpus::Jsonl { lines, number } => {
                let mut batch = Vec::new();
                let mut bytes = 0;
                while batch.len() < CORPUS_BATCH_DOCUMENTS && bytes < CORPUS_BATCH_BYTES {
                    let Some(text) = next_line(lines.as_mut(), input, number)? else {
                        break;
                    };
                    if text.trim().is_empty() {
                        continue;
                    }
                    let record = match serde_json::from_str(&text) {
                        Ok(serde_json::Value::Object(map)) => map,
                        Ok(_) => {
                            return Err(err(input, format!("line {number}: not a JSON object")))
                        }
                        Err(e) => return Err(err(input, format!("line {number}: not JSON: {e}"))),
                    };
                    bytes += text.len() + 1;
                    batch.push((*number, record));
                }
                Ok((!batch.is_empty()).then_some(batch))
            }
        }
    }
}

/// The Parquet or Arrow file `bytes`, parsed as `kind` says: by its kind, not its magic alone,
/// since a `.arrow` stream written before Arrow 0.15 has none.
pub(crate) fn table_file(
    bytes: &[u8],
    kind: CorpusKind,
) -> std::result::Result<headroom_parquet::TableFile<'_>, headroom_parquet::TableError> {
    Ok(if kind == CorpusKind::Parquet {
        headroom_parquet::TableFile::Parquet(headroom_parquet::ParquetFile::parse(bytes)?)
    } else {
        headroom_parquet::TableFile::Arrow(headroom_parquet::ArrowFile::parse(bytes)?)
    })
}

/// Write a corpus of records (a Parquet or Arrow file's rows, JSON lines): each record's
/// `text_field` is one document and the build's unit, delimited by `delimit` (nanoGPT's and
/// llm.c's `fineweb.py` put the same token between documents). A Parquet or Arrow file is
/// decoded a row group or record batch at a time and only its text column (FineWeb as Hugging
/// Face publishes it, a dataset as `datasets` saved it); JSON lines are
/// streamed, through gzip or zstd if compressed, a batch at a time. Each batch's documents are
/// encoded in parallel and written in order. A record whose text is null or missing is an
/// error naming it. Returns `false` when the build is to stop.
fn write_records(
    (index, input): (usize, &Path),
    kind: CorpusKind,
    tok: &Tokenizer,
    text_field: &str,
    delimit: Delimit,
    emitter: &mut Emitter,
    progress: Option<&str>,
) -> Result<bool> {
    let map;
    let mut corpus = match kind {
        CorpusKind::Text => {
            return Err(err(input, "a text file has no records"));
        }
        CorpusKind::Parquet | CorpusKind::Arrow => {
            map = map_file(input)?;
            let file = Box::new(table_file(&map, kind).map_err(|e| err(input, e.to_string()))?);
            Corpus::Table {
                file,
                options: headroom_parquet::ReadOptions {
                    columns: Some(vec![text_field.to_owned()]),
                    ..headroom_parquet::ReadOptions::default()
                },
                next_group: 0,
                number: 0,
            }
        }
        CorpusKind::Jsonl(compression) => {
            let file = std::fs::File::open(input).map_err(|e| err(input, e.to_string()))?;
            Corpus::Jsonl {
                lines: decompressed(file, compression),
                number: 0,
            }
        }
    };
    let bar = match &corpus {
        Corpus::Table { file, .. } => progress_bar(progress, Some(file.num_rows()), false),
        Corpus::Jsonl { .. } => progress_bar(progress, None, false),
    };
    // Resuming: row groups (record batches) wholly in the kept shards are not even decoded.
    if let Corpus::Table {
        file,
        next_group,
        number,
        ..
    } = &mut corpus
    {
        while let Some(rows) = file.group_rows(*next_group) {
            if rows == 0 || !emitter.already_written(index, *number + rows - 1) {
                break;
            }
            *number += rows;
            *next_group += 1;
        }
        bar.set_position(*number);
    }
    let unit = corpus.unit();
    let mut records = 0u64;
    while let Some(batch) = corpus.next_batch(input)? {
        records += batch.len() as u64;
        // Per record: its tokens and the bytes of text they came from, or None when written.
        let encoded: Vec<Result<Option<EncodedRecord>>> = batch
            .par_iter()
            .map(|(number, record)| {
                if emitter.already_written(index, number - 1) {
                    return Ok(None);
                }
                let text = record
                    .get(text_field)
                    .and_then(|v| v.as_str())
                    .ok_or_else(|| {
                        err(
                            input,
                            format!(
                                "{unit} {number}: {text_field:?} is {}, not text",
                                record
                                    .get(text_field)
                                    .map_or("missing".into(), |v| v.to_string())
                            ),
                        )
                    })?;
                // A long document is encoded in pieces cut where the tokenizer allows, as a
                // text file's are; the delimiter goes in the same sequence.
                let mut ids = Vec::new();
                if let Delimit::Before(bos) = delimit {
                    ids.push(bos);
                }
                for (_, a, e) in pieces(tok, text.as_bytes(), None) {
                    let piece = text
                        .get(a..e)
                        .ok_or_else(|| err(input, "a piece cut inside a character"))?;
                    ids.extend(tok.encode(piece)?);
                }
                if let Delimit::After(eot) = delimit {
                    ids.push(eot);
                }
                Ok(Some((ids, text.len())))
            })
            .collect::<Vec<_>>();
        let encoded: Vec<Option<EncodedRecord>> = first_error_in_order(encoded)?;
        for ((number, _), done) in batch.iter().zip(encoded) {
            let Some((sequence, len)) = done else {
                continue;
            };
            if !emitter.unit((index, number - 1), &sequence, true, len as u64)? {
                bar.finish_and_clear();
                return Ok(false);
            }
        }
        bar.inc(batch.len() as u64);
    }
    bar.finish_and_clear();
    let skipped_groups = matches!(&corpus, Corpus::Table { number, .. } if *number > records);
    if records == 0 && !skipped_groups {
        return Err(err(input, format!("no {unit}s")));
    }
    Ok(true)
}

/// Tokenize a corpus of records into `out` in `format`: each Parquet row's or JSON line's
/// `text_field` is one document, ended by the end-of-text token ([`build_corpus`] of one
/// input of `kind`).
pub fn build_from_records(
    input: &Path,
    kind: CorpusKind,
    tok: &Tokenizer,
    format: TokenFileFormat,
    text_field: &str,
    out: &Path,
    progress: bool,
) -> Result<BuildReport> {
    if kind == CorpusKind::Text {
        return Err(err(input, "a text file has no records: use build"));
    }
    let options = CorpusOptions {
        text_field: Some(text_field.to_owned()),
        ..CorpusOptions::default()
    };
    build_kinds(
        &[(input.to_path_buf(), kind)],
        tok,
        format,
        &options,
        out,
        progress,
    )
}

/// [`build_from_records`] of a Parquet file.
pub fn build_from_parquet(
    input: &Path,
    tok: &Tokenizer,
    format: TokenFileFormat,
    text_field: &str,
    out: &Path,
    progress: bool,
) -> Result<BuildReport> {
    build_from_records(
        input,
        CorpusKind::Parquet,
        tok,
        format,
        text_field,
        out,
        progress,
    )
}

/// What [`build_prompt_completion`] wrote.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PromptCompletionReport {
    /// The token file(s) and the loss mask, each with its size in bytes.
    pub files: Vec<(PathBuf, u64)>,
    /// Examples (non-blank lines).
    pub examples: u64,
    /// Tokens written.
    pub tokens: u64,
    /// Tokens whose loss counts (completions, their end-of-text tokens, `text` examples).
    pub counted: u64,
    /// Examples whose prompt's ids are not a prefix of the whole example's (a merge across
    /// the boundary): their completion starts where the two diverge, as TRL's does (and TRL
    /// warns of the same).
    pub boundary_merges: u64,
    /// The format written.
    pub format: TokenFileFormat,
    /// Examples longer than [`SftOptions::max_length`]: cut to it, or with
    /// [`PackStrategy::BfdSplit`] split into pieces of it.
    pub truncated: u64,
    /// Examples left out because the cut left no counted token (TRL drops them too).
    pub dropped: u64,
    /// With [`SftOptions::pack`]: examples (with [`PackStrategy::BfdSplit`], pieces) left
    /// without a counted token, packed anyway as TRL's packing does (it drops such examples
    /// only from unpacked data): they fill room in their rows and add no loss.
    pub packed_uncounted: u64,
    /// With `assistant_only_loss`: whether the template's generation blocks count the
    /// assistant's end of turn (TRL's `is_chat_template_stop_token_trained`; when not, the
    /// model never learns to stop, and TRL warns). `None` otherwise.
    pub stop_token_counted: Option<bool>,
    /// With [`SftOptions::pack`]: the rows and their padding.
    pub packed: Option<PackReport>,
}

/// What [`SftOptions::pack`] made of the examples.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PackReport {
    /// Rows of `max_length` tokens.
    pub rows: u64,
    /// Padding tokens that fill the rows' room.
    pub padding: u64,
}

/// One line of a prompt-completion JSONL file, in TRL's dataset formats: prompt-completion
/// (`{"prompt": …, "completion": …}`) and language modelling (`{"text": …}`), each standard
/// (strings) or conversational (lists of `{"role", "content"}` messages; language modelling's
/// key is then `messages`). A conversational example may carry `tools` (a list of JSON
/// schemas, or that list as JSON text) and `chat_template_kwargs` (further template variables),
/// which TRL passes to the chat template. Other keys (an id, a source) are ignored, as TRL
/// drops other columns.
#[derive(serde::Deserialize)]
struct ExampleLine {
    prompt: Option<Turns>,
    completion: Option<Turns>,
    text: Option<String>,
    messages: Option<Vec<ChatValue>>,
    tools: Option<Tools>,
    chat_template_kwargs: Option<ChatValue>,
}

/// A prompt or a completion: text, or messages.
#[derive(serde::Deserialize)]
#[serde(untagged)]
enum Turns {
    Text(String),
    Messages(Vec<ChatValue>),
}

/// An example's tools: the list, or the list as JSON text (TRL's `json.loads` of a string).
#[derive(serde::Deserialize)]
#[serde(untagged)]
pub(crate) enum Tools {
    List(Vec<ChatValue>),
    Json(String),
}

/// What a conversation gives its template besides the messages (TRL's `tools` and
/// `chat_template_kwargs` columns).
pub(crate) struct TemplateInputs {
    /// The tools' list.
    pub tools: Option<Vec<ChatValue>>,
    /// The further variables.
    pub extra: Vec<(String, ChatValue)>,
}

/// A conversation's `tools` (a list, or the list as JSON text) and `chat_template_kwargs` (an
/// object) as its template takes them.
pub(crate) fn template_inputs(
    tools: Option<Tools>,
    kwargs: Option<ChatValue>,
) -> std::result::Result<TemplateInputs, String> {
    let tools = match tools {
        None => None,
        Some(Tools::List(l)) => Some(l),
        Some(Tools::Json(text)) => Some(
            serde_json::from_str::<Vec<ChatValue>>(&text)
                .map_err(|e| format!("tools is not a JSON list: {e}"))?,
        ),
    };
    let extra = match kwargs {
        None | Some(ChatValue::Null) => Vec::new(),
        Some(ChatValue::Object(o)) => o,
        Some(_) => return Err("chat_template_kwargs is not an object".into()),
    };
    Ok(TemplateInputs { tools, extra })
}

/// The chat template conversational examples are rendered with: the tokenizer's, if it has
/// one (the error text when its `tokenizer_config.json` is unreadable, reported only if a
/// conversational example needs it).
type ChatForExamples = std::result::Result<Option<ChatTemplate>, String>;

/// How [`build_prompt_completion_with`] renders conversational examples and which tokens of
/// them count.
#[derive(Clone, Debug, Default)]
pub struct SftOptions {
    /// Count only the tokens that the chat template's `{% generation %}` blocks render (the
    /// assistant's turns; TRL's `assistant_only_loss`, transformers'
    /// `return_assistant_tokens_mask`), and of a prompt-completion example only those of the
    /// completion. Every example must be conversational, the template must have such blocks,
    /// and every example must have a counted token.
    pub assistant_only_loss: bool,
    /// A chat template in place of the tokenizer's ([`ChatTemplate::from_file`]; TRL's
    /// `chat_template_path`), such as a training template with `{% generation %}` blocks.
    pub chat_template: Option<ChatTemplate>,
    /// A prompt-completion example's prompt counts too (TRL's `completion_only_loss=False`);
    /// with `assistant_only_loss`, the assistant's turns of the prompt then count.
    pub count_prompts: bool,
    /// Cut each example to at most this many tokens, and leave out an example with no counted
    /// token left (TRL's `max_length`, whose default is 1024; `None` is TRL's `None`: no cut).
    pub max_length: Option<usize>,
    /// Which end of a long example to keep.
    pub truncation: Truncation,
    /// The key of a language-modelling example's text (TRL's `dataset_text_field`; `None` is
    /// TRL's default, `text`).
    pub text_field: Option<String>,
    /// The end-of-sequence token in place of the tokenizer's (TRL's `eos_token`): it ends each
    /// text and prompt-completion example, and chat templates render it as `eos_token` (unless
    /// an example's `chat_template_kwargs` set that). Must be a token of the vocabulary.
    pub eos_token: Option<String>,
    /// Pad every example to `max_length` with the end-of-text token (never counted), plus one
    /// token at the end of the file: `train --seq max_length` then reads each example alone in
    /// its own window from position 0, as TRL's padded batches (no attention across examples;
    /// a real token never attends to the padding after it, so the pad id does not matter). An
    /// example's first token is not counted: it would be the target of the previous window's
    /// last position, and TRL's labels never use it.
    pub pad: bool,
    /// Pack whole examples into rows of `max_length` tokens by best-fit decreasing, as TRL's
    /// `packing=True` (its default `packing_strategy="bfd"`) does, in TRL's row order: each
    /// example a document of the Megatron index, each row padded to `max_length` with one
    /// uncounted padding document, plus one token at the end of the file. `train --seq
    /// max_length --document-attention` then reads one row per window from position 0, each
    /// example attending only to itself with its own positions — TRL's padding-free batches,
    /// no example cut across rows. Needs the Megatron format; holds the kept examples in
    /// memory (about 5 bytes per token) until they are placed. An example's first token is not
    /// counted, as TRL's padding-free labels leave it out. An example longer than a row is
    /// cut or split as the [`PackStrategy`] says, and one left without a counted token is
    /// packed, not dropped, as in TRL's packing.
    pub pack: Option<PackStrategy>,
}

/// What [`SftOptions::pack`] does with an example longer than a row: TRL's
/// `packing_strategy` (its `wrapped` ignores example boundaries, as `train` without
/// `--document-attention` reads any file).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum PackStrategy {
    /// `bfd`, TRL's default: the example keeps its first `max_length` tokens, whatever
    /// [`SftOptions::truncation`] says ([`Truncation::KeepEnd`] is refused), the rest is lost.
    #[default]
    Bfd,
    /// `bfd_split`: the example is split from its start into pieces of `max_length` tokens
    /// (the last may be shorter), each packed as an example of its own — its own document,
    /// positions from 0, its first token uncounted — so no token is lost.
    BfdSplit,
}

/// TRL's best-fit-decreasing packing (`trl.data_utils._pack_bfd`) of examples of `lengths`
/// (each at most `capacity`, none empty) into rows of `capacity`: the examples from longest to
/// shortest (ties in input order), each into the row with the least room that holds it (of
/// rows with equal room, the one that reached it first), else into a new row. Returns the
/// rows in the order they were opened, each its examples' indices in the order placed.
pub fn best_fit_decreasing(lengths: &[usize], capacity: usize) -> Vec<Vec<usize>> {
    let mut order: Vec<usize> = (0..lengths.len()).collect();
    // Stable, as Arrow's sort: equal lengths keep their input order.
    order.sort_by(|&a, &b| lengths[b].cmp(&lengths[a]));
    let mut rows: Vec<Vec<usize>> = Vec::new();
    // Rows by their room left (below `capacity`, above 0), first come first served.
    let mut by_room: BTreeMap<usize, VecDeque<usize>> = BTreeMap::new();
    for i in order {
        let len = lengths[i];
        // The least room that holds the example (a full-length example opens a row).
        let best = by_room.range(len..capacity).next().map(|(&room, _)| room);
        let taken = best.and_then(|room| {
            let queue = by_room.get_mut(&room)?;
            let row = queue.pop_front()?;
            if queue.is_empty() {
                by_room.remove(&room);
            }
            Some((row, room))
        });
        let (row, room) = match taken.filter(|&(row, _)| row < rows.len()) {
            Some(found) => found,
            None => {
                rows.push(Vec::new());
                (rows.len() - 1, capacity)
            }
        };
        if let Some(r) = rows.get_mut(row) {
            r.push(i);
        }
        let left = room.saturating_sub(len);
        if left > 0 {
            by_room.entry(left).or_default().push_back(row);
        }
    }
    rows
}

/// Which end of an example longer than [`SftOptions::max_length`] is kept (TRL's
/// `truncation_mode`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Truncation {
    /// The first `max_length` tokens (`keep_start`, TRL's default).
    #[default]
    KeepStart,
    /// The last `max_length` tokens (`keep_end`).
    KeepEnd,
}

/// One example's ids and their loss flags.
fn encode_example(
    tok: &Tokenizer,
    chat: &ChatForExamples,
    options: &SftOptions,
    eot: u32,
    line: &str,
    (unit, number): (&str, usize),
    input: &Path,
) -> Result<(Vec<u32>, Vec<bool>, bool)> {
    let bad = |why: String| err(input, format!("{unit} {number}: {why}"));
    let mut ex: ExampleLine =
        serde_json::from_str(line).map_err(|e| bad(format!("not an example: {e}")))?;
    // TRL's `dataset_text_field`: a language-modelling example's text is that key's (its
    // `text`, if any, is then an ignored column); other formats do not read it.
    if let Some(field) = options.text_field.as_deref().filter(|&f| f != "text") {
        let language_modelling =
            ex.prompt.is_none() && ex.completion.is_none() && ex.messages.is_none();
        ex.text = if language_modelling {
            let mut line: serde_json::Map<String, serde_json::Value> =
                serde_json::from_str(line).map_err(|e| bad(format!("not an example: {e}")))?;
            match line.remove(field) {
                Some(serde_json::Value::String(t)) => Some(t),
                Some(_) => return Err(bad(format!("{field:?} is not text"))),
                None => {
                    return Err(bad(format!(
                        "no {field:?} (--dataset-text-field), \"prompt\" and \"completion\", \
                         or \"messages\""
                    )))
                }
            }
        } else {
            None
        };
    }
    let template = || match chat {
        Ok(Some(t)) => Ok(t),
        Ok(None) => Err(bad(format!(
            "a conversational example needs the tokenizer's chat template, and {} has none \
             (transformers reads it from chat_template.jinja or tokenizer_config.json beside \
             tokenizer.json; --chat-template gives one)",
            tok.source().display()
        ))),
        Err(e) => Err(bad(format!("the tokenizer's chat template: {e}"))),
    };
    let TemplateInputs { tools, mut extra } =
        template_inputs(ex.tools, ex.chat_template_kwargs).map_err(bad)?;
    // TRL sets the tokenizer's eos_token, which the template reads among the special tokens;
    // an example's own variables still win, as in transformers.
    if let Some(eos) = &options.eos_token {
        if !extra.iter().any(|(k, _)| k == "eos_token") {
            extra.insert(0, ("eos_token".into(), ChatValue::String(eos.clone())));
        }
    }
    // The ids of a conversation, and with `assistant_only_loss` which of them the template's
    // generation blocks wrote (else none).
    let rendered = |messages: &[ChatValue], generation_prompt: bool| {
        let request = ChatRequest {
            messages,
            add_generation_prompt: generation_prompt,
            tools: tools.as_deref(),
            documents: None,
            extra: &extra,
            continue_final_message: None,
        };
        let r = template()?
            .render_request(&request)
            .map_err(|e| bad(e.to_string()))?;
        // transformers' apply_chat_template(tokenize=True): the template wrote the special
        // tokens, so none is added around the text.
        if options.assistant_only_loss && !generation_prompt {
            tok.encode_marking(&r.text, &r.generation)
        } else {
            let ids = tok.encode(&r.text)?;
            let none = vec![false; ids.len()];
            Ok((ids, none))
        }
    };
    // The completion starts where the ids of the prompt alone and of the whole example
    // diverge: after the whole prompt, unless a token merges across the boundary or the
    // template renders the prompt alone differently (TRL's `common_prefix_length`).
    let split = |prompt: Vec<u32>, whole: Vec<u32>| {
        let common = prompt
            .iter()
            .zip(&whole)
            .take_while(|(a, b)| a == b)
            .count();
        (whole, common, common < prompt.len())
    };
    // The ids, where the counted part starts, whether the prompt merged, and for a
    // conversational example (its template ends each turn: no end-of-text is appended) which
    // tokens its generation blocks wrote.
    let (mut ids, prompt_len, merged, assistant) = match ex {
        ExampleLine {
            prompt: Some(Turns::Messages(p)),
            completion: Some(Turns::Messages(c)),
            text: None,
            messages: None,
            ..
        } => {
            // TRL's conversational prompt-completion: the prompt with the assistant's turn
            // header, and the whole conversation.
            let (prompt, _) = rendered(&p, true)?;
            let (whole, assistant) = rendered(&[p, c].concat(), false)?;
            let (ids, common, merged) = split(prompt, whole);
            (ids, common, merged, Some(assistant))
        }
        ExampleLine {
            prompt: None,
            completion: None,
            text: None,
            messages: Some(m),
            ..
        } => {
            // Conversational language modelling: every token counts, as in TRL without
            // `assistant_only_loss`.
            let (ids, assistant) = rendered(&m, false)?;
            (ids, 0, false, Some(assistant))
        }
        ExampleLine {
            prompt: Some(Turns::Text(p)),
            completion: Some(Turns::Text(c)),
            text: None,
            messages: None,
            ..
        } => {
            // TRL's tokenisation: the prompt alone, and the whole example, each as a sequence;
            // the completion starts where the two diverge (after the whole prompt, unless a
            // token merges across the boundary).
            let (ids, common, merged) =
                split(tok.encode_sequence(&p)?, tok.encode_sequence(&(p + &c))?);
            (ids, common, merged, None)
        }
        ExampleLine {
            prompt: None,
            completion: None,
            text: Some(t),
            messages: None,
            ..
        } => (tok.encode_sequence(&t)?, 0, false, None),
        _ => {
            return Err(bad(
                "an example is {\"prompt\", \"completion\"} (both text or both messages), \
                 {\"text\"} or {\"messages\"}"
                    .into(),
            ))
        }
    };
    if assistant.is_none() && ids.last() != Some(&eot) {
        ids.push(eot);
    }
    let prompt_len = if options.count_prompts {
        0
    } else {
        prompt_len.min(ids.len())
    };
    let mut flags: Vec<bool> = (0..ids.len()).map(|i| i >= prompt_len).collect();
    if options.assistant_only_loss {
        // TRL's labels: a token counts when every mask it has says so.
        let assistant = assistant.ok_or_else(|| {
            bad("assistant_only_loss needs conversational examples (messages)".into())
        })?;
        if !assistant.contains(&true) {
            return Err(bad(
                "no token of this example is inside the chat template's {% generation %} \
                 blocks (is there an assistant turn?)"
                    .into(),
            ));
        }
        for (flag, a) in flags.iter_mut().zip(assistant) {
            *flag &= a;
        }
    }
    Ok((ids, flags, merged))
}

/// Whether the template's generation blocks take in the end of an assistant's turn: TRL's
/// `is_chat_template_stop_token_trained`. It renders a user turn, an assistant turn and a
/// user turn; the last token of the generation blocks that is not blank must be an added
/// token (the end of turn), or the model never learns to stop. `eos_token` is TRL's setting
/// of that name, which it gives the tokenizer before the check, so the template renders it.
pub fn stop_token_counted(
    tok: &Tokenizer,
    template: &ChatTemplate,
    eos_token: Option<&str>,
) -> Result<bool> {
    let turn = |role: &str| serde_json::json!({"role": role, "content": "dummy"}).into();
    let messages: Vec<ChatValue> = vec![turn("user"), turn("assistant"), turn("user")];
    let extra: Vec<(String, ChatValue)> = eos_token
        .map(|eos| ("eos_token".to_string(), ChatValue::String(eos.to_string())))
        .into_iter()
        .collect();
    let request = ChatRequest {
        messages: &messages,
        extra: &extra,
        ..Default::default()
    };
    let Ok(r) = template.render_request(&request) else {
        return Ok(false);
    };
    let (ids, marked) = tok.encode_marking(&r.text, &r.generation)?;
    for (&id, _) in ids.iter().zip(&marked).rev().filter(|(_, &m)| m) {
        if tok.decode(&[id])?.trim().is_empty() {
            continue;
        }
        return Ok(tok.is_added_token(id));
    }
    Ok(false)
}

/// Tokenize a JSONL file of examples into `out` in `format` and its loss mask beside it
/// (`<token file>.lossmask`): each example is its tokens (as [`Tokenizer::encode_sequence`]
/// makes them) then the end-of-sequence token ([`Tokenizer::eos_token`], or
/// [`SftOptions::eos_token`]), packed one after another. For a prompt-completion
/// example the prompt's tokens do not count as targets and the completion's and the
/// end-of-text token do (TRL's `completion_only_loss`, transformers' `labels = -100` on the
/// prompt): the ids and flags of TRL's `SFTTrainer` (`tests/sft_trl.rs` against
/// `benches/torch/make_sft_fixture.py`'s fixture). Every token of a `text` example counts.
/// TRL appends the end-of-text token's text to the completion unless it already ends with
/// it, which a Hugging Face tokenizer maps to its id: the same ids as appending the id, as
/// here. (GPT-2's BPE keeps special-token strings in data as ordinary text.)
///
/// Conversational examples (prompt and completion as lists of messages, or `messages`, with
/// the example's `tools` and `chat_template_kwargs` if any) are rendered with the tokenizer's
/// chat template ([`ChatTemplate::beside`]: `chat_template.jinja` or the
/// `tokenizer_config.json` beside its `tokenizer.json`) and tokenised without added
/// special tokens, as transformers' `apply_chat_template(tokenize=True)`: for prompt and
/// completion, the prompt with the generation prompt and the whole conversation, the
/// completion starting where the two diverge; no end-of-text token is appended, since the
/// template ends each turn (TRL's ids and labels: `tests/sft_trl.rs` against
/// `benches/torch/make_chat_sft_fixture.py`). Megatron output
/// ends a document after each example. Blank lines are skipped. The tokens are written first, then the mask: a crash
/// between them leaves a mask whose length the reader checks against the new file.
pub fn build_prompt_completion(
    input: &Path,
    tok: &Tokenizer,
    format: TokenFileFormat,
    out: &Path,
    progress: bool,
) -> Result<PromptCompletionReport> {
    build_prompt_completion_with(input, tok, format, out, progress, &SftOptions::default())
}

/// [`build_prompt_completion`] with [`SftOptions`]: a chat template file in place of the
/// tokenizer's, only the assistant's tokens counted, prompts counted too, examples cut to a
/// maximum length.
pub fn build_prompt_completion_with(
    input: &Path,
    tok: &Tokenizer,
    format: TokenFileFormat,
    out: &Path,
    progress: bool,
    options: &SftOptions,
) -> Result<PromptCompletionReport> {
    build_examples(
        std::slice::from_ref(&input.to_path_buf()),
        tok,
        format,
        out,
        progress,
        options,
    )
}

/// [`build_prompt_completion_with`] of several files, one after the other, into one token
/// file and its mask (a Hugging Face split in several Parquet shards, `train_sft-00000-of-00003`
/// …): the examples of all, in order; with packing, packed together. Each input is JSON lines
/// (plain, or gzip- or zstd-compressed, streamed) or a Parquet or Arrow file; an input without
/// examples is an error naming it.
pub fn build_examples(
    inputs: &[PathBuf],
    tok: &Tokenizer,
    format: TokenFileFormat,
    out: &Path,
    progress: bool,
    options: &SftOptions,
) -> Result<PromptCompletionReport> {
    let Some(input) = inputs.first().map(PathBuf::as_path) else {
        return Err(err(out, "no inputs"));
    };
    for other in inputs {
        if same_file(other, out) {
            return Err(err(other, "is the output file"));
        }
    }
    headroom_mmap_data::tools::check_vocab_fits(tok.vocab_size() as u64, format.token_type())?;
    // TRL's `processing_class.eos_token`, or its `eos_token` setting.
    let eot = match &options.eos_token {
        Some(text) => tok.token_id(text).ok_or_else(|| {
            err(
                tok.source(),
                format!("the eos token {text:?} is not in the vocabulary"),
            )
        })?,
        None => tok.eos_token()?.ok_or_else(|| {
            err(
                tok.source(),
                "no end-of-text token to end each example with",
            )
        })?,
    };
    if options.max_length == Some(0) {
        return Err(err(input, "a maximum length of 0 tokens leaves nothing"));
    }
    if options.pad && options.max_length.is_none() {
        return Err(err(input, "padding needs a maximum length to pad to"));
    }
    if let Some(strategy) = options.pack {
        if options.max_length.is_none() || options.pad {
            return Err(err(
                input,
                "packing needs a maximum length (the rows' length) and no padding of each example",
            ));
        }
        if !matches!(format, TokenFileFormat::Megatron { .. }) {
            return Err(err(
                out,
                "packing needs the Megatron format (--format megatron): its index records each \
                 example as a document, which train --document-attention reads",
            ));
        }
        if strategy == PackStrategy::Bfd && options.truncation == Truncation::KeepEnd {
            return Err(err(
                input,
                "packing cuts an example longer than a row to its first tokens, as TRL's \
                 packing does whatever its truncation_mode says: keep-end applies to unpacked \
                 data only",
            ));
        }
    }
    let chat: ChatForExamples = match &options.chat_template {
        Some(t) => Ok(Some(t.clone())),
        None => tok.chat_template().map_err(|e| e.to_string()),
    };
    let mut stop_token_counted = None;
    if options.assistant_only_loss {
        let template = match &chat {
            Ok(Some(t)) => t,
            Ok(None) => {
                return Err(err(
                    tok.source(),
                    "assistant_only_loss needs a chat template, and the tokenizer has none",
                ))
            }
            Err(e) => return Err(err(tok.source(), e.clone())),
        };
        if !template.has_generation_blocks() {
            return Err(err(
                template.path(),
                "assistant_only_loss needs a chat template whose assistant turns are inside                  {% generation %} … {% endgeneration %} blocks, and this one has none; give                  one that has with --chat-template (TRL ships training templates for common                  models)",
            ));
        }
        stop_token_counted = Some(self::stop_token_counted(
            tok,
            template,
            options.eos_token.as_deref(),
        )?);
    }
    // The mask belongs beside the token file (a Megatron pair's `.bin`).
    let mask_path = headroom_mmap_data::loss_mask_path(
        &headroom_mmap_data::formats::token_file_path(out, format),
    );
    let mut writer = TokenWriter::create(out, format)?;
    let mut mask = headroom_mmap_data::LossMaskWriter::create(&mask_path)?;
    let (mut counted, mut merges, mut truncated, mut dropped) = (0u64, 0u64, 0u64, 0u64);
    let mut packed_uncounted = 0u64;
    // With `pack`: the kept examples, placed once all are known.
    let mut kept: Vec<(Vec<u32>, Vec<bool>)> = Vec::new();
    // Examples encoded in parallel, written in order.
    let batch = rayon::current_num_threads().max(1) * 256;
    let mut examples_read = 0u64;
    for (k, input) in inputs.iter().enumerate() {
        let input = input.as_path();
        let map = map_file(input)?;
        let mut examples = Examples::of(&map, input)?;
        if examples.len() == Some(0) {
            return Err(err(input, "no examples"));
        }
        let prefix = match inputs.len() {
            1 => String::new(),
            n => format!("[{}/{n}] ", k + 1),
        };
        let bar = match examples.len() {
            Some(n) => progress_bar(progress.then_some(prefix.as_str()), Some(n), false),
            None => progress_bar(progress.then_some(prefix.as_str()), None, false),
        };
        let unit = examples.unit();
        let before = examples_read;
        examples.for_each_batch(batch, |group| {
            examples_read += group.len() as u64;
            let encoded = first_error_in_order(
                group
                    .par_iter()
                    .map(|&(n, l)| encode_example(tok, &chat, options, eot, l, (unit, n), input))
                    .collect(),
            )?;
            for (mut ids, mut flags, merged) in encoded {
                if let (Some(max), Some(PackStrategy::BfdSplit)) =
                    (options.max_length, options.pack)
                {
                    // Every piece packed, counted or not (TRL's packing has no filter).
                    merges += u64::from(merged);
                    truncated += u64::from(ids.len() > max);
                    for (piece, piece_flags) in ids.chunks(max).zip(flags.chunks(max)) {
                        packed_uncounted += u64::from(!piece_flags.contains(&true));
                        let mut piece_flags = piece_flags.to_vec();
                        piece_flags[0] = false;
                        if kept.try_reserve(1).is_err() {
                            return Err(err(input, "out of memory holding the examples to pack"));
                        }
                        kept.push((piece.to_vec(), piece_flags));
                    }
                    continue;
                }
                if let Some(max) = options.max_length {
                    if ids.len() > max {
                        truncated += 1;
                        let cut = match options.truncation {
                            Truncation::KeepStart => 0..max,
                            Truncation::KeepEnd => ids.len() - max..ids.len(),
                        };
                        ids = ids[cut.clone()].to_vec();
                        flags = flags[cut].to_vec();
                    }
                    // TRL's filter after its cut: an example without a counted token adds no loss.
                    // TRL's packing has no such filter: the example still takes its room in a row.
                    if !flags.contains(&true) {
                        if options.pack.is_some() {
                            packed_uncounted += 1;
                        } else {
                            dropped += 1;
                            continue;
                        }
                    }
                    if options.pad {
                        flags[0] = false;
                        ids.resize(max, eot);
                        flags.resize(max, false);
                    }
                }
                merges += u64::from(merged);
                if options.pack.is_some() {
                    flags[0] = false;
                    if kept.try_reserve(1).is_err() {
                        return Err(err(input, "out of memory holding the examples to pack"));
                    }
                    kept.push((ids, flags));
                    continue;
                }
                writer.write(&ids)?;
                writer.end_document()?;
                mask.write(&flags)?;
                counted += flags.iter().filter(|&&f| f).count() as u64;
            }
            bar.inc(group.len() as u64);
            Ok(())
        })?;
        bar.finish_and_clear();
        if examples_read == before {
            return Err(err(input, "no examples"));
        }
    }
    if counted == 0 && kept.iter().all(|(_, flags)| !flags.contains(&true)) {
        return Err(err(
            input,
            format!(
                "no example has a counted token within its first (or last) {} tokens",
                options.max_length.unwrap_or(0)
            ),
        ));
    }
    let mut packed = None;
    if let (Some(_), Some(max)) = (options.pack, options.max_length) {
        let lengths: Vec<usize> = kept.iter().map(|(ids, _)| ids.len()).collect();
        let rows = best_fit_decreasing(&lengths, max);
        let mut padding = 0u64;
        for row in &rows {
            let mut used = 0;
            for &i in row {
                let (ids, flags) = kept
                    .get(i)
                    .ok_or_else(|| err(input, "packing placed an example that does not exist"))?;
                writer.write(ids)?;
                writer.end_document()?;
                mask.write(flags)?;
                counted += flags.iter().filter(|&&f| f).count() as u64;
                used += ids.len();
            }
            // The row's room: one document of padding, never counted.
            let room = max.saturating_sub(used);
            if room > 0 {
                writer.write(&vec![eot; room])?;
                writer.end_document()?;
                mask.write(&vec![false; room])?;
                padding += room as u64;
            }
        }
        packed = Some(PackReport {
            rows: rows.len() as u64,
            padding,
        });
    }
    if options.pad || options.pack.is_some() {
        // The last row's window needs one token past it for its last target.
        writer.write(&[eot])?;
        writer.end_document()?;
        mask.write(&[false])?;
    }
    let written = writer.finish()?;
    mask.finish()?;
    let mask_bytes = std::fs::metadata(&mask_path)
        .map_err(|e| err(&mask_path, e.to_string()))?
        .len();
    let mut files = written.files;
    files.push((mask_path, mask_bytes));
    Ok(PromptCompletionReport {
        files,
        examples: examples_read,
        tokens: written.tokens,
        counted,
        boundary_merges: merges,
        format,
        truncated,
        dropped,
        packed_uncounted,
        stop_token_counted,
        packed,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// GPT-2's `bytes_to_unicode`, written out as the Python does it, is undone byte for byte.
    #[test]
    fn byte_level_characters_map_back_to_their_bytes() {
        let mut printable: Vec<u32> = (u32::from(b'!')..=u32::from(b'~')).collect();
        printable.extend(0xA1..=0xAC);
        printable.extend(0xAE..=0xFF);
        let mut n = 0;
        for b in 0..=255u32 {
            let c = if printable.contains(&b) {
                b
            } else {
                n += 1;
                255 + n
            };
            let c = char::from_u32(c).unwrap();
            assert_eq!(byte_of_level_char(c), Some(b as u8), "{c:?}");
        }
        assert_eq!(n, 68);
        assert_eq!(byte_of_level_char('\u{144}'), None);
        assert_eq!(byte_of_level_char('€'), None);
    }

    #[test]
    fn gpt2_token_bytes_are_the_tokens_bytes() {
        let t = Tokenizer::from_name("gpt2").unwrap();
        let ids = t.encode(" naïve 東京").unwrap();
        let joined: Vec<u8> = ids
            .iter()
            .flat_map(|&id| t.token_bytes(id).unwrap())
            .collect();
        assert_eq!(joined, " naïve 東京".as_bytes());
        assert!(t.token_bytes(u32::MAX).is_err());
    }
}
