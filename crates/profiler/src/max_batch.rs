//! Find the largest batch (or sequence length, or any size) that fits a memory budget by trying
//! it: exponential growth until a failure, then binary search between the last fit and the
//! first failure. Assumes fitting is monotone (if `n` fits, every smaller size fits).

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

/// The result of [`search_max_fit`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct SearchReport {
    /// The largest size that fit (`None` when no size in `1..=limit` fits).
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
/// ```
/// use headroom_profiler::search_max_fit;
/// let report = search_max_fit(1, 1 << 20, |batch| Ok::<_, ()>(batch * 3 <= 100)).unwrap();
/// assert_eq!(report.largest_fit, Some(33));
/// assert!(report.attempts.len() <= 14);
/// ```
pub fn search_max_fit<E>(
    start: usize,
    limit: usize,
    mut try_fit: impl FnMut(usize) -> TrialResult<E>,
) -> Result<SearchReport, E> {
    let mut attempts = Vec::new();
    if limit == 0 {
        return Ok(SearchReport {
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
    Ok(SearchReport {
        largest_fit: (lo > 0).then_some(lo),
        attempts,
    })
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
        assert_eq!(r.attempts.last().map(|a| a.size), Some(1));
        let r = search_max_fit(4, 100, |_| Ok::<_, ()>(true)).unwrap();
        assert_eq!(r.largest_fit, Some(100));
        let r = search_max_fit(4, 0, |_| Ok::<_, ()>(true)).unwrap();
        assert_eq!(r.largest_fit, None);
        assert!(r.attempts.is_empty());
    }

    #[test]
    fn errors_stop_the_search() {
        let r = search_max_fit(1, 100, |n| if n < 8 { Ok(true) } else { Err("boom") });
        assert_eq!(r, Err("boom"));
        assert!(validate_search_bounds(0, 3).is_err());
        assert!(validate_search_bounds(1, 3).is_ok());
    }

    proptest! {
        #[test]
        fn finds_the_threshold_with_few_distinct_attempts(
            threshold in 0usize..5000, start in 1usize..64, limit in 1usize..6000,
        ) {
            let r = search_max_fit(start, limit, |n| Ok::<_, ()>(n <= threshold)).unwrap();
            let expected = threshold.min(limit);
            prop_assert_eq!(r.largest_fit, (expected > 0).then_some(expected));
            let mut sizes: Vec<usize> = r.attempts.iter().map(|a| a.size).collect();
            for a in &r.attempts {
                prop_assert_eq!(a.fits, a.size <= threshold);
                prop_assert!(a.size >= 1 && a.size <= limit);
            }
            let n = sizes.len();
            sizes.sort_unstable();
            sizes.dedup();
            prop_assert_eq!(sizes.len(), n, "a size was tried twice");
            // Doubling from `start` then bisecting: about 2·log2(limit) + 2 tries.
            let bound = 2 * (usize::BITS - limit.leading_zeros()) as usize + 2;
            prop_assert!(n <= bound, "{} attempts > {}", n, bound);
        }
    }
}
