//! [`CpuAdamW`]: PyTorch's AdamW on the host, with f32 or 8-bit moments in RAM or in a file.

use std::path::Path;

use headroom_tensor::cpu::kernels::{FloatSlice, FloatSliceMut};
use headroom_tensor::{Cpu, CpuTensor, Tensor};
use rayon::prelude::*;
use serde::{Deserialize, Serialize};

use crate::adamw_kernel::{fused_step_unchecked, step_serial, Isa, StepScalars, SupportedIsa};
use crate::quantized::{
    dequantize_block, quantize_block, signed_book, unsigned_book, CodeBook, QUANT_BLOCK,
};
use crate::state_store::{StateStore, StoreIdentity};
use crate::{OffloadError, Result};

/// AdamW hyper-parameters of one parameter group. Defaults are PyTorch's.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct AdamWHyper {
    /// Learning rate.
    pub lr: f64,
    /// First-moment decay β1.
    pub beta1: f64,
    /// Second-moment decay β2.
    pub beta2: f64,
    /// ε, added outside the square root.
    pub eps: f64,
    /// Decoupled weight decay (multiplies `lr`).
    pub weight_decay: f64,
}

impl Default for AdamWHyper {
    fn default() -> Self {
        AdamWHyper {
            lr: 1e-3,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 1e-2,
        }
    }
}

impl AdamWHyper {
    /// The same hyper-parameters with learning rate `lr`, checked (learning-rate schedules).
    pub fn with_lr(self, lr: f64) -> Result<Self> {
        let h = AdamWHyper { lr, ..self };
        h.validate()?;
        Ok(h)
    }

    /// Check the ranges PyTorch checks.
    pub fn validate(&self) -> Result<()> {
        let bad = |name, value: f64, reason| OffloadError::InvalidHyper {
            name,
            value,
            reason,
        };
        if !(self.lr >= 0.0 && self.lr.is_finite()) {
            return Err(bad("lr", self.lr, "must be finite and >= 0"));
        }
        if !(0.0..1.0).contains(&self.beta1) {
            return Err(bad("beta1", self.beta1, "must be in [0, 1)"));
        }
        if !(0.0..1.0).contains(&self.beta2) {
            return Err(bad("beta2", self.beta2, "must be in [0, 1)"));
        }
        if !(self.eps >= 0.0 && self.eps.is_finite()) {
            return Err(bad("eps", self.eps, "must be finite and >= 0"));
        }
        if !(self.weight_decay >= 0.0 && self.weight_decay.is_finite()) {
            return Err(bad(
                "weight_decay",
                self.weight_decay,
                "must be finite and >= 0",
            ));
        }
        Ok(())
    }
}

/// How the two moments are stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum StatePrecision {
    /// f32 `m` and `v`: 8 bytes per parameter, exact.
    F32,
    /// Blockwise 8-bit `m` and `√v` with an f32 scale per 2048 elements, each byte an index
    /// into a 256-entry dynamic code book: ≈ 2.004 bytes per parameter. Kept so that state
    /// written with it resumes exactly; new state uses [`StatePrecision::Float8`], which is
    /// about twice as fast to update on the CPU.
    Int8,
    /// Blockwise 8-bit `m` and `√v` with an f32 scale per 2048 elements, each byte a small
    /// float relative to the scale (sign + E3M4 for `m`, E4M4 for `√v`, both with subnormals;
    /// see the module `float8`): ≈ 2.004 bytes per parameter, decoded and encoded with a few
    /// integer operations instead of table lookups.
    Float8,
}

impl StatePrecision {
    /// True for the 8-bit formats.
    pub fn is_8bit(self) -> bool {
        self != StatePrecision::F32
    }

    fn code(self) -> u32 {
        match self {
            StatePrecision::F32 => 0,
            StatePrecision::Int8 => 1,
            StatePrecision::Float8 => 2,
        }
    }
}

/// One parameter the optimizer updates: its element count and its group.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ParamSpec {
    /// Number of elements.
    pub numel: usize,
    /// Index into the optimizer's groups.
    pub group: usize,
}

/// Where a new optimizer keeps its moments.
#[derive(Clone, Copy, Debug)]
pub enum StoreSpec<'a> {
    /// Host RAM allocated through this backend (reported to its allocation hook).
    Ram(&'a Cpu),
    /// A new memory-mapped file at this path (created or truncated).
    File(&'a Path),
}

/// Everything but the moments: enough, with the moment bytes (or the store file), to continue a
/// run exactly.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct AdamWState {
    /// Moment precision.
    pub precision: StatePrecision,
    /// Hyper-parameters per group.
    pub groups: Vec<AdamWHyper>,
    /// The parameters, in order.
    pub params: Vec<ParamSpec>,
    /// Steps taken per parameter (PyTorch keeps one per parameter too).
    pub steps: Vec<u64>,
}

#[derive(Clone, Copy, Debug)]
struct Slot {
    spec: ParamSpec,
    step: u64,
    /// First element of this parameter in the flat moment arrays.
    elem: usize,
    /// First quantisation block of this parameter (8-bit only).
    block: usize,
}

/// PyTorch AdamW on the CPU, bandwidth-bound, deterministic for any thread count.
pub struct CpuAdamW {
    precision: StatePrecision,
    groups: Vec<AdamWHyper>,
    slots: Vec<Slot>,
    numel: usize,
    blocks: usize,
    store: StateStore,
    isa: SupportedIsa,
}

impl std::fmt::Debug for CpuAdamW {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CpuAdamW")
            .field("precision", &self.precision)
            .field("params", &self.slots.len())
            .field("numel", &self.numel)
            .field("file_store", &self.store.is_file())
            .field("isa", &self.isa.isa())
            .finish()
    }
}

impl CpuAdamW {
    /// An optimizer for `params` with zeroed moments.
    pub fn new(
        groups: Vec<AdamWHyper>,
        params: &[ParamSpec],
        precision: StatePrecision,
        store: StoreSpec<'_>,
    ) -> Result<Self> {
        let (slots, numel, blocks) = Self::layout(&groups, params)?;
        let id = Self::identity(precision, params, numel, blocks);
        let store = match store {
            StoreSpec::Ram(cpu) => StateStore::ram(cpu, id.payload_bytes as usize)?,
            StoreSpec::File(path) => StateStore::create_file(path, id)?,
        };
        Ok(CpuAdamW {
            precision,
            groups,
            slots,
            numel,
            blocks,
            store,
            isa: SupportedIsa::detect(),
        })
    }

    /// Continue from saved state with moments in RAM. `moments` are bytes in the layout
    /// [`CpuAdamW::moments`] documents (a checkpoint of it), checked only for their length.
    pub fn restore(state: &AdamWState, cpu: &Cpu, moments: &[u8]) -> Result<Self> {
        Self::restore_into(state, StoreSpec::Ram(cpu), moments)
    }

    /// Continue from saved state and moment bytes, with the moments in a new store of any kind
    /// (a checkpoint copied into a fresh memory-mapped file, say). The store is flushed.
    pub fn restore_into(state: &AdamWState, store: StoreSpec<'_>, moments: &[u8]) -> Result<Self> {
        let len = moments.len() as u64;
        Self::restore_from_reader(state, store, len, &mut &moments[..], Path::new("moments"))
    }

    /// [`CpuAdamW::restore_into`] reading the `len` moment bytes from `reader` straight into
    /// the new store, so they never exist twice (a checkpoint's moments are twice the model
    /// for f32 AdamW). `source` names the reader in errors. A length other than the store's is
    /// refused before anything is allocated for it; a reader that ends early is
    /// [`OffloadError::Io`].
    pub fn restore_from_reader(
        state: &AdamWState,
        store: StoreSpec<'_>,
        len: u64,
        reader: &mut dyn std::io::Read,
        source: &Path,
    ) -> Result<Self> {
        let (_, numel, blocks) = Self::layout(&state.groups, &state.params)?;
        let expected = Self::identity(state.precision, &state.params, numel, blocks).payload_bytes;
        if len != expected {
            return Err(OffloadError::StateMismatch(format!(
                "{len} moment bytes, expected {expected}"
            )));
        }
        let mut opt = Self::new(state.groups.clone(), &state.params, state.precision, store)?;
        reader
            .read_exact(opt.store.bytes_mut())
            .map_err(|e| OffloadError::Io {
                path: source.to_path_buf(),
                source: e,
            })?;
        opt.set_steps(&state.steps)?;
        opt.store.flush()?;
        Ok(opt)
    }

    /// Continue from saved state with moments in the store file a previous run flushed.
    pub fn reopen(state: &AdamWState, path: &Path) -> Result<Self> {
        let (slots, numel, blocks) = Self::layout(&state.groups, &state.params)?;
        let id = Self::identity(state.precision, &state.params, numel, blocks);
        let mut opt = CpuAdamW {
            precision: state.precision,
            groups: state.groups.clone(),
            slots,
            numel,
            blocks,
            store: StateStore::open_file(path, id)?,
            isa: SupportedIsa::detect(),
        };
        opt.set_steps(&state.steps)?;
        Ok(opt)
    }

    fn set_steps(&mut self, steps: &[u64]) -> Result<()> {
        if steps.len() != self.slots.len() {
            return Err(OffloadError::StateMismatch(format!(
                "{} step counters for {} parameters",
                steps.len(),
                self.slots.len()
            )));
        }
        for (slot, &s) in self.slots.iter_mut().zip(steps) {
            slot.step = s;
        }
        Ok(())
    }

    fn layout(groups: &[AdamWHyper], params: &[ParamSpec]) -> Result<(Vec<Slot>, usize, usize)> {
        for g in groups {
            g.validate()?;
        }
        let mut slots = Vec::with_capacity(params.len());
        let (mut elem, mut block) = (0usize, 0usize);
        for p in params {
            if p.group >= groups.len() {
                return Err(OffloadError::UnknownGroup {
                    index: p.group,
                    count: groups.len(),
                });
            }
            slots.push(Slot {
                spec: *p,
                step: 0,
                elem,
                block,
            });
            elem = elem
                .checked_add(p.numel)
                .ok_or(OffloadError::InvalidHyper {
                    name: "numel",
                    value: p.numel as f64,
                    reason: "total parameter count overflows",
                })?;
            // Blocks never straddle two parameters, so each parameter quantises alone.
            block += p.numel.div_ceil(QUANT_BLOCK);
        }
        Ok((slots, elem, block))
    }

    fn identity(
        precision: StatePrecision,
        params: &[ParamSpec],
        numel: usize,
        blocks: usize,
    ) -> StoreIdentity {
        // FNV-1a over the parameter sizes.
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        for p in params {
            for b in (p.numel as u64).to_le_bytes() {
                h = (h ^ b as u64).wrapping_mul(0x0100_0000_01b3);
            }
        }
        let payload = match precision {
            StatePrecision::F32 => 8 * numel,
            StatePrecision::Int8 | StatePrecision::Float8 => 8 * blocks + 2 * numel,
        };
        StoreIdentity {
            precision_code: precision.code(),
            payload_bytes: payload as u64,
            layout_fingerprint: h,
        }
    }

    /// Run every update with this instruction set instead of the detected one (to compare
    /// paths, or to pin one). [`OffloadError::UnsupportedIsa`] when this CPU cannot run it:
    /// nothing falls back silently.
    pub fn with_isa(mut self, isa: Isa) -> Result<Self> {
        self.isa = isa.checked()?;
        Ok(self)
    }

    /// The instruction set updates run with.
    pub fn isa(&self) -> Isa {
        self.isa.isa()
    }

    /// Hyper-parameters of group `g`.
    pub fn hyper(&self, g: usize) -> Result<&AdamWHyper> {
        self.groups.get(g).ok_or(OffloadError::UnknownGroup {
            index: g,
            count: self.groups.len(),
        })
    }

    /// Change the learning rate of group `g` (learning-rate schedules).
    pub fn set_lr(&mut self, g: usize, lr: f64) -> Result<()> {
        let count = self.groups.len();
        let h = self
            .groups
            .get_mut(g)
            .ok_or(OffloadError::UnknownGroup { index: g, count })?;
        *h = h.with_lr(lr)?;
        Ok(())
    }

    /// Number of parameters (tensors).
    pub fn num_params(&self) -> usize {
        self.slots.len()
    }

    /// Moment bytes per model parameter (8 for f32, ≈ 2.004 for 8-bit).
    pub fn state_bytes_per_param(&self) -> f64 {
        self.store.bytes().len() as f64 / self.numel.max(1) as f64
    }

    /// The raw moment bytes, to checkpoint them and give them back to
    /// [`CpuAdamW::restore`] / [`CpuAdamW::restore_into`]. For typed access to f32 moments use
    /// [`CpuAdamW::exp_avg`] and [`CpuAdamW::exp_avg_sq`].
    ///
    /// Layout (a checkpoint format: it does not change). Values are in the machine's byte order
    /// (little-endian on every target headroom supports). Parameter `i` starts at element
    /// `offset(i)` = the sum of `numel` of parameters `0..i`, in the order the optimizer was
    /// built with; `N` is the sum of all `numel`.
    /// - [`StatePrecision::F32`]: `8·N` bytes, `[exp_avg: N × f32][exp_avg_sq: N × f32]`: every
    ///   parameter's first moment, then every parameter's second moment (PyTorch's `exp_avg`
    ///   and `exp_avg_sq`). Parameter `i`'s `exp_avg` is f32 elements
    ///   `offset(i) .. offset(i) + numel(i)`, its `exp_avg_sq` the same range plus `N`.
    /// - [`StatePrecision::Int8`]: `8·B + 2·N` bytes, where each parameter has
    ///   `ceil(numel / QUANT_BLOCK)` blocks of its own (a block never spans two parameters) and
    ///   `B` is their total: `[m scales: B × f32][√v scales: B × f32][m codes: N × u8]
    ///   [√v codes: N × u8]`. A scale is its block's absolute maximum; a code indexes the signed
    ///   (m) or unsigned (√v) dynamic code book, so `m ≈ book[code]·scale` and
    ///   `v ≈ (book[code]·scale)²`. Parameter `i`'s blocks start at the sum of the block counts
    ///   of parameters `0..i`, its codes at `offset(i)`.
    /// - [`StatePrecision::Float8`]: the same layout as `Int8`; a code is the small float the
    ///   module `float8` defines (an `i8` for `m`, a `u8` for `√v`), so
    ///   `m ≈ value(code)·scale` and `v ≈ (value(code)·scale)²`.
    pub fn moments(&self) -> &[u8] {
        self.store.bytes()
    }

    /// PyTorch's `exp_avg` (first moment) of parameter `index`, for f32 moments.
    /// [`OffloadError::UnknownParam`] for an index the optimizer was not built with,
    /// [`OffloadError::MomentsNotF32`] for 8-bit moments.
    pub fn exp_avg(&self, index: usize) -> Result<&[f32]> {
        Ok(self.f32_moments_of(index)?.0)
    }

    /// PyTorch's `exp_avg_sq` (second moment) of parameter `index`, for f32 moments; errors as
    /// [`CpuAdamW::exp_avg`].
    pub fn exp_avg_sq(&self, index: usize) -> Result<&[f32]> {
        Ok(self.f32_moments_of(index)?.1)
    }

    fn f32_moments_of(&self, index: usize) -> Result<(&[f32], &[f32])> {
        let slot = self.slots.get(index).ok_or(OffloadError::UnknownParam {
            index,
            count: self.slots.len(),
        })?;
        if self.precision != StatePrecision::F32 {
            return Err(OffloadError::MomentsNotF32 {
                precision: self.precision,
            });
        }
        let all: &[f32] = bytemuck::try_cast_slice(&self.store.bytes()[..8 * self.numel])
            .map_err(|e| OffloadError::StateMismatch(format!("moment store: {e}")))?;
        let (m, v) = all.split_at(self.numel);
        let range = slot.elem..slot.elem + slot.spec.numel;
        Ok((&m[range.clone()], &v[range]))
    }

    /// Everything but the moments.
    pub fn state(&self) -> AdamWState {
        AdamWState {
            precision: self.precision,
            groups: self.groups.clone(),
            params: self.slots.iter().map(|s| s.spec).collect(),
            steps: self.slots.iter().map(|s| s.step).collect(),
        }
    }

    /// Write a file store's dirty pages to disk.
    pub fn flush(&mut self) -> Result<()> {
        self.store.flush()
    }

    /// One AdamW step of parameter `index`: `param` (f32 master) is updated in place from
    /// `grad` (f32, bf16 or f16); if `copy` is given, the updated parameter is also written
    /// there in its precision (the working copy to upload) in the same pass.
    pub fn step(
        &mut self,
        index: usize,
        param: &mut [f32],
        grad: FloatSlice<'_>,
        copy: Option<FloatSliceMut<'_>>,
    ) -> Result<()> {
        let slot = *self.slots.get(index).ok_or(OffloadError::UnknownParam {
            index,
            count: self.slots.len(),
        })?;
        let n = slot.spec.numel;
        let check = |what, got| {
            if got != n {
                return Err(OffloadError::LengthMismatch {
                    what,
                    expected: n,
                    got,
                });
            }
            Ok(())
        };
        check("param", param.len())?;
        check("grad", grad.len())?;
        if let Some(c) = &copy {
            check("working copy", c.len())?;
        }
        let h = self.groups[slot.spec.group];
        let t = slot.step + 1;
        let s = StepScalars::new(h.lr, h.beta1, h.beta2, h.eps, h.weight_decay, t);
        let isa = self.isa;
        match self.precision {
            StatePrecision::F32 => {
                let (m, v) = f32_moments(self.store.bytes_mut(), self.numel, slot.elem, n);
                fused_step_unchecked(isa, &s, param, grad, m, v, copy);
            }
            StatePrecision::Int8 | StatePrecision::Float8 => {
                let st = Int8Slices::new(self.store.bytes_mut(), self.numel, self.blocks, slot, n);
                int8_step(isa, self.precision, &s, param, grad, st, copy);
            }
        }
        self.slots[index].step = t;
        Ok(())
    }

    /// [`CpuAdamW::step`] on host tensors: `param` f32, `grad` f32/bf16/f16, `copy` any float.
    pub fn step_tensor(
        &mut self,
        index: usize,
        param: &mut CpuTensor,
        grad: &CpuTensor,
        copy: Option<&mut CpuTensor>,
    ) -> Result<()> {
        let g = grad.float_slice("adamw grad")?;
        let p = param.as_mut_slice::<f32>()?;
        match copy {
            None => self.step(index, p, g, None),
            Some(c) => {
                if c.numel() != p.len() {
                    return Err(OffloadError::LengthMismatch {
                        what: "working copy",
                        expected: p.len(),
                        got: c.numel(),
                    });
                }
                let c = c.float_slice_mut("adamw working copy")?;
                self.step(index, p, g, Some(c))
            }
        }
    }
}

/// The f32 `m` and `v` of one parameter inside the payload `[m: numel][v: numel]`.
fn f32_moments(bytes: &mut [u8], numel: usize, elem: usize, n: usize) -> (&mut [f32], &mut [f32]) {
    let all: &mut [f32] = bytemuck::cast_slice_mut(&mut bytes[..8 * numel]);
    let (m, v) = all.split_at_mut(numel);
    (&mut m[elem..elem + n], &mut v[elem..elem + n])
}

/// The 8-bit state of one parameter inside the payload
/// `[m scales: blocks][s scales: blocks][m codes: numel][s codes: numel]`.
struct Int8Slices<'a> {
    m_scale: &'a mut [f32],
    s_scale: &'a mut [f32],
    m_codes: &'a mut [u8],
    s_codes: &'a mut [u8],
}

impl<'a> Int8Slices<'a> {
    fn new(bytes: &'a mut [u8], numel: usize, blocks: usize, slot: Slot, n: usize) -> Self {
        let (scales, codes) = bytes.split_at_mut(8 * blocks);
        let scales: &mut [f32] = bytemuck::cast_slice_mut(scales);
        let (m_scale, s_scale) = scales.split_at_mut(blocks);
        let (m_codes, s_codes) = codes.split_at_mut(numel);
        let nb = n.div_ceil(QUANT_BLOCK);
        Int8Slices {
            m_scale: &mut m_scale[slot.block..slot.block + nb],
            s_scale: &mut s_scale[slot.block..slot.block + nb],
            m_codes: &mut m_codes[slot.elem..slot.elem + n],
            s_codes: &mut s_codes[slot.elem..slot.elem + n],
        }
    }
}

/// AdamW with 8-bit moments (`precision` one of the two 8-bit formats): per block, decode `m`
/// and `√v`, run the f32 update, encode. Blocks are independent, so the result does not depend
/// on the thread count.
#[allow(clippy::too_many_arguments)]
fn int8_step(
    isa: SupportedIsa,
    precision: StatePrecision,
    s: &StepScalars,
    param: &mut [f32],
    grad: FloatSlice<'_>,
    st: Int8Slices<'_>,
    copy: Option<FloatSliceMut<'_>>,
) {
    let nb = param.len().div_ceil(QUANT_BLOCK);
    let grads = crate::adamw_kernel::split_float(grad, QUANT_BLOCK);
    let copies: Vec<Option<FloatSliceMut<'_>>> = match copy {
        None => (0..nb).map(|_| None).collect(),
        Some(c) => crate::adamw_kernel::split_float_mut(c, QUANT_BLOCK)
            .into_iter()
            .map(Some)
            .collect(),
    };
    let (mb, sb) = (signed_book(), unsigned_book());
    param
        .par_chunks_mut(QUANT_BLOCK)
        .zip(grads.into_par_iter())
        .zip(copies.into_par_iter())
        .zip(st.m_codes.par_chunks_mut(QUANT_BLOCK))
        .zip(st.s_codes.par_chunks_mut(QUANT_BLOCK))
        .zip(st.m_scale.par_iter_mut())
        .zip(st.s_scale.par_iter_mut())
        .for_each(|((((((p, g), c), mc), sc), ms), ss)| {
            if precision == StatePrecision::Float8 {
                let b = crate::float8::Block {
                    p: &mut *p,
                    g,
                    mc,
                    sc,
                    ms,
                    ss,
                };
                match isa.isa() {
                    // SAFETY: a `SupportedIsa` exists only for an ISA that `Isa::is_supported`
                    // confirmed (with FMA), and every AVX-512F CPU has AVX2.
                    #[cfg(target_arch = "x86_64")]
                    Isa::Avx512 => unsafe { crate::float8::block_avx512(s, b) },
                    // SAFETY: as above (avx2 and fma present).
                    #[cfg(target_arch = "x86_64")]
                    Isa::Avx2 => unsafe { crate::float8::block_avx2(s, b) },
                    _ => crate::float8::block_portable(s, b),
                }
                crate::adamw_kernel::write_copy(p, c);
                return;
            }
            let b = Int8Block {
                p,
                g,
                c,
                mc,
                sc,
                ms,
                ss,
            };
            match isa.isa() {
                // SAFETY: a `SupportedIsa` exists only for an ISA that `Isa::is_supported`
                // confirmed (avx512f and fma present).
                #[cfg(target_arch = "x86_64")]
                Isa::Avx512 => unsafe { int8_block_avx512(mb, sb, s, b, isa) },
                // SAFETY: as above (avx2 and fma present).
                #[cfg(target_arch = "x86_64")]
                Isa::Avx2 => unsafe { int8_block_avx2(mb, sb, s, b, isa) },
                _ => int8_block(mb, sb, s, b, isa),
            }
        });
}

/// One quantisation block of a parameter and its 8-bit state.
struct Int8Block<'a, 'g> {
    p: &'a mut [f32],
    g: FloatSlice<'g>,
    c: Option<FloatSliceMut<'g>>,
    mc: &'a mut [u8],
    sc: &'a mut [u8],
    ms: &'a mut f32,
    ss: &'a mut f32,
}

/// Dequantise `m` and `√v`, run the exact f32 update, requantise: the portable path and the
/// scalar reference of the 8-bit update. The AVX2 and AVX-512 wrappers below run the fused
/// AVX2 kernel (`int8_avx2`) instead, which performs the same IEEE-exact operations per element
/// (the update's fused multiply-adds included) in another order of passes, so every path gives
/// the same bits (`tests/int8_state.rs`).
#[inline(always)]
fn int8_block(
    mb: &CodeBook,
    sb: &CodeBook,
    s: &StepScalars,
    b: Int8Block<'_, '_>,
    isa: SupportedIsa,
) {
    let n = b.p.len();
    let mut m = [0f32; QUANT_BLOCK];
    let mut v = [0f32; QUANT_BLOCK];
    let (m, v) = (&mut m[..n], &mut v[..n]);
    dequantize_block(mb, b.mc, *b.ms, m);
    dequantize_block(sb, b.sc, *b.ss, v);
    for x in v.iter_mut() {
        *x *= *x;
    }
    step_serial(isa, s, b.p, b.g, m, v, b.c);
    *b.ms = quantize_block(mb, m, b.mc);
    for x in v.iter_mut() {
        *x = x.sqrt();
    }
    *b.ss = quantize_block(sb, v, b.sc);
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn int8_block_avx512(
    mb: &CodeBook,
    sb: &CodeBook,
    s: &StepScalars,
    b: Int8Block<'_, '_>,
    _isa: SupportedIsa,
) {
    // SAFETY: the caller guarantees this function's features, which include AVX2 and FMA.
    unsafe { int8_block_fused(mb, sb, s, b) }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn int8_block_avx2(
    mb: &CodeBook,
    sb: &CodeBook,
    s: &StepScalars,
    b: Int8Block<'_, '_>,
    _isa: SupportedIsa,
) {
    // SAFETY: the caller guarantees this function's features, which include AVX2 and FMA.
    unsafe { int8_block_fused(mb, sb, s, b) }
}

/// [`int8_block`] by the fused AVX2 kernel (`int8_avx2`): the same operations per element, so
/// the same bits. f16 gradients are widened into a buffer first (exactly, as `step_serial`
/// widens them).
///
/// # Safety
/// The CPU must support AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn int8_block_fused(mb: &CodeBook, sb: &CodeBook, s: &StepScalars, b: Int8Block<'_, '_>) {
    use crate::int8_avx2::{block, Grad};
    let mut wide = None;
    let g = Grad::of(b.g, &mut wide);
    // SAFETY: the caller guarantees AVX2 and FMA.
    unsafe { block(mb, sb, s, b.p, g, b.mc, b.sc, b.ms, b.ss) };
    crate::adamw_kernel::write_copy(b.p, b.c);
}
