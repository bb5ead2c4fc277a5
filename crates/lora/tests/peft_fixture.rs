//! Adapters written by PEFT itself (`benches/torch/make_lora_fixture.py`): headroom reads
//! them, reproduces each adapted module's output from the base weight (read straight from
//! the tiny Llama's `model.safetensors`) and writes adapters that read back identical.
//!
//! Tolerance: headroom and torch sum the same products in different orders, so a module
//! output may differ by a few f32 roundings of its magnitude; asserted as
//! `|Δ| ≤ 1e-5 · max(1, max|y|)` (measured: about 1e-6, printed by the test).

use std::path::{Path, PathBuf};

use headroom_lora::{
    DenseLinear, FrozenLinear, LoraAdapter, LoraMatrix, Mode, WeightLayout, CONFIG_FILE,
    WEIGHTS_FILE,
};
use headroom_tensor::Cpu;
use safetensors::SafeTensors;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

fn base_model() -> Vec<u8> {
    std::fs::read(
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../trainer/tests/fixtures/hf-llama-gqa-untied/model.safetensors"),
    )
    .unwrap()
}

fn f32_tensor(st: &SafeTensors<'_>, name: &str) -> (Vec<usize>, Vec<f32>) {
    let v = st.tensor(name).unwrap();
    assert_eq!(v.dtype(), safetensors::Dtype::F32, "{name}");
    let data = v
        .data()
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    (v.shape().to_vec(), data)
}

/// Every 2-D weight of the base as `(module, out, in)`.
fn base_modules(st: &SafeTensors<'_>) -> Vec<(String, usize, usize)> {
    st.tensors()
        .into_iter()
        .filter_map(|(name, v)| {
            let module = name.strip_suffix(".weight")?;
            match *v.shape() {
                [o, i] => Some((module.to_owned(), o, i)),
                _ => None,
            }
        })
        .collect()
}

const MODULES: [&str; 3] = [
    "model.layers.0.self_attn.q_proj",
    "model.layers.1.self_attn.v_proj",
    "model.layers.0.mlp.down_proj",
];

/// Load `name`, check its configuration, and reproduce peft's module outputs; returns the
/// largest difference seen.
fn reproduce(name: &str, want_scaling: f32) -> f32 {
    let cpu = Cpu::new();
    let dir = fixtures().join(name);
    let adapter = LoraAdapter::load(&cpu, &dir).unwrap();
    let c = adapter.config();
    assert_eq!((c.r, c.alpha, c.dropout), (4, 8.0, 0.0));
    assert_eq!(c.task_type.as_deref(), Some("CAUSAL_LM"));
    assert!(!c.fan_in_fan_out);
    let mut targets = c.target_modules.clone();
    targets.sort();
    assert_eq!(targets, ["down_proj", "q_proj", "v_proj"]);
    assert_eq!(adapter.len(), 6, "2 layers × 3 targets");

    let model_bytes = base_model();
    let model = SafeTensors::deserialize(&model_bytes).unwrap();
    let shapes = base_modules(&model);
    adapter
        .check_base(shapes.iter().map(|(n, o, i)| (n.as_str(), *o, *i)))
        .unwrap();

    let reference = std::fs::read(dir.join("reference.safetensors")).unwrap();
    let reference = SafeTensors::deserialize(&reference).unwrap();
    let mut worst = 0f32;
    for module in MODULES {
        let lora = adapter.get(module).unwrap();
        assert_eq!(lora.scaling(), want_scaling);
        let (_, w) = f32_tensor(&model, &format!("{module}.weight"));
        let (xs, x) = f32_tensor(&reference, &format!("{module}.x"));
        let (ys, y_peft) = f32_tensor(&reference, &format!("{module}.y"));
        let rows = xs[0];
        assert_eq!(
            (xs[1], ys),
            (lora.in_features(), vec![rows, lora.out_features()])
        );
        let base = DenseLinear::new(&w, None, lora.out_features(), lora.in_features()).unwrap();

        let mut y = vec![0.0; y_peft.len()];
        lora.infer(&base, &x, &mut y, rows).unwrap();
        let ymax = y_peft.iter().fold(0f32, |m, v| m.max(v.abs()));
        let diff = y
            .iter()
            .zip(&y_peft)
            .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
        println!("{name} {module}: max |headroom - peft| {diff:.3e} (max |y| {ymax:.3})");
        assert!(diff <= 1e-5 * ymax.max(1.0), "{module}: {diff}");
        worst = worst.max(diff);
        // The adapter matters: the base alone is far from peft's output.
        let mut y_base = vec![0.0; y.len()];
        base.forward(&x, &mut y_base, rows).unwrap();
        let moved = y_base
            .iter()
            .zip(&y_peft)
            .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
        assert!(
            moved > 0.1,
            "{module}: the adapter moves the output by only {moved}"
        );

        // The training forward (dropout 0) gives the same bits as inference.
        let mut y_train = vec![0.0; y.len()];
        lora.forward(
            &base,
            &x,
            &mut y_train,
            rows,
            Mode::Train {
                step: 3,
                micro_batch: 0,
            },
        )
        .unwrap();
        assert_eq!(y_train, y);

        // Merged into the base weight, the plain linear gives peft's output too.
        let mut merged = w.clone();
        lora.merge_into(&mut merged, WeightLayout::OutIn).unwrap();
        let mb = DenseLinear::new(&merged, None, lora.out_features(), lora.in_features()).unwrap();
        let mut y_merged = vec![0.0; y.len()];
        mb.forward(&x, &mut y_merged, rows).unwrap();
        let diff = y_merged
            .iter()
            .zip(&y_peft)
            .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
        println!("{name} {module}: merged max |headroom - peft| {diff:.3e}");
        assert!(diff <= 1e-5 * ymax.max(1.0), "{module} merged: {diff}");
    }
    worst
}

#[test]
fn peft_adapter_reproduces_peft_module_outputs() {
    let worst = reproduce("peft-llama-tiny", 2.0);
    println!("peft-llama-tiny: worst {worst:.3e}");
}

#[test]
fn peft_rslora_adapter_reproduces_peft_module_outputs() {
    let cpu = Cpu::new();
    let adapter = LoraAdapter::load(&cpu, fixtures().join("peft-llama-tiny-rslora")).unwrap();
    assert!(adapter.config().use_rslora);
    // alpha / √r = 8 / 2.
    let worst = reproduce("peft-llama-tiny-rslora", 4.0);
    println!("peft-llama-tiny-rslora: worst {worst:.3e}");
}

#[test]
fn the_reference_holds_logits_for_the_trainer() {
    let bytes = std::fs::read(fixtures().join("peft-llama-tiny/reference.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let tokens = st.tensor("tokens").unwrap();
    assert_eq!(tokens.shape(), [2, 16]);
    assert_eq!(tokens.dtype(), safetensors::Dtype::I32);
    let (shape, logits) = f32_tensor(&st, "logits");
    assert_eq!(shape, [2, 16, 97]);
    let (_, merged) = f32_tensor(&st, "merged_logits");
    let diff = logits
        .iter()
        .zip(&merged)
        .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
    assert!(diff < 1e-4, "peft's own merge moved its logits by {diff}");
}

#[test]
fn peft_files_read_and_write_back_identical() {
    let cpu = Cpu::new();
    for name in [
        "peft-llama-tiny",
        "peft-llama-tiny-rslora",
        "peft-gpt2-conv1d",
    ] {
        let dir = fixtures().join(name);
        let adapter = LoraAdapter::load(&cpu, &dir).unwrap();
        let original = std::fs::read(dir.join(WEIGHTS_FILE)).unwrap();
        let original = SafeTensors::deserialize(&original).unwrap();

        let out = tempfile::tempdir().unwrap();
        adapter.save(out.path()).unwrap();
        let written = std::fs::read(out.path().join(WEIGHTS_FILE)).unwrap();
        let written_st = SafeTensors::deserialize(&written).unwrap();
        // Same names, shapes, dtype and bits as peft's own file.
        let mut names: Vec<String> = original.names().into_iter().map(str::to_owned).collect();
        let mut names_written: Vec<String> =
            written_st.names().into_iter().map(str::to_owned).collect();
        names.sort();
        names_written.sort();
        assert_eq!(names, names_written);
        for n in &names {
            let (a, b) = (original.tensor(n).unwrap(), written_st.tensor(n).unwrap());
            assert_eq!(
                (a.dtype(), a.shape(), a.data()),
                (b.dtype(), b.shape(), b.data()),
                "{n}"
            );
        }

        let again = LoraAdapter::load(&cpu, out.path()).unwrap();
        assert_eq!(again.config(), adapter.config());
        for ((na, a), (nb, b)) in adapter.iter().zip(again.iter()) {
            assert_eq!(na, nb);
            assert_eq!(a.a(), b.a());
            assert_eq!(a.b(), b.b());
            assert_eq!(a.scaling(), b.scaling());
        }
        // The writer is deterministic: writing what was read gives the same bytes.
        let (config_bytes, weight_bytes) = again.to_peft_bytes().unwrap();
        assert_eq!(weight_bytes, written);
        assert_eq!(
            config_bytes,
            std::fs::read(out.path().join(CONFIG_FILE)).unwrap()
        );
        let json: serde_json::Value = serde_json::from_slice(&config_bytes).unwrap();
        assert_eq!(json["peft_type"], "LORA");
        assert_eq!(json["lora_alpha"], adapter.config().alpha as i64);
        assert_eq!(json["r"], adapter.config().r);
        assert_eq!(json["fan_in_fan_out"], adapter.config().fan_in_fan_out);
        assert_eq!(json["bias"], "none");
        assert!(json["lora_dropout"].is_number());
    }
}

/// The names in `dir`, sorted.
fn entries(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

/// Saving over an adapter replaces both files and leaves nothing else; a save that fails
/// after its temporaries were written removes them again and reports the file it failed on.
#[test]
fn save_replaces_files_and_leaves_no_temporaries() {
    let cpu = Cpu::new();
    let adapter = LoraAdapter::load(&cpu, fixtures().join("peft-llama-tiny")).unwrap();
    let rslora = LoraAdapter::load(&cpu, fixtures().join("peft-llama-tiny-rslora")).unwrap();
    let out = tempfile::tempdir().unwrap();
    adapter.save(out.path()).unwrap();
    rslora.save(out.path()).unwrap();
    assert_eq!(entries(out.path()), [CONFIG_FILE, WEIGHTS_FILE]);
    let again = LoraAdapter::load(&cpu, out.path()).unwrap();
    assert_eq!(again.config(), rslora.config());
    assert_eq!(
        std::fs::read(out.path().join(WEIGHTS_FILE)).unwrap(),
        rslora.to_peft_bytes().unwrap().1
    );

    // A directory where the configuration goes: the weights' rename succeeds, the
    // configuration's fails (a file cannot replace a directory).
    let blocked = tempfile::tempdir().unwrap();
    std::fs::create_dir(blocked.path().join(CONFIG_FILE)).unwrap();
    let err = adapter.save(blocked.path()).unwrap_err();
    assert!(
        err.to_string().contains(CONFIG_FILE),
        "the error names the file: {err}"
    );
    assert_eq!(entries(blocked.path()), [CONFIG_FILE, WEIGHTS_FILE]);
    assert!(blocked.path().join(CONFIG_FILE).is_dir());
}

#[test]
fn tensor_names_are_peft_names() {
    assert_eq!(
        headroom_lora::peft_tensor_name("model.layers.0.mlp.down_proj", LoraMatrix::B),
        "base_model.model.model.layers.0.mlp.down_proj.lora_B.weight"
    );
    assert_eq!(
        headroom_lora::parse_peft_tensor_name("base_model.model.h.0.attn.c_attn.lora_A.weight"),
        Some(("h.0.attn.c_attn", LoraMatrix::A))
    );
    for bad in [
        "base_model.model..lora_A.weight",
        "model.h.0.lora_A.weight",
        "base_model.model.h.0.lora_A.default.weight",
        "base_model.model.h.0.lora_C.weight",
    ] {
        assert_eq!(headroom_lora::parse_peft_tensor_name(bad), None, "{bad}");
    }
}

/// GPT-2's Conv1D (`fan_in_fan_out: true` in PEFT): the LoRA tensors are `[r, in]` /
/// `[out, r]` as for `nn.Linear`, the base weight is stored `[in, out]`. Headroom's base is
/// always `[out, in]` (the trainer transposes Conv1D at load); a merge into the stored
/// `[in, out]` weight uses `WeightLayout::InOut` and must equal peft's merge.
#[test]
fn peft_conv1d_adapter_reproduces_peft_and_merges_in_place() {
    let cpu = Cpu::new();
    let dir = fixtures().join("peft-gpt2-conv1d");
    let adapter = LoraAdapter::load(&cpu, &dir).unwrap();
    assert!(adapter.config().fan_in_fan_out);
    let reference = std::fs::read(dir.join("reference.safetensors")).unwrap();
    let reference = SafeTensors::deserialize(&reference).unwrap();
    for module in ["transformer.h.0.attn.c_attn", "transformer.h.0.mlp.c_fc"] {
        let lora = adapter.get(module).unwrap();
        assert_eq!(lora.scaling(), 3.0);
        let (ws, w_in_out) = f32_tensor(&reference, &format!("{module}.base_weight"));
        let (in_f, out_f) = (ws[0], ws[1]);
        assert_eq!((lora.in_features(), lora.out_features()), (in_f, out_f));
        let (_, bias) = f32_tensor(&reference, &format!("{module}.bias"));
        let (xs, x) = f32_tensor(&reference, &format!("{module}.x"));
        let (_, y_peft) = f32_tensor(&reference, &format!("{module}.y"));
        let w_out_in: Vec<f32> = (0..out_f * in_f)
            .map(|k| w_in_out[(k % in_f) * out_f + k / in_f])
            .collect();
        let base = DenseLinear::new(&w_out_in, Some(&bias), out_f, in_f).unwrap();
        let mut y = vec![0.0; y_peft.len()];
        lora.infer(&base, &x, &mut y, xs[0]).unwrap();
        let ymax = y_peft.iter().fold(0f32, |m, v| m.max(v.abs()));
        let diff = y
            .iter()
            .zip(&y_peft)
            .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
        println!("conv1d {module}: max |headroom - peft| {diff:.3e} (max |y| {ymax:.3})");
        assert!(diff <= 1e-5 * ymax.max(1.0), "{module}: {diff}");

        let (_, merged_peft) = f32_tensor(&reference, &format!("{module}.merged_weight"));
        let mut merged = w_in_out.clone();
        lora.merge_into(&mut merged, WeightLayout::InOut).unwrap();
        let diff = merged
            .iter()
            .zip(&merged_peft)
            .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
        println!("conv1d {module}: merged weight max |headroom - peft| {diff:.3e}");
        assert!(diff <= 1e-6, "{module} merged weight: {diff}");
    }
}
