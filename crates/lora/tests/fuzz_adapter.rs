//! Fuzzing the PEFT adapter reader: `adapter_config.json` and `adapter_model.safetensors`
//! mutated together (one fuzzkit bundle: byte flips, truncation, splices, the safetensors
//! header length and the bundle's part lengths set to extreme values), seeded with peft's own
//! files and with adapters headroom writes. Whatever loads must run a forward and a backward
//! and write back to an adapter that loads identical; everything else must be a typed error.
//! The campaign asserts 0 panics and 0 hangs.
//!
//! `HEADROOM_FUZZ_ITERS` scales the random inputs.

use std::path::Path;

use headroom_fuzzkit::{bundle, fuzz_seeds, iterations, unbundle, Field, Seed};
use headroom_lora::{DenseLinear, LoraAdapter, LoraConfig, LoraError, Mode};
use headroom_tensor::Cpu;

fn exercise(adapter: &LoraAdapter) -> Result<(), LoraError> {
    for (_, lora) in adapter.iter() {
        let (o, i) = (lora.out_features(), lora.in_features());
        // Fuzzed shapes are backed by real bytes, but keep the base small anyway.
        if o.saturating_mul(i) > 1 << 16 {
            continue;
        }
        let w = vec![0.5f32; o * i];
        let base = DenseLinear::new(&w, None, o, i)?;
        let rows = 2;
        let x = vec![1.0f32; rows * i];
        let mut y = vec![0f32; rows * o];
        let saved = lora.forward(
            &base,
            &x,
            &mut y,
            rows,
            Mode::Train {
                step: 1,
                micro_batch: 0,
            },
        )?;
        let mut grads = lora.alloc_grads()?;
        let mut dx = vec![0f32; rows * i];
        lora.backward(&base, &saved, &x, &y, &mut dx, &mut grads)?;
    }
    Ok(())
}

fn seed_of(name: &str, config: &[u8], weights: &[u8]) -> Seed {
    bundle(
        name,
        &[
            ("config", config, &[]),
            ("weights", weights, &[Field::new("header_len", 0, 8)]),
        ],
    )
}

#[test]
fn fuzz_peft_adapter() {
    let fixtures = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
    let mut seeds = Vec::new();
    for name in [
        "peft-llama-tiny",
        "peft-llama-tiny-rslora",
        "peft-gpt2-conv1d",
    ] {
        let dir = fixtures.join(name);
        let config = std::fs::read(dir.join(headroom_lora::CONFIG_FILE)).unwrap();
        let weights = std::fs::read(dir.join(headroom_lora::WEIGHTS_FILE)).unwrap();
        seeds.push(seed_of(name, &config, &weights));
    }
    let cpu = Cpu::new();
    let mut config = LoraConfig::new(3, 6.0, ["c_attn", "c_fc"]);
    config.dropout = 0.1;
    config.fan_in_fan_out = true;
    let adapter = LoraAdapter::new(
        &cpu,
        config,
        [
            ("h.0.attn.c_attn", 12, 4),
            ("h.0.mlp.c_fc", 16, 4),
            ("h.0.mlp.c_proj", 4, 16),
        ],
    )
    .unwrap();
    let (c, w) = adapter.to_peft_bytes().unwrap();
    seeds.push(seed_of("headroom", &c, &w));

    let report = fuzz_seeds("peft_adapter", &seeds, iterations(300), |bytes| {
        let parts = unbundle(bytes, 2);
        let cpu = Cpu::new();
        let adapter = LoraAdapter::from_peft_bytes(&cpu, parts[0], parts[1])?;
        exercise(&adapter)?;
        let (c, w) = adapter.to_peft_bytes()?;
        let again = LoraAdapter::from_peft_bytes(&cpu, &c, &w)?;
        assert_eq!(again.len(), adapter.len());
        for ((na, a), (nb, b)) in adapter.iter().zip(again.iter()) {
            assert_eq!(na, nb);
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(a.a()), bits(b.a()));
            assert_eq!(bits(a.b()), bits(b.b()));
        }
        Ok::<(), LoraError>(())
    });
    println!("{report}");
    report.assert_clean();
    assert!(
        report.ok > 0,
        "no input was accepted: the seeds are broken\n{report}"
    );
    assert!(
        report.errors > 0,
        "no input was refused: the mutator is broken\n{report}"
    );
}
