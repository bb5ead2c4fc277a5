//! Schedules: the operations a chain executor runs, their validation, the fixed schedules
//! (store-all, checkpoint lists, every-k, √n) and the simulator that predicts a schedule's
//! peak saved bytes and compute from a [`ChainCost`].
//!
//! ## Semantics (shared by the simulator and the executor)
//! Activation `k` is the input of layer `k` (activation `n` is the chain's output); activation
//! 0 is the caller's input, always available and never counted. The executor holds at most one
//! activation *at hand* (the last forward's output), a set of *checkpoints*, and the *saved
//! state* of layers waiting for their backward (their input plus what the layer kept).
//!
//! A forward of layer `i` reads activation `i` from the hand if it is there, else from a
//! checkpoint (dropping whatever was at hand). Then:
//! - [`Op::ForwardSave`] keeps the layer's saved state; its input moves into it (a checkpoint
//!   of that input is consumed).
//! - [`Op::ForwardCheckpoint`] keeps its input as a checkpoint (no-op if it already is one).
//! - [`Op::ForwardDiscard`] keeps nothing new; an input at hand is dropped.
//!
//! The output is at hand afterwards. The first time the last layer runs, the loss gives the
//! output gradient. [`Op::Backward`] runs from the last layer down, consuming the saved state.
//! Whatever can no longer be used (an activation whose layer is reversed) is freed at once.
//!
//! Live saved bytes are the checkpoints, the saved states (with their inputs) and the
//! activation at hand; during a forward its output and new saved state count too. Gradients
//! flowing backward are not counted (they are the same for every schedule).

use serde::{Deserialize, Serialize};

use crate::{ChainCost, ScheduleError};

/// One step of a schedule.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Op {
    /// Forward of layer `i`, keeping what its backward needs.
    ForwardSave(usize),
    /// Forward of layer `i`, keeping its input as a checkpoint.
    ForwardCheckpoint(usize),
    /// Forward of layer `i`, keeping nothing.
    ForwardDiscard(usize),
    /// Backward of layer `i`.
    Backward(usize),
}

impl Op {
    /// The layer this operation runs.
    pub fn layer(self) -> usize {
        match self {
            Op::ForwardSave(i)
            | Op::ForwardCheckpoint(i)
            | Op::ForwardDiscard(i)
            | Op::Backward(i) => i,
        }
    }

    /// Whether this is a forward.
    pub fn is_forward(self) -> bool {
        !matches!(self, Op::Backward(_))
    }
}

/// A validated sequence of operations over a chain of `num_layers` layers. Deserialising one
/// validates it too.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "UncheckedSchedule")]
pub struct Schedule {
    num_layers: usize,
    ops: Vec<Op>,
}

/// A schedule as read from a file, before validation.
#[derive(Deserialize)]
struct UncheckedSchedule {
    num_layers: usize,
    ops: Vec<Op>,
}

impl TryFrom<UncheckedSchedule> for Schedule {
    type Error = ScheduleError;
    fn try_from(s: UncheckedSchedule) -> Result<Self, ScheduleError> {
        Schedule::new(s.num_layers, s.ops)
    }
}

/// What a schedule costs under a cost model (predicted) or what a run measured.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ScheduleStats {
    /// Peak live saved bytes (see the module docs for what counts).
    pub peak_saved_bytes: u64,
    /// Sum of the forward times of every forward run.
    pub forward_time: f64,
    /// Sum of the backward times.
    pub backward_time: f64,
    /// Forwards run (a plain forward pass is `num_layers`).
    pub forward_count: usize,
    /// Most checkpoints alive at once (the caller's input not counted).
    pub max_checkpoints: usize,
}

impl ScheduleStats {
    /// Forward time beyond one plain forward pass: the price of recomputation.
    pub fn recompute_time(&self, costs: &ChainCost) -> f64 {
        (self.forward_time - costs.total_forward_time()).max(0.0)
    }
}

/// Where a forward found its input.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum InputSource {
    /// Activation 0, the caller's.
    External,
    /// The activation at hand.
    Hand,
    /// A checkpoint.
    Checkpoint,
}

/// The schedule state machine without tensors: validates a schedule and, given costs,
/// predicts its memory and compute.
#[derive(Clone, Debug)]
pub(crate) struct Simulator<'c> {
    n: usize,
    costs: Option<&'c ChainCost>,
    hand: Option<usize>,
    checkpoints: Vec<bool>,
    saved: Vec<bool>,
    /// Layers `frontier..n` are reversed; the next backward is `frontier - 1`.
    frontier: usize,
    live: u64,
    stats: ScheduleStats,
    /// Saved bytes live when the last layer's first forward has produced its output: the
    /// moment the executor calls the loss.
    at_loss: Option<u64>,
}

impl<'c> Simulator<'c> {
    pub(crate) fn new(n: usize, costs: Option<&'c ChainCost>) -> Self {
        Simulator {
            n,
            costs,
            hand: None,
            checkpoints: vec![false; n + 1],
            saved: vec![false; n],
            frontier: n,
            live: 0,
            stats: ScheduleStats::default(),
            at_loss: None,
        }
    }

    fn act(&self, k: usize) -> u64 {
        self.costs.map_or(0, |c| c.activation_bytes(k))
    }

    fn extra(&self, i: usize) -> u64 {
        self.costs.map_or(0, |c| c.saved_bytes(i))
    }

    fn next_backward(&self) -> Option<usize> {
        self.frontier.checked_sub(1)
    }

    pub(crate) fn apply(&mut self, op_index: usize, op: Op) -> Result<(), ScheduleError> {
        let i = op.layer();
        if i >= self.n {
            return Err(ScheduleError::LayerOutOfRange {
                op_index,
                op,
                layer: i,
                num_layers: self.n,
            });
        }
        if let Op::Backward(_) = op {
            return self.backward(op_index, op, i);
        }
        if i >= self.frontier {
            return Err(ScheduleError::ForwardPastFrontier {
                op_index,
                op,
                layer: i,
                next_backward: self.next_backward(),
            });
        }
        if self.saved[i] {
            return Err(ScheduleError::AlreadySaved {
                op_index,
                op,
                layer: i,
            });
        }
        let source = if self.hand == Some(i) {
            InputSource::Hand
        } else if i == 0 {
            InputSource::External
        } else if self.checkpoints[i] {
            InputSource::Checkpoint
        } else {
            return Err(ScheduleError::InputUnavailable {
                op_index,
                op,
                layer: i,
            });
        };
        if source != InputSource::Hand {
            if let Some(k) = self.hand.take() {
                self.live -= self.act(k);
            }
        }
        let out = self.act(i + 1);
        let extra = if matches!(op, Op::ForwardSave(_)) {
            self.extra(i)
        } else {
            0
        };
        self.live += out + extra;
        self.stats.peak_saved_bytes = self.stats.peak_saved_bytes.max(self.live);
        if i + 1 == self.n && self.at_loss.is_none() {
            self.at_loss = Some(self.live);
        }
        match op {
            Op::ForwardSave(_) => {
                self.saved[i] = true;
                if source == InputSource::Checkpoint {
                    self.checkpoints[i] = false;
                }
            }
            Op::ForwardCheckpoint(_) => {
                if source == InputSource::Hand {
                    if self.checkpoints[i] {
                        self.live -= self.act(i);
                    } else {
                        self.checkpoints[i] = true;
                    }
                }
            }
            Op::ForwardDiscard(_) => {
                if source == InputSource::Hand {
                    self.live -= self.act(i);
                }
            }
            Op::Backward(_) => unreachable!("handled above"),
        }
        self.hand = Some(i + 1);
        self.stats.forward_count += 1;
        self.stats.forward_time += self.costs.map_or(0.0, |c| c.forward_time(i));
        self.free_dead();
        Ok(())
    }

    fn backward(&mut self, op_index: usize, op: Op, i: usize) -> Result<(), ScheduleError> {
        if self.next_backward() != Some(i) {
            return Err(ScheduleError::BackwardOutOfOrder {
                op_index,
                op,
                layer: i,
                expected: self.next_backward(),
            });
        }
        if !self.saved[i] {
            return Err(ScheduleError::NotSaved {
                op_index,
                op,
                layer: i,
            });
        }
        self.saved[i] = false;
        self.live -= self.act(i) + self.extra(i);
        self.frontier = i;
        self.stats.backward_time += self.costs.map_or(0.0, |c| c.layers()[i].backward_time);
        self.free_dead();
        Ok(())
    }

    /// Activation `k` can only feed layer `k`; once that layer is reversed it is dead.
    fn free_dead(&mut self) {
        if let Some(k) = self.hand {
            if k >= self.frontier {
                self.hand = None;
                self.live -= self.act(k);
            }
        }
        for k in self.frontier..=self.n {
            if self.checkpoints[k] {
                self.checkpoints[k] = false;
                self.live -= self.act(k);
            }
        }
        let count = self.checkpoints.iter().filter(|&&c| c).count();
        self.stats.max_checkpoints = self.stats.max_checkpoints.max(count);
    }

    /// Everything that determines the future of the state (live bytes follow from it).
    #[cfg(test)]
    pub(crate) fn key(&self) -> (Option<usize>, Vec<bool>, Vec<bool>, usize) {
        (
            self.hand,
            self.checkpoints.clone(),
            self.saved.clone(),
            self.frontier,
        )
    }

    /// Figures so far.
    #[cfg(test)]
    pub(crate) fn stats(&self) -> ScheduleStats {
        self.stats
    }

    pub(crate) fn finish(self) -> Result<ScheduleStats, ScheduleError> {
        if self.frontier > 0 {
            return Err(ScheduleError::Incomplete {
                remaining: self.frontier,
            });
        }
        debug_assert_eq!(self.live, 0, "a finished schedule holds nothing");
        Ok(self.stats)
    }
}

impl Schedule {
    /// Validate `ops` as a complete schedule for a chain of `num_layers` layers.
    pub fn new(num_layers: usize, ops: Vec<Op>) -> Result<Self, ScheduleError> {
        if num_layers == 0 {
            return Err(ScheduleError::EmptyChain);
        }
        let mut sim = Simulator::new(num_layers, None);
        for (k, &op) in ops.iter().enumerate() {
            sim.apply(k, op)?;
        }
        sim.finish()?;
        Ok(Schedule { num_layers, ops })
    }

    /// Layers the schedule runs.
    pub fn num_layers(&self) -> usize {
        self.num_layers
    }

    /// The operations, in order.
    pub fn ops(&self) -> &[Op] {
        &self.ops
    }

    /// Number of forwards the schedule runs.
    pub fn forward_count(&self) -> usize {
        self.ops.iter().filter(|op| op.is_forward()).count()
    }

    /// A simulator of this schedule over `costs`, which must have one entry per layer.
    fn simulator_for<'c>(&self, costs: &'c ChainCost) -> Result<Simulator<'c>, ScheduleError> {
        if costs.len() != self.num_layers {
            return Err(ScheduleError::LengthMismatch {
                schedule: self.num_layers,
                chain: costs.len(),
            });
        }
        Ok(Simulator::new(self.num_layers, Some(costs)))
    }

    /// Predict peak live saved bytes and compute under `costs`.
    pub fn simulate(&self, costs: &ChainCost) -> Result<ScheduleStats, ScheduleError> {
        let mut sim = self.simulator_for(costs)?;
        for (k, &op) in self.ops.iter().enumerate() {
            sim.apply(k, op)?;
        }
        sim.finish()
    }

    /// The saved bytes live when the executor calls the loss (the last layer's output in
    /// hand, the first time it is computed), under `costs`: at most
    /// [`ScheduleStats::peak_saved_bytes`], and below it when the schedule's peak comes later,
    /// while a segment is recomputed.
    pub fn saved_at_loss(&self, costs: &ChainCost) -> Result<u64, ScheduleError> {
        let mut sim = self.simulator_for(costs)?;
        for (k, &op) in self.ops.iter().enumerate() {
            sim.apply(k, op)?;
            if let Some(at) = sim.at_loss {
                return Ok(at);
            }
        }
        Ok(sim.at_loss.unwrap_or(0))
    }

    /// The baseline: every layer saves in one forward pass, then every backward.
    pub fn store_all(num_layers: usize) -> Result<Self, ScheduleError> {
        let mut ops: Vec<Op> = (0..num_layers).map(Op::ForwardSave).collect();
        ops.extend((0..num_layers).rev().map(Op::Backward));
        Schedule::new(num_layers, ops)
    }

    /// Keep only the inputs of the listed layers (the chain's input always) in the forward
    /// pass; in backward, recompute each segment between checkpoints once, saving, and reverse
    /// it. The last segment saves during the first pass already. Indices must be `< num_layers`;
    /// duplicates and `0` are allowed and ignored.
    pub fn checkpoint_inputs(num_layers: usize, layers: &[usize]) -> Result<Self, ScheduleError> {
        if num_layers == 0 {
            return Err(ScheduleError::EmptyChain);
        }
        let mut starts = vec![0usize];
        for &l in layers {
            if l >= num_layers {
                return Err(ScheduleError::InvalidParameter(format!(
                    "checkpoint layer {l} is out of range for {num_layers} layers"
                )));
            }
            starts.push(l);
        }
        starts.sort_unstable();
        starts.dedup();
        let mut ends: Vec<usize> = starts[1..].to_vec();
        ends.push(num_layers);
        let segments: Vec<(usize, usize)> = starts.into_iter().zip(ends).collect();
        let mut ops = Vec::with_capacity(4 * num_layers);
        let (last, head) = segments.split_last().ok_or(ScheduleError::EmptyChain)?;
        for &(s, t) in head {
            ops.push(Op::ForwardCheckpoint(s));
            ops.extend((s + 1..t).map(Op::ForwardDiscard));
        }
        ops.extend((last.0..last.1).map(Op::ForwardSave));
        ops.extend((last.0..last.1).rev().map(Op::Backward));
        for &(s, t) in head.iter().rev() {
            ops.extend((s..t).map(Op::ForwardSave));
            ops.extend((s..t).rev().map(Op::Backward));
        }
        Schedule::new(num_layers, ops)
    }

    /// Checkpoint the input of every `k`-th layer (layers `0, k, 2k, …`).
    pub fn every_k(num_layers: usize, k: usize) -> Result<Self, ScheduleError> {
        if k == 0 {
            return Err(ScheduleError::InvalidParameter(
                "every_k needs k >= 1".into(),
            ));
        }
        let layers: Vec<usize> = (0..num_layers).step_by(k).collect();
        Schedule::checkpoint_inputs(num_layers, &layers)
    }

    /// Checkpoint every `⌈√n⌉`-th layer (Chen et al.'s √n schedule).
    pub fn sqrt_n(num_layers: usize) -> Result<Self, ScheduleError> {
        Schedule::every_k(num_layers, sqrt_segment(num_layers))
    }
}

/// `⌈√n⌉`, at least 1.
pub fn sqrt_segment(n: usize) -> usize {
    let mut k = (n as f64).sqrt() as usize;
    while k * k < n {
        k += 1;
    }
    k.max(1)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::LayerCost;

    #[test]
    fn the_loss_sees_the_peak_of_store_all_and_less_under_recomputation() {
        for n in 1..9 {
            let costs = unit_costs(n);
            let all = Schedule::store_all(n).unwrap();
            assert_eq!(
                all.saved_at_loss(&costs).unwrap(),
                all.simulate(&costs).unwrap().peak_saved_bytes
            );
            for k in 1..=n {
                let s = Schedule::every_k(n, k).unwrap();
                let at = s.saved_at_loss(&costs).unwrap();
                assert!(at <= s.simulate(&costs).unwrap().peak_saved_bytes);
                assert!(at > 0);
            }
        }
        // Three layers in segments of two: recomputing the first segment while the second's
        // gradient is held keeps more than the loss's moment.
        let costs = unit_costs(3);
        let s = Schedule::every_k(3, 2).unwrap();
        assert!(s.saved_at_loss(&costs).unwrap() < s.simulate(&costs).unwrap().peak_saved_bytes);
        assert!(Schedule::store_all(2)
            .unwrap()
            .saved_at_loss(&costs)
            .is_err());
    }

    fn unit_costs(n: usize) -> ChainCost {
        ChainCost::homogeneous(
            n,
            LayerCost {
                forward_time: 1.0,
                backward_time: 2.0,
                input_bytes: 10,
                saved_bytes: 5,
            },
        )
        .unwrap()
    }

    #[test]
    fn store_all_peak_is_every_saved_state() {
        let s = Schedule::store_all(4).unwrap();
        let st = s.simulate(&unit_costs(4)).unwrap();
        // inputs 1..3 (30) + four extras (20) + the output at hand while the last layer runs (10)
        assert_eq!(st.peak_saved_bytes, 60);
        assert_eq!(st.forward_count, 4);
        assert_eq!(st.forward_time, 4.0);
        assert_eq!(st.backward_time, 8.0);
    }

    #[test]
    fn every_k_recomputes_all_but_the_last_segment() {
        let s = Schedule::every_k(6, 2).unwrap();
        assert_eq!(s.forward_count(), 6 + 4);
        let st = s.simulate(&unit_costs(6)).unwrap();
        // a_2 is checkpointed; a_4 starts the last segment, which saves in the first pass.
        assert_eq!(st.max_checkpoints, 1);
        assert!(
            st.peak_saved_bytes
                < Schedule::store_all(6)
                    .unwrap()
                    .simulate(&unit_costs(6))
                    .unwrap()
                    .peak_saved_bytes
        );
    }

    #[test]
    fn invalid_schedules_get_typed_errors() {
        use Op::*;
        assert_eq!(Schedule::new(0, vec![]), Err(ScheduleError::EmptyChain));
        assert!(matches!(
            Schedule::new(2, vec![ForwardSave(0), Backward(0)]),
            Err(ScheduleError::BackwardOutOfOrder {
                layer: 0,
                expected: Some(1),
                ..
            })
        ));
        assert!(matches!(
            Schedule::new(2, vec![ForwardDiscard(1)]),
            Err(ScheduleError::InputUnavailable { layer: 1, .. })
        ));
        assert!(matches!(
            Schedule::new(2, vec![ForwardSave(0), ForwardDiscard(1), Backward(1)]),
            Err(ScheduleError::NotSaved { layer: 1, .. })
        ));
        assert!(matches!(
            Schedule::new(1, vec![ForwardSave(0), ForwardSave(0)]),
            Err(ScheduleError::AlreadySaved { layer: 0, .. })
        ));
        assert!(matches!(
            Schedule::new(1, vec![ForwardSave(0), Backward(0), ForwardDiscard(0)]),
            Err(ScheduleError::ForwardPastFrontier {
                layer: 0,
                next_backward: None,
                ..
            })
        ));
        assert!(matches!(
            Schedule::new(2, vec![ForwardSave(0), ForwardSave(1), Backward(1)]),
            Err(ScheduleError::Incomplete { remaining: 1 })
        ));
        assert!(matches!(
            Schedule::new(2, vec![ForwardSave(5)]),
            Err(ScheduleError::LayerOutOfRange { layer: 5, .. })
        ));
        // The input of layer 1 was dropped by the discard and never checkpointed.
        assert!(matches!(
            Schedule::new(
                3,
                vec![
                    ForwardDiscard(0),
                    ForwardDiscard(1),
                    ForwardSave(2),
                    Backward(2),
                    ForwardSave(1)
                ]
            ),
            Err(ScheduleError::InputUnavailable { layer: 1, .. })
        ));
        assert!(Schedule::every_k(3, 0).is_err());
        assert!(Schedule::checkpoint_inputs(3, &[3]).is_err());
        assert!(Schedule::store_all(3)
            .unwrap()
            .simulate(&unit_costs(4))
            .is_err());
    }

    #[test]
    fn deserialising_validates() {
        let good = serde_json::to_string(&Schedule::sqrt_n(5).unwrap()).unwrap();
        let back: Schedule = serde_json::from_str(&good).unwrap();
        assert_eq!(back, Schedule::sqrt_n(5).unwrap());
        let bad = r#"{"num_layers":2,"ops":[{"ForwardSave":0},{"Backward":0}]}"#;
        assert!(serde_json::from_str::<Schedule>(bad).is_err());
    }

    #[test]
    fn sqrt_segment_is_ceiling_sqrt() {
        for (n, k) in [
            (1, 1),
            (2, 2),
            (4, 2),
            (5, 3),
            (9, 3),
            (10, 4),
            (24, 5),
            (100, 10),
        ] {
            assert_eq!(sqrt_segment(n), k, "n = {n}");
        }
    }
}
