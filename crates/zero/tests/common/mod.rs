//! Helpers shared by the integration tests: rank threads and a plain AdamW.
#![allow(dead_code)]

use std::sync::Arc;
use std::time::Duration;

use headroom_tensor::BoxedError;
use headroom_zero::{InProcessComm, InProcessGroup, ShardOptimizer, UpdatePiece};

/// Run `f` on `n` rank threads of a fresh in-process group; results in rank order.
pub fn run_ranks<T, F>(n: usize, f: F) -> Vec<T>
where
    T: Send + 'static,
    F: Fn(InProcessComm) -> T + Send + Sync + 'static,
{
    let comms = InProcessGroup::create(n, Duration::from_secs(120)).expect("group");
    let f = Arc::new(f);
    let threads: Vec<_> = comms
        .into_iter()
        .map(|c| {
            let f = f.clone();
            std::thread::spawn(move || f(c))
        })
        .collect();
    threads
        .into_iter()
        .map(|t| t.join().expect("rank thread panicked"))
        .collect()
}

/// torch.optim.AdamW's update, elementwise: decoupled weight decay on tensor 0 of each layer
/// (the weight), none on the others (biases). State per element: `[m, v]`.
#[derive(Clone, Debug)]
pub struct AdamW {
    pub lr: f32,
    pub beta1: f32,
    pub beta2: f32,
    pub eps: f32,
    pub weight_decay: f32,
}

impl Default for AdamW {
    fn default() -> Self {
        AdamW {
            lr: 1e-2,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.1,
        }
    }
}

impl ShardOptimizer for AdamW {
    fn state_per_param(&self) -> usize {
        2
    }

    fn update(
        &mut self,
        piece: &UpdatePiece,
        params: &mut [f32],
        grads: &[f32],
        state: &mut [f32],
    ) -> Result<(), BoxedError> {
        let t = i32::try_from(piece.step)?;
        let bc1 = 1.0 - self.beta1.powi(t);
        let bc2_sqrt = (1.0 - self.beta2.powi(t)).sqrt();
        let wd = if piece.tensor == 0 {
            self.weight_decay
        } else {
            0.0
        };
        // Planar state: the piece's m, then its v.
        let (m, v) = state.split_at_mut(params.len());
        for (((p, &g), m), v) in params.iter_mut().zip(grads).zip(m).zip(v) {
            *p -= self.lr * wd * *p;
            *m = self.beta1 * *m + (1.0 - self.beta1) * g;
            *v = self.beta2 * *v + (1.0 - self.beta2) * g * g;
            let denom = v.sqrt() / bc2_sqrt + self.eps;
            *p -= (self.lr / bc1) * *m / denom;
        }
        Ok(())
    }
}

/// A small deterministic generator (SplitMix64).
pub struct Rng(pub u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed)
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in [-1, 1).
    pub fn uniform(&mut self) -> f32 {
        ((self.next_u64() >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
    pub fn vec(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| self.uniform()).collect()
    }
}

/// One training step of a trainer over a chain: for every micro-batch, a forward pass
/// (gather, prefetch the next layer, read the parameters, release) and a backward pass in
/// reverse (gather, prefetch the previous layer, push the gradients, release), then `step`.
/// Gradients are `grad(layer, tensor, micro)` filled with a constant.
pub fn drive_step(
    zero: &mut headroom_zero::ZeroEngine,
    sizes: &[Vec<usize>],
    micro_batches: usize,
    opt: &mut dyn ShardOptimizer,
) {
    let n = sizes.len();
    for micro in 0..micro_batches {
        for (l, layer) in sizes.iter().enumerate() {
            zero.gather(l).unwrap();
            if l + 1 < n {
                zero.prefetch(l + 1).unwrap();
            }
            let len = match zero.config().precision {
                headroom_zero::Precision::Fp32 => zero.params(l).unwrap().len(),
                headroom_zero::Precision::MixedBf16 => zero.params_bf16(l).unwrap().len(),
            };
            assert_eq!(len, layer.iter().sum::<usize>());
            zero.release(l).unwrap();
        }
        for l in (0..n).rev() {
            zero.gather(l).unwrap();
            if l > 0 {
                zero.prefetch(l - 1).unwrap();
            }
            let grads: Vec<Vec<f32>> = sizes[l]
                .iter()
                .enumerate()
                .map(|(t, &len)| vec![0.001 * (1 + l + t + micro) as f32; len])
                .collect();
            let refs: Vec<&[f32]> = grads.iter().map(Vec::as_slice).collect();
            zero.push_grads(l, &refs).unwrap();
            zero.release(l).unwrap();
        }
    }
    zero.step(opt).unwrap();
}
