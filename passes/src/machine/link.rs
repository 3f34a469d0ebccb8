//! Links and the time of a ring all-reduce over them.

use serde::Serialize;

/// A link: bytes/s and seconds per message.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Link {
    pub bandwidth: f64,
    pub latency_s: f64,
}

impl Link {
    /// Seconds to move `bytes` over this link.
    pub fn seconds(&self, bytes: f64) -> f64 {
        if bytes <= 0.0 {
            return 0.0;
        }
        self.latency_s + bytes / self.bandwidth
    }
}

/// Ring all-reduce of `bytes` among `w` replicas over `link`: `2 (w - 1)` steps, each
/// moving `bytes / w` and paying the latency. The building block of [`AllReduce::seconds`].
pub fn allreduce_seconds(bytes: f64, w: usize, link: Link) -> f64 {
    if w <= 1 || bytes <= 0.0 {
        return 0.0;
    }
    let steps = 2.0 * (w as f64 - 1.0);
    steps * (link.latency_s + bytes / w as f64 / link.bandwidth)
}

/// How the `w` replicas of a stage all-reduce their gradients (the cluster describes them,
/// `Cluster::allreduce`): `per_server` replicas in each server reduce among themselves
/// over `intra`, and each one's `1 / per_server` shard is reduced across the `w / per_server` servers over
/// `inter`. `per_server >= w`: one ring inside a server; `per_server == 1`: one flat ring
/// over `inter`. The width is the caller's (the replay's `SimSetup::w`), so a description
/// cannot disagree with it.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct AllReduce {
    pub per_server: usize,
    pub intra: Link,
    pub inter: Link,
}

impl AllReduce {
    /// A flat ring over one link.
    pub fn ring(link: Link) -> AllReduce {
        AllReduce { per_server: 1, intra: link, inter: link }
    }

    /// Seconds to all-reduce `bytes` of gradient among `w` replicas. With `g` replicas per
    /// server over `k`
    /// servers: reduce-scatter inside the server (`g - 1` steps of `bytes / g` over
    /// `intra`), a ring all-reduce of each shard across the servers (`2 (k - 1)` steps of
    /// `bytes / (g k)` over `inter`), all-gather inside the server (`g - 1` steps of
    /// `bytes / g`). The two intra-server halves together are a ring all-reduce of `bytes`
    /// among `g`, so it is two rings; `g = 1` or `k = 1` is the flat ring.
    pub fn seconds(&self, bytes: f64, w: usize) -> f64 {
        let g = self.per_server.clamp(1, w.max(1));
        let k = w.max(1) / g;
        allreduce_seconds(bytes, g, self.intra) + allreduce_seconds(bytes / g as f64, k, self.inter)
    }

    /// Its links, for validation.
    pub fn links(&self) -> [Link; 2] {
        [self.intra, self.inter]
    }
}
