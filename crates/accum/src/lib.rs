//! # headroom-accum
//!
//! Gradient accumulation exactly equivalent to the big batch: micro-batching, token-weighted normalisation, clipping. (Under construction.)
