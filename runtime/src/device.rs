//! Where kernels run: `cpu` or `cuda:N`, parsed from the command line and checked
//! against what libtorch can reach.

use std::fmt;
use std::str::FromStr;

/// A compute device.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Device {
    Cpu,
    Cuda(usize),
}

/// A device that cannot be parsed or used.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum DeviceError {
    #[error("unknown device {0:?}: expected \"cpu\", \"cuda\" or \"cuda:N\"")]
    Parse(String),
    #[error(
        "CUDA device {0} requested but no CUDA device is available \
         (libtorch built without CUDA or no GPU)"
    )]
    NoCuda(Device),
    #[error("CUDA device {device} requested but only {count} CUDA device(s) are available")]
    OutOfRange { device: Device, count: i64 },
}

impl FromStr for Device {
    type Err = DeviceError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let t = s.trim().to_ascii_lowercase();
        match t.as_str() {
            "cpu" => return Ok(Device::Cpu),
            "cuda" => return Ok(Device::Cuda(0)),
            _ => {}
        }
        t.strip_prefix("cuda:")
            .and_then(|n| n.parse::<usize>().ok())
            .map(Device::Cuda)
            .ok_or_else(|| DeviceError::Parse(s.to_string()))
    }
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Device::Cpu => f.write_str("cpu"),
            Device::Cuda(n) => write!(f, "cuda:{n}"),
        }
    }
}

#[cfg(feature = "torch")]
impl Device {
    /// The tch device, after checking that libtorch can reach it.
    pub fn to_tch(&self) -> Result<tch::Device, DeviceError> {
        match *self {
            Device::Cpu => Ok(tch::Device::Cpu),
            Device::Cuda(n) => {
                if !tch::Cuda::is_available() {
                    return Err(DeviceError::NoCuda(*self));
                }
                let count = tch::Cuda::device_count();
                if n as i64 >= count {
                    return Err(DeviceError::OutOfRange {
                        device: *self,
                        count,
                    });
                }
                Ok(tch::Device::Cuda(n))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_devices() {
        assert_eq!("cpu".parse::<Device>(), Ok(Device::Cpu));
        assert_eq!("cuda".parse::<Device>(), Ok(Device::Cuda(0)));
        assert_eq!("cuda:3".parse::<Device>(), Ok(Device::Cuda(3)));
        assert!(matches!(
            "gpu".parse::<Device>(),
            Err(DeviceError::Parse(_))
        ));
        assert!(matches!(
            "cuda:x".parse::<Device>(),
            Err(DeviceError::Parse(_))
        ));
    }

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
