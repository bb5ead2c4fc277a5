//! Global gradient-norm clipping, computed in f64 over all gradients together.

use headroom_tensor::Backend;
use serde::{Deserialize, Serialize};

use crate::{AccumError, Result};

/// What clipping did.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct ClipReport {
    /// The global L2 norm before clipping.
    pub norm: f64,
    /// The factor every gradient was multiplied by (`max_norm / norm` rounded to f32), or
    /// `None` when `norm <= max_norm` and nothing was touched.
    pub coefficient: Option<f32>,
}

/// The global L2 norm of all gradients, `sqrt(Σ_tensors Σ x²)`, accumulated in f64. The
/// per-tensor sums are added in tensor order, so the result is reproducible.
pub fn global_grad_norm<B: Backend>(backend: &B, grads: &[B::Tensor]) -> Result<f64> {
    let mut total = 0f64;
    for g in grads {
        total += backend.sum_squares(g)?;
    }
    Ok(total.sqrt())
}

/// Scale all gradients by `max_norm / norm` when their global norm exceeds `max_norm`, and
/// leave them bit for bit untouched otherwise. Returns the pre-clip norm.
///
/// Unlike PyTorch's `clip_grad_norm_`, no epsilon is added to the norm: the coefficient is
/// exactly `max_norm / norm` (rounded once to f32), and `norm > max_norm > 0` already rules out
/// a division by zero. A non-finite norm is returned as is and nothing is scaled; callers that
/// reach clipping through [`GradAccumulator`](crate::GradAccumulator) never see one, since
/// non-finite steps are skipped before.
pub fn clip_grad_norm<B: Backend>(
    backend: &B,
    grads: &mut [B::Tensor],
    max_norm: f64,
) -> Result<ClipReport> {
    check_max_norm(max_norm)?;
    let norm = global_grad_norm(backend, grads)?;
    if !norm.is_finite() || norm <= max_norm {
        return Ok(ClipReport {
            norm,
            coefficient: None,
        });
    }
    let coefficient = (max_norm / norm) as f32;
    for g in grads.iter_mut() {
        backend.scale(g, coefficient)?;
    }
    Ok(ClipReport {
        norm,
        coefficient: Some(coefficient),
    })
}

pub(crate) fn check_max_norm(max_norm: f64) -> Result<()> {
    if max_norm.is_finite() && max_norm > 0.0 {
        Ok(())
    } else {
        Err(AccumError::InvalidMaxNorm(max_norm))
    }
}
