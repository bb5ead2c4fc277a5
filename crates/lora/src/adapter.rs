//! [`LoraAdapter`]: the adapters of a whole model under one [`LoraConfig`].

use std::collections::BTreeMap;

use headroom_tensor::Cpu;

use crate::config::LoraConfig;
use crate::error::{LoraError, Result};
use crate::linear::LoraLinear;

/// Bytes an adapter's training state takes, per memory category: what the tracker counts
/// once the parameters, gradients and optimizer moments are allocated.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AdapterMemory {
    /// Trainable parameters (Σ `r · (in + out)`).
    pub parameters: usize,
    /// `Parameters` bytes (f32 A and B).
    pub parameter_bytes: usize,
    /// `Gradients` bytes (f32 dA and dB).
    pub gradient_bytes: usize,
    /// `OptimizerState` bytes for the number of f32 moments asked for (2 for Adam).
    pub optimizer_bytes: usize,
}

/// One base module: its name and shape, `(name, out_features, in_features)`.
pub type ModuleShape<'a> = (&'a str, usize, usize);

/// The adapters of a model, by module name (sorted), sharing one configuration.
#[derive(Debug)]
pub struct LoraAdapter {
    config: LoraConfig,
    modules: BTreeMap<String, LoraLinear>,
}

impl LoraAdapter {
    /// Fresh adapters (PEFT initialisation, see [`LoraLinear::new`]) for every base module
    /// that `config` targets ([`LoraConfig::matches`]). No match at all is an error, as in
    /// PEFT.
    pub fn new<'a>(
        cpu: &Cpu,
        config: LoraConfig,
        base_modules: impl IntoIterator<Item = ModuleShape<'a>>,
    ) -> Result<Self> {
        config.validate()?;
        let mut modules = BTreeMap::new();
        for (name, out_f, in_f) in base_modules {
            if config.matches(name) {
                modules.insert(
                    name.to_owned(),
                    LoraLinear::new(cpu, name, out_f, in_f, &config)?,
                );
            }
        }
        if modules.is_empty() {
            return Err(LoraError::NoTargetMatched {
                targets: config.target_modules.clone(),
            });
        }
        Ok(LoraAdapter { config, modules })
    }

    /// Adapters assembled from modules already built (a loader's path). Every module must be
    /// targeted by `config` and have its rank.
    pub fn from_modules(
        config: LoraConfig,
        modules: impl IntoIterator<Item = LoraLinear>,
    ) -> Result<Self> {
        config.validate()?;
        let mut map = BTreeMap::new();
        for m in modules {
            if !config.matches(m.name()) {
                return Err(LoraError::NotTargeted {
                    module: m.name().to_owned(),
                    targets: config.target_modules.clone(),
                });
            }
            if m.rank() != config.r {
                return Err(LoraError::RankMismatch {
                    name: m.name().to_owned(),
                    expected: config.r,
                    actual: m.rank(),
                });
            }
            map.insert(m.name().to_owned(), m);
        }
        if map.is_empty() {
            return Err(LoraError::NoTargetMatched {
                targets: config.target_modules.clone(),
            });
        }
        Ok(LoraAdapter {
            config,
            modules: map,
        })
    }

    /// The configuration.
    pub fn config(&self) -> &LoraConfig {
        &self.config
    }
    /// The adapter of module `name`.
    pub fn get(&self, name: &str) -> Option<&LoraLinear> {
        self.modules.get(name)
    }
    /// The adapter of module `name`, mutable.
    pub fn get_mut(&mut self, name: &str) -> Option<&mut LoraLinear> {
        self.modules.get_mut(name)
    }
    /// Every adapter, by module name.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &LoraLinear)> + '_ {
        self.modules.iter().map(|(k, v)| (k.as_str(), v))
    }
    /// Every adapter, mutable.
    pub fn iter_mut(&mut self) -> impl Iterator<Item = (&str, &mut LoraLinear)> + '_ {
        self.modules.iter_mut().map(|(k, v)| (k.as_str(), v))
    }
    /// Number of adapted modules.
    pub fn len(&self) -> usize {
        self.modules.len()
    }
    /// Whether there is no adapted module (never true for a constructed adapter).
    pub fn is_empty(&self) -> bool {
        self.modules.is_empty()
    }

    /// Memory of the adapters' training state with `moments` f32 optimizer moments per
    /// parameter (2 for AdamW, 0 for SGD): exactly what [`LoraLinear::alloc_grads`] and
    /// [`LoraLinear::alloc_moments`] allocate.
    pub fn memory(&self, moments: usize) -> AdapterMemory {
        let parameters: usize = self.modules.values().map(LoraLinear::parameter_count).sum();
        AdapterMemory {
            parameters,
            parameter_bytes: parameters * 4,
            gradient_bytes: parameters * 4,
            optimizer_bytes: parameters.saturating_mul(4).saturating_mul(moments),
        }
    }

    /// Check the adapters against the base model's modules: every targeted base module has
    /// an adapter of its shape, and every adapter has a base module.
    pub fn check_base<'a>(
        &self,
        base_modules: impl IntoIterator<Item = ModuleShape<'a>>,
    ) -> Result<()> {
        let mut seen = std::collections::BTreeSet::new();
        for (name, out_f, in_f) in base_modules {
            match self.modules.get(name) {
                Some(m) => {
                    seen.insert(name);
                    if (m.out_features(), m.in_features()) != (out_f, in_f) {
                        return Err(LoraError::ShapeMismatch {
                            name: name.to_owned(),
                            expected: format!("base [{out_f}, {in_f}]"),
                            actual: vec![m.out_features(), m.in_features()],
                        });
                    }
                }
                None if self.config.matches(name) => {
                    return Err(LoraError::MissingModule {
                        module: name.to_owned(),
                    })
                }
                None => {}
            }
        }
        match self.modules.keys().find(|k| !seen.contains(k.as_str())) {
            Some(module) => Err(LoraError::UnknownModule {
                module: module.clone(),
            }),
            None => Ok(()),
        }
    }
}
