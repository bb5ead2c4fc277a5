//! The small interface through which a loss scaler joins the step, so this crate never depends
//! on `headroom-amp`: the trainer wraps its scaler in a type implementing [`GradUnscaler`].

use headroom_tensor::{Backend, BoxedError};

/// What the accumulator needs from a loss scaler: unscale the accumulated gradients once per
/// optimizer step and learn whether the step was taken.
///
/// [`GradAccumulator::finish_step`](crate::GradAccumulator::finish_step) calls
/// [`unscale_and_check`](GradUnscaler::unscale_and_check) exactly once, after the last
/// micro-batch, then [`update`](GradUnscaler::update) exactly once with the step's verdict.
/// Unscaling the sum once instead of every micro-batch costs one pass over the gradients per
/// step rather than one per micro-batch, and the non-finite check sees every micro-batch.
///
/// A dynamic scaler (such as `headroom_amp`'s) joins through a small adapter written where both
/// crates are visible, typically the trainer. A self-contained one:
///
/// ```
/// use headroom_accum::GradUnscaler;
/// use headroom_tensor::{Backend, BoxedError, Cpu, CpuTensor};
///
/// /// Halve on overflow, double after 2000 good steps.
/// struct Dynamic { scale: f32, good_steps: u32 }
///
/// impl GradUnscaler<Cpu> for Dynamic {
///     fn unscale_and_check(&mut self, cpu: &Cpu, grads: &mut [CpuTensor]) -> Result<bool, BoxedError> {
///         let mut refs: Vec<&mut CpuTensor> = grads.iter_mut().collect();
///         Ok(cpu.unscale_and_check(&mut refs, 1.0 / self.scale)?)
///     }
///     fn update(&mut self, found_non_finite: bool) -> Result<(), BoxedError> {
///         if found_non_finite {
///             self.scale /= 2.0;
///             self.good_steps = 0;
///         } else {
///             self.good_steps += 1;
///             if self.good_steps == 2000 {
///                 self.scale *= 2.0;
///                 self.good_steps = 0;
///             }
///         }
///         Ok(())
///     }
/// }
///
/// # fn main() -> Result<(), BoxedError> {
/// let cpu = Cpu::new();
/// let mut scaler = Dynamic { scale: 1024.0, good_steps: 0 };
/// let mut grads = vec![cpu.upload(&[2048.0f32, f32::INFINITY], [2])?];
/// let found = scaler.unscale_and_check(&cpu, &mut grads)?;
/// scaler.update(found)?;
/// assert!(found);
/// assert_eq!(scaler.scale, 512.0);
/// assert_eq!(grads[0].as_slice::<f32>()?[0], 2.0);
/// # Ok(())
/// # }
/// ```
pub trait GradUnscaler<B: Backend> {
    /// Multiply every gradient by `1 / scale` in place and return `true` if any element was
    /// infinite or NaN before unscaling.
    fn unscale_and_check(
        &mut self,
        backend: &B,
        grads: &mut [B::Tensor],
    ) -> Result<bool, BoxedError>;

    /// Learn the step's verdict: `true` when non-finite gradients made it skip (a dynamic
    /// scaler backs off), `false` when it was applied (a dynamic scaler may grow). Fallible
    /// because a scaler with its own step bookkeeping (such as `headroom_amp::LossScaler`,
    /// whose `update` checks it was unscaled first) may refuse.
    fn update(&mut self, found_non_finite: bool) -> Result<(), BoxedError>;
}

impl<B: Backend, U: GradUnscaler<B> + ?Sized> GradUnscaler<B> for &mut U {
    fn unscale_and_check(
        &mut self,
        backend: &B,
        grads: &mut [B::Tensor],
    ) -> Result<bool, BoxedError> {
        (**self).unscale_and_check(backend, grads)
    }
    fn update(&mut self, found_non_finite: bool) -> Result<(), BoxedError> {
        (**self).update(found_non_finite)
    }
}

/// No loss scaling: gradients are left as they are but still checked for non-finite values,
/// so a step with an overflow or NaN is skipped rather than poisoning the weights.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NoLossScaling;

impl<B: Backend> GradUnscaler<B> for NoLossScaling {
    fn unscale_and_check(
        &mut self,
        backend: &B,
        grads: &mut [B::Tensor],
    ) -> Result<bool, BoxedError> {
        // Multiplying by 1.0 is the identity on every value, NaN and ±inf included.
        unscale_all(backend, grads, 1.0)
    }
    fn update(&mut self, _found_non_finite: bool) -> Result<(), BoxedError> {
        Ok(())
    }
}

/// A fixed loss scale: the caller multiplies its loss gradient by [`scale`](Self::scale), the
/// accumulated gradients are divided by it once per step. Counts the steps it saw, so a run
/// can report how many were skipped.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StaticLossScale {
    scale: f32,
    steps: u64,
    skipped: u64,
}

impl StaticLossScale {
    /// A fixed scale; `None` unless `scale` is positive and finite.
    pub fn new(scale: f32) -> Option<Self> {
        (scale.is_finite() && scale > 0.0).then_some(StaticLossScale {
            scale,
            steps: 0,
            skipped: 0,
        })
    }

    /// The factor the loss gradient is multiplied by.
    pub fn scale(&self) -> f32 {
        self.scale
    }

    /// Steps seen by [`GradUnscaler::update`].
    pub fn steps(&self) -> u64 {
        self.steps
    }

    /// Steps skipped for non-finite gradients.
    pub fn skipped(&self) -> u64 {
        self.skipped
    }
}

impl<B: Backend> GradUnscaler<B> for StaticLossScale {
    fn unscale_and_check(
        &mut self,
        backend: &B,
        grads: &mut [B::Tensor],
    ) -> Result<bool, BoxedError> {
        unscale_all(backend, grads, 1.0 / self.scale)
    }
    fn update(&mut self, found_non_finite: bool) -> Result<(), BoxedError> {
        self.steps += 1;
        self.skipped += u64::from(found_non_finite);
        Ok(())
    }
}

fn unscale_all<B: Backend>(
    backend: &B,
    grads: &mut [B::Tensor],
    inv_scale: f32,
) -> Result<bool, BoxedError> {
    let mut refs: Vec<&mut B::Tensor> = grads.iter_mut().collect();
    Ok(backend.unscale_and_check(&mut refs, inv_scale)?)
}
