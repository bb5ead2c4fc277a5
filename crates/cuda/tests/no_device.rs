//! The device probe: on a machine without a usable GPU every constructor returns
//! `CudaError::NoDevice`, never a panic. Runs everywhere (not ignored).

use headroom_cuda::{device_count, driver_library_present, Cuda, CudaError};

#[test]
fn new_returns_no_device_when_there_is_none() {
    let result = Cuda::new(0);
    if device_count() == 0 {
        match result {
            Err(CudaError::NoDevice { reason }) => {
                assert!(!reason.is_empty());
                let shown = CudaError::NoDevice { reason }.to_string();
                assert!(shown.starts_with("no CUDA device"), "{shown}");
            }
            Err(other) => panic!("expected NoDevice, got {other:?}"),
            Ok(cuda) => panic!("device_count() is 0 but Cuda::new(0) opened {cuda:?}"),
        }
    } else {
        let cuda = result.expect("device_count() > 0, so ordinal 0 opens");
        assert_eq!(cuda.ordinal(), 0);
    }
}

#[test]
fn out_of_range_ordinal_is_no_device_on_every_machine() {
    for ordinal in [device_count(), device_count() + 7, usize::MAX] {
        match Cuda::new(ordinal) {
            Err(CudaError::NoDevice { reason }) => assert!(!reason.is_empty()),
            other => panic!("ordinal {ordinal}: expected NoDevice, got {other:?}"),
        }
    }
}

#[test]
fn missing_driver_library_means_zero_devices() {
    if driver_library_present() {
        eprintln!("libcuda is present on this machine; the no-driver path is not exercised here");
        return;
    }
    assert_eq!(device_count(), 0);
    match Cuda::new(0) {
        Err(CudaError::NoDevice { reason }) => {
            assert!(
                reason.contains("libcuda"),
                "reason should name the library: {reason}"
            )
        }
        other => panic!("expected NoDevice, got {other:?}"),
    }
}
