//! # headroom-offload
//!
//! Bandwidth-bound CPU AdamW, 8-bit optimizer state, gradient offload pipeline, RAM and memory-mapped state stores. (Under construction.)
