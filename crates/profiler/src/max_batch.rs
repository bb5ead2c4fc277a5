//! Find the largest batch (or sequence length, or any size) that fits a memory budget by trying
//! it: exponential growth until a failure, then binary search between the last fit and the
//! first failure ([`search_max_fit`]); and confirm an estimated answer by measuring around it
//! ([`confirm_boundary`]). Both assume fitting is monotone (if `n` fits, every smaller size
//! fits).

use std::collections::BTreeMap;

use serde::Serialize;

use crate::error::{OutOfBudget, ProfilerError};

/// One size tried.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Attempt {
    /// The size tried.
    pub size: usize,
    /// Whether it fit.
    pub fits: bool,
}

/// What a search established about the largest size that fits.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(tag = "outcome", rename_all = "snake_case")]
pub enum MaxFit {
    /// `largest_fit` fits and `smallest_refused` (= `largest_fit + 1` once the search has
    /// converged) does not: the answer, bracketed by two trials.
    Found {
        /// The largest size that fit.
        largest_fit: usize,
        /// The smallest size that did not fit.
        smallest_refused: usize,
    },
    /// Everything tried up to and including the search limit fit: the true answer is `limit`
    /// or larger, so `limit` is a lower bound, not the answer.
    LimitReached {
        /// The search limit, which fit.
        limit: usize,
    },
    /// Not even the smallest size tried fits.
    NoneFits {
        /// The smallest size tried (1 unless the search was stopped early).
        smallest_tried: usize,
    },
}

impl MaxFit {
    /// The largest size known to fit: the answer for [`MaxFit::Found`], the limit (a lower
    /// bound) for [`MaxFit::LimitReached`], `None` for [`MaxFit::NoneFits`].
    pub fn largest_fit(&self) -> Option<usize> {
        match *self {
            MaxFit::Found { largest_fit, .. } => Some(largest_fit),
            MaxFit::LimitReached { limit } => Some(limit),
            MaxFit::NoneFits { .. } => None,
        }
    }

    /// True for [`MaxFit::Found`]: a fit and a refusal one apart were both observed.
    pub fn is_exact(&self) -> bool {
        matches!(self, MaxFit::Found { largest_fit, smallest_refused }
            if smallest_refused.checked_sub(*largest_fit) == Some(1))
    }
}

impl std::fmt::Display for MaxFit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            MaxFit::Found {
                largest_fit,
                smallest_refused,
            } => write!(f, "{largest_fit} fits, {smallest_refused} does not"),
            MaxFit::LimitReached { limit } => {
                write!(f, "everything up to the limit {limit} fits")
            }
            MaxFit::NoneFits { smallest_tried } => {
                write!(f, "nothing fits (not even {smallest_tried})")
            }
        }
    }
}

/// The result of [`search_max_fit`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct SearchReport {
    /// What the search established.
    pub outcome: MaxFit,
    /// The largest size that fit (`None` when no size in `1..=limit` fits); the same as
    /// `outcome.largest_fit()`, so with [`MaxFit::LimitReached`] it is the limit, a lower
    /// bound — look at [`SearchReport::outcome`] to tell the two apart.
    pub largest_fit: Option<usize>,
    /// Every attempt in the order made.
    pub attempts: Vec<Attempt>,
}

/// What a trial step reports: it fit, it did not, or it failed for another reason.
pub type TrialResult<E> = Result<bool, E>;

/// Search `1..=limit` for the largest size for which `try_fit` returns `Ok(true)`.
///
/// Starts at `start` (clamped into `1..=limit`) and doubles while sizes fit, then bisects.
/// If `start` itself does not fit, bisects below it. Each size is tried at most once; an `Err`
/// from `try_fit` stops the search and is returned. About `2·log2(answer)` attempts.
///
/// The outcome says whether the answer was bracketed ([`MaxFit::Found`]), the limit fit
/// ([`MaxFit::LimitReached`]) or nothing did ([`MaxFit::NoneFits`]). A `limit` of 0 tries
/// nothing and reports `NoneFits { smallest_tried: 0 }`.
///
/// ```
/// use headroom_profiler::{search_max_fit, MaxFit};
/// let report = search_max_fit(1, 1 << 20, |batch| Ok::<_, ()>(batch * 3 <= 100)).unwrap();
/// assert_eq!(report.outcome, MaxFit::Found { largest_fit: 33, smallest_refused: 34 });
/// assert_eq!(report.largest_fit, Some(33));
/// assert!(report.attempts.len() <= 14);
/// let all = search_max_fit(4, 50, |_| Ok::<_, ()>(true)).unwrap();
/// assert_eq!(all.outcome, MaxFit::LimitReached { limit: 50 });
/// ```
pub fn search_max_fit<E>(
    start: usize,
    limit: usize,
    mut try_fit: impl FnMut(usize) -> TrialResult<E>,
) -> Result<SearchReport, E> {
    let mut attempts = Vec::new();
    if limit == 0 {
        return Ok(SearchReport {
            outcome: MaxFit::NoneFits { smallest_tried: 0 },
            largest_fit: None,
            attempts,
        });
    }
    let mut trial = |size: usize, attempts: &mut Vec<Attempt>| -> Result<bool, E> {
        let fits = try_fit(size)?;
        attempts.push(Attempt { size, fits });
        Ok(fits)
    };
    // Invariant: `lo` fits (0 stands for "nothing tried fits"), `hi` does not (limit + 1 stands
    // for "untried beyond the limit").
    let mut lo = 0usize;
    let mut hi = limit.saturating_add(1);
    let mut size = start.clamp(1, limit);
    loop {
        if trial(size, &mut attempts)? {
            lo = size;
            if size == limit {
                break;
            }
            size = size.saturating_mul(2).min(limit);
        } else {
            hi = size;
            break;
        }
    }
    while hi - lo > 1 {
        let mid = lo + (hi - lo) / 2;
        if trial(mid, &mut attempts)? {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    let outcome = if lo == 0 {
        MaxFit::NoneFits {
            smallest_tried: attempts.iter().map(|a| a.size).min().unwrap_or(1),
        }
    } else if lo == limit {
        MaxFit::LimitReached { limit }
    } else {
        MaxFit::Found {
            largest_fit: lo,
            smallest_refused: hi,
        }
    };
    Ok(SearchReport {
        largest_fit: outcome.largest_fit(),
        outcome,
        attempts,
    })
}

/// The result of [`confirm_boundary`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct BoundaryCheck {
    /// The confirmed answer: a measured fit at `b` and a measured refusal at `b + 1`
    /// ([`MaxFit::Found`]), a measured fit at the limit, or a measured refusal at 1. `None`
    /// when the trial budget ran out first; the bounds below then say what is known.
    pub outcome: Option<MaxFit>,
    /// The largest size measured to fit.
    pub largest_fit: Option<usize>,
    /// The smallest size measured not to fit.
    pub smallest_refused: Option<usize>,
    /// The estimate the walk started from (clamped into `1..=limit`).
    pub estimate: usize,
    /// Every measurement in the order made; each size at most once.
    pub trials: Vec<Attempt>,
}

impl BoundaryCheck {
    /// Signed distance from the estimate to the confirmed answer (`answer − estimate`), when
    /// the answer was confirmed and something fits.
    pub fn estimate_error(&self) -> Option<i128> {
        let answer = self.outcome?.largest_fit()?;
        Some(answer as i128 - self.estimate as i128)
    }
}

/// Confirm an estimated largest fitting size by measuring around it.
///
/// `estimate` (clamped into `1..=limit`) is measured first. From there the walk goes up while
/// measured runs fit and down while they do not, with steps that double each time it keeps
/// going the same way (1, 2, 4, … — so an estimate that is far off still costs only about
/// `2·log2(error)` trials), then bisects the gap between the largest measured fit and the
/// smallest measured refusal, until a fit at `b` and a refusal at `b + 1` have both been
/// measured. It stops early with [`MaxFit::LimitReached`] when `limit` fits and with
/// [`MaxFit::NoneFits`] when 1 does not. At most `max_trials` measurements are made (each size
/// at most once); if they run out first, `outcome` is `None`. An `Err` from `measure` stops
/// the walk and is returned.
///
/// ```
/// use headroom_profiler::{confirm_boundary, MaxFit};
/// // The estimator said 20; really 23 is the largest that fits.
/// let check = confirm_boundary(20, 1000, 16, |b| Ok::<_, ()>(b <= 23)).unwrap();
/// assert_eq!(check.outcome, Some(MaxFit::Found { largest_fit: 23, smallest_refused: 24 }));
/// assert_eq!(check.estimate_error(), Some(3));
/// ```
pub fn confirm_boundary<E>(
    estimate: usize,
    limit: usize,
    max_trials: usize,
    mut measure: impl FnMut(usize) -> TrialResult<E>,
) -> Result<BoundaryCheck, E> {
    let estimate = estimate.clamp(1, limit.max(1));
    let mut check = BoundaryCheck {
        outcome: None,
        largest_fit: None,
        smallest_refused: None,
        estimate,
        trials: Vec::new(),
    };
    if limit == 0 {
        check.outcome = Some(MaxFit::NoneFits { smallest_tried: 0 });
        return Ok(check);
    }
    let mut seen: BTreeMap<usize, bool> = BTreeMap::new();
    // Measure `size` unless already known; `None` when the trial budget is spent.
    let mut probe = |size: usize, check: &mut BoundaryCheck| -> Result<Option<bool>, E> {
        if let Some(fits) = seen.get(&size) {
            return Ok(Some(*fits));
        }
        if check.trials.len() >= max_trials {
            return Ok(None);
        }
        let fits = measure(size)?;
        seen.insert(size, fits);
        check.trials.push(Attempt { size, fits });
        if fits {
            check.largest_fit = Some(check.largest_fit.map_or(size, |l| l.max(size)));
        } else {
            check.smallest_refused = Some(check.smallest_refused.map_or(size, |s| s.min(size)));
        }
        Ok(Some(fits))
    };

    // Phase 1: gallop away from the estimate until both a fit and a refusal are known (or an
    // end of the range is reached).
    let Some(first) = probe(estimate, &mut check)? else {
        return Ok(check);
    };
    let mut step = 1usize;
    let mut at = estimate;
    loop {
        if first {
            if at == limit {
                check.outcome = Some(MaxFit::LimitReached { limit });
                return Ok(check);
            }
            at = at.saturating_add(step).min(limit);
            match probe(at, &mut check)? {
                None => return Ok(check),
                Some(true) => {}
                Some(false) => break,
            }
        } else {
            if at == 1 {
                check.outcome = Some(MaxFit::NoneFits { smallest_tried: 1 });
                return Ok(check);
            }
            at = at.saturating_sub(step).max(1);
            match probe(at, &mut check)? {
                None => return Ok(check),
                Some(false) => {}
                Some(true) => break,
            }
        }
        step = step.saturating_mul(2);
    }

    // Phase 2: bisect between the largest fit and the smallest refusal.
    loop {
        let (Some(lo), Some(hi)) = (check.largest_fit, check.smallest_refused) else {
            return Ok(check);
        };
        if hi <= lo {
            // Unreachable for the walk above (every fit it keeps is below every refusal), but
            // a boundary is never claimed from contradictory measurements.
            return Ok(check);
        }
        if hi - lo == 1 {
            check.outcome = Some(MaxFit::Found {
                largest_fit: lo,
                smallest_refused: hi,
            });
            return Ok(check);
        }
        let mid = lo + (hi - lo) / 2;
        if probe(mid, &mut check)?.is_none() {
            return Ok(check);
        }
    }
}

/// Turn a training step's result into a trial result: success fits, a budget refusal
/// ([`OutOfBudget`] anywhere in the error's source chain) does not fit, any other error stops
/// the search.
pub fn fits_unless_out_of_budget<T, E>(result: Result<T, E>) -> TrialResult<E>
where
    E: std::error::Error + 'static,
{
    match result {
        Ok(_) => Ok(true),
        Err(e) if OutOfBudget::find(&e).is_some() => Ok(false),
        Err(e) => Err(e),
    }
}

/// Check search bounds given by a user (command line): `start` and `limit` at least 1.
pub fn validate_search_bounds(start: usize, limit: usize) -> Result<(), ProfilerError> {
    if start == 0 || limit == 0 {
        return Err(ProfilerError::InvalidConfig {
            field: "search bounds",
            reason: format!("start {start} and limit {limit} must be at least 1"),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn nothing_fits_and_everything_fits() {
        let r = search_max_fit(4, 100, |_| Ok::<_, ()>(false)).unwrap();
        assert_eq!(r.largest_fit, None);
        assert_eq!(r.outcome, MaxFit::NoneFits { smallest_tried: 1 });
        assert_eq!(r.attempts.last().map(|a| a.size), Some(1));
        let r = search_max_fit(4, 100, |_| Ok::<_, ()>(true)).unwrap();
        assert_eq!(r.largest_fit, Some(100));
        assert_eq!(r.outcome, MaxFit::LimitReached { limit: 100 });
        assert!(!r.outcome.is_exact());
        let r = search_max_fit(4, 0, |_| Ok::<_, ()>(true)).unwrap();
        assert_eq!(r.largest_fit, None);
        assert_eq!(r.outcome, MaxFit::NoneFits { smallest_tried: 0 });
        assert!(r.attempts.is_empty());
        // The limit itself is the boundary: 100 fits, 101 is beyond the search.
        let r = search_max_fit(1, 100, |n| Ok::<_, ()>(n <= 100)).unwrap();
        assert_eq!(r.outcome, MaxFit::LimitReached { limit: 100 });
        // One below the limit is an exact answer.
        let r = search_max_fit(1, 100, |n| Ok::<_, ()>(n <= 99)).unwrap();
        assert_eq!(
            r.outcome,
            MaxFit::Found {
                largest_fit: 99,
                smallest_refused: 100
            }
        );
        assert!(r.outcome.is_exact());
        assert_eq!(r.outcome.to_string(), "99 fits, 100 does not");
    }

    #[test]
    fn errors_stop_the_search() {
        let r = search_max_fit(1, 100, |n| if n < 8 { Ok(true) } else { Err("boom") });
        assert_eq!(r, Err("boom"));
        assert!(validate_search_bounds(0, 3).is_err());
        assert!(validate_search_bounds(1, 3).is_ok());
        let c = confirm_boundary(5, 100, 10, |n| if n < 8 { Ok(true) } else { Err("boom") });
        assert_eq!(c, Err("boom"));
    }

    #[test]
    fn confirmation_edges() {
        // Everything fits: stops at the limit.
        let c = confirm_boundary(90, 100, 64, |_| Ok::<_, ()>(true)).unwrap();
        assert_eq!(c.outcome, Some(MaxFit::LimitReached { limit: 100 }));
        assert_eq!(
            c.trials.last(),
            Some(&Attempt {
                size: 100,
                fits: true
            })
        );
        // Nothing fits: stops at 1.
        let c = confirm_boundary(10, 100, 64, |_| Ok::<_, ()>(false)).unwrap();
        assert_eq!(c.outcome, Some(MaxFit::NoneFits { smallest_tried: 1 }));
        assert_eq!(
            c.trials.last(),
            Some(&Attempt {
                size: 1,
                fits: false
            })
        );
        assert_eq!(c.estimate_error(), None);
        // An estimate beyond the limit is clamped.
        let c = confirm_boundary(500, 100, 64, |n| Ok::<_, ()>(n <= 40)).unwrap();
        assert_eq!(c.estimate, 100);
        assert_eq!(c.outcome.and_then(|o| o.largest_fit()), Some(40));
        // The exact estimate costs two trials.
        let c = confirm_boundary(40, 100, 64, |n| Ok::<_, ()>(n <= 40)).unwrap();
        assert_eq!(
            c.trials,
            [
                Attempt {
                    size: 40,
                    fits: true
                },
                Attempt {
                    size: 41,
                    fits: false
                }
            ]
        );
        assert_eq!(c.estimate_error(), Some(0));
        // A zero limit measures nothing.
        let c = confirm_boundary(3, 0, 64, |_| Ok::<_, ()>(true)).unwrap();
        assert_eq!(c.outcome, Some(MaxFit::NoneFits { smallest_tried: 0 }));
        assert!(c.trials.is_empty());
        // Too few trials: no outcome, but the bounds measured so far.
        let c = confirm_boundary(1, 1000, 3, |n| Ok::<_, ()>(n <= 500)).unwrap();
        assert_eq!(c.outcome, None);
        assert_eq!(c.trials.len(), 3);
        assert_eq!(c.largest_fit, Some(4));
        assert_eq!(c.smallest_refused, None);
    }

    proptest! {
        #[test]
        fn finds_the_threshold_with_few_distinct_attempts(
            threshold in 0usize..5000, start in 1usize..64, limit in 1usize..6000,
        ) {
            let r = search_max_fit(start, limit, |n| Ok::<_, ()>(n <= threshold)).unwrap();
            let expected = threshold.min(limit);
            prop_assert_eq!(r.largest_fit, (expected > 0).then_some(expected));
            prop_assert_eq!(r.largest_fit, r.outcome.largest_fit());
            let outcome = if threshold == 0 {
                MaxFit::NoneFits { smallest_tried: 1 }
            } else if threshold >= limit {
                MaxFit::LimitReached { limit }
            } else {
                MaxFit::Found { largest_fit: threshold, smallest_refused: threshold + 1 }
            };
            prop_assert_eq!(r.outcome, outcome);
            let mut sizes: Vec<usize> = r.attempts.iter().map(|a| a.size).collect();
            for a in &r.attempts {
                prop_assert_eq!(a.fits, a.size <= threshold);
                prop_assert!(a.size >= 1 && a.size <= limit);
            }
            // The bracketing sizes were both tried.
            if let MaxFit::Found { largest_fit, smallest_refused } = r.outcome {
                prop_assert!(sizes.contains(&largest_fit) && sizes.contains(&smallest_refused));
            }
            let n = sizes.len();
            sizes.sort_unstable();
            sizes.dedup();
            prop_assert_eq!(sizes.len(), n, "a size was tried twice");
            // Doubling from `start` then bisecting: about 2·log2(limit) + 2 tries.
            let bound = 2 * (usize::BITS - limit.leading_zeros()) as usize + 2;
            prop_assert!(n <= bound, "{} attempts > {}", n, bound);
        }

        #[test]
        fn confirmation_lands_exactly_on_the_boundary(
            threshold in 0usize..5000, estimate in 0usize..6000, limit in 1usize..6000,
        ) {
            let c = confirm_boundary(estimate, limit, 64, |n| Ok::<_, ()>(n <= threshold))
                .unwrap();
            let expected = if threshold == 0 {
                MaxFit::NoneFits { smallest_tried: 1 }
            } else if threshold >= limit {
                MaxFit::LimitReached { limit }
            } else {
                MaxFit::Found { largest_fit: threshold, smallest_refused: threshold + 1 }
            };
            prop_assert_eq!(c.outcome, Some(expected));
            let mut sizes: Vec<usize> = c.trials.iter().map(|a| a.size).collect();
            for a in &c.trials {
                prop_assert_eq!(a.fits, a.size <= threshold);
                prop_assert!(a.size >= 1 && a.size <= limit);
            }
            prop_assert_eq!(c.trials.first().map(|a| a.size), Some(estimate.clamp(1, limit)));
            // Both sides of a found boundary were measured.
            if let MaxFit::Found { largest_fit, smallest_refused } = expected {
                prop_assert!(sizes.contains(&largest_fit) && sizes.contains(&smallest_refused));
            }
            let n = sizes.len();
            sizes.sort_unstable();
            sizes.dedup();
            prop_assert_eq!(sizes.len(), n, "a size was measured twice");
            // Galloping then bisecting: about 2·log2(distance) + 3 trials.
            let distance = estimate.clamp(1, limit).abs_diff(threshold.clamp(1, limit)) + 1;
            let bound = 2 * (usize::BITS - distance.leading_zeros()) as usize + 3;
            prop_assert!(n <= bound, "{} trials > {} (distance {})", n, bound, distance);
        }
    }
}
