//! Write a headroom adapter for the tiny Llama fixture, plus headroom's outputs of its
//! adapted modules, for `benches/torch/make_lora_fixture.py --check-headroom DIR` to load in
//! peft and compare:
//!
//! ```sh
//! cargo run -p headroom-lora --example write_peft_check -- /tmp/headroom-adapter [--rslora]
//! python benches/torch/make_lora_fixture.py --check-headroom /tmp/headroom-adapter
//! ```
//!
//! The adapter targets `q_proj`, `k_proj`, `o_proj` and `up_proj` (r = 8, alpha = 16) with
//! headroom's own initialisation of A and a deterministic non-zero B, so the check sees an
//! adapter that moves every output. `expected.safetensors` holds `<module>.x` and
//! `<module>.y` for every adapted module.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use headroom_lora::{DenseLinear, LoraAdapter, LoraConfig};
use headroom_tensor::Cpu;
use safetensors::tensor::{Dtype, SafeTensors, TensorView};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let out = PathBuf::from(
        args.next()
            .ok_or("usage: write_peft_check DIR [--rslora]")?,
    );
    let rslora = args.any(|a| a == "--rslora");
    let base_dir =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../trainer/tests/fixtures/hf-llama-gqa-untied");
    let model_bytes = std::fs::read(base_dir.join("model.safetensors"))?;
    let model = SafeTensors::deserialize(&model_bytes)?;
    let weight = |name: &str| -> Result<(usize, usize, Vec<f32>), Box<dyn std::error::Error>> {
        let v = model.tensor(name)?;
        let [o, i] = *v.shape() else {
            return Err(format!("{name} is not 2-D").into());
        };
        let data = v
            .data()
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        Ok((o, i, data))
    };
    let mut modules = Vec::new();
    for (name, view) in model.tensors() {
        if let (Some(m), [o, i]) = (name.strip_suffix(".weight"), view.shape()) {
            modules.push((m.to_owned(), *o, *i));
        }
    }
    let mut config = LoraConfig::new(8, 16.0, ["q_proj", "k_proj", "o_proj", "up_proj"]);
    config.use_rslora = rslora;
    config.seed = 2024;
    config.base_model_name_or_path = Some(base_dir.display().to_string());
    let cpu = Cpu::new();
    let mut adapter = LoraAdapter::new(
        &cpu,
        config,
        modules.iter().map(|(n, o, i)| (n.as_str(), *o, *i)),
    )?;
    for (k, (_, lora)) in adapter.iter_mut().enumerate() {
        let (_, b) = lora.params_mut();
        for (j, v) in b.iter_mut().enumerate() {
            *v = (((j * 7 + k * 13) % 17) as f32 - 8.0) * 0.02;
        }
    }
    adapter.save(&out)?;

    let mut expected: Vec<(String, Vec<usize>, Vec<u8>)> = Vec::new();
    let rows = 3;
    for (name, lora) in adapter.iter() {
        let (o, i, w) = weight(&format!("{name}.weight"))?;
        let base = DenseLinear::new(&w, None, o, i)?;
        let x: Vec<f32> = (0..rows * i)
            .map(|j| ((j * 31 % 23) as f32 - 11.0) * 0.1)
            .collect();
        let mut y = vec![0.0; rows * o];
        lora.infer(&base, &x, &mut y, rows)?;
        let bytes = |v: &[f32]| v.iter().flat_map(|f| f.to_le_bytes()).collect::<Vec<u8>>();
        expected.push((format!("{name}.x"), vec![rows, i], bytes(&x)));
        expected.push((format!("{name}.y"), vec![rows, o], bytes(&y)));
    }
    let views = expected
        .iter()
        .map(|(n, s, b)| Ok((n.clone(), TensorView::new(Dtype::F32, s.clone(), b)?)))
        .collect::<Result<Vec<_>, safetensors::SafeTensorError>>()?;
    let st = safetensors::serialize(views, None::<HashMap<String, String>>)?;
    std::fs::write(out.join("expected.safetensors"), st)?;
    println!(
        "wrote {} adapted modules (scaling {}) to {}",
        adapter.len(),
        adapter.iter().next().map_or(0.0, |(_, l)| l.scaling()),
        out.display()
    );
    Ok(())
}
