//! The chain executor: runs a validated [`Schedule`] over real layers and tensors, counting
//! live saved bytes exactly as the simulator predicts them.

use std::time::Instant;

use headroom_tensor::{Backend, MemoryCategory, Tensor};

use crate::schedule::InputSource;
use crate::{
    ChainCost, CkptError, Layer, LayerCost, Op, SavedState, Schedule, ScheduleError, ScheduleStats,
};

/// A chain of layers run forward then backward under a schedule.
///
/// Layers of different kinds go in one chain through an enum of them, or boxed as
/// [`BoxedLayer`](crate::BoxedLayer)s; the chain itself is generic so a homogeneous chain costs
/// no dispatch.
#[derive(Clone, Debug)]
pub struct Chain<L> {
    layers: Vec<L>,
}

/// The result of one step.
#[derive(Debug)]
pub struct StepOutput<T> {
    /// Gradient of the loss with respect to the chain's input.
    pub input_grad: T,
    /// Measured figures: exact peak live saved bytes and checkpoint count, forward count,
    /// and wall-clock forward / backward time in seconds.
    pub stats: ScheduleStats,
}

/// A layer's saved state and its input (`None` when the input is the caller's).
struct SavedSlot<T, S> {
    input: Option<T>,
    state: S,
}

/// Mutable state of one step; mirrors the simulator in `schedule.rs` with real tensors.
struct StepState<T, S> {
    hand: Option<(usize, T)>,
    checkpoints: Vec<Option<T>>,
    saved: Vec<Option<SavedSlot<T, S>>>,
    frontier: usize,
    live: u64,
    stats: ScheduleStats,
}

fn bytes<T: Tensor>(t: &T) -> u64 {
    t.size_in_bytes() as u64
}

impl<T: Tensor, S> StepState<T, S> {
    fn free_dead(&mut self) {
        if let Some((k, _)) = &self.hand {
            if *k >= self.frontier {
                if let Some((_, t)) = self.hand.take() {
                    self.live = self.live.saturating_sub(bytes(&t));
                }
            }
        }
        for k in self.frontier..self.checkpoints.len() {
            if let Some(t) = self.checkpoints[k].take() {
                self.live = self.live.saturating_sub(bytes(&t));
            }
        }
        let count = self.checkpoints.iter().filter(|c| c.is_some()).count();
        self.stats.max_checkpoints = self.stats.max_checkpoints.max(count);
    }
}

impl<L> Chain<L> {
    /// A chain of `layers`, run first to last in forward.
    pub fn new(layers: Vec<L>) -> Self {
        Chain { layers }
    }

    /// Number of layers.
    pub fn len(&self) -> usize {
        self.layers.len()
    }

    /// Whether the chain has no layers.
    pub fn is_empty(&self) -> bool {
        self.layers.is_empty()
    }

    /// The layers.
    pub fn layers(&self) -> &[L] {
        &self.layers
    }

    /// The layers, mutably (to read or zero their gradients, update parameters).
    pub fn layers_mut(&mut self) -> &mut [L] {
        &mut self.layers
    }

    /// The layers back.
    pub fn into_layers(self) -> Vec<L> {
        self.layers
    }

    /// Run one forward and backward under `schedule`.
    ///
    /// `loss` is called once, on the chain's output the first time it is computed, and returns
    /// the gradient of the loss with respect to that output (same shape). Layers accumulate
    /// their parameter gradients; the input gradient is returned. Saved activations are
    /// allocated under [`MemoryCategory::Activations`]; gradients flowing backward and the
    /// loss's allocations under [`MemoryCategory::Workspace`].
    ///
    /// A schedule for another number of layers is an error before anything runs. If a layer
    /// or the loss fails midway, the error names it, everything the step held is freed, and
    /// the chain stays usable; parameter gradients may then hold a partial accumulation.
    pub fn step<B, F>(
        &mut self,
        backend: &B,
        schedule: &Schedule,
        input: &B::Tensor,
        loss: F,
    ) -> Result<StepOutput<B::Tensor>, CkptError>
    where
        B: Backend,
        L: Layer<B>,
        F: FnOnce(&B::Tensor) -> headroom_tensor::Result<B::Tensor>,
    {
        let n = self.layers.len();
        if schedule.num_layers() != n {
            return Err(ScheduleError::LengthMismatch {
                schedule: schedule.num_layers(),
                chain: n,
            }
            .into());
        }
        let mut loss = Some(loss);
        let mut grad: Option<B::Tensor> = None;
        let mut st: StepState<B::Tensor, L::Saved> = StepState {
            hand: None,
            checkpoints: (0..=n).map(|_| None).collect(),
            saved: (0..n).map(|_| None).collect(),
            frontier: n,
            live: 0,
            stats: ScheduleStats::default(),
        };
        for &op in schedule.ops() {
            let i = op.layer();
            let layer = self
                .layers
                .get_mut(i)
                .ok_or(CkptError::Internal("layer out of range"))?;
            if let Op::Backward(_) = op {
                let slot = st.saved[i]
                    .take()
                    .ok_or(CkptError::Internal("backward without saved state"))?;
                let g = grad
                    .take()
                    .ok_or(CkptError::Internal("backward without a gradient"))?;
                let freed =
                    slot.input.as_ref().map_or(0, bytes) + slot.state.size_in_bytes() as u64;
                let started = Instant::now();
                let input_grad = {
                    let _ws = MemoryCategory::Workspace.enter();
                    let x = slot.input.as_ref().unwrap_or(input);
                    layer
                        .backward(backend, x, slot.state, &g)
                        .map_err(|source| CkptError::Backward { layer: i, source })?
                };
                st.stats.backward_time += started.elapsed().as_secs_f64();
                drop(slot.input);
                st.live = st.live.saturating_sub(freed);
                grad = Some(input_grad);
                st.frontier = i;
                st.free_dead();
                continue;
            }

            let source = if st.hand.as_ref().is_some_and(|(k, _)| *k == i) {
                InputSource::Hand
            } else if i == 0 {
                InputSource::External
            } else if st.checkpoints[i].is_some() {
                InputSource::Checkpoint
            } else {
                return Err(CkptError::Internal("forward input unavailable"));
            };
            if source != InputSource::Hand {
                if let Some((_, t)) = st.hand.take() {
                    st.live = st.live.saturating_sub(bytes(&t));
                }
            }
            let started = Instant::now();
            let (output, state) = {
                let x = match source {
                    InputSource::Hand => st.hand.as_ref().map(|(_, t)| t),
                    InputSource::External => Some(input),
                    InputSource::Checkpoint => st.checkpoints[i].as_ref(),
                }
                .ok_or(CkptError::Internal("forward input vanished"))?;
                let _act = MemoryCategory::Activations.enter();
                if let Op::ForwardSave(_) = op {
                    let (o, s) = layer
                        .forward_save(backend, x)
                        .map_err(|source| CkptError::Forward { layer: i, source })?;
                    (o, Some(s))
                } else {
                    let o = layer
                        .forward_discard(backend, x)
                        .map_err(|source| CkptError::Forward { layer: i, source })?;
                    (o, None)
                }
            };
            st.stats.forward_time += started.elapsed().as_secs_f64();
            st.stats.forward_count += 1;
            st.live += bytes(&output) + state.as_ref().map_or(0, |s| s.size_in_bytes() as u64);
            st.stats.peak_saved_bytes = st.stats.peak_saved_bytes.max(st.live);

            match (op, state) {
                (Op::ForwardSave(_), Some(state)) => {
                    let input = match source {
                        InputSource::Hand => st.hand.take().map(|(_, t)| t),
                        InputSource::Checkpoint => st.checkpoints[i].take(),
                        InputSource::External => None,
                    };
                    st.saved[i] = Some(SavedSlot { input, state });
                }
                (Op::ForwardCheckpoint(_), _) => {
                    if source == InputSource::Hand {
                        if let Some((_, t)) = st.hand.take() {
                            if st.checkpoints[i].is_some() {
                                st.live = st.live.saturating_sub(bytes(&t));
                            } else {
                                st.checkpoints[i] = Some(t);
                            }
                        }
                    }
                }
                (Op::ForwardDiscard(_), _) => {
                    if source == InputSource::Hand {
                        if let Some((_, t)) = st.hand.take() {
                            st.live = st.live.saturating_sub(bytes(&t));
                        }
                    }
                }
                _ => return Err(CkptError::Internal("forward op without its state")),
            }
            if i + 1 == n {
                if let Some(loss) = loss.take() {
                    let g = {
                        let _ws = MemoryCategory::Workspace.enter();
                        loss(&output).map_err(CkptError::Loss)?
                    };
                    if g.shape() != output.shape() {
                        return Err(CkptError::LossGradientShape {
                            expected: output.shape().clone(),
                            got: g.shape().clone(),
                        });
                    }
                    grad = Some(g);
                }
            }
            st.hand = Some((i + 1, output));
            st.free_dead();
        }
        if st.frontier != 0 || st.live != 0 {
            return Err(CkptError::Internal("schedule ended with state left"));
        }
        let input_grad = grad.ok_or(CkptError::Internal("no input gradient"))?;
        Ok(StepOutput {
            input_grad,
            stats: st.stats,
        })
    }

    /// Run one store-all step, timing every forward and backward and recording every
    /// activation and saved-state size: the measured [`ChainCost`] the planner needs. The step
    /// is a real one (gradients accumulate). Times are wall-clock seconds of this single run;
    /// profile a warmed-up step for stable numbers.
    pub fn profile<B, F>(
        &mut self,
        backend: &B,
        input: &B::Tensor,
        loss: F,
    ) -> Result<(ChainCost, StepOutput<B::Tensor>), CkptError>
    where
        B: Backend,
        L: Layer<B>,
        F: FnOnce(&B::Tensor) -> headroom_tensor::Result<B::Tensor>,
    {
        let n = self.layers.len();
        let schedule = Schedule::store_all(n)?;
        let mut costs = vec![
            LayerCost {
                forward_time: 0.0,
                backward_time: 0.0,
                input_bytes: 0,
                saved_bytes: 0,
            };
            n
        ];
        let mut saved: Vec<(Option<B::Tensor>, L::Saved)> = Vec::with_capacity(n);
        let mut x: Option<B::Tensor> = None;
        let mut peak = 0u64;
        let mut live = 0u64;
        {
            let _act = MemoryCategory::Activations.enter();
            for (i, layer) in self.layers.iter().enumerate() {
                let xin = x.as_ref().unwrap_or(input);
                let started = Instant::now();
                let (out, state) = layer
                    .forward_save(backend, xin)
                    .map_err(|source| CkptError::Forward { layer: i, source })?;
                costs[i].forward_time = started.elapsed().as_secs_f64();
                costs[i].input_bytes = bytes(xin);
                costs[i].saved_bytes = state.size_in_bytes() as u64;
                live += bytes(&out) + costs[i].saved_bytes;
                peak = peak.max(live);
                saved.push((x.take(), state));
                x = Some(out);
            }
        }
        let output = x.ok_or(CkptError::Internal("empty chain"))?;
        let output_bytes = bytes(&output);
        let mut grad = {
            let _ws = MemoryCategory::Workspace.enter();
            loss(&output).map_err(CkptError::Loss)?
        };
        if grad.shape() != output.shape() {
            return Err(CkptError::LossGradientShape {
                expected: output.shape().clone(),
                got: grad.shape().clone(),
            });
        }
        drop(output);
        let mut backward_total = 0.0;
        for (i, layer) in self.layers.iter_mut().enumerate().rev() {
            let (xin, state) = saved
                .pop()
                .ok_or(CkptError::Internal("missing saved state"))?;
            let started = Instant::now();
            grad = {
                let _ws = MemoryCategory::Workspace.enter();
                layer
                    .backward(backend, xin.as_ref().unwrap_or(input), state, &grad)
                    .map_err(|source| CkptError::Backward { layer: i, source })?
            };
            costs[i].backward_time = started.elapsed().as_secs_f64();
            backward_total += costs[i].backward_time;
        }
        let forward_time = costs.iter().map(|c| c.forward_time).sum();
        let cost = ChainCost::new(costs, output_bytes)
            .map_err(|_| CkptError::Internal("profiled costs invalid"))?;
        Ok((
            cost,
            StepOutput {
                input_grad: grad,
                stats: ScheduleStats {
                    peak_saved_bytes: peak,
                    forward_time,
                    backward_time: backward_total,
                    forward_count: schedule.forward_count(),
                    max_checkpoints: 0,
                },
            },
        ))
    }
}
