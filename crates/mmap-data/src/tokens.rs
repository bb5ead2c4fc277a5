//! Token element types on disk and in batches, and the window copy kernel between them.

use headroom_tensor::Element;
use serde::{Deserialize, Serialize};

/// How token ids are stored in a file: element type and width, always little-endian.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum TokenType {
    /// Unsigned 8-bit (byte-level vocabularies).
    U8,
    /// Unsigned 16-bit: nanoGPT `.bin`, llm.c GPT-2 shards, Megatron `uint16`.
    U16,
    /// Unsigned 32-bit: llm.c Llama-3 shards, raw files with vocabularies above 65 536.
    U32,
    /// Signed 32-bit: Megatron `int32`.
    I32,
    /// Signed 64-bit: Megatron `int64`.
    I64,
}

impl TokenType {
    /// Bytes per token.
    pub const fn width(self) -> usize {
        match self {
            TokenType::U8 => 1,
            TokenType::U16 => 2,
            TokenType::U32 | TokenType::I32 => 4,
            TokenType::I64 => 8,
        }
    }

    /// Short lowercase name (`"u16"`).
    pub const fn name(self) -> &'static str {
        match self {
            TokenType::U8 => "u8",
            TokenType::U16 => "u16",
            TokenType::U32 => "u32",
            TokenType::I32 => "i32",
            TokenType::I64 => "i64",
        }
    }

    /// Largest token id this type can store (token ids are never negative and never exceed
    /// `u32::MAX`, whatever the storage type).
    pub const fn max_token(self) -> u64 {
        match self {
            TokenType::U8 => u8::MAX as u64,
            TokenType::U16 => u16::MAX as u64,
            TokenType::I32 => i32::MAX as u64,
            TokenType::U32 | TokenType::I64 => u32::MAX as u64,
        }
    }

    /// Append `token` to `out` in this encoding; `Err` if it does not fit.
    pub(crate) fn encode(self, token: u32, out: &mut Vec<u8>) -> Result<(), u64> {
        let t = u64::from(token);
        if t > self.max_token() {
            return Err(t);
        }
        match self {
            TokenType::U8 => out.push(token as u8),
            TokenType::U16 => out.extend_from_slice(&(token as u16).to_le_bytes()),
            TokenType::U32 => out.extend_from_slice(&token.to_le_bytes()),
            TokenType::I32 => out.extend_from_slice(&(token as i32).to_le_bytes()),
            TokenType::I64 => out.extend_from_slice(&i64::from(token).to_le_bytes()),
        }
        Ok(())
    }
}

impl std::str::FromStr for TokenType {
    type Err = crate::DataError;

    /// Parse a lowercase name as [`TokenType::name`] prints it (`"u16"`, …).
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        [
            TokenType::U8,
            TokenType::U16,
            TokenType::U32,
            TokenType::I32,
            TokenType::I64,
        ]
        .into_iter()
        .find(|t| t.name() == s)
        .ok_or_else(|| {
            crate::DataError::InvalidConfig(format!(
                "unknown token type {s:?} (expected u8, u16, u32, i32 or i64)"
            ))
        })
    }
}

impl std::fmt::Display for TokenType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// The two element types a batch can be produced in: `u32` (compact, for our own kernels) and
/// `i64` (what PyTorch's embedding and cross-entropy expect).
pub trait OutputToken: Element + Default {
    /// Which output type this is.
    const OUTPUT: OutputType;
    /// Convert a token id already checked to be `< 2^32`.
    fn from_token(token: u64) -> Self;
    /// Back to a token id (for tests and tools).
    fn to_token(self) -> u64;
}

impl OutputToken for u32 {
    const OUTPUT: OutputType = OutputType::U32;
    #[inline(always)]
    fn from_token(token: u64) -> Self {
        token as u32
    }
    fn to_token(self) -> u64 {
        u64::from(self)
    }
}

impl OutputToken for i64 {
    const OUTPUT: OutputType = OutputType::I64;
    #[inline(always)]
    fn from_token(token: u64) -> Self {
        token as i64
    }
    fn to_token(self) -> u64 {
        self as u64
    }
}

/// Element type of the inputs and targets a loader hands out.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum OutputType {
    /// `u32` token ids.
    U32,
    /// `i64` token ids.
    I64,
}

impl OutputType {
    /// Bytes per element.
    pub const fn width(self) -> usize {
        match self {
            OutputType::U32 => 4,
            OutputType::I64 => 8,
        }
    }

    /// The matching tensor dtype.
    pub const fn dtype(self) -> headroom_tensor::DType {
        match self {
            OutputType::U32 => headroom_tensor::DType::U32,
            OutputType::I64 => headroom_tensor::DType::I64,
        }
    }
}

/// A run of little-endian tokens viewed in place (a memory map or an owned buffer).
///
/// Holds bytes, not `&[u16]`: a view never needs its start aligned, so any offset a file format
/// allows can be read without copying.
#[derive(Clone, Copy, Debug)]
pub struct TokenSlice<'a> {
    bytes: &'a [u8],
    token_type: TokenType,
}

impl<'a> TokenSlice<'a> {
    /// View `bytes` as tokens; `None` when the length is not a multiple of the token width.
    pub fn new(bytes: &'a [u8], token_type: TokenType) -> Option<Self> {
        bytes
            .len()
            .is_multiple_of(token_type.width())
            .then_some(TokenSlice { bytes, token_type })
    }

    /// View the whole tokens in `bytes`, ignoring a trailing partial token.
    pub(crate) fn truncating(bytes: &'a [u8], token_type: TokenType) -> Self {
        let whole = bytes.len() - bytes.len() % token_type.width();
        TokenSlice {
            bytes: bytes.get(..whole).unwrap_or(&[]),
            token_type,
        }
    }

    /// Number of tokens.
    pub fn len(&self) -> usize {
        self.bytes.len() / self.token_type.width()
    }

    /// True when there are no tokens.
    pub fn is_empty(&self) -> bool {
        self.bytes.is_empty()
    }

    /// The storage type.
    pub fn token_type(&self) -> TokenType {
        self.token_type
    }

    /// The raw little-endian bytes.
    pub fn as_bytes(&self) -> &'a [u8] {
        self.bytes
    }

    /// Token `index` as stored (signed types may be negative); `None` past the end.
    pub fn get(&self, index: usize) -> Option<i64> {
        let w = self.token_type.width();
        let at = index.checked_mul(w)?;
        let b = self.bytes.get(at..at.checked_add(w)?)?;
        Some(decode_one(b, self.token_type))
    }

    /// The tokens `start..start + len`; `None` if that is not inside this slice.
    pub fn sub(&self, start: usize, len: usize) -> Option<TokenSlice<'a>> {
        let w = self.token_type.width();
        let from = start.checked_mul(w)?;
        let to = start.checked_add(len)?.checked_mul(w)?;
        Some(TokenSlice {
            bytes: self.bytes.get(from..to)?,
            token_type: self.token_type,
        })
    }

    /// Decode the first `out.len()` tokens into `out`, checking each is `< vocab_size`.
    ///
    /// Returns the index and stored value of the first token outside the vocabulary (then `out`
    /// holds unspecified values), or `Err((0, -1))` with `out` untouched if the slice is shorter
    /// than `out`. The check is a running maximum inside the copy loop, so the fast path pays
    /// one compare per token; the offending token is located only on failure.
    pub fn decode_into<O: OutputToken>(
        &self,
        out: &mut [O],
        vocab_size: u64,
    ) -> Result<(), (usize, i64)> {
        let w = self.token_type.width();
        let Some(src) = out.len().checked_mul(w).and_then(|n| self.bytes.get(..n)) else {
            return Err((0, -1));
        };
        // Negative stored values wrap to huge u64s, so one unsigned maximum catches them too.
        let max = match self.token_type {
            TokenType::U8 => widen(src, out),
            TokenType::U16 => match native_words::<u16>(src) {
                Some(words) => widen(words, out),
                None => copy_loop(src, out, |c: &[u8; 2]| u64::from(u16::from_le_bytes(*c))),
            },
            TokenType::U32 => match native_words::<u32>(src) {
                Some(words) => widen(words, out),
                None => copy_loop(src, out, |c: &[u8; 4]| u64::from(u32::from_le_bytes(*c))),
            },
            TokenType::I32 => copy_loop(src, out, |c: &[u8; 4]| {
                i64::from(i32::from_le_bytes(*c)) as u64
            }),
            TokenType::I64 => copy_loop(src, out, |c: &[u8; 8]| i64::from_le_bytes(*c) as u64),
        };
        if max < vocab_size {
            return Ok(());
        }
        for i in 0..out.len() {
            if let Some(v) = self.get(i) {
                if v < 0 || v as u64 >= vocab_size {
                    return Err((i, v));
                }
            }
        }
        Err((0, -1))
    }

    /// Index and value of the first token `>= vocab_size` (or negative), if any.
    pub fn find_out_of_range(&self, vocab_size: u64) -> Option<(usize, i64)> {
        const CHUNK: usize = 1 << 14;
        let mut scratch = vec![0u32; CHUNK];
        let mut start = 0;
        while start < self.len() {
            let n = CHUNK.min(self.len() - start);
            let sub = self.sub(start, n)?;
            if let Err((i, v)) = sub.decode_into(&mut scratch[..n], vocab_size) {
                return Some((start + i, v));
            }
            start += n;
        }
        None
    }
}

/// `bytes` as native words when they are aligned and the host is little-endian (then native
/// equals the file's byte order); `None` sends the caller to the byte-by-byte path.
#[inline(always)]
fn native_words<W: bytemuck::Pod>(bytes: &[u8]) -> Option<&[W]> {
    if cfg!(target_endian = "little") {
        bytemuck::try_cast_slice(bytes).ok()
    } else {
        None
    }
}

/// The fast path: a plain widening loop with the maximum kept in the narrow type, which the
/// compiler turns into packed zero-extends and packed unsigned maxima.
#[inline(always)]
fn widen<S: Copy + Ord + Default + Into<u64>, O: OutputToken>(src: &[S], out: &mut [O]) -> u64 {
    let mut max = S::default();
    for (o, &v) in out.iter_mut().zip(src) {
        max = max.max(v);
        *o = O::from_token(v.into());
    }
    max.into()
}

#[inline(always)]
fn copy_loop<const W: usize, O: OutputToken>(
    src: &[u8],
    out: &mut [O],
    decode: impl Fn(&[u8; W]) -> u64,
) -> u64 {
    let mut max = 0u64;
    for (o, c) in out.iter_mut().zip(src.chunks_exact(W)) {
        // chunks_exact yields exactly W bytes, so the conversion cannot fail.
        let arr: &[u8; W] = match c.try_into() {
            Ok(a) => a,
            Err(_) => continue,
        };
        let v = decode(arr);
        max = max.max(v);
        *o = O::from_token(v);
    }
    max
}

fn decode_one(b: &[u8], t: TokenType) -> i64 {
    let mut buf = [0u8; 8];
    let n = b.len().min(8);
    buf[..n].copy_from_slice(&b[..n]);
    match t {
        TokenType::U8 => i64::from(buf[0]),
        TokenType::U16 => i64::from(u16::from_le_bytes([buf[0], buf[1]])),
        TokenType::U32 => i64::from(u32::from_le_bytes([buf[0], buf[1], buf[2], buf[3]])),
        TokenType::I32 => i64::from(i32::from_le_bytes([buf[0], buf[1], buf[2], buf[3]])),
        TokenType::I64 => i64::from_le_bytes(buf),
    }
}

/// Encode `tokens` as `token_type`, or report the first that does not fit.
pub(crate) fn encode_tokens(tokens: &[u32], token_type: TokenType) -> crate::Result<Vec<u8>> {
    let mut out = Vec::with_capacity(tokens.len() * token_type.width());
    for (index, &t) in tokens.iter().enumerate() {
        token_type
            .encode(t, &mut out)
            .map_err(|value| crate::DataError::TokenTooWide {
                index,
                value,
                width: token_type.name(),
            })?;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn any_type() -> impl Strategy<Value = TokenType> {
        prop_oneof![
            Just(TokenType::U8),
            Just(TokenType::U16),
            Just(TokenType::U32),
            Just(TokenType::I32),
            Just(TokenType::I64),
        ]
    }

    proptest! {
        // Both decode paths (aligned native words and unaligned bytes) against `get`.
        #[test]
        fn decode_matches_scalar_reference_at_any_alignment(
            t in any_type(),
            raw in prop::collection::vec(any::<u32>(), 1..100),
            shift in 0usize..8,
            vocab in 1u64..=(1u64 << 32),
        ) {
            let tokens: Vec<u32> = raw.iter().map(|&v| (u64::from(v) % (t.max_token() + 1)) as u32).collect();
            let mut bytes = vec![0u8; shift];
            bytes.extend(encode_tokens(&tokens, t).unwrap());
            let s = TokenSlice::new(&bytes[shift..], t).unwrap();
            let want_err = tokens.iter().position(|&v| u64::from(v) >= vocab);
            let mut out32 = vec![0u32; tokens.len()];
            let mut out64 = vec![0i64; tokens.len()];
            let r32 = s.decode_into(&mut out32, vocab);
            let r64 = s.decode_into(&mut out64, vocab);
            match want_err {
                None => {
                    prop_assert!(r32.is_ok() && r64.is_ok());
                    for (i, &v) in tokens.iter().enumerate() {
                        prop_assert_eq!(s.get(i), Some(i64::from(v)));
                        prop_assert_eq!(out32[i], v);
                        prop_assert_eq!(out64[i], i64::from(v));
                    }
                }
                Some(i) => {
                    prop_assert_eq!(r32, Err((i, i64::from(tokens[i]))));
                    prop_assert_eq!(r64, Err((i, i64::from(tokens[i]))));
                }
            }
        }
    }

    #[test]
    fn decode_matches_get_and_flags_out_of_range() {
        let bytes = encode_tokens(&[1, 7, 300, 2], TokenType::U16).unwrap();
        let s = TokenSlice::new(&bytes, TokenType::U16).unwrap();
        let mut out = [0i64; 4];
        s.decode_into(&mut out, 301).unwrap();
        assert_eq!(out, [1, 7, 300, 2]);
        assert_eq!(s.decode_into(&mut out, 300), Err((2, 300)));
        assert_eq!(s.find_out_of_range(100), Some((2, 300)));
        let mut long = [0u32; 5];
        assert_eq!(s.decode_into(&mut long, 1000), Err((0, -1)));
        let neg = (-5i32).to_le_bytes();
        let n = TokenSlice::new(&neg, TokenType::I32).unwrap();
        assert_eq!(n.decode_into(&mut [0u32; 1], 1000), Err((0, -5)));
        assert!(TokenSlice::new(&[0u8; 3], TokenType::U16).is_none());
    }
}
