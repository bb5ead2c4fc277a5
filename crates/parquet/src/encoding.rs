//! Value and level encodings: PLAIN, the RLE/bit-packing hybrid (levels and dictionary
//! indices), DELTA_BINARY_PACKED, DELTA_LENGTH_BYTE_ARRAY, DELTA_BYTE_ARRAY and
//! BYTE_STREAM_SPLIT. Each decoder is told how many values to produce and fails, rather than
//! invents, when the bytes run out; no count read from the data sizes an allocation on its
//! own (the caller has checked it against the read's budget).

use serde_json::Value;

use crate::meta::{Annotation, PhysicalType};
use crate::{ParquetError, Result};

fn corrupt(what: impl Into<String>) -> ParquetError {
    ParquetError::Corrupt(what.into())
}

/// How a leaf column's values become JSON.
#[derive(Clone, Copy, Debug)]
pub(crate) struct LeafType {
    pub(crate) physical: PhysicalType,
    pub(crate) annotation: Annotation,
    /// FIXED_LEN_BYTE_ARRAY's width.
    pub(crate) type_length: usize,
}

impl LeafType {
    fn int32(&self, v: i32) -> Value {
        if self.annotation == Annotation::Unsigned {
            Value::from(v as u32)
        } else {
            Value::from(v)
        }
    }

    fn int64(&self, v: i64) -> Value {
        if self.annotation == Annotation::Unsigned {
            Value::from(v as u64)
        } else {
            Value::from(v)
        }
    }

    fn bytes(&self, b: &[u8]) -> Result<Value> {
        if self.annotation == Annotation::Text {
            std::str::from_utf8(b)
                .map(|s| Value::String(s.to_owned()))
                .map_err(|_| corrupt("a text value that is not UTF-8"))
        } else {
            Ok(Value::Array(b.iter().map(|&x| Value::from(x)).collect()))
        }
    }
}

/// JSON has no NaN or infinity: they read as null, as `json.dumps` would refuse them.
fn float(v: f64) -> Value {
    serde_json::Number::from_f64(v).map_or(Value::Null, Value::Number)
}

/// A cursor over a page's bytes.
pub(crate) struct Bytes<'a> {
    pub(crate) data: &'a [u8],
    pub(crate) pos: usize,
}

impl<'a> Bytes<'a> {
    pub(crate) fn new(data: &'a [u8]) -> Bytes<'a> {
        Bytes { data, pos: 0 }
    }

    pub(crate) fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        let out = self
            .pos
            .checked_add(n)
            .and_then(|end| self.data.get(self.pos..end))
            .ok_or_else(|| corrupt("a page shorter than its values"))?;
        self.pos += n;
        Ok(out)
    }

    pub(crate) fn rest(&self) -> &'a [u8] {
        &self.data[self.pos..]
    }

    fn u32_le(&mut self) -> Result<u32> {
        let b = self.take(4)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }

    fn varint(&mut self) -> Result<u64> {
        let mut value = 0u64;
        for shift in (0..64).step_by(7) {
            let b = self.take(1)?[0];
            value |= u64::from(b & 0x7f) << shift;
            if b & 0x80 == 0 {
                return Ok(value);
            }
        }
        Err(corrupt("a varint longer than 10 bytes"))
    }

    fn zigzag(&mut self) -> Result<i64> {
        let v = self.varint()?;
        Ok((v >> 1) as i64 ^ -((v & 1) as i64))
    }
}

/// The `index`-th `width`-bit value packed least significant bit first (width ≤ 64).
fn unpack(data: &[u8], index: usize, width: usize) -> u64 {
    if width == 0 {
        return 0;
    }
    let bit = index * width;
    let (first, shift) = (bit / 8, bit % 8);
    let mut acc = 0u128;
    for (i, &b) in data[first..]
        .iter()
        .take((shift + width).div_ceil(8))
        .enumerate()
    {
        acc |= u128::from(b) << (8 * i);
    }
    let mask = if width == 64 {
        u64::MAX
    } else {
        (1u64 << width) - 1
    };
    (acc >> shift) as u64 & mask
}

/// `n` values of the RLE/bit-packing hybrid at `width` bits (levels and dictionary indices).
pub(crate) fn rle_hybrid(data: &[u8], width: usize, n: usize, out: &mut Vec<u32>) -> Result<()> {
    if width > 32 {
        return Err(corrupt(format!("a bit width of {width}")));
    }
    let mut bytes = Bytes::new(data);
    let mut left = n;
    while left > 0 {
        let header = bytes.varint()?;
        if header & 1 == 0 {
            let count = header >> 1;
            let raw = bytes.take(width.div_ceil(8))?;
            let value = raw
                .iter()
                .rev()
                .fold(0u32, |acc, &b| (acc << 8) | u32::from(b));
            if width < 32 && value >> width != 0 {
                return Err(corrupt("a run's value wider than its bit width"));
            }
            let take = usize::try_from(count).unwrap_or(usize::MAX).min(left);
            if take == 0 {
                return Err(corrupt("an empty run"));
            }
            out.extend(std::iter::repeat_n(value, take));
            left -= take;
        } else {
            let groups = usize::try_from(header >> 1).map_err(|_| corrupt("a huge run"))?;
            let values = groups.checked_mul(8).ok_or_else(|| corrupt("a huge run"))?;
            if values == 0 {
                return Err(corrupt("an empty run"));
            }
            let take = values.min(left);
            // Writers may end the last run short of its full groups: only what is used
            // must be there.
            let needed = (take * width).div_ceil(8);
            let full = groups
                .checked_mul(width)
                .ok_or_else(|| corrupt("a huge run"))?;
            let packed = &bytes.rest()[..full.min(bytes.rest().len())];
            if packed.len() < needed {
                return Err(corrupt("a bit-packed run past the page's end"));
            }
            out.extend((0..take).map(|i| unpack(packed, i, width) as u32));
            bytes.pos += packed.len();
            left -= take;
        }
    }
    Ok(())
}

/// The bit width of levels up to `max`.
pub(crate) fn width_of(max: u32) -> usize {
    (32 - max.leading_zeros()) as usize
}

/// `n` PLAIN values.
pub(crate) fn plain(bytes: &mut Bytes<'_>, leaf: &LeafType, n: usize) -> Result<Vec<Value>> {
    let width = match leaf.physical {
        PhysicalType::Boolean => {
            let packed = bytes.take(n.div_ceil(8))?;
            return Ok((0..n)
                .map(|i| Value::Bool(packed[i / 8] >> (i % 8) & 1 == 1))
                .collect());
        }
        PhysicalType::ByteArray => {
            let mut out = Vec::with_capacity(n.min(bytes.rest().len() / 4));
            for _ in 0..n {
                let len = bytes.u32_le()? as usize;
                out.push(leaf.bytes(bytes.take(len)?)?);
            }
            return Ok(out);
        }
        PhysicalType::Int32 | PhysicalType::Float => 4,
        PhysicalType::Int64 | PhysicalType::Double => 8,
        PhysicalType::Int96 => 12,
        PhysicalType::FixedLenByteArray => leaf.type_length,
    };
    let all = bytes.take(
        n.checked_mul(width)
            .ok_or_else(|| corrupt("too many values"))?,
    )?;
    fixed_width(all, width, leaf)
}

/// Values of `width` bytes each, laid end to end.
fn fixed_width(all: &[u8], width: usize, leaf: &LeafType) -> Result<Vec<Value>> {
    if width == 0 {
        return Err(corrupt("a fixed-length column of width 0"));
    }
    all.chunks_exact(width)
        .map(|c| {
            Ok(match leaf.physical {
                PhysicalType::Int32 => leaf.int32(i32::from_le_bytes([c[0], c[1], c[2], c[3]])),
                PhysicalType::Float => {
                    float(f64::from(f32::from_le_bytes([c[0], c[1], c[2], c[3]])))
                }
                PhysicalType::Int64 => {
                    leaf.int64(i64::from_le_bytes(c.try_into().expect("8 bytes")))
                }
                PhysicalType::Double => float(f64::from_le_bytes(c.try_into().expect("8 bytes"))),
                _ => leaf.bytes(c)?,
            })
        })
        .collect()
}

/// `n` BYTE_STREAM_SPLIT values: byte `k` of every value, then byte `k + 1` of every value…
pub(crate) fn byte_stream_split(data: &[u8], leaf: &LeafType, n: usize) -> Result<Vec<Value>> {
    let width = match leaf.physical {
        PhysicalType::Int32 | PhysicalType::Float => 4,
        PhysicalType::Int64 | PhysicalType::Double => 8,
        PhysicalType::FixedLenByteArray => leaf.type_length,
        other => return Err(corrupt(format!("BYTE_STREAM_SPLIT for {other:?}"))),
    };
    if width == 0 || !data.len().is_multiple_of(width) {
        return Err(corrupt("a BYTE_STREAM_SPLIT page of a partial value"));
    }
    let count = data.len() / width;
    if count < n {
        return Err(corrupt("a page shorter than its values"));
    }
    let mut joined = Vec::with_capacity(n * width);
    for i in 0..n {
        joined.extend((0..width).map(|k| data[k * count + i]));
    }
    fixed_width(&joined, width, leaf)
}

/// `n` integers of DELTA_BINARY_PACKED; leaves `bytes` after the last block read.
pub(crate) fn delta_binary_packed(bytes: &mut Bytes<'_>, n: usize) -> Result<Vec<i64>> {
    let block = usize::try_from(bytes.varint()?).map_err(|_| corrupt("a huge delta block"))?;
    let miniblocks = usize::try_from(bytes.varint()?).map_err(|_| corrupt("a huge delta block"))?;
    let total = bytes.varint()?;
    let first = bytes.zigzag()?;
    if block == 0 || block % 128 != 0 || miniblocks == 0 || block % miniblocks != 0 {
        return Err(corrupt(format!(
            "a delta block of {block} in {miniblocks} miniblocks"
        )));
    }
    let per_mini = block / miniblocks;
    if per_mini % 32 != 0 {
        return Err(corrupt("a delta miniblock not a multiple of 32 values"));
    }
    if total < n as u64 {
        return Err(corrupt(format!(
            "{total} delta values where {n} are needed"
        )));
    }
    let total = total as usize; // ≥ n, and n fits
    let mut out = Vec::with_capacity(n.min(bytes.rest().len() * 8 + 1));
    if total == 0 {
        return Ok(out);
    }
    out.push(first);
    let mut last = first;
    // Every value the header announces is consumed, so `bytes` ends after the block.
    let mut left = total - 1;
    while left > 0 {
        let min_delta = bytes.zigzag()?;
        let widths = bytes.take(miniblocks)?.to_vec();
        for &w in &widths {
            if left == 0 {
                break; // Miniblocks past the last value are not written.
            }
            let w = usize::from(w);
            if w > 64 {
                return Err(corrupt(format!("a delta bit width of {w}")));
            }
            let packed = bytes.take(per_mini * w / 8)?;
            let take = per_mini.min(left);
            for i in 0..take {
                last = last
                    .wrapping_add(min_delta)
                    .wrapping_add(unpack(packed, i, w) as i64);
                if out.len() < n {
                    out.push(last);
                }
            }
            left -= take;
        }
    }
    Ok(out)
}

/// `n` DELTA_LENGTH_BYTE_ARRAY values.
fn delta_length(bytes: &mut Bytes<'_>, n: usize) -> Result<Vec<Vec<u8>>> {
    let lengths = delta_binary_packed(bytes, n)?;
    lengths
        .iter()
        .map(|&len| {
            let len = usize::try_from(len).map_err(|_| corrupt("a negative length"))?;
            Ok(bytes.take(len)?.to_vec())
        })
        .collect()
}

/// `n` DELTA_LENGTH_BYTE_ARRAY values as JSON.
pub(crate) fn delta_length_byte_array(
    bytes: &mut Bytes<'_>,
    leaf: &LeafType,
    n: usize,
) -> Result<Vec<Value>> {
    delta_length(bytes, n)?
        .iter()
        .map(|b| leaf.bytes(b))
        .collect()
}

/// `n` DELTA_BYTE_ARRAY values: each a prefix of the one before and a suffix of its own.
pub(crate) fn delta_byte_array(
    bytes: &mut Bytes<'_>,
    leaf: &LeafType,
    n: usize,
) -> Result<Vec<Value>> {
    let prefixes = delta_binary_packed(bytes, n)?;
    let suffixes = delta_length(bytes, n)?;
    let mut previous: Vec<u8> = Vec::new();
    let mut out = Vec::with_capacity(n);
    for (prefix, suffix) in prefixes.iter().zip(&suffixes) {
        let prefix = usize::try_from(*prefix)
            .ok()
            .filter(|&p| p <= previous.len())
            .ok_or_else(|| corrupt("a prefix longer than the value before"))?;
        previous.truncate(prefix);
        previous.extend_from_slice(suffix);
        out.push(leaf.bytes(&previous)?);
    }
    Ok(out)
}

/// `n` DELTA_BINARY_PACKED values as JSON (INT32 or INT64 columns).
pub(crate) fn delta_ints(bytes: &mut Bytes<'_>, leaf: &LeafType, n: usize) -> Result<Vec<Value>> {
    let ints = delta_binary_packed(bytes, n)?;
    Ok(match leaf.physical {
        PhysicalType::Int32 => ints.iter().map(|&v| leaf.int32(v as i32)).collect(),
        PhysicalType::Int64 => ints.iter().map(|&v| leaf.int64(v)).collect(),
        other => return Err(corrupt(format!("DELTA_BINARY_PACKED for {other:?}"))),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// A plain encoder of the hybrid, choosing runs and packed groups by `choices`.
    fn encode_hybrid(values: &[u32], width: usize, choices: &[bool]) -> Vec<u8> {
        fn varint(out: &mut Vec<u8>, mut v: u64) {
            while v >= 0x80 {
                out.push(v as u8 | 0x80);
                v >>= 7;
            }
            out.push(v as u8);
        }
        let mut out = Vec::new();
        let mut i = 0;
        let mut c = 0;
        while i < values.len() {
            let run = values[i..].iter().take_while(|&&v| v == values[i]).count();
            let as_run = choices.get(c).copied().unwrap_or(true);
            c += 1;
            if as_run {
                varint(&mut out, (run as u64) << 1);
                out.extend(&values[i].to_le_bytes()[..width.div_ceil(8)]);
                i += run;
            } else {
                let group: Vec<u32> = values[i..].iter().take(8).copied().collect();
                varint(&mut out, (1 << 1) | 1);
                let mut bits = vec![0u8; width];
                for (j, &v) in group.iter().enumerate() {
                    for b in 0..width {
                        if v >> b & 1 == 1 {
                            let bit = j * width + b;
                            bits[bit / 8] |= 1 << (bit % 8);
                        }
                    }
                }
                out.extend(bits);
                i += group.len();
            }
        }
        out
    }

    proptest! {
        /// Any mix of runs and packed groups decodes to the values encoded, at every width.
        #[test]
        fn the_hybrid_decodes_what_was_encoded(
            width in 0usize..=32,
            raw in prop::collection::vec(any::<u32>(), 1..200),
            runs in prop::collection::vec(0usize..4, 1..200),
            choices in prop::collection::vec(any::<bool>(), 0..64),
        ) {
            let mask = if width == 32 { u32::MAX } else { (1u32 << width) - 1 };
            let values: Vec<u32> = raw
                .iter()
                .zip(runs.iter().cycle())
                .flat_map(|(&v, &r)| std::iter::repeat_n(v & mask, r + 1))
                .collect();
            let encoded = encode_hybrid(&values, width, &choices);
            let mut out = Vec::new();
            rle_hybrid(&encoded, width, values.len(), &mut out).unwrap();
            prop_assert_eq!(&out, &values);
            // One value more than was written is refused, not invented.
            let mut out = Vec::new();
            prop_assert!(rle_hybrid(&encoded, width, values.len() + 9, &mut out).is_err());
        }
    }

    #[test]
    fn delta_binary_packed_reads_the_format_example() {
        // The spec's example: 1 2 3 4 5 as block 128 / 4 miniblocks; deltas all 1, so the
        // min delta is 1 and every width 0.
        let bytes = [0x80, 0x01, 0x04, 0x05, 0x02, 0x02, 0, 0, 0, 0];
        let mut b = Bytes::new(&bytes);
        assert_eq!(delta_binary_packed(&mut b, 5).unwrap(), [1, 2, 3, 4, 5]);
        assert_eq!(b.pos, bytes.len());
        let mut b = Bytes::new(&bytes);
        assert!(
            delta_binary_packed(&mut b, 6).is_err(),
            "more than announced"
        );
    }
}
