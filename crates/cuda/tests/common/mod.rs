//! Scalar CPU references and test data shared by the trainer-op tests (`trainer_ops_parity.rs`
//! on a GPU, `trainer_ops_emulator.rs` on the host). Each reference is a transcription of the
//! CPU code it stands for (headroom-trainer's `ops`, headroom-offload's `reference.rs`,
//! headroom-amp's `stochastic_rounding.rs`); the bitwise ones are pinned to golden values the
//! real crates printed (see `trainer_ops_parity.rs`).

// Each test crate uses a different subset.
#![allow(dead_code)]

use headroom_cuda::{AdamWStep, GemmOp, GemmShape, HeadLayout, StochasticRoundingKey};
use headroom_tensor::{bf16, f16, DType};

/// headroom-trainer `ops::fast_math::exp`, transcribed.
pub fn ref_exp(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    const ROUND: f32 = 12_582_912.0;
    let x = x.clamp(-87.3, 88.7);
    let n = (x * LOG2E + ROUND) - ROUND;
    let r = (x - n * LN2_HI) - n * LN2_LO;
    let p = 1.987_569_1e-4f32;
    let p = p * r + 1.398_199_9e-3;
    let p = p * r + 8.333_452e-3;
    let p = p * r + 4.166_579_6e-2;
    let p = p * r + 1.666_666_5e-1;
    let p = p * r + 0.5;
    let y = (p * r * r + r) + 1.0;
    let scale = f32::from_bits(((n as i32 + 127) as u32) << 23);
    y * scale
}

/// headroom-trainer `ops::fast_math::tanh`, transcribed.
pub fn ref_tanh(x: f32) -> f32 {
    let a = x.abs().min(9.0);
    let e = ref_exp(2.0 * a);
    let t = 1.0 - 2.0 / (e + 1.0);
    let a2 = a * a;
    let small = a
        * (1.0
            + a2 * (-1.0 / 3.0 + a2 * (2.0 / 15.0 + a2 * (-17.0 / 315.0 + a2 * (62.0 / 2835.0)))));
    let t = if a < 0.3 { small } else { t };
    let t = if a >= 9.0 { 1.0 } else { t };
    t.copysign(x)
}

pub const SQRT_2_OVER_PI: f32 = 0.797_884_6;
pub const GELU_K: f32 = 0.044_715;

/// headroom-trainer `ops::gelu::forward`, one element.
pub fn ref_gelu(x: f32) -> f32 {
    let u = SQRT_2_OVER_PI * (x + GELU_K * x * x * x);
    0.5 * x * (1.0 + ref_tanh(u))
}

/// headroom-trainer `ops::gelu::backward`, one element: the new `dinp`.
pub fn ref_gelu_backward(dinp: f32, x: f32, d: f32) -> f32 {
    let u = SQRT_2_OVER_PI * (x + GELU_K * x * x * x);
    let t = ref_tanh(u);
    let sech2 = 1.0 - t * t;
    let du = SQRT_2_OVER_PI * (1.0 + 3.0 * GELU_K * x * x);
    dinp + (0.5 * (1.0 + t) + 0.5 * x * sech2 * du) * d
}

/// headroom-trainer `ops::glu::forward::<GeluTanh>` (Gemma's GeGLU), one element.
pub fn ref_geglu(g: f32, u: f32) -> f32 {
    ref_gelu(g) * u
}

/// headroom-trainer `ops::glu::backward::<GeluTanh>`, one element: the new `(dgate, dup)`.
pub fn ref_geglu_backward(dg: f32, du: f32, g: f32, u: f32, d: f32) -> (f32, f32) {
    let derivative = ref_gelu_backward(0.0, g, 1.0);
    (dg + derivative * u * d, du + ref_gelu(g) * d)
}

/// headroom-offload `reference::adamw_step` (PyTorch's single-tensor AdamW), transcribed:
/// fused multiply-adds in ATen's lerp and in `addcmul`, every other operation rounded alone.
pub fn ref_adamw(s: &AdamWStep, param: &mut [f32], grad: &[f32], m: &mut [f32], v: &mut [f32]) {
    for i in 0..param.len() {
        let g = grad[i];
        let p = param[i] * s.decay;
        let w = s.one_minus_beta1;
        let diff = g - m[i];
        let mi = if w.abs() < 0.5 {
            w.mul_add(diff, m[i])
        } else {
            (w - 1.0).mul_add(diff, g)
        };
        let vi = (s.one_minus_beta2 * g).mul_add(g, v[i] * s.beta2);
        let denom = vi.sqrt() / s.bc2_sqrt + s.eps;
        param[i] = p + (-s.step_size * mi) / denom;
        m[i] = mi;
        v[i] = vi;
    }
}

pub fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

pub fn lowbias32(mut x: u32) -> u32 {
    x ^= x >> 16;
    x = x.wrapping_mul(0x7feb_352d);
    x ^= x >> 15;
    x = x.wrapping_mul(0x846c_a68b);
    x ^ (x >> 16)
}

/// headroom-amp `stochastic_rounding::random_bits`, transcribed.
pub fn ref_random_bits(key: StochasticRoundingKey, index: u64) -> u16 {
    const GOLDEN: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut h = mix64(key.seed.wrapping_add(GOLDEN));
    h = mix64(h ^ key.step.wrapping_mul(GOLDEN));
    h = mix64(h ^ ((u64::from(key.tensor) << 32) | (index >> 32)));
    let (k1, k2) = ((h >> 32) as u32, h as u32);
    (lowbias32(lowbias32(index as u32 ^ k1).wrapping_add(k2)) >> 16) as u16
}

/// headroom-amp `stochastic_round_bf16_bits`, transcribed.
pub fn ref_stochastic_round(x: f32, random: u16) -> u16 {
    let b = x.to_bits();
    let is_nan = (b & 0x7fff_ffff) > 0x7f80_0000;
    let rounded = b.wrapping_add(u32::from(random)) >> 16;
    let quiet_nan = (b >> 16) | 0x0040;
    (if is_nan { quiet_nan } else { rounded }) as u16
}

/// The trainer's embedding forward.
pub fn ref_embedding_forward(
    tokens: &[u32],
    wte: &[f32],
    wpe: &[f32],
    t: usize,
    c: usize,
) -> Vec<f32> {
    let mut out = vec![0f32; tokens.len() * c];
    for (i, (o, &tok)) in out.chunks_exact_mut(c).zip(tokens).enumerate() {
        let pos = i % t;
        for j in 0..c {
            o[j] = wte[tok as usize * c + j] + wpe[pos * c + j];
        }
    }
    out
}

/// The trainer's embedding backward (rows in token order).
pub fn ref_embedding_backward(
    dwte: &mut [f32],
    dwpe: &mut [f32],
    dout: &[f32],
    tokens: &[u32],
    t: usize,
    c: usize,
) {
    for (i, (d, &tok)) in dout.chunks_exact(c).zip(tokens).enumerate() {
        let pos = i % t;
        for j in 0..c {
            dwte[tok as usize * c + j] += d[j];
            dwpe[pos * c + j] += d[j];
        }
    }
}

/// headroom-trainer `ops::rmsnorm::forward`, transcribed: (out, rstd).
pub fn ref_rmsnorm(inp: &[f32], weight: &[f32], eps: f32, c: usize) -> (Vec<f32>, Vec<f32>) {
    let mut out = vec![0f32; inp.len()];
    let mut rstd = vec![0f32; inp.len() / c];
    for ((o, x), r) in out
        .chunks_exact_mut(c)
        .zip(inp.chunks_exact(c))
        .zip(&mut rstd)
    {
        let ms = (x.iter().map(|&v| v as f64 * v as f64).sum::<f64>() / c as f64) as f32;
        let s = 1.0 / (ms + eps).sqrt();
        for i in 0..c {
            o[i] = weight[i] * (x[i] * s);
        }
        *r = s;
    }
    (out, rstd)
}

/// headroom-trainer `ops::rmsnorm::backward`, transcribed (accumulates into `dinp`,
/// `dweight`).
pub fn ref_rmsnorm_backward(
    dinp: &mut [f32],
    dweight: &mut [f32],
    dout: &[f32],
    inp: &[f32],
    weight: &[f32],
    rstd: &[f32],
    c: usize,
) {
    for (((di, d), x), &s) in dinp
        .chunks_exact_mut(c)
        .zip(dout.chunks_exact(c))
        .zip(inp.chunks_exact(c))
        .zip(rstd)
    {
        let mut dot = 0f64;
        for i in 0..c {
            dot += (weight[i] * d[i]) as f64 * (x[i] * s) as f64;
        }
        let mean = (dot / c as f64) as f32;
        for i in 0..c {
            let norm = x[i] * s;
            dweight[i] += norm * d[i];
            di[i] += (weight[i] * d[i] - norm * mean) * s;
        }
    }
}

/// headroom-trainer `ops::glu`'s σ, transcribed (through `fast_math::exp`).
fn ref_sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + ref_exp(-x))
}

/// headroom-trainer `ops::swiglu::forward`, one element.
pub fn ref_swiglu(g: f32, u: f32) -> f32 {
    g * ref_sigmoid(g) * u
}

/// headroom-trainer `ops::swiglu::backward`, one element: the new `(dgate, dup)`.
pub fn ref_swiglu_backward(dg: f32, du: f32, g: f32, u: f32, d: f32) -> (f32, f32) {
    let s = ref_sigmoid(g);
    (dg + s * (1.0 + g * (1.0 - s)) * u * d, du + g * s * d)
}

/// headroom-trainer `ops::rope::tables`, transcribed: `(cos, sin)`, `[t, hs/2]` each.
pub fn ref_rope_tables(t: usize, hs: usize, theta: f32) -> (Vec<f32>, Vec<f32>) {
    let half = hs / 2;
    let inv_freq: Vec<f32> = (0..half)
        .map(|i| 1.0 / theta.powf((2 * i) as f32 / hs as f32))
        .collect();
    let mut cos = vec![0f32; t * half];
    let mut sin = vec![0f32; t * half];
    for pos in 0..t {
        for (i, &f) in inv_freq.iter().enumerate() {
            let angle = (pos as f32 * f) as f64;
            cos[pos * half + i] = angle.cos() as f32;
            sin[pos * half + i] = angle.sin() as f32;
        }
    }
    (cos, sin)
}

/// headroom-trainer `ops::rope::apply`, transcribed (in place on `[rows, hs]`, position
/// `row % t`).
pub fn ref_rope_apply(x: &mut [f32], t: usize, hs: usize, cos: &[f32], sin: &[f32], inverse: bool) {
    let half = hs / 2;
    let sign = if inverse { -1.0f32 } else { 1.0 };
    for head in x.chunks_mut(t * hs) {
        for (pos, row) in head.chunks_exact_mut(hs).enumerate() {
            let (a, b) = row.split_at_mut(half);
            let (c, s) = (&cos[pos * half..][..half], &sin[pos * half..][..half]);
            for i in 0..half {
                let (x1, x2) = (a[i], b[i]);
                let si = sign * s[i];
                a[i] = x1 * c[i] - x2 * si;
                b[i] = x2 * c[i] + x1 * si;
            }
        }
    }
}

/// Layer norm forward in f64: (out, mean, rstd).
pub fn ref_layernorm(
    inp: &[f32],
    w: &[f32],
    b: &[f32],
    c: usize,
) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
    let (mut out, mut mean, mut rstd) = (Vec::new(), Vec::new(), Vec::new());
    for x in inp.chunks_exact(c) {
        let mu = x.iter().map(|&v| v as f64).sum::<f64>() / c as f64;
        let var = x.iter().map(|&v| (v as f64 - mu).powi(2)).sum::<f64>() / c as f64;
        let s = 1.0 / (var + 1e-5).sqrt();
        for i in 0..c {
            out.push((x[i] as f64 - mu) * s * w[i] as f64 + b[i] as f64);
        }
        mean.push(mu);
        rstd.push(s);
    }
    (out, mean, rstd)
}

/// Layer norm backward in f64 from the device's saved statistics: (dinp, dweight, dbias)
/// added to the given starting values.
#[allow(clippy::too_many_arguments)]
pub fn ref_layernorm_backward(
    dinp0: &[f32],
    dw0: &[f32],
    db0: &[f32],
    dout: &[f32],
    inp: &[f32],
    w: &[f32],
    mean: &[f32],
    rstd: &[f32],
    c: usize,
) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
    let mut dinp: Vec<f64> = dinp0.iter().map(|&v| v as f64).collect();
    let mut dw: Vec<f64> = dw0.iter().map(|&v| v as f64).collect();
    let mut db: Vec<f64> = db0.iter().map(|&v| v as f64).collect();
    for (r, (d, x)) in dout.chunks_exact(c).zip(inp.chunks_exact(c)).enumerate() {
        let (mu, s) = (mean[r] as f64, rstd[r] as f64);
        let norm: Vec<f64> = x.iter().map(|&v| (v as f64 - mu) * s).collect();
        let dnorm: Vec<f64> = (0..c).map(|i| w[i] as f64 * d[i] as f64).collect();
        let a = dnorm.iter().sum::<f64>() / c as f64;
        let b = dnorm.iter().zip(&norm).map(|(p, q)| p * q).sum::<f64>() / c as f64;
        for i in 0..c {
            db[i] += d[i] as f64;
            dw[i] += norm[i] * d[i] as f64;
            dinp[r * c + i] += (dnorm[i] - a - norm[i] * b) * s;
        }
    }
    (dinp, dw, db)
}

/// Softmax cross-entropy in f64: (losses, dlogits).
pub fn ref_cross_entropy(
    logits: &[f32],
    targets: &[u32],
    dloss: &[f32],
    v: usize,
) -> (Vec<f64>, Vec<f64>) {
    let (mut losses, mut grads) = (Vec::new(), Vec::new());
    for ((row, &t), &dl) in logits.chunks_exact(v).zip(targets).zip(dloss) {
        let max = row.iter().fold(f64::NEG_INFINITY, |a, &b| a.max(b as f64));
        let sum: f64 = row.iter().map(|&x| (x as f64 - max).exp()).sum();
        losses.push(sum.ln() + max - row[t as usize] as f64);
        for (j, &x) in row.iter().enumerate() {
            let p = (x as f64 - max).exp() / sum;
            grads.push((p - if j == t as usize { 1.0 } else { 0.0 }) * dl as f64);
        }
    }
    (losses, grads)
}

/// One element of a product and the sum of the magnitudes of its terms.
pub type Exact = (f64, f64);

/// The three products by their row-major definitions, in f64 (`a`, `b` already rounded to
/// their storage dtype): each output with Σ|terms| for the error bound.
pub fn ref_gemm(op: GemmOp, s: GemmShape, a: &[f32], b: &[f32]) -> Vec<Exact> {
    let GemmShape { m, n, k } = s;
    let dot = |terms: &mut dyn Iterator<Item = (f32, f32)>| {
        terms.fold((0.0, 0.0), |(sum, mag), (x, y)| {
            let p = x as f64 * y as f64;
            (sum + p, mag + p.abs())
        })
    };
    match op {
        GemmOp::Forward => (0..m * n)
            .map(|x| dot(&mut (0..k).map(|p| (a[(x / n) * k + p], b[(x % n) * k + p]))))
            .collect(),
        GemmOp::InputGrad => (0..m * k)
            .map(|x| dot(&mut (0..n).map(|p| (a[(x / k) * n + p], b[p * k + x % k]))))
            .collect(),
        GemmOp::WeightGrad => (0..n * k)
            .map(|x| dot(&mut (0..m).map(|p| (a[p * n + x / k], b[p * k + x % k]))))
            .collect(),
    }
}

// ------------------------------------------------------------------------------------------
// Test data and helpers.

/// Deterministic values in [-scale, scale].
pub fn values(len: usize, seed: u32, scale: f32) -> Vec<f32> {
    (0..len as u32)
        .map(|i| {
            let h = (i ^ seed.wrapping_mul(0x85eb_ca6b))
                .wrapping_mul(0x9e37_79b9)
                .rotate_left(13)
                ^ seed;
            ((h % 20_001) as f32 / 10_000.0 - 1.0) * scale
        })
        .collect()
}

/// The inputs the golden values were printed for.
pub fn golden_inputs() -> Vec<f32> {
    let mut v = vec![
        0.0f32, -0.0, 1.0, -1.0, 0.29, 0.31, -0.3, 8.99, 9.0, -9.5, 1e-30, -3.7, 20.0, -20.0, 0.5,
        2.5,
    ];
    for i in 0..48u32 {
        let h = i.wrapping_mul(0x9e37_79b9).rotate_left(7);
        v.push(((h % 20_001) as f32 - 10_000.0) * 1e-3);
    }
    v
}

pub fn round_to(dtype: DType, x: &[f32]) -> Vec<f32> {
    match dtype {
        DType::F32 => x.to_vec(),
        DType::BF16 => x.iter().map(|&v| bf16::from_f32(v).to_f32()).collect(),
        DType::F16 => x.iter().map(|&v| f16::from_f32(v).to_f32()).collect(),
        other => unreachable!("{other}"),
    }
}

pub fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

pub fn assert_bitwise(what: &str, got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            g.to_bits() == w.to_bits() || (g.is_nan() && w.is_nan()),
            "{what}[{i}]: got {g:e} ({:#x}), want {w:e} ({:#x})",
            g.to_bits(),
            w.to_bits()
        );
    }
}

/// |got − want| ≤ rel·|want| + abs, element by element.
pub fn assert_close(what: &str, got: &[f32], want: &[f64], rel: f64, abs: f64) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let err = (g as f64 - w).abs();
        assert!(
            err <= rel * w.abs() + abs,
            "{what}[{i}]: got {g:e}, want {w:e} (error {err:e}, allowed {:e})",
            rel * w.abs() + abs
        );
    }
}

// ------------------------------------------------------------------------------------------
// Attention-head permutes, as plain loops over elements.

/// Part `l.part` of the wide `[B, T, parts·NH·hs]` rows as `[B, NH, T, hs]`.
pub fn ref_split_heads<T: Clone>(wide: &[T], l: HeadLayout) -> Vec<T> {
    let c = l.heads * l.head_dim;
    let mut heads = Vec::with_capacity(l.batch * c * l.seq);
    for b in 0..l.batch {
        for h in 0..l.heads {
            for t in 0..l.seq {
                for d in 0..l.head_dim {
                    heads.push(
                        wide[(b * l.seq + t) * l.parts * c + l.part * c + h * l.head_dim + d]
                            .clone(),
                    );
                }
            }
        }
    }
    heads
}

/// `heads` `[B, NH, T, hs]` written into part `l.part` of the wide rows; the rest untouched.
pub fn ref_merge_heads<T: Clone>(wide: &mut [T], heads: &[T], l: HeadLayout) {
    let c = l.heads * l.head_dim;
    for b in 0..l.batch {
        for h in 0..l.heads {
            for t in 0..l.seq {
                for d in 0..l.head_dim {
                    wide[(b * l.seq + t) * l.parts * c + l.part * c + h * l.head_dim + d] =
                        heads[((b * l.heads + h) * l.seq + t) * l.head_dim + d].clone();
                }
            }
        }
    }
}
