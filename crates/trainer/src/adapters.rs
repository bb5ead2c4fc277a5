//! PEFT LoRA adapters on the trainer's models: read an adapter directory, check it against the
//! model's linear layers, and merge it into the fp32 masters as PEFT's `merge_and_unload()`
//! does (`W += scaling · B·A`), for `headroom merge`, `sample --adapter` and `eval --adapter`.
//!
//! Names: PEFT names a module by its path in the transformers model it wrapped. Llama's
//! modules are `model.layers.{l}.self_attn.q_proj` and so on, as headroom names the masters;
//! GPT-2's sit under `transformer.` in `GPT2LMHeadModel` (`transformer.h.{l}.attn.c_attn`),
//! which headroom's names omit, so the prefix is added before matching. Every master is
//! `[out, in]` (GPT-2's Conv1D weights are transposed on load), so every merge is in that
//! layout.

use std::path::Path;

use headroom_lora::{LoraAdapter, WeightLayout};
use headroom_tensor::{Cpu, CpuTensor};

use crate::model::{params, Family, ModelConfig};
use crate::{Result, TrainError};

/// PEFT's module name for a headroom parameter name of `cfg`'s family (`.weight` removed).
fn peft_module(cfg: &ModelConfig, weight_name: &str) -> Option<String> {
    let module = weight_name.strip_suffix(".weight")?;
    Some(match cfg.family {
        Family::Gpt2 if module != "lm_head" => format!("transformer.{module}"),
        _ => module.to_owned(),
    })
}

/// Read the PEFT adapter in `dir`: a PEFT adapter directory, or a headroom LoRA run — its
/// checkpoint root (the newest step) or one step — whose every file is first checked against
/// its manifest.
pub fn load(cpu: &Cpu, dir: &Path) -> Result<LoraAdapter> {
    if dir.join(crate::checkpoint::MANIFEST).is_file()
        || !dir.join(headroom_lora::CONFIG_FILE).is_file()
    {
        if let Ok(step) = crate::checkpoint::resolve(dir) {
            // Opening reads the manifest, the state and a fine-tuning step's adapters (all
            // verified), never a full model's weights or moments: a model checkpoint passed
            // as an adapter is refused below without reading gigabytes first.
            let ck = crate::checkpoint::ResumePoint::open(&step)?;
            if let (Some(f), Some(adapters)) = (&ck.state.finetune, &ck.adapters) {
                let params: Vec<&[f32]> = adapters.iter().map(Vec::as_slice).collect();
                return crate::checkpoint::adapter_of(&ck.state.config, &f.spec, &params);
            }
        }
    }
    LoraAdapter::load(cpu, dir).map_err(|source| TrainError::Adapter {
        path: dir.to_path_buf(),
        source,
    })
}

/// Merge `adapter` into `masters` (the model's fp32 parameters in [`params`] order) after
/// checking that every adapted module is one of the model's linear layers with the adapter's
/// shape and that every module the adapter's targets name has an adapter. Returns the number
/// of modules merged. Nothing is changed when a check fails.
pub fn merge(
    cfg: &ModelConfig,
    masters: &mut [CpuTensor],
    adapter: &LoraAdapter,
    dir: &Path,
) -> Result<usize> {
    let wrap = |source| TrainError::Adapter {
        path: dir.to_path_buf(),
        source,
    };
    let infos = params::param_infos(cfg);
    if infos.len() != masters.len() {
        return Err(TrainError::Input(format!(
            "{} masters for a model of {} tensors",
            masters.len(),
            infos.len()
        )));
    }
    // The linear layers: every 2-d weight but the embeddings (PEFT adapts nn.Linear and
    // Conv1D; an embedding adapter is a different PEFT layer).
    let modules: Vec<(usize, String, usize, usize)> = infos
        .iter()
        .enumerate()
        .filter(|(_, info)| info.shape.len() == 2 && !is_embedding(&info.name))
        .filter_map(|(i, info)| {
            peft_module(cfg, &info.name).map(|m| (i, m, info.shape[0], info.shape[1]))
        })
        .collect();
    adapter
        .check_base(modules.iter().map(|(_, m, o, i)| (m.as_str(), *o, *i)))
        .map_err(wrap)?;
    let mut merged = 0;
    for (i, module, _, _) in &modules {
        if let Some(lora) = adapter.get(module) {
            let w = masters[*i].as_mut_slice::<f32>()?;
            lora.merge_into(w, WeightLayout::OutIn).map_err(wrap)?;
            merged += 1;
        }
    }
    Ok(merged)
}

/// `adapter`'s tensors in the order a fine-tuning model over `cfg` takes them
/// ([`crate::model::finetune::adapter_infos`]: `[A, B]` per adapted module), after the same
/// checks as [`merge`]: every module the adapter's targets name on this model has its
/// adapter, with the model's shapes.
pub fn unmerged_tensors(
    cfg: &ModelConfig,
    adapter: &LoraAdapter,
    dir: &Path,
) -> Result<Vec<Vec<f32>>> {
    let wrap = |source| TrainError::Adapter {
        path: dir.to_path_buf(),
        source,
    };
    let modules = crate::model::finetune::adapted_modules(cfg, adapter.config())?;
    adapter
        .check_base(
            modules
                .iter()
                .map(|m| (m.name.as_str(), m.out_features, m.in_features)),
        )
        .map_err(wrap)?;
    let mut out = Vec::with_capacity(2 * modules.len());
    for m in &modules {
        let lora = adapter.get(&m.name).ok_or_else(|| {
            TrainError::Input(format!(
                "adapter {}: no adapter for {}, which its targets name",
                dir.display(),
                m.name
            ))
        })?;
        out.push(lora.a().to_vec());
        out.push(lora.b().to_vec());
    }
    Ok(out)
}

fn is_embedding(name: &str) -> bool {
    ["wte.weight", "wpe.weight", "model.embed_tokens.weight"].contains(&name)
}
