//! Thrift's compact protocol, as Parquet writes its footer and page headers: just enough to read
//! structs field by field and skip what is not needed. Every length is checked against the bytes
//! left before anything is allocated, and nesting is bounded, so a hostile footer costs at most
//! its own size.

use crate::{ParquetError, Result};

/// The deepest nesting of structs and containers read (Parquet's own structs nest about 5 deep).
const MAX_DEPTH: usize = 32;

/// A compact-protocol field or element type.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Type {
    True,
    False,
    Byte,
    I16,
    I32,
    I64,
    Double,
    Binary,
    List,
    Set,
    Map,
    Struct,
}

impl Type {
    fn of(nibble: u8) -> Result<Type> {
        Ok(match nibble {
            1 => Type::True,
            2 => Type::False,
            3 => Type::Byte,
            4 => Type::I16,
            5 => Type::I32,
            6 => Type::I64,
            7 => Type::Double,
            8 => Type::Binary,
            9 => Type::List,
            10 => Type::Set,
            11 => Type::Map,
            12 => Type::Struct,
            n => return Err(corrupt(format!("thrift type {n}"))),
        })
    }
}

fn corrupt(what: String) -> ParquetError {
    ParquetError::Corrupt(format!("metadata: {what}"))
}

/// A reader over one compact-protocol message.
pub(crate) struct Reader<'a> {
    bytes: &'a [u8],
    pos: usize,
    /// The last field id of each struct being read, innermost last (ids are written as deltas).
    last_ids: Vec<i16>,
}

impl<'a> Reader<'a> {
    pub(crate) fn new(bytes: &'a [u8]) -> Reader<'a> {
        Reader {
            bytes,
            pos: 0,
            last_ids: Vec::new(),
        }
    }

    /// How many bytes the message took so far.
    pub(crate) fn position(&self) -> usize {
        self.pos
    }

    fn byte(&mut self) -> Result<u8> {
        let b = *self
            .bytes
            .get(self.pos)
            .ok_or_else(|| corrupt("truncated".into()))?;
        self.pos += 1;
        Ok(b)
    }

    fn varint(&mut self) -> Result<u64> {
        let mut value = 0u64;
        for shift in (0..64).step_by(7) {
            let b = self.byte()?;
            value |= u64::from(b & 0x7f) << shift;
            if b & 0x80 == 0 {
                return Ok(value);
            }
        }
        Err(corrupt("varint longer than 10 bytes".into()))
    }

    fn zigzag(&mut self) -> Result<i64> {
        let v = self.varint()?;
        Ok((v >> 1) as i64 ^ -((v & 1) as i64))
    }

    /// Enters a struct: fields follow until [`Reader::field`] says none is left.
    pub(crate) fn begin(&mut self) -> Result<()> {
        if self.last_ids.len() >= MAX_DEPTH {
            return Err(corrupt("nested too deep".into()));
        }
        self.last_ids.push(0);
        Ok(())
    }

    /// The next field's id and type, or `None` at the struct's end (which leaves it).
    pub(crate) fn field(&mut self) -> Result<Option<(i16, Type)>> {
        let header = self.byte()?;
        if header == 0 {
            self.last_ids.pop();
            return Ok(None);
        }
        let kind = Type::of(header & 0x0f)?;
        let delta = header >> 4;
        let last = *self
            .last_ids
            .last()
            .ok_or_else(|| corrupt("field outside a struct".into()))?;
        let id = if delta == 0 {
            i16::try_from(self.zigzag()?).map_err(|_| corrupt("field id out of range".into()))?
        } else {
            last.checked_add(i16::from(delta))
                .ok_or_else(|| corrupt("field id out of range".into()))?
        };
        *self.last_ids.last_mut().expect("checked above") = id;
        Ok(Some((id, kind)))
    }

    /// A boolean field's value, which compact protocol keeps in the field's type.
    pub(crate) fn bool_of(&self, kind: Type) -> Result<bool> {
        match kind {
            Type::True => Ok(true),
            Type::False => Ok(false),
            other => Err(corrupt(format!("{other:?} where a bool belongs"))),
        }
    }

    /// An `i32` field (Parquet's enums and most counts).
    pub(crate) fn i32(&mut self, kind: Type) -> Result<i32> {
        match kind {
            Type::I32 | Type::I16 | Type::Byte => {}
            other => return Err(corrupt(format!("{other:?} where an i32 belongs"))),
        }
        let v = if kind == Type::Byte {
            i64::from(self.byte()? as i8)
        } else {
            self.zigzag()?
        };
        i32::try_from(v).map_err(|_| corrupt(format!("{v} does not fit an i32")))
    }

    /// An `i64` field.
    pub(crate) fn i64(&mut self, kind: Type) -> Result<i64> {
        match kind {
            Type::I64 | Type::I32 | Type::I16 => self.zigzag(),
            other => Err(corrupt(format!("{other:?} where an i64 belongs"))),
        }
    }

    /// A binary or string field's bytes.
    pub(crate) fn binary(&mut self, kind: Type) -> Result<&'a [u8]> {
        if kind != Type::Binary {
            return Err(corrupt(format!("{kind:?} where binary belongs")));
        }
        let len = self.varint()?;
        let end = usize::try_from(len)
            .ok()
            .and_then(|l| self.pos.checked_add(l))
            .filter(|&e| e <= self.bytes.len())
            .ok_or_else(|| corrupt(format!("a {len}-byte string past the end")))?;
        let out = &self.bytes[self.pos..end];
        self.pos = end;
        Ok(out)
    }

    /// A UTF-8 string field.
    pub(crate) fn string(&mut self, kind: Type) -> Result<String> {
        let bytes = self.binary(kind)?;
        String::from_utf8(bytes.to_vec()).map_err(|_| corrupt("a name is not UTF-8".into()))
    }

    /// A list field's element type and length; the length is at most the bytes left, since
    /// every element takes at least one.
    pub(crate) fn list(&mut self, kind: Type) -> Result<(Type, usize)> {
        if kind != Type::List && kind != Type::Set {
            return Err(corrupt(format!("{kind:?} where a list belongs")));
        }
        let header = self.byte()?;
        let element = Type::of(header & 0x0f)?;
        let len = match header >> 4 {
            15 => self.varint()?,
            n => u64::from(n),
        };
        let left = (self.bytes.len() - self.pos) as u64;
        if len > left {
            return Err(corrupt(format!("a list of {len} in {left} bytes")));
        }
        Ok((element, len as usize))
    }

    /// A list of strings (a column's path).
    pub(crate) fn string_list(&mut self, kind: Type) -> Result<Vec<String>> {
        let (element, len) = self.list(kind)?;
        (0..len).map(|_| self.string(element)).collect()
    }

    /// Skips a value of type `kind`.
    pub(crate) fn skip(&mut self, kind: Type) -> Result<()> {
        match kind {
            Type::True | Type::False => Ok(()),
            Type::Byte => self.byte().map(drop),
            Type::I16 | Type::I32 | Type::I64 => self.varint().map(drop),
            Type::Double => {
                for _ in 0..8 {
                    self.byte()?;
                }
                Ok(())
            }
            Type::Binary => self.binary(kind).map(drop),
            Type::List | Type::Set => {
                let (element, len) = self.list(kind)?;
                self.nested(|r| {
                    for _ in 0..len {
                        r.skip_element(element)?;
                    }
                    Ok(())
                })
            }
            Type::Map => {
                let len = self.varint()?;
                if len == 0 {
                    return Ok(());
                }
                let types = self.byte()?;
                let (key, value) = (Type::of(types >> 4)?, Type::of(types & 0x0f)?);
                let left = (self.bytes.len() - self.pos) as u64;
                if len > left {
                    return Err(corrupt(format!("a map of {len} in {left} bytes")));
                }
                self.nested(|r| {
                    for _ in 0..len {
                        r.skip_element(key)?;
                        r.skip_element(value)?;
                    }
                    Ok(())
                })
            }
            Type::Struct => {
                self.begin()?;
                while let Some((_, field)) = self.field()? {
                    self.skip(field)?;
                }
                Ok(())
            }
        }
    }

    /// A list element: a bool takes a byte there, unlike a bool field.
    fn skip_element(&mut self, kind: Type) -> Result<()> {
        match kind {
            Type::True | Type::False => self.byte().map(drop),
            other => self.skip(other),
        }
    }

    /// Runs `f` one level deeper (containers count towards the nesting bound as structs do).
    fn nested(&mut self, f: impl FnOnce(&mut Self) -> Result<()>) -> Result<()> {
        if self.last_ids.len() >= MAX_DEPTH {
            return Err(corrupt("nested too deep".into()));
        }
        self.last_ids.push(0);
        let out = f(self);
        self.last_ids.pop();
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fields_lists_and_skips_read_as_written() {
        // struct { 1: i32 = -3, 2: list<string> = ["ab"], 4: bool true, 20: struct { 1: i64 = 300 } }
        let bytes = [
            0x15, 0x05, // field 1 (delta 1) i32, zigzag(-3) = 5
            0x19, 0x18, 0x02, b'a', b'b', // field 2 list, 1 binary element
            0x21, // field 4 (delta 2) bool true
            0x0c, 0x28, // field 20 (long form) struct, zigzag(20) = 40
            0x16, 0xd8, 0x04, // field 1 i64, zigzag(300) = 600
            0x00, 0x00,
        ];
        let mut r = Reader::new(&bytes);
        r.begin().unwrap();
        let (id, t) = r.field().unwrap().unwrap();
        assert_eq!((id, r.i32(t).unwrap()), (1, -3));
        let (id, t) = r.field().unwrap().unwrap();
        assert_eq!((id, r.string_list(t).unwrap()), (2, vec!["ab".to_string()]));
        let (id, t) = r.field().unwrap().unwrap();
        assert_eq!((id, r.bool_of(t).unwrap()), (4, true));
        let (id, t) = r.field().unwrap().unwrap();
        assert_eq!((id, t), (20, Type::Struct));
        r.skip(t).unwrap();
        assert_eq!(r.field().unwrap(), None);
        assert_eq!(r.position(), bytes.len());
    }

    #[test]
    fn hostile_lengths_and_depths_are_refused() {
        // A list announcing 2^40 elements in 3 bytes.
        let mut r = Reader::new(&[0x19, 0xf8, 0x80, 0x80, 0x80, 0x80, 0x80, 0x20]);
        r.begin().unwrap();
        let (_, t) = r.field().unwrap().unwrap();
        assert!(r.string_list(t).is_err());
        // Structs nested past the bound.
        let deep = vec![0x1c; 100];
        let mut r = Reader::new(&deep);
        r.begin().unwrap();
        let (_, t) = r.field().unwrap().unwrap();
        assert!(r.skip(t).is_err());
    }
}
