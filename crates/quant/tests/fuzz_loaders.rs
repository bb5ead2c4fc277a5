//! Fuzz tests for the loaders: bitsandbytes-layout safetensors (seeds written by this crate
//! and by bitsandbytes itself) and `QuantizedTensor::from_parts` (fed through a small binary
//! envelope whose size fields the mutator sets to extreme values). Whatever loads is
//! dequantized and multiplied, and checked for consistency; every other input must be a typed
//! error. Each campaign asserts 0 panics and 0 hangs.
//!
//! `HEADROOM_FUZZ_ITERS` scales the random inputs per campaign.

use headroom_fuzzkit::{fuzz_seeds, iterations, Field, FuzzReport, Seed};
use headroom_quant::{
    matmul_backward_input, matmul_forward, AbsmaxParts, BlockSize, MatmulOptions, QuantConfig,
    QuantError, QuantParts, QuantType, QuantizedTensor,
};
use headroom_tensor::Cpu;

const CI_ITERATIONS: u64 = 300;

fn check(report: FuzzReport) {
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

fn weight(n: usize) -> Vec<f32> {
    (0..n)
        .map(|i| ((i * 7919) % 201) as f32 / 50.0 - 2.0)
        .collect()
}

/// Use a loaded tensor the way a model would, and check what it claims.
fn exercise(q: &QuantizedTensor) -> Result<(), QuantError> {
    let d = q.dequantize();
    assert_eq!(d.len(), q.numel());
    assert_eq!(q.packed().len(), q.numel().div_ceil(2));
    assert_eq!(q.absmax_f32().len(), q.num_blocks());
    // Keep the matmul small: fuzzed shapes can be large but are backed by real bytes.
    if q.numel() <= 1 << 16 {
        let cols = *q.shape().last().unwrap();
        let rows = q.numel() / cols;
        let cpu = Cpu::new();
        let x = vec![1.0f32; 2 * cols];
        let mut y = vec![0f32; 2 * rows];
        matmul_forward(&cpu, &x, q, &mut y, &MatmulOptions::default())?;
        let mut dx = vec![0f32; 2 * cols];
        matmul_backward_input(&cpu, &y, q, &mut dx, &MatmulOptions::default())?;
    }
    Ok(())
}

#[test]
fn fuzz_bnb_safetensors() {
    let cpu = Cpu::new();
    let mut seeds = Vec::new();
    for (qt, bs, double, shape) in [
        (QuantType::Nf4, 64, true, [5usize, 70]),
        (QuantType::Fp4, 32, false, [3, 11]),
        (QuantType::Nf4, 128, false, [9, 40]),
    ] {
        let config = QuantConfig {
            quant_type: qt,
            blocksize: BlockSize::new(bs).unwrap(),
            double_quant: double,
        };
        let q =
            QuantizedTensor::quantize(&cpu, &weight(shape[0] * shape[1]), &shape, config).unwrap();
        let bytes = q.to_bnb_safetensors("weight").unwrap();
        seeds.push(
            Seed::new(format!("{qt:?} b{bs} dq={double}"), bytes).with_fields([Field::new(
                "header_len",
                0,
                8,
            )]),
        );
    }
    let fixture = std::fs::read(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/bnb_fp4.safetensors"),
    )
    .unwrap();
    seeds
        .push(Seed::new("bitsandbytes fp4", fixture).with_fields([Field::new("header_len", 0, 8)]));

    let report = fuzz_seeds(
        "bnb_safetensors",
        &seeds,
        iterations(CI_ITERATIONS),
        |bytes| {
            let cpu = Cpu::new();
            let q = QuantizedTensor::from_bnb_safetensors(&cpu, bytes, "weight")?;
            exercise(&q)?;
            // What loads writes back and loads again to the same tensor.
            let again = QuantizedTensor::from_bnb_safetensors(
                &cpu,
                &q.to_bnb_safetensors("weight")?,
                "weight",
            )?;
            assert_eq!(again.packed(), q.packed());
            assert_eq!(
                again
                    .dequantize()
                    .iter()
                    .map(|v| v.to_bits())
                    .collect::<Vec<_>>(),
                q.dequantize()
                    .iter()
                    .map(|v| v.to_bits())
                    .collect::<Vec<_>>()
            );
            Ok::<(), QuantError>(())
        },
    );
    check(report);
}

/// The envelope for `from_parts`: a fixed header of sizes, then the buffers.
const HEADER: usize = 46;

fn parts_fields() -> Vec<Field> {
    vec![
        Field::new("blocksize", 0, 8),
        Field::new("dim0", 8, 8),
        Field::new("dim1", 16, 8),
        Field::new("quant_type", 24, 1),
        Field::new("double", 25, 1),
        Field::new("offset", 26, 4),
        Field::new("n_codes", 30, 4),
        Field::new("n_absmax", 34, 4),
        Field::new("n_absmax2", 38, 4),
        Field::new("n_code2", 42, 4),
    ]
}

fn encode_parts(q: &QuantizedTensor) -> Vec<u8> {
    let mut b = Vec::new();
    b.extend((q.blocksize().get() as u64).to_le_bytes());
    b.extend((q.shape()[0] as u64).to_le_bytes());
    b.extend((q.shape()[1] as u64).to_le_bytes());
    b.push(match q.quant_type() {
        QuantType::Nf4 => 0,
        QuantType::Fp4 => 1,
    });
    let f32s = |v: &[f32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
    let (absmax, offset, absmax2, code2): (Vec<u8>, f32, Vec<f32>, Vec<f32>) =
        match q.absmax_storage() {
            headroom_quant::AbsmaxStorage::Double(d) => {
                b.push(1);
                (
                    d.codes().to_vec(),
                    d.offset(),
                    d.absmax2().to_vec(),
                    d.code2().to_vec(),
                )
            }
            _ => {
                b.push(0);
                (f32s(&q.absmax_f32()), 0.0, Vec::new(), Vec::new())
            }
        };
    b.extend(offset.to_le_bytes());
    let n_absmax = if q.is_double_quant() {
        absmax.len()
    } else {
        absmax.len() / 4
    };
    for n in [q.packed().len(), n_absmax, absmax2.len(), code2.len()] {
        b.extend((n as u32).to_le_bytes());
    }
    assert_eq!(b.len(), HEADER);
    b.extend(q.packed());
    b.extend(absmax);
    b.extend(f32s(&absmax2));
    b.extend(f32s(&code2));
    b
}

/// A damaged envelope, or the loader's own refusal (whose variant names the error kind).
#[derive(Debug)]
#[allow(dead_code)] // the payloads are read through Debug in the report
enum PartsError {
    Envelope(String),
    Quant(QuantError),
}

impl From<String> for PartsError {
    fn from(s: String) -> Self {
        PartsError::Envelope(s)
    }
}

impl From<&str> for PartsError {
    fn from(s: &str) -> Self {
        PartsError::Envelope(s.to_string())
    }
}

fn decode_parts(cpu: &Cpu, b: &[u8]) -> Result<QuantizedTensor, PartsError> {
    let h = b.get(..HEADER).ok_or("truncated header")?;
    let u64_at = |o: usize| u64::from_le_bytes(h[o..o + 8].try_into().unwrap());
    let u32_at = |o: usize| u32::from_le_bytes(h[o..o + 4].try_into().unwrap()) as usize;
    let qt = match h[24] {
        0 => QuantType::Nf4,
        1 => QuantType::Fp4,
        t => return Err(format!("quant type {t}").into()),
    };
    let double = h[25] != 0;
    let offset = f32::from_le_bytes(h[26..30].try_into().unwrap());
    let mut rest = &b[HEADER..];
    let mut take = |n: Option<usize>| -> Result<&[u8], PartsError> {
        let n = n.ok_or("size overflow")?;
        if n > rest.len() {
            return Err("truncated body".into());
        }
        let (a, r) = rest.split_at(n);
        rest = r;
        Ok(a)
    };
    let to_f32 = |x: &[u8]| -> Vec<f32> {
        x.chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect()
    };
    let codes = take(Some(u32_at(30)))?;
    let shape = [u64_at(8), u64_at(16)];
    let absmax_bytes = take(if double {
        Some(u32_at(34))
    } else {
        u32_at(34).checked_mul(4)
    })?;
    let absmax2 = to_f32(take(u32_at(38).checked_mul(4))?);
    let code2 = to_f32(take(u32_at(42).checked_mul(4))?);
    let plain = to_f32(absmax_bytes);
    let absmax = if double {
        AbsmaxParts::Double {
            codes: absmax_bytes,
            offset,
            absmax2: &absmax2,
            code2: &code2,
        }
    } else {
        AbsmaxParts::Plain(&plain)
    };
    QuantizedTensor::from_parts(
        cpu,
        QuantParts {
            codes,
            absmax,
            shape: &shape,
            blocksize: u64_at(0),
            quant_type: qt,
        },
    )
    .map_err(PartsError::Quant)
}

#[test]
fn fuzz_from_parts() {
    let cpu = Cpu::new();
    let mut seeds = Vec::new();
    for (qt, bs, double, shape) in [
        (QuantType::Nf4, 32, true, [20usize, 33]),
        (QuantType::Fp4, 64, false, [7, 9]),
        (QuantType::Nf4, 4096, true, [1, 5]),
    ] {
        let config = QuantConfig {
            quant_type: qt,
            blocksize: BlockSize::new(bs).unwrap(),
            double_quant: double,
        };
        let q =
            QuantizedTensor::quantize(&cpu, &weight(shape[0] * shape[1]), &shape, config).unwrap();
        let bytes = encode_parts(&q);
        assert_eq!(decode_parts(&cpu, &bytes).unwrap().packed(), q.packed());
        seeds.push(
            Seed::new(format!("{qt:?} b{bs} dq={double}"), bytes).with_fields(parts_fields()),
        );
    }
    let report = fuzz_seeds("from_parts", &seeds, iterations(CI_ITERATIONS), |bytes| {
        let cpu = Cpu::new();
        let q = decode_parts(&cpu, bytes)?;
        exercise(&q).map_err(PartsError::Quant)
    });
    check(report);
}
