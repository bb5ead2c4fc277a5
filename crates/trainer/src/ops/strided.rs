//! The one matrix view of this crate's CPU products: a slice and two strides. The f32 GEMM,
//! the widening GEMM and the bf16 GEMM take it for any element type; each reads the elements
//! as it needs them (f32 values, bf16 bits).

/// A `[rows, cols]` matrix in a slice: element `(r, c)` is `data[r·row_stride + c·col_stride]`,
/// so a transpose is the same slice with the strides swapped (nothing is copied). The shape is
/// not stored: a product states it, and checks it with [`Strided::covers`] before reading.
#[derive(Clone, Copy, Debug)]
pub struct Strided<'a, T> {
    /// The elements.
    pub data: &'a [T],
    /// Elements between consecutive rows.
    pub row_stride: usize,
    /// Elements between consecutive columns.
    pub col_stride: usize,
}

impl<'a, T: Copy> Strided<'a, T> {
    /// A dense row-major matrix with `cols` columns.
    pub fn rows(data: &'a [T], cols: usize) -> Self {
        Strided {
            data,
            row_stride: cols,
            col_stride: 1,
        }
    }

    /// The transpose of a dense row-major matrix with `cols` columns.
    pub fn transposed(data: &'a [T], cols: usize) -> Self {
        Strided {
            data,
            row_stride: 1,
            col_stride: cols,
        }
    }

    /// The same matrix, transposed.
    pub fn t(self) -> Self {
        Strided {
            data: self.data,
            row_stride: self.col_stride,
            col_stride: self.row_stride,
        }
    }

    /// The same matrix without its first `r` rows.
    pub fn skip_rows(self, r: usize) -> Self {
        Strided {
            data: &self.data[(r * self.row_stride).min(self.data.len())..],
            ..self
        }
    }

    /// The same matrix without its first `c` columns.
    pub fn skip_cols(self, c: usize) -> Self {
        Strided {
            data: &self.data[(c * self.col_stride).min(self.data.len())..],
            ..self
        }
    }

    /// Element `(r, c)`.
    #[inline]
    pub fn get(&self, r: usize, c: usize) -> T {
        self.data[r * self.row_stride + c * self.col_stride]
    }

    /// Whether a `[rows, cols]` matrix at these strides lies inside the slice (without
    /// overflow).
    pub fn covers(&self, rows: usize, cols: usize) -> bool {
        rows == 0
            || cols == 0
            || (rows - 1)
                .checked_mul(self.row_stride)
                .zip((cols - 1).checked_mul(self.col_stride))
                .and_then(|(r, c)| r.checked_add(c))
                .is_some_and(|last| last < self.data.len())
    }
}

#[cfg(test)]
mod tests {
    use super::Strided;

    #[test]
    fn transposes_and_skips_address_the_same_elements() {
        // [2, 3] row-major: 0 1 2 / 3 4 5.
        let data = [0, 1, 2, 3, 4, 5];
        let m = Strided::rows(&data, 3);
        let t = Strided::transposed(&data, 3); // [3, 2]
        for r in 0..2 {
            for c in 0..3 {
                assert_eq!(m.get(r, c), data[r * 3 + c]);
                assert_eq!(t.get(c, r), m.get(r, c));
                assert_eq!(m.t().get(c, r), m.get(r, c));
            }
        }
        assert_eq!(m.skip_rows(1).get(0, 2), 5);
        assert_eq!(m.skip_cols(1).get(1, 0), 4);
        let rows_of_two = Strided {
            data: &data[..],
            row_stride: 2,
            col_stride: 1,
        };
        assert_eq!(rows_of_two.get(2, 1), 5);
        assert!(m.covers(2, 3) && !m.covers(3, 3) && !m.covers(2, 4));
        assert!(m.covers(0, 99) && m.covers(99, 0));
        let huge = Strided {
            row_stride: usize::MAX,
            ..rows_of_two
        };
        assert!(!huge.covers(2, 1));
    }
}
