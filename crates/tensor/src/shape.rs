//! Tensor shapes: dense, row-major, no strides.
//!
//! Every headroom tensor is contiguous; layers that need a transposed view say so in their
//! kernels instead of carrying strides around. That keeps the byte size of a tensor a function
//! of its shape alone, which is what the memory accounting relies on.

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::{DType, Error, Result};

/// The dimensions of a dense row-major tensor. A rank-0 shape is a scalar with one element.
#[derive(Clone, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
pub struct Shape(Vec<usize>);

impl Shape {
    /// A shape from its dimensions, outermost first.
    pub fn new(dims: impl Into<Vec<usize>>) -> Self {
        Shape(dims.into())
    }

    /// The dimensions, outermost first.
    pub fn dims(&self) -> &[usize] {
        &self.0
    }

    /// The number of dimensions.
    pub fn rank(&self) -> usize {
        self.0.len()
    }

    /// Dimension `i`, or `None` when `i >= rank`.
    pub fn dim(&self, i: usize) -> Option<usize> {
        self.0.get(i).copied()
    }

    /// The number of elements, or `None` if it overflows `usize`.
    pub fn checked_numel(&self) -> Option<usize> {
        self.0.iter().try_fold(1usize, |acc, &d| acc.checked_mul(d))
    }

    /// The number of elements. Saturates at `usize::MAX` for shapes no allocation could hold;
    /// allocation paths use [`Shape::checked_bytes`] and report the overflow instead.
    pub fn numel(&self) -> usize {
        self.checked_numel().unwrap_or(usize::MAX)
    }

    /// Bytes needed for this shape at `dtype`, with overflow reported as an error.
    pub fn checked_bytes(&self, dtype: DType) -> Result<usize> {
        self.checked_numel()
            .and_then(|n| n.checked_mul(dtype.size_in_bytes()))
            .ok_or_else(|| Error::SizeOverflow {
                shape: self.clone(),
                dtype,
            })
    }

    /// `new` if it has the same element count as `self` (a reshape), else
    /// [`Error::InvalidShape`]. Backends implement `Tensor::reshape` with it.
    pub fn reshape_to(&self, new: Shape) -> Result<Shape> {
        if new.checked_numel() != Some(self.numel()) {
            return Err(Error::InvalidShape {
                op: "reshape",
                shape: new,
                reason: "element count differs from the tensor's",
            });
        }
        Ok(new)
    }

    /// Row-major strides in elements.
    pub fn strides(&self) -> Vec<usize> {
        let mut strides = vec![1usize; self.0.len()];
        for i in (0..self.0.len().saturating_sub(1)).rev() {
            strides[i] = strides[i + 1].saturating_mul(self.0[i + 1]);
        }
        strides
    }
}

impl fmt::Debug for Shape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{self}")
    }
}

impl fmt::Display for Shape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("[")?;
        for (i, d) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str(", ")?;
            }
            write!(f, "{d}")?;
        }
        f.write_str("]")
    }
}

impl From<Vec<usize>> for Shape {
    fn from(v: Vec<usize>) -> Self {
        Shape(v)
    }
}

impl From<&[usize]> for Shape {
    fn from(v: &[usize]) -> Self {
        Shape(v.to_vec())
    }
}

impl<const N: usize> From<[usize; N]> for Shape {
    fn from(v: [usize; N]) -> Self {
        Shape(v.to_vec())
    }
}

impl From<usize> for Shape {
    fn from(n: usize) -> Self {
        Shape(vec![n])
    }
}

impl From<&Shape> for Shape {
    fn from(s: &Shape) -> Self {
        s.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numel_strides_and_display() {
        let s = Shape::from([2, 3, 4]);
        assert_eq!(s.numel(), 24);
        assert_eq!(s.rank(), 3);
        assert_eq!(s.strides(), vec![12, 4, 1]);
        assert_eq!(s.to_string(), "[2, 3, 4]");
        assert_eq!(Shape::new(vec![]).numel(), 1);
        assert_eq!(s.checked_bytes(DType::BF16).unwrap(), 48);
    }

    #[test]
    fn overflow_is_an_error_not_a_wrap() {
        let s = Shape::from([usize::MAX / 2, 3]);
        assert_eq!(s.checked_numel(), None);
        assert!(matches!(
            s.checked_bytes(DType::F32),
            Err(Error::SizeOverflow { .. })
        ));
        let s = Shape::from([usize::MAX / 4 + 1]);
        assert!(s.checked_numel().is_some());
        assert!(s.checked_bytes(DType::F32).is_err());
    }
}
