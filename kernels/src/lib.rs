//! # headroom-kernels (under construction)
