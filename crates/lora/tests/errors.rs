//! Corrupt or mismatched adapters are typed errors, each named by what is wrong.

use std::collections::HashMap;

use headroom_lora::{LoraAdapter, LoraConfig, LoraError};
use headroom_tensor::Cpu;
use safetensors::tensor::{Dtype, TensorView};
use serde_json::{json, Value};

/// A tensor as the test builds it: name, dtype, shape, little-endian bytes.
type Raw = (String, Dtype, Vec<usize>, Vec<u8>);

fn valid() -> (Value, Vec<Raw>) {
    let config = json!({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": 2, "lora_alpha": 4,
        "lora_dropout": 0.05, "target_modules": ["q_proj"], "use_rslora": false,
        "bias": "none", "fan_in_fan_out": false, "init_lora_weights": true,
        "rank_pattern": {}, "alpha_pattern": {}, "use_dora": false, "modules_to_save": null,
    });
    let f32s = |n: usize| {
        (0..n)
            .flat_map(|i| (i as f32 * 0.25).to_le_bytes())
            .collect::<Vec<u8>>()
    };
    let tensors = vec![
        (
            "base_model.model.l.0.q_proj.lora_A.weight".to_owned(),
            Dtype::F32,
            vec![2, 3],
            f32s(6),
        ),
        (
            "base_model.model.l.0.q_proj.lora_B.weight".to_owned(),
            Dtype::F32,
            vec![5, 2],
            f32s(10),
        ),
    ];
    (config, tensors)
}

fn weights(tensors: &[Raw]) -> Vec<u8> {
    let views: Vec<(String, TensorView<'_>)> = tensors
        .iter()
        .map(|(n, d, s, b)| (n.clone(), TensorView::new(*d, s.clone(), b).unwrap()))
        .collect();
    safetensors::serialize(views, None::<HashMap<String, String>>).unwrap()
}

fn load(config: &Value, tensors: &[Raw]) -> Result<LoraAdapter, LoraError> {
    LoraAdapter::from_peft_bytes(
        &Cpu::new(),
        config.to_string().as_bytes(),
        &weights(tensors),
    )
}

#[test]
fn the_valid_adapter_loads() {
    let (c, t) = valid();
    let a = load(&c, &t).unwrap();
    let l = a.get("l.0.q_proj").unwrap();
    assert_eq!((l.rank(), l.in_features(), l.out_features()), (2, 3, 5));
    assert_eq!(l.a(), [0.0, 0.25, 0.5, 0.75, 1.0, 1.25]);
    assert_eq!(a.config().dropout, 0.05);
    assert_eq!(l.scaling(), 2.0);
}

#[test]
fn bf16_and_f16_tensors_are_widened_exactly() {
    let (c, mut t) = valid();
    let bf = |n: usize| {
        (0..n)
            .flat_map(|i| half::bf16::from_f32(i as f32 * 0.25).to_le_bytes())
            .collect::<Vec<u8>>()
    };
    let hf = |n: usize| {
        (0..n)
            .flat_map(|i| half::f16::from_f32(i as f32 * 0.25).to_le_bytes())
            .collect::<Vec<u8>>()
    };
    t[0].1 = Dtype::BF16;
    t[0].3 = bf(6);
    t[1].1 = Dtype::F16;
    t[1].3 = hf(10);
    let a = load(&c, &t).unwrap();
    let l = a.get("l.0.q_proj").unwrap();
    assert_eq!(l.a(), [0.0, 0.25, 0.5, 0.75, 1.0, 1.25]);
    assert_eq!(l.b()[9], 2.25);
}

#[test]
fn tensor_problems_are_typed_errors() {
    let (c, t) = valid();
    let check = |tensors: &[Raw], want: &str| {
        let err = load(&c, tensors).unwrap_err();
        assert!(
            format!("{err:?}").starts_with(want),
            "wanted {want}, got {err:?}"
        );
    };
    check(&t[..1], "MissingTensor");
    check(&t[1..], "MissingTensor");
    let mut extra = t.clone();
    extra.push((
        "base_model.model.l.0.q_proj.lora_magnitude_vector".into(),
        Dtype::F32,
        vec![5],
        vec![0; 20],
    ));
    check(&extra, "UnexpectedTensor");
    let mut other = t.clone();
    other.push((
        "base_model.model.l.0.k_proj.lora_A.weight".into(),
        Dtype::F32,
        vec![2, 3],
        vec![0; 24],
    ));
    other.push((
        "base_model.model.l.0.k_proj.lora_B.weight".into(),
        Dtype::F32,
        vec![5, 2],
        vec![0; 40],
    ));
    check(&other, "NotTargeted");
    let mut rank = t.clone();
    rank[0].2 = vec![3, 2];
    check(&rank, "RankMismatch");
    let mut rank_b = t.clone();
    rank_b[1].2 = vec![2, 5];
    check(&rank_b, "RankMismatch");
    let mut three_d = t.clone();
    three_d[0].2 = vec![2, 3, 1];
    check(&three_d, "ShapeMismatch");
    let mut dtype = t.clone();
    dtype[0].1 = Dtype::I32;
    check(&dtype, "UnsupportedDType");
    let mut f64s = t.clone();
    f64s[1].1 = Dtype::F64;
    f64s[1].2 = vec![5, 2];
    f64s[1].3 = vec![0; 80];
    check(&f64s, "UnsupportedDType");
    check(&[], "NoTargetMatched");
    let err =
        LoraAdapter::from_peft_bytes(&Cpu::new(), c.to_string().as_bytes(), b"not safetensors")
            .unwrap_err();
    assert!(matches!(err, LoraError::Safetensors(_)), "{err:?}");
}

#[test]
fn configuration_problems_are_typed_errors() {
    let (c, t) = valid();
    let with = |k: &str, v: Value| {
        let mut c = c.clone();
        c[k] = v;
        c
    };
    let without = |k: &str| {
        let mut c = c.clone();
        c.as_object_mut().unwrap().remove(k);
        c
    };
    let cases: Vec<(Value, &str)> = vec![
        (with("peft_type", json!("IA3")), "Unsupported"),
        (without("peft_type"), "Json"),
        (with("r", json!(0)), "InvalidConfig"),
        (with("r", json!(-2)), "Json"),
        (with("r", json!(2.5)), "Json"),
        (with("r", json!(1u64 << 40)), "InvalidConfig"),
        (without("r"), "Json"),
        (with("lora_alpha", json!("8")), "Json"),
        (with("lora_alpha", json!(1e300)), "InvalidConfig"),
        (with("lora_dropout", json!(1.0)), "InvalidConfig"),
        (with("lora_dropout", json!(-0.5)), "InvalidConfig"),
        (with("target_modules", json!(".*q_proj")), "Unsupported"),
        (with("target_modules", json!(null)), "Unsupported"),
        (with("target_modules", json!([1, 2])), "Json"),
        (with("target_modules", json!([])), "InvalidConfig"),
        (with("bias", json!("all")), "Unsupported"),
        (with("use_dora", json!(true)), "Unsupported"),
        (with("rank_pattern", json!({"q_proj": 8})), "Unsupported"),
        (with("alpha_pattern", json!({"q_proj": 8})), "Unsupported"),
        (with("modules_to_save", json!(["lm_head"])), "Unsupported"),
        (with("layers_to_transform", json!([0])), "Unsupported"),
        (with("init_lora_weights", json!("pissa")), "Unsupported"),
        (with("use_rslora", json!("yes")), "Json"),
        (with("task_type", json!(3)), "Json"),
        (json!([1, 2, 3]), "Json"),
    ];
    for (config, want) in cases {
        let err = load(&config, &t).unwrap_err();
        assert!(
            format!("{err:?}").starts_with(want),
            "{config}: wanted {want}, got {err:?}"
        );
    }
    let err = LoraAdapter::from_peft_bytes(&Cpu::new(), b"{\"peft_type\": \"LORA\",", &weights(&t))
        .unwrap_err();
    assert!(matches!(err, LoraError::Json(_)), "{err:?}");
}

/// GPT-2's Conv1D modules: PEFT saves `fan_in_fan_out: true` and the same `[r, in]` /
/// `[out, r]` tensors, so the adapter loads unchanged and the flag survives a round trip.
#[test]
fn fan_in_fan_out_adapters_load_and_keep_the_flag() {
    let (mut c, t) = valid();
    c["fan_in_fan_out"] = json!(true);
    let a = load(&c, &t).unwrap();
    assert!(a.config().fan_in_fan_out);
    let (config, weights) = a.to_peft_bytes().unwrap();
    let again = LoraAdapter::from_peft_bytes(&Cpu::new(), &config, &weights).unwrap();
    assert!(again.config().fan_in_fan_out);
}

#[test]
fn missing_files_are_io_errors() {
    let dir = tempfile::tempdir().unwrap();
    let err = LoraAdapter::load(&Cpu::new(), dir.path()).unwrap_err();
    assert!(matches!(err, LoraError::Io { .. }), "{err:?}");
    let big = dir.path().join(headroom_lora::CONFIG_FILE);
    std::fs::write(
        &big,
        vec![b' '; headroom_lora::MAX_CONFIG_BYTES as usize + 1],
    )
    .unwrap();
    let err = LoraAdapter::load(&Cpu::new(), dir.path()).unwrap_err();
    assert!(matches!(err, LoraError::TooLarge { .. }), "{err:?}");
}

/// A file that reports no size (here `/dev/zero`) would be read until memory runs out: either
/// adapter file that is not a regular file is an I/O error naming it.
#[cfg(unix)]
#[test]
fn device_files_are_refused_without_reading_them() {
    let (c, t) = valid();
    for (device, other) in [
        (headroom_lora::CONFIG_FILE, headroom_lora::WEIGHTS_FILE),
        (headroom_lora::WEIGHTS_FILE, headroom_lora::CONFIG_FILE),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let content = if other == headroom_lora::CONFIG_FILE {
            c.to_string().into_bytes()
        } else {
            weights(&t)
        };
        std::fs::write(dir.path().join(other), content).unwrap();
        std::os::unix::fs::symlink("/dev/zero", dir.path().join(device)).unwrap();
        let err = LoraAdapter::load(&Cpu::new(), dir.path()).unwrap_err();
        match &err {
            LoraError::Io { path, source } => {
                assert!(path.ends_with(device), "{err:?}");
                assert!(source.to_string().contains("not a regular file"), "{err:?}");
            }
            other => panic!("{device}: {other:?}"),
        }
    }
    // The same files, regular, load.
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join(headroom_lora::CONFIG_FILE), c.to_string()).unwrap();
    std::fs::write(dir.path().join(headroom_lora::WEIGHTS_FILE), weights(&t)).unwrap();
    LoraAdapter::load(&Cpu::new(), dir.path()).unwrap();
}

#[test]
fn from_modules_checks_targets_and_rank() {
    let cpu = Cpu::new();
    let config = LoraConfig::new(2, 4.0, ["q_proj"]);
    let k = headroom_lora::LoraLinear::new(
        &cpu,
        "l.k_proj",
        3,
        3,
        &LoraConfig::new(2, 4.0, ["k_proj"]),
    )
    .unwrap();
    let err = LoraAdapter::from_modules(config.clone(), [k]).unwrap_err();
    assert!(matches!(err, LoraError::NotTargeted { .. }), "{err:?}");
    let q4 = headroom_lora::LoraLinear::new(
        &cpu,
        "l.q_proj",
        3,
        3,
        &LoraConfig::new(4, 4.0, ["q_proj"]),
    )
    .unwrap();
    let err = LoraAdapter::from_modules(config, [q4]).unwrap_err();
    assert!(matches!(err, LoraError::RankMismatch { .. }), "{err:?}");
}
