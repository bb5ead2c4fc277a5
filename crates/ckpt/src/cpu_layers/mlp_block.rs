//! A transformer-style MLP block: `y = x + W2 · gelu(W1 · LN(x) + b1) + b2`.

use headroom_tensor::{Cpu, CpuTensor, Result};

use super::kernels::{
    add_bias, gelu_backward_inplace, gelu_into, layernorm_apply, layernorm_backward_acc,
    layernorm_stats, matmul, matmul_at_acc, matmul_bt, sum_rows_acc,
};
use super::{alloc_f32, opt_bytes, rows_of, seeded_values};
use crate::{Intermediate, Layer, RecomputePolicy, SaveAll, SavedState};

/// Pre-norm MLP block with a residual: `y = x + gelu(LN(x) · W1 + b1) · W2 + b2`,
/// `x: [rows, width]`, hidden size `hidden` (GPT-2 uses `4 · width`).
///
/// Its backward needs the layer-norm output ([`Intermediate::Norm`]), the first matmul's
/// output ([`Intermediate::MatmulOutput`]) and the GELU output ([`Intermediate::Activation`]);
/// the policy decides which are kept and which are recomputed from the input and the
/// normalisation statistics (always kept: two floats a row).
#[derive(Clone, Debug)]
pub struct MlpBlock<P = SaveAll> {
    width: usize,
    hidden: usize,
    params: MlpParams,
    grads: MlpParams,
    policy: P,
}

#[derive(Clone, Debug)]
struct MlpParams {
    ln_gamma: Vec<f32>,
    ln_beta: Vec<f32>,
    w1: Vec<f32>,
    b1: Vec<f32>,
    w2: Vec<f32>,
    b2: Vec<f32>,
}

impl MlpParams {
    fn zeros(width: usize, hidden: usize) -> Self {
        MlpParams {
            ln_gamma: vec![0.0; width],
            ln_beta: vec![0.0; width],
            w1: vec![0.0; width * hidden],
            b1: vec![0.0; hidden],
            w2: vec![0.0; hidden * width],
            b2: vec![0.0; width],
        }
    }

    fn all(&self) -> [&[f32]; 6] {
        [
            &self.ln_gamma,
            &self.ln_beta,
            &self.w1,
            &self.b1,
            &self.w2,
            &self.b2,
        ]
    }

    fn all_mut(&mut self) -> [&mut Vec<f32>; 6] {
        [
            &mut self.ln_gamma,
            &mut self.ln_beta,
            &mut self.w1,
            &mut self.b1,
            &mut self.w2,
            &mut self.b2,
        ]
    }
}

/// What [`MlpBlock`] keeps: normalisation statistics always, the rest as its policy says.
#[derive(Debug)]
pub struct MlpSaved {
    stats: CpuTensor,
    norm: Option<CpuTensor>,
    hidden: Option<CpuTensor>,
    activation: Option<CpuTensor>,
}

impl SavedState for MlpSaved {
    fn size_in_bytes(&self) -> usize {
        self.stats.as_bytes().len()
            + opt_bytes(&self.norm)
            + opt_bytes(&self.hidden)
            + opt_bytes(&self.activation)
    }
}

/// The intermediates of one forward.
struct Intermediates {
    stats: CpuTensor,
    norm: CpuTensor,
    hidden: CpuTensor,
    activation: CpuTensor,
}

impl MlpBlock<SaveAll> {
    /// A block with deterministic weights from `seed`, gamma 1, beta 0, zero gradients.
    pub fn new(width: usize, hidden: usize, seed: u64) -> Self {
        MlpBlock::with_policy(width, hidden, seed, SaveAll)
    }
}

impl<P: RecomputePolicy> MlpBlock<P> {
    /// As [`MlpBlock::new`], with a recomputation policy.
    pub fn with_policy(width: usize, hidden: usize, seed: u64, policy: P) -> Self {
        let s1 = 1.0 / (width.max(1) as f32).sqrt();
        let s2 = 1.0 / (hidden.max(1) as f32).sqrt();
        let params = MlpParams {
            ln_gamma: vec![1.0; width],
            ln_beta: vec![0.0; width],
            w1: seeded_values(width * hidden, seed, s1),
            b1: seeded_values(hidden, seed ^ 0x11, s1),
            w2: seeded_values(hidden * width, seed ^ 0x22, s2),
            b2: seeded_values(width, seed ^ 0x33, s2),
        };
        MlpBlock {
            width,
            hidden,
            params,
            grads: MlpParams::zeros(width, hidden),
            policy,
        }
    }

    /// The policy.
    pub fn policy(&self) -> P {
        self.policy
    }

    /// Features in and out.
    pub fn width(&self) -> usize {
        self.width
    }

    /// Hidden features.
    pub fn hidden(&self) -> usize {
        self.hidden
    }

    /// Parameter gradients (ln gamma, ln beta, W1, b1, W2, b2).
    pub fn grads(&self) -> [&[f32]; 6] {
        self.grads.all()
    }

    /// Parameters (ln gamma, ln beta, W1, b1, W2, b2), mutably.
    pub fn params_mut(&mut self) -> [&mut Vec<f32>; 6] {
        self.params.all_mut()
    }

    /// Reset gradients to zero.
    pub fn zero_grads(&mut self) {
        for g in self.grads.all_mut() {
            g.fill(0.0);
        }
    }

    fn norm_from(
        &self,
        cpu: &Cpu,
        x: &CpuTensor,
        stats: &CpuTensor,
        rows: usize,
        keep: bool,
    ) -> Result<CpuTensor> {
        let mut norm = alloc_f32(cpu, [rows, self.width], keep)?;
        layernorm_apply(
            x.as_slice::<f32>()?,
            stats.as_slice::<f32>()?,
            &self.params.ln_gamma,
            &self.params.ln_beta,
            norm.as_mut_slice::<f32>()?,
        );
        Ok(norm)
    }

    fn hidden_from(
        &self,
        cpu: &Cpu,
        norm: &CpuTensor,
        rows: usize,
        keep: bool,
    ) -> Result<CpuTensor> {
        let mut h = alloc_f32(cpu, [rows, self.hidden], keep)?;
        {
            let hs = h.as_mut_slice::<f32>()?;
            let ns = norm.as_slice::<f32>()?;
            cpu.install(|| matmul(ns, &self.params.w1, hs, rows, self.width, self.hidden));
            add_bias(hs, &self.params.b1);
        }
        Ok(h)
    }

    fn activation_from(
        &self,
        cpu: &Cpu,
        h: &CpuTensor,
        rows: usize,
        keep: bool,
    ) -> Result<CpuTensor> {
        let mut g = alloc_f32(cpu, [rows, self.hidden], keep)?;
        {
            let hs = h.as_slice::<f32>()?;
            let gs = g.as_mut_slice::<f32>()?;
            cpu.install(|| gelu_into(hs, gs));
        }
        Ok(g)
    }

    /// Run the block; `keep` says which intermediates (norm, hidden, activation) are allocated
    /// as saved activations, `keep_stats` whether the statistics are.
    fn run(
        &self,
        cpu: &Cpu,
        x: &CpuTensor,
        keep: [bool; 3],
        keep_stats: bool,
    ) -> Result<(CpuTensor, Intermediates)> {
        let [keep_norm, keep_hidden, keep_act] = keep;
        let rows = rows_of(x, self.width, "MlpBlock::forward")?;
        let mut stats = alloc_f32(cpu, [rows, 2], keep_stats)?;
        layernorm_stats(
            x.as_slice::<f32>()?,
            stats.as_mut_slice::<f32>()?,
            self.width,
        );
        let norm = self.norm_from(cpu, x, &stats, rows, keep_norm)?;
        let hidden = self.hidden_from(cpu, &norm, rows, keep_hidden)?;
        let activation = self.activation_from(cpu, &hidden, rows, keep_act)?;
        let mut y = alloc_f32(cpu, [rows, self.width], true)?;
        {
            let ys = y.as_mut_slice::<f32>()?;
            let gs = activation.as_slice::<f32>()?;
            cpu.install(|| matmul(gs, &self.params.w2, ys, rows, self.hidden, self.width));
            add_bias(ys, &self.params.b2);
            for (y, &x) in ys.iter_mut().zip(x.as_slice::<f32>()?) {
                *y += x;
            }
        }
        Ok((
            y,
            Intermediates {
                stats,
                norm,
                hidden,
                activation,
            },
        ))
    }
}

impl<P: RecomputePolicy> Layer<Cpu> for MlpBlock<P> {
    type Saved = MlpSaved;

    fn forward_save(&self, cpu: &Cpu, x: &CpuTensor) -> Result<(CpuTensor, MlpSaved)> {
        let keep = [
            self.policy.keep(Intermediate::Norm),
            self.policy.keep(Intermediate::MatmulOutput),
            self.policy.keep(Intermediate::Activation),
        ];
        let (y, it) = self.run(cpu, x, keep, true)?;
        Ok((
            y,
            MlpSaved {
                stats: it.stats,
                norm: keep[0].then_some(it.norm),
                hidden: keep[1].then_some(it.hidden),
                activation: keep[2].then_some(it.activation),
            },
        ))
    }

    fn forward_discard(&self, cpu: &Cpu, x: &CpuTensor) -> Result<CpuTensor> {
        Ok(self.run(cpu, x, [false; 3], false)?.0)
    }

    fn backward(
        &mut self,
        cpu: &Cpu,
        x: &CpuTensor,
        saved: MlpSaved,
        dy: &CpuTensor,
    ) -> Result<CpuTensor> {
        let rows = rows_of(x, self.width, "MlpBlock::backward (input)")?;
        let dy_rows = rows_of(dy, self.width, "MlpBlock::backward (grad_output)")?;
        if dy_rows != rows {
            return Err(headroom_tensor::Error::LengthMismatch {
                op: "MlpBlock::backward rows",
                expected: rows,
                got: dy_rows,
            });
        }
        let stats = saved.stats;
        let norm = match saved.norm {
            Some(t) => t,
            None => self.norm_from(cpu, x, &stats, rows, false)?,
        };
        let hidden = match saved.hidden {
            Some(t) => t,
            None => self.hidden_from(cpu, &norm, rows, false)?,
        };
        let activation = match saved.activation {
            Some(t) => t,
            None => self.activation_from(cpu, &hidden, rows, false)?,
        };
        let (m, d, h) = (rows, self.width, self.hidden);
        let mut dg = alloc_f32(cpu, [m, h], false)?;
        let mut dnorm = alloc_f32(cpu, [m, d], false)?;
        let mut dx = alloc_f32(cpu, [m, d], true)?;
        {
            let dys = dy.as_slice::<f32>()?;
            let gs = activation.as_slice::<f32>()?;
            let hs = hidden.as_slice::<f32>()?;
            let ns = norm.as_slice::<f32>()?;
            let dgs = dg.as_mut_slice::<f32>()?;
            let dns = dnorm.as_mut_slice::<f32>()?;
            let dxs = dx.as_mut_slice::<f32>()?;
            let (p, g) = (&self.params, &mut self.grads);
            cpu.install(|| {
                sum_rows_acc(dys, &mut g.b2, d);
                matmul_at_acc(gs, dys, &mut g.w2, m, h, d);
                matmul_bt(dys, &p.w2, dgs, m, d, h);
                gelu_backward_inplace(hs, dgs);
                sum_rows_acc(dgs, &mut g.b1, h);
                matmul_at_acc(ns, dgs, &mut g.w1, m, d, h);
                matmul_bt(dgs, &p.w1, dns, m, h, d);
            });
            // Residual path, then the layer norm's contribution.
            dxs.copy_from_slice(dys);
            layernorm_backward_acc(
                x.as_slice::<f32>()?,
                stats.as_slice::<f32>()?,
                &p.ln_gamma,
                dns,
                dxs,
                &mut g.ln_gamma,
                &mut g.ln_beta,
            );
        }
        Ok(dx)
    }
}
