//! headroom-quant against bitsandbytes' own output (`benches/torch/make_quant_fixture.py`,
//! bitsandbytes' CPU `quantize_4bit` / `dequantize_4bit`): packed bytes, absmax, quantized
//! absmax, offset and second-level absmax byte-identical; dequantized values bit-identical; NF4
//! and FP4, block sizes 32, 64, 128 and 4096, tails, an odd element count, with and without
//! double quantization. Also the safetensors files in the layout transformers saves.

use std::collections::HashMap;
use std::path::PathBuf;

use headroom_quant::{
    dynamic_map_signed, AbsmaxStorage, BlockSize, Isa, QuantConfig, QuantType, QuantizedTensor,
    FP4_CODE, NF4_CODE,
};
use headroom_tensor::Cpu;
use serde_json::Value;

struct Fixture {
    blob: Vec<u8>,
    index: Value,
}

fn fixtures_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

impl Fixture {
    fn load() -> Fixture {
        let dir = fixtures_dir();
        let blob = std::fs::read(dir.join("bnb_4bit.bin")).unwrap();
        let index: Value =
            serde_json::from_slice(&std::fs::read(dir.join("bnb_4bit.json")).unwrap()).unwrap();
        Fixture { blob, index }
    }

    fn bytes(&self, name: &str) -> &[u8] {
        let a = &self.index["arrays"][name];
        assert!(a.is_object(), "no array {name}");
        let off = a["offset"].as_u64().unwrap() as usize;
        let len = a["bytes"].as_u64().unwrap() as usize;
        &self.blob[off..off + len]
    }

    fn f32s(&self, name: &str) -> Vec<f32> {
        assert_eq!(self.index["arrays"][name]["dtype"], "f32", "{name}");
        self.bytes(name)
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect()
    }

    fn u8s(&self, name: &str) -> Vec<u8> {
        assert_eq!(self.index["arrays"][name]["dtype"], "u8", "{name}");
        self.bytes(name).to_vec()
    }
}

fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

/// Bitwise equality with the first difference named (the arrays are too long to print).
#[track_caller]
fn assert_bits(got: &[f32], want: &[f32], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    if let Some(i) = got
        .iter()
        .zip(want)
        .position(|(a, b)| a.to_bits() != b.to_bits())
    {
        panic!(
            "{what}: element {i} is {:e} ({:#x}), bitsandbytes has {:e} ({:#x})",
            got[i],
            got[i].to_bits(),
            want[i],
            want[i].to_bits()
        );
    }
}

#[test]
fn code_books_equal_bitsandbytes() {
    let f = Fixture::load();
    assert_eq!(bits(&f.f32s("code/nf4")), bits(&NF4_CODE));
    assert_eq!(bits(&f.f32s("code/fp4")), bits(&FP4_CODE));
    // Every double-quantized case stores the map it used; it is the signed dynamic map.
    let cases = f.index["cases"].as_array().unwrap();
    let mut seen = 0;
    for c in cases.iter().filter(|c| c["double_quant"] == true) {
        let name = c["name"].as_str().unwrap();
        assert_eq!(
            bits(&f.f32s(&format!("{name}/code2"))),
            bits(dynamic_map_signed())
        );
        seen += 1;
    }
    assert!(seen >= 8);
}

#[test]
fn torch_mean_is_reproduced_bit_for_bit() {
    let f = Fixture::load();
    for n in f.index["mean_sizes"].as_array().unwrap() {
        let n = n.as_u64().unwrap();
        let x = f.f32s(&format!("mean/{n}/input"));
        let want = f.f32s(&format!("mean/{n}/torch"))[0];
        let got = headroom_quant::torch_mean_f32(&x);
        assert_eq!(
            got.to_bits(),
            want.to_bits(),
            "n = {n}: {got} vs torch {want}"
        );
    }
}

#[test]
fn quantize_and_dequantize_are_byte_identical_to_bitsandbytes() {
    let f = Fixture::load();
    let cpu = Cpu::new();
    let cases = f.index["cases"].as_array().unwrap();
    assert_eq!(cases.len(), 20);
    let mut blocksizes = HashMap::new();
    for c in cases {
        let name = c["name"].as_str().unwrap();
        let shape: Vec<usize> = c["shape"]
            .as_array()
            .unwrap()
            .iter()
            .map(|d| d.as_u64().unwrap() as usize)
            .collect();
        let config = QuantConfig {
            quant_type: QuantType::from_name(c["quant_type"].as_str().unwrap()).unwrap(),
            blocksize: BlockSize::new(c["blocksize"].as_u64().unwrap()).unwrap(),
            double_quant: c["double_quant"].as_bool().unwrap(),
        };
        *blocksizes.entry(config.blocksize.get()).or_insert(0) += 1;
        let input = f.f32s(&format!("input/{}", c["input"].as_str().unwrap()));
        let q = QuantizedTensor::quantize(&cpu, &input, &shape, config).unwrap();
        assert_eq!(
            q.packed(),
            f.u8s(&format!("{name}/packed")).as_slice(),
            "{name}: packed"
        );
        match q.absmax_storage() {
            AbsmaxStorage::Plain(_) => {
                assert_eq!(
                    bits(&q.absmax_f32()),
                    bits(&f.f32s(&format!("{name}/absmax"))),
                    "{name}: absmax"
                );
            }
            AbsmaxStorage::Double(d) => {
                assert_eq!(
                    d.offset().to_bits(),
                    f.f32s(&format!("{name}/offset"))[0].to_bits(),
                    "{name}: offset"
                );
                assert_eq!(
                    bits(d.absmax2()),
                    bits(&f.f32s(&format!("{name}/absmax2"))),
                    "{name}: second-level absmax"
                );
                assert_eq!(
                    d.codes(),
                    f.u8s(&format!("{name}/qabsmax")).as_slice(),
                    "{name}: quantized absmax"
                );
            }
        }
        let want = f.f32s(&format!("{name}/dequant"));
        for isa in Isa::available() {
            let mut got = vec![0f32; q.numel()];
            q.dequantize_range_isa(isa, 0, &mut got).unwrap();
            assert_bits(&got, &want, &format!("{name}: dequantized ({isa:?})"));
            // In bf16: bitsandbytes' values rounded to nearest even (torch's `.to(bfloat16)`).
            let mut got16 = vec![half::bf16::ZERO; q.numel()];
            q.dequantize_range_bf16_isa(isa, 0, &mut got16).unwrap();
            let got16: Vec<f32> = got16.iter().map(|v| v.to_f32()).collect();
            let want16: Vec<f32> = want
                .iter()
                .map(|&v| half::bf16::from_f32(v).to_f32())
                .collect();
            assert_bits(
                &got16,
                &want16,
                &format!("{name}: dequantized to bf16 ({isa:?})"),
            );
        }
    }
    for bs in [32, 64, 128, 4096] {
        assert!(blocksizes.contains_key(&bs), "block size {bs} covered");
    }
}

#[test]
fn safetensors_written_by_transformers_layout_load_and_dequantize_exactly() {
    let cpu = Cpu::new();
    for (file, qt, double, bs) in [
        ("bnb_nf4_dq.safetensors", QuantType::Nf4, true, 64),
        ("bnb_fp4.safetensors", QuantType::Fp4, false, 128),
    ] {
        let bytes = std::fs::read(fixtures_dir().join(file)).unwrap();
        let q = QuantizedTensor::from_bnb_safetensors(&cpu, &bytes, "weight").unwrap();
        assert_eq!(q.quant_type(), qt);
        assert_eq!(q.is_double_quant(), double);
        assert_eq!(q.blocksize().get(), bs);
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let read = |name: &str| -> Vec<f32> {
            st.tensor(name)
                .unwrap()
                .data()
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
                .collect()
        };
        assert_bits(&q.dequantize(), &read("ref.dequant"), file);
        // Quantizing the same input reproduces the file's tensors exactly, and writing them
        // back gives what bitsandbytes wrote, tensor by tensor.
        let shape = q.shape().to_vec();
        let requant = QuantizedTensor::quantize(
            &cpu,
            &read("ref.input"),
            &shape,
            QuantConfig {
                quant_type: qt,
                blocksize: BlockSize::new(bs as u64).unwrap(),
                double_quant: double,
            },
        )
        .unwrap();
        let ours = requant.to_bnb_safetensors("weight").unwrap();
        let ours = safetensors::SafeTensors::deserialize(&ours).unwrap();
        let mut names = ours.names();
        names.sort();
        for name in &names {
            let a = ours.tensor(name).unwrap();
            let b = st.tensor(name).unwrap();
            assert_eq!(a.dtype(), b.dtype(), "{file}: {name}");
            if name.contains("quant_state") {
                let ja: Value = serde_json::from_slice(a.data()).unwrap();
                let jb: Value = serde_json::from_slice(b.data()).unwrap();
                assert_eq!(ja, jb, "{file}: {name}");
            } else {
                assert_eq!(a.shape(), b.shape(), "{file}: {name}");
                assert_eq!(a.data(), b.data(), "{file}: {name}");
            }
        }
        // Every tensor of the file but the references is one we write.
        let theirs: Vec<&str> = st
            .names()
            .into_iter()
            .filter(|n| !n.starts_with("ref."))
            .collect();
        assert_eq!(theirs.len(), names.len(), "{file}");
    }
}
