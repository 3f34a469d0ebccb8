//! `pipewright bench-allreduce`: the time of one gradient sum over every rank of an MPI
//! job, by the fixed order ([`Reduction::FixedOrder`]) and by MPI's all-reduce
//! ([`Reduction::Collective`]), for payloads of several sizes, and how far the two sums
//! lie apart. Every rank runs it (`mpirun -np W pipewright bench-allreduce ...`); rank 0
//! returns the rows.

use std::time::{Duration, Instant};

use pipewright_runtime::pipeline::{Layout, MpiJob, Reduction, Transport};
use tch::{Kind, Tensor};

use crate::DriverError;

/// One payload's timings on rank 0 (median of the repeats, after one untimed sum).
#[derive(Clone, Debug)]
pub struct SumTiming {
    pub bytes: u64,
    pub fixed_order_ms: f64,
    pub collective_ms: f64,
    /// The largest difference between the two sums, relative to the sum's largest value.
    pub rel_gap: f64,
}

/// The payload of each rank is split into this many tensors, as a stage's gradients are.
const PARTS: i64 = 4;

/// Times sums of `sizes` bytes of f32 over every rank of `job` (each rank's payload is
/// seeded by its rank), `repeat` times each, both ways; no wait lasts longer than
/// `timeout`. `Some` on rank 0.
pub fn bench_allreduce(job: &MpiJob, sizes: &[u64], repeat: usize, timeout: Duration) -> Result<Option<Vec<SumTiming>>, DriverError> {
    let layout = Layout::new(1, job.size());
    let mut fixed = job.transport(layout, timeout).map_err(DriverError::msg)?.with_reduction(Reduction::FixedOrder);
    let mut collective = job.transport(layout, timeout).map_err(DriverError::msg)?.with_reduction(Reduction::Collective);
    tch::manual_seed(job.rank() as i64 + 1);
    let mut rows = Vec::new();
    for &bytes in sizes {
        let per_part = (bytes / 4 / PARTS as u64).max(1) as i64;
        let payload: Vec<Tensor> = (0..PARTS).map(|_| Tensor::randn([per_part], (Kind::Float, tch::Device::Cpu))).collect();
        let (fixed_ms, a) = time_sums(&mut fixed, &payload, repeat)?;
        let (collective_ms, b) = time_sums(&mut collective, &payload, repeat)?;
        rows.push(SumTiming { bytes, fixed_order_ms: fixed_ms, collective_ms, rel_gap: rel_gap(&a, &b)? });
    }
    Ok((job.rank() == 0).then_some(rows))
}

/// The median milliseconds of `repeat` sums of `payload` over `link` (after one untimed
/// one), and the last sum.
fn time_sums(link: &mut dyn Transport, payload: &[Tensor], repeat: usize) -> Result<(f64, Vec<Tensor>), DriverError> {
    let copy = || payload.iter().map(|t| t.copy()).collect::<Vec<_>>();
    let mut sum = link.all_reduce_replicas(copy()).map_err(DriverError::msg)?;
    let mut times = Vec::with_capacity(repeat);
    for _ in 0..repeat.max(1) {
        let t0 = Instant::now();
        sum = link.all_reduce_replicas(copy()).map_err(DriverError::msg)?;
        times.push(t0.elapsed().as_secs_f64() * 1e3);
    }
    times.sort_by(f64::total_cmp);
    Ok((times[times.len() / 2], sum))
}

fn rel_gap(a: &[Tensor], b: &[Tensor]) -> Result<f64, DriverError> {
    let torch = |e: tch::TchError| DriverError::msg(format!("comparing the sums: {e}"));
    let (mut gap, mut scale) = (0f64, 0f64);
    for (x, y) in a.iter().zip(b) {
        gap = gap.max(x.f_sub(y).and_then(|d| d.f_abs()).and_then(|d| d.f_max()).and_then(|m| m.f_double_value(&[])).map_err(torch)?);
        scale = scale.max(x.f_abs().and_then(|d| d.f_max()).and_then(|m| m.f_double_value(&[])).map_err(torch)?);
    }
    Ok(gap / scale.max(f64::MIN_POSITIVE))
}
