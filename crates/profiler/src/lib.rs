//! # headroom-profiler
//!
//! Memory profiling by category: tracker, budgets, reports, timeline export, estimator. (Under construction.)
