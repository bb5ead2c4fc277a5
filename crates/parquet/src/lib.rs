//! # headroom-parquet
//!
//! Reads Apache Parquet files, the format Hugging Face datasets are published in (FineWeb,
//! MMLU, UltraChat…), and Arrow IPC, the format `datasets` keeps them in on disk, as rows of
//! JSON objects: the shape `datasets`' `to_json` writes, so that everything that reads JSONL
//! lines reads Parquet and Arrow rows too.
//!
//! ```
//! use headroom_parquet::{ParquetFile, ReadOptions};
//! # let bytes = include_bytes!(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/mmlu_like.parquet"));
//! let file = ParquetFile::parse(bytes).unwrap();
//! assert!(file.fields().iter().any(|f| f == "choices"));
//! let rows = file.rows(&ReadOptions::default()).unwrap();
//! assert_eq!(rows.len() as u64, file.num_rows());
//! // A list<string> column is a JSON array, an int64 a JSON integer.
//! assert!(rows[0]["choices"].is_array() && rows[0]["answer"].is_u64());
//! // Only the columns asked for are decoded.
//! let only = ReadOptions { columns: Some(vec!["question".into()]), ..ReadOptions::default() };
//! assert_eq!(file.rows(&only).unwrap()[0].len(), 1);
//!
//! // A `save_to_disk` shard, Arrow IPC, read the same way a record batch at a time.
//! use headroom_parquet::TableFile;
//! # let bytes = include_bytes!(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/arrow/hf_save_to_disk/data-00000-of-00002.arrow"));
//! let shard = TableFile::parse(bytes).unwrap();
//! assert_eq!(shard.describe(), "Arrow IPC stream");
//! let first = shard.group(0, &ReadOptions::default()).unwrap();
//! assert!(first[0]["text"].is_string());
//! ```
//!
//! What it reads:
//! - **Structure:** every row group; nullable fields, structs, lists in both the standard
//!   three-level and the older two-level forms, nested to any depth (Dremel's repetition and
//!   definition levels, assembled per leaf column and merged).
//! - **Pages:** data pages v1 and v2, dictionary pages.
//! - **Encodings:** PLAIN, PLAIN_DICTIONARY and RLE_DICTIONARY, RLE (levels, and booleans),
//!   DELTA_BINARY_PACKED, DELTA_LENGTH_BYTE_ARRAY, DELTA_BYTE_ARRAY and BYTE_STREAM_SPLIT.
//! - **Codecs:** uncompressed, SNAPPY, GZIP, ZSTD and LZ4_RAW.
//! - **Values:** booleans; signed and unsigned integers of every width (dates, times and
//!   timestamps as their stored integers); floats and doubles (NaN and infinities become
//!   null, which JSON lacks); UTF-8 text as strings; other bytes as arrays of byte values.
//!
//! What it refuses, with [`ParquetError::Unsupported`] naming the column, and only when that
//! column is read: MAP columns, DECIMAL, FLOAT16 and INT96 values, the LZO, BROTLI and Hadoop
//! LZ4 codecs, encrypted files. Reading fewer columns ([`ReadOptions::columns`]) reads the
//! rest of such a file.
//!
//! Bounds: a file is untrusted input. Every offset and length is checked against the file
//! before use; a page's decompressed size is bounded by [`ReadOptions::max_page_bytes`] and
//! the values one read materialises by [`ReadOptions::max_values`], both checked before the
//! memory is taken, so a small hostile file cannot ask for a large allocation.
//! `tests/pyarrow.rs` reads files pyarrow wrote (`benches/torch/make_parquet_fixture.py`)
//! and compares every row with pyarrow's; `tests/fuzz_parquet.rs` feeds damaged ones.
//!
//! Arrow IPC ([`ArrowFile`], the [`arrow`] module) is read by the same rules: the format
//! `datasets` caches every dataset in and `save_to_disk` writes. [`TableFile`] takes either
//! by its magic bytes, a group (row group, record batch) at a time. `tests/arrow_ipc.rs` reads
//! files pyarrow and `datasets` wrote (`benches/torch/make_arrow_fixture.py`).

pub mod arrow;
mod compress;
mod encoding;
mod flatbuf;
mod meta;
mod schema;
mod table;
mod thrift;

use serde_json::{Map, Value};

pub use crate::arrow::{is_arrow, ArrowError, ArrowFile, ArrowFormat};
use crate::compress::Codec;
use crate::encoding::{Bytes, LeafType};
use crate::meta::{ColumnMeta, FileMeta, PageKind, PhysicalType};
use crate::schema::{Leaf, Step};
pub use crate::table::{TableError, TableFile, TableFormat};

/// A row: the top-level fields read, by name.
pub type Row = Map<String, Value>;

/// Why a file could not be read.
#[derive(Debug, thiserror::Error)]
pub enum ParquetError {
    /// Not a Parquet file at all (no `PAR1` at both ends).
    #[error("not a Parquet file: {0}")]
    NotParquet(String),
    /// A Parquet file whose bytes contradict themselves or end early.
    #[error("corrupt Parquet file: {0}")]
    Corrupt(String),
    /// A valid file that uses something this reader does not read.
    #[error("unsupported Parquet feature: {0}")]
    Unsupported(String),
    /// A column asked for that the file does not have.
    #[error("no column {0:?} in the Parquet file (it has {1})")]
    UnknownColumn(String, String),
    /// A row group asked for that the file does not have.
    #[error("no row group {index} in a Parquet file of {count}")]
    NoRowGroup {
        /// The index asked for.
        index: usize,
        /// The file's row groups.
        count: usize,
    },
    /// A read that would pass [`ReadOptions`]' bounds.
    #[error("Parquet read over its bound: {0}")]
    OverBudget(String),
}

/// This crate's results.
pub type Result<T> = std::result::Result<T, ParquetError>;

/// What to read, and the most it may cost.
#[derive(Clone, Debug)]
pub struct ReadOptions {
    /// The top-level fields to read, or all of them.
    pub columns: Option<Vec<String>>,
    /// The most leaf values (levels included: a null or an empty list counts) one call
    /// materialises; a JSON value takes about 32 bytes plus its text. A value copied out of a
    /// dictionary (Parquet's or Arrow's) also counts its text, at 32 bytes a value, each time a
    /// row copies it: the page bound cannot see that expansion.
    pub max_values: u64,
    /// The largest page, decompressed.
    pub max_page_bytes: usize,
}

impl Default for ReadOptions {
    fn default() -> ReadOptions {
        ReadOptions {
            columns: None,
            max_values: 1 << 26,
            max_page_bytes: 1 << 28,
        }
    }
}

/// A parsed Parquet file over its bytes: the footer read and checked, no page yet decoded.
#[derive(Debug)]
pub struct ParquetFile<'a> {
    bytes: &'a [u8],
    meta: FileMeta,
    leaves: Vec<Leaf>,
    fields: Vec<String>,
}

impl<'a> ParquetFile<'a> {
    /// Parses the footer of the file `bytes` and checks it against the file and itself.
    pub fn parse(bytes: &'a [u8]) -> Result<ParquetFile<'a>> {
        if bytes.len() < 12 || &bytes[..4] != b"PAR1" {
            return Err(ParquetError::NotParquet(
                "it does not start with PAR1".into(),
            ));
        }
        let tail = &bytes[bytes.len() - 4..];
        if tail == b"PARE" {
            return Err(ParquetError::Unsupported("an encrypted file".into()));
        }
        if tail != b"PAR1" {
            return Err(ParquetError::NotParquet("it does not end with PAR1".into()));
        }
        let len_at = bytes.len() - 8;
        let footer_len = u32::from_le_bytes(bytes[len_at..len_at + 4].try_into().expect("4"));
        let footer_start = len_at
            .checked_sub(footer_len as usize)
            .filter(|&s| s >= 4)
            .ok_or_else(|| {
                ParquetError::Corrupt(format!(
                    "a {footer_len}-byte footer in a {}-byte file",
                    bytes.len()
                ))
            })?;
        let meta = meta::file_meta(&bytes[footer_start..len_at])?;
        let leaves = schema::leaves(&meta.schema)?;
        let mut fields: Vec<String> = Vec::new();
        for leaf in &leaves {
            if fields.last() != Some(&leaf.top) {
                if fields.contains(&leaf.top) {
                    return Err(ParquetError::Corrupt(format!(
                        "two top-level fields named {:?}",
                        leaf.top
                    )));
                }
                fields.push(leaf.top.clone());
            }
        }
        let mut rows = 0i64;
        for (g, group) in meta.row_groups.iter().enumerate() {
            if group.num_rows < 0 {
                return Err(ParquetError::Corrupt(format!(
                    "row group {g} has {} rows",
                    group.num_rows
                )));
            }
            rows = rows.saturating_add(group.num_rows);
            if group.columns.len() != leaves.len() {
                return Err(ParquetError::Corrupt(format!(
                    "row group {g} has {} column chunks for {} columns",
                    group.columns.len(),
                    leaves.len()
                )));
            }
            for (chunk, leaf) in group.columns.iter().zip(&leaves) {
                if chunk.path != leaf.path || chunk.physical != leaf.leaf_type.physical {
                    return Err(ParquetError::Corrupt(format!(
                        "row group {g}'s chunk {} ({:?}) is not the schema's column {} ({:?})",
                        chunk.path.join("."),
                        chunk.physical,
                        leaf.path.join("."),
                        leaf.leaf_type.physical
                    )));
                }
            }
        }
        if rows != meta.num_rows {
            return Err(ParquetError::Corrupt(format!(
                "{} rows in the footer, {rows} in its row groups",
                meta.num_rows
            )));
        }
        Ok(ParquetFile {
            bytes,
            meta,
            leaves,
            fields,
        })
    }

    /// The rows in the file.
    pub fn num_rows(&self) -> u64 {
        self.meta.num_rows as u64
    }

    /// The row groups in the file.
    pub fn num_row_groups(&self) -> usize {
        self.meta.row_groups.len()
    }

    /// The rows of row group `index`.
    pub fn row_group_rows(&self, index: usize) -> Option<u64> {
        self.meta.row_groups.get(index).map(|g| g.num_rows as u64)
    }

    /// The top-level fields, in schema order.
    pub fn fields(&self) -> &[String] {
        &self.fields
    }

    /// The top-level fields that cannot be read, each with why (a MAP column, DECIMAL
    /// values…): reading them is an [`ParquetError::Unsupported`] error.
    pub fn unreadable_fields(&self) -> Vec<(String, String)> {
        let mut out: Vec<(String, String)> = Vec::new();
        for leaf in &self.leaves {
            if let Some(why) = &leaf.unsupported {
                if out.last().is_none_or(|(f, _)| *f != leaf.top) {
                    out.push((leaf.top.clone(), why.clone()));
                }
            }
        }
        out
    }

    /// The writer the file names (`created_by`), if any.
    pub fn created_by(&self) -> Option<&str> {
        self.meta.created_by.as_deref()
    }

    /// Every row of the file; the bounds hold for the whole call.
    pub fn rows(&self, options: &ReadOptions) -> Result<Vec<Row>> {
        let mut budget = Budget::of(options);
        let mut out = Vec::new();
        for g in 0..self.num_row_groups() {
            out.extend(self.read_group(g, options, &mut budget)?);
        }
        Ok(out)
    }

    /// The rows of row group `index` (a large file read a group at a time).
    pub fn row_group(&self, index: usize, options: &ReadOptions) -> Result<Vec<Row>> {
        if index >= self.num_row_groups() {
            return Err(ParquetError::NoRowGroup {
                index,
                count: self.num_row_groups(),
            });
        }
        self.read_group(index, options, &mut Budget::of(options))
    }

    fn selected(&self, options: &ReadOptions) -> Result<Vec<usize>> {
        if let Some(names) = &options.columns {
            if let Some(missing) = names.iter().find(|n| !self.fields.contains(n)) {
                return Err(ParquetError::UnknownColumn(
                    missing.clone(),
                    self.fields.join(", "),
                ));
            }
        }
        let wanted = |leaf: &Leaf| {
            options
                .columns
                .as_ref()
                .is_none_or(|names| names.contains(&leaf.top))
        };
        let chosen: Vec<usize> = (0..self.leaves.len())
            .filter(|&i| wanted(&self.leaves[i]))
            .collect();
        if let Some(why) = chosen
            .iter()
            .find_map(|&i| self.leaves[i].unsupported.clone())
        {
            return Err(ParquetError::Unsupported(format!("column {why}")));
        }
        Ok(chosen)
    }

    fn read_group(&self, g: usize, options: &ReadOptions, budget: &mut Budget) -> Result<Vec<Row>> {
        let chosen = self.selected(options)?;
        let group = &self.meta.row_groups[g];
        let num_rows = group.num_rows as u64;
        budget.spend(num_rows)?;
        let mut rows: Vec<Row> = Vec::new();
        for (n, &i) in chosen.iter().enumerate() {
            let leaf = &self.leaves[i];
            let chunk = &group.columns[i];
            let column = self
                .read_chunk(chunk, leaf, options, budget)
                .map_err(|e| in_column(e, g, leaf))?;
            let partials = assemble(leaf, column).map_err(|e| in_column(e, g, leaf))?;
            if partials.len() as u64 != num_rows {
                return Err(in_column(
                    ParquetError::Corrupt(format!(
                        "{} rows where the row group has {num_rows}",
                        partials.len()
                    )),
                    g,
                    leaf,
                ));
            }
            if n == 0 {
                rows = partials;
            } else {
                for (row, partial) in rows.iter_mut().zip(partials) {
                    merge_objects(row, partial).map_err(|e| in_column(e, g, leaf))?;
                }
            }
        }
        if chosen.is_empty() {
            rows = (0..num_rows).map(|_| Row::new()).collect();
        }
        Ok(rows)
    }

    fn read_chunk(
        &self,
        chunk: &ColumnMeta,
        leaf: &Leaf,
        options: &ReadOptions,
        budget: &mut Budget,
    ) -> Result<Column> {
        let codec = Codec::of(chunk.codec)?;
        let num_values = u64::try_from(chunk.num_values)
            .map_err(|_| ParquetError::Corrupt("a negative value count".into()))?;
        if num_values == 0 {
            // pyarrow writes an empty chunk as a lone dictionary page and a data page offset
            // of 0: there is nothing to read.
            return Ok(Column::default());
        }
        let start = match chunk.dictionary_page_offset {
            // Some writers put 0 here for "none".
            Some(d) if d > 0 && d < chunk.data_page_offset => d,
            _ => chunk.data_page_offset,
        };
        let footer = self.bytes.len() - 8;
        let range = usize::try_from(start)
            .ok()
            .filter(|&s| s >= 4)
            .and_then(|s| {
                let len = usize::try_from(chunk.total_compressed_size).ok()?;
                Some((s, s.checked_add(len)?))
            })
            .filter(|&(_, end)| end <= footer)
            .ok_or_else(|| {
                ParquetError::Corrupt(format!(
                    "a chunk of {} bytes at {start}, outside the file",
                    chunk.total_compressed_size
                ))
            })?;
        let data = &self.bytes[range.0..range.1];
        budget.check(num_values)?;
        let mut column = Column::default();
        let mut dictionary: Option<Vec<Value>> = None;
        let mut pos = 0;
        let mut read = 0u64;
        while read < num_values {
            let (header, header_len) = meta::page_header(&data[pos..])?;
            let body_start = pos + header_len;
            let body_end = body_start
                .checked_add(header.compressed_size as usize)
                .filter(|&e| e <= data.len())
                .ok_or_else(|| ParquetError::Corrupt("a page past its chunk's end".into()))?;
            let body = &data[body_start..body_end];
            pos = body_end;
            let size = header.uncompressed_size as usize;
            if size > options.max_page_bytes {
                return Err(ParquetError::OverBudget(format!(
                    "a page of {size} bytes (the bound is {})",
                    options.max_page_bytes
                )));
            }
            match header.kind {
                PageKind::Dictionary {
                    num_values: n,
                    encoding,
                } => {
                    if dictionary.is_some() || read > 0 {
                        return Err(ParquetError::Corrupt("a second dictionary page".into()));
                    }
                    if encoding != 0 && encoding != 2 {
                        return Err(ParquetError::Unsupported(format!(
                            "dictionary encoding {encoding}"
                        )));
                    }
                    let n = count(n)?;
                    budget.spend(n as u64)?;
                    let page = compress::decompress(codec, body, size)?;
                    dictionary = Some(encoding::plain(&mut Bytes::new(&page), &leaf.leaf_type, n)?);
                }
                PageKind::DataV1 {
                    num_values: n,
                    encoding,
                    def_encoding,
                    rep_encoding,
                } => {
                    let n = count(n)?;
                    budget.spend(n as u64)?;
                    let page = compress::decompress(codec, body, size)?;
                    let mut bytes = Bytes::new(&page);
                    if leaf.max_rep > 0 {
                        levels_v1(&mut bytes, rep_encoding, leaf.max_rep, n, &mut column.reps)?;
                    }
                    if leaf.max_def > 0 {
                        levels_v1(&mut bytes, def_encoding, leaf.max_def, n, &mut column.defs)?;
                    }
                    column.push_values(
                        &mut bytes,
                        encoding,
                        leaf,
                        n,
                        dictionary.as_deref(),
                        budget,
                    )?;
                    read += n as u64;
                }
                PageKind::DataV2 {
                    num_values: n,
                    encoding,
                    def_len,
                    rep_len,
                    compressed,
                } => {
                    let n = count(n)?;
                    budget.spend(n as u64)?;
                    let (rep_len, def_len) = (count(rep_len)?, count(def_len)?);
                    let levels_len = rep_len
                        .checked_add(def_len)
                        .filter(|&l| l <= body.len() && l <= size)
                        .ok_or_else(|| {
                            ParquetError::Corrupt("levels longer than their page".into())
                        })?;
                    // v2 levels: the hybrid without a length prefix, never compressed.
                    let (reps, defs) = body[..levels_len].split_at(rep_len);
                    for (raw, max, out) in [
                        (reps, leaf.max_rep, &mut column.reps),
                        (defs, leaf.max_def, &mut column.defs),
                    ] {
                        if max > 0 {
                            encoding::rle_hybrid(raw, encoding::width_of(max), n, out)?;
                        }
                    }
                    let rest = &body[levels_len..];
                    let page = if compressed {
                        compress::decompress(codec, rest, size - levels_len)?
                    } else {
                        rest.to_vec()
                    };
                    let mut bytes = Bytes::new(&page);
                    column.push_values(
                        &mut bytes,
                        encoding,
                        leaf,
                        n,
                        dictionary.as_deref(),
                        budget,
                    )?;
                    read += n as u64;
                }
                PageKind::Other => {}
            }
            if pos >= data.len() && read < num_values {
                return Err(ParquetError::Corrupt(format!(
                    "{read} of {num_values} values before the chunk's end"
                )));
            }
        }
        if read != num_values {
            return Err(ParquetError::Corrupt(format!(
                "pages of {read} values where the chunk has {num_values}"
            )));
        }
        if column.defs.iter().any(|&d| d > leaf.max_def)
            || column.reps.iter().any(|&r| r > leaf.max_rep)
        {
            return Err(ParquetError::Corrupt(
                "a level above the column's maximum".into(),
            ));
        }
        Ok(column)
    }
}

/// A page or header count, which may not be negative.
fn count(n: i32) -> Result<usize> {
    usize::try_from(n).map_err(|_| ParquetError::Corrupt(format!("a count of {n}")))
}

fn in_column(e: ParquetError, g: usize, leaf: &Leaf) -> ParquetError {
    let at = |what: String| format!("row group {g}, column {}: {what}", leaf.path.join("."));
    match e {
        ParquetError::Corrupt(w) => ParquetError::Corrupt(at(w)),
        ParquetError::Unsupported(w) => ParquetError::Unsupported(at(w)),
        ParquetError::OverBudget(w) => ParquetError::OverBudget(at(w)),
        other => other,
    }
}

/// What `v` costs against [`ReadOptions::max_values`] each time it is materialised: one per
/// JSON value, and a string's text counted at 32 bytes a value (a value's own size).
pub(crate) fn value_weight(v: &Value) -> u64 {
    match v {
        Value::String(s) => 1 + s.len() as u64 / 32,
        Value::Array(a) => 1 + a.iter().map(value_weight).sum::<u64>(),
        Value::Object(o) => 1 + o.values().map(value_weight).sum::<u64>(),
        _ => 1,
    }
}

/// What one call may still materialise of [`ReadOptions::max_values`] (Parquet and Arrow).
pub(crate) struct Budget {
    left: u64,
    bound: u64,
}

impl Budget {
    pub(crate) fn of(options: &ReadOptions) -> Budget {
        Budget {
            left: options.max_values,
            bound: options.max_values,
        }
    }

    fn check(&self, n: u64) -> Result<()> {
        if n > self.left {
            return Err(ParquetError::OverBudget(format!(
                "more than {} values (ReadOptions::max_values)",
                self.bound
            )));
        }
        Ok(())
    }

    pub(crate) fn spend(&mut self, n: u64) -> Result<()> {
        self.check(n)?;
        self.left -= n;
        Ok(())
    }
}

/// A leaf column chunk's levels and non-null values.
#[derive(Default)]
struct Column {
    reps: Vec<u32>,
    defs: Vec<u32>,
    values: Vec<Value>,
}

impl Column {
    /// Decodes the values of a page whose `n` entries' levels were just read: as many as
    /// its definition levels say are present.
    fn push_values(
        &mut self,
        bytes: &mut Bytes<'_>,
        encoding: i32,
        leaf: &Leaf,
        n: usize,
        dictionary: Option<&[Value]>,
        budget: &mut Budget,
    ) -> Result<()> {
        let present = if leaf.max_def == 0 {
            n
        } else {
            self.defs[self.defs.len() - n..]
                .iter()
                .filter(|&&d| d == leaf.max_def)
                .count()
        };
        let decoded = values(
            bytes,
            encoding,
            &leaf.leaf_type,
            present,
            dictionary,
            budget,
        )?;
        self.values.extend(decoded);
        Ok(())
    }
}

/// A v1 page's levels: RLE with a 4-byte length.
fn levels_v1(
    bytes: &mut Bytes<'_>,
    encoding: i32,
    max: u32,
    n: usize,
    out: &mut Vec<u32>,
) -> Result<()> {
    if encoding != 3 {
        return Err(ParquetError::Unsupported(format!(
            "levels in encoding {encoding} (only RLE is read)"
        )));
    }
    let len = bytes.take(4)?;
    let len = u32::from_le_bytes([len[0], len[1], len[2], len[3]]) as usize;
    let raw = bytes.take(len)?;
    encoding::rle_hybrid(raw, encoding::width_of(max), n, out)
}

/// A page's `n` non-null values in `encoding`.
fn values(
    bytes: &mut Bytes<'_>,
    encoding: i32,
    leaf: &LeafType,
    n: usize,
    dictionary: Option<&[Value]>,
    budget: &mut Budget,
) -> Result<Vec<Value>> {
    let unfit = || {
        ParquetError::Corrupt(format!(
            "encoding {encoding} for a {:?} column",
            leaf.physical
        ))
    };
    match encoding {
        0 => encoding::plain(bytes, leaf, n),
        2 | 8 => {
            let dictionary = dictionary.ok_or_else(|| {
                ParquetError::Corrupt("dictionary indices without a dictionary".into())
            })?;
            if n == 0 {
                return Ok(Vec::new());
            }
            let width = usize::from(bytes.take(1)?[0]);
            let mut indices = Vec::new();
            encoding::rle_hybrid(bytes.rest(), width, n, &mut indices)?;
            // Each index copies its value: a long string used many times costs its text each
            // time, counted before any copy is made.
            let copied: u64 = indices
                .iter()
                .filter_map(|&i| dictionary.get(i as usize))
                .map(|v| value_weight(v) - 1)
                .sum();
            budget.spend(copied)?;
            indices
                .iter()
                .map(|&i| {
                    dictionary.get(i as usize).cloned().ok_or_else(|| {
                        ParquetError::Corrupt(format!(
                            "index {i} into a dictionary of {}",
                            dictionary.len()
                        ))
                    })
                })
                .collect()
        }
        3 if leaf.physical == PhysicalType::Boolean => {
            let len = bytes.take(4)?;
            let len = u32::from_le_bytes([len[0], len[1], len[2], len[3]]) as usize;
            let mut bits = Vec::new();
            encoding::rle_hybrid(bytes.take(len)?, 1, n, &mut bits)?;
            Ok(bits.iter().map(|&b| Value::Bool(b == 1)).collect())
        }
        5 => match leaf.physical {
            PhysicalType::Int32 | PhysicalType::Int64 => encoding::delta_ints(bytes, leaf, n),
            _ => Err(unfit()),
        },
        6 => match leaf.physical {
            PhysicalType::ByteArray => encoding::delta_length_byte_array(bytes, leaf, n),
            _ => Err(unfit()),
        },
        7 => match leaf.physical {
            PhysicalType::ByteArray | PhysicalType::FixedLenByteArray => {
                encoding::delta_byte_array(bytes, leaf, n)
            }
            _ => Err(unfit()),
        },
        9 => encoding::byte_stream_split(bytes.rest(), leaf, n),
        other => Err(ParquetError::Unsupported(format!("value encoding {other}"))),
    }
}

/// Each row's part of `leaf`: an object holding just the path down to the leaf's values.
fn assemble(leaf: &Leaf, column: Column) -> Result<Vec<Row>> {
    let Column { reps, defs, values } = column;
    let entries = if leaf.max_def == 0 {
        values.len()
    } else {
        defs.len()
    };
    if leaf.max_rep > 0 && reps.len() != entries {
        return Err(ParquetError::Corrupt("levels of different lengths".into()));
    }
    let mut values = values.into_iter();
    let mut rows: Vec<Row> = Vec::new();
    let mut current: Option<Value> = None;
    for e in 0..entries {
        let rep = if leaf.max_rep > 0 { reps[e] } else { 0 };
        let def = if leaf.max_def > 0 { defs[e] } else { 0 };
        if rep == 0 {
            if let Some(Value::Object(row)) = current.take() {
                rows.push(row);
            }
            current = Some(Value::Object(Map::new()));
        }
        let root = current
            .as_mut()
            .ok_or_else(|| ParquetError::Corrupt("a column that starts inside a row".into()))?;
        insert(root, &leaf.steps, rep, def, leaf.max_def, &mut values)?;
    }
    if let Some(Value::Object(row)) = current.take() {
        rows.push(row);
    }
    if values.next().is_some() {
        return Err(ParquetError::Corrupt("more values than levels say".into()));
    }
    Ok(rows)
}

/// Places one (repetition, definition, value) entry in its row's tree.
fn insert(
    root: &mut Value,
    steps: &[Step],
    rep: u32,
    def: u32,
    max_def: u32,
    values: &mut impl Iterator<Item = Value>,
) -> Result<()> {
    let corrupt = |what: &str| ParquetError::Corrupt(what.into());
    let mut slot = root;
    let (mut d, mut r) = (0u32, 0u32);
    for step in steps {
        match step {
            Step::Key(name) => {
                if slot.is_null() {
                    *slot = Value::Object(Map::new());
                }
                let Value::Object(map) = slot else {
                    return Err(corrupt("levels that contradict the schema"));
                };
                slot = map.entry(name.clone()).or_insert(Value::Null);
            }
            Step::Optional => {
                d += 1;
                if def < d {
                    return if slot.is_null() {
                        Ok(())
                    } else {
                        Err(corrupt("a value defined twice"))
                    };
                }
            }
            Step::List => {
                d += 1;
                r += 1;
                if slot.is_null() {
                    *slot = Value::Array(Vec::new());
                }
                let Value::Array(items) = slot else {
                    return Err(corrupt("levels that contradict the schema"));
                };
                if def < d {
                    return if items.is_empty() {
                        Ok(())
                    } else {
                        Err(corrupt("an empty list after its elements"))
                    };
                }
                if rep > r {
                    slot = items
                        .last_mut()
                        .ok_or_else(|| corrupt("a list continued before it started"))?;
                } else {
                    if rep < r && !items.is_empty() {
                        return Err(corrupt("a list started twice"));
                    }
                    items.push(Value::Null);
                    slot = items.last_mut().expect("just pushed");
                }
            }
        }
    }
    debug_assert_eq!(d, max_def);
    if !slot.is_null() {
        return Err(corrupt("a value defined twice"));
    }
    *slot = values
        .next()
        .ok_or_else(|| corrupt("fewer values than levels say"))?;
    Ok(())
}

/// Merges one leaf's part of a row into the row.
fn merge_objects(into: &mut Row, from: Row) -> Result<()> {
    for (key, value) in from {
        match into.get_mut(&key) {
            Some(existing) => merge(existing, value)?,
            None => {
                into.insert(key, value);
            }
        }
    }
    Ok(())
}

fn merge(into: &mut Value, from: Value) -> Result<()> {
    match (into, from) {
        (Value::Object(a), Value::Object(b)) => merge_objects(a, b),
        (Value::Array(a), Value::Array(b)) if a.len() == b.len() => {
            a.iter_mut().zip(b).try_for_each(|(x, y)| merge(x, y))
        }
        (Value::Null, Value::Null) => Ok(()),
        _ => Err(ParquetError::Corrupt(
            "columns of one struct disagree on its nulls or list lengths".into(),
        )),
    }
}
