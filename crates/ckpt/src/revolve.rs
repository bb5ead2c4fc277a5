//! Revolve-style binomial checkpointing for homogeneous chains (Griewank & Walther).
//!
//! With `slots` checkpoints besides the caller's input, reversing `n` layers takes the fewest
//! forwards of any schedule that keeps at most `slots` checkpoints. The split points come from
//! a small dynamic program over (segment length, free slots); the forward count it reaches is
//! Griewank's closed form `n + r·n − β(c+1, r−1)` with `c = slots + 1` snapshots (the caller's
//! input is one) and `r` the repetition number, `β(c, r) = C(c + r, c)` — tested against it.

use crate::{Op, Schedule, ScheduleError};

/// Largest chain the Revolve tables are built for (the table is `O(n² · slots)` to fill).
pub const MAX_REVOLVE_LAYERS: usize = 4096;

/// Most table steps (`n² · (slots + 1)`) a Revolve schedule may cost to build.
const MAX_REVOLVE_WORK: u128 = 1 << 31;

/// The best first advance to reverse `len` layers with `c` free checkpoint slots, for every
/// `len ≤ n`, from a table of the fewest extra forwards (beyond each layer's taping forward).
struct RevolveTable {
    slots: usize,
    /// `split[len][c]`: how many layers to advance before storing the next checkpoint.
    split: Vec<Vec<usize>>,
}

impl RevolveTable {
    fn new(n: usize, slots: usize) -> Self {
        let slots = slots.min(n);
        let mut advances = vec![vec![0u64; slots + 1]; n + 1];
        let mut split = vec![vec![0usize; slots + 1]; n + 1];
        for len in 2..=n {
            for c in 0..=slots {
                let mut best = u64::MAX;
                let mut best_j = len - 1;
                for j in 1..len {
                    let right = len - j;
                    // A right part of one layer is taped straight from the hand: no slot.
                    let right_cost = if right == 1 {
                        0
                    } else if c == 0 {
                        continue;
                    } else {
                        advances[right][c - 1]
                    };
                    let cost = j as u64 + right_cost + advances[j][c];
                    if cost < best {
                        best = cost;
                        best_j = j;
                    }
                }
                advances[len][c] = best;
                split[len][c] = best_j;
            }
        }
        RevolveTable { slots, split }
    }

    fn emit(&self, s: usize, t: usize, c: usize, ops: &mut Vec<Op>) {
        let len = t - s;
        if len == 1 {
            ops.push(Op::ForwardSave(s));
            ops.push(Op::Backward(s));
            return;
        }
        let j = self.split[len][c];
        ops.push(Op::ForwardCheckpoint(s));
        ops.extend((s + 1..s + j).map(Op::ForwardDiscard));
        let right_slots = if len - j == 1 { c } else { c - 1 };
        self.emit(s + j, t, right_slots, ops);
        self.emit(s, s + j, c, ops);
    }
}

impl Schedule {
    /// The binomial (Revolve) schedule for `num_layers` layers keeping at most `slots`
    /// checkpoints (besides the caller's input). Minimises the number of forwards for a chain
    /// of identical layers. Revolve never keeps saved state during an advance, so even with
    /// ample slots every layer but the last runs forward twice; prefer the planner when memory
    /// allows more.
    pub fn revolve(num_layers: usize, slots: usize) -> Result<Self, ScheduleError> {
        if num_layers == 0 {
            return Err(ScheduleError::EmptyChain);
        }
        if num_layers > MAX_REVOLVE_LAYERS {
            return Err(ScheduleError::InvalidParameter(format!(
                "revolve supports at most {MAX_REVOLVE_LAYERS} layers, got {num_layers}"
            )));
        }
        let work = (num_layers as u128).pow(2) * (slots.min(num_layers) as u128 + 1);
        if work > MAX_REVOLVE_WORK {
            return Err(ScheduleError::InvalidParameter(format!(
                "revolve with {num_layers} layers and {slots} slots is too large to tabulate; use fewer slots"
            )));
        }
        let table = RevolveTable::new(num_layers, slots);
        let mut ops = Vec::new();
        table.emit(0, num_layers, table.slots, &mut ops);
        Schedule::new(num_layers, ops)
    }
}

/// `C(c + r, c)`, saturating.
fn beta(c: u64, r: u64) -> u64 {
    // C(c + r, r) computed incrementally; exact at every step.
    let mut acc: u128 = 1;
    for k in 1..=r.min(c) {
        acc = acc * u128::from(c + r - r.min(c) + k) / u128::from(k);
        if acc > u128::from(u64::MAX) {
            return u64::MAX;
        }
    }
    acc as u64
}

/// Griewank's minimal number of forwards to reverse `num_layers` identical layers with `slots`
/// checkpoints besides the caller's input: each layer's taping forward plus `r·n − β(c+1, r−1)`
/// advances, `c = slots + 1`.
pub fn revolve_forward_count(num_layers: usize, slots: usize) -> u64 {
    let n = num_layers as u64;
    if n <= 1 {
        return n;
    }
    let c = slots as u64 + 1;
    // Repetition number: the smallest r with β(c, r) ≥ n.
    let mut r = 0u64;
    while beta(c, r) < n {
        r += 1;
    }
    let advances = if r == 0 {
        0
    } else {
        r * n - beta(c + 1, r - 1)
    };
    n + advances
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn beta_is_binomial() {
        assert_eq!(beta(2, 1), 3);
        assert_eq!(beta(3, 1), 4);
        assert_eq!(beta(2, 2), 6);
        assert_eq!(beta(5, 0), 1);
        assert_eq!(beta(0, 7), 1);
        assert_eq!(beta(3, 3), 20);
    }

    #[test]
    fn small_cases_by_hand() {
        // 2 layers, no slots: advance once from the input, tape layer 1, then tape layer 0.
        let s = Schedule::revolve(2, 0).unwrap();
        assert_eq!(
            s.ops(),
            [
                Op::ForwardCheckpoint(0),
                Op::ForwardSave(1),
                Op::Backward(1),
                Op::ForwardSave(0),
                Op::Backward(0)
            ]
        );
        assert_eq!(revolve_forward_count(2, 0), 3);
        assert_eq!(revolve_forward_count(3, 0), 6);
        assert_eq!(revolve_forward_count(4, 1), 8);
    }
}
