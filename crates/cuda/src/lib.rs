//! # headroom-cuda (under construction)
