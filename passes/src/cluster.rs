//! The cluster the planner targets: workers, their memory, link bandwidths and roofline
//! numbers, with a TOML form and parsers for human-readable sizes.
//!
//! # TOML keys (all optional; missing keys keep [`Cluster::default`])
//! ```toml
//! workers = 16              # total accelerators N = w * d
//! workers_per_node = 8      # accelerators per server
//! memory_per_worker = "16GiB"   # or an integer byte count
//! intra_bw = "150GB/s"      # link inside a server, bytes/s (or "Gbit/s", or a number)
//! inter_bw = "100Gbit/s"    # link between servers
//! peak_flops = "15.7T"      # flop/s: a number, or with suffix K/M/G/T/P (optionally "flops", "FLOPS", "/s")
//! mem_bw = "900GB/s"        # device memory bandwidth for the roofline
//! server_bw = "25Gbit/s"    # all of a server's network links together (optional)
//! ```
//! Without `server_bw`, every all-reduce ring that leaves a server has `inter_bw` to itself;
//! with it, the rings of the `min(d, workers_per_node)` stages a server holds share it
//! ([`Cluster::allreduce_bw`]).
//! The keys may also sit in a `[cluster]` table. Unknown keys are errors.
//!
//! Sizes: `B`, `KB`/`MB`/`GB`/`TB` (powers of 1000), `KiB`/`MiB`/`GiB`/`TiB` (powers of
//! 1024). Bandwidths: a size followed by `/s` (bytes), or `bit/s`, `Kbit/s`, `Mbit/s`,
//! `Gbit/s`, `Tbit/s` (`bps` and `Gbps` forms accepted), converted to bytes/s.

// `%`: the workspace's MSRV is 1.80.
#![allow(clippy::manual_is_multiple_of)]

use pipewright_core::units::human_bytes;
use serde::{Deserialize, Serialize};

use crate::cost::Roofline;

/// The hardware a plan is made for.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Cluster {
    pub workers: usize,
    /// Bytes of accelerator memory per worker.
    pub memory_per_worker: u64,
    /// Bytes/s between workers of one server.
    pub intra_bw: f64,
    /// Bytes/s between servers.
    pub inter_bw: f64,
    pub workers_per_node: usize,
    /// Flop/s of one worker.
    pub peak_flops: f64,
    /// Memory bandwidth of one worker, bytes/s.
    pub mem_bw: f64,
    /// Bytes/s all network links of one server carry together (`None`: not described,
    /// each ring has `inter_bw`). Absent from plan files written before it existed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub server_bw: Option<f64>,
}

/// Said wherever a plan was made on [`Cluster::default`] because no cluster was described.
pub const DEFAULT_CLUSTER_NOTE: &str = "no cluster given, so the plan assumes the default: one server of 8 V100-class GPUs \
(16 GiB and 15.7 Tflop/s each, 150 GB/s between them), not this machine; describe yours with --cluster FILE \
or --workers, --memory, --peak-flops, --intra-bw, --inter-bw, --workers-per-node";

impl Default for Cluster {
    /// One server of 8 V100-class GPUs: 16 GiB each, NVLink-class 150 GB/s inside the
    /// server, 25 Gbit/s between servers, 15.7 Tflop/s, 900 GB/s.
    fn default() -> Cluster {
        Cluster {
            workers: 8,
            memory_per_worker: 16 << 30,
            intra_bw: 150e9,
            inter_bw: 25e9 / 8.0,
            workers_per_node: 8,
            peak_flops: 15.7e12,
            mem_bw: 900e9,
            server_bw: None,
        }
    }
}

/// Cluster description errors.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum ClusterError {
    #[error("invalid TOML: {0}")]
    Toml(String),
    #[error("unknown cluster key {0:?}")]
    UnknownKey(String),
    #[error("cluster key {key:?}: {why}")]
    BadValue { key: String, why: String },
    #[error("cannot parse {text:?} as {what}")]
    Parse { text: String, what: &'static str },
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
pub fn parse_bytes(text: &str) -> Result<u64, ClusterError> {
    let err = || ClusterError::Parse {
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
pub fn parse_bandwidth(text: &str) -> Result<f64, ClusterError> {
    let err = || ClusterError::Parse {
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
pub fn parse_flops(text: &str) -> Result<f64, ClusterError> {
    let err = || ClusterError::Parse {
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

impl Cluster {
    /// Reads a cluster from TOML (keys in the module docs).
    pub fn from_toml(text: &str) -> Result<Cluster, ClusterError> {
        let root: toml::Table = text
            .parse()
            .map_err(|e: toml::de::Error| ClusterError::Toml(e.to_string()))?;
        let table = match root.get("cluster") {
            Some(toml::Value::Table(t)) if root.len() == 1 => t.clone(),
            _ => root,
        };
        let mut c = Cluster::default();
        for (key, value) in &table {
            let bad = |why: &str| ClusterError::BadValue {
                key: key.clone(),
                why: why.to_string(),
            };
            let count = || -> Result<usize, ClusterError> {
                match value {
                    toml::Value::Integer(i) if *i >= 1 => {
                        usize::try_from(*i).map_err(|_| bad("too large"))
                    }
                    _ => Err(bad("expected a positive integer")),
                }
            };
            let text_or_number =
                |parse: fn(&str) -> Result<f64, ClusterError>| -> Result<f64, ClusterError> {
                    let v = match value {
                        toml::Value::Integer(i) if *i >= 0 => *i as f64,
                        toml::Value::Float(f) if f.is_finite() && *f >= 0.0 => *f,
                        toml::Value::String(s) => parse(s)?,
                        _ => {
                            return Err(bad(
                                "expected a non-negative number or a string with a unit",
                            ))
                        }
                    };
                    if v <= 0.0 {
                        return Err(bad("must be positive"));
                    }
                    Ok(v)
                };
            match key.as_str() {
                "workers" => c.workers = count()?,
                "workers_per_node" => c.workers_per_node = count()?,
                "memory_per_worker" => {
                    c.memory_per_worker = match value {
                        toml::Value::Integer(i) if *i > 0 => *i as u64,
                        toml::Value::String(s) => parse_bytes(s)?,
                        _ => {
                            return Err(bad(
                                "expected a positive byte count or a size such as \"16GiB\"",
                            ))
                        }
                    };
                    if c.memory_per_worker == 0 {
                        return Err(bad("must be positive"));
                    }
                }
                "intra_bw" => c.intra_bw = text_or_number(parse_bandwidth)?,
                "inter_bw" => c.inter_bw = text_or_number(parse_bandwidth)?,
                "peak_flops" => c.peak_flops = text_or_number(parse_flops)?,
                "mem_bw" => c.mem_bw = text_or_number(parse_bandwidth)?,
                "server_bw" => c.server_bw = Some(text_or_number(parse_bandwidth)?),
                _ => return Err(ClusterError::UnknownKey(key.clone())),
            }
        }
        Ok(c)
    }

    /// One line for people: `8 workers (8 per server), 16.0 GiB, 15.7 Tflop/s each`.
    pub fn summary(&self) -> String {
        let memory = if self.memory_per_worker == u64::MAX { "no memory limit".to_string() } else { human_bytes(self.memory_per_worker) };
        format!("{} workers ({} per server), {memory}, {:.1} Tflop/s each", self.workers, self.workers_per_node, self.peak_flops / 1e12)
    }

    /// The roofline description of one worker.
    pub fn roofline(&self) -> Roofline {
        Roofline {
            name: "cluster worker".into(),
            peak_flops: self.peak_flops,
            mem_bw: self.mem_bw,
        }
    }

    /// Bandwidth between consecutive stages of one pipeline. Workers are numbered
    /// `replica * d + stage`, so a pipeline stays inside a server when `d` divides the
    /// server size.
    pub fn pipeline_bw(&self, d: usize) -> f64 {
        if d <= self.workers_per_node && self.workers_per_node % d.max(1) == 0 {
            self.intra_bw
        } else {
            self.inter_bw
        }
    }

    /// Bandwidth of the all-reduce among the `w` replicas of a stage: intra-server when all
    /// `w * d` workers fit in one server; otherwise `inter_bw`, or, when the servers'
    /// network is described (`server_bw`), its share for each of the `min(d,
    /// workers_per_node)` rings of the stages a server holds, which all-reduce at about the
    /// same time.
    pub fn allreduce_bw(&self, w: usize, d: usize) -> f64 {
        if w.saturating_mul(d) <= self.workers_per_node {
            self.intra_bw
        } else {
            let rings = d.min(self.workers_per_node).max(1) as f64;
            self.server_bw.map_or(self.inter_bw, |s| self.inter_bw.min(s / rings))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_and_rates() {
        assert_eq!(parse_bytes("16GiB").unwrap(), 16 << 30);
        assert_eq!(parse_bytes("512MiB").unwrap(), 512 << 20);
        assert_eq!(parse_bytes("1.5GB").unwrap(), 1_500_000_000);
        assert_eq!(parse_bytes("4096").unwrap(), 4096);
        assert!(parse_bytes("16 parsecs").is_err());
        assert!(parse_bytes("-1GB").is_err());
        assert_eq!(parse_bandwidth("25GB/s").unwrap(), 25e9);
        assert_eq!(parse_bandwidth("100Gbit/s").unwrap(), 12.5e9);
        assert_eq!(parse_bandwidth("10Gbps").unwrap(), 1.25e9);
        assert!(parse_bandwidth("10Gbit").is_err());
        assert_eq!(parse_flops("15.7T").unwrap(), 15.7e12);
        assert_eq!(parse_flops("312 TFLOPS").unwrap(), 312e12);
    }

    #[test]
    fn toml_keys() {
        let c = Cluster::from_toml(
            "workers = 16\nworkers_per_node = 4\nmemory_per_worker = \"512MiB\"\nintra_bw = \"25GB/s\"\ninter_bw = \"100Gbit/s\"\npeak_flops = 1e12\nmem_bw = \"1TB/s\"\n",
        )
        .unwrap();
        assert_eq!(c.workers, 16);
        assert_eq!(c.workers_per_node, 4);
        assert_eq!(c.memory_per_worker, 512 << 20);
        assert_eq!(c.intra_bw, 25e9);
        assert_eq!(c.inter_bw, 12.5e9);
        assert_eq!(c.peak_flops, 1e12);
        assert_eq!(c.mem_bw, 1e12);
        assert_eq!(c.server_bw, None);
        // Four rings leave each server of 4 at d = 4 and share its 100 Gbit/s.
        assert_eq!(c.allreduce_bw(4, 4), 12.5e9);
        let shared = Cluster::from_toml("workers = 16\nworkers_per_node = 4\ninter_bw = \"100Gbit/s\"\nserver_bw = \"100Gbit/s\"\n").unwrap();
        assert_eq!(shared.allreduce_bw(4, 4), 12.5e9 / 4.0);
        assert_eq!(shared.allreduce_bw(16, 1), 12.5e9);
        assert_eq!(shared.allreduce_bw(2, 2), shared.intra_bw);
        let t = Cluster::from_toml("[cluster]\nworkers = 2\n").unwrap();
        assert_eq!(t.workers, 2);
        assert!(matches!(
            Cluster::from_toml("gpus = 3"),
            Err(ClusterError::UnknownKey(_))
        ));
        assert!(matches!(
            Cluster::from_toml("workers = 0"),
            Err(ClusterError::BadValue { .. })
        ));
        assert!(matches!(
            Cluster::from_toml("workers = ["),
            Err(ClusterError::Toml(_))
        ));
    }
}
