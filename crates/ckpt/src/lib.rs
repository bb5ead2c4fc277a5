//! # headroom-ckpt
//!
//! Activation checkpointing: layer contract, recompute schedules, chain executor and an optimal memory-budget planner. (Under construction.)
