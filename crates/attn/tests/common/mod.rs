//! Shared by the integration tests: a scalar f64 reference of attention forward and backward,
//! deterministic input data, and error metrics.
#![allow(dead_code)]

use headroom_attn::{
    Algorithm, AttentionBackend, AttentionConfig, AttentionForward, AttentionGradients,
};
use headroom_tensor::{bf16, Backend, Cpu, CpuTensor, DType};

/// Naive, chunked or flash by `which` (mod 3), with the given tiles and chunk.
pub fn algorithm(which: u8, (block_q, block_k, chunk): (usize, usize, usize)) -> Algorithm {
    match which % 3 {
        0 => Algorithm::Naive,
        1 => Algorithm::Chunked { chunk_size: chunk },
        _ => Algorithm::Flash { block_q, block_k },
    }
}

/// Sizes of one test problem.
#[derive(Clone, Copy, Debug)]
pub struct Sizes {
    pub batch: usize,
    pub q_heads: usize,
    pub kv_heads: usize,
    pub q_len: usize,
    pub kv_len: usize,
    pub head_dim: usize,
}

impl Sizes {
    pub fn q_numel(&self) -> usize {
        self.batch * self.q_heads * self.q_len * self.head_dim
    }
    pub fn kv_numel(&self) -> usize {
        self.batch * self.kv_heads * self.kv_len * self.head_dim
    }
    pub fn q_shape(&self) -> [usize; 4] {
        [self.batch, self.q_heads, self.q_len, self.head_dim]
    }
    pub fn kv_shape(&self) -> [usize; 4] {
        [self.batch, self.kv_heads, self.kv_len, self.head_dim]
    }
}

/// Deterministic pseudo-random values in [-amp, amp) (a 64-bit LCG; tests need no rand crate).
pub fn values(n: usize, seed: u64, amp: f32) -> Vec<f32> {
    let mut s = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * amp
        })
        .collect()
}

/// Inputs `q, k, v, d_out` as host f32 (already rounded to bf16 when `dtype` is bf16, so the
/// f64 reference sees exactly what the kernels see).
pub struct Inputs {
    pub q: Vec<f32>,
    pub k: Vec<f32>,
    pub v: Vec<f32>,
    pub d_out: Vec<f32>,
}

pub fn round_to(dtype: DType, x: Vec<f32>) -> Vec<f32> {
    match dtype {
        DType::BF16 => x.into_iter().map(|v| bf16::from_f32(v).to_f32()).collect(),
        _ => x,
    }
}

pub fn inputs(s: &Sizes, seed: u64, dtype: DType) -> Inputs {
    Inputs {
        q: round_to(dtype, values(s.q_numel(), seed, 1.5)),
        k: round_to(dtype, values(s.kv_numel(), seed + 1, 1.5)),
        v: round_to(dtype, values(s.kv_numel(), seed + 2, 1.0)),
        d_out: round_to(dtype, values(s.q_numel(), seed + 3, 1.0)),
    }
}

pub fn upload(cpu: &Cpu, data: &[f32], shape: [usize; 4], dtype: DType) -> CpuTensor {
    match dtype {
        DType::F32 => cpu.upload(data, shape).unwrap(),
        DType::BF16 => {
            let h: Vec<bf16> = data.iter().map(|&v| bf16::from_f32(v)).collect();
            cpu.upload(&h, shape).unwrap()
        }
        other => panic!("test helper: unsupported {other}"),
    }
}

pub fn download(cpu: &Cpu, t: &CpuTensor) -> Vec<f32> {
    match t.dtype_name() {
        "f32" => cpu.download::<f32>(t).unwrap(),
        _ => cpu
            .download::<bf16>(t)
            .unwrap()
            .into_iter()
            .map(|v| v.to_f32())
            .collect(),
    }
}

trait DTypeName {
    fn dtype_name(&self) -> &'static str;
}
impl DTypeName for CpuTensor {
    fn dtype_name(&self) -> &'static str {
        use headroom_tensor::Tensor;
        self.dtype().name()
    }
}

/// Forward and backward through the library, results as host f32.
pub struct Run {
    pub out: Vec<f32>,
    pub lse: Vec<f32>,
    pub dq: Vec<f32>,
    pub dk: Vec<f32>,
    pub dv: Vec<f32>,
}

pub fn run(cpu: &Cpu, s: &Sizes, x: &Inputs, dtype: DType, config: &AttentionConfig) -> Run {
    let q = upload(cpu, &x.q, s.q_shape(), dtype);
    let k = upload(cpu, &x.k, s.kv_shape(), dtype);
    let v = upload(cpu, &x.v, s.kv_shape(), dtype);
    let d_out = upload(cpu, &x.d_out, s.q_shape(), dtype);
    let fwd: AttentionForward<CpuTensor> = cpu.attention_forward(&q, &k, &v, config).unwrap();
    let g: AttentionGradients<CpuTensor> =
        cpu.attention_backward(&q, &k, &v, &fwd, &d_out).unwrap();
    Run {
        out: download(cpu, &fwd.output),
        lse: cpu.download::<f32>(&fwd.logsumexp).unwrap(),
        dq: download(cpu, &g.dq),
        dk: download(cpu, &g.dk),
        dv: download(cpu, &g.dv),
    }
}

/// Plain scalar f64 attention: forward output, logsumexp and the three gradients.
pub struct Reference {
    pub out: Vec<f64>,
    pub lse: Vec<f64>,
    pub dq: Vec<f64>,
    pub dk: Vec<f64>,
    pub dv: Vec<f64>,
}

pub fn visible(s: &Sizes, causal: bool, i: usize) -> usize {
    if !causal {
        return s.kv_len;
    }
    ((i + 1 + s.kv_len) as isize - s.q_len as isize).clamp(0, s.kv_len as isize) as usize
}

pub fn reference(s: &Sizes, x: &Inputs, causal: bool, scale: f64) -> Reference {
    reference_from(s, x, causal, scale, &|_, _| 0)
}

/// [`reference`] where query `i` of batch row `b` sees keys `first_key(b, i) ..` of its
/// visible prefix only (a document's start, a sliding window's): the definition a mask is
/// checked against.
pub fn reference_from(
    s: &Sizes,
    x: &Inputs,
    causal: bool,
    scale: f64,
    first_key: &dyn Fn(usize, usize) -> usize,
) -> Reference {
    let (nq, nk, d) = (s.q_len, s.kv_len, s.head_dim);
    let group = s.q_heads / s.kv_heads;
    let mut r = Reference {
        out: vec![0.0; s.q_numel()],
        lse: vec![f64::NEG_INFINITY; s.batch * s.q_heads * nq],
        dq: vec![0.0; s.q_numel()],
        dk: vec![0.0; s.kv_numel()],
        dv: vec![0.0; s.kv_numel()],
    };
    for b in 0..s.batch {
        for h in 0..s.q_heads {
            let bh = b * s.q_heads + h;
            let kvh = b * s.kv_heads + h / group;
            let q = |i: usize, c: usize| x.q[(bh * nq + i) * d + c] as f64;
            let k = |j: usize, c: usize| x.k[(kvh * nk + j) * d + c] as f64;
            let v = |j: usize, c: usize| x.v[(kvh * nk + j) * d + c] as f64;
            let dout = |i: usize, c: usize| x.d_out[(bh * nq + i) * d + c] as f64;
            for i in 0..nq {
                let vis = visible(s, causal, i);
                let first = first_key(b, i).min(vis);
                if vis == first {
                    continue;
                }
                // Scores of the keys before `first` are -inf: probability 0, no gradient.
                let scores: Vec<f64> = (0..vis)
                    .map(|j| {
                        if j < first {
                            f64::NEG_INFINITY
                        } else {
                            scale * (0..d).map(|c| q(i, c) * k(j, c)).sum::<f64>()
                        }
                    })
                    .collect();
                let m = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let z: f64 = scores.iter().map(|x| (x - m).exp()).sum();
                let p: Vec<f64> = scores.iter().map(|x| (x - m).exp() / z).collect();
                r.lse[bh * nq + i] = m + z.ln();
                for c in 0..d {
                    r.out[(bh * nq + i) * d + c] = (0..vis).map(|j| p[j] * v(j, c)).sum();
                }
                // dP_j = dO·v_j; dS_j = P_j (dP_j − Σ P dP).
                let dp: Vec<f64> = (0..vis)
                    .map(|j| (0..d).map(|c| dout(i, c) * v(j, c)).sum())
                    .collect();
                let dsum: f64 = (0..vis).map(|j| p[j] * dp[j]).sum();
                for j in 0..vis {
                    let ds = p[j] * (dp[j] - dsum);
                    for c in 0..d {
                        r.dq[(bh * nq + i) * d + c] += scale * ds * k(j, c);
                        r.dk[(kvh * nk + j) * d + c] += scale * ds * q(i, c);
                        r.dv[(kvh * nk + j) * d + c] += p[j] * dout(i, c);
                    }
                }
            }
        }
    }
    r
}

/// max |a − b| / max(max |b|, floor): the error relative to the tensor's largest magnitude.
pub fn rel_err(a: &[f32], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len());
    // Inputs are O(1), so f32 rounding noise is ~1e-7 in absolute terms. A tensor that is
    // exactly zero in theory (dQ when every row sees a single key: softmax over one score has
    // no gradient) keeps that noise; the floor of 1e-3 stops it reading as a relative error.
    let scale = b.iter().fold(1e-3f64, |m, x| m.max(x.abs()));
    a.iter()
        .zip(b)
        .map(|(&x, &y)| (x as f64 - y).abs())
        .fold(0.0, f64::max)
        / scale
}

/// `rel_err` with the magnitude floored at `floor` instead of 1e-3.
pub fn rel_err_floor(a: &[f32], b: &[f64], floor: f64) -> f64 {
    assert_eq!(a.len(), b.len());
    let scale = b.iter().fold(floor.max(1e-3), |m, x| m.max(x.abs()));
    a.iter()
        .zip(b)
        .map(|(&x, &y)| (x as f64 - y).abs())
        .fold(0.0, f64::max)
        / scale
}

/// Magnitude floors for dQ and dK: a tenth of the terms they are sums of,
/// `scale · max|dO·Vᵀ| · max|K|` and `… · max|Q|` (with `max|dO·Vᵀ| ≤ max‖dO_row‖₁ · max|V|`).
///
/// Why: dS = P∘(dP − D) cancels — exactly with a single visible key, almost when softmax
/// saturates — so dQ and dK can be far smaller than the terms, and then hold rounding noise of
/// a few f32 epsilons *of the terms* on every implementation. Measured against their own tiny
/// size that noise reads as a large relative error and says nothing about correctness.
pub fn score_grad_floors(s: &Sizes, x: &Inputs, scale: f64) -> (f64, f64) {
    let max_abs = |v: &[f32]| v.iter().fold(0f64, |m, &a| m.max(f64::from(a.abs())));
    let row_l1 = x
        .d_out
        .chunks(s.head_dim.max(1))
        .map(|r| r.iter().map(|a| f64::from(a.abs())).sum::<f64>())
        .fold(0f64, f64::max);
    let dp = row_l1 * max_abs(&x.v);
    (
        0.1 * scale * dp * max_abs(&x.k),
        0.1 * scale * dp * max_abs(&x.q),
    )
}

pub fn rel_err_f32(a: &[f32], b: &[f32]) -> f64 {
    let b64: Vec<f64> = b.iter().map(|&x| x as f64).collect();
    rel_err(a, &b64)
}

/// Live and peak bytes per memory category, as a backend's allocation hook reports them.
#[derive(Default)]
pub struct Peaks {
    state: std::sync::Mutex<(
        std::collections::HashMap<headroom_tensor::MemoryCategory, usize>,
        std::collections::HashMap<headroom_tensor::MemoryCategory, usize>,
    )>,
}

impl Peaks {
    /// Bytes of `c` live now.
    pub fn live(&self, c: headroom_tensor::MemoryCategory) -> usize {
        self.state.lock().unwrap().0.get(&c).copied().unwrap_or(0)
    }

    /// The most bytes of `c` live at once since the start (or the last [`Peaks::reset`]).
    pub fn peak(&self, c: headroom_tensor::MemoryCategory) -> usize {
        self.state.lock().unwrap().1.get(&c).copied().unwrap_or(0)
    }

    /// Restarts the workspace peak from what is live now.
    pub fn reset(&self) {
        let mut s = self.state.lock().unwrap();
        let ws = headroom_tensor::MemoryCategory::Workspace;
        let live = s.0.get(&ws).copied().unwrap_or(0);
        s.1.insert(ws, live);
    }

    /// [`Peaks::peak`] of the workspace.
    pub fn workspace_peak(&self) -> u64 {
        self.peak(headroom_tensor::MemoryCategory::Workspace) as u64
    }
}

impl headroom_tensor::AllocHook for Peaks {
    fn on_alloc(&self, e: &headroom_tensor::AllocEvent) -> Result<(), headroom_tensor::BoxedError> {
        let mut s = self.state.lock().unwrap();
        let live = {
            let l = s.0.entry(e.category).or_default();
            *l += e.bytes;
            *l
        };
        let peak = s.1.entry(e.category).or_default();
        *peak = (*peak).max(live);
        Ok(())
    }
    fn on_free(&self, e: &headroom_tensor::AllocEvent) {
        *self.state.lock().unwrap().0.entry(e.category).or_default() -= e.bytes;
    }
}
