//! Merge / unmerge, PEFT's initialisation, and target matching.

use headroom_lora::{
    DenseLinear, FrozenLinear, LoraAdapter, LoraConfig, LoraError, LoraLinear, WeightLayout,
};
use headroom_tensor::Cpu;
use proptest::prelude::*;

fn values(n: usize, seed: u64, amp: f32) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0) * amp
        })
        .collect()
}

/// One unit in the last place of `x` (f32).
fn ulp(x: f32) -> f32 {
    let x = x.abs();
    f32::from_bits(x.to_bits() + 1) - x
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(32))]

    /// The merged weight's output equals the adapter's (within f32 rounding of two
    /// differently ordered sums), unmerge restores the base within the documented bound,
    /// and the `[in, out]` layout gives the transpose of the `[out, in]` result bit for bit.
    #[test]
    fn merge_matches_the_adapter_and_unmerge_restores_the_base(
        rows in 1usize..6, out_f in 1usize..48, in_f in 1usize..300, r in 1usize..9,
        alpha in 1.0f32..64.0, rslora: bool, seed in 0u64..1000, b_amp in 0.01f32..3.0,
    ) {
        let cpu = Cpu::new();
        let mut config = LoraConfig::new(r, alpha, ["fc"]);
        config.use_rslora = rslora;
        config.seed = seed;
        let mut lora = LoraLinear::new(&cpu, "h.0.fc", out_f, in_f, &config).unwrap();
        lora.params_mut().1.copy_from_slice(&values(out_f * r, seed + 1, b_amp));
        let w = values(out_f * in_f, seed + 2, 0.5);
        let x = values(rows * in_f, seed + 3, 1.0);
        let base = DenseLinear::new(&w, None, out_f, in_f).unwrap();
        let mut y_adapter = vec![0.0; rows * out_f];
        lora.infer(&base, &x, &mut y_adapter, rows).unwrap();

        let mut merged = w.clone();
        lora.merge_into(&mut merged, WeightLayout::OutIn).unwrap();
        let merged_base = DenseLinear::new(&merged, None, out_f, in_f).unwrap();
        let mut y_merged = vec![0.0; rows * out_f];
        merged_base.forward(&x, &mut y_merged, rows).unwrap();
        // Both are sums of in_f + r products of magnitude ≲ Σ|x|·(|w| + |Δ|): bound by
        // k·ε·Σ|terms|.
        let a = lora.a();
        let b = lora.b();
        let s = lora.scaling();
        for n in 0..rows {
            for o in 0..out_f {
                let mut mag = 0f64;
                for j in 0..in_f {
                    let d: f32 = (0..r).map(|k| (b[o * r + k] * a[k * in_f + j]).abs()).sum();
                    mag += f64::from(x[n * in_f + j].abs()) * f64::from(w[o * in_f + j].abs() + s * d);
                }
                let tol = 4.0 * (in_f + r) as f64 * f64::from(f32::EPSILON) * mag + 1e-30;
                let diff = f64::from((y_merged[n * out_f + o] - y_adapter[n * out_f + o]).abs());
                prop_assert!(diff <= tol, "({n}, {o}): {diff} > {tol}");
            }
        }

        let mut transposed: Vec<f32> = (0..in_f * out_f).map(|i| w[(i % out_f) * in_f + i / out_f]).collect();
        lora.merge_into(&mut transposed, WeightLayout::InOut).unwrap();
        for o in 0..out_f {
            for j in 0..in_f {
                prop_assert_eq!(transposed[j * out_f + o].to_bits(), merged[o * in_f + j].to_bits());
            }
        }

        let mut restored = merged.clone();
        lora.unmerge_from(&mut restored, WeightLayout::OutIn).unwrap();
        for i in 0..w.len() {
            let bound = ulp(w[i].abs().max(merged[i].abs()));
            prop_assert!((restored[i] - w[i]).abs() <= bound, "{i}: {} vs {}", restored[i], w[i]);
        }
        lora.unmerge_from(&mut transposed, WeightLayout::InOut).unwrap();
        for o in 0..out_f {
            for j in 0..in_f {
                prop_assert_eq!(transposed[j * out_f + o].to_bits(), restored[o * in_f + j].to_bits());
            }
        }
    }
}

#[test]
fn merge_with_zero_b_changes_nothing() {
    let cpu = Cpu::new();
    let lora = LoraLinear::new(&cpu, "fc", 7, 13, &LoraConfig::new(4, 8.0, ["fc"])).unwrap();
    let w = values(7 * 13, 3, 1.0);
    let mut m = w.clone();
    lora.merge_into(&mut m, WeightLayout::OutIn).unwrap();
    assert_eq!(m, w);
    lora.unmerge_from(&mut m, WeightLayout::OutIn).unwrap();
    assert_eq!(m, w);
    assert!(lora.merge_into(&mut m[..90], WeightLayout::OutIn).is_err());
}

/// `kaiming_uniform_(a=√5)` on `[r, in]`: uniform on [-1/√in, 1/√in); B zero; a pure
/// function of (seed, module name).
#[test]
fn initialisation_is_peft_kaiming_uniform_and_deterministic() {
    let cpu = Cpu::new();
    let (out_f, in_f, r) = (32, 1024, 16);
    let mut config = LoraConfig::new(r, 32.0, ["q_proj"]);
    config.seed = 5;
    let l = LoraLinear::new(&cpu, "m.q_proj", out_f, in_f, &config).unwrap();
    let bound = 1.0 / (in_f as f32).sqrt();
    let a = l.a();
    assert_eq!(a.len(), r * in_f);
    assert!(a.iter().all(|v| v.abs() <= bound));
    let n = a.len() as f64;
    let mean = a.iter().map(|&v| f64::from(v)).sum::<f64>() / n;
    let var = a
        .iter()
        .map(|&v| (f64::from(v) - mean).powi(2))
        .sum::<f64>()
        / n;
    let want_var = f64::from(bound).powi(2) / 3.0;
    assert!(mean.abs() < 0.02 * f64::from(bound), "mean {mean}");
    assert!(
        (var / want_var - 1.0).abs() < 0.03,
        "variance {var} vs {want_var}"
    );
    // The extremes of the range are reached (uniform, not normal).
    assert!(a.iter().any(|&v| v > 0.99 * bound) && a.iter().any(|&v| v < -0.99 * bound));
    assert!(l.b().iter().all(|&v| v == 0.0));
    assert_eq!(l.b().len(), out_f * r);

    let again = LoraLinear::new(&cpu, "m.q_proj", out_f, in_f, &config).unwrap();
    assert_eq!(again.a(), a);
    let other_module = LoraLinear::new(&cpu, "m.k_proj", out_f, in_f, &config).unwrap();
    assert_ne!(other_module.a(), a);
    config.seed = 6;
    let other_seed = LoraLinear::new(&cpu, "m.q_proj", out_f, in_f, &config).unwrap();
    assert_ne!(other_seed.a(), a);
}

#[test]
fn scaling_is_alpha_over_r_or_over_sqrt_r() {
    let mut c = LoraConfig::new(16, 32.0, ["q_proj"]);
    assert_eq!(c.scaling(), 2.0);
    c.use_rslora = true;
    assert_eq!(c.scaling(), 8.0);
    c.r = 3;
    assert_eq!(c.scaling(), (32.0f64 / 3f64.sqrt()) as f32);
}

#[test]
fn target_matching_follows_peft() {
    let mut c = LoraConfig::new(4, 8.0, ["q_proj", "mlp.down_proj", "lm_head"]);
    for (name, want) in [
        ("model.layers.0.self_attn.q_proj", true),
        ("q_proj", true),
        ("model.layers.0.self_attn.xq_proj", false),
        ("model.layers.0.self_attn.q_proj.base", false),
        ("model.layers.3.mlp.down_proj", true),
        ("model.layers.3.down_proj", false),
        ("model.layers.3.mlpx.down_proj", false),
        ("lm_head", true),
        ("model.layers.0.self_attn.k_proj", false),
        ("", false),
    ] {
        assert_eq!(c.matches(name), want, "{name}");
    }
    c.exclude_modules = vec!["layers.1.self_attn.q_proj".into()];
    assert!(!c.matches("model.layers.1.self_attn.q_proj"));
    assert!(c.matches("model.layers.11.self_attn.q_proj"));
    // Names are never patterns.
    let regex = LoraConfig::new(4, 8.0, [".*q_proj"]);
    assert!(!regex.matches("model.layers.0.self_attn.q_proj"));
}

#[test]
fn an_adapter_covers_exactly_the_targeted_modules() {
    let cpu = Cpu::new();
    let modules = [
        ("model.layers.0.self_attn.q_proj", 32, 32),
        ("model.layers.0.self_attn.k_proj", 16, 32),
        ("model.layers.0.self_attn.v_proj", 16, 32),
        ("model.layers.0.mlp.down_proj", 32, 72),
    ];
    let adapter =
        LoraAdapter::new(&cpu, LoraConfig::new(4, 8.0, ["q_proj", "v_proj"]), modules).unwrap();
    let names: Vec<&str> = adapter.iter().map(|(n, _)| n).collect();
    assert_eq!(
        names,
        [
            "model.layers.0.self_attn.q_proj",
            "model.layers.0.self_attn.v_proj"
        ]
    );
    let v = adapter.get("model.layers.0.self_attn.v_proj").unwrap();
    assert_eq!((v.out_features(), v.in_features(), v.rank()), (16, 32, 4));
    let mem = adapter.memory(2);
    assert_eq!(mem.parameters, 4 * (32 + 32) + 4 * (32 + 16));
    assert_eq!(mem.optimizer_bytes, 2 * 4 * mem.parameters);
    adapter.check_base(modules).unwrap();
    let err = adapter.check_base([modules[0]]).unwrap_err();
    assert!(
        matches!(err, LoraError::UnknownModule { ref module } if module.ends_with("v_proj")),
        "{err}"
    );
    let err = adapter
        .check_base([
            modules[0],
            modules[2],
            ("model.layers.1.self_attn.q_proj", 32, 32),
        ])
        .unwrap_err();
    assert!(matches!(err, LoraError::MissingModule { .. }), "{err}");
    let err = adapter
        .check_base([modules[0], ("model.layers.0.self_attn.v_proj", 8, 32)])
        .unwrap_err();
    assert!(matches!(err, LoraError::ShapeMismatch { .. }), "{err}");

    let err = LoraAdapter::new(&cpu, LoraConfig::new(4, 8.0, ["o_proj"]), modules).unwrap_err();
    assert!(matches!(err, LoraError::NoTargetMatched { .. }), "{err}");
}

#[test]
fn invalid_configurations_are_refused() {
    let cpu = Cpu::new();
    let mut bad = vec![
        LoraConfig::new(0, 8.0, ["q"]),
        LoraConfig::new(headroom_lora::MAX_RANK + 1, 8.0, ["q"]),
        LoraConfig::new(4, f32::NAN, ["q"]),
        LoraConfig::new(4, 8.0, Vec::<String>::new()),
        LoraConfig::new(4, 8.0, [""]),
    ];
    for p in [1.0, -0.1, f32::NAN] {
        let mut c = LoraConfig::new(4, 8.0, ["q"]);
        c.dropout = p;
        bad.push(c);
    }
    for c in bad {
        let err = LoraLinear::new(&cpu, "q", 2, 2, &c).unwrap_err();
        assert!(matches!(err, LoraError::InvalidConfig(_)), "{c:?}: {err}");
    }
}
