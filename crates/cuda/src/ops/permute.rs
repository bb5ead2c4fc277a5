//! Attention heads between a linear layer's rows and flash attention's per-head layout, one
//! kernel launch per move (`headroom_kernels::PERMUTE_HEADS`):
//! `[B, T, parts·NH·hs]` (heads side by side in each row; `parts` = 3 for a fused qkv
//! projection, 1 otherwise) ⇄ one part as `[B, NH, T, hs]`.
//!
//! The kernels move opaque units, so any dtype works and the result is the input's bytes,
//! permuted (bitwise by construction). The unit is the widest of 16, 8, 4, 2 or 1 bytes that
//! divides a head row (`hs` elements); every head row starts at a multiple of its size in both
//! layouts, and every device allocation is aligned to 256 bytes, so each unit access is aligned.

use headroom_kernels::PERMUTE_HEADS_UNITS;
use headroom_tensor::{Error, Result, Tensor};

use super::OpLaunch;
use crate::device::Cuda;
use crate::tensor::CudaTensor;

/// Where one part's attention heads live: the wide tensor is `[batch, seq, parts·heads·head_dim]`
/// with part `p`'s head `h` at elements `(p·heads + h)·head_dim ..` of each row; the heads
/// tensor is `[batch, heads, seq, head_dim]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct HeadLayout {
    /// Sequences, B.
    pub batch: usize,
    /// Positions per sequence, T.
    pub seq: usize,
    /// Heads per part, NH.
    pub heads: usize,
    /// Elements per head, hs.
    pub head_dim: usize,
    /// Parts side by side in each wide row (3 for q, k, v of a fused projection; else 1).
    pub parts: usize,
    /// Which part moves (`< parts`).
    pub part: usize,
}

impl HeadLayout {
    /// One part (`parts = 1`, `part = 0`): a `[B, T, NH·hs]` tensor.
    pub fn single(batch: usize, seq: usize, heads: usize, head_dim: usize) -> HeadLayout {
        HeadLayout {
            batch,
            seq,
            heads,
            head_dim,
            parts: 1,
            part: 0,
        }
    }

    /// Part `part` of `parts` (e.g. 0, 1, 2 for q, k, v of a fused qkv projection).
    pub fn part_of(self, parts: usize, part: usize) -> HeadLayout {
        HeadLayout {
            parts,
            part,
            ..self
        }
    }

    /// Elements of the heads tensor `[B, NH, T, hs]`; `None` on overflow.
    pub fn heads_numel(&self) -> Option<usize> {
        self.batch
            .checked_mul(self.heads)?
            .checked_mul(self.seq)?
            .checked_mul(self.head_dim)
    }

    /// Elements of the wide tensor `[B, T, parts·NH·hs]`; `None` on overflow.
    pub fn wide_numel(&self) -> Option<usize> {
        self.heads_numel()?.checked_mul(self.parts)
    }
}

/// The direction of a move, as the kernels' `merge` flag.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Direction {
    /// Wide → heads.
    Split = 0,
    /// Heads → the part's slice of the wide rows.
    Merge = 1,
}

/// A checked launch: the entry point, its unit and every kernel argument.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct PermutePlan {
    pub function: &'static str,
    pub unit_bytes: usize,
    pub batch: u32,
    pub seq: u32,
    pub heads: u32,
    pub head_units: u32,
    pub parts: u32,
    pub part: u32,
    /// `batch·heads·seq` head rows (each `head_units` units).
    pub rows: usize,
}

impl PermutePlan {
    /// Threads per head row: the smallest power of two ≥ `head_units`, or the largest power of
    /// two ≤ `block` if that is smaller (the kernel computes the same from its `blockDim.x`).
    pub fn lanes(&self, block: u32) -> u32 {
        let mut lanes = 1u32;
        while lanes < self.head_units && lanes.saturating_mul(2) <= block {
            lanes <<= 1;
        }
        lanes
    }
}

const TOO_LARGE: &str =
    "B·NH·T head rows or a head row's units exceed the kernel's 32-bit row arithmetic";

fn invalid(op: &'static str, t: &impl Tensor, reason: &'static str) -> Error {
    Error::InvalidShape {
        op,
        shape: t.shape().clone(),
        reason,
    }
}

/// Every check of a move between `wide` and `heads` (same dtype, the layout's element counts,
/// `part < parts`, 32-bit limits) and the launch it makes; generic over [`Tensor`] so it is
/// tested on CPU tensors.
pub(crate) fn plan_permute(
    op: &'static str,
    wide: &impl Tensor,
    heads: &impl Tensor,
    layout: HeadLayout,
) -> Result<PermutePlan> {
    if heads.dtype() != wide.dtype() {
        return Err(Error::DTypeMismatch {
            op,
            expected: wide.dtype(),
            got: heads.dtype(),
        });
    }
    if layout.part >= layout.parts {
        return Err(invalid(
            op,
            wide,
            "the part must be below the number of parts",
        ));
    }
    let (Some(heads_n), Some(wide_n)) = (layout.heads_numel(), layout.wide_numel()) else {
        return Err(invalid(op, wide, "the layout's element count overflows"));
    };
    Error::check_len(op, wide_n, wide.numel())?;
    Error::check_len(op, heads_n, heads.numel())?;
    let u32_of = |v: usize| u32::try_from(v).map_err(|_| invalid(op, wide, TOO_LARGE));
    let rows = layout.batch * layout.heads * layout.seq; // ≤ heads_n, so no overflow
    u32_of(rows)?;
    // The element count did not overflow, so neither does a head row's byte count.
    let row_bytes = layout.head_dim * wide.dtype().size_in_bytes();
    let (unit_bytes, function) = PERMUTE_HEADS_UNITS
        .iter()
        .copied()
        .find(|(bytes, _)| row_bytes.is_multiple_of(*bytes))
        .ok_or_else(|| invalid(op, wide, "no unit divides a head row"))?;
    Ok(PermutePlan {
        function,
        unit_bytes,
        batch: u32_of(layout.batch)?,
        seq: u32_of(layout.seq)?,
        heads: u32_of(layout.heads)?,
        head_units: u32_of(row_bytes / unit_bytes)?,
        parts: u32_of(layout.parts)?,
        part: u32_of(layout.part)?,
        rows,
    })
}

impl Cuda {
    /// Copy `count` elements from element `src_offset` of `src` to element `dst_offset` of
    /// `dst` (same dtype; a copy-engine command on the stream): the rows of a chunk in and out
    /// of a whole tensor. Both ranges are checked first; nothing is copied on an error.
    pub fn copy_elements(
        &self,
        src: &CudaTensor,
        src_offset: usize,
        dst: &mut CudaTensor,
        dst_offset: usize,
        count: usize,
    ) -> Result<()> {
        const OP: &str = "copy_elements";
        self.check_devices(OP, &[src, dst])?;
        super::expect_dtype(OP, dst, src.dtype())?;
        for (t, offset) in [(src, src_offset), (&*dst, dst_offset)] {
            if offset.checked_add(count).is_none_or(|end| end > t.numel()) {
                return Err(Error::InvalidShape {
                    op: OP,
                    shape: t.shape().clone(),
                    reason: "the range reaches past the end of the tensor",
                });
            }
        }
        if count == 0 {
            return Ok(());
        }
        let size = src.dtype().size_in_bytes();
        let (s0, d0, bytes) = (src_offset * size, dst_offset * size, count * size);
        let src_b = self.buffer(OP, src)?;
        let dst_b = self.buffer_mut(OP, dst)?;
        self.stream()
            .memcpy_dtod(
                &src_b.slice(s0..s0 + bytes),
                &mut dst_b.slice_mut(d0..d0 + bytes),
            )
            .map_err(self.driver_fail(OP))
    }

    /// Split part `layout.part` of the wide `[B, T, parts·NH·hs]` tensor `wide` into `heads`
    /// `[B, NH, T, hs]`: `heads[b, h, t, d] = wide[b, t, (part·NH + h)·hs + d]`. Any dtype (the
    /// same for both); element counts must be the layout's. One kernel launch, bitwise.
    pub fn split_heads(
        &self,
        heads: &mut CudaTensor,
        wide: &CudaTensor,
        layout: HeadLayout,
    ) -> Result<()> {
        const OP: &str = "split_heads";
        self.check_devices(OP, &[heads, wide])?;
        let plan = plan_permute(OP, wide, heads, layout)?;
        self.launch_permute(OP, heads, wide, plan, Direction::Split)
    }

    /// Merge `heads` `[B, NH, T, hs]` into part `layout.part` of the wide `[B, T,
    /// parts·NH·hs]` tensor `wide`, the inverse of [`Cuda::split_heads`]. Only that part of each
    /// wide row is written, so the parts of one tensor can be merged one after another.
    pub fn merge_heads(
        &self,
        wide: &mut CudaTensor,
        heads: &CudaTensor,
        layout: HeadLayout,
    ) -> Result<()> {
        const OP: &str = "merge_heads";
        self.check_devices(OP, &[wide, heads])?;
        let plan = plan_permute(OP, wide, heads, layout)?;
        self.launch_permute(OP, wide, heads, plan, Direction::Merge)
    }

    fn launch_permute(
        &self,
        op: &'static str,
        dst: &mut CudaTensor,
        src: &CudaTensor,
        plan: PermutePlan,
        direction: Direction,
    ) -> Result<()> {
        if plan.rows == 0 || plan.head_units == 0 {
            return Ok(());
        }
        let func = self.op_function(op, plan.function)?;
        let lanes = plan.lanes(headroom_kernels::BLOCK_THREADS);
        // Blocks for one thread per lane of every row; the kernel's row loop strides past the cap.
        let cfg = self.elementwise_config(plan.rows.saturating_mul(lanes as usize));
        let merge = direction as u32;
        let src_b = self.buffer(op, src)?;
        let dst_b = self.buffer_mut(op, dst)?;
        let mut launch = OpLaunch::new(self, plan.function, &func);
        launch
            .output(dst_b)
            .input(src_b)
            .u32(&plan.batch)
            .u32(&plan.seq)
            .u32(&plan.heads)
            .u32(&plan.head_units)
            .u32(&plan.parts)
            .u32(&plan.part)
            .u32(&merge);
        // SAFETY: both tensors hold the layout's element counts of one dtype (checked by
        // plan_permute), so every unit the kernel touches (rows·head_units in the heads tensor,
        // parts·rows·head_units in the wide one) lies inside them; the unit divides a head row
        // and allocations are 256-byte aligned, so every access is aligned; `dst` is borrowed
        // mutably and so is a different allocation than `src`.
        unsafe { launch.launch(self, op, cfg) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use headroom_tensor::{Backend, Cpu, DType, Device, Shape};
    use proptest::prelude::*;

    fn layout(b: usize, t: usize, nh: usize, hs: usize, parts: usize, part: usize) -> HeadLayout {
        HeadLayout::single(b, t, nh, hs).part_of(parts, part)
    }

    #[test]
    fn gpt2_bf16_heads_move_as_16_byte_units() {
        let cpu = Cpu::new();
        let l = layout(2, 5, 12, 64, 3, 1);
        let wide = cpu.zeros([2, 5, 3 * 768], DType::BF16).unwrap();
        let heads = cpu.zeros([2, 12, 5, 64], DType::BF16).unwrap();
        let p = plan_permute("op", &wide, &heads, l).unwrap();
        assert_eq!(
            (p.function, p.unit_bytes, p.head_units),
            ("permute_heads_b16", 16, 8)
        );
        assert_eq!((p.batch, p.seq, p.heads, p.parts, p.part), (2, 5, 12, 3, 1));
        assert_eq!(p.rows, 2 * 12 * 5);
        assert_eq!(p.lanes(256), 8);
        // hs = 128: 16 units of 16 bytes.
        let l = layout(1, 3, 2, 128, 1, 0);
        let wide = cpu.zeros([3, 256], DType::BF16).unwrap();
        let heads = cpu.zeros([6, 128], DType::BF16).unwrap();
        let p = plan_permute("op", &wide, &heads, l).unwrap();
        assert_eq!((p.unit_bytes, p.head_units, p.lanes(256)), (16, 16, 16));
    }

    #[test]
    fn bad_layouts_and_tensors_are_typed_errors() {
        let cpu = Cpu::new();
        let wide = cpu.zeros([2, 3, 12], DType::BF16).unwrap();
        let heads = cpu.zeros([2, 2, 3, 2], DType::BF16).unwrap();
        let ok = layout(2, 3, 2, 2, 3, 2);
        assert!(plan_permute("op", &wide, &heads, ok).is_ok());
        // part out of range, and no parts at all.
        for bad in [ok.part_of(3, 3), ok.part_of(0, 0)] {
            assert!(matches!(
                plan_permute("op", &wide, &heads, bad),
                Err(Error::InvalidShape { .. })
            ));
        }
        // Element counts that are not the layout's (wide, then heads).
        let short = cpu.zeros([2, 3, 11], DType::BF16).unwrap();
        assert!(matches!(
            plan_permute("op", &short, &heads, ok),
            Err(Error::LengthMismatch {
                expected: 72,
                got: 66,
                ..
            })
        ));
        assert!(matches!(
            plan_permute("op", &wide, &wide, ok),
            Err(Error::LengthMismatch {
                expected: 24,
                got: 72,
                ..
            })
        ));
        // Mixed dtypes.
        let heads32 = cpu.zeros([2, 2, 3, 2], DType::F32).unwrap();
        assert!(matches!(
            plan_permute("op", &wide, &heads32, ok),
            Err(Error::DTypeMismatch {
                expected: DType::BF16,
                got: DType::F32,
                ..
            })
        ));
        // Overflowing layouts.
        let huge = layout(usize::MAX, 2, 1, 1, 1, 0);
        assert!(matches!(
            plan_permute("op", &wide, &heads, huge),
            Err(Error::InvalidShape { .. })
        ));
        assert!(matches!(
            plan_permute("op", &wide, &heads, ok.part_of(usize::MAX, 0)),
            Err(Error::InvalidShape { .. })
        ));
    }

    /// Shape and dtype only: a tensor too large to allocate, for the size limits.
    struct Meta(Shape, DType);

    impl Tensor for Meta {
        fn shape(&self) -> &Shape {
            &self.0
        }
        fn dtype(&self) -> DType {
            self.1
        }
        fn device(&self) -> Device {
            Device::Cpu
        }
        fn reshape(&mut self, shape: Shape) -> Result<()> {
            self.0 = shape;
            Ok(())
        }
    }

    #[test]
    fn more_than_u32_rows_or_dimensions_are_refused() {
        // 2^32 head rows of one element: counts match, the row arithmetic would not fit.
        let l = layout(1 << 16, 1 << 16, 1, 1, 1, 0);
        let t = Meta(Shape::from(vec![1usize << 32]), DType::U8);
        assert!(matches!(
            plan_permute("op", &t, &t, l),
            Err(Error::InvalidShape {
                reason: TOO_LARGE,
                ..
            })
        ));
        // One row short of the limit is accepted.
        let max_rows = u32::MAX as usize;
        let l = layout(1, max_rows, 1, 1, 1, 0);
        let t = Meta(Shape::from(vec![max_rows]), DType::U8);
        let p = plan_permute("op", &t, &t, l).unwrap();
        assert_eq!((p.rows, p.seq, p.unit_bytes), (max_rows, u32::MAX, 1));
        // A head row of 2^32 16-byte units does not fit the kernel's head_units.
        let l = layout(1, 1, 1, 1 << 36, 1, 0);
        let t = Meta(Shape::from(vec![1usize << 36]), DType::U8);
        assert!(matches!(
            plan_permute("op", &t, &t, l),
            Err(Error::InvalidShape {
                reason: TOO_LARGE,
                ..
            })
        ));
    }

    #[test]
    fn empty_layouts_plan_without_dividing_by_zero() {
        let cpu = Cpu::new();
        let empty = cpu.zeros([0], DType::BF16).unwrap();
        for l in [
            layout(0, 3, 2, 4, 1, 0),
            layout(2, 0, 2, 4, 3, 2),
            layout(2, 3, 0, 4, 1, 0),
            layout(2, 3, 2, 0, 1, 0),
        ] {
            let p = plan_permute("op", &empty, &empty, l).unwrap();
            assert!(p.rows == 0 || p.head_units == 0, "{l:?}: {p:?}");
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]

        /// The unit is the widest listed one that divides a head row, and the units cover the
        /// row exactly.
        #[test]
        fn the_unit_is_the_widest_divisor_of_a_head_row(
            b in 1usize..4, t in 1usize..9, nh in 1usize..6, hs in 1usize..200,
            parts in 1usize..4, dtype in prop::sample::select(DType::ALL.to_vec()),
        ) {
            let cpu = Cpu::new();
            let l = layout(b, t, nh, hs, parts, parts - 1);
            let wide = cpu.zeros([b, t, parts * nh * hs], dtype).unwrap();
            let heads = cpu.zeros([b, nh, t, hs], dtype).unwrap();
            let p = plan_permute("op", &wide, &heads, l).unwrap();
            let row_bytes = hs * dtype.size_in_bytes();
            prop_assert_eq!(p.head_units as usize * p.unit_bytes, row_bytes);
            prop_assert!(p.unit_bytes <= 16 && p.unit_bytes.is_power_of_two());
            prop_assert!(p.unit_bytes == 16 || row_bytes % (2 * p.unit_bytes) != 0);
            prop_assert_eq!(p.function, format!("permute_heads_b{}", p.unit_bytes));
            prop_assert_eq!(p.rows, b * nh * t);
            let lanes = p.lanes(256);
            prop_assert!(lanes.is_power_of_two() && lanes <= 256);
            prop_assert!(lanes >= p.head_units.min(256));
            prop_assert!(lanes == 1 || lanes / 2 < p.head_units);
            // A block that is not a power of two still gets whole rows.
            prop_assert!(p.lanes(96) <= 96 && p.lanes(96) >= p.head_units.min(64));
        }
    }
}
