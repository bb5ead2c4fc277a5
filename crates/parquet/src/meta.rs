//! The footer's `FileMetaData` and the page headers, the fields of `parquet.thrift` this reader
//! uses (the rest are skipped).

use crate::thrift::{Reader, Type};
use crate::{ParquetError, Result};

fn corrupt(what: impl Into<String>) -> ParquetError {
    ParquetError::Corrupt(what.into())
}

/// A physical type (`parquet.thrift`'s `Type`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PhysicalType {
    /// One bit.
    Boolean,
    /// 32-bit signed.
    Int32,
    /// 64-bit signed.
    Int64,
    /// The deprecated 96-bit timestamp.
    Int96,
    /// IEEE 754 single.
    Float,
    /// IEEE 754 double.
    Double,
    /// Bytes of any length.
    ByteArray,
    /// Bytes of the column's `type_length`.
    FixedLenByteArray,
}

impl PhysicalType {
    fn of(v: i32) -> Result<PhysicalType> {
        Ok(match v {
            0 => PhysicalType::Boolean,
            1 => PhysicalType::Int32,
            2 => PhysicalType::Int64,
            3 => PhysicalType::Int96,
            4 => PhysicalType::Float,
            5 => PhysicalType::Double,
            6 => PhysicalType::ByteArray,
            7 => PhysicalType::FixedLenByteArray,
            n => return Err(corrupt(format!("physical type {n}"))),
        })
    }
}

/// How often a field occurs in its parent.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Repetition {
    /// Exactly once.
    Required,
    /// Once or null.
    Optional,
    /// Any number of times (a list).
    Repeated,
}

/// What a schema element's logical or converted type says about its values, as far as this
/// reader tells them apart.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Annotation {
    /// None, or one that does not change how a value reads (dates, timestamps, times).
    #[default]
    None,
    /// UTF-8 text (`STRING`, `UTF8`, `ENUM`, `JSON`).
    Text,
    /// An unsigned integer.
    Unsigned,
    /// A list group.
    List,
    /// A map group.
    Map,
    /// A decimal (not read).
    Decimal,
    /// A 16-bit float (not read).
    Float16,
    /// An annotation this reader does not know.
    Unknown,
}

/// One element of the flattened schema.
#[derive(Clone, Debug)]
pub(crate) struct SchemaElement {
    pub(crate) physical: Option<PhysicalType>,
    pub(crate) type_length: Option<i32>,
    pub(crate) repetition: Option<Repetition>,
    pub(crate) name: String,
    pub(crate) num_children: Option<i32>,
    pub(crate) annotation: Annotation,
}

/// A column chunk's metadata.
#[derive(Clone, Debug)]
pub(crate) struct ColumnMeta {
    pub(crate) physical: PhysicalType,
    pub(crate) path: Vec<String>,
    pub(crate) codec: i32,
    pub(crate) num_values: i64,
    pub(crate) total_compressed_size: i64,
    pub(crate) data_page_offset: i64,
    pub(crate) dictionary_page_offset: Option<i64>,
}

/// A row group: its row count and one chunk per leaf column.
#[derive(Clone, Debug)]
pub(crate) struct RowGroup {
    pub(crate) num_rows: i64,
    pub(crate) columns: Vec<ColumnMeta>,
}

/// The file's metadata.
#[derive(Clone, Debug)]
pub(crate) struct FileMeta {
    pub(crate) schema: Vec<SchemaElement>,
    pub(crate) num_rows: i64,
    pub(crate) row_groups: Vec<RowGroup>,
    pub(crate) created_by: Option<String>,
}

fn repetition(v: i32) -> Result<Repetition> {
    Ok(match v {
        0 => Repetition::Required,
        1 => Repetition::Optional,
        2 => Repetition::Repeated,
        n => return Err(corrupt(format!("repetition type {n}"))),
    })
}

fn converted(v: i32) -> Annotation {
    match v {
        0 | 4 | 19 => Annotation::Text,
        1 | 2 => Annotation::Map,
        3 => Annotation::List,
        5 => Annotation::Decimal,
        11..=14 => Annotation::Unsigned,
        20 => Annotation::None, // BSON: bytes
        6..=10 | 15..=18 | 21 => Annotation::None,
        _ => Annotation::Unknown,
    }
}

/// `LogicalType`, a union: the one field set says which.
fn logical(r: &mut Reader<'_>) -> Result<Annotation> {
    let mut out = Annotation::Unknown;
    r.begin()?;
    while let Some((id, kind)) = r.field()? {
        match (id, kind) {
            (10, Type::Struct) => {
                // IntType { 1: bitWidth byte, 2: isSigned bool }
                let mut signed = true;
                r.begin()?;
                while let Some((id, kind)) = r.field()? {
                    match id {
                        2 => signed = r.bool_of(kind)?,
                        _ => r.skip(kind)?,
                    }
                }
                out = if signed {
                    Annotation::None
                } else {
                    Annotation::Unsigned
                };
            }
            _ => {
                out = match id {
                    1 | 4 | 12 => Annotation::Text,
                    2 => Annotation::Map,
                    3 => Annotation::List,
                    5 => Annotation::Decimal,
                    6..=9 | 11 | 13 | 14 => Annotation::None,
                    15 => Annotation::Float16,
                    _ => Annotation::Unknown,
                };
                r.skip(kind)?;
            }
        }
    }
    Ok(out)
}

fn schema_element(r: &mut Reader<'_>) -> Result<SchemaElement> {
    let mut e = SchemaElement {
        physical: None,
        type_length: None,
        repetition: None,
        name: String::new(),
        num_children: None,
        annotation: Annotation::None,
    };
    let mut name = false;
    let mut logical_type = None;
    r.begin()?;
    while let Some((id, kind)) = r.field()? {
        match id {
            1 => e.physical = Some(PhysicalType::of(r.i32(kind)?)?),
            2 => e.type_length = Some(r.i32(kind)?),
            3 => e.repetition = Some(repetition(r.i32(kind)?)?),
            4 => {
                e.name = r.string(kind)?;
                name = true;
            }
            5 => e.num_children = Some(r.i32(kind)?),
            6 => e.annotation = converted(r.i32(kind)?),
            10 if kind == Type::Struct => logical_type = Some(logical(r)?),
            _ => r.skip(kind)?,
        }
    }
    if !name {
        return Err(corrupt("a schema element without a name"));
    }
    // The logical type, when present, is the newer and finer of the two.
    if let Some(l) = logical_type {
        if l != Annotation::Unknown || e.annotation == Annotation::None {
            e.annotation = l;
        }
    }
    Ok(e)
}

fn column_meta(r: &mut Reader<'_>) -> Result<ColumnMeta> {
    let (mut physical, mut path, mut codec, mut num_values) = (None, None, None, None);
    let (mut compressed, mut data_offset, mut dict_offset) = (None, None, None);
    r.begin()?;
    while let Some((id, kind)) = r.field()? {
        match id {
            1 => physical = Some(PhysicalType::of(r.i32(kind)?)?),
            3 => path = Some(r.string_list(kind)?),
            4 => codec = Some(r.i32(kind)?),
            5 => num_values = Some(r.i64(kind)?),
            7 => compressed = Some(r.i64(kind)?),
            9 => data_offset = Some(r.i64(kind)?),
            11 => dict_offset = Some(r.i64(kind)?),
            _ => r.skip(kind)?,
        }
    }
    let missing = |what: &str| corrupt(format!("column metadata without {what}"));
    Ok(ColumnMeta {
        physical: physical.ok_or_else(|| missing("a type"))?,
        path: path.ok_or_else(|| missing("a path"))?,
        codec: codec.ok_or_else(|| missing("a codec"))?,
        num_values: num_values.ok_or_else(|| missing("a value count"))?,
        total_compressed_size: compressed.ok_or_else(|| missing("a size"))?,
        data_page_offset: data_offset.ok_or_else(|| missing("a data page offset"))?,
        dictionary_page_offset: dict_offset,
    })
}

fn column_chunk(r: &mut Reader<'_>) -> Result<ColumnMeta> {
    let mut meta = None;
    let mut external = false;
    r.begin()?;
    while let Some((id, kind)) = r.field()? {
        match id {
            1 => external = !r.string(kind)?.is_empty(),
            3 if kind == Type::Struct => meta = Some(column_meta(r)?),
            _ => r.skip(kind)?,
        }
    }
    if external {
        return Err(ParquetError::Unsupported(
            "a column chunk in another file".into(),
        ));
    }
    meta.ok_or_else(|| corrupt("a column chunk without metadata"))
}

fn row_group(r: &mut Reader<'_>) -> Result<RowGroup> {
    let (mut columns, mut num_rows) = (None, None);
    r.begin()?;
    while let Some((id, kind)) = r.field()? {
        match id {
            1 => {
                let (element, len) = r.list(kind)?;
                if element != Type::Struct {
                    return Err(corrupt("column chunks that are not structs"));
                }
                columns = Some(
                    (0..len)
                        .map(|_| column_chunk(r))
                        .collect::<Result<Vec<_>>>()?,
                );
            }
            3 => num_rows = Some(r.i64(kind)?),
            _ => r.skip(kind)?,
        }
    }
    Ok(RowGroup {
        num_rows: num_rows.ok_or_else(|| corrupt("a row group without a row count"))?,
        columns: columns.ok_or_else(|| corrupt("a row group without columns"))?,
    })
}

/// Parses the footer's `FileMetaData`.
pub(crate) fn file_meta(bytes: &[u8]) -> Result<FileMeta> {
    let mut r = Reader::new(bytes);
    let (mut schema, mut num_rows, mut row_groups, mut created_by) = (None, None, None, None);
    r.begin()?;
    while let Some((id, kind)) = r.field()? {
        match id {
            2 => {
                let (element, len) = r.list(kind)?;
                if element != Type::Struct {
                    return Err(corrupt("schema elements that are not structs"));
                }
                schema = Some(
                    (0..len)
                        .map(|_| schema_element(&mut r))
                        .collect::<Result<Vec<_>>>()?,
                );
            }
            3 => num_rows = Some(r.i64(kind)?),
            4 => {
                let (element, len) = r.list(kind)?;
                if element != Type::Struct {
                    return Err(corrupt("row groups that are not structs"));
                }
                row_groups = Some(
                    (0..len)
                        .map(|_| row_group(&mut r))
                        .collect::<Result<Vec<_>>>()?,
                );
            }
            6 => created_by = Some(String::from_utf8_lossy(r.binary(kind)?).into_owned()),
            _ => r.skip(kind)?,
        }
    }
    Ok(FileMeta {
        schema: schema.ok_or_else(|| corrupt("no schema"))?,
        num_rows: num_rows.ok_or_else(|| corrupt("no row count"))?,
        row_groups: row_groups.ok_or_else(|| corrupt("no row groups"))?,
        created_by,
    })
}

/// A page's kind and sizes.
#[derive(Clone, Debug)]
pub(crate) struct PageHeader {
    pub(crate) kind: PageKind,
    pub(crate) uncompressed_size: i32,
    pub(crate) compressed_size: i32,
}

/// The headers of the page kinds read.
#[derive(Clone, Debug)]
pub(crate) enum PageKind {
    Dictionary {
        num_values: i32,
        encoding: i32,
    },
    DataV1 {
        num_values: i32,
        encoding: i32,
        def_encoding: i32,
        rep_encoding: i32,
    },
    DataV2 {
        num_values: i32,
        encoding: i32,
        def_len: i32,
        rep_len: i32,
        compressed: bool,
    },
    /// An index page or one of a kind this reader does not know: skipped.
    Other,
}

/// Parses a page header at the start of `bytes`; returns it and its length.
pub(crate) fn page_header(bytes: &[u8]) -> Result<(PageHeader, usize)> {
    let mut r = Reader::new(bytes);
    let (mut page_type, mut uncompressed, mut compressed) = (None, None, None);
    let (mut v1, mut v2, mut dict) = (None, None, None);
    r.begin()?;
    while let Some((id, kind)) = r.field()? {
        match id {
            1 => page_type = Some(r.i32(kind)?),
            2 => uncompressed = Some(r.i32(kind)?),
            3 => compressed = Some(r.i32(kind)?),
            5 if kind == Type::Struct => {
                let (mut n, mut enc, mut d, mut rep) = (None, None, None, None);
                r.begin()?;
                while let Some((id, kind)) = r.field()? {
                    match id {
                        1 => n = Some(r.i32(kind)?),
                        2 => enc = Some(r.i32(kind)?),
                        3 => d = Some(r.i32(kind)?),
                        4 => rep = Some(r.i32(kind)?),
                        _ => r.skip(kind)?,
                    }
                }
                let missing = || corrupt("an incomplete data page header");
                v1 = Some(PageKind::DataV1 {
                    num_values: n.ok_or_else(missing)?,
                    encoding: enc.ok_or_else(missing)?,
                    def_encoding: d.ok_or_else(missing)?,
                    rep_encoding: rep.ok_or_else(missing)?,
                });
            }
            7 if kind == Type::Struct => {
                let (mut n, mut enc) = (None, None);
                r.begin()?;
                while let Some((id, kind)) = r.field()? {
                    match id {
                        1 => n = Some(r.i32(kind)?),
                        2 => enc = Some(r.i32(kind)?),
                        _ => r.skip(kind)?,
                    }
                }
                let missing = || corrupt("an incomplete dictionary page header");
                dict = Some(PageKind::Dictionary {
                    num_values: n.ok_or_else(missing)?,
                    encoding: enc.ok_or_else(missing)?,
                });
            }
            8 if kind == Type::Struct => {
                let (mut n, mut enc, mut d, mut rep, mut c) = (None, None, None, None, true);
                r.begin()?;
                while let Some((id, kind)) = r.field()? {
                    match id {
                        1 => n = Some(r.i32(kind)?),
                        4 => enc = Some(r.i32(kind)?),
                        5 => d = Some(r.i32(kind)?),
                        6 => rep = Some(r.i32(kind)?),
                        7 => c = r.bool_of(kind)?,
                        _ => r.skip(kind)?,
                    }
                }
                let missing = || corrupt("an incomplete data page v2 header");
                v2 = Some(PageKind::DataV2 {
                    num_values: n.ok_or_else(missing)?,
                    encoding: enc.ok_or_else(missing)?,
                    def_len: d.ok_or_else(missing)?,
                    rep_len: rep.ok_or_else(missing)?,
                    compressed: c,
                });
            }
            _ => r.skip(kind)?,
        }
    }
    let missing = || corrupt("an incomplete page header");
    let page_type = page_type.ok_or_else(missing)?;
    let kind = match page_type {
        0 => v1.ok_or_else(|| corrupt("a data page without its header"))?,
        2 => dict.ok_or_else(|| corrupt("a dictionary page without its header"))?,
        3 => v2.ok_or_else(|| corrupt("a data page v2 without its header"))?,
        _ => PageKind::Other,
    };
    let header = PageHeader {
        kind,
        uncompressed_size: uncompressed.ok_or_else(missing)?,
        compressed_size: compressed.ok_or_else(missing)?,
    };
    if header.uncompressed_size < 0 || header.compressed_size < 0 {
        return Err(corrupt("a page of negative size"));
    }
    Ok((header, r.position()))
}
