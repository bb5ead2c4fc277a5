//! [`LoraLinear`]: one adapter `(A, B)` over a frozen base, forward, backward, merge.

use headroom_tensor::{Backend, Cpu, CpuTensor, DType, MemoryCategory};
use rayon::prelude::*;

use crate::config::{scaling, LoraConfig, MAX_RANK};
use crate::error::{check_len, mul, LoraError, Result};
use crate::frozen::FrozenLinear;
use crate::gemm::{gemm_into, Strided};
use crate::rng;

/// Whether a forward trains (dropout on, activations kept for backward) or only infers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// Training: dropout is applied with the mask of `(seed, step, micro_batch, module)`.
    /// Give every forward of a module within a step its own `micro_batch` (gradient
    /// accumulation), and a recomputed forward (activation checkpointing) the same one: the
    /// mask is then the same as the first time.
    Train {
        /// The optimizer step.
        step: u64,
        /// The forward call within the step (the micro-batch index).
        micro_batch: u64,
    },
    /// Inference: no dropout.
    Eval,
}

/// The layout of a base weight in memory, for [`LoraLinear::merge_into`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WeightLayout {
    /// `[out, in]` row-major: `nn.Linear`, and every headroom base (the trainer transposes
    /// GPT-2's `Conv1D` weights at load).
    OutIn,
    /// `[in, out]` row-major: GPT-2's `Conv1D` as transformers stores it (PEFT's
    /// `fan_in_fan_out = true`).
    InOut,
}

/// What [`LoraLinear::forward`] keeps for [`LoraLinear::backward`]: `h = dropout(x)·Aᵀ`,
/// `[rows, r]` f32, allocated as `Activations` — `rows · r · 4` bytes
/// ([`LoraLinear::saved_bytes`]). The input `x` is not copied: the backward takes it again
/// (the caller keeps it for its own backward anyway), and the dropout mask is regenerated
/// from the mode recorded here rather than stored.
#[derive(Debug)]
pub struct LoraSaved {
    h: CpuTensor,
    rows: usize,
    mode: Mode,
}

impl LoraSaved {
    /// Rows of the forward's input.
    pub fn rows(&self) -> usize {
        self.rows
    }
    /// The mode the forward ran in.
    pub fn mode(&self) -> Mode {
        self.mode
    }
    /// The kept tensor `h = dropout(x)·Aᵀ`.
    pub fn h(&self) -> &CpuTensor {
        &self.h
    }
}

/// Gradients of one adapter: `dA` `[r, in]` and `dB` `[out, r]`, f32, allocated as
/// `Gradients` (and nothing of the base weight's size). [`LoraLinear::backward`] accumulates
/// into them; [`LoraGrads::zero`] clears them.
#[derive(Debug)]
pub struct LoraGrads {
    /// `∂L/∂A`, `[r, in]`.
    pub a: CpuTensor,
    /// `∂L/∂B`, `[out, r]`.
    pub b: CpuTensor,
}

impl LoraGrads {
    /// Set both gradients to zero.
    pub fn zero(&mut self, cpu: &Cpu) -> Result<()> {
        cpu.fill_zero(&mut self.a)?;
        cpu.fill_zero(&mut self.b)?;
        Ok(())
    }
}

/// A LoRA adapter for one linear of `in_features → out_features`: A `[r, in]`, B `[out, r]`
/// (f32, allocated as `Parameters` through the [`Cpu`] backend), the scaling, dropout and the
/// module's name (which keys its initialisation and dropout streams).
///
/// `forward`: `y = base(x) + scaling · (dropout(x)·Aᵀ)·Bᵀ`; `backward`: `dA`, `dB` and the
/// input gradient (base's plus the adapter's), see [`LoraLinear::backward`]. The base is
/// passed to each call, so one adapter can sit over a dense, bf16 or 4-bit base
/// ([`FrozenLinear`]).
#[derive(Debug)]
pub struct LoraLinear {
    name: String,
    in_features: usize,
    out_features: usize,
    r: usize,
    scaling: f32,
    dropout: f32,
    seed: u64,
    a: CpuTensor,
    b: CpuTensor,
    cpu: Cpu,
}

/// Workspace buffer of `n` f32, tagged `Workspace`.
fn workspace(cpu: &Cpu, n: usize) -> Result<CpuTensor> {
    let _ws = MemoryCategory::Workspace.enter();
    Ok(cpu.zeros([n], DType::F32)?)
}

fn f32s(t: &CpuTensor) -> Result<&[f32]> {
    Ok(t.as_slice::<f32>()?)
}

fn f32s_mut(t: &mut CpuTensor) -> Result<&mut [f32]> {
    Ok(t.as_mut_slice::<f32>()?)
}

impl LoraLinear {
    /// A fresh adapter for module `name`, initialised as PEFT does (`init_lora_weights=True`):
    /// A from `kaiming_uniform_(a=√5)`, i.e. uniform on `[-1/√in, 1/√in)`, drawn from a
    /// stream keyed by `(config.seed, name)`; B zero, so the adapted layer starts equal to the
    /// base.
    pub fn new(
        cpu: &Cpu,
        name: &str,
        out_features: usize,
        in_features: usize,
        config: &LoraConfig,
    ) -> Result<Self> {
        config.validate()?;
        let r = config.r;
        let (a_len, b_len) = Self::param_lens(r, out_features, in_features)?;
        let bound = if in_features == 0 {
            0.0
        } else {
            (1.0 / (in_features as f64).sqrt()) as f32
        };
        let key = rng::key(&[rng::DOMAIN_INIT, config.seed, rng::name_hash(name)]);
        let _params = MemoryCategory::Parameters.enter();
        let mut a = cpu.zeros([r, in_features], DType::F32)?;
        a.as_mut_slice::<f32>()?
            .iter_mut()
            .enumerate()
            .for_each(|(i, v)| *v = (2.0 * rng::unit(key, i as u64) - 1.0) * bound);
        let b = cpu.zeros([out_features, r], DType::F32)?;
        debug_assert_eq!(
            (a.as_slice::<f32>()?.len(), b.as_slice::<f32>()?.len()),
            (a_len, b_len)
        );
        Ok(LoraLinear {
            name: name.to_owned(),
            in_features,
            out_features,
            r,
            scaling: config.scaling(),
            dropout: config.dropout,
            seed: config.seed,
            a,
            b,
            cpu: cpu.clone(),
        })
    }

    /// An adapter with given weights: `a` `[r, in]` and `b` `[out, r]` row-major (as PEFT
    /// stores `lora_A.weight` and `lora_B.weight`); `r`, scaling, dropout and seed from
    /// `config`.
    pub fn from_weights(
        cpu: &Cpu,
        name: &str,
        out_features: usize,
        in_features: usize,
        config: &LoraConfig,
        a: &[f32],
        b: &[f32],
    ) -> Result<Self> {
        let mut lora = Self::new(cpu, name, out_features, in_features, config)?;
        check_len("lora_A", a.len(), lora.a.numel_f32())?;
        check_len("lora_B", b.len(), lora.b.numel_f32())?;
        f32s_mut(&mut lora.a)?.copy_from_slice(a);
        f32s_mut(&mut lora.b)?.copy_from_slice(b);
        Ok(lora)
    }

    fn param_lens(r: usize, out_features: usize, in_features: usize) -> Result<(usize, usize)> {
        if r == 0 || r > MAX_RANK {
            return Err(LoraError::InvalidConfig(format!("r = {r}")));
        }
        Ok((
            mul("lora_A elements", r, in_features)?,
            mul("lora_B elements", out_features, r)?,
        ))
    }

    /// The module name.
    pub fn name(&self) -> &str {
        &self.name
    }
    /// `in_features` of the base.
    pub fn in_features(&self) -> usize {
        self.in_features
    }
    /// `out_features` of the base.
    pub fn out_features(&self) -> usize {
        self.out_features
    }
    /// The rank `r`.
    pub fn rank(&self) -> usize {
        self.r
    }
    /// The factor applied to `B·A·x`.
    pub fn scaling(&self) -> f32 {
        self.scaling
    }
    /// The dropout probability.
    pub fn dropout(&self) -> f32 {
        self.dropout
    }
    /// Change the scaling (PEFT's `set_scale`); `alpha / r` or `alpha / √r` for `config`.
    pub fn set_scaling_from(&mut self, config: &LoraConfig) {
        self.scaling = scaling(config.alpha, self.r, config.use_rslora);
    }
    /// A, `[r, in]`.
    pub fn a(&self) -> &[f32] {
        self.a.as_slice::<f32>().unwrap_or(&[])
    }
    /// B, `[out, r]`.
    pub fn b(&self) -> &[f32] {
        self.b.as_slice::<f32>().unwrap_or(&[])
    }
    /// A and B, mutable (for an optimizer, or to load values).
    pub fn params_mut(&mut self) -> (&mut [f32], &mut [f32]) {
        let a = self.a.as_mut_slice::<f32>().unwrap_or(&mut []);
        let b = self.b.as_mut_slice::<f32>().unwrap_or(&mut []);
        (a, b)
    }
    /// The parameter tensors (`Parameters`), for a backend-level optimizer.
    pub fn param_tensors(&mut self) -> (&mut CpuTensor, &mut CpuTensor) {
        (&mut self.a, &mut self.b)
    }
    /// Trainable parameters: `r · (in + out)`.
    pub fn parameter_count(&self) -> usize {
        self.r * (self.in_features + self.out_features)
    }
    /// Bytes kept between forward and backward for `rows` input rows (the `Activations` of
    /// [`LoraSaved`]).
    pub fn saved_bytes(&self, rows: usize) -> usize {
        rows.saturating_mul(self.r).saturating_mul(4)
    }
    /// Peak `Workspace` bytes a forward or backward of `rows` rows allocates: the dropped-out
    /// input `[rows, in]` when dropout is on, plus `[rows, r]` in backward (and `h` in
    /// [`infer`](Self::infer)).
    pub fn workspace_bytes(&self, rows: usize) -> usize {
        let drop = if self.dropout > 0.0 {
            rows.saturating_mul(self.in_features)
        } else {
            0
        };
        drop.saturating_add(rows.saturating_mul(self.r))
            .saturating_mul(4)
    }

    /// Zeroed gradients `dA`, `dB`, allocated as `Gradients`.
    pub fn alloc_grads(&self) -> Result<LoraGrads> {
        let _g = MemoryCategory::Gradients.enter();
        Ok(LoraGrads {
            a: self.cpu.zeros([self.r, self.in_features], DType::F32)?,
            b: self.cpu.zeros([self.out_features, self.r], DType::F32)?,
        })
    }

    /// `count` zeroed f32 optimizer moments shaped like (A, B) (2 for Adam), allocated as
    /// `OptimizerState`: the adapter's whole optimizer state, `count · 4 ·` [`parameter_count`]
    /// bytes.
    ///
    /// [`parameter_count`]: Self::parameter_count
    pub fn alloc_moments(&self, count: usize) -> Result<Vec<[CpuTensor; 2]>> {
        let _o = MemoryCategory::OptimizerState.enter();
        (0..count)
            .map(|_| {
                Ok([
                    self.cpu.zeros([self.r, self.in_features], DType::F32)?,
                    self.cpu.zeros([self.out_features, self.r], DType::F32)?,
                ])
            })
            .collect()
    }

    /// The dropout stream of one forward call.
    fn dropout_key(&self, mode: Mode) -> Option<(u64, u32, f32)> {
        DropoutMask::new(self.seed, &self.name, self.dropout, mode)
            .map(|m| (m.key, m.threshold, m.scale))
    }

    /// The dropout multiplier of element `index` (`0` or `1/(1-p)`) of a `[rows, in]` input
    /// in `mode`; `1` when dropout is off. Forward and backward both use this, so the mask is
    /// the same in both by construction; it depends only on (seed, step, micro-batch, module
    /// name, element index).
    pub fn dropout_multiplier(&self, mode: Mode, index: usize) -> f32 {
        match self.dropout_key(mode) {
            Some((key, threshold, scale)) => multiplier(key, threshold, scale, index),
            None => 1.0,
        }
    }

    /// `dst = x ⊙ mask` (dropout applied), threaded over fixed chunks.
    fn apply_dropout(dst: &mut [f32], x: &[f32], (key, threshold, scale): (u64, u32, f32)) {
        const CHUNK: usize = 1 << 14;
        dst.par_chunks_mut(CHUNK)
            .zip(x.par_chunks(CHUNK))
            .enumerate()
            .for_each(|(c, (d, x))| {
                for (j, (d, x)) in d.iter_mut().zip(x).enumerate() {
                    *d = *x * multiplier(key, threshold, scale, c * CHUNK + j);
                }
            });
    }

    fn check_rows(
        &self,
        x_len: usize,
        y_len: usize,
        rows: usize,
        xs: (&'static str, &'static str),
    ) -> Result<()> {
        check_len(
            xs.0,
            x_len,
            mul("rows × in_features", rows, self.in_features)?,
        )?;
        check_len(
            xs.1,
            y_len,
            mul("rows × out_features", rows, self.out_features)?,
        )
    }

    fn check_base<B: FrozenLinear + ?Sized>(&self, base: &B) -> Result<()> {
        if base.in_features() != self.in_features || base.out_features() != self.out_features {
            return Err(LoraError::ShapeMismatch {
                name: format!("base of {}", self.name),
                expected: format!("[{}, {}]", self.out_features, self.in_features),
                actual: vec![base.out_features(), base.in_features()],
            });
        }
        Ok(())
    }

    /// `h = dropout(x)·Aᵀ` into `h` (`[rows, r]`).
    fn down(&self, x: &[f32], h: &mut [f32], rows: usize, mode: Mode) -> Result<()> {
        let a = f32s(&self.a)?;
        let k = self.in_features;
        match self.dropout_key(mode) {
            Some(d) => {
                let mut ws = workspace(&self.cpu, x.len())?;
                let xd = f32s_mut(&mut ws)?;
                self.cpu.install(|| Self::apply_dropout(xd, x, d));
                self.cpu.install(|| {
                    gemm_into(
                        h,
                        Strided::rows(xd, k),
                        Strided::transposed(a, k),
                        rows,
                        self.r,
                        k,
                        1.0,
                        false,
                    )
                })
            }
            None => self.cpu.install(|| {
                gemm_into(
                    h,
                    Strided::rows(x, k),
                    Strided::transposed(a, k),
                    rows,
                    self.r,
                    k,
                    1.0,
                    false,
                )
            }),
        }
    }

    /// `y += scaling · h·Bᵀ`.
    fn up(&self, h: &[f32], y: &mut [f32], rows: usize) -> Result<()> {
        let b = f32s(&self.b)?;
        self.cpu.install(|| {
            gemm_into(
                y,
                Strided::rows(h, self.r),
                Strided::transposed(b, self.r),
                rows,
                self.out_features,
                self.r,
                self.scaling,
                true,
            )
        })
    }

    /// Training forward: `y = base(x) + scaling · (dropout(x)·Aᵀ)·Bᵀ`, `x` `[rows, in]`, `y`
    /// `[rows, out]` (overwritten). Returns what [`backward`](Self::backward) needs (`h`,
    /// `rows · r` f32, `Activations`); with dropout, one `[rows, in]` `Workspace` buffer
    /// lives during the call.
    ///
    /// With B = 0 the result equals `base(x)` bit for bit (the update is an exact zero).
    pub fn forward<B: FrozenLinear + ?Sized>(
        &self,
        base: &B,
        x: &[f32],
        y: &mut [f32],
        rows: usize,
        mode: Mode,
    ) -> Result<LoraSaved> {
        self.check_base(base)?;
        self.check_rows(x.len(), y.len(), rows, ("x", "y"))?;
        base.forward(x, y, rows).map_err(LoraError::Base)?;
        let mut h = {
            let _act = MemoryCategory::Activations.enter();
            self.cpu
                .zeros([mul("rows × r", rows, self.r)?], DType::F32)?
        };
        self.down(x, f32s_mut(&mut h)?, rows, mode)?;
        self.up(f32s(&h)?, y, rows)?;
        Ok(LoraSaved { h, rows, mode })
    }

    /// Inference forward (no dropout, nothing kept): `y = base(x) + scaling · x·Aᵀ·Bᵀ`; `h`
    /// lives in `Workspace` during the call.
    pub fn infer<B: FrozenLinear + ?Sized>(
        &self,
        base: &B,
        x: &[f32],
        y: &mut [f32],
        rows: usize,
    ) -> Result<()> {
        self.check_base(base)?;
        self.check_rows(x.len(), y.len(), rows, ("x", "y"))?;
        base.forward(x, y, rows).map_err(LoraError::Base)?;
        let mut h = workspace(&self.cpu, mul("rows × r", rows, self.r)?)?;
        self.down(x, f32s_mut(&mut h)?, rows, Mode::Eval)?;
        self.up(f32s(&h)?, y, rows)
    }

    /// Backward of [`forward`](Self::forward), given the same `x` and the output gradient
    /// `dy` (`[rows, out]`). With `g = scaling · dy·B` (`[rows, r]`, `Workspace`) and `M` the
    /// forward's dropout multipliers:
    /// - `grads.b += scaling · dyᵀ·h` and `grads.a += gᵀ·(x ⊙ M)` (accumulated);
    /// - `dx += base.backward_input(dy) + (g·A) ⊙ M` (accumulated).
    ///
    /// No buffer of the base weight's size is touched or allocated; with dropout one
    /// `[rows, in]` `Workspace` buffer lives during the call.
    #[allow(clippy::too_many_arguments)]
    pub fn backward<B: FrozenLinear + ?Sized>(
        &self,
        base: &B,
        saved: &LoraSaved,
        x: &[f32],
        dy: &[f32],
        dx: &mut [f32],
        grads: &mut LoraGrads,
    ) -> Result<()> {
        self.check_base(base)?;
        let rows = saved.rows;
        self.check_rows(x.len(), dy.len(), rows, ("x", "dy"))?;
        check_len("dx", dx.len(), x.len())?;
        check_len(
            "saved h",
            saved.h.numel_f32(),
            mul("rows × r", rows, self.r)?,
        )?;
        check_len("grads.a", grads.a.numel_f32(), self.a.numel_f32())?;
        check_len("grads.b", grads.b.numel_f32(), self.b.numel_f32())?;
        base.backward_input(dy, dx, rows).map_err(LoraError::Base)?;

        let (r, k, m) = (self.r, self.in_features, self.out_features);
        let a = f32s(&self.a)?;
        let b = f32s(&self.b)?;
        let h = f32s(&saved.h)?;
        let mut g_t = workspace(&self.cpu, mul("rows × r", rows, r)?)?;
        let g = f32s_mut(&mut g_t)?;
        let cpu = &self.cpu;
        // g = scaling · dy·B
        cpu.install(|| {
            gemm_into(
                g,
                Strided::rows(dy, m),
                Strided::rows(b, r),
                rows,
                r,
                m,
                self.scaling,
                false,
            )
        })?;
        // dB += scaling · dyᵀ·h
        let db = f32s_mut(&mut grads.b)?;
        cpu.install(|| {
            gemm_into(
                db,
                Strided::transposed(dy, m),
                Strided::rows(h, r),
                m,
                r,
                rows,
                self.scaling,
                true,
            )
        })?;
        let g: &[f32] = g;
        let da = f32s_mut(&mut grads.a)?;
        match self.dropout_key(saved.mode) {
            None => {
                // dA += gᵀ·x ; dx += g·A
                cpu.install(|| {
                    gemm_into(
                        da,
                        Strided::transposed(g, r),
                        Strided::rows(x, k),
                        r,
                        k,
                        rows,
                        1.0,
                        true,
                    )
                })?;
                cpu.install(|| {
                    gemm_into(
                        dx,
                        Strided::rows(g, r),
                        Strided::rows(a, k),
                        rows,
                        k,
                        r,
                        1.0,
                        true,
                    )
                })?;
            }
            Some(d) => {
                let mut ws_t = workspace(cpu, x.len())?;
                let ws = f32s_mut(&mut ws_t)?;
                cpu.install(|| Self::apply_dropout(ws, x, d));
                cpu.install(|| {
                    gemm_into(
                        da,
                        Strided::transposed(g, r),
                        Strided::rows(ws, k),
                        r,
                        k,
                        rows,
                        1.0,
                        true,
                    )
                })?;
                // The buffer is reused for g·A, then masked into dx.
                cpu.install(|| {
                    gemm_into(
                        ws,
                        Strided::rows(g, r),
                        Strided::rows(a, k),
                        rows,
                        k,
                        r,
                        1.0,
                        false,
                    )
                })?;
                let (key, threshold, scale) = d;
                const CHUNK: usize = 1 << 14;
                cpu.install(|| {
                    dx.par_chunks_mut(CHUNK)
                        .zip(ws.par_chunks(CHUNK))
                        .enumerate()
                        .for_each(|(c, (dx, ws))| {
                            for (j, (dx, w)) in dx.iter_mut().zip(ws).enumerate() {
                                *dx += *w * multiplier(key, threshold, scale, c * CHUNK + j);
                            }
                        })
                });
            }
        }
        Ok(())
    }

    /// The update `scaling · B·A` of output row `o` for input columns `cols`, into `dst`:
    /// each element summed over the rank in order, then scaled, so merge and unmerge see the
    /// identical value.
    fn delta_row(a: &[f32], b_row: &[f32], k: usize, scaling: f32, c0: usize, dst: &mut [f32]) {
        dst.fill(0.0);
        for (rr, &bv) in b_row.iter().enumerate() {
            let a_row = &a[rr * k + c0..rr * k + c0 + dst.len()];
            for (d, &av) in dst.iter_mut().zip(a_row) {
                *d += bv * av;
            }
        }
        for d in dst.iter_mut() {
            *d *= scaling;
        }
    }

    fn apply_delta(&self, weight: &mut [f32], layout: WeightLayout, sign: f32) -> Result<()> {
        let (m, k) = (self.out_features, self.in_features);
        check_len("weight", weight.len(), mul("weight elements", m, k)?)?;
        if m == 0 || k == 0 {
            return Ok(());
        }
        let a = f32s(&self.a)?;
        let b = f32s(&self.b)?;
        let s = self.scaling * sign;
        const TILE: usize = 256;
        match layout {
            WeightLayout::OutIn => self.cpu.install(|| {
                weight.par_chunks_mut(k).enumerate().for_each(|(o, w_row)| {
                    let mut buf = [0f32; TILE];
                    for c0 in (0..k).step_by(TILE) {
                        let len = TILE.min(k - c0);
                        Self::delta_row(
                            a,
                            &b[o * self.r..(o + 1) * self.r],
                            k,
                            s,
                            c0,
                            &mut buf[..len],
                        );
                        for (w, d) in w_row[c0..c0 + len].iter_mut().zip(&buf[..len]) {
                            *w += *d;
                        }
                    }
                })
            }),
            WeightLayout::InOut => self.cpu.install(|| {
                // Row i of an [in, out] weight is column i of the update: computed in output
                // tiles with the same per-element arithmetic as the [out, in] case.
                weight.par_chunks_mut(m).enumerate().for_each(|(i, w_row)| {
                    for (o, w) in w_row.iter_mut().enumerate() {
                        let mut d = [0f32; 1];
                        Self::delta_row(a, &b[o * self.r..(o + 1) * self.r], k, s, i, &mut d);
                        *w += d[0];
                    }
                })
            }),
        }
        Ok(())
    }

    /// Fold the adapter into a base weight: `W += scaling · B·A` (PEFT's `merge`). After it,
    /// `base(x)` with the merged weight equals this adapter's output within f32 rounding.
    ///
    /// The update is computed element by element (sum over the rank in order, then the
    /// scaling), identically in [`unmerge_from`](Self::unmerge_from), so unmerging subtracts
    /// exactly the value merging added: `unmerge(merge(W))` differs from `W` by at most one
    /// rounding of `W + Δ`, i.e. `|W'' − W| ≤ ulp(max(|W|, |W + Δ|))` per element, and is `W`
    /// exactly when `W + Δ` is representable (Δ = 0 among others).
    pub fn merge_into(&self, weight: &mut [f32], layout: WeightLayout) -> Result<()> {
        self.apply_delta(weight, layout, 1.0)
    }

    /// Undo [`merge_into`](Self::merge_into): `W -= scaling · B·A` (see there for the
    /// rounding bound).
    pub fn unmerge_from(&self, weight: &mut [f32], layout: WeightLayout) -> Result<()> {
        self.apply_delta(weight, layout, -1.0)
    }
}

/// The dropout mask of one module's input in one forward: element `i` of the (row-major)
/// input is multiplied by [`DropoutMask::multiplier`]`(i)`, `0` or `1/(1-p)`, a pure function
/// of (seed, step, micro-batch, module name, `i`) — so a recomputed forward and the backward
/// regenerate it exactly, for any thread count. What [`LoraLinear`] applies; public so that a
/// caller running the adapter's arithmetic on its own backend applies the same mask.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DropoutMask {
    key: u64,
    threshold: u32,
    scale: f32,
}

impl DropoutMask {
    /// The mask of module `name` with dropout probability `p` (in `[0, 1)`) and initialisation
    /// seed `seed` in `mode`; `None` when nothing is dropped (`p = 0`, or [`Mode::Eval`]).
    pub fn new(seed: u64, name: &str, p: f32, mode: Mode) -> Option<Self> {
        match mode {
            Mode::Train { step, micro_batch } if p > 0.0 => {
                let key = rng::key(&[
                    rng::DOMAIN_DROPOUT,
                    seed,
                    step,
                    micro_batch,
                    rng::name_hash(name),
                ]);
                // Element dropped when its 32 random bits fall below p·2³²; p < 1 keeps it
                // below 2³².
                let threshold = (f64::from(p) * 4_294_967_296.0) as u32;
                let scale = (1.0 / (1.0 - f64::from(p))) as f32;
                Some(DropoutMask {
                    key,
                    threshold,
                    scale,
                })
            }
            _ => None,
        }
    }

    /// Element `index`'s multiplier: `0` (dropped) or `1/(1-p)`.
    pub fn multiplier(&self, index: usize) -> f32 {
        multiplier(self.key, self.threshold, self.scale, index)
    }

    /// `dst[i] = x[i] · multiplier(i)`, threaded over fixed chunks (the same bits for any
    /// thread count). `dst` and `x` have the same length.
    pub fn apply(&self, dst: &mut [f32], x: &[f32]) {
        LoraLinear::apply_dropout(dst, x, (self.key, self.threshold, self.scale));
    }

    /// `x[i] *= multiplier(i)` in place.
    pub fn apply_in_place(&self, x: &mut [f32]) {
        const CHUNK: usize = 1 << 14;
        x.par_chunks_mut(CHUNK).enumerate().for_each(|(c, x)| {
            for (j, v) in x.iter_mut().enumerate() {
                *v *= self.multiplier(c * CHUNK + j);
            }
        });
    }
}

#[inline]
fn multiplier(key: u64, threshold: u32, scale: f32, index: usize) -> f32 {
    if ((rng::bits(key, index as u64) >> 32) as u32) < threshold {
        0.0
    } else {
        scale
    }
}

trait NumelF32 {
    fn numel_f32(&self) -> usize;
}

impl NumelF32 for CpuTensor {
    fn numel_f32(&self) -> usize {
        self.as_slice::<f32>().map_or(0, <[f32]>::len)
    }
}
