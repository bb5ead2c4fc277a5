//! [`DeviceMemoryProbe`] for the CUDA backend: the driver's free/total (`cuMemGetInfo`) and the
//! default memory pool's reserved bytes, for the report's device lines.

use headroom_cuda::Cuda;
use headroom_tensor::Device;

use crate::{DeviceMemoryInfo, DeviceMemoryProbe, ProfilerError};

impl DeviceMemoryProbe for Cuda {
    fn probe(&self, device: Device) -> Result<DeviceMemoryInfo, ProfilerError> {
        if device != Device::Cuda(self.ordinal()) {
            return Err(ProfilerError::Unavailable {
                what: "device memory",
                reason: format!("this probe sees cuda:{}, not {device}", self.ordinal()),
            });
        }
        let unavailable = |e: headroom_cuda::CudaError| ProfilerError::Unavailable {
            what: "device memory",
            reason: e.to_string(),
        };
        let (free, total) = self.mem_info().map_err(unavailable)?;
        let pool_reserved = self.pool_reserved_bytes().map_err(unavailable)?;
        Ok(DeviceMemoryInfo {
            device,
            free: free as u64,
            total: total as u64,
            pool_reserved: Some(pool_reserved),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use headroom_tensor::{Backend, DType};

    #[test]
    #[ignore = "needs a CUDA device"]
    fn probe_reports_plausible_device_figures() {
        let cuda = Cuda::new(0).unwrap();
        let before = cuda.probe(Device::Cuda(0)).unwrap();
        assert!(before.free <= before.total && before.total > 0);
        let t = cuda.zeros([64 << 20], DType::U8).unwrap();
        cuda.synchronize().unwrap();
        let after = cuda.probe(Device::Cuda(0)).unwrap();
        assert!(after.pool_reserved.unwrap() >= 64 << 20, "{after:?}");
        drop(t);
        assert!(cuda.probe(Device::Cpu).is_err());
    }
}
