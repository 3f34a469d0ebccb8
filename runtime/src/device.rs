//! Reaching a [`Device`] (parsed and printed by `pipewright_core`) through libtorch.

pub use pipewright_core::Device;

/// A device libtorch cannot reach.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum DeviceError {
    #[error(
        "CUDA device {0} requested but no CUDA device is available \
         (libtorch built without CUDA or no GPU)"
    )]
    NoCuda(Device),
    #[error("CUDA device {device} requested but only {count} CUDA device(s) are available")]
    OutOfRange { device: Device, count: i64 },
}

/// The tch device for `device`, after checking that libtorch can reach it.
#[cfg(feature = "torch")]
pub fn tch_device(device: Device) -> Result<tch::Device, DeviceError> {
    match device {
        Device::Cpu => Ok(tch::Device::Cpu),
        Device::Cuda(n) => {
            if !tch::Cuda::is_available() {
                return Err(DeviceError::NoCuda(device));
            }
            let count = tch::Cuda::device_count();
            if n as i64 >= count {
                return Err(DeviceError::OutOfRange { device, count });
            }
            Ok(tch::Device::Cuda(n))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_cuda_message() {
        let msg = DeviceError::NoCuda(Device::Cuda(0)).to_string();
        assert_eq!(
            msg,
            "CUDA device cuda:0 requested but no CUDA device is available \
             (libtorch built without CUDA or no GPU)"
        );
    }
}
