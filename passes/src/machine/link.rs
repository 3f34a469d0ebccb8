//! Links and the time of an all-reduce over them: MPI's or NCCL's rings, or the runtime's
//! fixed-order gather ([`Reduction`]).

use pipewright_core::Reduction;
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
/// cannot disagree with it. With [`Reduction::FixedOrder`] there are no rings: the first
/// replica gathers every part and sends the sum back, its traffic to other servers over
/// `root_inter`.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct AllReduce {
    pub per_server: usize,
    pub intra: Link,
    pub inter: Link,
    /// The link the first replica's own traffic to other servers takes when it alone
    /// crosses its server's network (the fixed order's gather and send-back).
    pub root_inter: Link,
    pub reduction: Reduction,
}

impl AllReduce {
    /// A flat ring over one link.
    pub fn ring(link: Link) -> AllReduce {
        AllReduce { per_server: 1, intra: link, inter: link, root_inter: link, reduction: Reduction::Collective }
    }

    /// The same group summing by `reduction`.
    pub fn with_reduction(self, reduction: Reduction) -> AllReduce {
        AllReduce { reduction, ..self }
    }

    /// Seconds to all-reduce `bytes` of gradient among `w` replicas, by
    /// [`AllReduce::reduction`].
    pub fn seconds(&self, bytes: f64, w: usize) -> f64 {
        match self.reduction {
            Reduction::Collective => self.ring_seconds(bytes, w),
            Reduction::FixedOrder => self.fixed_order_seconds(bytes, w),
        }
    }

    /// The rings: with `g` replicas per server over `k`
    /// servers: reduce-scatter inside the server (`g - 1` steps of `bytes / g` over
    /// `intra`), a ring all-reduce of each shard across the servers (`2 (k - 1)` steps of
    /// `bytes / (g k)` over `inter`), all-gather inside the server (`g - 1` steps of
    /// `bytes / g`). The two intra-server halves together are a ring all-reduce of `bytes`
    /// among `g`, so it is two rings; `g = 1` or `k = 1` is the flat ring.
    fn ring_seconds(&self, bytes: f64, w: usize) -> f64 {
        let g = self.per_server.clamp(1, w.max(1));
        let k = w.max(1) / g;
        allreduce_seconds(bytes, g, self.intra) + allreduce_seconds(bytes / g as f64, k, self.inter)
    }

    /// The fixed order: the first replica receives each other replica's whole part, one
    /// after another, then sends each the sum, so `2 (w - 1)` payloads pass through it (the
    /// `g - 1` of its own server over `intra`, the rest over `root_inter`) whatever the
    /// links elsewhere: its time grows linearly with `w` where the rings' stays near
    /// `2 bytes / bandwidth`.
    fn fixed_order_seconds(&self, bytes: f64, w: usize) -> f64 {
        if w <= 1 || bytes <= 0.0 {
            return 0.0;
        }
        let g = self.per_server.clamp(1, w);
        2.0 * ((g - 1) as f64 * self.intra.seconds(bytes) + (w - g) as f64 * self.root_inter.seconds(bytes))
    }

    /// Its links, for validation.
    pub fn links(&self) -> [Link; 3] {
        [self.intra, self.inter, self.root_inter]
    }
}
