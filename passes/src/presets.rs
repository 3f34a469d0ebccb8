//! Hardware for `pipewright simulate`: device and network presets (datasheet figures; the
//! sources are listed in docs/simulator.md) and [`SimCluster`], a [`Cluster`] with the
//! link latencies the simulator also needs, and what a device achieves of its peaks: per
//! kernel from published measurements ([`DEVICES`], [`Achievable`]), or a flat
//! `--efficiency` the user gives instead.
//!
//! # TOML (`simulate --cluster FILE`)
//! The keys of [`Cluster::from_toml`], plus (all optional):
//! ```toml
//! intra_latency = "5us"      # per message inside a server
//! inter_latency = "20us"     # per message between servers
//! efficiency = 0.5           # share of peak flop/s and memory bandwidth achieved
//! host_cores = 2             # the stages are threads on one host with this many cores
//! ```
//! `host_cores` describes a CPU run of the embedded executor (one compute thread per stage
//! and replica, all in one process): the working stages then take turns on those cores in
//! Linux's default time slice ([`crate::machine::HostCores::linux`]), each turn lasting
//! until the scheduler's next tick when a profile measured it ([`crate::cost::CostModel::tick`]).
//! Without it every stage has its own device.

use pipewright_core::{Layout, Precision};
use serde::Serialize;

use crate::cluster::{Cluster, ClusterError, Latencies};
use crate::cost::Achievable;
use crate::machine::{AllReduce, Link};
use pipewright_core::Reduction;

/// One accelerator's datasheet figures.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct DevicePreset {
    pub name: &'static str,
    pub memory: u64,
    /// Dense fp32 flop/s (no tensor cores).
    pub fp32_flops: f64,
    /// Dense fp16 tensor-core flop/s (bf16 the same where supported).
    pub half_flops: f64,
    pub bf16: bool,
    /// Memory bandwidth, bytes/s.
    pub mem_bw: f64,
    /// NVLink bandwidth per direction per GPU, bytes/s.
    pub nvlink_bw: f64,
    /// The network preset its usual servers have.
    pub network: &'static str,
    /// What it achieves of those peaks (published measurements, [`DEVICES`]).
    pub measured: Measured,
}

/// A device's published measurements: the shares of its peaks that large matrix products
/// and streaming kernels reach, and its multiprocessors (for tile and wave quantization).
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Measured {
    /// Large fp16/bf16 tensor-core matrix products.
    pub gemm_half: f64,
    /// Large fp32 matrix products; `None`: no published measurement (the peak is used).
    pub gemm_fp32: Option<f64>,
    /// Streaming kernels (one load, one store per element).
    pub bandwidth: f64,
    pub sms: u32,
}

/// Host launch time per kernel: "Usually, the launch time on the CPU side is between 5-20
/// microseconds" (Meta, Holistic Trace Analysis, *CUDA Kernel Launch Statistics*); the low
/// end, as libtorch launches from C++ with no Python in between.
pub const LAUNCH_S: f64 = 5e-6;

const GIB: u64 = 1 << 30;

/// The device presets (datasheet sources: docs/simulator.md). Measured shares:
/// - V100: fp16 GEMM 83 of 125 Tflop/s (Markidis et al., *NVIDIA Tensor Core
///   Programmability, Performance & Precision*, IPDPSW 2018, arXiv 1803.04014); fp32 GEMM
///   14 of 15.7 (M. Li, github.com/mli/transformers-benchmarks, V100 16GB); 809 of 898 GB/s
///   streamed (RRZE gpu-benches `gpu-stream`, "scale", Ernst et al., JPDC 2023); 80 SMs
///   (NVIDIA Tesla V100 white paper).
/// - A100: bf16 GEMM 267.9 of 312 Tflop/s (S. Bekman, *Machine Learning Engineering*,
///   "Maximum Achievable Matmul FLOPS", A100 SXM); streamed 1382 of 1555 GB/s (40 GB) and
///   1737 of 2039 (80 GB) (RRZE `gpu-stream` "scale"); 108 SMs (NVIDIA, *Matrix
///   Multiplication Background User's Guide*).
/// - H100: bf16 GEMM 792.1 of 989 Tflop/s (Bekman, H100 SXM); streamed 1704 of 2000 GB/s
///   (RRZE `gpu-stream` "scale", measured on the PCIe H100, taken for the SXM one); 132 SMs
///   (NVIDIA H100 white paper). H200: the same GH100 die, H100's shares (no H200
///   measurement was found).
/// - No published fp32 (non-tensor-core) GEMM share was found for A100, H100 or H200.
pub const DEVICES: [DevicePreset; 5] = [
    DevicePreset { name: "V100-16GB", memory: 16 * GIB, fp32_flops: 15.7e12, half_flops: 125e12, bf16: false, mem_bw: 900e9, nvlink_bw: 150e9, network: "25gbit", measured: Measured { gemm_half: 83.0 / 125.0, gemm_fp32: Some(14.0 / 15.7), bandwidth: 809.0 / 898.0, sms: 80 } },
    DevicePreset { name: "A100-40GB", memory: 40 * GIB, fp32_flops: 19.5e12, half_flops: 312e12, bf16: true, mem_bw: 1555e9, nvlink_bw: 300e9, network: "8x200gbit", measured: Measured { gemm_half: 267.9 / 312.0, gemm_fp32: None, bandwidth: 1382.0 / 1555.0, sms: 108 } },
    DevicePreset { name: "A100-80GB", memory: 80 * GIB, fp32_flops: 19.5e12, half_flops: 312e12, bf16: true, mem_bw: 2039e9, nvlink_bw: 300e9, network: "8x200gbit", measured: Measured { gemm_half: 267.9 / 312.0, gemm_fp32: None, bandwidth: 1737.0 / 2039.0, sms: 108 } },
    DevicePreset { name: "H100", memory: 80 * GIB, fp32_flops: 67e12, half_flops: 989e12, bf16: true, mem_bw: 3350e9, nvlink_bw: 450e9, network: "8x400gbit", measured: Measured { gemm_half: 792.1 / 989.0, gemm_fp32: None, bandwidth: 1704.0 / 2000.0, sms: 132 } },
    DevicePreset { name: "H200", memory: 141_000_000_000, fp32_flops: 67e12, half_flops: 989e12, bf16: true, mem_bw: 4800e9, nvlink_bw: 450e9, network: "8x400gbit", measured: Measured { gemm_half: 792.1 / 989.0, gemm_fp32: None, bandwidth: 1704.0 / 2000.0, sms: 132 } },
];

impl DevicePreset {
    /// What it achieves per kernel computing in `precision`.
    pub fn achievable(&self, precision: Precision) -> Achievable {
        let m = self.measured;
        let gemm = if precision.is_mixed() { m.gemm_half } else { m.gemm_fp32.unwrap_or(1.0) };
        Achievable { gemm, bandwidth: m.bandwidth, launch_s: LAUNCH_S, sms: m.sms, bytes_scale: precision.activation_share() }
    }
}

/// A server's network to the other servers.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct NetworkPreset {
    pub name: &'static str,
    /// Network links per server.
    pub links: u32,
    /// Bytes/s of one link.
    pub link_bw: f64,
    /// Seconds per message (an assumption, see docs/simulator.md).
    pub latency_s: f64,
}

/// The network presets (sources: docs/simulator.md).
pub const NETWORKS: [NetworkPreset; 4] = [
    NetworkPreset { name: "25gbit", links: 1, link_bw: 25e9 / 8.0, latency_s: 20e-6 },
    NetworkPreset { name: "100gbit", links: 1, link_bw: 100e9 / 8.0, latency_s: 20e-6 },
    NetworkPreset { name: "8x200gbit", links: 8, link_bw: 200e9 / 8.0, latency_s: 5e-6 },
    NetworkPreset { name: "8x400gbit", links: 8, link_bw: 400e9 / 8.0, latency_s: 5e-6 },
];

/// Per message inside a server (NVLink), an assumption like the network latencies.
pub const NVLINK_LATENCY_S: f64 = Latencies::ASSUMED.intra_s;

/// A preset or key could not be used.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum PresetError {
    #[error("unknown device preset {0:?}: expected one of V100-16GB, A100-40GB, A100-80GB, H100, H200 (or a cluster TOML file)")]
    UnknownDevice(String),
    #[error("unknown network preset {0:?}: expected one of 25gbit, 100gbit, 8x200gbit, 8x400gbit")]
    UnknownNetwork(String),
    #[error("{device} has no bf16 tensor cores; simulate it with --precision fp16 or fp32")]
    NoBf16 { device: &'static str },
    #[error("{key}: {why}")]
    Bad { key: &'static str, why: String },
    #[error(transparent)]
    Cluster(#[from] ClusterError),
}

/// A device preset by name (case-insensitive).
pub fn device(name: &str) -> Result<DevicePreset, PresetError> {
    DEVICES.iter().copied().find(|d| d.name.eq_ignore_ascii_case(name)).ok_or_else(|| PresetError::UnknownDevice(name.to_string()))
}

/// A network preset by name (case-insensitive).
pub fn network(name: &str) -> Result<NetworkPreset, PresetError> {
    NETWORKS.iter().copied().find(|n| n.name.eq_ignore_ascii_case(name)).ok_or_else(|| PresetError::UnknownNetwork(name.to_string()))
}

/// What the simulator replays on: the planner's cluster and the latencies and efficiency it
/// does not model.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct SimCluster {
    /// The name it was made from (a preset, or the file).
    pub name: String,
    /// As the planner sees it, efficiency applied.
    pub cluster: Cluster,
    pub intra_latency_s: f64,
    pub inter_latency_s: f64,
    /// Share of the peak flop/s and memory bandwidth achieved (applied in `cluster`): a
    /// flat override, or 1 where the cluster's per-kernel model applies
    /// (`cluster.achievable`).
    pub efficiency: f64,
    /// The stages are threads on one host with this many CPU cores (`host_cores`); `None`:
    /// each stage has its own device.
    pub host_cores: Option<usize>,
}

fn check_efficiency(e: f64) -> Result<f64, PresetError> {
    if e.is_finite() && e > 0.0 && e <= 1.0 {
        Ok(e)
    } else {
        Err(PresetError::Bad { key: "efficiency", why: format!("{e} is not in (0, 1]") })
    }
}

impl SimCluster {
    /// `servers` servers of `per_server` `device`s joined by `net`, computing in
    /// `precision` (fp32 peak, or the tensor cores for bf16/fp16) at `efficiency` of peak.
    pub fn from_preset(device: DevicePreset, net: NetworkPreset, servers: usize, per_server: usize, precision: Precision, efficiency: Option<f64>) -> Result<SimCluster, PresetError> {
        // Without a flat efficiency, each kernel achieves what the device's published
        // measurements say (the model); with one, every kernel that share of the peaks.
        let (efficiency, achievable) = match efficiency {
            Some(e) => (check_efficiency(e)?, None),
            None => (1.0, Some(device.achievable(precision))),
        };
        if servers == 0 || per_server == 0 {
            return Err(PresetError::Bad { key: "servers", why: "need at least one server of at least one GPU".into() });
        }
        if precision == Precision::Bf16 && !device.bf16 {
            return Err(PresetError::NoBf16 { device: device.name });
        }
        let peak = if precision.is_mixed() { device.half_flops } else { device.fp32_flops };
        let cluster = Cluster {
            workers: servers * per_server,
            memory_per_worker: device.memory,
            intra_bw: device.nvlink_bw,
            inter_bw: net.link_bw,
            workers_per_node: per_server,
            peak_flops: peak * efficiency,
            mem_bw: device.mem_bw * efficiency,
            server_bw: Some(net.link_bw * f64::from(net.links)),
            reduction: Reduction::Collective,
            achievable,
        };
        let achieved = match achievable {
            Some(a) => format!("achievable: GEMM {:.2} of peak before tile and wave quantization, memory {:.2} of bandwidth, at least {} µs per kernel", a.gemm, a.bandwidth, a.launch_s * 1e6),
            None => format!("efficiency {efficiency}"),
        };
        Ok(SimCluster {
            name: format!("{servers} x {per_server} {} ({}), {} {precision}, {achieved}", device.name, net.name, if precision.is_mixed() { "tensor cores" } else { "no tensor cores" }),
            cluster,
            intra_latency_s: NVLINK_LATENCY_S,
            inter_latency_s: net.latency_s,
            efficiency,
            host_cores: None,
        })
    }

    /// A cluster TOML file's text (keys in the module docs).
    pub fn from_toml(name: &str, text: &str) -> Result<SimCluster, PresetError> {
        let mut table: toml::Table = text.parse().map_err(|e: toml::de::Error| ClusterError::Toml(e.to_string()))?;
        let inner = match table.get_mut("cluster") {
            Some(toml::Value::Table(t)) => t,
            _ => &mut table,
        };
        let seconds = |key: &'static str, v: toml::Value| -> Result<f64, PresetError> {
            let x = match &v {
                toml::Value::Float(f) => *f,
                toml::Value::Integer(i) => *i as f64,
                toml::Value::String(s) => parse_seconds(s).ok_or_else(|| PresetError::Bad { key, why: format!("cannot parse {s:?} as a time (\"5us\", \"0.1ms\", \"2e-5\")") })?,
                _ => return Err(PresetError::Bad { key, why: "expected a number of seconds or a time such as \"5us\"".into() }),
            };
            if x.is_finite() && x >= 0.0 { Ok(x) } else { Err(PresetError::Bad { key, why: format!("{x} is not a non-negative time") }) }
        };
        let intra = inner.remove("intra_latency").map(|v| seconds("intra_latency", v)).transpose()?;
        let inter = inner.remove("inter_latency").map(|v| seconds("inter_latency", v)).transpose()?;
        let efficiency = match inner.remove("efficiency") {
            Some(toml::Value::Float(f)) => check_efficiency(f)?,
            Some(toml::Value::Integer(i)) => check_efficiency(i as f64)?,
            Some(_) => return Err(PresetError::Bad { key: "efficiency", why: "expected a number in (0, 1]".into() }),
            None => 1.0,
        };
        let host_cores = match inner.remove("host_cores") {
            Some(toml::Value::Integer(n)) if n >= 1 => Some(usize::try_from(n).map_err(|_| PresetError::Bad { key: "host_cores", why: format!("{n} cores is too many") })?),
            Some(toml::Value::Integer(n)) => return Err(PresetError::Bad { key: "host_cores", why: format!("{n} is not a number of cores (at least 1)") }),
            Some(_) => return Err(PresetError::Bad { key: "host_cores", why: "expected a whole number of CPU cores, at least 1".into() }),
            None => None,
        };
        let mut cluster = Cluster::from_toml(&table.to_string())?;
        cluster.peak_flops *= efficiency;
        cluster.mem_bw *= efficiency;
        Ok(SimCluster {
            name: name.to_string(),
            cluster,
            intra_latency_s: intra.unwrap_or(NVLINK_LATENCY_S),
            inter_latency_s: inter.unwrap_or(Latencies::ASSUMED.inter_s),
            efficiency,
            host_cores,
        })
    }

    /// A cluster the planner was given (a plan file's), with the default latencies and one
    /// network link per server.
    pub fn from_cluster(name: &str, cluster: Cluster) -> SimCluster {
        SimCluster { name: name.to_string(), cluster, intra_latency_s: Latencies::ASSUMED.intra_s, inter_latency_s: Latencies::ASSUMED.inter_s, efficiency: 1.0, host_cores: None }
    }

    /// Its per-message latencies.
    pub fn latencies(&self) -> Latencies {
        Latencies { intra_s: self.intra_latency_s, inter_s: self.inter_latency_s }
    }

    /// The links between consecutive stages of a layout, with this cluster's
    /// latencies ([`Cluster::pipeline_links`]).
    pub fn pipeline_links(&self, layout: Layout) -> Vec<Link> {
        self.cluster.pipeline_links(layout, self.latencies())
    }

    /// Each stage's all-reduce among its replicas, with this cluster's latencies
    /// ([`Cluster::allreduce`]: hierarchical when a stage's replicas spread evenly over servers,
    /// else a flat ring), as the planner times it.
    pub fn allreduce(&self, layout: Layout) -> AllReduce {
        self.cluster.allreduce(layout, self.latencies())
    }

    /// The link of the data-parallel all-reduce among `groups` tensor-parallel groups of
    /// `t` GPUs: NVLink when they all share one server, else the network as the `t` rings
    /// crossing each server share it ([`Cluster::tensor_dp_bw`]).
    pub fn tensor_dp_link(&self, t: usize, groups: usize) -> Link {
        if self.cluster.tensor_dp_rings(t, groups) == 0 {
            return Link { bandwidth: self.cluster.intra_bw, latency_s: self.intra_latency_s };
        }
        Link { bandwidth: self.cluster.tensor_dp_bw(t, groups), latency_s: self.inter_latency_s }
    }

    /// The link the `t` GPUs of a tensor-parallel group all-reduce over: NVLink inside
    /// their server; a group of whole servers is a ring crossing each server's network
    /// once ([`Cluster::tensor_group_bw`]).
    pub fn tensor_link(&self, t: usize) -> Link {
        if t <= self.cluster.workers_per_node {
            return Link { bandwidth: self.cluster.intra_bw, latency_s: self.intra_latency_s };
        }
        Link { bandwidth: self.cluster.tensor_group_bw(t), latency_s: self.inter_latency_s }
    }
}

/// `"5us"`, `"0.1ms"`, `"2e-5"`, `"1s"`: seconds.
pub fn parse_seconds(s: &str) -> Option<f64> {
    let s = s.trim();
    // Divisors, so that "5us" is exactly 5e-6.
    let (num, per_second) = if let Some(x) = s.strip_suffix("us").or_else(|| s.strip_suffix("µs")) {
        (x, 1e6)
    } else if let Some(x) = s.strip_suffix("ns") {
        (x, 1e9)
    } else if let Some(x) = s.strip_suffix("ms") {
        (x, 1e3)
    } else if let Some(x) = s.strip_suffix('s') {
        (x, 1.0)
    } else {
        (s, 1.0)
    };
    let v: f64 = num.trim().parse().ok()?;
    (v.is_finite() && v >= 0.0).then_some(v / per_second)
}

#[cfg(test)]
mod tests {
    use super::*;
    use pipewright_core::Placement;

    #[test]
    fn the_papers_cluster_from_presets() {
        let c = SimCluster::from_preset(device("v100-16gb").unwrap(), network("25gbit").unwrap(), 8, 8, Precision::Fp16, Some(1.0)).unwrap();
        assert_eq!(c.cluster.workers, 64);
        assert_eq!(c.cluster.memory_per_worker, 16 << 30);
        assert_eq!(c.cluster.peak_flops, 125e12);
        assert_eq!(c.cluster.inter_bw, 25e9 / 8.0);
        // Stage-major, w = d = 8: each stage's 8 replicas fill one server and all-reduce
        // over NVLink; every boundary sends 8 replicas' activations through the servers'
        // 25 Gbit/s at once.
        assert_eq!(c.allreduce(Layout::new(8, 8)).inter.bandwidth, 150e9);
        assert!(c.pipeline_links(Layout::new(8, 8)).iter().all(|l| l.bandwidth == 25e9 / 8.0 / 8.0 && l.latency_s == c.inter_latency_s));
        // w = 4, d = 16: two stages per server; the odd boundaries cross (4 replicas each).
        let links = c.pipeline_links(Layout::new(16, 4));
        assert_eq!(links.iter().filter(|l| l.bandwidth < 1e10).count(), 7);
        assert_eq!((links[0].bandwidth, links[1].bandwidth), (150e9, 25e9 / 8.0 / 4.0));
        assert_eq!(c.allreduce(Layout::new(16, 4)).inter.bandwidth, 150e9);
        // w = 21 spans three or four servers per stage: server 2 (workers 16..=23) holds
        // the end of stage 0's block (..=20) and the start of stage 1's (21..), so two
        // rings share its network.
        assert_eq!(c.cluster.allreduce_rings(Layout::new(3, 21)), 2);
        assert_eq!(c.allreduce(Layout::new(3, 21)).inter.bandwidth, 25e9 / 8.0 / 2.0);
        // w = 16 fills two servers per stage: hierarchical, a ring in each server over
        // NVLink and each GPU's eighth across the two over the shared 25 Gbit/s.
        let h = c.allreduce(Layout::new(4, 16));
        assert_eq!((h.per_server, h.intra.bandwidth, h.inter.bandwidth, h.inter.latency_s), (8, 150e9, 25e9 / 8.0 / 8.0, 20e-6));
        // Replica-major, w = d = 8: each pipeline fills one server, so every boundary
        // rides NVLink, and each stage's 8 replicas sit one per server: a flat ring whose
        // network each server shares among its 8 stages' rings.
        let replica_major = Layout::new(8, 8).placed(Placement::ReplicaMajor);
        assert!(c.pipeline_links(replica_major).iter().all(|l| l.bandwidth == 150e9 && l.latency_s == c.intra_latency_s));
        let flat = c.allreduce(replica_major);
        assert_eq!((flat.per_server, flat.inter.bandwidth), (1, 25e9 / 8.0 / 8.0));
        // w = 16, d = 4 replica-major: two pipelines per server, so each stage has two
        // replicas in each of 8 servers: hierarchical, 4 stages x 2 rings through each link.
        let two = c.allreduce(Layout::new(4, 16).placed(Placement::ReplicaMajor));
        assert_eq!((two.per_server, two.inter.bandwidth), (2, 25e9 / 8.0 / 8.0));
        // A 2 x 4 job fits in one server: NVLink everywhere.
        assert_eq!(c.allreduce(Layout::new(4, 2)).inter.bandwidth, 150e9);
        assert!(c.pipeline_links(Layout::new(4, 2)).iter().all(|l| l.bandwidth == 150e9));
        assert_eq!(SimCluster::from_preset(device("V100-16GB").unwrap(), network("25gbit").unwrap(), 1, 8, Precision::Fp32, Some(0.5)).unwrap().cluster.peak_flops, 15.7e12 * 0.5);
        // Tensor parallelism, t = 4: 16 groups over 8 servers, four rings (one per shard
        // position) through each server's one link; 2 groups fill one server: NVLink.
        assert_eq!(c.tensor_dp_link(4, 16), Link { bandwidth: 25e9 / 8.0 / 4.0, latency_s: 20e-6 });
        assert_eq!(c.tensor_dp_link(8, 8).bandwidth, 25e9 / 8.0 / 8.0);
        assert_eq!(c.tensor_dp_link(4, 2), Link { bandwidth: 150e9, latency_s: 5e-6 });
        assert_eq!(c.tensor_link(8), Link { bandwidth: 150e9, latency_s: 5e-6 });
        // t = 16 spans two servers: its ring crosses each one's link once, and 8 of the
        // 16 data-parallel rings (one per shard position) run through each server.
        assert_eq!(c.tensor_link(16), Link { bandwidth: 25e9 / 8.0, latency_s: 20e-6 });
        assert_eq!(c.tensor_dp_link(16, 4).bandwidth, 25e9 / 8.0 / 8.0);
    }

    #[test]
    fn bad_presets_and_keys_are_named() {
        assert_eq!(device("K80").unwrap_err(), PresetError::UnknownDevice("K80".into()));
        assert!(network("carrier pigeon").unwrap_err().to_string().contains("expected one of 25gbit"));
        let e = SimCluster::from_preset(device("V100-16GB").unwrap(), network("25gbit").unwrap(), 1, 8, Precision::Bf16, None).unwrap_err();
        assert_eq!(e.to_string(), "V100-16GB has no bf16 tensor cores; simulate it with --precision fp16 or fp32");
        assert!(SimCluster::from_preset(DEVICES[0], NETWORKS[0], 1, 8, Precision::Fp32, Some(1.5)).unwrap_err().to_string().starts_with("efficiency: 1.5"));
        let c = SimCluster::from_toml("c.toml", "workers = 16\nworkers_per_node = 8\ninter_latency = \"50us\"\nserver_bw = \"100Gbit/s\"\nefficiency = 0.5\npeak_flops = \"10T\"\n").unwrap();
        assert_eq!(c.inter_latency_s, 50e-6);
        assert_eq!(c.cluster.server_bw, Some(12.5e9));
        assert_eq!(c.cluster.peak_flops, 5e12);
        let e = SimCluster::from_toml("c.toml", "gpus = 3").unwrap_err();
        assert!(matches!(e, PresetError::Cluster(ClusterError::UnknownKey(_))), "{e}");
        assert_eq!(e.to_string(), "unknown cluster key \"gpus\"");
        assert!(SimCluster::from_toml("c.toml", "intra_latency = \"soon\"").unwrap_err().to_string().starts_with("intra_latency: cannot parse \"soon\""));
        assert_eq!(c.host_cores, None);
        assert_eq!(SimCluster::from_toml("c.toml", "workers = 4\nhost_cores = 2\n").unwrap().host_cores, Some(2));
        assert_eq!(SimCluster::from_toml("c.toml", "host_cores = 0").unwrap_err().to_string(), "host_cores: 0 is not a number of cores (at least 1)");
        assert!(SimCluster::from_toml("c.toml", "host_cores = \"two\"").unwrap_err().to_string().starts_with("host_cores: expected a whole number"));
        assert_eq!(parse_seconds("5us"), Some(5e-6));
        assert_eq!(parse_seconds("0.1ms"), Some(1e-4));
    }
}
