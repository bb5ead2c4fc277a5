//! Either columnar format a Hugging Face dataset comes in, behind one reader: Parquet as the
//! Hub serves it, Arrow IPC as `datasets` caches it and `save_to_disk` writes it. A reader that
//! takes rows a group at a time (a Parquet row group, an Arrow record batch) takes both.

use crate::arrow::{is_arrow, ArrowError, ArrowFile, ArrowFormat};
use crate::{ParquetError, ParquetFile, ReadOptions, Row};

/// Why a table file could not be read: its format's own error.
#[derive(Debug, thiserror::Error)]
pub enum TableError {
    /// A Parquet file's.
    #[error(transparent)]
    Parquet(#[from] ParquetError),
    /// Arrow IPC's.
    #[error(transparent)]
    Arrow(#[from] ArrowError),
    /// Neither format's start.
    #[error("neither a Parquet file nor Arrow IPC")]
    Neither,
}

/// Which format a table file is in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TableFormat {
    /// Parquet (`PAR1` at both ends).
    Parquet,
    /// Arrow IPC, file or stream.
    Arrow,
}

impl TableFormat {
    /// The format of the file `bytes`, by its magic (JSON text cannot start with either), or
    /// `None` for neither.
    pub fn of(bytes: &[u8]) -> Option<TableFormat> {
        if bytes.len() >= 12 && bytes.starts_with(b"PAR1") && bytes.ends_with(b"PAR1") {
            Some(TableFormat::Parquet)
        } else if is_arrow(bytes) {
            Some(TableFormat::Arrow)
        } else {
            None
        }
    }
}

/// A parsed table file of either format.
#[derive(Debug)]
pub enum TableFile<'a> {
    /// A Parquet file.
    Parquet(ParquetFile<'a>),
    /// Arrow IPC.
    Arrow(ArrowFile<'a>),
}

impl<'a> TableFile<'a> {
    /// Parses `bytes` as the format their magic names.
    pub fn parse(bytes: &'a [u8]) -> Result<TableFile<'a>, TableError> {
        match TableFormat::of(bytes) {
            Some(TableFormat::Parquet) => Ok(TableFile::Parquet(ParquetFile::parse(bytes)?)),
            Some(TableFormat::Arrow) => Ok(TableFile::Arrow(ArrowFile::parse(bytes)?)),
            None => Err(TableError::Neither),
        }
    }

    /// The format and its writer, in words (`Parquet (parquet-cpp-arrow version 26.0.1)`,
    /// `Arrow IPC stream`).
    pub fn describe(&self) -> String {
        match self {
            TableFile::Parquet(f) => {
                format!("Parquet ({})", f.created_by().unwrap_or("writer unnamed"))
            }
            TableFile::Arrow(f) => match f.format() {
                ArrowFormat::Stream => "Arrow IPC stream".into(),
                ArrowFormat::File => "Arrow IPC file".into(),
            },
        }
    }

    /// What its groups are called: `row groups` or `record batches`.
    pub fn groups_name(&self) -> &'static str {
        match self {
            TableFile::Parquet(_) => "row groups",
            TableFile::Arrow(_) => "record batches",
        }
    }

    /// The rows in the file.
    pub fn num_rows(&self) -> u64 {
        match self {
            TableFile::Parquet(f) => f.num_rows(),
            TableFile::Arrow(f) => f.num_rows(),
        }
    }

    /// The row groups or record batches.
    pub fn num_groups(&self) -> usize {
        match self {
            TableFile::Parquet(f) => f.num_row_groups(),
            TableFile::Arrow(f) => f.num_batches(),
        }
    }

    /// The rows of group `index`.
    pub fn group_rows(&self, index: usize) -> Option<u64> {
        match self {
            TableFile::Parquet(f) => f.row_group_rows(index),
            TableFile::Arrow(f) => f.batch_rows(index),
        }
    }

    /// The rows of group `index`.
    pub fn group(&self, index: usize, options: &ReadOptions) -> Result<Vec<Row>, TableError> {
        Ok(match self {
            TableFile::Parquet(f) => f.row_group(index, options)?,
            TableFile::Arrow(f) => f.batch(index, options)?,
        })
    }

    /// Every row; the bounds hold for the whole call.
    pub fn rows(&self, options: &ReadOptions) -> Result<Vec<Row>, TableError> {
        Ok(match self {
            TableFile::Parquet(f) => f.rows(options)?,
            TableFile::Arrow(f) => f.rows(options)?,
        })
    }

    /// The top-level fields, in schema order.
    pub fn fields(&self) -> &[String] {
        match self {
            TableFile::Parquet(f) => f.fields(),
            TableFile::Arrow(f) => f.fields(),
        }
    }

    /// The top-level fields that cannot be read, each with why.
    pub fn unreadable_fields(&self) -> Vec<(String, String)> {
        match self {
            TableFile::Parquet(f) => f.unreadable_fields(),
            TableFile::Arrow(f) => f.unreadable_fields(),
        }
    }
}
