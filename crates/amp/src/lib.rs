//! # headroom-amp
//!
//! Mixed precision: dynamic loss scaler (GradScaler semantics), autocast policy, fp32 master weights, bf16 stochastic rounding. (Under construction.)
