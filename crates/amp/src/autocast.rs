//! Autocast as an explicit table: which dtype each kind of op computes in and stores its
//! output in.
//!
//! PyTorch's autocast is a global mode that patches ops behind the caller's back. Here the
//! policy is a value the caller holds and asks: "I am about to run a matmul on these inputs —
//! in which dtype do I compute, and in which do I keep the activation?" Nothing is implicit,
//! two policies can coexist (say, one per model), and a policy serialises with the run.
//!
//! The default table follows PyTorch's CUDA autocast lists: matmul/linear, attention and
//! convolution run in the low precision; softmax, log-softmax, normalisation, losses,
//! exp/log/pow and reductions run in f32; elementwise ops run in the widest of their inputs.
//! As in PyTorch, the stored dtype equals the computed one unless overridden (llm.c-style
//! training overrides `store` to keep every activation in bf16).

use std::collections::BTreeMap;
use std::fmt;

use headroom_tensor::DType;
use serde::{Deserialize, Serialize};

use crate::{AmpError, Result};

/// A kind of op, as far as precision is concerned.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum OpCategory {
    /// Matrix multiplication, linear layers, batched matmul.
    MatMul,
    /// Scaled dot-product attention.
    Attention,
    /// Convolutions.
    Convolution,
    /// Softmax.
    Softmax,
    /// Log-softmax.
    LogSoftmax,
    /// Layer norm, RMS norm, group norm.
    Normalization,
    /// Loss functions (cross-entropy, MSE, …).
    Loss,
    /// exp, log, pow and friends, whose range overflows low precision easily.
    Transcendental,
    /// Sums, means, norms.
    Reduction,
    /// Add, multiply, activations (GELU, …) and other elementwise ops.
    Elementwise,
}

impl OpCategory {
    /// Every category, in table order.
    pub const ALL: [OpCategory; 10] = [
        OpCategory::MatMul,
        OpCategory::Attention,
        OpCategory::Convolution,
        OpCategory::Softmax,
        OpCategory::LogSoftmax,
        OpCategory::Normalization,
        OpCategory::Loss,
        OpCategory::Transcendental,
        OpCategory::Reduction,
        OpCategory::Elementwise,
    ];

    /// Short lowercase name for reports.
    pub const fn name(self) -> &'static str {
        match self {
            OpCategory::MatMul => "matmul",
            OpCategory::Attention => "attention",
            OpCategory::Convolution => "convolution",
            OpCategory::Softmax => "softmax",
            OpCategory::LogSoftmax => "log_softmax",
            OpCategory::Normalization => "normalization",
            OpCategory::Loss => "loss",
            OpCategory::Transcendental => "transcendental",
            OpCategory::Reduction => "reduction",
            OpCategory::Elementwise => "elementwise",
        }
    }

    fn index(self) -> usize {
        self as usize
    }
}

impl fmt::Display for OpCategory {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A floating-point dtype (a [`DType`] that a precision rule can name; integer dtypes cannot
/// be, so a policy never asks to compute a matmul in u16).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum FloatDType {
    /// f32.
    F32,
    /// f16.
    F16,
    /// bf16.
    BF16,
}

impl From<FloatDType> for DType {
    fn from(f: FloatDType) -> DType {
        match f {
            FloatDType::F32 => DType::F32,
            FloatDType::F16 => DType::F16,
            FloatDType::BF16 => DType::BF16,
        }
    }
}

/// How one dtype (compute or store) of an op is chosen.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum PrecisionRule {
    /// The policy's low precision (f16 or bf16; f32 under the fp32 preset).
    Low,
    /// f32.
    Full,
    /// The widest float dtype among the op's inputs (f16 with bf16 widens to f32, as PyTorch
    /// promotes them).
    WidestInput,
    /// Always this dtype.
    Fixed(FloatDType),
}

/// The compute and storage rules of one op category or named op.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct OpPrecision {
    /// The dtype the op computes in (its inputs are cast to it).
    pub compute: PrecisionRule,
    /// The dtype its output is stored in (what an activation costs in memory).
    pub store: PrecisionRule,
}

impl OpPrecision {
    /// Compute and store by the same rule.
    pub const fn same(rule: PrecisionRule) -> Self {
        OpPrecision {
            compute: rule,
            store: rule,
        }
    }
}

/// The answer for one op: cast the inputs to `compute`, keep the output as `store`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct AutocastDecision {
    /// The dtype to compute in.
    pub compute: DType,
    /// The dtype to store the output in.
    pub store: DType,
}

/// The built-in tables.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum AutocastPreset {
    /// Everything in f32 (autocast off).
    Fp32,
    /// Low precision is bf16.
    Bf16,
    /// Low precision is f16 (pair it with a loss scaler).
    Fp16,
}

impl AutocastPreset {
    /// The preset's low precision dtype.
    pub const fn low_precision(self) -> FloatDType {
        match self {
            AutocastPreset::Fp32 => FloatDType::F32,
            AutocastPreset::Bf16 => FloatDType::BF16,
            AutocastPreset::Fp16 => FloatDType::F16,
        }
    }
}

/// The default rule of a category under every preset: PyTorch's autocast lists.
const fn default_rule(category: OpCategory) -> OpPrecision {
    match category {
        OpCategory::MatMul | OpCategory::Attention | OpCategory::Convolution => {
            OpPrecision::same(PrecisionRule::Low)
        }
        OpCategory::Softmax
        | OpCategory::LogSoftmax
        | OpCategory::Normalization
        | OpCategory::Loss
        | OpCategory::Transcendental
        | OpCategory::Reduction => OpPrecision::same(PrecisionRule::Full),
        OpCategory::Elementwise => OpPrecision::same(PrecisionRule::WidestInput),
    }
}

/// An autocast policy: a low precision, one rule per [`OpCategory`], and overrides for named
/// ops (`"lm_head"` → f32, say), which win over their category.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct AutocastPolicy {
    low: FloatDType,
    categories: [OpPrecision; OpCategory::ALL.len()],
    op_overrides: BTreeMap<String, OpPrecision>,
}

impl AutocastPolicy {
    /// A preset's table with no overrides.
    pub fn preset(preset: AutocastPreset) -> Self {
        AutocastPolicy {
            low: preset.low_precision(),
            categories: OpCategory::ALL.map(default_rule),
            op_overrides: BTreeMap::new(),
        }
    }

    /// The low precision dtype.
    pub fn low_precision(&self) -> DType {
        self.low.into()
    }

    /// The rule of a category.
    pub fn category_rule(&self, category: OpCategory) -> OpPrecision {
        // Indexing by a fieldless enum's discriminant into an array of exactly ALL.len().
        self.categories[category.index()]
    }

    /// Replace the rule of a whole category.
    pub fn with_category(mut self, category: OpCategory, rule: OpPrecision) -> Self {
        self.categories[category.index()] = rule;
        self
    }

    /// Give the op named `name` its own rule, whatever its category.
    pub fn with_op_override(mut self, name: impl Into<String>, rule: OpPrecision) -> Self {
        self.op_overrides.insert(name.into(), rule);
        self
    }

    /// The override of a named op, if it has one.
    pub fn op_override(&self, name: &str) -> Option<OpPrecision> {
        self.op_overrides.get(name).copied()
    }

    /// Compute and storage dtypes for an op of `category` with float inputs `inputs`.
    ///
    /// Non-float inputs (token ids, indices) are ignored by [`PrecisionRule::WidestInput`];
    /// if no input is a float it is [`AmpError::NoFloatInput`].
    pub fn decide(&self, category: OpCategory, inputs: &[DType]) -> Result<AutocastDecision> {
        self.resolve(category.name(), self.category_rule(category), inputs)
    }

    /// As [`decide`](Self::decide), but the named op's override wins over its category.
    pub fn decide_op(
        &self,
        name: &str,
        category: OpCategory,
        inputs: &[DType],
    ) -> Result<AutocastDecision> {
        match self.op_override(name) {
            Some(rule) => self.resolve(name, rule, inputs),
            None => self.decide(category, inputs),
        }
    }

    fn resolve(&self, op: &str, rule: OpPrecision, inputs: &[DType]) -> Result<AutocastDecision> {
        Ok(AutocastDecision {
            compute: self.apply(op, rule.compute, inputs)?,
            store: self.apply(op, rule.store, inputs)?,
        })
    }

    fn apply(&self, op: &str, rule: PrecisionRule, inputs: &[DType]) -> Result<DType> {
        Ok(match rule {
            PrecisionRule::Low => self.low.into(),
            PrecisionRule::Full => DType::F32,
            PrecisionRule::Fixed(d) => d.into(),
            PrecisionRule::WidestInput => {
                widest_float(inputs).ok_or_else(|| AmpError::NoFloatInput {
                    op: op.to_owned(),
                    inputs: inputs.to_vec(),
                })?
            }
        })
    }
}

/// The widest float among `inputs`: f32 if any is f32 or if f16 meets bf16 (neither holds the
/// other), else the one low precision present; `None` without float inputs.
fn widest_float(inputs: &[DType]) -> Option<DType> {
    let has = |d: DType| inputs.contains(&d);
    match (has(DType::F32), has(DType::F16), has(DType::BF16)) {
        (true, _, _) | (false, true, true) => Some(DType::F32),
        (false, true, false) => Some(DType::F16),
        (false, false, true) => Some(DType::BF16),
        (false, false, false) => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn presets_follow_the_issue_table() {
        for (preset, low) in [
            (AutocastPreset::Fp32, DType::F32),
            (AutocastPreset::Bf16, DType::BF16),
            (AutocastPreset::Fp16, DType::F16),
        ] {
            let p = AutocastPolicy::preset(preset);
            assert_eq!(p.low_precision(), low);
            for c in [
                OpCategory::MatMul,
                OpCategory::Attention,
                OpCategory::Convolution,
            ] {
                assert_eq!(
                    p.decide(c, &[DType::F32, DType::F32]).unwrap(),
                    AutocastDecision {
                        compute: low,
                        store: low
                    },
                    "{c}"
                );
            }
            for c in [
                OpCategory::Softmax,
                OpCategory::LogSoftmax,
                OpCategory::Normalization,
                OpCategory::Loss,
                OpCategory::Transcendental,
                OpCategory::Reduction,
            ] {
                assert_eq!(p.decide(c, &[low]).unwrap().compute, DType::F32, "{c}");
            }
            assert_eq!(
                p.decide(OpCategory::Elementwise, &[low, low])
                    .unwrap()
                    .compute,
                low
            );
            assert_eq!(
                p.decide(OpCategory::Elementwise, &[low, DType::F32])
                    .unwrap()
                    .compute,
                DType::F32
            );
        }
    }

    #[test]
    fn overrides_win_and_storage_can_differ() {
        let p = AutocastPolicy::preset(AutocastPreset::Bf16)
            .with_op_override("lm_head", OpPrecision::same(PrecisionRule::Full))
            .with_category(
                OpCategory::Normalization,
                OpPrecision {
                    compute: PrecisionRule::Full,
                    store: PrecisionRule::Low,
                },
            );
        let bf = [DType::BF16];
        assert_eq!(
            p.decide_op("lm_head", OpCategory::MatMul, &bf)
                .unwrap()
                .compute,
            DType::F32
        );
        assert_eq!(
            p.decide_op("fc1", OpCategory::MatMul, &bf).unwrap().compute,
            DType::BF16
        );
        assert_eq!(
            p.decide(OpCategory::Normalization, &bf).unwrap(),
            AutocastDecision {
                compute: DType::F32,
                store: DType::BF16
            }
        );
        let json = serde_json::to_string(&p).unwrap();
        assert_eq!(serde_json::from_str::<AutocastPolicy>(&json).unwrap(), p);
    }

    #[test]
    fn widest_input_needs_a_float() {
        let p = AutocastPolicy::preset(AutocastPreset::Fp16);
        assert_eq!(
            p.decide(OpCategory::Elementwise, &[DType::U32, DType::F16])
                .unwrap()
                .compute,
            DType::F16
        );
        assert!(matches!(
            p.decide(OpCategory::Elementwise, &[DType::U16]),
            Err(AmpError::NoFloatInput { .. })
        ));
        // Rules that do not look at the inputs do not need a float input.
        assert_eq!(
            p.decide(OpCategory::MatMul, &[]).unwrap().compute,
            DType::F16
        );
    }

    fn float_dtype() -> impl Strategy<Value = DType> {
        prop_oneof![Just(DType::F32), Just(DType::F16), Just(DType::BF16)]
    }

    proptest! {
        /// The widest input holds every float input exactly: f32 holds all, f16/bf16 only
        /// themselves — and it is the narrowest such dtype.
        #[test]
        fn widest_input_holds_every_input(inputs in proptest::collection::vec(float_dtype(), 1..5)) {
            let w = widest_float(&inputs).unwrap();
            let holds = |wide: DType, d: DType| wide == DType::F32 || wide == d;
            prop_assert!(inputs.iter().all(|&d| holds(w, d)));
            if w != DType::F32 {
                prop_assert!(inputs.iter().all(|&d| d == w));
            } else {
                // f32 only when needed: an f32 input, or both low precisions.
                prop_assert!(inputs.contains(&DType::F32) || (inputs.contains(&DType::F16) && inputs.contains(&DType::BF16)));
            }
        }
    }
}
