//! A bounded FlatBuffers reader: just what Arrow's IPC metadata (`Schema.fbs`, `Message.fbs`,
//! `File.fbs`) needs. Every offset, vtable and vector length is checked against the buffer
//! before use, so a hostile message is an error and never a panic or a large allocation.
//!
//! The layout, in brief: a buffer starts with the offset of its root table; a table starts
//! with the signed distance back to its vtable; the vtable holds its own size, the table's,
//! and one 16-bit offset per field slot (0: absent, the default applies). Tables, vectors and
//! strings are reached through 32-bit offsets relative to where the offset is stored.

/// What went wrong, in words; the caller wraps it in its own error type.
pub(crate) type FbResult<T> = std::result::Result<T, String>;

fn read<const N: usize>(buf: &[u8], pos: usize) -> FbResult<[u8; N]> {
    pos.checked_add(N)
        .and_then(|end| buf.get(pos..end))
        .map(|b| b.try_into().expect("N bytes"))
        .ok_or_else(|| format!("{N} bytes at {pos} of a {}-byte message", buf.len()))
}

fn u32_at(buf: &[u8], pos: usize) -> FbResult<usize> {
    Ok(u32::from_le_bytes(read(buf, pos)?) as usize)
}

/// A table: its position and its vtable's, both checked to lie in the buffer.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Table<'a> {
    buf: &'a [u8],
    pos: usize,
    vtable: usize,
    vtable_len: usize,
}

/// The root table of `buf`.
pub(crate) fn root(buf: &[u8]) -> FbResult<Table<'_>> {
    let pos = u32_at(buf, 0)?;
    Table::at(buf, pos)
}

impl<'a> Table<'a> {
    fn at(buf: &'a [u8], pos: usize) -> FbResult<Table<'a>> {
        let back = i32::from_le_bytes(read(buf, pos)?);
        let vtable = (pos as i64)
            .checked_sub(i64::from(back))
            .filter(|&v| v >= 0)
            .ok_or_else(|| format!("a table at {pos} with its vtable {back} bytes back"))?
            as usize;
        let vtable_len = usize::from(u16::from_le_bytes(read(buf, vtable)?));
        if vtable_len < 4 || vtable_len % 2 != 0 || vtable + vtable_len > buf.len() {
            return Err(format!(
                "a vtable of {vtable_len} bytes at {vtable} of a {}-byte message",
                buf.len()
            ));
        }
        Ok(Table {
            buf,
            pos,
            vtable,
            vtable_len,
        })
    }

    /// Where field `slot` lies, or `None` when it is absent (its default applies).
    fn field(&self, slot: usize) -> FbResult<Option<usize>> {
        let entry = 4 + 2 * slot;
        if entry + 2 > self.vtable_len {
            return Ok(None);
        }
        let offset = u16::from_le_bytes(read(self.buf, self.vtable + entry)?);
        Ok((offset != 0).then_some(self.pos + usize::from(offset)))
    }

    fn scalar<const N: usize>(&self, slot: usize) -> FbResult<Option<[u8; N]>> {
        self.field(slot)?.map(|p| read(self.buf, p)).transpose()
    }

    /// An 8-bit field (an enum, a union's type, a byte).
    pub(crate) fn u8(&self, slot: usize, default: u8) -> FbResult<u8> {
        Ok(self.scalar::<1>(slot)?.map_or(default, |b| b[0]))
    }

    /// A boolean field.
    pub(crate) fn bool(&self, slot: usize) -> FbResult<bool> {
        Ok(self.u8(slot, 0)? != 0)
    }

    /// A 16-bit field (Arrow's `short` enums).
    pub(crate) fn i16(&self, slot: usize, default: i16) -> FbResult<i16> {
        Ok(self.scalar(slot)?.map_or(default, i16::from_le_bytes))
    }

    /// A 32-bit field.
    pub(crate) fn i32(&self, slot: usize, default: i32) -> FbResult<i32> {
        Ok(self.scalar(slot)?.map_or(default, i32::from_le_bytes))
    }

    /// A 64-bit field.
    pub(crate) fn i64(&self, slot: usize, default: i64) -> FbResult<i64> {
        Ok(self.scalar(slot)?.map_or(default, i64::from_le_bytes))
    }

    /// Where the offset field `slot` points, if present.
    fn target(&self, slot: usize) -> FbResult<Option<usize>> {
        let Some(p) = self.field(slot)? else {
            return Ok(None);
        };
        let target = p
            .checked_add(u32_at(self.buf, p)?)
            .filter(|&t| t < self.buf.len())
            .ok_or_else(|| format!("an offset at {p} past the {}-byte message", self.buf.len()))?;
        Ok(Some(target))
    }

    /// A table field.
    pub(crate) fn table(&self, slot: usize) -> FbResult<Option<Table<'a>>> {
        self.target(slot)?
            .map(|t| Table::at(self.buf, t))
            .transpose()
    }

    /// A vector field's elements of `size` bytes each: where they start and how many.
    fn vector(&self, slot: usize, size: usize) -> FbResult<Option<(usize, usize)>> {
        let Some(t) = self.target(slot)? else {
            return Ok(None);
        };
        let len = u32_at(self.buf, t)?;
        let start = t + 4;
        if len
            .checked_mul(size)
            .and_then(|bytes| start.checked_add(bytes))
            .is_none_or(|end| end > self.buf.len())
        {
            return Err(format!(
                "a vector of {len} {size}-byte elements at {t} of a {}-byte message",
                self.buf.len()
            ));
        }
        Ok(Some((start, len)))
    }

    /// A string field, which must be UTF-8.
    pub(crate) fn string(&self, slot: usize) -> FbResult<Option<&'a str>> {
        let Some((start, len)) = self.vector(slot, 1)? else {
            return Ok(None);
        };
        std::str::from_utf8(&self.buf[start..start + len])
            .map(Some)
            .map_err(|e| format!("a string at {start} that is not UTF-8: {e}"))
    }

    /// A vector of tables (empty when absent).
    pub(crate) fn tables(&self, slot: usize) -> FbResult<Vec<Table<'a>>> {
        let Some((start, len)) = self.vector(slot, 4)? else {
            return Ok(Vec::new());
        };
        (0..len)
            .map(|i| {
                let p = start + 4 * i;
                let t = p + u32_at(self.buf, p)?;
                Table::at(self.buf, t)
            })
            .collect()
    }

    /// A vector of structs of `size` bytes each, as their bytes (empty when absent).
    pub(crate) fn structs(&self, slot: usize, size: usize) -> FbResult<&'a [u8]> {
        Ok(match self.vector(slot, size)? {
            Some((start, len)) => &self.buf[start..start + len * size],
            None => &[],
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A table with an i64 in slot 0, a string in slot 1 and slot 2 absent, laid out by hand.
    fn sample() -> Vec<u8> {
        let mut b = Vec::new();
        b.extend(12u32.to_le_bytes()); // root offset -> table at 12
                                       // vtable at 4: size 8, table size 16, slot0 at +4, slot1 at +12
        b.extend(8u16.to_le_bytes());
        b.extend(16u16.to_le_bytes());
        b.extend(4u16.to_le_bytes());
        b.extend(12u16.to_le_bytes());
        // table at 12: back 8 to the vtable
        b.extend(8i32.to_le_bytes());
        b.extend((-7i64).to_le_bytes()); // slot 0 at 16
        b.extend(4u32.to_le_bytes()); // slot 1 at 24 -> string at 28
        b.extend(3u32.to_le_bytes());
        b.extend(b"abc\0");
        b
    }

    #[test]
    fn fields_defaults_and_strings() {
        let buf = sample();
        let t = root(&buf).unwrap();
        assert_eq!(t.i64(0, 0).unwrap(), -7);
        assert_eq!(t.string(1).unwrap(), Some("abc"));
        assert_eq!(t.i32(2, 42).unwrap(), 42, "absent slot: the default");
        assert_eq!(t.string(5).unwrap(), None, "a slot past the vtable");
    }

    #[test]
    fn damaged_buffers_are_errors() {
        let buf = sample();
        // Every truncation is an error or reads fewer fields, never a panic.
        for cut in 0..buf.len() {
            if let Ok(t) = root(&buf[..cut]) {
                let _ = t.i64(0, 0);
                let _ = t.string(1);
            }
        }
        // A string longer than the buffer.
        let mut long = buf.clone();
        long[28..32].copy_from_slice(&1000u32.to_le_bytes());
        assert!(root(&long).unwrap().string(1).is_err());
        // A vtable before the start.
        let mut back = buf.clone();
        back[12..16].copy_from_slice(&100i32.to_le_bytes());
        assert!(root(&back).is_err());
        // A vtable claiming more bytes than there are.
        let mut wide = buf;
        wide[4..6].copy_from_slice(&400u16.to_le_bytes());
        assert!(root(&wide).is_err());
    }
}
