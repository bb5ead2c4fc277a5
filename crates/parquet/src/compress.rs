//! Page decompression. Snappy (the default of pyarrow, Spark and datatrove) and LZ4_RAW are
//! decoded here; GZIP and ZSTD through pure-Rust crates. Every page's output is exactly the size
//! its header announces, so that size (already checked against the limit) bounds every
//! allocation: a stream that would decode to more or less is corrupt.

use std::io::Read;

use crate::{ParquetError, Result};

/// `parquet.thrift`'s compression codecs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Codec {
    Uncompressed,
    Snappy,
    Gzip,
    Zstd,
    Lz4Raw,
    /// Not a Parquet codec: Arrow IPC's LZ4_FRAME body compression.
    Lz4Frame,
}

impl Codec {
    /// The codec numbered `v`, or why it cannot be read.
    pub(crate) fn of(v: i32) -> Result<Codec> {
        Ok(match v {
            0 => Codec::Uncompressed,
            1 => Codec::Snappy,
            2 => Codec::Gzip,
            6 => Codec::Zstd,
            7 => Codec::Lz4Raw,
            3 => return Err(ParquetError::Unsupported("the LZO codec".into())),
            4 => return Err(ParquetError::Unsupported("the BROTLI codec".into())),
            5 => {
                return Err(ParquetError::Unsupported(
                    "the deprecated Hadoop LZ4 codec (LZ4_RAW is read)".into(),
                ))
            }
            n => return Err(ParquetError::Corrupt(format!("codec {n}"))),
        })
    }
}

fn corrupt(codec: Codec, what: impl std::fmt::Display) -> ParquetError {
    ParquetError::Corrupt(format!("{codec:?} page: {what}"))
}

/// `input` decompressed to exactly `size` bytes.
pub(crate) fn decompress(codec: Codec, input: &[u8], size: usize) -> Result<Vec<u8>> {
    let out = match codec {
        Codec::Uncompressed => input.to_vec(),
        Codec::Snappy => snappy(input, size)?,
        Codec::Lz4Raw => lz4_raw(input, size)?,
        Codec::Lz4Frame => lz4_frame(input, size)?,
        Codec::Gzip => read_exactly(flate2::read::MultiGzDecoder::new(input), size, codec)?,
        Codec::Zstd => {
            let decoder =
                ruzstd::decoding::StreamingDecoder::new(input).map_err(|e| corrupt(codec, e))?;
            read_exactly(decoder, size, codec)?
        }
    };
    if out.len() != size {
        return Err(corrupt(
            codec,
            format!("{} bytes where the header says {size}", out.len()),
        ));
    }
    Ok(out)
}

/// Reads at most `size + 1` bytes, so a stream longer than announced is seen without being
/// decoded whole.
fn read_exactly(reader: impl Read, size: usize, codec: Codec) -> Result<Vec<u8>> {
    let mut out = Vec::with_capacity(size);
    reader
        .take(size as u64 + 1)
        .read_to_end(&mut out)
        .map_err(|e| corrupt(codec, e))?;
    Ok(out)
}

/// Snappy's raw block format: a varint length, then literals and back-references.
pub(crate) fn snappy(input: &[u8], size: usize) -> Result<Vec<u8>> {
    let bad = |what: &str| corrupt(Codec::Snappy, what);
    let mut pos = 0;
    let mut announced = 0u64;
    for shift in (0..35).step_by(7) {
        let b = *input.get(pos).ok_or_else(|| bad("truncated length"))?;
        pos += 1;
        announced |= u64::from(b & 0x7f) << shift;
        if b & 0x80 == 0 {
            break;
        }
        if shift == 28 {
            return Err(bad("length longer than 5 bytes"));
        }
    }
    if announced != size as u64 {
        return Err(bad("its length differs from the page header's"));
    }
    let mut out = Vec::with_capacity(size);
    while pos < input.len() {
        let tag = input[pos];
        pos += 1;
        let (len, offset) = match tag & 3 {
            0 => {
                let mut len = usize::from(tag >> 2) + 1;
                if len > 60 {
                    let extra = len - 60;
                    let bytes = input
                        .get(pos..pos + extra)
                        .ok_or_else(|| bad("truncated literal length"))?;
                    len = bytes
                        .iter()
                        .rev()
                        .fold(0usize, |acc, &b| (acc << 8) | usize::from(b))
                        + 1;
                    pos += extra;
                }
                let literal = pos
                    .checked_add(len)
                    .and_then(|end| input.get(pos..end))
                    .ok_or_else(|| bad("truncated literal"))?;
                if out.len() + len > size {
                    return Err(bad("more bytes than announced"));
                }
                out.extend_from_slice(literal);
                pos += len;
                continue;
            }
            1 => {
                let low = *input.get(pos).ok_or_else(|| bad("truncated copy"))?;
                pos += 1;
                (
                    usize::from((tag >> 2) & 7) + 4,
                    (usize::from(tag >> 5) << 8) | usize::from(low),
                )
            }
            2 => {
                let b = input
                    .get(pos..pos + 2)
                    .ok_or_else(|| bad("truncated copy"))?;
                pos += 2;
                (
                    usize::from(tag >> 2) + 1,
                    usize::from(u16::from_le_bytes([b[0], b[1]])),
                )
            }
            _ => {
                let b = input
                    .get(pos..pos + 4)
                    .ok_or_else(|| bad("truncated copy"))?;
                pos += 4;
                let offset = u32::from_le_bytes([b[0], b[1], b[2], b[3]]);
                (usize::from(tag >> 2) + 1, offset as usize)
            }
        };
        back_reference(&mut out, offset, len, size).map_err(&bad)?;
    }
    Ok(out)
}

/// Appends `len` bytes copied from `offset` bytes back (overlapping copies repeat the pattern).
fn back_reference(
    out: &mut Vec<u8>,
    offset: usize,
    len: usize,
    size: usize,
) -> std::result::Result<(), &'static str> {
    if offset == 0 || offset > out.len() {
        return Err("a copy from before the start");
    }
    if out.len() + len > size {
        return Err("more bytes than announced");
    }
    let start = out.len() - offset;
    if offset >= len {
        out.extend_from_within(start..start + len);
    } else {
        for i in 0..len {
            out.push(out[start + i]);
        }
    }
    Ok(())
}

/// LZ4's block format (Parquet's LZ4_RAW): sequences of literals and a match.
pub(crate) fn lz4_raw(input: &[u8], size: usize) -> Result<Vec<u8>> {
    let mut out = Vec::with_capacity(size);
    lz4_block_into(input, &mut out, size).map_err(|what| corrupt(Codec::Lz4Raw, what))?;
    Ok(out)
}

/// Decodes one LZ4 block onto the end of `out`, which must not pass `size` bytes in all.
/// A match may reach back into what `out` held before: an LZ4 frame's linked blocks do.
fn lz4_block_into(
    input: &[u8],
    out: &mut Vec<u8>,
    size: usize,
) -> std::result::Result<(), &'static str> {
    let mut pos = 0;
    // A length nibble of 15 continues in bytes of 255 until a smaller one.
    let extended = |pos: &mut usize, mut len: usize| -> std::result::Result<usize, &'static str> {
        if len == 15 {
            loop {
                let b = *input.get(*pos).ok_or("truncated length")?;
                *pos += 1;
                len = len.checked_add(usize::from(b)).ok_or("length overflow")?;
                if b != 255 {
                    break;
                }
            }
        }
        Ok(len)
    };
    loop {
        let token = *input.get(pos).ok_or("truncated sequence")?;
        pos += 1;
        let literals = extended(&mut pos, usize::from(token >> 4))?;
        let literal = pos
            .checked_add(literals)
            .and_then(|end| input.get(pos..end))
            .ok_or("truncated literal")?;
        if out.len() + literals > size {
            return Err("more bytes than announced");
        }
        out.extend_from_slice(literal);
        pos += literals;
        if pos == input.len() {
            return Ok(()); // The last sequence has no match.
        }
        let b = input.get(pos..pos + 2).ok_or("truncated offset")?;
        pos += 2;
        let offset = usize::from(u16::from_le_bytes([b[0], b[1]]));
        let len = extended(&mut pos, usize::from(token & 15))?
            .checked_add(4)
            .ok_or("length overflow")?;
        back_reference(out, offset, len, size)?;
    }
}

/// LZ4's frame format (Arrow IPC's LZ4_FRAME body compression), decoded to exactly `size`
/// bytes: frames one after the other, skippable frames skipped, blocks linked or not. The
/// xxHash checksums are stepped over, not verified: the decoded size must match the
/// announced one exactly, and the values read from it are checked where they are used.
pub(crate) fn lz4_frame(input: &[u8], size: usize) -> Result<Vec<u8>> {
    let bad = |what: &str| ParquetError::Corrupt(format!("LZ4 frame: {what}"));
    let mut out = Vec::with_capacity(size);
    let mut pos = 0;
    let take = |pos: &mut usize, n: usize| -> Result<&[u8]> {
        let got = pos
            .checked_add(n)
            .and_then(|end| input.get(*pos..end))
            .ok_or_else(|| bad("truncated"))?;
        *pos += n;
        Ok(got)
    };
    let word = |b: &[u8]| u32::from_le_bytes(b.try_into().expect("4 bytes"));
    while pos < input.len() {
        let magic = word(take(&mut pos, 4)?);
        if magic & 0xffff_fff0 == 0x184d_2a50 {
            let skip = word(take(&mut pos, 4)?) as usize;
            take(&mut pos, skip)?;
            continue;
        }
        if magic != 0x184d_2204 {
            return Err(bad(&format!("magic {magic:#010x}")));
        }
        let descriptor = take(&mut pos, 2)?;
        let (flags, block_code) = (descriptor[0], descriptor[1]);
        if flags >> 6 != 1 || flags & 0b10 != 0 || block_code & 0x8f != 0 {
            return Err(bad("a frame descriptor of an unknown version"));
        }
        let max_block = match (block_code >> 4) & 7 {
            4 => 64 << 10,
            5 => 256 << 10,
            6 => 1 << 20,
            7 => 4 << 20,
            _ => return Err(bad("an unknown block size")),
        };
        let block_checksum = flags & 0b1_0000 != 0;
        let content_size = flags & 0b1000 != 0;
        let content_checksum = flags & 0b100 != 0;
        if flags & 1 != 0 {
            return Err(ParquetError::Unsupported(
                "an LZ4 frame with a dictionary".into(),
            ));
        }
        let frame_start = out.len();
        let announced = if content_size {
            let b = take(&mut pos, 8)?;
            Some(u64::from_le_bytes(b.try_into().expect("8 bytes")))
        } else {
            None
        };
        take(&mut pos, 1)?; // the descriptor's checksum
        loop {
            let header = word(take(&mut pos, 4)?);
            if header == 0 {
                break;
            }
            let len = (header & 0x7fff_ffff) as usize;
            if len > max_block {
                return Err(bad("a block larger than the frame's block size"));
            }
            let block = take(&mut pos, len)?;
            if header & 0x8000_0000 != 0 {
                if out.len() + len > size {
                    return Err(bad("more bytes than announced"));
                }
                out.extend_from_slice(block);
            } else {
                let before = out.len();
                lz4_block_into(block, &mut out, size).map_err(bad)?;
                if out.len() - before > max_block {
                    return Err(bad("a block decoding past the frame's block size"));
                }
            }
            if block_checksum {
                take(&mut pos, 4)?;
            }
        }
        if content_checksum {
            take(&mut pos, 4)?;
        }
        if announced.is_some_and(|n| n != (out.len() - frame_start) as u64) {
            return Err(bad("a frame whose content size is not what it decodes to"));
        }
    }
    if out.len() != size {
        return Err(bad(&format!(
            "{} bytes where {size} were announced",
            out.len()
        )));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn snappy_literals_and_overlapping_copies() {
        // "abcabcabcab": literal "abc", then a copy of 8 bytes from 3 back (1-byte offset form).
        let stream = [11, 0b0000_1000, b'a', b'b', b'c', 0b0001_0001, 3];
        assert_eq!(snappy(&stream, 11).unwrap(), b"abcabcabcab");
        assert!(
            snappy(&stream, 12).is_err(),
            "length disagreeing with the header"
        );
        assert!(snappy(&[4, 0b0000_1100, 1, 2, 3, 4, 0b0000_0101, 9], 4).is_err());
        assert!(snappy(&[11, 0b0000_1000, b'a', b'b', b'c', 0b0001_0001, 4], 11).is_err());
    }

    #[test]
    fn lz4_sequences_and_bounds() {
        // literal "ab", match of 6 from 2 back, then the final literal "!".
        let stream = [0x22, b'a', b'b', 2, 0, 0x10, b'!'];
        assert_eq!(lz4_raw(&stream, 9).unwrap(), b"abababab!");
        assert!(lz4_raw(&stream, 8).is_err());
        assert!(lz4_raw(&[0x20, b'a', b'b', 3, 0, 0x10, b'!'], 9).is_err());
        assert!(
            decompress(Codec::Lz4Raw, &stream, 10).is_err(),
            "short of the header's size"
        );
    }

    /// A frame: magic, flags (version 1, independent blocks, content size), block size
    /// 64 KiB, the content size, the descriptor's checksum byte, then `blocks`, an end mark.
    fn frame(content: u64, blocks: &[(bool, &[u8])]) -> Vec<u8> {
        let mut f = 0x184d_2204u32.to_le_bytes().to_vec();
        f.extend([0b0110_1000, 0b0100_0000]);
        f.extend(content.to_le_bytes());
        f.push(0);
        for (raw, data) in blocks {
            let flag = if *raw { 0x8000_0000 } else { 0 };
            f.extend((data.len() as u32 | flag).to_le_bytes());
            f.extend(*data);
        }
        f.extend(0u32.to_le_bytes());
        f
    }

    #[test]
    fn lz4_frames_linked_blocks_and_bounds() {
        // A stored block "abc", then a compressed one copying from it: 3 back, 6 bytes.
        let second: &[u8] = &[0x02, 3, 0, 0x10, b'!'];
        let f = frame(10, &[(true, b"abc"), (false, second)]);
        assert_eq!(lz4_frame(&f, 10).unwrap(), b"abcabcabc!");
        assert!(lz4_frame(&f, 11).is_err(), "shorter than announced");
        assert!(lz4_frame(&f, 9).is_err(), "longer than announced");
        let wrong_size = frame(11, &[(true, b"abc"), (false, second)]);
        assert!(
            lz4_frame(&wrong_size, 10).is_err(),
            "content size disagrees"
        );
        // Two frames, a skippable one between.
        let mut two = frame(3, &[(true, b"abc")]);
        two.extend(0x184d_2a51u32.to_le_bytes());
        two.extend(2u32.to_le_bytes());
        two.extend([9, 9]);
        two.extend(frame(2, &[(true, b"de")]));
        assert_eq!(lz4_frame(&two, 5).unwrap(), b"abcde");
        for cut in 0..f.len() {
            assert!(lz4_frame(&f[..cut], 10).is_err(), "cut at {cut}");
        }
        let mut bad_magic = f.clone();
        bad_magic[0] ^= 1;
        assert!(lz4_frame(&bad_magic, 10).is_err());
    }
}
