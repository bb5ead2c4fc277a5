//! bitsandbytes' serialized 4-bit state, as transformers and PEFT save a `Linear4bit` in
//! safetensors: `QuantState.as_dict(packed=True)` under the module's prefix.
//!
//! | name | dtype | content |
//! |---|---|---|
//! | `{p}` | u8 | packed codes (shape `[ceil(n/2), 1]`) |
//! | `{p}.absmax` | f32, or u8 with double quantization | per-block scales |
//! | `{p}.quant_map` | f32 `[16]` | the 4-bit code book |
//! | `{p}.nested_absmax` | f32 | second-level scales (double quantization only) |
//! | `{p}.nested_quant_map` | f32 `[256]` | the 8-bit code map (double quantization only) |
//! | `{p}.quant_state.bitsandbytes__{nf4,fp4}` | u8 | JSON: `quant_type`, `blocksize`, `dtype`, `shape`, and `nested_blocksize`, `nested_dtype`, `nested_offset` |

use std::collections::HashMap;
use std::path::Path;

use headroom_tensor::Cpu;
use safetensors::tensor::{Dtype, SafeTensors, TensorView};
use serde::{Deserialize, Serialize};

use crate::tensor::{AbsmaxParts, AbsmaxStorage, QuantParts, NESTED_BLOCKSIZE};
use crate::{QuantError, QuantType, QuantizedTensor, Result};

/// Largest JSON quant-state blob accepted (bitsandbytes writes about 200 bytes).
const MAX_STATE_BYTES: usize = 64 * 1024;

/// The non-tensor part of a quant state (the JSON blob).
#[derive(Debug, Serialize, Deserialize)]
struct PackedState {
    quant_type: String,
    blocksize: u64,
    dtype: String,
    shape: Vec<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    nested_blocksize: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    nested_dtype: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    nested_offset: Option<f64>,
}

/// One tensor of the serialized layout: name, safetensors dtype, shape and little-endian data.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BnbEntry {
    /// Full tensor name (`{prefix}.absmax`, …).
    pub name: String,
    /// Element type.
    pub dtype: Dtype,
    /// Shape, as bitsandbytes writes it.
    pub shape: Vec<usize>,
    /// Little-endian bytes.
    pub data: Vec<u8>,
}

impl BnbEntry {
    fn new(name: String, dtype: Dtype, shape: Vec<usize>, data: Vec<u8>) -> Self {
        BnbEntry {
            name,
            dtype,
            shape,
            data,
        }
    }
}

fn format_err(e: impl std::fmt::Display) -> QuantError {
    QuantError::Format(e.to_string())
}

fn get<'a>(st: &SafeTensors<'a>, name: &str) -> Result<TensorView<'a>> {
    st.tensor(name)
        .map_err(|_| QuantError::MissingTensor(name.to_string()))
}

fn expect_dtype(name: &str, view: &TensorView<'_>, dtype: Dtype) -> Result<()> {
    if view.dtype() != dtype {
        return Err(QuantError::BadTensor {
            name: name.to_string(),
            detail: format!("dtype {:?}, expected {dtype:?}", view.dtype()),
        });
    }
    Ok(())
}

/// Little-endian f32 data of a tensor (safetensors data need not be 4-byte aligned).
fn f32_data(name: &str, view: &TensorView<'_>) -> Result<Vec<f32>> {
    expect_dtype(name, view, Dtype::F32)?;
    let data = view.data();
    if data.len() % 4 != 0 {
        return Err(QuantError::BadTensor {
            name: name.to_string(),
            detail: format!("{} bytes is not a whole number of f32", data.len()),
        });
    }
    Ok(data
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect())
}

fn u8_data<'a>(name: &str, view: &TensorView<'a>) -> Result<&'a [u8]> {
    expect_dtype(name, view, Dtype::U8)?;
    Ok(view.data())
}

/// Bit-exact comparison (so +0 and -0 differ, as FP4's codes 0 and 8 do).
fn check_map(what: &'static str, expected: &'static str, got: &[f32], want: &[f32]) -> Result<()> {
    if got.len() != want.len() {
        return Err(QuantError::CodeMapMismatch {
            what,
            expected,
            index: got.len() as u64,
        });
    }
    match got
        .iter()
        .zip(want)
        .position(|(a, b)| a.to_bits() != b.to_bits())
    {
        Some(i) => Err(QuantError::CodeMapMismatch {
            what,
            expected,
            index: i as u64,
        }),
        None => Ok(()),
    }
}

impl QuantizedTensor {
    /// Load the quantized tensor stored under `prefix` (e.g. `"model.layers.0.mlp.up_proj.weight"`)
    /// from safetensors bytes in bitsandbytes' layout. Every inconsistency is an error.
    pub fn from_bnb_safetensors(cpu: &Cpu, bytes: &[u8], prefix: &str) -> Result<Self> {
        let st = SafeTensors::deserialize(bytes).map_err(format_err)?;
        Self::from_bnb_tensors(cpu, &st, prefix)
    }

    /// [`from_bnb_safetensors`](Self::from_bnb_safetensors) for a file.
    pub fn from_bnb_file(cpu: &Cpu, path: &Path, prefix: &str) -> Result<Self> {
        let bytes = std::fs::read(path).map_err(|source| QuantError::Io {
            path: path.display().to_string(),
            source,
        })?;
        Self::from_bnb_safetensors(cpu, &bytes, prefix)
    }

    /// Load from an already parsed safetensors file (several weights share one file).
    pub fn from_bnb_tensors(cpu: &Cpu, st: &SafeTensors<'_>, prefix: &str) -> Result<Self> {
        let state_prefix = format!("{prefix}.quant_state.bitsandbytes__");
        let mut keys: Vec<&str> = st
            .names()
            .into_iter()
            .filter(|n| n.starts_with(&state_prefix))
            .collect();
        keys.sort_unstable();
        let key = match keys.as_slice() {
            [k] => *k,
            [] => {
                return Err(QuantError::MissingTensor(format!(
                    "{state_prefix}{{nf4,fp4}}"
                )))
            }
            _ => {
                return Err(QuantError::BadQuantState(format!(
                    "more than one quant state under {prefix:?}"
                )))
            }
        };
        let qt = QuantType::from_name(&key[state_prefix.len()..])?;
        let blob = u8_data(key, &get(st, key)?)?;
        if blob.len() > MAX_STATE_BYTES {
            return Err(QuantError::BadQuantState(format!(
                "{} bytes of JSON (at most {MAX_STATE_BYTES})",
                blob.len()
            )));
        }
        let state: PackedState =
            serde_json::from_slice(blob).map_err(|e| QuantError::BadQuantState(e.to_string()))?;
        if QuantType::from_name(&state.quant_type)? != qt {
            return Err(QuantError::BadQuantState(format!(
                "quant_type {:?} under a {} key",
                state.quant_type,
                qt.name()
            )));
        }
        if !matches!(state.dtype.as_str(), "float32" | "float16" | "bfloat16") {
            return Err(QuantError::BadQuantState(format!(
                "dtype {:?} is not a float type",
                state.dtype
            )));
        }

        let codes_name = prefix.to_string();
        let codes = u8_data(&codes_name, &get(st, &codes_name)?)?;
        let map_name = format!("{prefix}.quant_map");
        let map = f32_data(&map_name, &get(st, &map_name)?)?;
        check_map("quant_map", qt.name(), &map, qt.code())?;

        let absmax_name = format!("{prefix}.absmax");
        let absmax_view = get(st, &absmax_name)?;
        let nested = state.nested_offset.is_some()
            || state.nested_blocksize.is_some()
            || st.tensor(&format!("{prefix}.nested_absmax")).is_ok();
        let plain;
        let (nested_absmax, nested_map);
        let absmax = if nested {
            if state.nested_blocksize != Some(NESTED_BLOCKSIZE as u64) {
                return Err(QuantError::BadQuantState(format!(
                    "nested_blocksize {:?} (bitsandbytes uses {NESTED_BLOCKSIZE})",
                    state.nested_blocksize
                )));
            }
            if state.nested_dtype.as_deref() != Some("float32") {
                return Err(QuantError::BadQuantState(format!(
                    "nested_dtype {:?} (expected \"float32\")",
                    state.nested_dtype
                )));
            }
            let offset = state
                .nested_offset
                .ok_or_else(|| QuantError::BadQuantState("nested_offset missing".into()))?;
            let offset = offset as f32;
            let na = format!("{prefix}.nested_absmax");
            nested_absmax = f32_data(&na, &get(st, &na)?)?;
            let nm = format!("{prefix}.nested_quant_map");
            nested_map = f32_data(&nm, &get(st, &nm)?)?;
            AbsmaxParts::Double {
                codes: u8_data(&absmax_name, &absmax_view)?,
                offset,
                absmax2: &nested_absmax,
                code2: &nested_map,
            }
        } else {
            plain = f32_data(&absmax_name, &absmax_view)?;
            AbsmaxParts::Plain(&plain)
        };
        QuantizedTensor::from_parts(
            cpu,
            QuantParts {
                codes,
                absmax,
                shape: &state.shape,
                blocksize: state.blocksize,
                quant_type: qt,
            },
        )
    }

    /// This tensor's entries in bitsandbytes' layout under `prefix`, ready for
    /// [`safetensors::serialize`] (see [`to_bnb_safetensors`](Self::to_bnb_safetensors)).
    pub fn bnb_entries(&self, prefix: &str) -> Result<Vec<BnbEntry>> {
        let f32_bytes = |v: &[f32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
        let mut state = PackedState {
            quant_type: self.quant_type().name().to_string(),
            blocksize: self.blocksize().get() as u64,
            dtype: "float32".to_string(),
            shape: self.shape().iter().map(|&d| d as u64).collect(),
            nested_blocksize: None,
            nested_dtype: None,
            nested_offset: None,
        };
        let packed = self.packed();
        let mut out = vec![
            BnbEntry::new(
                prefix.to_string(),
                Dtype::U8,
                vec![packed.len(), 1],
                packed.to_vec(),
            ),
            BnbEntry::new(
                format!("{prefix}.quant_map"),
                Dtype::F32,
                vec![16],
                f32_bytes(self.quant_type().code()),
            ),
        ];
        match self.absmax_storage() {
            AbsmaxStorage::Plain(_) => {
                let a = self.absmax_f32();
                out.push(BnbEntry::new(
                    format!("{prefix}.absmax"),
                    Dtype::F32,
                    vec![a.len()],
                    f32_bytes(&a),
                ));
            }
            AbsmaxStorage::Double(d) => {
                state.nested_blocksize = Some(NESTED_BLOCKSIZE as u64);
                state.nested_dtype = Some("float32".to_string());
                state.nested_offset = Some(d.offset() as f64);
                out.push(BnbEntry::new(
                    format!("{prefix}.absmax"),
                    Dtype::U8,
                    vec![d.codes().len()],
                    d.codes().to_vec(),
                ));
                out.push(BnbEntry::new(
                    format!("{prefix}.nested_absmax"),
                    Dtype::F32,
                    vec![d.absmax2().len()],
                    f32_bytes(d.absmax2()),
                ));
                out.push(BnbEntry::new(
                    format!("{prefix}.nested_quant_map"),
                    Dtype::F32,
                    vec![d.code2().len()],
                    f32_bytes(d.code2()),
                ));
            }
        }
        let json =
            serde_json::to_vec(&state).map_err(|e| QuantError::BadQuantState(e.to_string()))?;
        out.push(BnbEntry::new(
            format!(
                "{prefix}.quant_state.bitsandbytes__{}",
                self.quant_type().name()
            ),
            Dtype::U8,
            vec![json.len()],
            json,
        ));
        Ok(out)
    }

    /// A safetensors file holding this tensor under `prefix`, in the layout bitsandbytes,
    /// transformers and PEFT load.
    pub fn to_bnb_safetensors(&self, prefix: &str) -> Result<Vec<u8>> {
        let entries = self.bnb_entries(prefix)?;
        let views = entries
            .iter()
            .map(|e| {
                TensorView::new(e.dtype, e.shape.clone(), &e.data)
                    .map(|v| (e.name.clone(), v))
                    .map_err(format_err)
            })
            .collect::<Result<Vec<_>>>()?;
        safetensors::serialize(views, None::<HashMap<String, String>>).map_err(format_err)
    }
}
