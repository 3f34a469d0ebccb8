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
//! reduction = "collective"  # how gradient sums are taken: "collective" (rings) or
//!                           # "fixed-order" (the MPI runtime's --deterministic-reduce)
//! ```
//! Without `server_bw`, every all-reduce ring and every stage-to-stage transfer that leaves a
//! server has `inter_bw` to itself; with it, those that cross one server's network at the
//! same time share it ([`Cluster::allreduce_bw`], [`Cluster::boundary_bw`]).
//!
//! # Placement
//! Workers are numbered as the MPI ranks are, by the layout's [`Placement`]: stage-major
//! (worker `stage * w + replica`, the `w` replicas of a stage on consecutive workers) or
//! replica-major (worker `replica * d + stage`, each pipeline on consecutive workers); servers
//! hold consecutive workers (`workers_per_node` each). A stage's all-reduce stays in a
//! server when all its replicas do; a boundary `s -> s+1` stays in a server only when both
//! stages sit in the same server for every replica. Stage-major keeps the gradient sums in
//! a server when `w` divides the server size; replica-major keeps the boundaries in one when
//! `d` does.
//!
//! [`Placement`]: pipewright_core::Placement
//! The keys may also sit in a `[cluster]` table. Unknown keys are errors.
//!
//! Sizes: `B`, `KB`/`MB`/`GB`/`TB` (powers of 1000), `KiB`/`MiB`/`GiB`/`TiB` (powers of
//! 1024). Bandwidths: a size followed by `/s` (bytes), or `bit/s`, `Kbit/s`, `Mbit/s`,
//! `Gbit/s`, `Tbit/s` (`bps` and `Gbps` forms accepted), converted to bytes/s.

// `%`: the workspace's MSRV is 1.80.
#![allow(clippy::manual_is_multiple_of)]

use std::collections::{BTreeMap, HashMap};

use pipewright_core::{Layout, Reduction};
use pipewright_core::units::{human_bytes, parse_bandwidth, parse_bytes, parse_flops, UnitError};
use serde::{Deserialize, Serialize};

use crate::cost::{Achievable, Roofline};
use crate::machine::{AllReduce, Link};

/// Seconds per message on a server's NVLink and on the network between servers. The
/// planner's closed form has none ([`Latencies::NONE`]); its replays and `simulate` on a
/// plan's own cluster assume [`Latencies::ASSUMED`]; presets bring their own.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Latencies {
    pub intra_s: f64,
    pub inter_s: f64,
}

impl Latencies {
    pub const NONE: Latencies = Latencies { intra_s: 0.0, inter_s: 0.0 };
    /// 5 µs per NVLink message, 20 µs per network message: order-of-magnitude assumptions
    /// (docs/simulator.md), not measurements.
    pub const ASSUMED: Latencies = Latencies { intra_s: 5e-6, inter_s: 20e-6 };
}

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
    /// How the replicas' gradient sums are taken ([`Cluster::allreduce`]): MPI's or
    /// NCCL's rings (the default), or the runtime's fixed-order gather.
    #[serde(default, skip_serializing_if = "is_collective")]
    pub reduction: Reduction,
    /// What a worker achieves of `peak_flops` and `mem_bw` per kind of kernel (a GPU
    /// preset's published measurements); `None`: the peaks themselves.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub achievable: Option<Achievable>,
}

fn is_collective(r: &Reduction) -> bool {
    *r == Reduction::Collective
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
            reduction: Reduction::Collective,
            achievable: None,
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
    #[error(transparent)]
    Unit(#[from] UnitError),
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
                |parse: fn(&str) -> Result<f64, UnitError>| -> Result<f64, ClusterError> {
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
                "reduction" => c.reduction = value.as_str().ok_or_else(|| bad("expected \"collective\" or \"fixed-order\""))?.parse().map_err(|e: pipewright_core::UnknownWord| bad(&e.to_string()))?,
                _ => return Err(ClusterError::UnknownKey(key.clone())),
            }
        }
        Ok(c)
    }

    /// One line for people: `8 workers (8 per server), 16.0 GiB, 15.7 Tflop/s each`.
    pub fn summary(&self) -> String {
        let memory = if self.memory_per_worker == u64::MAX { "no memory limit".to_string() } else { human_bytes(self.memory_per_worker) };
        let achieved = self.achievable.map_or(String::new(), |a| format!(" (matrix products {:.2} of it before tile and wave quantization, memory {:.2} of its bandwidth)", a.gemm, a.bandwidth));
        format!("{} workers ({} per server), {memory}, {:.1} Tflop/s each{achieved}", self.workers, self.workers_per_node, self.peak_flops / 1e12)
    }

    /// The roofline description of one worker.
    pub fn roofline(&self) -> Roofline {
        Roofline {
            name: "cluster worker".into(),
            peak_flops: self.peak_flops,
            mem_bw: self.mem_bw,
            achievable: self.achievable,
        }
    }

    /// The server holding `worker` (servers hold consecutive workers).
    pub fn server_of(&self, worker: usize) -> usize {
        worker / self.workers_per_node.max(1)
    }

    /// How many of stage `stage`'s replicas each server holds, by server, under the
    /// layout's placement ([`Layout::rank`]).
    fn replicas_by_server(&self, layout: Layout, stage: usize) -> BTreeMap<usize, usize> {
        let mut by_server = BTreeMap::new();
        for r in 0..layout.replicas.max(1) {
            *by_server.entry(self.server_of(layout.rank(r, stage))).or_insert(0) += 1;
        }
        by_server
    }

    /// How many transfers of boundary `s -> s+1` (one per replica, all at about the same
    /// time since the replicas run in step) cross one server's network at most, counting
    /// what leaves and what enters each server; 0 when every replica's pair of workers
    /// shares a server.
    pub fn boundary_flows(&self, layout: Layout, s: usize) -> usize {
        self.flows_between(layout, s, s + 1)
    }

    /// [`Cluster::boundary_flows`] of a transfer from each replica's worker `from` to its
    /// worker `to` (consecutive ones, or, under interleaved 1F1B, the last and the first).
    fn flows_between(&self, layout: Layout, from: usize, to: usize) -> usize {
        let mut through: HashMap<usize, usize> = HashMap::new();
        for r in 0..layout.replicas.max(1) {
            let (a, b) = (self.server_of(layout.rank(r, from)), self.server_of(layout.rank(r, to)));
            if a != b {
                *through.entry(a).or_insert(0) += 1;
                *through.entry(b).or_insert(0) += 1;
            }
        }
        through.into_values().max().unwrap_or(0)
    }

    /// Bandwidth of boundary `s -> s+1`: `intra_bw` when it stays in servers; otherwise
    /// `inter_bw`, or, with `server_bw`, its share for each transfer crossing the busiest
    /// server's network ([`Cluster::boundary_flows`]).
    pub fn boundary_bw(&self, layout: Layout, s: usize) -> f64 {
        match self.boundary_flows(layout, s) {
            0 => self.intra_bw,
            n => self.network_share(n),
        }
    }

    /// Bandwidth between consecutive stages, one number for the partitioner (which costs
    /// every cut alike): per stage, the harmonic mean of the bandwidths of its one or two
    /// boundaries (what it spends on them, if their cuts carry alike), and of those the
    /// slowest stage's, since the slowest stage sets the pace. So a stage with one cut
    /// inside a server and one across counts about twice the network's rate, where the
    /// slowest boundary's rate alone would charge it twice its real network time. `intra_bw`
    /// when every boundary stays in a server.
    pub fn pipeline_bw(&self, layout: Layout) -> f64 {
        let d = layout.depth;
        let bw: Vec<f64> = (0..d.saturating_sub(1)).map(|s| self.boundary_bw(layout, s)).collect();
        (0..d)
            .map(|s| {
                let cuts: Vec<f64> = [s.checked_sub(1), (s + 1 < d).then_some(s)].into_iter().flatten().map(|b| bw[b]).collect();
                if cuts.is_empty() { self.intra_bw } else { cuts.len() as f64 / cuts.iter().map(|b| 1.0 / b).sum::<f64>() }
            })
            .fold(self.intra_bw, f64::min)
    }

    /// How many all-reduce groups (one per stage whose replicas span servers) cross the
    /// busiest server's network: 0 when every stage's replicas share one server.
    pub fn allreduce_rings(&self, layout: Layout) -> usize {
        let mut through: HashMap<usize, usize> = HashMap::new();
        for s in 0..layout.depth {
            let servers = self.replicas_by_server(layout, s);
            if servers.len() > 1 {
                for server in servers.into_keys() {
                    *through.entry(server).or_insert(0) += 1;
                }
            }
        }
        through.into_values().max().unwrap_or(0)
    }

    /// The all-reduce among the replicas of each stage of a layout, with the per-message
    /// `latencies` of its links (the planner's closed form passes [`Latencies::NONE`], the
    /// replays their cluster's): the one description of it that the planner and the
    /// simulator both time with [`AllReduce::seconds`].
    ///
    /// When every stage's replicas spread evenly, `p > 1` in each of `k > 1` servers (with
    /// stage-major placement: `w` a multiple of the server size, `p` the server size; with
    /// replica-major: `p` pipelines per server), it is hierarchical, as NCCL runs it on
    /// multi-GPU servers: a ring among the `p` replicas of each server over NVLink, and one
    /// ring per GPU across the `k` servers over the network for that GPU's `1/p` shard, the
    /// server's network shared by every such ring through it (those of every stage,
    /// [`Cluster::allreduce_rings`]). Otherwise it is the flat ring: over NVLink when each
    /// stage's replicas sit in one server, over the network at [`Cluster::allreduce_bw`]
    /// when they straddle servers unevenly (then no GPU count per server is common to the
    /// group, and NCCL's tree/ring choice is not modelled). With [`Reduction::FixedOrder`]
    /// the same links carry the first replica's gather ([`AllReduce::seconds`]).
    pub fn allreduce(&self, layout: Layout, latencies: Latencies) -> AllReduce {
        self.allreduce_links(layout, latencies).with_reduction(self.reduction)
    }

    fn allreduce_links(&self, layout: Layout, latencies: Latencies) -> AllReduce {
        let intra = Link { bandwidth: self.intra_bw, latency_s: latencies.intra_s };
        // The replicas every stage has in each server it uses, when that is one count.
        let counts: Vec<usize> = (0..layout.depth).flat_map(|s| self.replicas_by_server(layout, s).into_values()).collect();
        let per_server = counts.first().copied().filter(|&p| counts.iter().all(|&c| c == p));
        let rings = self.allreduce_rings(layout);
        match (rings, per_server) {
            (0, _) => AllReduce { per_server: layout.replicas.max(1), intra, inter: intra, root_inter: intra, reduction: Reduction::Collective },
            (rings, Some(p)) if p > 1 => {
                // Each of the p replicas a server holds of a stage runs its own ring across
                // the servers; every stage's rings go through the server's network at once.
                // A gather's root crosses it alone (beside the other stages' groups).
                let network = |shares: usize| Link { bandwidth: self.network_share(shares), latency_s: latencies.inter_s };
                AllReduce { per_server: p, intra, inter: network(rings * p), root_inter: network(rings), reduction: Reduction::Collective }
            }
            _ => {
                let inter = Link { bandwidth: self.allreduce_bw(layout), latency_s: latencies.inter_s };
                AllReduce { per_server: 1, intra, inter, root_inter: inter, reduction: Reduction::Collective }
            }
        }
    }

    /// The links between consecutive stages of a layout (by its placement,
    /// [`Layout::rank`]): link `s` is NVLink when every replica's stages `s` and `s + 1`
    /// share a server, else a network link at [`Cluster::boundary_bw`] (the replicas
    /// crossing one server's network share it, when `server_bw` is known), since the
    /// replicas wait for each other at every update.
    pub fn pipeline_links(&self, layout: Layout, latencies: Latencies) -> Vec<Link> {
        let workers: Vec<usize> = (0..layout.depth).collect();
        self.stage_links(layout, &workers, latencies)
    }

    /// The link under each boundary of stages on `layout`'s workers, stage `k` on worker
    /// `worker_of[k]` (several stages per worker under interleaved 1F1B and ZB-V,
    /// `Schedule::worker_of`; one each, `0..depth`, gives [`Cluster::pipeline_links`]). Two
    /// stages on one worker pass their tensors in its memory: a link of no time.
    pub fn stage_links(&self, layout: Layout, worker_of: &[usize], latencies: Latencies) -> Vec<Link> {
        worker_of
            .windows(2)
            .map(|pair| {
                let (from, to) = (pair[0], pair[1]);
                match self.flows_between(layout, from, to) {
                    _ if from == to => Link { bandwidth: f64::INFINITY, latency_s: 0.0 },
                    0 => Link { bandwidth: self.intra_bw, latency_s: latencies.intra_s },
                    n => Link { bandwidth: self.network_share(n), latency_s: latencies.inter_s },
                }
            })
            .collect()
    }

    /// Bandwidth of the all-reduce among the replicas of a stage: intra-server when each
    /// stage's replicas sit in one server; otherwise `inter_bw`,
    /// or, when the servers' network is described (`server_bw`), its share for each ring
    /// crossing the busiest server ([`Cluster::allreduce_rings`]; the stages all-reduce at
    /// about the same time).
    pub fn allreduce_bw(&self, layout: Layout) -> f64 {
        match self.allreduce_rings(layout) {
            0 => self.intra_bw,
            n => self.network_share(n),
        }
    }

    /// What each of `flows` transfers crossing one server's network at once gets:
    /// `inter_bw`, or its share of `server_bw` when that is known and smaller.
    fn network_share(&self, flows: usize) -> f64 {
        self.server_bw.map_or(self.inter_bw, |s| self.inter_bw.min(s / flows.max(1) as f64))
    }

    /// How many data-parallel rings of Megatron-style tensor parallelism cross the busiest
    /// server's network: `groups` groups of `t` GPUs on consecutive workers (group `g` on
    /// workers `g t .. (g + 1) t`: inside one server when `t` divides the server size,
    /// whole servers when it is a multiple of it), and one ring per shard position `j`
    /// through workers `j, t + j, 2t + j, ...`. 0 when all the groups share one server
    /// (the rings stay on NVLink); otherwise every ring through a server crosses its
    /// network: `t` of them, or the server's GPUs when a group spans servers.
    pub fn tensor_dp_rings(&self, t: usize, groups: usize) -> usize {
        let last = (t * groups).max(1) - 1;
        if self.server_of(0) == self.server_of(last) { 0 } else { t.min(self.workers_per_node.max(1)) }
    }

    /// Bandwidth of the ring a tensor-parallel group of `t` GPUs larger than a server
    /// all-reduces over: it runs through whole servers, entering and leaving each once, so
    /// each server's network carries one ring's traffic each way (Megatron's rings are per
    /// group, and a server holds GPUs of one group only).
    pub fn tensor_group_bw(&self, t: usize) -> f64 {
        if t <= self.workers_per_node { self.intra_bw } else { self.network_share(1) }
    }

    /// Bandwidth of the data-parallel all-reduce among `groups` tensor-parallel groups of
    /// `t` GPUs ([`Cluster::tensor_dp_rings`]), as [`Cluster::allreduce_bw`] shares it.
    pub fn tensor_dp_bw(&self, t: usize, groups: usize) -> f64 {
        match self.tensor_dp_rings(t, groups) {
            0 => self.intra_bw,
            n => self.network_share(n),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::machine::allreduce_seconds;

    /// `w` replicas of a `d`-stage pipeline, stage-major.
    fn sm(w: usize, d: usize) -> Layout {
        Layout::new(d, w)
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
        // Stage-major: 4 replicas of each of 4 stages fill one server of 4 each, so every
        // all-reduce stays in its server and every boundary crosses.
        assert_eq!(c.allreduce_bw(sm(4, 4)), c.intra_bw);
        assert_eq!(c.pipeline_bw(sm(4, 4)), 12.5e9);
        // Eight replicas span two servers: the ring leaves them.
        assert_eq!(c.allreduce_bw(sm(8, 2)), 12.5e9);
        let t = Cluster::from_toml("[cluster]\nworkers = 2\n").unwrap();
        assert_eq!(t.workers, 2);
    }

    /// The placement model follows the stage-major numbering (worker `s * w + r`).
    #[test]
    fn placement_is_stage_major() {
        let shared = Cluster::from_toml("workers = 16\nworkers_per_node = 4\nintra_bw = \"100GB/s\"\ninter_bw = \"100Gbit/s\"\nserver_bw = \"100Gbit/s\"\n").unwrap();
        assert_eq!((sm(4, 2).rank(1, 0), sm(4, 2).rank(0, 1), sm(2, 4).rank(1, 3)), (1, 4, 7));
        // All 16 workers in blocks of 4: each stage's replicas share a server.
        assert_eq!(shared.allreduce_rings(sm(4, 4)), 0);
        assert_eq!(shared.allreduce_bw(sm(4, 4)), 100e9);
        // ... and each boundary sends the 4 replicas' activations through both servers'
        // networks at once: a quarter of the server's 100 Gbit/s each, at every cut of
        // every stage.
        assert_eq!(shared.boundary_flows(sm(4, 4), 0), 4);
        assert_eq!(shared.boundary_bw(sm(4, 4), 0), 12.5e9 / 4.0);
        assert_eq!(shared.pipeline_bw(sm(4, 4)), 12.5e9 / 4.0);
        // One stage of 16 replicas: its ring crosses every server, alone.
        assert_eq!(shared.allreduce_bw(sm(16, 1)), 12.5e9);
        assert_eq!(shared.pipeline_bw(sm(16, 1)), 100e9);
        // 2 x 2 fits in one server: everything on the intra-server link.
        assert_eq!((shared.allreduce_bw(sm(2, 2)), shared.pipeline_bw(sm(2, 2))), (100e9, 100e9));
        // w = 2 divides 4: stages (0, 1) share server 0, so boundary 0 stays inside and
        // boundary 1 crosses with both replicas.
        assert_eq!((shared.boundary_flows(sm(2, 8), 0), shared.boundary_flows(sm(2, 8), 1), shared.boundary_flows(sm(2, 8), 2)), (0, 2, 0));
        assert_eq!(shared.allreduce_bw(sm(2, 8)), 100e9);
        // Stage 1 has one cut in its server and one across: the harmonic mean of the two.
        let slow = 12.5e9 / 2.0;
        assert_eq!(shared.pipeline_bw(sm(2, 8)), 2.0 / (1.0 / 100e9 + 1.0 / slow));
        // Two stages whose only boundary crosses: the network's rate.
        assert_eq!(shared.pipeline_bw(sm(4, 2)), 12.5e9 / 4.0);
        // w = 3 does not divide 4: stage 1's block (workers 3..=5) straddles servers 0 and
        // 1, and stage 2's (6..=8) servers 1 and 2: two rings through server 1.
        assert_eq!(shared.allreduce_rings(sm(3, 4)), 2);
        assert_eq!(shared.allreduce_bw(sm(3, 4)), 12.5e9 / 2.0);
        // Without server_bw each crossing has inter_bw to itself.
        let own = Cluster { server_bw: None, ..shared.clone() };
        assert_eq!((own.allreduce_bw(sm(3, 4)), own.pipeline_bw(sm(4, 4))), (12.5e9, 12.5e9));
    }

    /// Hand-computed all-reduce times of 1 GB: the paper's servers (8 GPUs, 150 GB/s NVLink,
    /// one 25 Gbit/s = 3.125 GB/s link each).
    #[test]
    fn hierarchical_allreduce_by_hand() {
        let paper = Cluster { workers: 16, server_bw: Some(3.125e9), inter_bw: 3.125e9, ..Cluster::default() };
        let close = |a: f64, b: f64| (a - b).abs() <= 1e-12 * b.max(1.0);
        // w = 16 over 2 servers of 8. A flat ring over the network: 2 * 15 steps of 1/16 GB
        // at 3.125 GB/s = 0.6 s.
        let flat = AllReduce::ring(Link { bandwidth: paper.allreduce_bw(sm(16, 1)), latency_s: 0.0 });
        assert!(close(flat.seconds(1e9, 16), 0.6), "{}", flat.seconds(1e9, 16));
        // Hierarchical: inside each server 2 * 7 steps of 1/8 GB at 150 GB/s (0.011667 s),
        // then each GPU's 1/8 GB shard over the 2 servers, 2 * 1 steps of 1/16 GB, the 8
        // shards' rings sharing the server's 3.125 GB/s (0.32 s): 0.3317 s, about half.
        let h = paper.allreduce(sm(16, 1), Latencies::NONE);
        assert_eq!((h.per_server, h.inter.bandwidth), (8, 3.125e9 / 8.0));
        assert!(close(h.seconds(1e9, 16), 14.0 / 8.0 / 150.0 + 0.32), "{}", h.seconds(1e9, 16));
        assert!(h.seconds(1e9, 16) < flat.seconds(1e9, 16));
        // Each message pays its link's latency: 14 NVLink steps and 2 network steps.
        let lat = Latencies { intra_s: 1e-3, inter_s: 1e-2 };
        assert!(close(paper.allreduce(sm(16, 1), lat).seconds(1e9, 16), h.seconds(1e9, 16) + 14e-3 + 2e-2));
        // 4 servers (w = 32): 2 * 3 network steps of 1/32 GB at 3.125/8 GB/s = 0.48 s.
        let four = Cluster { workers: 32, ..paper.clone() };
        assert!(close(four.allreduce(sm(32, 1), Latencies::NONE).seconds(1e9, 32), 14.0 / 8.0 / 150.0 + 0.48));
        // k = 1: 8 replicas in one server, the flat ring over NVLink, 2 * 7 / 8 GB at 150 GB/s.
        let inside = paper.allreduce(sm(8, 2), Latencies::NONE);
        assert!(close(inside.seconds(1e9, 8), 14.0 / 8.0 / 150.0));
        assert_eq!(inside.seconds(1e9, 8), allreduce_seconds(1e9, 8, Link { bandwidth: 150e9, latency_s: 0.0 }));
        // g = 1: one GPU per server, the flat ring over the network, 2 * 3 / 4 GB at 3.125.
        let single = Cluster { workers: 4, workers_per_node: 1, ..paper.clone() };
        let one = single.allreduce(sm(4, 1), Latencies::NONE);
        assert_eq!(one.per_server, 1);
        assert!(close(one.seconds(1e9, 4), 1.5 / 3.125));
        // Uneven blocks (w = 12 on servers of 8) keep the flat ring over the network, shared
        // by the two rings crossing server 1.
        let uneven = Cluster { workers: 24, ..paper.clone() };
        let u = uneven.allreduce(sm(12, 2), Latencies::NONE);
        assert_eq!((u.per_server, u.inter.bandwidth), (1, 3.125e9 / 2.0));
        assert!(close(u.seconds(1e9, 12), 2.0 * 11.0 / 12.0 / 1.5625));
        // Without server_bw each GPU's ring has inter_bw to itself.
        let own = Cluster { server_bw: None, ..paper.clone() };
        assert!(close(own.allreduce(sm(16, 1), Latencies::NONE).seconds(1e9, 16), 14.0 / 8.0 / 150.0 + 0.04));
        // No replicas to reduce with: nothing to do.
        assert_eq!(paper.allreduce(sm(1, 8), Latencies::ASSUMED).seconds(1e9, 1), 0.0);
    }

    /// The runtime's fixed order (`--deterministic-reduce`) by hand: the first replica
    /// receives every other part and sends each the sum, so its time grows with `w`.
    #[test]
    fn the_fixed_order_passes_every_part_through_the_first_replica() {
        let close = |a: f64, b: f64| (a - b).abs() <= 1e-12 * b.max(1.0);
        let paper = Cluster { workers: 64, server_bw: Some(3.125e9), inter_bw: 3.125e9, ..Cluster::default() };
        let fixed = Cluster { reduction: Reduction::FixedOrder, ..paper.clone() };
        // w = 64 over 8 servers: 7 parts in its server over NVLink, 56 over its server's
        // whole 3.125 GB/s link (it crosses it alone), in and out: 35.9 s for 1 GB.
        let f = fixed.allreduce(sm(64, 1), Latencies::NONE);
        assert_eq!((f.reduction, f.root_inter.bandwidth), (Reduction::FixedOrder, 3.125e9));
        assert!(close(f.seconds(1e9, 64), 2.0 * (7.0 / 150.0 + 56.0 / 3.125)), "{}", f.seconds(1e9, 64));
        // The rings: 2 * 7 / 8 GB over NVLink, then 2 * 7 / 64 GB per GPU's shard ring at
        // 3.125 / 8 GB/s: 0.573 s, 63x less.
        let ring = paper.allreduce(sm(64, 1), Latencies::NONE);
        assert!(close(ring.seconds(1e9, 64), 14.0 / 8.0 / 150.0 + 14.0 / 64.0 / (3.125 / 8.0)));
        assert!(f.seconds(1e9, 64) > 60.0 * ring.seconds(1e9, 64));
        // Inside one server only NVLink: 2 * 7 whole payloads against the ring's 2 * 7 / 8.
        assert!(close(fixed.allreduce(sm(8, 8), Latencies::NONE).seconds(1e9, 8), 14.0 / 150.0));
        // Each part pays its link's latency: 2 * 7 NVLink and 2 * 56 network messages.
        let lat = Latencies { intra_s: 1e-3, inter_s: 1e-2 };
        assert!(close(fixed.allreduce(sm(64, 1), lat).seconds(1e9, 64), f.seconds(1e9, 64) + 14e-3 + 112e-2));
        // Two stages of 32 replicas each fill servers of their own: the root still has its
        // server's whole link; an uneven block (w = 12) shares the ring's network rate.
        assert_eq!(fixed.allreduce(sm(32, 2), Latencies::NONE).root_inter.bandwidth, 3.125e9);
        assert_eq!(fixed.allreduce(sm(12, 2), Latencies::NONE).root_inter, fixed.allreduce(sm(12, 2), Latencies::NONE).inter);
        // One replica: nothing to sum.
        assert_eq!(fixed.allreduce(sm(1, 64), Latencies::NONE).seconds(1e9, 1), 0.0);
        // A cluster file says it; anything else is refused naming the choices.
        assert_eq!(Cluster::from_toml("reduction = \"fixed-order\"").unwrap().reduction, Reduction::FixedOrder);
        let e = Cluster::from_toml("reduction = \"tree\"").unwrap_err().to_string();
        assert!(e.starts_with("cluster key \"reduction\": unknown gradient sum \"tree\""), "{e}");
        assert!(e.contains("fixed-order"), "{e}");
    }

    #[test]
    fn bad_keys_are_errors() {
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
