//! The layer contract: an explicit forward that hands back what it saved, and a backward that
//! consumes it.

use headroom_tensor::{Backend, Result};

/// What a layer keeps between its forward and its backward, besides its input.
///
/// The executor keeps every saved layer's *input* itself (and counts it), so a layer's saved
/// state holds only the extra intermediates its backward needs (pre-activations, normalisation
/// statistics, …).
pub trait SavedState {
    /// Bytes this state holds alive (the byte size of every tensor inside it).
    fn size_in_bytes(&self) -> usize;
}

/// Nothing saved (a layer whose backward needs only its input).
impl SavedState for () {
    fn size_in_bytes(&self) -> usize {
        0
    }
}

/// One stage of a chain with an explicit forward and backward.
///
/// Invariants a layer must keep for checkpointing to be exact:
/// - `forward_save` and `forward_discard` compute bitwise the same output for the same input
///   and parameters (deterministic kernels), so recomputation reproduces what was discarded.
/// - `backward` accumulates (`+=`) into the layer's parameter gradients and returns the
///   gradient with respect to the input; it runs exactly once per step for every schedule.
/// - Allocations made for the saved state and the output are left in the caller's
///   [`MemoryCategory`](headroom_tensor::MemoryCategory) (the executor sets
///   `Activations`); temporary buffers are tagged `Workspace` by the layer, so the allocation
///   hook sees exactly what the executor counts.
pub trait Layer<B: Backend> {
    /// What the forward keeps for the backward (besides the input).
    type Saved: SavedState;

    /// Forward, keeping what the backward needs.
    fn forward_save(&self, backend: &B, input: &B::Tensor) -> Result<(B::Tensor, Self::Saved)>;

    /// Forward that keeps nothing (used while sweeping towards a checkpoint or recomputing).
    fn forward_discard(&self, backend: &B, input: &B::Tensor) -> Result<B::Tensor>;

    /// Backward: consumes the saved state, accumulates parameter gradients, returns the input
    /// gradient.
    fn backward(
        &mut self,
        backend: &B,
        input: &B::Tensor,
        saved: Self::Saved,
        grad_output: &B::Tensor,
    ) -> Result<B::Tensor>;
}
