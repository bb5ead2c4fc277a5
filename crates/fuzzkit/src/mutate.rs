//! The mutator: byte-level damage (bit flips, interesting bytes, random runs, truncation,
//! extension, chunk duplication and deletion) and structure-aware damage to known header
//! fields (extreme values, values derived from the file length, small arithmetic steps).

use std::fmt;

use crate::rng::Rng;

/// A header field of a seed input: `width` little-endian bytes at `offset`.
///
/// The mutator writes extreme values here ([`extreme_values`]), which is where parsers that
/// trust a count or a size break. Widths outside `1..=8` are clamped into that range.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Field {
    /// A short name shown in the recipe of a failing input (`"token count"`).
    pub name: String,
    /// Byte offset of the field in the input.
    pub offset: usize,
    /// Width in bytes, `1..=8`.
    pub width: usize,
}

impl Field {
    /// The field `name` of `width` bytes at `offset` (width clamped to `1..=8`).
    pub fn new(name: impl Into<String>, offset: usize, width: usize) -> Self {
        Field {
            name: name.into(),
            offset,
            width: width.clamp(1, 8),
        }
    }

    /// The same field `by` bytes further into the input (for a part inside a bundle).
    pub fn shifted(&self, by: usize) -> Self {
        Field {
            offset: self.offset.saturating_add(by),
            ..self.clone()
        }
    }

    /// One past the field's last byte.
    pub fn end(&self) -> usize {
        self.offset.saturating_add(self.width)
    }

    /// Mask of the field's width (`u64::MAX` for 8 bytes).
    pub fn mask(&self) -> u64 {
        width_mask(self.width)
    }

    /// Write the low `width` bytes of `value`, little-endian. Bytes beyond the end of `bytes`
    /// (a truncated input) are skipped; returns how many bytes were written.
    pub fn write(&self, bytes: &mut [u8], value: u64) -> usize {
        let le = value.to_le_bytes();
        let mut written = 0;
        for (i, &b) in le.iter().take(self.width).enumerate() {
            if let Some(slot) = self.offset.checked_add(i).and_then(|at| bytes.get_mut(at)) {
                *slot = b;
                written += 1;
            }
        }
        written
    }

    /// Read the field, `None` when it does not lie wholly inside `bytes`.
    pub fn read(&self, bytes: &[u8]) -> Option<u64> {
        let b = bytes.get(self.offset..self.end())?;
        let mut le = [0u8; 8];
        le[..b.len()].copy_from_slice(b);
        Some(u64::from_le_bytes(le))
    }
}

impl fmt::Display for Field {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}@{}/{}", self.name, self.offset, self.width)
    }
}

fn width_mask(width: usize) -> u64 {
    match width {
        0 => 0,
        w if w >= 8 => u64::MAX,
        w => (1u64 << (8 * w)) - 1,
    }
}

/// The values written into a field of `width` bytes (clamped to `1..=8`), each truncated to
/// the width, duplicates removed, in a fixed order:
///
/// 0, 1, 2, small powers of two and their neighbours, 2³¹ − 1, 2³¹, 2³² − 1, 2³², 2³² + 1,
/// 2⁴⁰, 2⁴⁸, 2⁵³, 2⁶² and its neighbours, 2⁶³ − 1 (`i64::MAX`), 2⁶³ (`i64::MIN`), −2³¹ and
/// −2³¹ − 1 sign-extended, −8, −2 (`MAX − 1`), −1 (`MAX`); plus the width's own signed
/// maximum and minimum. Negative values are the two's complement in the width.
pub fn extreme_values(width: usize) -> Vec<u64> {
    let width = width.clamp(1, 8);
    let mask = width_mask(width);
    let bits = 8 * width as u32;
    let signed_max = (1u64 << (bits - 1)) - 1;
    let candidates = [
        0u64,
        1,
        2,
        3,
        4,
        7,
        8,
        0x7F,
        0x80,
        0xFF,
        0x100,
        0x7FFF,
        0x8000,
        0xFFFF,
        0x1_0000,
        (1 << 31) - 1,
        1 << 31,
        (1 << 32) - 1,
        1 << 32,
        (1 << 32) + 1,
        1 << 40,
        1 << 48,
        1 << 53,
        (1 << 62) - 1,
        1 << 62,
        (1 << 62) + 1,
        i64::MAX as u64,
        1 << 63,
        i64::from(i32::MIN) as u64,
        (i64::from(i32::MIN) - 1) as u64,
        -8i64 as u64,
        signed_max,
        signed_max + 1,
        u64::MAX - 1,
        u64::MAX,
    ];
    let mut out: Vec<u64> = Vec::with_capacity(candidates.len());
    for v in candidates {
        let v = v & mask;
        if !out.contains(&v) {
            out.push(v);
        }
    }
    out
}

/// Values derived from the input's length `len` for a field of `width` bytes: a count or a
/// size that is exactly right, one off, or off by the width is where off-by-one checks fail.
pub fn length_values(len: usize, field: &Field) -> Vec<u64> {
    let l = len as u64;
    let w = field.width as u64;
    let mut out = Vec::new();
    for v in [
        l,
        l.wrapping_sub(1),
        l + 1,
        l / 2,
        l / 2 + 1,
        l / 4,
        l / 8,
        l / 8 + 1,
        l / w,
        l / w + 1,
        l.saturating_sub(field.end() as u64),
        l.saturating_sub(field.end() as u64) / 2,
        l.saturating_sub(field.end() as u64) / 4 + 1,
    ] {
        let v = v & field.mask();
        if !out.contains(&v) {
            out.push(v);
        }
    }
    out
}

/// The kinds of damage the [`Mutator`] does.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Mutation {
    /// Flip 1 to 8 random bits.
    FlipBits,
    /// Set a random byte to 0x00, 0x01, 0x7F, 0x80, 0xFE or 0xFF.
    InterestingByte,
    /// Overwrite a run of 1 to 16 bytes with random bytes.
    RandomBytes,
    /// Add or subtract a small number to a little-endian word (1, 2, 4 or 8 bytes) anywhere.
    Arithmetic,
    /// Write an extreme value ([`extreme_values`]) as a word at a random offset.
    ExtremeWord,
    /// Cut the input at a random length, half of the time inside the header (before the
    /// end of the last known field plus a few bytes).
    Truncate,
    /// Append 1 to 64 bytes of zeros, 0xFF, random bytes or a copy of the input's start.
    Extend,
    /// Copy a chunk of the input and insert it somewhere else.
    DuplicateChunk,
    /// Remove a chunk of the input.
    DeleteChunk,
    /// Write an extreme value ([`extreme_values`]) into a known [`Field`].
    ExtremeField,
    /// Write a value derived from the input length ([`length_values`]) into a known field.
    FieldFromLength,
    /// Add or subtract 1 to 16, double, or negate the value of a known field.
    FieldArithmetic,
}

impl Mutation {
    /// Every mutation, in declaration order.
    pub const ALL: [Mutation; 12] = [
        Mutation::FlipBits,
        Mutation::InterestingByte,
        Mutation::RandomBytes,
        Mutation::Arithmetic,
        Mutation::ExtremeWord,
        Mutation::Truncate,
        Mutation::Extend,
        Mutation::DuplicateChunk,
        Mutation::DeleteChunk,
        Mutation::ExtremeField,
        Mutation::FieldFromLength,
        Mutation::FieldArithmetic,
    ];

    /// True for the mutations that need at least one known field.
    pub fn needs_fields(self) -> bool {
        matches!(
            self,
            Mutation::ExtremeField | Mutation::FieldFromLength | Mutation::FieldArithmetic
        )
    }

    /// Relative weight when fields are known (header damage is where readers break, so it
    /// gets about 40 % of the draws).
    fn weight(self) -> u64 {
        match self {
            Mutation::FlipBits | Mutation::InterestingByte | Mutation::Truncate => 9,
            Mutation::RandomBytes | Mutation::Arithmetic | Mutation::ExtremeWord => 6,
            Mutation::Extend | Mutation::DuplicateChunk | Mutation::DeleteChunk => 5,
            Mutation::ExtremeField => 24,
            Mutation::FieldFromLength | Mutation::FieldArithmetic => 8,
        }
    }
}

/// What one mutated input is made of: the bytes and the steps that made them (shown when an
/// input fails, so it can be understood without a hex editor).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Mutated {
    /// The mutated input.
    pub bytes: Vec<u8>,
    /// One line per step applied, in order.
    pub steps: Vec<String>,
}

/// Applies stacked random mutations to a seed input. Stateless apart from its settings; the
/// randomness comes from the [`Rng`] passed in, so the same generator state gives the same
/// output.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Mutator {
    /// Most mutations stacked on one input (at least 1): half of the inputs get one, a
    /// quarter two, the rest up to this many.
    pub max_stack: usize,
    /// Bytes after the last known field that still count as "header" for truncation (and the
    /// header size assumed when no field is known).
    pub header_slack: usize,
}

impl Default for Mutator {
    fn default() -> Self {
        Mutator {
            max_stack: 4,
            header_slack: 16,
        }
    }
}

impl Mutator {
    /// A mutated copy of `seed`: 1 to `max_stack` random mutations, each chosen by weight
    /// among those that apply (field mutations only when `fields` is not empty).
    pub fn mutate(&self, seed: &[u8], fields: &[Field], rng: &mut Rng) -> Mutated {
        let stack = match rng.below(4) {
            0 | 1 => 1,
            2 => 2.min(self.max_stack.max(1)),
            _ => rng.range_inclusive(1, self.max_stack.max(1)),
        };
        let mut bytes = seed.to_vec();
        let mut steps = Vec::with_capacity(stack);
        for _ in 0..stack {
            let kind = self.choose(fields, rng);
            steps.push(self.apply(kind, &mut bytes, fields, rng));
        }
        Mutated { bytes, steps }
    }

    /// Draw a mutation kind by weight (field mutations only when `fields` is not empty).
    pub fn choose(&self, fields: &[Field], rng: &mut Rng) -> Mutation {
        let usable = |m: &Mutation| !m.needs_fields() || !fields.is_empty();
        let total: u64 = Mutation::ALL
            .iter()
            .filter(|m| usable(m))
            .map(|m| m.weight())
            .sum();
        let mut r = rng.below(total);
        for m in Mutation::ALL.iter().filter(|m| usable(m)) {
            if r < m.weight() {
                return *m;
            }
            r -= m.weight();
        }
        Mutation::FlipBits
    }

    /// Where the header ends for truncation: the end of the last field plus
    /// `header_slack`, or `header_slack` when no field is known.
    pub fn header_end(&self, fields: &[Field]) -> usize {
        fields
            .iter()
            .map(Field::end)
            .max()
            .unwrap_or(0)
            .saturating_add(self.header_slack)
    }

    /// Apply one mutation of `kind` to `bytes` in place; returns a one-line description. A
    /// mutation that cannot apply (a byte mutation of an empty input, a field mutation
    /// without fields) appends one random byte instead, so every step changes something.
    pub fn apply(
        &self,
        kind: Mutation,
        bytes: &mut Vec<u8>,
        fields: &[Field],
        rng: &mut Rng,
    ) -> String {
        let len = bytes.len();
        let needs_bytes = !matches!(
            kind,
            Mutation::Extend | Mutation::ExtremeField | Mutation::FieldFromLength
        );
        if (needs_bytes && len == 0) || (kind.needs_fields() && fields.is_empty()) {
            let b = rng.next_u64() as u8;
            bytes.push(b);
            return format!("append byte {b:#04x}");
        }
        match kind {
            Mutation::FlipBits => {
                let n = rng.range_inclusive(1, 8);
                let mut at = Vec::with_capacity(n);
                for _ in 0..n {
                    let bit = rng.index(len * 8);
                    bytes[bit / 8] ^= 1 << (bit % 8);
                    at.push(bit);
                }
                format!("flip bits {at:?}")
            }
            Mutation::InterestingByte => {
                let at = rng.index(len);
                let v = *rng
                    .pick(&[0x00u8, 0x01, 0x7F, 0x80, 0xFE, 0xFF])
                    .unwrap_or(&0);
                bytes[at] = v;
                format!("byte {at} = {v:#04x}")
            }
            Mutation::RandomBytes => {
                let at = rng.index(len);
                let n = rng.range_inclusive(1, 16).min(len - at);
                for b in &mut bytes[at..at + n] {
                    *b = rng.next_u64() as u8;
                }
                format!("random bytes {at}..{}", at + n)
            }
            Mutation::Arithmetic => {
                let width = *rng.pick(&[1usize, 2, 4, 8]).unwrap_or(&4);
                let field = Field::new("word", rng.index(len), width);
                let old = field.read(bytes).unwrap_or(0);
                let delta = rng.range_inclusive(1, 16) as u64;
                let new = if rng.chance(1, 2) {
                    old.wrapping_add(delta)
                } else {
                    old.wrapping_sub(delta)
                } & field.mask();
                field.write(bytes, new);
                format!("{field} {old:#x} -> {new:#x}")
            }
            Mutation::ExtremeWord => {
                let width = *rng.pick(&[1usize, 2, 4, 8]).unwrap_or(&4);
                let field = Field::new("word", rng.index(len), width);
                let values = extreme_values(width);
                let v = *rng.pick(&values).unwrap_or(&0);
                field.write(bytes, v);
                format!("{field} = {v:#x}")
            }
            Mutation::Truncate => {
                let header = self.header_end(fields).min(len);
                let to = if rng.chance(1, 2) {
                    rng.index(header + 1).min(len.saturating_sub(1))
                } else {
                    rng.index(len)
                };
                bytes.truncate(to);
                format!("truncate to {to} of {len}")
            }
            Mutation::Extend => {
                let n = rng.range_inclusive(1, 64);
                let how = rng.below(4);
                for i in 0..n {
                    let b = match how {
                        0 => 0,
                        1 => 0xFF,
                        2 => rng.next_u64() as u8,
                        _ => bytes.get(i % len.max(1)).copied().unwrap_or(0),
                    };
                    bytes.push(b);
                }
                let what = ["zeros", "0xff", "random bytes", "a copy of the start"][how as usize];
                format!("extend by {n} bytes of {what}")
            }
            Mutation::DuplicateChunk => {
                let (from, n) = self.chunk(len, rng);
                let to = rng.index(len + 1);
                let chunk = bytes[from..from + n].to_vec();
                bytes.splice(to..to, chunk);
                format!("duplicate {from}..{} at {to}", from + n)
            }
            Mutation::DeleteChunk => {
                let (from, n) = self.chunk(len, rng);
                bytes.drain(from..from + n);
                format!("delete {from}..{}", from + n)
            }
            Mutation::ExtremeField => {
                let field = rng
                    .pick(fields)
                    .cloned()
                    .unwrap_or_else(|| Field::new("?", 0, 4));
                let values = extreme_values(field.width);
                let v = *rng.pick(&values).unwrap_or(&0);
                field.write(bytes, v);
                format!("{field} = {v:#x}")
            }
            Mutation::FieldFromLength => {
                let field = rng
                    .pick(fields)
                    .cloned()
                    .unwrap_or_else(|| Field::new("?", 0, 4));
                let values = length_values(len, &field);
                let v = *rng.pick(&values).unwrap_or(&0);
                field.write(bytes, v);
                format!("{field} = {v:#x} (from length {len})")
            }
            Mutation::FieldArithmetic => {
                let field = rng
                    .pick(fields)
                    .cloned()
                    .unwrap_or_else(|| Field::new("?", 0, 4));
                let old = field.read(bytes).unwrap_or(0);
                let delta = rng.range_inclusive(1, 16) as u64;
                let new = match rng.below(4) {
                    0 => old.wrapping_add(delta),
                    1 => old.wrapping_sub(delta),
                    2 => old.wrapping_mul(2),
                    _ => old.wrapping_neg(),
                } & field.mask();
                field.write(bytes, new);
                format!("{field} {old:#x} -> {new:#x}")
            }
        }
    }

    /// A chunk `(start, length)` inside `len > 0` bytes: mostly short, sometimes up to half.
    fn chunk(&self, len: usize, rng: &mut Rng) -> (usize, usize) {
        let max = if rng.chance(1, 4) {
            (len / 2).max(1)
        } else {
            64.min(len)
        };
        let n = rng.range_inclusive(1, max);
        (rng.index(len - n + 1), n)
    }
}

/// Lengths the systematic inputs cut a seed of `len` bytes at, sorted: every length below 64
/// (and below the header end), every field's start, start + 1, end − 1, end and end + 1, the
/// header end ([`Mutator::header_end`]), half the seed and all but its last byte. Only lengths
/// shorter than the seed.
pub fn cut_points(len: usize, fields: &[Field], mutator: &Mutator) -> Vec<usize> {
    let header = mutator.header_end(fields);
    let mut cuts: Vec<usize> = (0..header.min(64)).collect();
    for f in fields {
        let (start, end) = (f.offset, f.end());
        cuts.extend([
            start,
            start.saturating_add(1),
            end - 1,
            end,
            end.saturating_add(1),
        ]);
    }
    cuts.extend([header, len / 2, len.saturating_sub(1)]);
    cuts.retain(|&c| c < len);
    cuts.sort_unstable();
    cuts.dedup();
    cuts
}

/// The systematic part of a campaign for one seed: the seed with each known field set to each
/// of its [`extreme_values`], then the seed cut at each of its [`cut_points`] (inside the
/// header, around every field, and a few points beyond).
pub fn systematic(seed: &[u8], fields: &[Field], mutator: &Mutator) -> Vec<Mutated> {
    let mut out = Vec::new();
    for field in fields {
        for v in extreme_values(field.width) {
            let mut bytes = seed.to_vec();
            field.write(&mut bytes, v);
            out.push(Mutated {
                bytes,
                steps: vec![format!("{field} = {v:#x}")],
            });
        }
    }
    for c in cut_points(seed.len(), fields, mutator) {
        out.push(Mutated {
            bytes: seed[..c].to_vec(),
            steps: vec![format!("truncate to {c} of {}", seed.len())],
        });
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    #[test]
    fn extreme_values_include_the_classic_ones() {
        let v8 = extreme_values(8);
        for want in [
            0,
            1,
            u64::MAX,
            u64::MAX - 1,
            1 << 31,
            1 << 32,
            1 << 40,
            1 << 62,
            1 << 63,
            i64::MAX as u64,
            i64::from(i32::MIN) as u64,
        ] {
            assert!(v8.contains(&want), "{want:#x} missing");
        }
        let v4 = extreme_values(4);
        assert!(v4.iter().all(|&v| v <= u64::from(u32::MAX)));
        for want in [0, 1, 0x7FFF_FFFF, 0x8000_0000, 0xFFFF_FFFF, 0xFFFF_FFFE] {
            assert!(v4.contains(&want), "{want:#x} missing");
        }
        assert_eq!(
            extreme_values(1),
            [0, 1, 2, 3, 4, 7, 8, 0x7F, 0x80, 0xFF, 0xF8, 0xFE]
        );
        let distinct: HashSet<_> = v8.iter().collect();
        assert_eq!(distinct.len(), v8.len());
        assert_eq!(extreme_values(0), extreme_values(1), "width clamps to 1");
    }

    #[test]
    fn fields_read_and_write_little_endian_and_clip_at_the_end() {
        let mut b = vec![0u8; 6];
        let f = Field::new("n", 2, 4);
        assert_eq!(f.write(&mut b, 0x0403_0201), 4);
        assert_eq!(b, [0, 0, 1, 2, 3, 4]);
        assert_eq!(f.read(&b), Some(0x0403_0201));
        let tail = Field::new("t", 4, 8);
        assert_eq!(tail.write(&mut b, u64::MAX), 2);
        assert_eq!(tail.read(&b), None);
        assert_eq!(Field::new("x", usize::MAX, 8).write(&mut b, 1), 0);
        assert_eq!(Field::new("w", 0, 99).width, 8);
        assert_eq!(f.shifted(10).offset, 12);
        assert_eq!(f.to_string(), "n@2/4");
    }

    /// Random mutation reaches every extreme value of every field.
    #[test]
    fn mutator_hits_every_extreme_field_value() {
        let seed = vec![0x55u8; 64];
        let fields = [Field::new("a", 8, 8), Field::new("b", 20, 4)];
        let mutator = Mutator {
            max_stack: 1,
            ..Default::default()
        };
        let mut seen: Vec<HashSet<u64>> = vec![HashSet::new(); fields.len()];
        for i in 0..20_000 {
            let mut rng = Rng::for_iteration(1, i);
            let m = mutator.mutate(&seed, &fields, &mut rng);
            if m.bytes.len() == seed.len() && m.steps[0].contains(" = ") {
                for (f, s) in fields.iter().zip(&mut seen) {
                    if let Some(v) = f.read(&m.bytes) {
                        s.insert(v);
                    }
                }
            }
        }
        for (f, s) in fields.iter().zip(&seen) {
            for v in extreme_values(f.width) {
                assert!(s.contains(&v), "{f} never got {v:#x}");
            }
        }
    }

    #[test]
    fn systematic_inputs_cover_every_field_value_and_header_cut() {
        let seed: Vec<u8> = (0..100).collect();
        let fields = [Field::new("count", 4, 4)];
        let m = Mutator::default();
        let inputs = systematic(&seed, &fields, &m);
        let values: HashSet<u64> = inputs
            .iter()
            .filter(|i| i.bytes.len() == seed.len())
            .filter_map(|i| fields[0].read(&i.bytes))
            .collect();
        assert_eq!(values.len(), extreme_values(4).len());
        let lengths: HashSet<usize> = inputs.iter().map(|i| i.bytes.len()).collect();
        for cut in 0..m.header_end(&fields) {
            assert!(lengths.contains(&cut), "no cut at {cut}");
        }
        assert!(lengths.contains(&50) && lengths.contains(&99));
    }

    #[test]
    fn cut_points_surround_far_fields_without_cutting_everywhere() {
        let fields = [Field::new("magic", 0, 4), Field::new("far", 1000, 8)];
        let m = Mutator::default();
        let cuts = cut_points(5000, &fields, &m);
        for want in [0, 1, 63, 1000, 1001, 1007, 1008, 1009, 1024, 2500, 4999] {
            assert!(cuts.contains(&want), "{want} missing");
        }
        assert!(!cuts.contains(&500));
        assert!(cuts.len() < 80, "{}", cuts.len());
        assert!(cuts.windows(2).all(|w| w[0] < w[1]));
        assert!(cut_points(3, &fields, &m).iter().all(|&c| c < 3));
        assert!(cut_points(0, &fields, &m).is_empty());
    }

    #[test]
    fn truncation_happens_inside_and_after_the_header() {
        let seed = vec![1u8; 300];
        let fields = [Field::new("n", 4, 4)];
        let m = Mutator::default();
        let (mut inside, mut after) = (0, 0);
        let mut rng = Rng::new(9);
        for _ in 0..2000 {
            let mut b = seed.clone();
            m.apply(Mutation::Truncate, &mut b, &fields, &mut rng);
            assert!(b.len() < seed.len());
            if b.len() < fields[0].end() {
                inside += 1;
            } else if b.len() > m.header_end(&fields) {
                after += 1;
            }
        }
        assert!(inside > 100 && after > 100, "{inside} {after}");
    }

    #[test]
    fn every_mutation_applies_to_any_input_without_panicking() {
        let fields = [Field::new("f", 0, 8), Field::new("far", 1000, 4)];
        let mut rng = Rng::new(5);
        for kind in Mutation::ALL {
            for len in [0usize, 1, 2, 7, 40] {
                for _ in 0..50 {
                    let mut b = vec![0xAB; len];
                    let step = Mutator::default().apply(kind, &mut b, &fields, &mut rng);
                    assert!(!step.is_empty());
                    let mut c = vec![0xAB; len];
                    Mutator::default().apply(kind, &mut c, &[], &mut rng);
                }
            }
        }
    }

    #[test]
    fn chunk_operations_change_the_length() {
        let seed: Vec<u8> = (0..=255).collect();
        let m = Mutator::default();
        let mut rng = Rng::new(2);
        let mut b = seed.clone();
        m.apply(Mutation::DuplicateChunk, &mut b, &[], &mut rng);
        assert!(b.len() > seed.len());
        let mut c = seed.clone();
        m.apply(Mutation::DeleteChunk, &mut c, &[], &mut rng);
        assert!(c.len() < seed.len());
        let mut d = seed.clone();
        m.apply(Mutation::Extend, &mut d, &[], &mut rng);
        assert!(d.len() > seed.len() && d.starts_with(&seed));
    }

    #[test]
    fn length_values_are_near_the_length() {
        let f = Field::new("n", 8, 4);
        let v = length_values(1000, &f);
        for want in [1000, 999, 1001, 250, 500, 988] {
            assert!(v.contains(&want), "{want} missing from {v:?}");
        }
    }
}
