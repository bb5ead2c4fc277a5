//! Element types: the [`DType`] tag and the [`Element`] trait that ties it to a Rust type.

use std::fmt;

use half::{bf16, f16};
use serde::{Deserialize, Serialize};

/// The element type of a tensor.
///
/// Floating types are what training computes in; the integer types carry token ids, indices and
/// quantised state.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum DType {
    /// IEEE 754 binary32.
    F32,
    /// IEEE 754 binary16 (`half::f16`).
    F16,
    /// bfloat16: the top half of an f32 (`half::bf16`).
    BF16,
    /// Unsigned 8-bit integer.
    U8,
    /// Unsigned 16-bit integer (nanoGPT token files).
    U16,
    /// Unsigned 32-bit integer.
    U32,
    /// Signed 32-bit integer.
    I32,
    /// Signed 64-bit integer.
    I64,
}

impl DType {
    /// Every dtype, in declaration order.
    pub const ALL: [DType; 8] = [
        DType::F32,
        DType::F16,
        DType::BF16,
        DType::U8,
        DType::U16,
        DType::U32,
        DType::I32,
        DType::I64,
    ];

    /// Bytes per element.
    pub const fn size_in_bytes(self) -> usize {
        match self {
            DType::U8 => 1,
            DType::F16 | DType::BF16 | DType::U16 => 2,
            DType::F32 | DType::U32 | DType::I32 => 4,
            DType::I64 => 8,
        }
    }

    /// True for f32, f16 and bf16.
    pub const fn is_float(self) -> bool {
        matches!(self, DType::F32 | DType::F16 | DType::BF16)
    }

    /// The short lowercase name used in file formats and reports (`"f32"`, `"bf16"`, …).
    pub const fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
            DType::U8 => "u8",
            DType::U16 => "u16",
            DType::U32 => "u32",
            DType::I32 => "i32",
            DType::I64 => "i64",
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A Rust type that can be an element of a tensor.
///
/// `Pod` makes host buffers safely reinterpretable as bytes, which is how uploads, downloads
/// and file formats move data without per-element work.
pub trait Element: bytemuck::Pod + Send + Sync + fmt::Debug + 'static {
    /// The dtype tag for this type.
    const DTYPE: DType;
}

macro_rules! impl_element {
    ($($t:ty => $d:ident),* $(,)?) => {
        $(impl Element for $t { const DTYPE: DType = DType::$d; })*
    };
}

impl_element!(
    f32 => F32,
    f16 => F16,
    bf16 => BF16,
    u8 => U8,
    u16 => U16,
    u32 => U32,
    i32 => I32,
    i64 => I64,
);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_match_rust_types() {
        assert_eq!(DType::F32.size_in_bytes(), std::mem::size_of::<f32>());
        assert_eq!(DType::F16.size_in_bytes(), std::mem::size_of::<f16>());
        assert_eq!(DType::BF16.size_in_bytes(), std::mem::size_of::<bf16>());
        assert_eq!(DType::U8.size_in_bytes(), 1);
        assert_eq!(DType::U16.size_in_bytes(), 2);
        assert_eq!(DType::U32.size_in_bytes(), 4);
        assert_eq!(DType::I32.size_in_bytes(), 4);
        assert_eq!(DType::I64.size_in_bytes(), 8);
        let floats: Vec<_> = DType::ALL.iter().filter(|d| d.is_float()).collect();
        assert_eq!(floats, [&DType::F32, &DType::F16, &DType::BF16]);
    }
}
