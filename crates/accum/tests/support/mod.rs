//! Test support: tiny models with explicit forward and backward on the CPU backend, random
//! problems and splits, a tolerance bound, and an allocation hook that records live and peak
//! bytes per memory category.
//!
//! The models work token by token (no interaction between tokens), so a token's forward and
//! backward are bit for bit the same whatever batch it sits in; accumulated and big-batch
//! gradients can only differ by summation order and where the `1 / total` weight is applied.

#![allow(dead_code)] // each test binary uses a different part

use std::ops::Range;
use std::sync::{Arc, Mutex};

use headroom_accum::MicroBatchStats;
use headroom_tensor::{
    AllocEvent, AllocHook, Backend, BoxedError, Cpu, CpuTensor, DType, MemoryCategory, Shape,
};

/// splitmix64: small, fast, good enough for test data.
#[derive(Clone, Debug)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed ^ 0x5DEE_CE66_D1CE_4E5B)
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in [0, n).
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }
    /// Uniform in [-1, 1).
    pub fn sym(&mut self) -> f32 {
        ((self.next_u64() >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
    pub fn chance(&mut self, p: f32) -> bool {
        ((self.next_u64() >> 40) as f32 / (1u64 << 24) as f32) < p
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ModelKind {
    /// `y = W x + b`, loss `½‖y − t‖²` per token.
    LinearMse,
    /// `logits = W₂ tanh(W₁ x + b₁) + b₂`, cross-entropy per token.
    MlpCrossEntropy,
}

/// One sequence: per-token inputs, targets and loss mask.
#[derive(Clone, Debug)]
pub struct Sequence {
    pub inputs: Vec<f32>,
    pub classes: Vec<usize>,
    pub values: Vec<f32>,
    pub mask: Vec<bool>,
}

impl Sequence {
    pub fn len(&self) -> usize {
        self.mask.len()
    }
    pub fn counted(&self) -> u64 {
        self.mask.iter().filter(|&&m| m).count() as u64
    }
}

pub struct Model {
    pub kind: ModelKind,
    pub d_in: usize,
    pub hidden: usize,
    pub d_out: usize,
    /// Linear: `[W, b]`; MLP: `[W₁, b₁, W₂, b₂]`, row-major `[out, in]`.
    pub params: Vec<CpuTensor>,
}

/// What the forward kept for the backward. Dropping it frees the activations.
pub struct Saved {
    x: CpuTensor,
    hidden: Option<CpuTensor>,
    /// Softmax probabilities (MLP) or residuals `y − t` (linear).
    out: CpuTensor,
    classes: Vec<usize>,
    mask: Vec<bool>,
}

impl Saved {
    pub fn tokens(&self) -> usize {
        self.mask.len()
    }
}

/// Loss sum, counted tokens and saved tensors of one forward.
pub struct Forward {
    pub stats: MicroBatchStats,
    pub saved: Saved,
}

impl Model {
    pub fn random(
        cpu: &Cpu,
        kind: ModelKind,
        d_in: usize,
        hidden: usize,
        d_out: usize,
        rng: &mut Rng,
    ) -> Self {
        let _tag = MemoryCategory::Parameters.enter();
        let mut make = |shape: Vec<usize>, scale: f32| {
            let n: usize = shape.iter().product();
            let data: Vec<f32> = (0..n).map(|_| rng.sym() * scale).collect();
            cpu.upload(&data, shape).unwrap()
        };
        let params = match kind {
            ModelKind::LinearMse => vec![make(vec![d_out, d_in], 1.0), make(vec![d_out], 0.5)],
            ModelKind::MlpCrossEntropy => vec![
                make(vec![hidden, d_in], 1.5),
                make(vec![hidden], 0.5),
                make(vec![d_out, hidden], 1.5),
                make(vec![d_out], 0.5),
            ],
        };
        Model {
            kind,
            d_in,
            hidden,
            d_out,
            params,
        }
    }

    pub fn param_shapes(&self) -> Vec<Shape> {
        use headroom_tensor::Tensor;
        self.params.iter().map(|p| p.shape().clone()).collect()
    }

    pub fn random_sequence(&self, len: usize, counted_p: f32, rng: &mut Rng) -> Sequence {
        Sequence {
            inputs: (0..len * self.d_in).map(|_| rng.sym() * 2.0).collect(),
            classes: (0..len).map(|_| rng.below(self.d_out)).collect(),
            values: (0..len * self.d_out).map(|_| rng.sym() * 2.0).collect(),
            mask: (0..len).map(|_| rng.chance(counted_p)).collect(),
        }
    }

    fn p(&self, i: usize) -> &[f32] {
        self.params[i].as_slice::<f32>().unwrap()
    }

    /// Forward over the tokens of `seqs`, keeping what backward needs as tracked tensors:
    /// the inputs under `Data`, hidden and output activations under `Activations`.
    pub fn forward(&self, cpu: &Cpu, seqs: &[Sequence]) -> Forward {
        let n: usize = seqs.iter().map(Sequence::len).sum();
        let inputs: Vec<f32> = seqs.iter().flat_map(|s| s.inputs.iter().copied()).collect();
        let targets: Vec<f32> = seqs.iter().flat_map(|s| s.values.iter().copied()).collect();
        let classes: Vec<usize> = seqs
            .iter()
            .flat_map(|s| s.classes.iter().copied())
            .collect();
        let mask: Vec<bool> = seqs.iter().flat_map(|s| s.mask.iter().copied()).collect();
        let x = {
            let _tag = MemoryCategory::Data.enter();
            cpu.upload(&inputs, [n, self.d_in]).unwrap()
        };
        let _tag = MemoryCategory::Activations.enter();
        let mut out = cpu.zeros([n, self.d_out], DType::F32).unwrap();
        let mut loss_sum = 0f64;
        let hidden = match self.kind {
            ModelKind::LinearMse => {
                let (w, b) = (self.p(0), self.p(1));
                let o = out.as_mut_slice::<f32>().unwrap();
                for t in 0..n {
                    let xt = &inputs[t * self.d_in..(t + 1) * self.d_in];
                    let mut loss = 0f64;
                    for c in 0..self.d_out {
                        let y = dot(&w[c * self.d_in..(c + 1) * self.d_in], xt) + b[c];
                        let r = y - targets[t * self.d_out + c];
                        o[t * self.d_out + c] = r;
                        loss += 0.5 * f64::from(r) * f64::from(r);
                    }
                    if mask[t] {
                        loss_sum += loss;
                    }
                }
                None
            }
            ModelKind::MlpCrossEntropy => {
                let (w1, b1, w2, b2) = (self.p(0), self.p(1), self.p(2), self.p(3));
                let mut h = cpu.zeros([n, self.hidden], DType::F32).unwrap();
                let hs = h.as_mut_slice::<f32>().unwrap();
                let o = out.as_mut_slice::<f32>().unwrap();
                for t in 0..n {
                    let xt = &inputs[t * self.d_in..(t + 1) * self.d_in];
                    let ht = &mut hs[t * self.hidden..(t + 1) * self.hidden];
                    for (j, hj) in ht.iter_mut().enumerate() {
                        *hj = (dot(&w1[j * self.d_in..(j + 1) * self.d_in], xt) + b1[j]).tanh();
                    }
                    let ot = &mut o[t * self.d_out..(t + 1) * self.d_out];
                    for (c, oc) in ot.iter_mut().enumerate() {
                        *oc = dot(&w2[c * self.hidden..(c + 1) * self.hidden], ht) + b2[c];
                    }
                    let m = ot.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                    let mut s = 0f32;
                    for oc in ot.iter_mut() {
                        *oc = (*oc - m).exp();
                        s += *oc;
                    }
                    let logit_t = ot[classes[t]];
                    for oc in ot.iter_mut() {
                        *oc /= s;
                    }
                    if mask[t] {
                        // −log softmax = log Σ exp(l − m) − (l_t − m); ot held exp(l − m).
                        loss_sum += f64::from(s).ln() - f64::from(logit_t).ln();
                    }
                }
                Some(h)
            }
        };
        let counted = mask.iter().filter(|&&m| m).count() as u64;
        Forward {
            stats: MicroBatchStats {
                counted_tokens: counted,
                loss_sum,
            },
            saved: Saved {
                x,
                hidden,
                out,
                classes,
                mask,
            },
        }
    }

    /// Add `seed × ∂(Σ counted losses)/∂θ` into `grads` (one f32 slice per parameter). When
    /// `magnitude` is given, also add the same sums with every factor replaced by its absolute
    /// value: the scale a summation-error bound is relative to.
    pub fn backward_add(
        &self,
        saved: &Saved,
        seed: f32,
        grads: &mut [&mut [f32]],
        mut magnitude: Option<&mut [Vec<f64>]>,
    ) {
        let x = saved.x.as_slice::<f32>().unwrap();
        let out = saved.out.as_slice::<f32>().unwrap();
        let mut d_out = vec![0f32; self.d_out];
        let mut d_h = vec![0f32; self.hidden];
        let mut mag_h = vec![0f64; self.hidden];
        for t in 0..saved.tokens() {
            if !saved.mask[t] {
                continue;
            }
            let xt = &x[t * self.d_in..(t + 1) * self.d_in];
            let ot = &out[t * self.d_out..(t + 1) * self.d_out];
            for c in 0..self.d_out {
                let raw = match self.kind {
                    ModelKind::LinearMse => ot[c],
                    ModelKind::MlpCrossEntropy => {
                        ot[c] - f32::from(u8::from(c == saved.classes[t]))
                    }
                };
                d_out[c] = raw * seed;
            }
            match self.kind {
                ModelKind::LinearMse => {
                    outer_add(grads, 0, 1, &d_out, xt, magnitude.as_deref_mut(), None);
                }
                ModelKind::MlpCrossEntropy => {
                    let hs = saved.hidden.as_ref().unwrap().as_slice::<f32>().unwrap();
                    let ht = &hs[t * self.hidden..(t + 1) * self.hidden];
                    outer_add(grads, 2, 3, &d_out, ht, magnitude.as_deref_mut(), None);
                    let w2 = self.p(2);
                    for j in 0..self.hidden {
                        let mut acc = 0f32;
                        let mut mag = 0f64;
                        for c in 0..self.d_out {
                            let term = w2[c * self.hidden + j] * d_out[c];
                            acc += term;
                            mag += f64::from(term.abs());
                        }
                        let dtanh = 1.0 - ht[j] * ht[j];
                        d_h[j] = acc * dtanh;
                        mag_h[j] = mag * f64::from(dtanh.abs());
                    }
                    outer_add(
                        grads,
                        0,
                        1,
                        &d_h,
                        xt,
                        magnitude.as_deref_mut(),
                        Some(&mag_h),
                    );
                }
            }
        }
    }

    /// The gradients of `seed × Σ counted losses` as fresh f32 tensors (under `Workspace`).
    pub fn backward(&self, cpu: &Cpu, saved: &Saved, seed: f32) -> Vec<CpuTensor> {
        let _tag = MemoryCategory::Workspace.enter();
        let mut grads: Vec<CpuTensor> = self
            .param_shapes()
            .into_iter()
            .map(|s| cpu.zeros(s, DType::F32).unwrap())
            .collect();
        {
            let mut slices: Vec<&mut [f32]> = grads
                .iter_mut()
                .map(|g| g.as_mut_slice::<f32>().unwrap())
                .collect();
            self.backward_add(saved, seed, &mut slices, None);
        }
        grads
    }

    /// Big-batch reference: gradients of the mean loss over all counted tokens (seed
    /// `1/total`), their absolute magnitudes, and the loss.
    pub fn big_batch(&self, cpu: &Cpu, seqs: &[Sequence]) -> BigBatch {
        let fwd = self.forward(cpu, seqs);
        let total = fwd.stats.counted_tokens;
        let seed = (1.0 / total as f64) as f32;
        let mut grads: Vec<Vec<f32>> = self
            .param_shapes()
            .iter()
            .map(|s| vec![0f32; s.numel()])
            .collect();
        let mut magnitude: Vec<Vec<f64>> = self
            .param_shapes()
            .iter()
            .map(|s| vec![0f64; s.numel()])
            .collect();
        {
            let mut slices: Vec<&mut [f32]> = grads.iter_mut().map(Vec::as_mut_slice).collect();
            self.backward_add(&fwd.saved, seed, &mut slices, Some(&mut magnitude));
        }
        let tokens = fwd.saved.tokens();
        BigBatch {
            grads,
            magnitude,
            loss: fwd.stats.loss_sum / total as f64,
            counted_tokens: total,
            // Longest chain of rounded operations behind one gradient element: the token sum
            // plus the inner sum over outputs plus a few products and the weighting.
            chain: tokens + self.d_out + 8,
        }
    }
}

pub struct BigBatch {
    pub grads: Vec<Vec<f32>>,
    pub magnitude: Vec<Vec<f64>>,
    pub loss: f64,
    pub counted_tokens: u64,
    pub chain: usize,
}

impl BigBatch {
    /// The stated f32 tolerance for element `(p, i)`: twice the classical worst-case bound of
    /// recursive summation, `γ_n · Σ|terms|` with `γ_n ≈ n·ε`, because both sides carry it.
    pub fn tolerance(&self, p: usize, i: usize) -> f64 {
        4.0 * self.chain as f64 * f64::from(f32::EPSILON) * self.magnitude[p][i] + 1e-30
    }

    /// Largest `|got − big| / tolerance` over all elements (≤ 1 means within tolerance).
    pub fn worst_ratio(&self, got: &[Vec<f32>]) -> f64 {
        let mut worst = 0f64;
        for (p, (g, b)) in got.iter().zip(&self.grads).enumerate() {
            assert_eq!(g.len(), b.len());
            for (i, (&g, &b)) in g.iter().zip(b).enumerate() {
                let err = (f64::from(g) - f64::from(b)).abs();
                worst = worst.max(err / self.tolerance(p, i));
            }
        }
        worst
    }
}

/// `grads[w] += a ⊗ b`, `grads[bias] += a`; magnitudes alongside when asked. `mag_a` gives the
/// magnitude of `a`'s elements when they are themselves sums (the MLP's hidden gradient).
fn outer_add(
    grads: &mut [&mut [f32]],
    w: usize,
    bias: usize,
    a: &[f32],
    b: &[f32],
    magnitude: Option<&mut [Vec<f64>]>,
    mag_a: Option<&[f64]>,
) {
    for (i, &ai) in a.iter().enumerate() {
        for (j, &bj) in b.iter().enumerate() {
            grads[w][i * b.len() + j] += ai * bj;
        }
        grads[bias][i] += ai;
    }
    if let Some(m) = magnitude {
        for (i, &ai) in a.iter().enumerate() {
            let ma = mag_a.map_or(f64::from(ai.abs()), |m| m[i]);
            for (j, &bj) in b.iter().enumerate() {
                m[w][i * b.len() + j] += ma * f64::from(bj.abs());
            }
            m[bias][i] += ma;
        }
    }
}

fn dot(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

/// A random problem: model, batch (at least one counted token), and a random contiguous split
/// into uneven micro-batches.
pub struct Problem {
    pub model: Model,
    pub batch: Vec<Sequence>,
    pub split: Vec<Range<usize>>,
}

pub fn random_problem(
    cpu: &Cpu,
    seed: u64,
    kind: ModelKind,
    n_seqs: usize,
    max_len: usize,
) -> Problem {
    let mut rng = Rng::new(seed);
    let d_in = 1 + rng.below(4);
    let hidden = 1 + rng.below(6);
    let d_out = 2 + rng.below(4);
    let model = Model::random(cpu, kind, d_in, hidden, d_out, &mut rng);
    let counted_p = [0.15f32, 0.5, 0.9][rng.below(3)];
    let mut batch: Vec<Sequence> = (0..n_seqs)
        .map(|_| {
            let len = rng.below(max_len + 1);
            model.random_sequence(len, counted_p, &mut rng)
        })
        .collect();
    if batch.iter().all(|s| s.counted() == 0) {
        batch[0] = model.random_sequence(1 + rng.below(max_len), 1.0, &mut rng);
    }
    let split = random_split(n_seqs, &mut rng);
    Problem {
        model,
        batch,
        split,
    }
}

/// A random cut of `0..n` into 1..=n contiguous non-empty ranges.
pub fn random_split(n: usize, rng: &mut Rng) -> Vec<Range<usize>> {
    let mut cuts: Vec<usize> = (1..n).filter(|_| rng.chance(0.5)).collect();
    cuts.insert(0, 0);
    cuts.push(n);
    cuts.windows(2).map(|w| w[0]..w[1]).collect()
}

pub fn download_all(cpu: &Cpu, tensors: &[CpuTensor]) -> Vec<Vec<f32>> {
    tensors
        .iter()
        .map(|t| cpu.download::<f32>(t).unwrap())
        .collect()
}

/// Live and peak bytes, and allocation count, per memory category.
#[derive(Default)]
pub struct CategoryTracker {
    state: Mutex<[(usize, usize, usize); 7]>,
}

fn slot(c: MemoryCategory) -> usize {
    MemoryCategory::ALL.iter().position(|&x| x == c).unwrap()
}

impl CategoryTracker {
    pub fn new() -> Arc<Self> {
        Arc::new(Self::default())
    }
    pub fn live(&self, c: MemoryCategory) -> usize {
        self.state.lock().unwrap()[slot(c)].0
    }
    pub fn peak(&self, c: MemoryCategory) -> usize {
        self.state.lock().unwrap()[slot(c)].1
    }
    pub fn allocations(&self, c: MemoryCategory) -> usize {
        self.state.lock().unwrap()[slot(c)].2
    }
    /// Forget the peaks (live bytes stay), to measure a phase on its own.
    pub fn reset_peaks(&self) {
        for s in self.state.lock().unwrap().iter_mut() {
            s.1 = s.0;
        }
    }
}

impl AllocHook for CategoryTracker {
    fn on_alloc(&self, e: &AllocEvent) -> Result<(), BoxedError> {
        let mut s = self.state.lock().unwrap();
        let c = &mut s[slot(e.category)];
        c.0 += e.bytes;
        c.1 = c.1.max(c.0);
        c.2 += 1;
        Ok(())
    }
    fn on_free(&self, e: &AllocEvent) {
        self.state.lock().unwrap()[slot(e.category)].0 -= e.bytes;
    }
}
