//! Selective recomputation inside a layer: a policy the layer consults for each intermediate it
//! could keep for its backward.
//!
//! Keeping matmul outputs and recomputing cheap elementwise results (GELU, layer-norm outputs)
//! is what llm.c's `-r` levels and Megatron-LM's selective recompute do: most of the memory of
//! an MLP block, a few percent of its compute. A policy is a type; layers are generic over it,
//! and [`SaveAll`] (the default) is a zero-sized type whose answer is a constant, so a layer
//! that uses no policy pays nothing.

use serde::{Deserialize, Serialize};

/// The kinds of intermediate a layer may keep or recompute.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Intermediate {
    /// Output of a matrix multiply (expensive to recompute).
    MatmulOutput,
    /// Output of an elementwise activation (GELU, SiLU): cheap to recompute from its input.
    Activation,
    /// Output of a normalisation (layer norm, RMS norm): cheap to recompute from the input and
    /// the (always kept, tiny) statistics.
    Norm,
}

impl Intermediate {
    const fn bit(self) -> u8 {
        match self {
            Intermediate::MatmulOutput => 1,
            Intermediate::Activation => 2,
            Intermediate::Norm => 4,
        }
    }
}

/// Decides, per kind of intermediate, whether a layer keeps it or recomputes it in backward.
///
/// Whatever the policy, gradients are bitwise the same (recomputation is deterministic); only
/// memory and time change.
pub trait RecomputePolicy: Copy + Send + Sync + std::fmt::Debug + 'static {
    /// Whether to keep intermediates of `kind` for the backward.
    fn keep(&self, kind: Intermediate) -> bool;
}

/// Keep everything (no recomputation). Zero-sized; `keep` is a constant.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SaveAll;

impl RecomputePolicy for SaveAll {
    #[inline(always)]
    fn keep(&self, _: Intermediate) -> bool {
        true
    }
}

/// Keep matmul outputs; recompute activations and norm outputs (Megatron-style selective
/// recompute). Zero-sized.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct KeepMatmuls;

impl RecomputePolicy for KeepMatmuls {
    #[inline(always)]
    fn keep(&self, kind: Intermediate) -> bool {
        kind == Intermediate::MatmulOutput
    }
}

/// A policy chosen at run time: a set of kinds to keep.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Selective {
    keep_mask: u8,
}

impl Default for Selective {
    fn default() -> Self {
        Selective::save_all()
    }
}

impl Selective {
    /// Keep every kind.
    pub const fn save_all() -> Self {
        Selective { keep_mask: 0b111 }
    }

    /// Keep nothing: recompute every intermediate from the layer's input.
    pub const fn recompute_all() -> Self {
        Selective { keep_mask: 0 }
    }

    /// llm.c's `-r` recompute levels: 0 keeps everything, 1 recomputes activations (GELU),
    /// 2 (and above) also recomputes norm outputs.
    pub const fn llmc_level(level: u8) -> Self {
        match level {
            0 => Selective::save_all(),
            1 => Selective { keep_mask: 0b101 },
            _ => Selective { keep_mask: 0b001 },
        }
    }

    /// This policy, also keeping `kind`.
    pub const fn keeping(self, kind: Intermediate) -> Self {
        Selective {
            keep_mask: self.keep_mask | kind.bit(),
        }
    }

    /// This policy, recomputing `kind`.
    pub const fn recomputing(self, kind: Intermediate) -> Self {
        Selective {
            keep_mask: self.keep_mask & !kind.bit(),
        }
    }
}

impl RecomputePolicy for Selective {
    #[inline]
    fn keep(&self, kind: Intermediate) -> bool {
        self.keep_mask & kind.bit() != 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ALL: [Intermediate; 3] = [
        Intermediate::MatmulOutput,
        Intermediate::Activation,
        Intermediate::Norm,
    ];

    #[test]
    fn policies_answer_as_documented() {
        assert!(ALL.iter().all(|&k| SaveAll.keep(k)));
        assert!(ALL.iter().all(|&k| Selective::save_all().keep(k)));
        assert!(ALL.iter().all(|&k| !Selective::recompute_all().keep(k)));
        for k in ALL {
            assert_eq!(KeepMatmuls.keep(k), k == Intermediate::MatmulOutput);
            assert_eq!(Selective::llmc_level(2).keep(k), KeepMatmuls.keep(k));
        }
        let l1 = Selective::llmc_level(1);
        assert!(l1.keep(Intermediate::Norm) && !l1.keep(Intermediate::Activation));
        let p = Selective::recompute_all().keeping(Intermediate::Norm);
        assert!(p.keep(Intermediate::Norm) && !p.keep(Intermediate::MatmulOutput));
        assert!(!Selective::save_all()
            .recomputing(Intermediate::Norm)
            .keep(Intermediate::Norm));
        assert_eq!(std::mem::size_of::<SaveAll>(), 0);
        assert_eq!(std::mem::size_of::<KeepMatmuls>(), 0);
    }
}
