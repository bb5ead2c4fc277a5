//! `y = gelu(x · W + b)`.

use headroom_tensor::{Cpu, CpuTensor, Result};

use super::kernels::{
    add_bias, gelu_backward_inplace, gelu_into, matmul, matmul_at_acc, matmul_bt, sum_rows_acc,
};
use super::{alloc_f32, opt_bytes, rows_of, seeded_values};
use crate::{Intermediate, Layer, RecomputePolicy, SaveAll, SavedState};

/// A dense layer with GELU: `y = gelu(x · W + b)`, `x: [rows, in]`, `W: [in, out]`.
///
/// Its backward needs the pre-activation `z = x · W + b` (an [`Intermediate::MatmulOutput`]):
/// kept, or recomputed from the input when the policy says so.
#[derive(Clone, Debug)]
pub struct Dense<P = SaveAll> {
    in_dim: usize,
    out_dim: usize,
    weight: Vec<f32>,
    bias: Vec<f32>,
    grad_weight: Vec<f32>,
    grad_bias: Vec<f32>,
    policy: P,
}

/// What [`Dense`] keeps: the pre-activation, unless its policy recomputes it.
#[derive(Debug)]
pub struct DenseSaved {
    pre_activation: Option<CpuTensor>,
}

impl SavedState for DenseSaved {
    fn size_in_bytes(&self) -> usize {
        opt_bytes(&self.pre_activation)
    }
}

impl Dense<SaveAll> {
    /// A layer with deterministic weights from `seed` (uniform in `±1/√in`), zero gradients.
    pub fn new(in_dim: usize, out_dim: usize, seed: u64) -> Self {
        Dense::with_policy(in_dim, out_dim, seed, SaveAll)
    }
}

impl<P: RecomputePolicy> Dense<P> {
    /// As [`Dense::new`], with a recomputation policy.
    pub fn with_policy(in_dim: usize, out_dim: usize, seed: u64, policy: P) -> Self {
        let scale = 1.0 / (in_dim.max(1) as f32).sqrt();
        Dense {
            in_dim,
            out_dim,
            weight: seeded_values(in_dim * out_dim, seed, scale),
            bias: seeded_values(out_dim, seed ^ 0xb1a5, scale),
            grad_weight: vec![0.0; in_dim * out_dim],
            grad_bias: vec![0.0; out_dim],
            policy,
        }
    }

    /// Input features.
    pub fn in_dim(&self) -> usize {
        self.in_dim
    }

    /// Output features.
    pub fn out_dim(&self) -> usize {
        self.out_dim
    }

    /// Parameter gradients (weight, bias), accumulated since the last [`zero_grads`](Self::zero_grads).
    pub fn grads(&self) -> [&[f32]; 2] {
        [&self.grad_weight, &self.grad_bias]
    }

    /// Parameters (weight, bias), mutably.
    pub fn params_mut(&mut self) -> [&mut Vec<f32>; 2] {
        [&mut self.weight, &mut self.bias]
    }

    /// Reset gradients to zero.
    pub fn zero_grads(&mut self) {
        self.grad_weight.fill(0.0);
        self.grad_bias.fill(0.0);
    }

    /// `out = x · W + b` into a fresh tensor.
    fn pre_activation(
        &self,
        cpu: &Cpu,
        x: &CpuTensor,
        rows: usize,
        keep: bool,
    ) -> Result<CpuTensor> {
        let mut z = alloc_f32(cpu, [rows, self.out_dim], keep)?;
        {
            let zs = z.as_mut_slice::<f32>()?;
            let xs = x.as_slice::<f32>()?;
            cpu.install(|| matmul(xs, &self.weight, zs, rows, self.in_dim, self.out_dim));
            add_bias(zs, &self.bias);
        }
        Ok(z)
    }
}

impl<P: RecomputePolicy> Layer<Cpu> for Dense<P> {
    type Saved = DenseSaved;

    fn forward_save(&self, cpu: &Cpu, x: &CpuTensor) -> Result<(CpuTensor, DenseSaved)> {
        let rows = rows_of(x, self.in_dim, "Dense::forward")?;
        let keep = self.policy.keep(Intermediate::MatmulOutput);
        let z = self.pre_activation(cpu, x, rows, keep)?;
        let mut y = alloc_f32(cpu, [rows, self.out_dim], true)?;
        {
            let zs = z.as_slice::<f32>()?;
            let ys = y.as_mut_slice::<f32>()?;
            cpu.install(|| gelu_into(zs, ys));
        }
        let pre_activation = keep.then_some(z);
        Ok((y, DenseSaved { pre_activation }))
    }

    fn forward_discard(&self, cpu: &Cpu, x: &CpuTensor) -> Result<CpuTensor> {
        let rows = rows_of(x, self.in_dim, "Dense::forward")?;
        let z = self.pre_activation(cpu, x, rows, false)?;
        let mut y = alloc_f32(cpu, [rows, self.out_dim], true)?;
        {
            let zs = z.as_slice::<f32>()?;
            let ys = y.as_mut_slice::<f32>()?;
            cpu.install(|| gelu_into(zs, ys));
        }
        Ok(y)
    }

    fn backward(
        &mut self,
        cpu: &Cpu,
        x: &CpuTensor,
        saved: DenseSaved,
        dy: &CpuTensor,
    ) -> Result<CpuTensor> {
        let rows = rows_of(x, self.in_dim, "Dense::backward (input)")?;
        let dy_rows = rows_of(dy, self.out_dim, "Dense::backward (grad_output)")?;
        if dy_rows != rows {
            return Err(headroom_tensor::Error::LengthMismatch {
                op: "Dense::backward rows",
                expected: rows,
                got: dy_rows,
            });
        }
        let z = match saved.pre_activation {
            Some(z) => z,
            None => self.pre_activation(cpu, x, rows, false)?,
        };
        let mut dz = alloc_f32(cpu, [rows, self.out_dim], false)?;
        let mut dx = alloc_f32(cpu, [rows, self.in_dim], true)?;
        {
            let dzs = dz.as_mut_slice::<f32>()?;
            dzs.copy_from_slice(dy.as_slice::<f32>()?);
            let zs = z.as_slice::<f32>()?;
            let xs = x.as_slice::<f32>()?;
            let dxs = dx.as_mut_slice::<f32>()?;
            let (m, k, n) = (rows, self.in_dim, self.out_dim);
            let (w, gw, gb) = (&self.weight, &mut self.grad_weight, &mut self.grad_bias);
            cpu.install(|| {
                gelu_backward_inplace(zs, dzs);
                matmul_at_acc(xs, dzs, gw, m, k, n);
                sum_rows_acc(dzs, gb, n);
                matmul_bt(dzs, w, dxs, m, n, k);
            });
        }
        Ok(dx)
    }
}
