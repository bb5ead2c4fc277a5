//! The planner: the schedule with the least recomputation that keeps live saved bytes within a
//! budget, for a chain whose layers differ in compute and memory.
//!
//! ## The dynamic program
//! In the spirit of rotor (Beaumont et al., "Optimal checkpointing for heterogeneous chains",
//! 2019). `opt(s, t, m)` is the least forward time that reverses layers `s..t` when activation
//! `s` is held (counted by the caller), the gradient of activation `t` is at hand, and at most
//! `m` further bytes may be live. Two ways to start:
//! - **save** layer `s` ([`Op::ForwardSave`]): its saved state and output stay live while
//!   `s+1..t` is reversed, then layer `s` is reversed:
//!   `f_s + opt(s+1, t, m − saved_s − act_{s+1})`;
//! - **checkpoint** activation `s` and advance without saving to some `s'`
//!   ([`Op::ForwardCheckpoint`], then [`Op::ForwardDiscard`]s), reverse `s'..t` holding
//!   activation `s'`, then reverse `s..s'` from the checkpoint:
//!   `Σ f_{s..s'} + opt(s', t, m − act_{s'}) + opt(s, s', m)`, provided the sweep itself fits
//!   (two consecutive activations are alive at once while advancing).
//!
//! Memory is discretised into `slots` equal slots of `⌈budget / slots⌉` bytes; every size is
//! rounded *up* to whole slots, so a plan that fits in slots fits in bytes. The table has
//! `n(n+1)/2 × (slots+1)` entries and each takes `O(n)` to fill: 100 layers × 500 slots is
//! about 8·10⁷ cheap steps (benchmarked in `benches/benches/ckpt.rs`). Segments of one length
//! are filled in parallel (they depend only on shorter ones); the result does not depend on
//! the thread count.
//!
//! Trade-off: rounding up can make the DP miss a schedule that fits the budget only to the
//! byte. So the planner also evaluates, exactly, store-all, every-k for every k and the
//! minimum-memory schedule, and returns the cheapest of everything that fits. It therefore
//! never does worse than a fixed schedule at the same budget, and it only reports an
//! infeasible budget when no schedule of its family fits at all (with the smallest budget that
//! does).

use rayon::prelude::*;
use serde::{Deserialize, Serialize};

use crate::{ChainCost, Op, PlanError, Schedule, ScheduleStats};

/// Memory slots the planner discretises the budget into unless told otherwise.
pub const DEFAULT_SLOTS: usize = 500;

/// Longest chain the planner accepts (its exact minimum-memory search is `O(n³)`).
pub const MAX_PLANNER_LAYERS: usize = 1024;

/// Most entries of the DP table (`n(n+1)/2 × (slots+1)`, 12 bytes each). Longer chains get
/// fewer slots rather than gigabytes of table.
const MAX_TABLE_ENTRIES: usize = 1 << 25;

/// A schedule with its predicted cost.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Plan {
    /// The schedule to run.
    pub schedule: Schedule,
    /// Predicted peak live saved bytes, forward time (recomputation included), backward time
    /// and forward count under the cost model. Exact for the cost model: the executor measures
    /// the same peak when the model's sizes are the layers' real sizes.
    pub predicted: ScheduleStats,
    /// Forward time beyond one plain forward pass.
    pub recompute_time: f64,
}

impl Plan {
    /// The predicted cost of any schedule (fixed or hand-written) under `costs`.
    pub fn for_schedule(schedule: Schedule, costs: &ChainCost) -> Result<Self, PlanError> {
        let predicted = schedule.simulate(costs)?;
        Ok(Plan {
            recompute_time: predicted.recompute_time(costs),
            schedule,
            predicted,
        })
    }

    /// Predicted forward plus backward time of one step.
    pub fn predicted_step_time(&self) -> f64 {
        self.predicted.forward_time + self.predicted.backward_time
    }
}

/// Chooses schedules for a memory budget.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Planner {
    slots: usize,
}

impl Default for Planner {
    fn default() -> Self {
        Planner {
            slots: DEFAULT_SLOTS,
        }
    }
}

/// Triangular index of segment `s..t` (`s < t`).
fn tri(s: usize, t: usize) -> usize {
    t * (t - 1) / 2 + s
}

/// Choice codes in the DP tables.
const INFEASIBLE: u32 = 0;
const SAVE: u32 = 1;
/// `SPLIT_BASE + s'`: checkpoint and advance to `s'`.
const SPLIT_BASE: u32 = 2;

impl Planner {
    /// A planner discretising memory into `slots` slots (more slots: closer to the optimum,
    /// slower; time grows linearly).
    pub fn new(slots: usize) -> Result<Self, PlanError> {
        if slots == 0 {
            return Err(PlanError::InvalidCosts(
                "the planner needs at least one memory slot".into(),
            ));
        }
        Ok(Planner { slots })
    }

    /// Memory slots used.
    pub fn slots(&self) -> usize {
        self.slots
    }

    /// The schedule with the least forward time whose peak live saved bytes stay within
    /// `budget_bytes`, or [`PlanError::BudgetTooSmall`] with the smallest feasible budget.
    pub fn optimal(&self, costs: &ChainCost, budget_bytes: u64) -> Result<Plan, PlanError> {
        let n = costs.len();
        if n > MAX_PLANNER_LAYERS {
            return Err(PlanError::InvalidCosts(format!(
                "the planner handles at most {MAX_PLANNER_LAYERS} layers, got {n}"
            )));
        }
        let (min_bytes, min_schedule) = min_memory(costs)?;
        if budget_bytes < min_bytes {
            return Err(PlanError::BudgetTooSmall {
                budget: budget_bytes,
                required: min_bytes,
            });
        }
        let mut candidates = vec![min_schedule, Schedule::store_all(n)?];
        for k in 1..n {
            candidates.push(Schedule::every_k(n, k)?);
        }
        if let Some(ops) = self.dp_ops(costs, budget_bytes) {
            candidates.push(Schedule::new(n, ops)?);
        }
        let mut best: Option<Plan> = None;
        for schedule in candidates {
            let plan = Plan::for_schedule(schedule, costs)?;
            if plan.predicted.peak_saved_bytes > budget_bytes {
                continue;
            }
            let better = match &best {
                None => true,
                Some(b) => {
                    (plan.predicted.forward_time, plan.predicted.peak_saved_bytes)
                        < (b.predicted.forward_time, b.predicted.peak_saved_bytes)
                }
            };
            if better {
                best = Some(plan);
            }
        }
        // The minimum-memory schedule always fits here, so there is a best.
        best.ok_or(PlanError::BudgetTooSmall {
            budget: budget_bytes,
            required: min_bytes,
        })
    }

    /// The discretised DP alone: the operations of the cheapest schedule that fits the budget
    /// after rounding sizes up to slots, or `None` when nothing fits in slots.
    pub(crate) fn dp_ops(&self, costs: &ChainCost, budget_bytes: u64) -> Option<Vec<Op>> {
        let n = costs.len();
        let rows = n * (n + 1) / 2;
        let slots = self
            .slots
            .min((MAX_TABLE_ENTRIES / rows.max(1)).saturating_sub(1));
        if slots == 0 {
            return None;
        }
        let slot_bytes = budget_bytes.div_ceil(slots as u64).max(1);
        let m_max = (budget_bytes / slot_bytes) as usize;
        let width = m_max + 1;
        // Sizes in slots; anything larger than the budget becomes `width` (never fits).
        let to_slots = |b: u64| -> usize { (b.div_ceil(slot_bytes)).min(width as u64) as usize };
        let act: Vec<usize> = (0..=n)
            .map(|k| to_slots(costs.activation_bytes(k)))
            .collect();
        let extra: Vec<usize> = (0..n).map(|i| to_slots(costs.saved_bytes(i))).collect();
        let mut prefix = vec![0.0f64; n + 1];
        for i in 0..n {
            prefix[i + 1] = prefix[i] + costs.forward_time(i);
        }

        let mut cost = vec![f64::INFINITY; rows * width];
        let mut choice = vec![INFEASIBLE; rows * width];
        for len in 1..=n {
            // Segments of one length depend only on shorter ones: fill them in parallel.
            let table = &cost;
            let filled: Vec<(usize, Vec<f64>, Vec<u32>)> = (0..=n - len)
                .into_par_iter()
                .map(|s| {
                    let t = s + len;
                    let mut cur = vec![f64::INFINITY; width];
                    let mut cur_choice = vec![INFEASIBLE; width];
                    // Save layer s.
                    let need = extra[s] + act[s + 1];
                    let f_s = prefix[s + 1] - prefix[s];
                    if need <= m_max {
                        if len == 1 {
                            for m in need..width {
                                cur[m] = f_s;
                                cur_choice[m] = SAVE;
                            }
                        } else {
                            let sub = &table[tri(s + 1, t) * width..][..width];
                            for m in need..width {
                                let c = f_s + sub[m - need];
                                if c < cur[m] {
                                    cur[m] = c;
                                    cur_choice[m] = SAVE;
                                }
                            }
                        }
                    }
                    // Checkpoint s and advance to s'.
                    let mut sweep = act[s + 1];
                    for sp in s + 1..t {
                        if sp > s + 1 {
                            sweep = sweep.max(act[sp - 1] + act[sp]);
                        }
                        if sweep > m_max {
                            break;
                        }
                        let lo = sweep.max(act[sp]);
                        if lo > m_max {
                            continue;
                        }
                        let advance = prefix[sp] - prefix[s];
                        let right = &table[tri(sp, t) * width..][..width];
                        let left = &table[tri(s, sp) * width..][..width];
                        let a = act[sp];
                        for m in lo..width {
                            let c = advance + right[m - a] + left[m];
                            if c < cur[m] {
                                cur[m] = c;
                                cur_choice[m] = SPLIT_BASE + sp as u32;
                            }
                        }
                    }
                    (s, cur, cur_choice)
                })
                .collect();
            for (s, row_cost, row_choice) in filled {
                let r = tri(s, s + len) * width;
                cost[r..r + width].copy_from_slice(&row_cost);
                choice[r..r + width].copy_from_slice(&row_choice);
            }
        }

        let mut ops = Vec::with_capacity(4 * n);
        let mut stack = vec![Frame::Solve(0, n, m_max)];
        while let Some(frame) = stack.pop() {
            match frame {
                Frame::Emit(op) => ops.push(op),
                Frame::Solve(s, t, m) => {
                    if s == t {
                        continue;
                    }
                    match *choice.get(tri(s, t) * width + m)? {
                        INFEASIBLE => return None,
                        SAVE => {
                            ops.push(Op::ForwardSave(s));
                            stack.push(Frame::Emit(Op::Backward(s)));
                            let need = extra[s] + act[s + 1];
                            stack.push(Frame::Solve(s + 1, t, m.checked_sub(need)?));
                        }
                        code => {
                            let sp = (code - SPLIT_BASE) as usize;
                            ops.push(Op::ForwardCheckpoint(s));
                            ops.extend((s + 1..sp).map(Op::ForwardDiscard));
                            // Right part first (runs next), then the left part: push in reverse.
                            stack.push(Frame::Solve(s, sp, m));
                            stack.push(Frame::Solve(sp, t, m.checked_sub(act[sp])?));
                        }
                    }
                }
            }
        }
        Some(ops)
    }
}

/// Work items of the iterative schedule reconstruction.
enum Frame {
    Solve(usize, usize, usize),
    Emit(Op),
}

/// The smallest peak of live saved bytes any schedule of the planner's family reaches, and
/// that schedule (exact bytes, no slots). Recomputation is not minimised.
pub fn min_memory(costs: &ChainCost) -> Result<(u64, Schedule), PlanError> {
    let n = costs.len();
    if n > MAX_PLANNER_LAYERS {
        return Err(PlanError::InvalidCosts(format!(
            "the planner handles at most {MAX_PLANNER_LAYERS} layers, got {n}"
        )));
    }
    let act: Vec<u64> = (0..=n).map(|k| costs.activation_bytes(k)).collect();
    let rows = n * (n + 1) / 2;
    let mut mem = vec![u64::MAX; rows];
    let mut choice = vec![INFEASIBLE; rows];
    let get = |mem: &[u64], s: usize, t: usize| if s == t { 0 } else { mem[tri(s, t)] };
    for len in 1..=n {
        for s in 0..=n - len {
            let t = s + len;
            let mut best = (costs.saved_bytes(s) + act[s + 1]).saturating_add(get(&mem, s + 1, t));
            let mut best_choice = SAVE;
            let mut sweep = act[s + 1];
            for sp in s + 1..t {
                if sp > s + 1 {
                    sweep = sweep.max(act[sp - 1] + act[sp]);
                }
                let peak = sweep
                    .max(act[sp].saturating_add(get(&mem, sp, t)))
                    .max(get(&mem, s, sp));
                if peak < best {
                    best = peak;
                    best_choice = SPLIT_BASE + sp as u32;
                }
            }
            mem[tri(s, t)] = best;
            choice[tri(s, t)] = best_choice;
        }
    }
    let mut ops = Vec::with_capacity(n * n);
    let mut stack = vec![Frame::Solve(0, n, 0)];
    while let Some(frame) = stack.pop() {
        match frame {
            Frame::Emit(op) => ops.push(op),
            Frame::Solve(s, t, _) => {
                if s == t {
                    continue;
                }
                let code = choice[tri(s, t)];
                if code == SAVE {
                    ops.push(Op::ForwardSave(s));
                    stack.push(Frame::Emit(Op::Backward(s)));
                    stack.push(Frame::Solve(s + 1, t, 0));
                } else {
                    let sp = (code - SPLIT_BASE) as usize;
                    ops.push(Op::ForwardCheckpoint(s));
                    ops.extend((s + 1..sp).map(Op::ForwardDiscard));
                    stack.push(Frame::Solve(s, sp, 0));
                    stack.push(Frame::Solve(sp, t, 0));
                }
            }
        }
    }
    let schedule = Schedule::new(n, ops)?;
    Ok((get(&mem, 0, n), schedule))
}

#[cfg(test)]
mod tests {
    use std::collections::{BTreeMap, BinaryHeap};

    use super::*;
    use crate::schedule::Simulator;
    use crate::LayerCost;

    /// The cheapest forward time of *any* valid op sequence whose peak fits `budget`, by
    /// Dijkstra over the simulator's states (integer forward times, so costs compare exactly).
    fn oracle(costs: &ChainCost, budget: u64) -> Option<u64> {
        let n = costs.len();
        let start = Simulator::new(n, Some(costs));
        let mut best: BTreeMap<_, u64> = BTreeMap::new();
        let mut heap = BinaryHeap::new();
        let mut states = vec![start];
        heap.push(std::cmp::Reverse((0u64, 0usize)));
        while let Some(std::cmp::Reverse((cost, id))) = heap.pop() {
            let state = states[id].clone();
            let key = state.key();
            if best.get(&key).is_some_and(|&c| c <= cost) && id != 0 {
                continue;
            }
            best.insert(key.clone(), cost);
            if key.3 == 0 {
                return Some(cost);
            }
            for i in 0..n {
                for op in [
                    Op::ForwardSave(i),
                    Op::ForwardCheckpoint(i),
                    Op::ForwardDiscard(i),
                    Op::Backward(i),
                ] {
                    let mut next = state.clone();
                    if next.apply(0, op).is_err() || next.stats().peak_saved_bytes > budget {
                        continue;
                    }
                    let c = cost
                        + if op.is_forward() {
                            costs.forward_time(i) as u64
                        } else {
                            0
                        };
                    if best.get(&next.key()).is_some_and(|&b| b <= c) {
                        continue;
                    }
                    states.push(next);
                    heap.push(std::cmp::Reverse((c, states.len() - 1)));
                }
            }
        }
        None
    }

    fn chain(spec: &[(u64, u64, u64)], out: u64) -> ChainCost {
        let layers = spec
            .iter()
            .map(|&(f, a, e)| LayerCost {
                forward_time: f as f64,
                backward_time: 1.0,
                input_bytes: a,
                saved_bytes: e,
            })
            .collect();
        ChainCost::new(layers, out).unwrap()
    }

    use proptest::prelude::*;

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(48))]

        /// With one byte per slot there is no rounding: the DP alone must match the exhaustive
        /// search over every valid schedule, and so must its minimum-memory companion.
        #[test]
        fn dp_matches_exhaustive_search(
            spec in prop::collection::vec((1u64..5, 1u64..4, 0u64..4), 1..5),
            out in 1u64..4,
            extra_budget in 0u64..12,
        ) {
            let costs = chain(&spec, out);
            let (min_bytes, min_schedule) = min_memory(&costs).unwrap();
            prop_assert_eq!(min_schedule.simulate(&costs).unwrap().peak_saved_bytes, min_bytes);
            let budget = min_bytes + extra_budget;
            // Nothing fits below the minimum.
            if min_bytes > 0 {
                prop_assert_eq!(oracle(&costs, min_bytes - 1), None);
            }
            let want = oracle(&costs, budget).unwrap();
            let planner = Planner::new(budget as usize).unwrap();
            let ops = planner.dp_ops(&costs, budget).unwrap();
            let plan = Plan::for_schedule(Schedule::new(costs.len(), ops).unwrap(), &costs).unwrap();
            prop_assert!(plan.predicted.peak_saved_bytes <= budget);
            prop_assert_eq!(plan.predicted.forward_time as u64, want);
            let full = planner.optimal(&costs, budget).unwrap();
            prop_assert_eq!(full.predicted.forward_time as u64, want);
        }
    }

    #[test]
    fn infeasible_budget_reports_the_smallest_feasible_one() {
        let costs = chain(&[(1, 10, 10), (1, 10, 10), (1, 10, 10)], 10);
        let (min_bytes, _) = min_memory(&costs).unwrap();
        let err = Planner::default()
            .optimal(&costs, min_bytes - 1)
            .unwrap_err();
        assert_eq!(
            err,
            PlanError::BudgetTooSmall {
                budget: min_bytes - 1,
                required: min_bytes
            }
        );
        let plan = Planner::default().optimal(&costs, min_bytes).unwrap();
        assert!(plan.predicted.peak_saved_bytes <= min_bytes);
        // At the minimum, recomputation is unavoidable, and the exhaustive search agrees on
        // its price.
        let best = oracle(&costs, min_bytes).unwrap();
        assert!(best > 3);
        assert_eq!(plan.predicted.forward_time as u64, best);
        assert!(Planner::new(0).is_err());
    }

    #[test]
    fn ample_budget_gives_store_all() {
        let costs = chain(&[(3, 10, 10), (2, 10, 10), (5, 10, 10), (1, 7, 3)], 10);
        let store_all = Plan::for_schedule(Schedule::store_all(4).unwrap(), &costs).unwrap();
        let plan = Planner::default()
            .optimal(&costs, store_all.predicted.peak_saved_bytes)
            .unwrap();
        assert_eq!(
            plan.predicted.forward_time,
            store_all.predicted.forward_time
        );
        assert_eq!(plan.recompute_time, 0.0);
        assert_eq!(plan.predicted_step_time(), 11.0 + 4.0);
    }
}
