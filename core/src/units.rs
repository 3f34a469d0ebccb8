//! Units for people: byte sizes printed one way everywhere (`512 B`, `1.5 MiB`), and byte
//! sizes, bandwidths and flop rates read from text (`16GiB`, `25Gbit/s`, `15.7T`) by flags
//! and cluster files alike.

/// `512 B`, `1.5 KiB`, `23.4 MiB`, `1.0 GiB`: powers of 1024, one decimal.
pub fn human_bytes(bytes: u64) -> String {
    const UNITS: [&str; 6] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
    let mut v = bytes as f64;
    let mut unit = 0;
    while v >= 1024.0 && unit + 1 < UNITS.len() {
        v /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{bytes} B")
    } else {
        format!("{v:.1} {}", UNITS[unit])
    }
}

/// A size, bandwidth or flop rate that does not parse.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("cannot parse {text:?} as {what}")]
pub struct UnitError {
    pub text: String,
    pub what: &'static str,
}

fn split_number(s: &str) -> Option<(f64, &str)> {
    let s = s.trim();
    let end = s
        .find(|c: char| {
            !(c.is_ascii_digit() || c == '.' || c == 'e' || c == 'E' || c == '+' || c == '-')
        })
        .unwrap_or(s.len());
    // An 'e' directly followed by a letter that is not a digit belongs to the unit (rare); keep it simple.
    let (num, unit) = s.split_at(end);
    let v: f64 = num.parse().ok()?;
    (v.is_finite() && v >= 0.0).then_some((v, unit.trim()))
}

fn size_multiplier(unit: &str) -> Option<f64> {
    Some(match unit {
        "" | "B" => 1.0,
        "K" | "KB" | "kB" => 1e3,
        "M" | "MB" => 1e6,
        "G" | "GB" => 1e9,
        "T" | "TB" => 1e12,
        "KiB" => 1024.0,
        "MiB" => 1024.0 * 1024.0,
        "GiB" => 1024.0 * 1024.0 * 1024.0,
        "TiB" => 1024.0f64.powi(4),
        _ => return None,
    })
}

/// Parses a byte size: `"16GiB"`, `"512MiB"`, `"1.5GB"`, `"4096"`.
pub fn parse_bytes(text: &str) -> Result<u64, UnitError> {
    let err = || UnitError {
        text: text.to_string(),
        what: "a byte size",
    };
    let (v, unit) = split_number(text).ok_or_else(err)?;
    let bytes = v * size_multiplier(unit).ok_or_else(err)?;
    if bytes > u64::MAX as f64 {
        return Err(err());
    }
    Ok(bytes.round() as u64)
}

/// Parses a bandwidth into bytes/s: `"25GB/s"`, `"100Gbit/s"`, `"10Gbps"`, `"1.5e9"`.
pub fn parse_bandwidth(text: &str) -> Result<f64, UnitError> {
    let err = || UnitError {
        text: text.to_string(),
        what: "a bandwidth",
    };
    let (v, unit) = split_number(text).ok_or_else(err)?;
    let bits = |prefix: &str| -> Option<f64> {
        Some(match prefix {
            "" => 1.0,
            "K" | "k" => 1e3,
            "M" => 1e6,
            "G" => 1e9,
            "T" => 1e12,
            _ => return None,
        })
    };
    let bytes_per_s = if let Some(p) = unit
        .strip_suffix("bit/s")
        .or_else(|| unit.strip_suffix("bps"))
    {
        v * bits(p).ok_or_else(err)? / 8.0
    } else if let Some(p) = unit.strip_suffix("/s") {
        v * size_multiplier(p).ok_or_else(err)?
    } else if unit.is_empty() {
        v
    } else {
        return Err(err());
    };
    Ok(bytes_per_s)
}

/// Parses a flop rate: `"15.7T"`, `"312Tflops"`, `"1e14"`, `"100 TFLOPS"`.
pub fn parse_flops(text: &str) -> Result<f64, UnitError> {
    let err = || UnitError {
        text: text.to_string(),
        what: "a flop rate",
    };
    let (v, unit) = split_number(text).ok_or_else(err)?;
    let unit = unit.trim_end_matches("/s");
    let lower = unit.to_ascii_lowercase();
    let prefix = lower.strip_suffix("flops").unwrap_or(&lower);
    let m = match prefix.trim() {
        "" => 1.0,
        "k" => 1e3,
        "m" => 1e6,
        "g" => 1e9,
        "t" => 1e12,
        "p" => 1e15,
        _ => return Err(err()),
    };
    Ok(v * m)
}

#[cfg(test)]
mod tests {
    use super::{human_bytes, parse_bandwidth, parse_bytes, parse_flops};

    #[test]
    fn formats_sizes() {
        assert_eq!(human_bytes(0), "0 B");
        assert_eq!(human_bytes(1023), "1023 B");
        assert_eq!(human_bytes(1536), "1.5 KiB");
        assert_eq!(human_bytes(23_670_924), "22.6 MiB");
        assert_eq!(human_bytes(16 << 30), "16.0 GiB");
    }

    #[test]
    fn parses_sizes() {
        assert_eq!(parse_bytes("16GiB"), Ok(16 << 30));
        assert_eq!(parse_bytes("1.5GB"), Ok(1_500_000_000));
        assert_eq!(parse_bytes("lots").unwrap_err().to_string(), "cannot parse \"lots\" as a byte size");
    }

    #[test]
    fn sizes_and_rates() {
        assert_eq!(parse_bytes("16GiB").unwrap(), 16 << 30);
        assert_eq!(parse_bytes("512MiB").unwrap(), 512 << 20);
        assert_eq!(parse_bytes("1.5GB").unwrap(), 1_500_000_000);
        assert_eq!(parse_bytes("4096").unwrap(), 4096);
        assert_eq!(parse_bytes("16 parsecs").unwrap_err().to_string(), "cannot parse \"16 parsecs\" as a byte size");
        assert_eq!(parse_bytes("-1GB").unwrap_err().to_string(), "cannot parse \"-1GB\" as a byte size");
        assert_eq!(parse_bandwidth("25GB/s").unwrap(), 25e9);
        assert_eq!(parse_bandwidth("100Gbit/s").unwrap(), 12.5e9);
        assert_eq!(parse_bandwidth("10Gbps").unwrap(), 1.25e9);
        assert_eq!(parse_bandwidth("10Gbit").unwrap_err().to_string(), "cannot parse \"10Gbit\" as a bandwidth");
        assert_eq!(parse_flops("15.7T").unwrap(), 15.7e12);
        assert_eq!(parse_flops("312 TFLOPS").unwrap(), 312e12);
    }
}
