//! Backward against central finite differences, forward against a plain reference, and the
//! dropout mask's properties. The adapted output is linear in each of x, A and B (the others
//! fixed), so central differences are exact up to f32 rounding of the forward: a large step
//! (0.5) keeps that rounding far below the tolerance.

use headroom_lora::{DenseLinear, FrozenLinear, LoraConfig, LoraLinear, Mode};
use headroom_tensor::{Cpu, Tensor};
use proptest::prelude::*;

fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

struct Case {
    rows: usize,
    out_f: usize,
    in_f: usize,
    weight: Vec<f32>,
    bias: Vec<f32>,
    x: Vec<f32>,
    /// dL/dy: the loss is Σ y ⊙ w.
    w: Vec<f32>,
    lora: LoraLinear,
}

fn case(
    rows: usize,
    out_f: usize,
    in_f: usize,
    r: usize,
    dropout: f32,
    rslora: bool,
    seed: u64,
) -> Case {
    let cpu = Cpu::new();
    let mut config = LoraConfig::new(r, 3.0, ["proj"]);
    config.dropout = dropout;
    config.use_rslora = rslora;
    config.seed = seed;
    let mut lora = LoraLinear::new(&cpu, "layers.0.proj", out_f, in_f, &config).unwrap();
    let b = values(out_f * r, seed + 7);
    lora.params_mut().1.copy_from_slice(&b);
    Case {
        rows,
        out_f,
        in_f,
        weight: values(out_f * in_f, seed + 1),
        bias: values(out_f, seed + 2),
        x: values(rows * in_f, seed + 3),
        w: values(rows * out_f, seed + 4),
        lora,
    }
}

impl Case {
    fn base(&self) -> DenseLinear<'_> {
        DenseLinear::new(&self.weight, Some(&self.bias), self.out_f, self.in_f).unwrap()
    }
    fn loss(&self, x: &[f32], lora: &LoraLinear, mode: Mode) -> f64 {
        let mut y = vec![0.0; self.rows * self.out_f];
        lora.forward(&self.base(), x, &mut y, self.rows, mode)
            .unwrap();
        y.iter()
            .zip(&self.w)
            .map(|(y, w)| f64::from(*y) * f64::from(*w))
            .sum()
    }
}

const EPS: f32 = 0.5;

fn close(analytic: f32, numeric: f64, scale: f64, what: &str) {
    let tol = 1e-4 * (1.0 + scale);
    assert!(
        (f64::from(analytic) - numeric).abs() <= tol,
        "{what}: analytic {analytic} vs finite difference {numeric} (tolerance {tol})"
    );
}

fn check_gradients(mut c: Case, mode: Mode) {
    let base_weight = c.weight.clone();
    let mut y = vec![0.0; c.rows * c.out_f];
    let saved = c
        .lora
        .forward(&c.base(), &c.x, &mut y, c.rows, mode)
        .unwrap();
    let mut grads = c.lora.alloc_grads().unwrap();
    // Start dx and the gradients away from zero: backward must accumulate.
    let dx0 = values(c.rows * c.in_f, 99);
    let mut dx = dx0.clone();
    let ga0 = values(grads.a.numel(), 98);
    let gb0 = values(grads.b.numel(), 97);
    grads.a.as_mut_slice::<f32>().unwrap().copy_from_slice(&ga0);
    grads.b.as_mut_slice::<f32>().unwrap().copy_from_slice(&gb0);
    c.lora
        .backward(&c.base(), &saved, &c.x, &c.w, &mut dx, &mut grads)
        .unwrap();
    let scale: f64 = c.w.iter().map(|v| f64::from(v.abs())).sum::<f64>() * 4.0;

    for i in 0..c.x.len() {
        let mut xp = c.x.clone();
        xp[i] += EPS;
        let mut xm = c.x.clone();
        xm[i] -= EPS;
        let fd = (c.loss(&xp, &c.lora, mode) - c.loss(&xm, &c.lora, mode)) / (2.0 * f64::from(EPS));
        close(dx[i] - dx0[i], fd, scale, &format!("dx[{i}]"));
    }
    let da = grads.a.as_slice::<f32>().unwrap().to_vec();
    for i in 0..da.len() {
        let orig = c.lora.a()[i];
        c.lora.params_mut().0[i] = orig + EPS;
        let lp = c.loss(&c.x, &c.lora, mode);
        c.lora.params_mut().0[i] = orig - EPS;
        let lm = c.loss(&c.x, &c.lora, mode);
        c.lora.params_mut().0[i] = orig;
        close(
            da[i] - ga0[i],
            (lp - lm) / (2.0 * f64::from(EPS)),
            scale,
            &format!("dA[{i}]"),
        );
    }
    let db = grads.b.as_slice::<f32>().unwrap().to_vec();
    for i in 0..db.len() {
        let orig = c.lora.b()[i];
        c.lora.params_mut().1[i] = orig + EPS;
        let lp = c.loss(&c.x, &c.lora, mode);
        c.lora.params_mut().1[i] = orig - EPS;
        let lm = c.loss(&c.x, &c.lora, mode);
        c.lora.params_mut().1[i] = orig;
        close(
            db[i] - gb0[i],
            (lp - lm) / (2.0 * f64::from(EPS)),
            scale,
            &format!("dB[{i}]"),
        );
    }
    assert_eq!(c.weight, base_weight, "the base weight is never written");
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]

    #[test]
    fn gradients_match_finite_differences(
        rows in 1usize..5, out_f in 1usize..9, in_f in 1usize..11, r in 1usize..5,
        dropout in prop_oneof![Just(0.0f32), 0.1f32..0.7], rslora: bool, seed in 0u64..1000,
        step in 0u64..5,
    ) {
        let c = case(rows, out_f, in_f, r, dropout, rslora, seed);
        check_gradients(c, Mode::Train { step, micro_batch: 1 });
    }

    #[test]
    fn zero_b_gives_the_base_output_bit_for_bit(
        rows in 0usize..6, out_f in 1usize..40, in_f in 1usize..40, r in 1usize..9,
        dropout in prop_oneof![Just(0.0f32), 0.1f32..0.9], seed in 0u64..1000, train: bool,
    ) {
        let mut c = case(rows, out_f, in_f, r, dropout, false, seed);
        c.lora.params_mut().1.fill(0.0);
        let mut y_base = vec![f32::NAN; rows * out_f];
        c.base().forward(&c.x, &mut y_base, rows).unwrap();
        let mode = if train { Mode::Train { step: seed, micro_batch: 0 } } else { Mode::Eval };
        let mut y = vec![f32::NAN; rows * out_f];
        c.lora.forward(&c.base(), &c.x, &mut y, rows, mode).unwrap();
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        prop_assert_eq!(bits(&y), bits(&y_base));
        let mut y2 = vec![f32::NAN; rows * out_f];
        c.lora.infer(&c.base(), &c.x, &mut y2, rows).unwrap();
        prop_assert_eq!(bits(&y2), bits(&y_base));
    }

    /// Forward and backward against a plain loop that uses the public dropout multipliers:
    /// the mask the backward applies is the forward's.
    #[test]
    fn forward_and_backward_use_the_same_dropout_mask(
        rows in 1usize..6, out_f in 1usize..12, in_f in 1usize..20, r in 1usize..5,
        dropout in 0.2f32..0.8, seed in 0u64..1000, step in 0u64..1000, micro in 0u64..4,
    ) {
        let c = case(rows, out_f, in_f, r, dropout, false, seed);
        let mode = Mode::Train { step, micro_batch: micro };
        let m: Vec<f32> = (0..rows * in_f).map(|i| c.lora.dropout_multiplier(mode, i)).collect();
        let keep = (1.0 / (1.0 - f64::from(dropout))) as f32;
        prop_assert!(m.iter().all(|&v| v == 0.0 || v == keep));
        let xd: Vec<f64> = c.x.iter().zip(&m).map(|(x, m)| f64::from(*x * *m)).collect();
        let (a, b, s) = (c.lora.a(), c.lora.b(), f64::from(c.lora.scaling()));
        let h: Vec<f64> = (0..rows * r).map(|i| {
            let (n, k) = (i / r, i % r);
            (0..in_f).map(|j| xd[n * in_f + j] * f64::from(a[k * in_f + j])).sum()
        }).collect();
        let mut y = vec![0.0; rows * out_f];
        let saved = c.lora.forward(&c.base(), &c.x, &mut y, rows, mode).unwrap();
        let mut y_base = vec![0.0; rows * out_f];
        c.base().forward(&c.x, &mut y_base, rows).unwrap();
        for n in 0..rows {
            for o in 0..out_f {
                let up: f64 = (0..r).map(|k| h[n * r + k] * f64::from(b[o * r + k])).sum();
                let want = f64::from(y_base[n * out_f + o]) + s * up;
                prop_assert!((f64::from(y[n * out_f + o]) - want).abs() <= 1e-4 * (1.0 + want.abs()));
            }
        }
        // dA = gᵀ·(x ⊙ M) with g = s·dy·B: only the forward's mask gives this.
        let mut grads = c.lora.alloc_grads().unwrap();
        let mut dx = vec![0.0; rows * in_f];
        c.lora.backward(&c.base(), &saved, &c.x, &c.w, &mut dx, &mut grads).unwrap();
        let g: Vec<f64> = (0..rows * r).map(|i| {
            let (n, k) = (i / r, i % r);
            s * (0..out_f).map(|o| f64::from(c.w[n * out_f + o]) * f64::from(b[o * r + k])).sum::<f64>()
        }).collect();
        let da = grads.a.as_slice::<f32>().unwrap();
        for k in 0..r {
            for j in 0..in_f {
                let want: f64 = (0..rows).map(|n| g[n * r + k] * xd[n * in_f + j]).sum();
                prop_assert!((f64::from(da[k * in_f + j]) - want).abs() <= 1e-4 * (1.0 + want.abs()));
            }
        }
        // A dropped input gets no adapter gradient: dx there is the base's alone.
        let mut dx_base = vec![0.0; rows * in_f];
        c.base().backward_input(&c.w, &mut dx_base, rows).unwrap();
        for i in 0..rows * in_f {
            if m[i] == 0.0 {
                prop_assert_eq!(dx[i].to_bits(), dx_base[i].to_bits());
            }
        }
    }
}

#[test]
fn dropout_masks_are_reproducible_and_vary_with_step_batch_and_module() {
    let cpu = Cpu::new();
    let mut config = LoraConfig::new(4, 8.0, ["q_proj", "v_proj"]);
    config.dropout = 0.3;
    config.seed = 17;
    let q = LoraLinear::new(&cpu, "l.0.q_proj", 8, 4096, &config).unwrap();
    let q_again = LoraLinear::new(&cpu, "l.0.q_proj", 8, 4096, &config).unwrap();
    let v = LoraLinear::new(&cpu, "l.0.v_proj", 8, 4096, &config).unwrap();
    let mask = |l: &LoraLinear, step, micro_batch| -> Vec<f32> {
        (0..4096)
            .map(|i| l.dropout_multiplier(Mode::Train { step, micro_batch }, i))
            .collect()
    };
    let m = mask(&q, 3, 0);
    assert_eq!(
        m,
        mask(&q_again, 3, 0),
        "same seed, step and module: same mask"
    );
    assert_ne!(m, mask(&q, 4, 0), "another step");
    assert_ne!(m, mask(&q, 3, 1), "another micro-batch");
    assert_ne!(m, mask(&v, 3, 0), "another module");
    config.seed = 18;
    let q_other_seed = LoraLinear::new(&cpu, "l.0.q_proj", 8, 4096, &config).unwrap();
    assert_ne!(m, mask(&q_other_seed, 3, 0), "another seed");
    let dropped = m.iter().filter(|&&v| v == 0.0).count() as f64 / 4096.0;
    assert!((dropped - 0.3).abs() < 0.03, "dropped fraction {dropped}");
    assert!(
        (0..4096).all(|i| q.dropout_multiplier(Mode::Eval, i) == 1.0),
        "no dropout in eval"
    );
}

#[test]
fn results_do_not_depend_on_the_thread_count() {
    let run = |threads: usize| {
        let cpu = Cpu::with_threads(threads).unwrap();
        let (rows, out_f, in_f) = (64, 96, 160);
        let mut config = LoraConfig::new(8, 16.0, ["proj"]);
        config.dropout = 0.1;
        let mut lora = LoraLinear::new(&cpu, "proj", out_f, in_f, &config).unwrap();
        lora.params_mut().1.copy_from_slice(&values(out_f * 8, 5));
        let w = values(out_f * in_f, 1);
        let base = DenseLinear::new(&w, None, out_f, in_f).unwrap();
        let x = values(rows * in_f, 2);
        let dy = values(rows * out_f, 3);
        let mode = Mode::Train {
            step: 9,
            micro_batch: 0,
        };
        let mut y = vec![0.0; rows * out_f];
        let saved = lora.forward(&base, &x, &mut y, rows, mode).unwrap();
        let mut grads = lora.alloc_grads().unwrap();
        let mut dx = vec![0.0; rows * in_f];
        lora.backward(&base, &saved, &x, &dy, &mut dx, &mut grads)
            .unwrap();
        let mut merged = w.clone();
        lora.merge_into(&mut merged, headroom_lora::WeightLayout::OutIn)
            .unwrap();
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        (
            bits(&y),
            bits(&dx),
            bits(grads.a.as_slice::<f32>().unwrap()),
            bits(grads.b.as_slice::<f32>().unwrap()),
            bits(&merged),
        )
    };
    let one = run(1);
    assert_eq!(one, run(2));
    assert_eq!(one, run(3));
}

#[test]
fn wrong_lengths_are_errors() {
    let c = case(2, 3, 4, 2, 0.0, false, 1);
    let mut y = vec![0.0; 6];
    assert!(c
        .lora
        .forward(&c.base(), &c.x[..7], &mut y, 2, Mode::Eval)
        .is_err());
    assert!(c
        .lora
        .forward(&c.base(), &c.x, &mut y[..5], 2, Mode::Eval)
        .is_err());
    let other = DenseLinear::new(&c.weight[..8], None, 2, 4).unwrap();
    let err = c
        .lora
        .forward(&other, &c.x, &mut y, 2, Mode::Eval)
        .unwrap_err();
    assert!(
        matches!(err, headroom_lora::LoraError::ShapeMismatch { .. }),
        "{err}"
    );
    let saved = c
        .lora
        .forward(&c.base(), &c.x, &mut y, 2, Mode::Eval)
        .unwrap();
    let mut grads = c.lora.alloc_grads().unwrap();
    let mut dx = vec![0.0; 7];
    assert!(c
        .lora
        .backward(&c.base(), &saved, &c.x, &c.w, &mut dx, &mut grads)
        .is_err());
    assert!(DenseLinear::new(&c.weight, None, 5, 4).is_err());
}
