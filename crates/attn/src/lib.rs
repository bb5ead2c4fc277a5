//! # headroom-attn
//!
//! Naive, chunked and flash attention, forward and backward, causal, GQA, CPU (CUDA behind a feature). (Under construction.)
