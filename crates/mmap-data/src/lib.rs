//! # headroom-mmap-data
//!
//! Memory-mapped token datasets (nanoGPT, llm.c, Megatron), samplers, prefetching loader, synthetic source. (Under construction.)
