//! Where a tensor lives.

use std::fmt;

use serde::{Deserialize, Serialize};

/// A compute device.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum Device {
    /// Host memory, computed on by the CPU backend.
    Cpu,
    /// A CUDA device, by ordinal.
    Cuda(usize),
}

impl Device {
    /// True for [`Device::Cuda`].
    pub const fn is_cuda(self) -> bool {
        matches!(self, Device::Cuda(_))
    }
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Device::Cpu => f.write_str("cpu"),
            Device::Cuda(i) => write!(f, "cuda:{i}"),
        }
    }
}
