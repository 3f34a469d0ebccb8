//! What a run takes from the machine it runs on, as the cost model, the cluster and the
//! simulator all see it: links and the time of an all-reduce over them ([`Link`],
//! [`AllReduce`]), a CPU host's cores shared by the stages' threads and how those threads
//! crowd it ([`HostCores`], [`Crowding`]), and how much the operations' times vary from
//! one microbatch to the next ([`DurationSpread`]).
//!
//! It sits below them all: the cluster builds links and all-reduces from its description,
//! a profile measures crowding and spread, the cost model hands them on, the planner and
//! the simulator time with them. It imports none of those, so none of them has to import
//! another to share these.

mod host;
mod link;
mod spread;

pub use host::{default_time_slice, Crowding, HostCores};
pub use link::{allreduce_seconds, AllReduce, Link};
pub use spread::{duration_factors, DurationSpread};
