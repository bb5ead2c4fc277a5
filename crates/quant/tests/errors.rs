//! Every malformed input is a typed error, named by its variant: block sizes, shapes, lengths,
//! non-finite values, overflowing sizes, and bitsandbytes-layout files with a tensor missing,
//! of the wrong type, with another code book or with a broken quant state.

use headroom_quant::{
    AbsmaxParts, BlockSize, BnbEntry, QuantConfig, QuantError, QuantParts, QuantType,
    QuantizedTensor,
};
use headroom_tensor::Cpu;
use safetensors::tensor::{Dtype, TensorView};

fn parts<'a>(
    codes: &'a [u8],
    absmax: AbsmaxParts<'a>,
    shape: &'a [u64],
    bs: u64,
) -> QuantParts<'a> {
    QuantParts {
        codes,
        absmax,
        shape,
        blocksize: bs,
        quant_type: QuantType::Nf4,
    }
}

#[test]
fn block_sizes_must_be_powers_of_two_from_32_to_4096() {
    for bad in [0u64, 1, 16, 48, 96, 8192, u64::MAX] {
        assert!(matches!(BlockSize::new(bad), Err(QuantError::InvalidBlockSize(b)) if b == bad));
    }
    for good in [32u64, 64, 128, 256, 512, 1024, 2048, 4096] {
        assert_eq!(BlockSize::new(good).unwrap().get() as u64, good);
    }
    assert_eq!(BlockSize::default().get(), 64);
    assert!(matches!(
        QuantType::from_name("int4"),
        Err(QuantError::UnknownQuantType(_))
    ));
}

#[test]
fn quantize_refuses_bad_input() {
    let cpu = Cpu::new();
    let c = QuantConfig::qlora();
    let e = QuantizedTensor::quantize(&cpu, &[1.0, f32::NAN], &[2], c).unwrap_err();
    assert!(matches!(e, QuantError::NonFinite { index: 1, .. }), "{e}");
    let e = QuantizedTensor::quantize(&cpu, &[1.0, f32::INFINITY], &[2], c).unwrap_err();
    assert!(matches!(e, QuantError::NonFinite { .. }), "{e}");
    let e = QuantizedTensor::quantize(&cpu, &[1.0; 5], &[2, 3], c).unwrap_err();
    assert!(
        matches!(
            e,
            QuantError::LengthMismatch {
                expected: 6,
                got: 5,
                ..
            }
        ),
        "{e}"
    );
    let e = QuantizedTensor::quantize(&cpu, &[], &[0, 3], c).unwrap_err();
    assert!(matches!(e, QuantError::EmptyShape(_)), "{e}");
    let e = QuantizedTensor::quantize(&cpu, &[], &[], c).unwrap_err();
    assert!(matches!(e, QuantError::EmptyShape(_)), "{e}");
    let e = QuantizedTensor::quantize(&cpu, &[1.0], &[usize::MAX, 2], c).unwrap_err();
    assert!(matches!(e, QuantError::SizeOverflow(_)), "{e}");
}

#[test]
fn from_parts_checks_every_length_and_value() {
    let cpu = Cpu::new();
    let shape = [3u64, 50]; // 150 elements: 75 bytes, 3 blocks of 64
    let codes = [0x77u8; 75];
    let am = [1.0f32, 2.0, 0.5];
    assert!(
        QuantizedTensor::from_parts(&cpu, parts(&codes, AbsmaxParts::Plain(&am), &shape, 64))
            .is_ok()
    );

    let cases: Vec<(QuantParts<'_>, &str)> = vec![
        (
            parts(&codes[..74], AbsmaxParts::Plain(&am), &shape, 64),
            "LengthMismatch",
        ),
        (
            parts(&codes, AbsmaxParts::Plain(&am[..2]), &shape, 64),
            "LengthMismatch",
        ),
        (
            parts(
                &codes,
                AbsmaxParts::Plain(&[1.0, f32::NAN, 1.0]),
                &shape,
                64,
            ),
            "NonFinite",
        ),
        (
            parts(&codes, AbsmaxParts::Plain(&[1.0, -1.0, 1.0]), &shape, 64),
            "NegativeAbsmax",
        ),
        (
            parts(&codes, AbsmaxParts::Plain(&am), &shape, 100),
            "InvalidBlockSize",
        ),
        (
            parts(&codes, AbsmaxParts::Plain(&am), &[u64::MAX, 3], 64),
            "SizeOverflow",
        ),
        (
            parts(&codes, AbsmaxParts::Plain(&am), &[1 << 62], 64),
            "SizeOverflow",
        ),
        (
            parts(&codes, AbsmaxParts::Plain(&am), &[3, 0], 64),
            "EmptyShape",
        ),
        (
            parts(
                &codes,
                AbsmaxParts::Double {
                    codes: &[1, 2, 3],
                    offset: f32::NAN,
                    absmax2: &[1.0],
                    code2: &[0.0; 256],
                },
                &shape,
                64,
            ),
            "NonFinite",
        ),
        (
            parts(
                &codes,
                AbsmaxParts::Double {
                    codes: &[1, 2, 3],
                    offset: 0.5,
                    absmax2: &[1.0, 1.0],
                    code2: &[0.0; 256],
                },
                &shape,
                64,
            ),
            "LengthMismatch",
        ),
        (
            parts(
                &codes,
                AbsmaxParts::Double {
                    codes: &[1, 2, 3],
                    offset: 0.5,
                    absmax2: &[1.0],
                    code2: &[0.0; 255],
                },
                &shape,
                64,
            ),
            "LengthMismatch",
        ),
    ];
    for (p, want) in cases {
        let e = QuantizedTensor::from_parts(&cpu, p).unwrap_err();
        assert!(
            format!("{e:?}").starts_with(want),
            "expected {want}, got {e:?}"
        );
    }
}

fn rebuild(entries: &[BnbEntry]) -> Vec<u8> {
    let views: Vec<(String, TensorView<'_>)> = entries
        .iter()
        .map(|e| {
            (
                e.name.clone(),
                TensorView::new(e.dtype, e.shape.clone(), &e.data).unwrap(),
            )
        })
        .collect();
    safetensors::serialize(views, None).unwrap()
}

#[test]
fn bnb_files_with_wrong_tensors_are_refused() {
    let cpu = Cpu::new();
    let w: Vec<f32> = (0..300).map(|i| (i as f32 - 150.0) / 40.0).collect();
    let q = QuantizedTensor::quantize(&cpu, &w, &[6, 50], QuantConfig::qlora()).unwrap();
    let entries = q.bnb_entries("w").unwrap();
    assert!(QuantizedTensor::from_bnb_safetensors(&cpu, &rebuild(&entries), "w").is_ok());
    let err = |e: Vec<BnbEntry>| {
        QuantizedTensor::from_bnb_safetensors(&cpu, &rebuild(&e), "w").unwrap_err()
    };
    let edit = |name: &str, f: &dyn Fn(&mut BnbEntry)| {
        let mut e = entries.clone();
        f(e.iter_mut().find(|x| x.name == name).unwrap());
        e
    };

    // A missing tensor, under another prefix too.
    let missing: Vec<_> = entries
        .iter()
        .filter(|e| e.name != "w.nested_absmax")
        .cloned()
        .collect();
    assert!(matches!(err(missing), QuantError::MissingTensor(_)));
    assert!(matches!(
        QuantizedTensor::from_bnb_safetensors(&cpu, &rebuild(&entries), "v").unwrap_err(),
        QuantError::MissingTensor(_)
    ));
    // Wrong dtype of the packed codes.
    let e = err(edit("w", &|t| {
        t.dtype = Dtype::I8;
    }));
    assert!(matches!(e, QuantError::BadTensor { .. }), "{e:?}");
    // Another code book.
    let e = err(edit("w.quant_map", &|t| {
        t.data[..4].copy_from_slice(&0.5f32.to_le_bytes())
    }));
    assert!(
        matches!(e, QuantError::CodeMapMismatch { index: 0, .. }),
        "{e:?}"
    );
    // A state blob that is not JSON, or names another block size, type or shape.
    let key = "w.quant_state.bitsandbytes__nf4";
    let set_json = |text: &str| {
        let text = text.to_string();
        edit(key, &move |t| {
            t.data = text.clone().into_bytes();
            t.shape = vec![t.data.len()];
        })
    };
    let json =
        String::from_utf8(entries.iter().find(|e| e.name == key).unwrap().data.clone()).unwrap();
    assert!(matches!(
        err(set_json("{not json")),
        QuantError::BadQuantState(_)
    ));
    let e = err(set_json(
        &json.replace("\"blocksize\":64", "\"blocksize\":48"),
    ));
    assert!(matches!(e, QuantError::InvalidBlockSize(48)), "{e:?}");
    let e = err(set_json(
        &json.replace("\"quant_type\":\"nf4\"", "\"quant_type\":\"fp4\""),
    ));
    assert!(matches!(e, QuantError::BadQuantState(_)), "{e:?}");
    let e = err(set_json(&json.replace("[6,50]", "[6,51]")));
    assert!(matches!(e, QuantError::LengthMismatch { .. }), "{e:?}");
    let e = err(set_json(
        &json.replace("[6,50]", "[18446744073709551615,2]"),
    ));
    assert!(matches!(e, QuantError::SizeOverflow(_)), "{e:?}");
    let e = err(set_json(
        &json.replace("\"nested_blocksize\":256", "\"nested_blocksize\":128"),
    ));
    assert!(matches!(e, QuantError::BadQuantState(_)), "{e:?}");
    // Two quant states under one prefix.
    let mut two = entries.clone();
    let mut fp4 = two.iter().find(|e| e.name == key).unwrap().clone();
    fp4.name = "w.quant_state.bitsandbytes__fp4".into();
    two.push(fp4);
    assert!(matches!(err(two), QuantError::BadQuantState(_)));
    // Not a safetensors file at all.
    assert!(matches!(
        QuantizedTensor::from_bnb_safetensors(&cpu, b"\xff\xff\xff\xff\xff\xff\xff\xff{}", "w")
            .unwrap_err(),
        QuantError::Format(_)
    ));
    let e = QuantizedTensor::from_bnb_file(
        &cpu,
        std::path::Path::new("/nonexistent/w.safetensors"),
        "w",
    )
    .unwrap_err();
    assert!(matches!(e, QuantError::Io { .. }), "{e:?}");
}
