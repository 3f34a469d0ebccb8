//! Where kernels run: `cpu` or `cuda:N`. Parsing and printing live here; checking that
//! libtorch can reach a device is the runtime's (`pipewright_runtime::device`).

use std::fmt;
use std::str::FromStr;

/// A compute device.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Device {
    Cpu,
    Cuda(usize),
}

/// Text that names no device.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("unknown device {0:?}: expected \"cpu\", \"cuda\" or \"cuda:N\"")]
pub struct UnknownDevice(pub String);

impl FromStr for Device {
    type Err = UnknownDevice;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "cpu" => return Ok(Device::Cpu),
            "cuda" => return Ok(Device::Cuda(0)),
            _ => {}
        }
        s.strip_prefix("cuda:")
            .filter(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
            .and_then(|n| n.parse::<usize>().ok())
            .map(Device::Cuda)
            .ok_or_else(|| UnknownDevice(s.to_string()))
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

impl serde::Serialize for Device {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> serde::Deserialize<'de> for Device {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = <std::borrow::Cow<'de, str> as serde::Deserialize>::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_prints_devices() {
        assert_eq!("cpu".parse::<Device>(), Ok(Device::Cpu));
        assert_eq!("cuda".parse::<Device>(), Ok(Device::Cuda(0)));
        assert_eq!("cuda:3".parse::<Device>(), Ok(Device::Cuda(3)));
        assert_eq!(Device::Cuda(3).to_string(), "cuda:3");
        for bad in ["gpu", "cuda:x", "cuda:", "cuda:+1", "CPU", " cpu"] {
            assert_eq!(bad.parse::<Device>(), Err(UnknownDevice(bad.into())), "{bad}");
        }
        assert_eq!(serde_json::to_string(&Device::Cuda(1)).unwrap(), "\"cuda:1\"");
        assert_eq!(serde_json::from_str::<Device>("\"cpu\"").unwrap(), Device::Cpu);
    }
}
