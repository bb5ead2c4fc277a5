//! Apache Arrow's IPC format, read as rows of JSON objects by the same rules as Parquet.
//!
//! Hugging Face `datasets` keeps every dataset it has loaded or built as Arrow IPC streams:
//! the cache's `*.arrow` files and `save_to_disk`'s `data-00000-of-00001.arrow`, written by
//! pyarrow's `RecordBatchStreamWriter`. pyarrow's `RecordBatchFileWriter` (Feather v2) writes
//! the file format: the same messages between `ARROW1` magic, indexed by a footer. Both are
//! read here, a record batch at a time, so a cache file of many gigabytes is never decoded
//! whole.
//!
//! What it reads: the stream format (with the continuation marker, or without it as writers
//! before Arrow 0.15 wrote it) and the file format; metadata versions V4 and V5; buffers
//! uncompressed or compressed with LZ4_FRAME or ZSTD; dictionary-encoded columns, with
//! dictionaries replaced or extended (delta) between batches; nullable fields; booleans;
//! signed and unsigned integers of every width; float32 and float64 (NaN and infinities
//! become null); utf8 and large_utf8 as strings; binary, large_binary and fixed_size_binary
//! as arrays of byte values; date32, date64, time, timestamp and duration as their stored
//! integers; list, large_list, fixed_size_list and struct, nested to any depth.
//!
//! What it refuses with [`ArrowError::Unsupported`], and only when that column is read:
//! map, union, decimal, float16, interval, run-end encoded and the view types (the last
//! three's buffers are still stepped over, so the columns after them read), big-endian data.
//!
//! Bounds: every offset and length in the metadata is checked against the file before use,
//! a decompressed buffer is bounded by [`ReadOptions::max_page_bytes`], and the values one
//! call materialises (a dictionary's values counted each time they are used) by
//! [`ReadOptions::max_values`].

use std::borrow::Cow;
use std::collections::HashMap;

use serde_json::Value;

use crate::compress::{self, Codec};
use crate::flatbuf::{self, Table};
use crate::{value_weight, Budget, ParquetError, ReadOptions, Row};

/// Why Arrow IPC data could not be read.
#[derive(Debug, thiserror::Error)]
pub enum ArrowError {
    /// Not Arrow IPC at all: neither the file format's `ARROW1` magic nor a stream that
    /// starts with a schema message.
    #[error("not an Arrow IPC file or stream: {0}")]
    NotArrow(String),
    /// Arrow IPC data whose bytes contradict themselves or end early.
    #[error("corrupt Arrow IPC data: {0}")]
    Corrupt(String),
    /// Valid Arrow IPC that uses something this reader does not read.
    #[error("unsupported Arrow feature: {0}")]
    Unsupported(String),
    /// A column asked for that the schema does not have.
    #[error("no column {0:?} in the Arrow schema (it has {1})")]
    UnknownColumn(String, String),
    /// A record batch asked for that the data does not have.
    #[error("no record batch {index} in Arrow data of {count}")]
    NoBatch {
        /// The index asked for.
        index: usize,
        /// The batches there are.
        count: usize,
    },
    /// A read that would pass [`ReadOptions`]' bounds.
    #[error("Arrow read over its bound: {0}")]
    OverBudget(String),
}

type Result<T> = std::result::Result<T, ArrowError>;

fn corrupt(what: impl Into<String>) -> ArrowError {
    ArrowError::Corrupt(what.into())
}

impl From<ParquetError> for ArrowError {
    fn from(e: ParquetError) -> ArrowError {
        match e {
            ParquetError::Unsupported(what) => ArrowError::Unsupported(what),
            ParquetError::Corrupt(what) => ArrowError::Corrupt(what),
            ParquetError::OverBudget(what) => ArrowError::OverBudget(what),
            other => ArrowError::Corrupt(other.to_string()),
        }
    }
}

/// Which of Arrow's two IPC layouts the bytes are in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ArrowFormat {
    /// Messages one after another, as `datasets` writes its cache and `save_to_disk` files.
    Stream,
    /// `ARROW1`, the messages, and a footer indexing them (Feather v2).
    File,
}

/// Whether `head`, a file's first bytes, look like Arrow IPC: the file format's magic, or a
/// stream's continuation marker (a stream written before Arrow 0.15 has none and is only
/// known by parsing it).
pub fn is_arrow(head: &[u8]) -> bool {
    head.starts_with(b"ARROW1") || head.starts_with(&[0xff; 4])
}

/// The metadata versions this reader knows: V4 (Arrow 0.8) is `3`, V5 (Arrow 1.0) `4`.
const V4: i16 = 3;
const V5: i16 = 4;

/// How deep fields may nest in a schema; deeper is taken for a hostile file.
const MAX_DEPTH: usize = 64;

#[derive(Clone, Copy, Debug)]
struct IntType {
    bits: u8,
    signed: bool,
}

/// How an unsupported type's buffers are laid out, so that the columns after it still read.
#[derive(Clone, Copy, Debug)]
enum Shape {
    /// This many buffers, then the children's.
    Buffers(usize),
    /// A view type: validity, views, and as many data buffers as the batch's
    /// `variadicBufferCounts` says.
    Views,
    /// A type this reader does not know at all.
    Unknown,
}

#[derive(Clone, Debug)]
enum Kind {
    Null,
    Int(IntType),
    Float(u8),
    Bool,
    Bytes {
        large: bool,
        utf8: bool,
    },
    FixedBytes(usize),
    /// Dates, times, timestamps and durations: their stored integers, of this many bytes.
    Temporal(usize),
    List {
        large: bool,
    },
    FixedList(usize),
    Struct,
    Unsupported {
        why: String,
        shape: Shape,
    },
}

#[derive(Clone, Debug)]
struct Field {
    name: String,
    kind: Kind,
    children: Vec<Field>,
    /// The dictionary's id and its indices' type, for a dictionary-encoded field (whose
    /// `kind` is then its values' type).
    dictionary: Option<(i64, IntType)>,
}

fn int_type(t: &Table<'_>) -> Result<IntType> {
    let bits = t.i32(0, 0).map_err(corrupt)?;
    let signed = t.bool(1).map_err(corrupt)?;
    match bits {
        8 | 16 | 32 | 64 => Ok(IntType {
            bits: bits as u8,
            signed,
        }),
        _ => Err(corrupt(format!("a {bits}-bit integer"))),
    }
}

fn parse_field(t: &Table<'_>, version: i16, depth: usize) -> Result<Field> {
    if depth > MAX_DEPTH {
        return Err(corrupt(format!("fields nested deeper than {MAX_DEPTH}")));
    }
    let name = t.string(0).map_err(corrupt)?.unwrap_or("").to_owned();
    let type_id = t.u8(2, 0).map_err(corrupt)?;
    let ty = t.table(3).map_err(corrupt)?;
    let dictionary = match t.table(4).map_err(corrupt)? {
        Some(d) => {
            let id = d.i64(0, 0).map_err(corrupt)?;
            let index = match d.table(1).map_err(corrupt)? {
                Some(i) => int_type(&i)?,
                None => IntType {
                    bits: 32,
                    signed: true,
                },
            };
            Some((id, index))
        }
        None => None,
    };
    let children = t
        .tables(5)
        .map_err(corrupt)?
        .iter()
        .map(|c| parse_field(c, version, depth + 1))
        .collect::<Result<Vec<_>>>()?;
    let param = |slot: usize, default: i32| -> Result<i32> {
        match &ty {
            Some(ty) => ty.i32(slot, default).map_err(corrupt),
            None => Ok(default),
        }
    };
    let short = |slot: usize, default: i16| -> Result<i16> {
        match &ty {
            Some(ty) => ty.i16(slot, default).map_err(corrupt),
            None => Ok(default),
        }
    };
    let unsupported = |why: &str, shape: Shape| Kind::Unsupported {
        why: why.to_owned(),
        shape,
    };
    // A union had a validity buffer before V5.
    let union_validity = usize::from(version < V5);
    let kind = match type_id {
        1 => Kind::Null,
        2 => Kind::Int(match &ty {
            Some(ty) => int_type(ty)?,
            None => {
                return Err(corrupt(format!(
                    "field {name:?}: an integer without a width"
                )))
            }
        }),
        3 => match short(0, 0)? {
            0 => unsupported("float16 values", Shape::Buffers(2)),
            1 => Kind::Float(32),
            2 => Kind::Float(64),
            p => return Err(corrupt(format!("field {name:?}: float precision {p}"))),
        },
        4 => Kind::Bytes {
            large: false,
            utf8: false,
        },
        5 => Kind::Bytes {
            large: false,
            utf8: true,
        },
        6 => Kind::Bool,
        7 => unsupported("decimal values", Shape::Buffers(2)),
        // date32 counts days, date64 milliseconds.
        8 => Kind::Temporal(if short(0, 1)? == 0 { 4 } else { 8 }),
        9 => match param(1, 32)? {
            32 => Kind::Temporal(4),
            64 => Kind::Temporal(8),
            b => return Err(corrupt(format!("field {name:?}: a {b}-bit time"))),
        },
        10 | 18 => Kind::Temporal(8),
        11 => unsupported("interval values", Shape::Buffers(2)),
        12 => Kind::List { large: false },
        13 => Kind::Struct,
        14 => {
            let dense = short(0, 0)? == 1;
            unsupported(
                "a union",
                Shape::Buffers(1 + usize::from(dense) + union_validity),
            )
        }
        15 => match param(0, 0)? {
            w if w >= 0 => Kind::FixedBytes(w as usize),
            w => return Err(corrupt(format!("field {name:?}: {w}-byte fixed binary"))),
        },
        16 => match param(0, 0)? {
            n if n >= 0 => Kind::FixedList(n as usize),
            n => return Err(corrupt(format!("field {name:?}: fixed lists of {n}"))),
        },
        17 => unsupported("a map", Shape::Buffers(2)),
        19 => Kind::Bytes {
            large: true,
            utf8: false,
        },
        20 => Kind::Bytes {
            large: true,
            utf8: true,
        },
        21 => Kind::List { large: true },
        22 => unsupported("run-end encoding", Shape::Buffers(0)),
        23 | 24 => unsupported("a view type (binary_view, string_view)", Shape::Views),
        25 | 26 => unsupported("a list view", Shape::Buffers(3)),
        0 => return Err(corrupt(format!("field {name:?} has no type"))),
        n => unsupported(&format!("type {n}, newer than this reader"), Shape::Unknown),
    };
    let wanted_children = match kind {
        Kind::List { .. } | Kind::FixedList(_) => Some(1),
        Kind::Unsupported { .. } | Kind::Struct => None,
        _ => Some(0),
    };
    if wanted_children.is_some_and(|n| n != children.len()) {
        return Err(corrupt(format!(
            "field {name:?} has {} children",
            children.len()
        )));
    }
    Ok(Field {
        name,
        kind,
        children,
        dictionary,
    })
}

/// Every dictionary-encoded field under `fields`, by id, as the field of its values.
fn dictionary_fields(fields: &[Field], into: &mut HashMap<i64, Field>) -> Result<()> {
    for f in fields {
        if let Some((id, _)) = f.dictionary {
            let values = Field {
                dictionary: None,
                ..f.clone()
            };
            if into.insert(id, values).is_some() {
                return Err(ArrowError::Unsupported(format!(
                    "dictionary {id} shared by several fields"
                )));
            }
        }
        dictionary_fields(&f.children, into)?;
    }
    Ok(())
}

/// The dictionaries `field` and its children use.
fn dictionary_ids(field: &Field, into: &mut Vec<i64>) {
    if let Some((id, _)) = field.dictionary {
        into.push(id);
    } else {
        for c in &field.children {
            dictionary_ids(c, into);
        }
    }
}

/// A message after the schema: a dictionary, or a record batch of `rows` rows.
#[derive(Clone, Copy, Debug)]
enum Message<'a> {
    Dictionary {
        id: i64,
        delta: bool,
        batch: Table<'a>,
        body: &'a [u8],
    },
    Batch {
        batch: Table<'a>,
        body: &'a [u8],
        rows: u64,
    },
}

/// A message's metadata and where its body starts; `None` at a stream's end marker.
fn framed(bytes: &[u8], at: usize) -> Result<Option<(Table<'_>, usize)>> {
    let word = |p: usize| -> Result<[u8; 4]> {
        p.checked_add(4)
            .and_then(|e| bytes.get(p..e))
            .map(|b| b.try_into().expect("4 bytes"))
            .ok_or_else(|| corrupt(format!("a message cut short at byte {p}")))
    };
    let first = word(at)?;
    let (len, start) = if first == [0xff; 4] {
        (i32::from_le_bytes(word(at + 4)?), at + 8)
    } else {
        (i32::from_le_bytes(first), at + 4)
    };
    if len == 0 {
        return Ok(None);
    }
    let meta = usize::try_from(len)
        .ok()
        .and_then(|n| Some(start..start.checked_add(n)?))
        .and_then(|r| Some((bytes.get(r.clone())?, r.end)))
        .ok_or_else(|| {
            corrupt(format!(
                "a {len}-byte message at byte {at} of {}",
                bytes.len()
            ))
        })?;
    let table = flatbuf::root(meta.0).map_err(|e| corrupt(format!("message at {at}: {e}")))?;
    Ok(Some((table, meta.1)))
}

/// A message's version, header type, header and body length.
fn message_header<'a>(t: &Table<'a>, at: usize) -> Result<(u8, Table<'a>, usize)> {
    let bad = |e: String| corrupt(format!("message at {at}: {e}"));
    let version = t.i16(0, 0).map_err(bad)?;
    if !(V4..=V5).contains(&version) {
        return Err(if version < V4 {
            ArrowError::Unsupported(format!(
                "metadata version V{} (before Arrow 0.8)",
                i32::from(version) + 1
            ))
        } else {
            ArrowError::Unsupported(format!("metadata version V{}", i32::from(version) + 1))
        });
    }
    let kind = t.u8(1, 0).map_err(bad)?;
    let header = t
        .table(2)
        .map_err(bad)?
        .ok_or_else(|| corrupt(format!("message at {at} has no header")))?;
    let body = t.i64(3, 0).map_err(bad)?;
    let body = usize::try_from(body)
        .map_err(|_| corrupt(format!("message at {at}: a body of {body} bytes")))?;
    Ok((kind, header, body))
}

/// A message's body, checked to lie in the file.
fn body_at(bytes: &[u8], start: usize, len: usize) -> Result<&[u8]> {
    start
        .checked_add(len)
        .and_then(|end| bytes.get(start..end))
        .ok_or_else(|| {
            corrupt(format!(
                "a {len}-byte body at byte {start} of a {}-byte file",
                bytes.len()
            ))
        })
}

/// Arrow IPC data over its bytes: its schema read and its messages found, no batch decoded.
#[derive(Debug)]
pub struct ArrowFile<'a> {
    format: ArrowFormat,
    fields: Vec<Field>,
    names: Vec<String>,
    metadata: Vec<(String, String)>,
    dictionary_fields: HashMap<i64, Field>,
    messages: Vec<Message<'a>>,
    /// Each record batch's index in `messages`.
    batches: Vec<usize>,
    num_rows: u64,
}

impl<'a> ArrowFile<'a> {
    /// Parses the schema and finds every message of the IPC file or stream `bytes`.
    pub fn parse(bytes: &'a [u8]) -> Result<ArrowFile<'a>> {
        if bytes.starts_with(b"ARROW1") {
            return Self::parse_file(bytes);
        }
        let (schema, version, mut at) = match framed(bytes, 0) {
            Ok(Some((t, end))) => match message_header(&t, 0) {
                Ok((1, header, body)) => (header, t.i16(0, 0).map_err(corrupt)?, end + body),
                Ok(_) => {
                    return Err(ArrowError::NotArrow(
                        "its first message is not a schema".into(),
                    ))
                }
                Err(e @ ArrowError::Unsupported(_)) => return Err(e),
                Err(e) => return Err(ArrowError::NotArrow(e.to_string())),
            },
            Ok(None) => return Err(ArrowError::NotArrow("it is an empty stream".into())),
            Err(e) => return Err(ArrowError::NotArrow(e.to_string())),
        };
        let mut file = Self::with_schema(ArrowFormat::Stream, &schema, version)?;
        // A stream ends at its end marker, or where the bytes do (a writer that was not
        // closed; what is there is whole messages or an error).
        while at < bytes.len() {
            let Some((t, end)) = framed(bytes, at)? else {
                break;
            };
            let (kind, header, len) = message_header(&t, at)?;
            let body = body_at(bytes, end, len)?;
            match kind {
                2 | 3 => file.push(kind, header, body, at)?,
                1 => return Err(corrupt(format!("a second schema at byte {at}"))),
                k => {
                    return Err(ArrowError::Unsupported(format!(
                        "message type {k} at byte {at} (tensors are not tables)"
                    )))
                }
            }
            at = end + len;
        }
        Ok(file)
    }

    /// The file format: magic, padding, the stream, the footer, its length, magic.
    fn parse_file(bytes: &'a [u8]) -> Result<ArrowFile<'a>> {
        let n = bytes.len();
        if n < 18 || &bytes[n - 6..] != b"ARROW1" {
            return Err(corrupt("an Arrow file that does not end with ARROW1"));
        }
        let footer_len = i32::from_le_bytes(bytes[n - 10..n - 6].try_into().expect("4"));
        let footer = usize::try_from(footer_len)
            .ok()
            .and_then(|len| (n - 10).checked_sub(len))
            .filter(|&start| start >= 8)
            .map(|start| &bytes[start..n - 10])
            .ok_or_else(|| corrupt(format!("a {footer_len}-byte footer in a {n}-byte file")))?;
        let bad = |e: String| corrupt(format!("footer: {e}"));
        let root = flatbuf::root(footer).map_err(bad)?;
        let version = root.i16(0, 0).map_err(bad)?;
        if version < V4 {
            return Err(ArrowError::Unsupported(format!(
                "metadata version V{} (before Arrow 0.8)",
                i32::from(version) + 1
            )));
        }
        let schema = root
            .table(1)
            .map_err(bad)?
            .ok_or_else(|| corrupt("a footer without a schema"))?;
        let mut file = Self::with_schema(ArrowFormat::File, &schema, version)?;
        let dictionaries = root.structs(2, 24).map_err(bad)?;
        let batches = root.structs(3, 24).map_err(bad)?;
        // Dictionaries before batches: a file's dictionaries hold for all of its batches.
        for (kind, blocks) in [(2u8, dictionaries), (3u8, batches)] {
            for block in blocks.chunks_exact(24) {
                let offset = i64::from_le_bytes(block[0..8].try_into().expect("8"));
                let meta_len = i32::from_le_bytes(block[8..12].try_into().expect("4"));
                let body_len = i64::from_le_bytes(block[16..24].try_into().expect("8"));
                let (Ok(at), Ok(meta_len), Ok(body_len)) = (
                    usize::try_from(offset),
                    usize::try_from(meta_len),
                    usize::try_from(body_len),
                ) else {
                    return Err(corrupt(format!(
                        "a block at {offset} of {meta_len} + {body_len} bytes"
                    )));
                };
                let (t, end) = framed(bytes, at)?
                    .ok_or_else(|| corrupt(format!("an end marker at block {at}")))?;
                let (found, header, len) = message_header(&t, at)?;
                if found != kind || len != body_len || at.checked_add(meta_len) < Some(end) {
                    return Err(corrupt(format!(
                        "the message at {at} is not the one the footer indexes"
                    )));
                }
                let body = body_at(bytes, at + meta_len, len)?;
                file.push(kind, header, body, at)?;
            }
        }
        Ok(file)
    }

    fn with_schema(format: ArrowFormat, schema: &Table<'_>, version: i16) -> Result<Self> {
        let bad = |e: String| corrupt(format!("schema: {e}"));
        if schema.i16(0, 0).map_err(bad)? != 0 {
            return Err(ArrowError::Unsupported("big-endian data".into()));
        }
        let fields = schema
            .tables(1)
            .map_err(bad)?
            .iter()
            .map(|f| parse_field(f, version, 0))
            .collect::<Result<Vec<_>>>()?;
        let mut names: Vec<String> = Vec::new();
        for f in &fields {
            if names.contains(&f.name) {
                return Err(corrupt(format!("two top-level fields named {:?}", f.name)));
            }
            names.push(f.name.clone());
        }
        let metadata = schema
            .tables(2)
            .map_err(bad)?
            .iter()
            .map(|kv| {
                let key = kv.string(0).map_err(bad)?.unwrap_or("").to_owned();
                let value = kv.string(1).map_err(bad)?.unwrap_or("").to_owned();
                Ok((key, value))
            })
            .collect::<Result<Vec<_>>>()?;
        let mut dictionaries = HashMap::new();
        dictionary_fields(&fields, &mut dictionaries)?;
        Ok(ArrowFile {
            format,
            fields,
            names,
            metadata,
            dictionary_fields: dictionaries,
            messages: Vec::new(),
            batches: Vec::new(),
            num_rows: 0,
        })
    }

    fn push(&mut self, kind: u8, header: Table<'a>, body: &'a [u8], at: usize) -> Result<()> {
        let bad = |e: String| corrupt(format!("message at {at}: {e}"));
        if kind == 2 {
            let id = header.i64(0, 0).map_err(bad)?;
            let batch = header
                .table(1)
                .map_err(bad)?
                .ok_or_else(|| corrupt(format!("dictionary at {at} without data")))?;
            let delta = header.bool(2).map_err(bad)?;
            if !self.dictionary_fields.contains_key(&id) {
                return Err(corrupt(format!(
                    "dictionary {id} at {at}, which no field uses"
                )));
            }
            self.messages.push(Message::Dictionary {
                id,
                delta,
                batch,
                body,
            });
        } else {
            let rows = header.i64(0, 0).map_err(bad)?;
            let rows = u64::try_from(rows).map_err(|_| bad(format!("{rows} rows")))?;
            self.num_rows = self.num_rows.saturating_add(rows);
            self.batches.push(self.messages.len());
            self.messages.push(Message::Batch {
                batch: header,
                body,
                rows,
            });
        }
        Ok(())
    }

    /// Stream or file.
    pub fn format(&self) -> ArrowFormat {
        self.format
    }

    /// The rows in all batches.
    pub fn num_rows(&self) -> u64 {
        self.num_rows
    }

    /// The record batches.
    pub fn num_batches(&self) -> usize {
        self.batches.len()
    }

    /// The rows of record batch `index`.
    pub fn batch_rows(&self, index: usize) -> Option<u64> {
        match self.messages.get(*self.batches.get(index)?) {
            Some(Message::Batch { rows, .. }) => Some(*rows),
            _ => None,
        }
    }

    /// The top-level fields, in schema order.
    pub fn fields(&self) -> &[String] {
        &self.names
    }

    /// The schema's key-value metadata (`datasets` keeps its features under `huggingface`).
    pub fn metadata(&self) -> &[(String, String)] {
        &self.metadata
    }

    /// The top-level fields that cannot be read, each with why: reading them is an
    /// [`ArrowError::Unsupported`] error.
    pub fn unreadable_fields(&self) -> Vec<(String, String)> {
        fn why(f: &Field) -> Option<String> {
            match &f.kind {
                Kind::Unsupported { why, .. } => Some(why.clone()),
                _ => f.children.iter().find_map(why),
            }
        }
        self.fields
            .iter()
            .filter_map(|f| Some((f.name.clone(), why(f)?)))
            .collect()
    }

    /// Every row; the bounds hold for the whole call.
    pub fn rows(&self, options: &ReadOptions) -> Result<Vec<Row>> {
        let mut budget = Budget::of(options);
        let mut out = Vec::new();
        for b in 0..self.num_batches() {
            out.extend(self.read_batch(b, options, &mut budget)?);
        }
        Ok(out)
    }

    /// The rows of record batch `index` (a large file read a batch at a time).
    pub fn batch(&self, index: usize, options: &ReadOptions) -> Result<Vec<Row>> {
        if index >= self.num_batches() {
            return Err(ArrowError::NoBatch {
                index,
                count: self.num_batches(),
            });
        }
        self.read_batch(index, options, &mut Budget::of(options))
    }

    fn read_batch(&self, b: usize, options: &ReadOptions, budget: &mut Budget) -> Result<Vec<Row>> {
        let chosen: Vec<bool> = match &options.columns {
            Some(names) => {
                if let Some(missing) = names.iter().find(|n| !self.names.contains(n)) {
                    return Err(ArrowError::UnknownColumn(
                        missing.clone(),
                        self.names.join(", "),
                    ));
                }
                self.names.iter().map(|n| names.contains(n)).collect()
            }
            None => vec![true; self.fields.len()],
        };
        let at = self.batches[b];
        let Message::Batch { batch, body, rows } = self.messages[at] else {
            unreachable!("batches index record batches");
        };
        budget.spend(rows)?;
        // The dictionaries the chosen columns use, as they stand at this batch.
        let mut ids = Vec::new();
        for (f, _) in self.fields.iter().zip(&chosen).filter(|(_, &c)| c) {
            dictionary_ids(f, &mut ids);
        }
        // Each from its last whole dictionary before this batch, then the deltas after it:
        // a stream that replaces its dictionaries is not decoded from its start every batch.
        let mut dictionaries: HashMap<i64, Vec<Value>> = HashMap::new();
        for &wanted in &ids {
            let whole = |m: &Message<'_>| matches!(m, Message::Dictionary { id, delta: false, .. } if *id == wanted);
            let from = self.messages[..at].iter().rposition(whole).unwrap_or(0);
            for message in &self.messages[from..at] {
                let Message::Dictionary {
                    id,
                    delta,
                    batch,
                    body,
                } = *message
                else {
                    continue;
                };
                if id != wanted {
                    continue;
                }
                let field = &self.dictionary_fields[&id];
                let mut none = HashMap::new();
                let mut reader = BatchReader::new(batch, body, options, budget)
                    .map_err(|e| in_dictionary(e, id))?;
                let values = reader
                    .read(field, &mut none)
                    .map_err(|e| in_dictionary(e, id))?;
                let entry = dictionaries.entry(id).or_default();
                if !delta {
                    entry.clear();
                }
                entry.extend(values);
            }
        }
        let mut reader =
            BatchReader::new(batch, body, options, budget).map_err(|e| in_batch(e, b, None))?;
        let rows = usize::try_from(rows).map_err(|_| corrupt("a batch too long to index"))?;
        let mut out: Vec<Row> = (0..rows).map(|_| Row::new()).collect();
        let last = chosen.iter().rposition(|&c| c);
        for (i, (field, &wanted)) in self.fields.iter().zip(&chosen).enumerate() {
            if Some(i) > last || last.is_none() {
                break;
            }
            if !wanted {
                reader
                    .skip(field)
                    .map_err(|e| in_batch(e, b, Some(field)))?;
                continue;
            }
            let values = reader
                .read(field, &mut dictionaries)
                .map_err(|e| in_batch(e, b, Some(field)))?;
            if values.len() != rows {
                return Err(in_batch(
                    corrupt(format!("{} values in a batch of {rows} rows", values.len())),
                    b,
                    Some(field),
                ));
            }
            for (row, v) in out.iter_mut().zip(values) {
                row.insert(field.name.clone(), v);
            }
        }
        Ok(out)
    }
}

fn in_batch(e: ArrowError, b: usize, field: Option<&Field>) -> ArrowError {
    let place = match field {
        Some(f) => format!("batch {b}, column {:?}", f.name),
        None => format!("batch {b}"),
    };
    match e {
        ArrowError::Corrupt(w) => ArrowError::Corrupt(format!("{place}: {w}")),
        ArrowError::Unsupported(w) => ArrowError::Unsupported(format!("{place}: {w}")),
        other => other,
    }
}

fn in_dictionary(e: ArrowError, id: i64) -> ArrowError {
    match e {
        ArrowError::Corrupt(w) => ArrowError::Corrupt(format!("dictionary {id}: {w}")),
        ArrowError::Unsupported(w) => ArrowError::Unsupported(format!("dictionary {id}: {w}")),
        other => other,
    }
}

/// Walks a record batch's nodes and buffers in the schema's depth-first order.
struct BatchReader<'a, 'o> {
    body: &'a [u8],
    nodes: &'a [u8],
    buffers: &'a [u8],
    variadic: &'a [u8],
    next_node: usize,
    next_buffer: usize,
    next_variadic: usize,
    codec: Option<Codec>,
    options: &'o ReadOptions,
    budget: &'o mut Budget,
}

impl<'a, 'o> BatchReader<'a, 'o> {
    fn new(
        batch: Table<'a>,
        body: &'a [u8],
        options: &'o ReadOptions,
        budget: &'o mut Budget,
    ) -> Result<Self> {
        let nodes = batch.structs(1, 16).map_err(corrupt)?;
        let buffers = batch.structs(2, 16).map_err(corrupt)?;
        let codec = match batch.table(3).map_err(corrupt)? {
            None => None,
            Some(c) => {
                if c.u8(1, 0).map_err(corrupt)? != 0 {
                    return Err(ArrowError::Unsupported(
                        "a body compressed other than buffer by buffer".into(),
                    ));
                }
                Some(match c.u8(0, 0).map_err(corrupt)? {
                    0 => Codec::Lz4Frame,
                    1 => Codec::Zstd,
                    n => return Err(ArrowError::Unsupported(format!("body compression {n}"))),
                })
            }
        };
        let variadic = batch.structs(4, 8).map_err(corrupt)?;
        Ok(BatchReader {
            body,
            nodes,
            buffers,
            variadic,
            next_node: 0,
            next_buffer: 0,
            next_variadic: 0,
            codec,
            options,
            budget,
        })
    }

    /// The next node's length and null count.
    fn node(&mut self) -> Result<(usize, usize)> {
        let at = self.next_node * 16;
        let node = self
            .nodes
            .get(at..at + 16)
            .ok_or_else(|| corrupt(format!("fewer than {} field nodes", self.next_node + 1)))?;
        self.next_node += 1;
        let len = i64::from_le_bytes(node[..8].try_into().expect("8"));
        let nulls = i64::from_le_bytes(node[8..].try_into().expect("8"));
        match (usize::try_from(len), usize::try_from(nulls)) {
            (Ok(len), Ok(nulls)) if nulls <= len => Ok((len, nulls)),
            _ => Err(corrupt(format!("a node of {len} values, {nulls} null"))),
        }
    }

    fn raw_buffer(&mut self) -> Result<&'a [u8]> {
        let at = self.next_buffer * 16;
        let entry = self
            .buffers
            .get(at..at + 16)
            .ok_or_else(|| corrupt(format!("fewer than {} buffers", self.next_buffer + 1)))?;
        self.next_buffer += 1;
        let offset = i64::from_le_bytes(entry[..8].try_into().expect("8"));
        let len = i64::from_le_bytes(entry[8..].try_into().expect("8"));
        usize::try_from(offset)
            .ok()
            .zip(usize::try_from(len).ok())
            .and_then(|(o, l)| self.body.get(o..o.checked_add(l)?))
            .ok_or_else(|| {
                corrupt(format!(
                    "a {len}-byte buffer at {offset} of a {}-byte body",
                    self.body.len()
                ))
            })
    }

    /// The next buffer, decompressed: a compressed body prefixes each buffer with its
    /// uncompressed length, -1 for one stored as it is.
    fn buffer(&mut self) -> Result<Cow<'a, [u8]>> {
        let raw = self.raw_buffer()?;
        let Some(codec) = self.codec else {
            return Ok(Cow::Borrowed(raw));
        };
        if raw.is_empty() {
            return Ok(Cow::Borrowed(raw));
        }
        let (size, data) = raw
            .split_first_chunk::<8>()
            .ok_or_else(|| corrupt("a compressed buffer shorter than its length prefix"))?;
        let size = i64::from_le_bytes(*size);
        if size == -1 {
            return Ok(Cow::Borrowed(data));
        }
        let size = usize::try_from(size)
            .map_err(|_| corrupt(format!("a buffer of {size} bytes uncompressed")))?;
        if size > self.options.max_page_bytes {
            return Err(ArrowError::OverBudget(format!(
                "a {size}-byte buffer (ReadOptions::max_page_bytes is {})",
                self.options.max_page_bytes
            )));
        }
        Ok(Cow::Owned(compress::decompress(codec, data, size)?))
    }

    /// Steps over `field`'s nodes and buffers.
    fn skip(&mut self, field: &Field) -> Result<()> {
        self.node()?;
        if field.dictionary.is_some() {
            self.raw_buffer()?;
            self.raw_buffer()?;
            return Ok(());
        }
        let buffers = match &field.kind {
            Kind::Null => 0,
            Kind::Int(_)
            | Kind::Float(_)
            | Kind::Bool
            | Kind::FixedBytes(_)
            | Kind::Temporal(_)
            | Kind::List { .. } => 2,
            Kind::Bytes { .. } => 3,
            Kind::FixedList(_) | Kind::Struct => 1,
            Kind::Unsupported { shape, why } => match shape {
                Shape::Buffers(n) => *n,
                Shape::Views => {
                    let at = self.next_variadic * 8;
                    let count = self
                        .variadic
                        .get(at..at + 8)
                        .map(|c| i64::from_le_bytes(c.try_into().expect("8")))
                        .ok_or_else(|| corrupt("fewer variadic buffer counts than view fields"))?;
                    self.next_variadic += 1;
                    usize::try_from(count)
                        .ok()
                        .and_then(|c| c.checked_add(2))
                        .ok_or_else(|| corrupt(format!("{count} variadic buffers")))?
                }
                Shape::Unknown => {
                    return Err(ArrowError::Unsupported(format!(
                        "field {:?}: {why}, whose buffers cannot be stepped over",
                        field.name
                    )))
                }
            },
        };
        for _ in 0..buffers {
            self.raw_buffer()?;
        }
        for child in &field.children {
            self.skip(child)?;
        }
        Ok(())
    }

    /// `field`'s values, one per element of its node.
    fn read(
        &mut self,
        field: &Field,
        dictionaries: &mut HashMap<i64, Vec<Value>>,
    ) -> Result<Vec<Value>> {
        let (len, nulls) = self.node()?;
        self.budget.spend(len as u64)?;
        if let Kind::Unsupported { why, .. } = &field.kind {
            return Err(ArrowError::Unsupported(format!(
                "field {:?}: {why}",
                field.name
            )));
        }
        if let Some((id, index)) = field.dictionary {
            let validity = self.validity(len, nulls)?;
            let indices = self.buffer()?;
            let values = dictionaries
                .get(&id)
                .ok_or_else(|| corrupt(format!("dictionary {id} used before it is sent")))?;
            let ints = fixed(&indices, len, usize::from(index.bits / 8))?;
            let mut out = Vec::with_capacity(len);
            for (i, bytes) in ints.enumerate() {
                if !validity.get(i) {
                    out.push(Value::Null);
                    continue;
                }
                let k = int_value(bytes, index.signed);
                let v = k
                    .as_u64()
                    .and_then(|k| values.get(usize::try_from(k).ok()?))
                    .ok_or_else(|| {
                        corrupt(format!(
                            "index {k} into dictionary {id} of {}",
                            values.len()
                        ))
                    })?;
                self.budget.spend(value_weight(v))?;
                out.push(v.clone());
            }
            return Ok(out);
        }
        if matches!(field.kind, Kind::Null) {
            return Ok(vec![Value::Null; len]);
        }
        let validity = self.validity(len, nulls)?;
        let values: Vec<Value> = match field.kind {
            Kind::Null | Kind::Unsupported { .. } => unreachable!("handled above"),
            Kind::Int(t) => {
                let data = self.buffer()?;
                fixed(&data, len, usize::from(t.bits / 8))?
                    .map(|b| int_value(b, t.signed))
                    .collect()
            }
            Kind::Temporal(width) => {
                let data = self.buffer()?;
                fixed(&data, len, width)?
                    .map(|b| int_value(b, true))
                    .collect()
            }
            Kind::Float(bits) => {
                let data = self.buffer()?;
                let float =
                    |v: f64| serde_json::Number::from_f64(v).map_or(Value::Null, Value::Number);
                if bits == 32 {
                    fixed(&data, len, 4)?
                        .map(|b| float(f64::from(f32::from_le_bytes(b.try_into().expect("4")))))
                        .collect()
                } else {
                    fixed(&data, len, 8)?
                        .map(|b| float(f64::from_le_bytes(b.try_into().expect("8"))))
                        .collect()
                }
            }
            Kind::Bool => {
                let data = self.buffer()?;
                let bits = Bits::over(data, len, "a boolean")?;
                (0..len).map(|i| Value::Bool(bits.get(i))).collect()
            }
            Kind::FixedBytes(width) => {
                let data = self.buffer()?;
                if width == 0 {
                    vec![Value::Array(Vec::new()); len]
                } else {
                    fixed(&data, len, width)?.map(byte_array).collect()
                }
            }
            Kind::Bytes { large, utf8 } => {
                let offsets = self.buffer()?;
                let data = self.buffer()?;
                let offsets = offsets_of(&offsets, len, large, data.len())?;
                let mut out = Vec::with_capacity(len);
                for (i, w) in offsets.windows(2).enumerate() {
                    if !validity.get(i) {
                        out.push(Value::Null);
                        continue;
                    }
                    let bytes = &data[w[0]..w[1]];
                    out.push(if utf8 {
                        Value::String(
                            std::str::from_utf8(bytes)
                                .map_err(|e| corrupt(format!("value {i} is not UTF-8: {e}")))?
                                .to_owned(),
                        )
                    } else {
                        byte_array(bytes)
                    });
                }
                return Ok(out);
            }
            Kind::List { large } => {
                let offsets = self.buffer()?;
                let offsets: Vec<usize> = if len == 0 {
                    Vec::new()
                } else {
                    offsets_of(&offsets, len, large, usize::MAX)?
                };
                let child = self.read(&field.children[0], dictionaries)?;
                if offsets.last().is_some_and(|&end| end > child.len()) {
                    return Err(corrupt(format!(
                        "lists ending at {} of {} child values",
                        offsets.last().copied().unwrap_or(0),
                        child.len()
                    )));
                }
                let mut items = child.into_iter();
                let mut at = 0;
                let mut out = Vec::with_capacity(len);
                for (i, w) in offsets.windows(2).enumerate() {
                    // Offsets never go back (checked), so each list is the next run.
                    items.by_ref().take(w[0] - at).for_each(drop);
                    let list: Vec<Value> = items.by_ref().take(w[1] - w[0]).collect();
                    at = w[1];
                    out.push(if validity.get(i) {
                        Value::Array(list)
                    } else {
                        Value::Null
                    });
                }
                return Ok(out);
            }
            Kind::FixedList(n) => {
                let child = self.read(&field.children[0], dictionaries)?;
                if len.checked_mul(n).is_none_or(|need| need > child.len()) {
                    return Err(corrupt(format!(
                        "{len} lists of {n} from {} child values",
                        child.len()
                    )));
                }
                let mut items = child.into_iter();
                (0..len)
                    .map(|_| Value::Array(items.by_ref().take(n).collect()))
                    .collect()
            }
            Kind::Struct => {
                let mut columns = Vec::with_capacity(field.children.len());
                for c in &field.children {
                    let values = self.read(c, dictionaries)?;
                    if values.len() < len {
                        return Err(corrupt(format!(
                            "struct field {:?} has {} values for {len} structs",
                            c.name,
                            values.len()
                        )));
                    }
                    columns.push(values.into_iter());
                }
                (0..len)
                    .map(|_| {
                        let mut object = Row::new();
                        for (c, values) in field.children.iter().zip(columns.iter_mut()) {
                            object.insert(c.name.clone(), values.next().expect("checked"));
                        }
                        Value::Object(object)
                    })
                    .collect()
            }
        };
        Ok(values
            .into_iter()
            .enumerate()
            .map(|(i, v)| if validity.get(i) { v } else { Value::Null })
            .collect())
    }

    /// The next buffer as a validity bitmap for `len` values; an empty one means no nulls.
    fn validity(&mut self, len: usize, nulls: usize) -> Result<Bits<'a>> {
        let data = self.buffer()?;
        if data.is_empty() {
            if nulls > 0 {
                return Err(corrupt(format!("{nulls} nulls and no validity bitmap")));
            }
            return Ok(Bits::All);
        }
        Bits::over(data, len, "a validity")
    }
}

/// A bitmap, least significant bit first; `All` when every bit is set.
enum Bits<'a> {
    All,
    Map(Cow<'a, [u8]>),
}

impl<'a> Bits<'a> {
    fn over(data: Cow<'a, [u8]>, len: usize, what: &str) -> Result<Bits<'a>> {
        if data.len() < len.div_ceil(8) {
            return Err(corrupt(format!(
                "{what} bitmap of {} bytes for {len} values",
                data.len()
            )));
        }
        Ok(Bits::Map(data))
    }

    fn get(&self, i: usize) -> bool {
        match self {
            Bits::All => true,
            Bits::Map(b) => b[i / 8] >> (i % 8) & 1 == 1,
        }
    }
}

/// `len` values of `width` bytes from the start of `data`, checked to be there.
fn fixed(data: &[u8], len: usize, width: usize) -> Result<std::slice::ChunksExact<'_, u8>> {
    let need = len
        .checked_mul(width)
        .filter(|&n| n <= data.len())
        .ok_or_else(|| {
            corrupt(format!(
                "{} bytes for {len} values of {width} bytes",
                data.len()
            ))
        })?;
    Ok(data[..need].chunks_exact(width.max(1)))
}

fn int_value(b: &[u8], signed: bool) -> Value {
    let mut wide = [0u8; 8];
    wide[..b.len()].copy_from_slice(b);
    if signed {
        let shift = 64 - 8 * b.len() as u32;
        Value::from(i64::from_le_bytes(wide) << shift >> shift)
    } else {
        Value::from(u64::from_le_bytes(wide))
    }
}

fn byte_array(b: &[u8]) -> Value {
    Value::Array(b.iter().map(|&x| Value::from(x)).collect())
}

/// `len + 1` offsets (32- or 64-bit), checked to start at or after 0, never go back, and end
/// within `limit`; an array of no values may have no offsets at all.
fn offsets_of(data: &[u8], len: usize, large: bool, limit: usize) -> Result<Vec<usize>> {
    if len == 0 && data.is_empty() {
        return Ok(vec![0]);
    }
    let width = if large { 8 } else { 4 };
    let count = len
        .checked_add(1)
        .ok_or_else(|| corrupt("too many offsets"))?;
    let offsets: Vec<usize> = fixed(data, count, width)?
        .map(|b| {
            let v = if large {
                i64::from_le_bytes(b.try_into().expect("8"))
            } else {
                i64::from(i32::from_le_bytes(b.try_into().expect("4")))
            };
            usize::try_from(v).map_err(|_| corrupt(format!("offset {v}")))
        })
        .collect::<Result<_>>()?;
    if offsets.windows(2).any(|w| w[1] < w[0]) {
        return Err(corrupt("offsets that go back"));
    }
    if offsets[len] > limit {
        return Err(corrupt(format!(
            "offsets ending at {} past {limit} bytes of data",
            offsets[len]
        )));
    }
    Ok(offsets)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn integers_widen_with_their_sign() {
        assert_eq!(int_value(&[0xff], true), Value::from(-1));
        assert_eq!(int_value(&[0xff], false), Value::from(255));
        assert_eq!(int_value(&[0, 0x80], true), Value::from(-32768));
        assert_eq!(int_value(&[0xff; 8], false), Value::from(u64::MAX));
    }

    #[test]
    fn offsets_are_checked() {
        let o = |v: &[i32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
        assert_eq!(offsets_of(&o(&[0, 2, 5]), 2, false, 5).unwrap(), [0, 2, 5]);
        assert!(
            offsets_of(&o(&[0, 2, 5]), 2, false, 4).is_err(),
            "past the data"
        );
        assert!(
            offsets_of(&o(&[0, 3, 2]), 2, false, 5).is_err(),
            "backwards"
        );
        assert!(offsets_of(&o(&[-1, 2]), 1, false, 5).is_err(), "negative");
        assert!(offsets_of(&o(&[0, 2]), 2, false, 5).is_err(), "too few");
        assert_eq!(offsets_of(&[], 0, false, 0).unwrap(), [0]);
    }

    #[test]
    fn not_arrow_is_a_typed_error() {
        assert!(matches!(
            ArrowFile::parse(b"PAR1 something"),
            Err(ArrowError::NotArrow(_))
        ));
        assert!(matches!(
            ArrowFile::parse(&[0xff, 0xff, 0xff, 0xff, 0, 0, 0, 0]),
            Err(ArrowError::NotArrow(_))
        ));
        assert!(ArrowFile::parse(b"ARROW1\0\0ARROW1").is_err());
    }
}
