//! The cost model of a chain: per-layer compute time and bytes, as the planner and the
//! schedule simulator see them.

use serde::{Deserialize, Serialize};

use crate::PlanError;

/// Measured or supplied costs of one layer.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct LayerCost {
    /// Time of one forward (any unit, consistently: seconds, FLOPs, …).
    pub forward_time: f64,
    /// Time of one backward (same unit). Does not influence the choice of schedule (every
    /// schedule runs each backward once); it is reported in the predicted step time.
    pub backward_time: f64,
    /// Bytes of the layer's input activation. The chain's first input is the caller's and is
    /// never counted.
    pub input_bytes: u64,
    /// Bytes of the layer's saved state besides its input ([`SavedState::size_in_bytes`](crate::SavedState::size_in_bytes)).
    pub saved_bytes: u64,
}

/// Costs of a whole chain: every layer, plus the size of the chain's output. Deserialising
/// one validates it too.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(try_from = "UncheckedChainCost")]
pub struct ChainCost {
    layers: Vec<LayerCost>,
    output_bytes: u64,
}

/// A cost model as read from a file, before validation.
#[derive(Deserialize)]
struct UncheckedChainCost {
    layers: Vec<LayerCost>,
    output_bytes: u64,
}

impl TryFrom<UncheckedChainCost> for ChainCost {
    type Error = PlanError;
    fn try_from(c: UncheckedChainCost) -> Result<Self, PlanError> {
        ChainCost::new(c.layers, c.output_bytes)
    }
}

impl ChainCost {
    /// A chain's costs. Errors for an empty chain or a negative / non-finite time.
    pub fn new(layers: Vec<LayerCost>, output_bytes: u64) -> Result<Self, PlanError> {
        if layers.is_empty() {
            return Err(PlanError::InvalidCosts("the chain has no layers".into()));
        }
        for (i, l) in layers.iter().enumerate() {
            for (what, t) in [("forward", l.forward_time), ("backward", l.backward_time)] {
                if !t.is_finite() || t < 0.0 {
                    return Err(PlanError::InvalidCosts(format!(
                        "layer {i}: {what} time {t} is not a finite non-negative number"
                    )));
                }
            }
        }
        Ok(ChainCost {
            layers,
            output_bytes,
        })
    }

    /// A chain of `n` identical layers.
    pub fn homogeneous(n: usize, layer: LayerCost) -> Result<Self, PlanError> {
        let out = layer.input_bytes;
        ChainCost::new(vec![layer; n], out)
    }

    /// Number of layers.
    pub fn len(&self) -> usize {
        self.layers.len()
    }

    /// Always false: a cost model has at least one layer.
    pub fn is_empty(&self) -> bool {
        self.layers.is_empty()
    }

    /// The per-layer costs.
    pub fn layers(&self) -> &[LayerCost] {
        &self.layers
    }

    /// Bytes of the chain's output (the last layer's output).
    pub fn output_bytes(&self) -> u64 {
        self.output_bytes
    }

    /// Bytes of activation `k` (the input of layer `k`, or the output for `k == len`) as the
    /// executor counts them: activation 0 is the caller's input and costs nothing.
    pub fn activation_bytes(&self, k: usize) -> u64 {
        if k == 0 {
            0
        } else if k < self.layers.len() {
            self.layers[k].input_bytes
        } else {
            self.output_bytes
        }
    }

    /// Extra bytes layer `i` saves besides its input.
    pub fn saved_bytes(&self, i: usize) -> u64 {
        self.layers.get(i).map_or(0, |l| l.saved_bytes)
    }

    /// Forward time of layer `i`.
    pub fn forward_time(&self, i: usize) -> f64 {
        self.layers.get(i).map_or(0.0, |l| l.forward_time)
    }

    /// Sum of all forward times (one plain forward pass).
    pub fn total_forward_time(&self) -> f64 {
        self.layers.iter().map(|l| l.forward_time).sum()
    }

    /// Sum of all backward times.
    pub fn total_backward_time(&self) -> f64 {
        self.layers.iter().map(|l| l.backward_time).sum()
    }
}
