//! Hugging Face directories that must not load, and the variants that must: every bad input is
//! a typed `TrainError::Pretrained` naming the file and what is wrong, never a panic.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use headroom_tensor::{Backend, Cpu, CpuTensor, DType, Tensor};
use headroom_trainer::hf;
use headroom_trainer::model::params;
use headroom_trainer::TrainError;
use safetensors::tensor::TensorView;
use safetensors::{Dtype, SafeTensors};
use serde_json::{json, Value};

fn fixture() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/hf-llama-gqa-untied")
}

/// The fixture's tensors as (name → dtype, shape, bytes).
fn tensors() -> BTreeMap<String, (Dtype, Vec<usize>, Vec<u8>)> {
    let bytes = std::fs::read(fixture().join("model.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    st.tensors()
        .into_iter()
        .map(|(n, t)| (n, (t.dtype(), t.shape().to_vec(), t.data().to_vec())))
        .collect()
}

fn write(path: &Path, tensors: &BTreeMap<String, (Dtype, Vec<usize>, Vec<u8>)>) {
    let views: Vec<(String, TensorView<'_>)> = tensors
        .iter()
        .map(|(n, (d, s, b))| (n.clone(), TensorView::new(*d, s.clone(), b).unwrap()))
        .collect();
    safetensors::serialize_to_file(views, None, path).unwrap();
}

/// A copy of the fixture directory with `edit` applied to its tensors and `config` to its
/// config.json.
fn variant(
    scratch: &tempfile::TempDir,
    name: &str,
    edit: impl FnOnce(&mut BTreeMap<String, (Dtype, Vec<usize>, Vec<u8>)>),
    config: impl FnOnce(&mut serde_json::Value),
) -> PathBuf {
    let dir = scratch.path().join(name);
    std::fs::create_dir_all(&dir).unwrap();
    let mut t = tensors();
    edit(&mut t);
    write(&dir.join("model.safetensors"), &t);
    let mut cfg: serde_json::Value =
        serde_json::from_slice(&std::fs::read(fixture().join("config.json")).unwrap()).unwrap();
    config(&mut cfg);
    std::fs::write(dir.join("config.json"), serde_json::to_vec(&cfg).unwrap()).unwrap();
    dir
}

/// A copy of the fixture with every tensor rounded to `dtype` (bf16 or f16) and stored so.
fn narrowed(scratch: &tempfile::TempDir, name: &str, dtype: Dtype) -> PathBuf {
    variant(
        scratch,
        name,
        |t| {
            for (d, _, b) in t.values_mut() {
                *b = b
                    .chunks_exact(4)
                    .flat_map(|x| {
                        let v = f32::from_le_bytes([x[0], x[1], x[2], x[3]]);
                        match dtype {
                            Dtype::BF16 => half::bf16::from_f32(v).to_bits(),
                            _ => half::f16::from_f32(v).to_bits(),
                        }
                        .to_le_bytes()
                    })
                    .collect();
                *d = dtype;
            }
        },
        |_| {},
    )
}

fn refused(dir: &Path, needle: &str) {
    match hf::load(dir, &Cpu::new()) {
        Err(e @ TrainError::Pretrained { .. }) => {
            let message = e.to_string();
            assert!(
                message.contains(needle),
                "{message:?} does not mention {needle:?}"
            )
        }
        Err(other) => panic!("{needle}: untyped error {other}"),
        Ok(_) => panic!("{needle}: loaded"),
    }
}

fn masters(dir: &Path) -> Vec<Vec<f32>> {
    let (_, m) = hf::load(dir, &Cpu::new()).unwrap();
    m.iter()
        .map(|t| t.as_slice::<f32>().unwrap().to_vec())
        .collect()
}

#[test]
fn malformed_directories_are_typed_errors() {
    let s = tempfile::tempdir().unwrap();
    let up = "model.layers.1.mlp.up_proj.weight";
    refused(
        &variant(
            &s,
            "arch",
            |_| {},
            |c| c["architectures"] = serde_json::json!(["BertModel"]),
        ),
        "architecture BertModel",
    );
    refused(
        &variant(&s, "missing", |t| drop(t.remove(up)), |_| {}),
        &format!("missing tensor {up}"),
    );
    refused(
        &variant(
            &s,
            "extra",
            |t| {
                drop(t.insert(
                    "model.extra.weight".into(),
                    (Dtype::F32, vec![1], vec![0; 4]),
                ))
            },
            |_| {},
        ),
        "model.extra.weight",
    );
    refused(
        &variant(
            &s,
            "shape",
            |t| {
                let e = t.get_mut(up).unwrap();
                e.1 = vec![e.1[1], e.1[0]];
            },
            |_| {},
        ),
        "has shape",
    );
    refused(
        &variant(
            &s,
            "dtype",
            |t| {
                let e = t.get_mut(up).unwrap();
                e.0 = Dtype::I32;
            },
            |_| {},
        ),
        "dtype",
    );
    refused(
        &variant(
            &s,
            "config-shape",
            |_| {},
            |c| c["num_key_value_heads"] = 3.into(),
        ),
        "key/value heads",
    );
    refused(
        &variant(
            &s,
            "rope",
            |_| {},
            |c| c["rope_parameters"]["rope_type"] = "longrope".into(),
        ),
        "rope type",
    );
    refused(
        &variant(&s, "act", |_| {}, |c| c["hidden_act"] = "gelu".into()),
        "activation",
    );
}

#[test]
fn incomplete_directories_are_typed_errors() {
    let s = tempfile::tempdir().unwrap();
    // No config.json.
    let dir = variant(&s, "no-config", |_| {}, |_| {});
    std::fs::remove_file(dir.join("config.json")).unwrap();
    refused(&dir, "config.json");
    // No architectures and an unknown model_type.
    let dir = variant(
        &s,
        "model-type",
        |_| {},
        |c| {
            c.as_object_mut().unwrap().remove("architectures");
            c["model_type"] = "gemma".into();
        },
    );
    refused(&dir, "architecture");
    // No weights at all.
    let dir = variant(&s, "no-weights", |_| {}, |_| {});
    std::fs::remove_file(dir.join("model.safetensors")).unwrap();
    refused(&dir, "neither model.safetensors nor");
    // A shard the index names is missing; a tensor the index names is not in its shard.
    let dir = s.path().join("shards");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::copy(fixture().join("config.json"), dir.join("config.json")).unwrap();
    let all = tensors();
    let mut map = serde_json::Map::new();
    for name in all.keys() {
        map.insert(name.clone(), "model-00001-of-00002.safetensors".into());
    }
    map.insert(
        "model.norm.weight".into(),
        "model-00002-of-00002.safetensors".into(),
    );
    let mut first = all.clone();
    first.remove("model.norm.weight");
    write(&dir.join("model-00001-of-00002.safetensors"), &first);
    let index = serde_json::json!({"metadata": {}, "weight_map": map});
    std::fs::write(
        dir.join("model.safetensors.index.json"),
        serde_json::to_vec(&index).unwrap(),
    )
    .unwrap();
    refused(&dir, "model-00002-of-00002.safetensors");
    let mut only_norm = BTreeMap::new();
    only_norm.insert(
        "model.layers.0.mlp.up_proj.weight".to_string(),
        all["model.layers.0.mlp.up_proj.weight"].clone(),
    );
    write(&dir.join("model-00002-of-00002.safetensors"), &only_norm);
    refused(&dir, "in the index but not the shard");
}

#[test]
fn bf16_f16_and_sharded_files_load() {
    let s = tempfile::tempdir().unwrap();
    let f32_masters = masters(&fixture());
    for (name, dtype) in [("bf16", Dtype::BF16), ("f16", Dtype::F16)] {
        let dir = narrowed(&s, name, dtype);
        let low = masters(&dir);
        for (a, b) in low.iter().flatten().zip(f32_masters.iter().flatten()) {
            let want = match dtype {
                Dtype::BF16 => half::bf16::from_f32(*b).to_f32(),
                _ => half::f16::from_f32(*b).to_f32(),
            };
            assert_eq!(a.to_bits(), want.to_bits(), "{name}");
        }
    }
    // Two shards and transformers' index: the same masters as the single file.
    let dir = s.path().join("sharded");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::copy(fixture().join("config.json"), dir.join("config.json")).unwrap();
    let all = tensors();
    let (mut first, mut second) = (BTreeMap::new(), BTreeMap::new());
    let mut map = serde_json::Map::new();
    for (i, (n, t)) in all.into_iter().enumerate() {
        let file = if i % 2 == 0 {
            "model-00001-of-00002.safetensors"
        } else {
            "model-00002-of-00002.safetensors"
        };
        map.insert(n.clone(), file.into());
        if i % 2 == 0 {
            first.insert(n, t)
        } else {
            second.insert(n, t)
        };
    }
    write(&dir.join("model-00001-of-00002.safetensors"), &first);
    write(&dir.join("model-00002-of-00002.safetensors"), &second);
    let index = serde_json::json!({"metadata": {}, "weight_map": map});
    std::fs::write(
        dir.join("model.safetensors.index.json"),
        serde_json::to_vec(&index).unwrap(),
    )
    .unwrap();
    assert_eq!(masters(&dir), f32_masters);
    // An index that points outside the directory is refused.
    let mut bad = index.clone();
    bad["weight_map"]["model.norm.weight"] = "../model.safetensors".into();
    std::fs::write(
        dir.join("model.safetensors.index.json"),
        serde_json::to_vec(&bad).unwrap(),
    )
    .unwrap();
    refused(&dir, "not a plain name");
}

/// What a [`params::TensorSink`] was given: each tensor, and the f32 values streamed before it.
struct Recorder {
    want: Box<dyn Fn(usize) -> DType>,
    tensors: Vec<CpuTensor>,
    values: Vec<Vec<f32>>,
}

impl params::TensorSink for Recorder {
    fn dtype(&self, index: usize) -> DType {
        (self.want)(index)
    }

    fn values(&mut self, index: usize, values: &[f32]) -> headroom_trainer::Result<()> {
        assert_eq!(
            index,
            self.tensors.len(),
            "values for the tensor about to be pushed"
        );
        self.values[index].extend_from_slice(values);
        Ok(())
    }

    fn push(&mut self, index: usize, tensor: CpuTensor) -> headroom_trainer::Result<()> {
        assert_eq!(index, self.tensors.len());
        self.tensors.push(tensor);
        Ok(())
    }
}

/// `load_into` a sink that wants bf16, f16 or f32 tensor by tensor gives, bit for bit,
/// `load_each`'s f32 tensors cast by the backend, and streams exactly the f32 values of every
/// tensor it delivers narrowed (none for f32 ones): f32, bf16 and f16 files, and GPT-2's
/// sharded, transposed `Conv1D` weights (read transposed, a band of rows at a time); and so
/// does `init_params_into` against `init_params`.
#[test]
fn narrowed_tensors_load_as_the_cast_f32_tensors() {
    let s = tempfile::tempdir().unwrap();
    let gpt2 = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/hf-gpt2-sharded");
    let dirs = [
        fixture(),
        narrowed(&s, "bf16", Dtype::BF16),
        narrowed(&s, "f16", Dtype::F16),
        gpt2,
    ];
    let cpu = Cpu::new();
    for dir in &dirs {
        let (_, masters) = hf::load(dir, &cpu).unwrap();
        for (narrow, odd) in [
            (DType::BF16, DType::F32),
            (DType::F16, DType::BF16),
            (DType::BF16, DType::BF16),
        ] {
            let mut sink = Recorder {
                want: Box::new(move |i| if i % 2 == 0 { narrow } else { odd }),
                tensors: Vec::new(),
                values: vec![Vec::new(); masters.len()],
            };
            hf::load_into(dir, &cpu, &mut sink).unwrap();
            check(&cpu, &sink, &masters, &dir.display().to_string());
        }
    }
    // A seeded initialisation streams the same way: `init_params`' tensors, cast.
    let cfg = hf::read_config(&dirs[3]).unwrap();
    let masters = params::init_params(&cpu, &cfg, 7).unwrap();
    let mut sink = Recorder {
        want: Box::new(|i| [DType::BF16, DType::F32, DType::F16][i % 3]),
        tensors: Vec::new(),
        values: vec![Vec::new(); masters.len()],
    };
    params::init_params_into(&cpu, &cfg, 7, &mut sink).unwrap();
    check(&cpu, &sink, &masters, "init");
    // Only float dtypes load.
    let mut sink = Recorder {
        want: Box::new(|_| DType::I32),
        tensors: Vec::new(),
        values: Vec::new(),
    };
    match hf::load_into(&fixture(), &cpu, &mut sink) {
        Err(TrainError::Config(m)) => assert!(m.contains("f32, bf16 or f16"), "{m}"),
        other => panic!("{:?}", other.map(|_| ())),
    }
}

/// `sink` received `masters` cast to the dtypes it wanted, bit for bit, and the f32 values of
/// exactly the tensors it wanted narrowed.
fn check(cpu: &Cpu, sink: &Recorder, masters: &[CpuTensor], what: &str) {
    assert_eq!(sink.tensors.len(), masters.len());
    for (i, (got, master)) in sink.tensors.iter().zip(masters).enumerate() {
        let dtype = (sink.want)(i);
        assert_eq!(got.dtype(), dtype);
        assert_eq!(got.shape(), master.shape());
        let mut want = cpu.zeros(master.shape().clone(), dtype).unwrap();
        cpu.cast(master, &mut want).unwrap();
        assert_eq!(
            bytes(cpu, got),
            bytes(cpu, &want),
            "{what}: tensor {i} in {dtype:?}"
        );
        let streamed = &sink.values[i];
        if dtype == DType::F32 {
            assert!(streamed.is_empty(), "{what}: values of f32 tensor {i}");
        } else {
            let f32s = master.as_slice::<f32>().unwrap();
            assert_eq!(streamed.len(), f32s.len(), "{what}: tensor {i}");
            assert!(
                streamed
                    .iter()
                    .zip(f32s)
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "{what}: tensor {i}'s streamed values differ from the f32 master"
            );
        }
    }
}

/// A tensor's raw bytes, whatever its dtype.
fn bytes(cpu: &Cpu, t: &CpuTensor) -> Vec<u8> {
    match t.dtype() {
        DType::F32 => bytemuck::cast_slice(&cpu.download::<f32>(t).unwrap()).to_vec(),
        DType::BF16 => cpu
            .download::<half::bf16>(t)
            .unwrap()
            .iter()
            .flat_map(|v| v.to_bits().to_le_bytes())
            .collect(),
        DType::F16 => cpu
            .download::<half::f16>(t)
            .unwrap()
            .iter()
            .flat_map(|v| v.to_bits().to_le_bytes())
            .collect(),
        other => panic!("{other:?}"),
    }
}

/// Mutated headers, truncations and byte flips of the weights file: every outcome is a load
/// or a typed error.
#[test]
fn mutated_weight_files_never_panic() {
    let s = tempfile::tempdir().unwrap();
    let dir = s.path().join("m");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::copy(fixture().join("config.json"), dir.join("config.json")).unwrap();
    let original = std::fs::read(fixture().join("model.safetensors")).unwrap();
    let header_end = 8 + u64::from_le_bytes(original[..8].try_into().unwrap()) as usize;
    let mut state = 0x9E37_79B9_7F4A_7C15u64;
    let mut next = |n: usize| {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        (state % n.max(1) as u64) as usize
    };
    let (mut loaded, mut refused_count) = (0, 0);
    for case in 0..1500 {
        let mut bytes = original.clone();
        match case % 4 {
            // A byte of the header (offsets, shapes, dtypes, the length prefix).
            0 | 1 => {
                let i = next(header_end);
                bytes[i] = next(256) as u8;
            }
            2 => bytes.truncate(next(original.len())),
            // A digit of the header replaced by a large number.
            _ => {
                let i = next(header_end - 8) + 8;
                if bytes[i].is_ascii_digit() {
                    bytes.splice(i..i + 1, b"99999999999999999999".iter().copied());
                }
            }
        }
        std::fs::write(dir.join("model.safetensors"), &bytes).unwrap();
        match hf::load(&dir, &Cpu::new()) {
            Ok(_) => loaded += 1,
            Err(TrainError::Pretrained { .. }) => refused_count += 1,
            Err(other) => panic!("case {case}: untyped error {other}"),
        }
    }
    assert!(refused_count > 1000, "only {refused_count} refused");
    eprintln!("{loaded} loaded, {refused_count} refused");
}

/// Bytes no tensor owns — after the last tensor, as the safetensors reader also refuses — are
/// a typed error, not ignored.
#[test]
fn data_bytes_no_tensor_covers_are_refused() {
    let s = tempfile::tempdir().unwrap();
    let dir = variant(&s, "trailing", |_| {}, |_| {});
    let file = dir.join("model.safetensors");
    let mut bytes = std::fs::read(&file).unwrap();
    assert!(hf::load(&dir, &Cpu::new()).is_ok());
    bytes.extend_from_slice(&[0u8; 4]);
    std::fs::write(&file, &bytes).unwrap();
    assert!(SafeTensors::deserialize(&bytes).is_err());
    refused(&dir, "cover");
}

/// A non-finite value in a block linear quantized as it streams in is a typed error naming its
/// position in the tensor, as `QuantizedTensor::quantize` names it for a whole tensor; nothing
/// of the model is built.
#[test]
fn a_non_finite_weight_is_refused_where_it_is_quantized() {
    use headroom_trainer::model::finetune::{FinetuneBuilder, QuantSpec};
    use headroom_trainer::model::{ModelOptions, Precision};
    let scratch = tempfile::tempdir().unwrap();
    // Element 5 of layer 0's down projection (`[32, 72]`, row-major as the model holds it).
    let dir = variant(
        &scratch,
        "nan",
        |t| {
            let (_, _, b) = t.get_mut("model.layers.0.mlp.down_proj.weight").unwrap();
            b[4 * 5..4 * 6].copy_from_slice(&f32::NAN.to_le_bytes());
        },
        |_| {},
    );
    let cpu = Cpu::new();
    for double_quant in [false, true] {
        let cfg = hf::read_config(&dir).unwrap();
        let opts = ModelOptions {
            precision: Precision::Bf16,
            ..ModelOptions::default()
        };
        let quant = QuantSpec {
            quant_type: "nf4".into(),
            blocksize: 64,
            double_quant,
        };
        let mut builder = FinetuneBuilder::frozen(&cpu, cfg, opts, Some(quant)).unwrap();
        let err = hf::load_into(&dir, &cpu, &mut builder).unwrap_err();
        assert!(
            matches!(
                err,
                TrainError::Quant(headroom_quant::QuantError::NonFinite { index: 5, .. })
            ),
            "{err}"
        );
    }
}

/// config.json values that the shape check multiplies are checked, not wrapped: 2^62 + 8 ×
/// 4 heads is 2^64 + 32, which would wrap to the fixture's hidden size of 32. A head_dim that
/// is present must be an integer (null is transformers' "derive it"); one that differs from
/// hidden_size / heads is the model's own head width, so weights of the derived width are
/// refused by their shapes.
#[test]
fn head_dim_is_an_integer_whose_product_is_checked() {
    let s = tempfile::tempdir().unwrap();
    refused(
        &variant(
            &s,
            "head-dim-overflow",
            |_| {},
            |c| c["head_dim"] = 4_611_686_018_427_387_912u64.into(),
        ),
        "head dimension 4611686018427387912 × 4 heads must be in 1..=131072",
    );
    refused(
        &variant(&s, "head-dim-text", |_| {}, |c| c["head_dim"] = "8".into()),
        "head_dim is not a non-negative integer",
    );
    refused(
        &variant(&s, "head-dim-float", |_| {}, |c| c["head_dim"] = 8.5.into()),
        "head_dim is not a non-negative integer",
    );
    refused(
        &variant(&s, "head-dim-other", |_| {}, |c| c["head_dim"] = 4.into()),
        "q_proj.weight has shape [32, 32], expected [16, 32]",
    );
    let derived = variant(&s, "head-dim-null", |_| {}, |c| c["head_dim"] = Value::Null);
    assert_eq!(masters(&derived), masters(&fixture()));
}

fn gpt2_config() -> Value {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/hf-gpt2-sharded/config.json");
    serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap()
}

/// GPT-2 attention that does not scale by 1/sqrt(head_dim), or that also scales by the layer
/// index, is not what the model here computes: refused by name.
#[test]
fn gpt2_attention_scalings_other_than_ours_are_refused() {
    let s = tempfile::tempdir().unwrap();
    let read = |name: &str, key: &str, value: Value| {
        let dir = s.path().join(name);
        std::fs::create_dir_all(&dir).unwrap();
        let mut cfg = gpt2_config();
        cfg[key] = value;
        std::fs::write(dir.join("config.json"), serde_json::to_vec(&cfg).unwrap()).unwrap();
        hf::read_config(&dir)
    };
    for (key, value) in [
        ("scale_attn_weights", json!(false)),
        ("scale_attn_weights", Value::Null),
        ("scale_attn_by_inverse_layer_idx", json!(true)),
    ] {
        match read(key, key, value.clone()) {
            Err(e @ TrainError::Pretrained { .. }) => {
                assert!(e.to_string().contains(key), "{e}")
            }
            other => panic!("{key} = {value}: {other:?}"),
        }
    }
    // Our scaling, spelled out or left to the default, loads.
    read("explicit", "scale_attn_weights", json!(true)).unwrap();
    read(
        "inverse-null",
        "scale_attn_by_inverse_layer_idx",
        Value::Null,
    )
    .unwrap();
    let mut cfg = gpt2_config();
    for key in ["scale_attn_weights", "scale_attn_by_inverse_layer_idx"] {
        cfg.as_object_mut().unwrap().remove(key);
    }
    let dir = s.path().join("defaults");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("config.json"), serde_json::to_vec(&cfg).unwrap()).unwrap();
    hf::read_config(&dir).unwrap();
}

/// A JSON file of the directory that is a symlink to a device (which reports no size) is
/// refused at once, not read until memory runs out.
#[cfg(unix)]
#[test]
fn json_files_that_are_devices_are_refused_without_reading_them() {
    let s = tempfile::tempdir().unwrap();
    let dir = variant(&s, "config-device", |_| {}, |_| {});
    std::fs::remove_file(dir.join("config.json")).unwrap();
    std::os::unix::fs::symlink("/dev/zero", dir.join("config.json")).unwrap();
    refused(&dir, "not a regular file");
    let dir = variant(&s, "index-device", |_| {}, |_| {});
    std::fs::remove_file(dir.join("model.safetensors")).unwrap();
    std::os::unix::fs::symlink("/dev/zero", dir.join("model.safetensors.index.json")).unwrap();
    refused(&dir, "not a regular file");
}
