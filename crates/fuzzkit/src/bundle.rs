//! Several files as one fuzz input: a reader that needs two files (an index beside its data,
//! a config beside its weights) is fuzzed by mutating both at once, including their sizes.
//!
//! Layout: `n` little-endian `u32` part lengths, then the parts back to back. The length
//! words are fields themselves, so the mutator moves bytes from one part to the next, and
//! truncation or extension of the input shortens or lengthens the last part.

use crate::mutate::Field;
use crate::runner::Seed;

/// Bytes of the length prefix of an `n`-part bundle.
pub fn prefix_len(parts: usize) -> usize {
    parts.saturating_mul(4)
}

/// Pack `parts` (each with the fields known inside it) into one [`Seed`] named `name`: the
/// length words become fields `"<part name> length"` and every part's fields are shifted to
/// where the part lands.
pub fn bundle(name: &str, parts: &[(&str, &[u8], &[Field])]) -> Seed {
    let mut bytes = Vec::new();
    let mut fields = Vec::new();
    for (i, (part, data, _)) in parts.iter().enumerate() {
        let len = u32::try_from(data.len()).unwrap_or(u32::MAX);
        bytes.extend_from_slice(&len.to_le_bytes());
        fields.push(Field::new(format!("{part} length"), 4 * i, 4));
    }
    for (part, data, part_fields) in parts {
        let at = bytes.len();
        fields.extend(part_fields.iter().map(|f| Field {
            name: format!("{part}.{}", f.name),
            ..f.shifted(at)
        }));
        bytes.extend_from_slice(data);
    }
    Seed::new(name, bytes).with_fields(fields)
}

/// Split a bundle of `n` parts. Never fails: a missing length word counts as 0, every part
/// but the last takes at most what is left, and the last part takes everything after the
/// others (so a bundle always yields exactly `n` slices, possibly empty).
pub fn unbundle(bytes: &[u8], n: usize) -> Vec<&[u8]> {
    let prefix = prefix_len(n).min(bytes.len());
    let (head, mut rest) = bytes.split_at(prefix);
    let mut parts = Vec::with_capacity(n);
    for i in 0..n {
        if i + 1 == n {
            parts.push(rest);
            break;
        }
        let word = head
            .get(4 * i..4 * i + 4)
            .map_or(0, |w| u32::from_le_bytes([w[0], w[1], w[2], w[3]]));
        let take = usize::try_from(word).unwrap_or(usize::MAX).min(rest.len());
        let (part, after) = rest.split_at(take);
        parts.push(part);
        rest = after;
    }
    parts
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::Rng;

    #[test]
    fn round_trip_and_shifted_fields() {
        let idx_fields = [Field::new("count", 2, 4)];
        let seed = bundle(
            "pair",
            &[("idx", b"abcdefgh", &idx_fields), ("bin", b"0123", &[])],
        );
        assert_eq!(unbundle(&seed.bytes, 2), [&b"abcdefgh"[..], &b"0123"[..]]);
        let names: Vec<&str> = seed.fields.iter().map(|f| f.name.as_str()).collect();
        assert_eq!(names, ["idx length", "bin length", "idx.count"]);
        assert_eq!(seed.fields[2].offset, 8 + 2);
        assert_eq!(
            seed.fields[2].read(&seed.bytes),
            Some(u32::from_le_bytes(*b"cdef").into())
        );
    }

    #[test]
    fn any_bytes_split_into_n_parts() {
        let mut rng = Rng::new(4);
        for _ in 0..2000 {
            let len = rng.index(40);
            let bytes: Vec<u8> = (0..len).map(|_| rng.next_u64() as u8 % 8).collect();
            for n in 0..4 {
                let parts = unbundle(&bytes, n);
                assert_eq!(parts.len(), n);
                let total: usize = parts.iter().map(|p| p.len()).sum();
                assert!(total <= bytes.len());
            }
        }
        assert_eq!(unbundle(&[], 2), [&[][..], &[][..]]);
    }
}
