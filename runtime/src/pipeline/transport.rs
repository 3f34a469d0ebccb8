//! Moving activations and gradients between neighbouring stages, and the reductions
//! across stages (gradient norm, tied weights) and across replicas (data parallelism).

use std::collections::HashMap;
use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use tch::Tensor;

/// Named tensors of one microbatch.
pub type Named = Vec<(String, Tensor)>;

/// A stage worker's link to its neighbours (stage k-1 upstream, k+1 downstream in the same
/// replica), to the other stages and to the other replicas of its stage. Errors are
/// messages; a closed peer is an error, never a hang, and so is a wait longer than the
/// transport's timeout (the message says what was awaited, and from whom).
///
/// Every reduction is collective: all its participants call it the same number of times,
/// in the same order. Sums are taken in a fixed participant order, so results do not
/// depend on arrival order (training stays bit-deterministic).
pub trait Transport: Send {
    /// Sends microbatch `mb`'s activations to the next stage.
    fn send_forward(&mut self, mb: u64, tensors: Named) -> Result<(), String>;
    /// Tells the next stage that the run stops before microbatch `mb`, the first of a step,
    /// in place of its activations ([`super::StopGate`]).
    fn send_stop(&mut self, mb: u64) -> Result<(), String>;
    /// Receives microbatch `mb`'s activations from the previous stage; `None`: the run
    /// stops before `mb` (the previous stage sent [`Transport::send_stop`]).
    fn recv_forward(&mut self, mb: u64) -> Result<Option<Named>, String>;
    /// Sends microbatch `mb`'s input gradients to the previous stage.
    fn send_backward(&mut self, mb: u64, grads: Named) -> Result<(), String>;
    /// Receives microbatch `mb`'s output gradients from the next stage.
    fn recv_backward(&mut self, mb: u64) -> Result<Named, String>;
    /// Sum of `x` over every worker (every stage of every replica).
    fn all_reduce_sum(&mut self, x: f64) -> Result<f64, String>;
    /// Element-wise sums of `tensors` over the replicas of this stage (summed in replica
    /// order); `tensors` itself when there is one replica.
    fn all_reduce_replicas(&mut self, tensors: Vec<Tensor>) -> Result<Vec<Tensor>, String>;
    /// Element-wise sums of `tensors` over the stages `stages` (ascending, this stage among
    /// them) of this replica, summed in stage order: the gradients of tied weights.
    fn all_reduce_tied(&mut self, stages: &[u32], tensors: Vec<Tensor>) -> Result<Vec<Tensor>, String>;
    /// Makes every pending and future reduction fail (a worker has failed).
    fn abort(&mut self);
    /// Begins the sum of `tensors` over `group` (as [`Transport::all_reduce_replicas`] or
    /// [`Transport::all_reduce_tied`]): `Some(sum)` when it completed at once (the
    /// default), `None` while it goes on in the background, to be completed by
    /// [`Transport::finish_sum`] (one per group at a time). Under 2BW a step's gradient
    /// sums are not needed until the update made from them is first used, so the worker
    /// begins them and computes on meanwhile.
    fn begin_sum(&mut self, group: &SumGroup, tensors: Vec<Tensor>) -> Result<Option<Vec<Tensor>>, String> {
        match group {
            SumGroup::Replicas => self.all_reduce_replicas(tensors),
            SumGroup::Tied(stages) => self.all_reduce_tied(stages, tensors),
        }
        .map(Some)
    }
    /// Whether [`Transport::begin_sum`] over `group` returns without waiting for the
    /// group's other members (false by default: it is the blocking sum).
    fn sums_in_background(&self, _group: &SumGroup) -> bool {
        false
    }
    /// Makes ready, before the first step, whatever the sums over `groups` (every group
    /// this worker will sum over) need: nothing by default. Every member of a group calls
    /// it with that group among its `groups` before any sum over it.
    fn prepare_sums(&mut self, _groups: &[SumGroup]) -> Result<(), String> {
        Ok(())
    }
    /// Completes the sum over `group` [`Transport::begin_sum`] left in the background.
    fn finish_sum(&mut self, group: &SumGroup) -> Result<Vec<Tensor>, String> {
        Err(format!("no {group} is in flight"))
    }
    /// Whether the sum over `group` left in the background is complete (or none is in
    /// flight), without waiting; asking also advances it.
    fn sum_done(&mut self, _group: &SumGroup) -> bool {
        true
    }
}

/// A group a stage's gradients are summed over.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum SumGroup {
    /// The replicas of the stage.
    Replicas,
    /// The stages (ascending) of the replica that hold copies of a tied weight.
    Tied(Vec<u32>),
}

impl std::fmt::Display for SumGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SumGroup::Replicas => write!(f, "gradient sum over the replicas"),
            SumGroup::Tied(stages) => write!(f, "tied-weight gradient sum of stages {stages:?}"),
        }
    }
}

struct Msg {
    mb: u64,
    /// `None`: the stop marker in place of the first activations of a step.
    tensors: Option<Named>,
}

/// Workers as threads of one process, linked by `std::sync::mpsc` channels.
pub struct InProcess {
    stage: u32,
    replica: usize,
    fwd_in: Option<Receiver<Msg>>,
    fwd_out: Option<Sender<Msg>>,
    bwd_in: Option<Receiver<Msg>>,
    bwd_out: Option<Sender<Msg>>,
    everyone: Arc<Gather<f64>>,
    replicas: Arc<Gather<Vec<Tensor>>>,
    /// Per tied-weight stage set: the gather of this replica.
    tied: HashMap<Vec<u32>, Arc<Gather<Vec<Tensor>>>>,
    /// Every gather this worker takes part in, to abort them all.
    all: Vec<Arc<dyn Abort>>,
    /// The sums begun in the background ([`Transport::begin_sum`]): the generation of
    /// the group's gather this worker contributed to.
    in_flight: HashMap<SumGroup, u64>,
    timeout: Duration,
}

impl InProcess {
    /// Transports for `replicas` copies of a `depth`-stage pipeline, indexed
    /// `[replica][stage]`; `tied` lists the stage sets that share a tied weight. No wait
    /// lasts longer than `timeout`.
    pub fn grid(depth: usize, replicas: usize, tied: &[Vec<u32>], timeout: Duration) -> Vec<Vec<InProcess>> {
        let everyone = Arc::new(Gather::new(depth * replicas, "gradient-norm sum of every stage".into()));
        let per_stage: Vec<Arc<Gather<Vec<Tensor>>>> =
            (0..depth).map(|k| Arc::new(Gather::new(replicas, format!("gradient sum of stage {k}'s replicas")))).collect();
        let mut grid = Vec::new();
        for r in 0..replicas {
            let groups: HashMap<Vec<u32>, Arc<Gather<Vec<Tensor>>>> =
                tied.iter().map(|set| (set.clone(), Arc::new(Gather::new(set.len(), format!("tied-weight gradient sum of stages {set:?} (replica {r})"))))).collect();
            let mut row: Vec<InProcess> = (0..depth)
                .map(|k| {
                    let mine: HashMap<Vec<u32>, Arc<Gather<Vec<Tensor>>>> =
                        groups.iter().filter(|(set, _)| set.contains(&(k as u32))).map(|(s, g)| (s.clone(), g.clone())).collect();
                    let mut all: Vec<Arc<dyn Abort>> = vec![everyone.clone(), per_stage[k].clone()];
                    all.extend(mine.values().map(|g| g.clone() as Arc<dyn Abort>));
                    InProcess {
                        stage: k as u32,
                        replica: r,
                        fwd_in: None,
                        fwd_out: None,
                        bwd_in: None,
                        bwd_out: None,
                        everyone: everyone.clone(),
                        replicas: per_stage[k].clone(),
                        tied: mine,
                        all,
                        in_flight: HashMap::new(),
                        timeout,
                    }
                })
                .collect();
            for k in 0..depth.saturating_sub(1) {
                let (ftx, frx) = std::sync::mpsc::channel();
                let (btx, brx) = std::sync::mpsc::channel();
                row[k].fwd_out = Some(ftx);
                row[k + 1].fwd_in = Some(frx);
                row[k + 1].bwd_out = Some(btx);
                row[k].bwd_in = Some(brx);
            }
            grid.push(row);
        }
        grid
    }
}

fn send(tx: &Option<Sender<Msg>>, mb: u64, tensors: Option<Named>, what: &str) -> Result<(), String> {
    let tx = tx.as_ref().ok_or_else(|| format!("no {what} neighbour"))?;
    tx.send(Msg { mb, tensors }).map_err(|_| format!("{what} neighbour has stopped"))
}

/// Microbatch `mb`'s `kind` (activations, gradients) from the `what` neighbour.
fn recv(rx: &Option<Receiver<Msg>>, mb: u64, what: &str, kind: &str, timeout: Duration) -> Result<Option<Named>, String> {
    let rx = rx.as_ref().ok_or_else(|| format!("no {what} neighbour"))?;
    let msg = rx.recv_timeout(timeout).map_err(|e| match e {
        RecvTimeoutError::Timeout => format!("waited {} s for microbatch {mb}'s {kind} from the {what} stage, which sent nothing", timeout.as_secs_f64()),
        RecvTimeoutError::Disconnected => format!("{what} neighbour has stopped"),
    })?;
    if msg.mb != mb {
        return Err(format!("expected microbatch {mb} from the {what} neighbour, got {}", msg.mb));
    }
    Ok(msg.tensors)
}

/// `a[i] + b[i]`; a length or shape mismatch (participants that disagree on what they
/// sum) is an error, never a panic.
pub(crate) fn add_lists(a: &[Tensor], b: &[Tensor]) -> Result<Vec<Tensor>, String> {
    if a.len() != b.len() {
        return Err(format!("summing {} tensors with {}", a.len(), b.len()));
    }
    tch::no_grad(|| {
        a.iter()
            .zip(b)
            .enumerate()
            .map(|(i, (x, y))| {
                if x.size() != y.size() {
                    return Err(format!("tensor {i}: summing shape {:?} with {:?}", x.size(), y.size()));
                }
                // Participants on other devices: the sum is on the first one's.
                y.f_to_device(x.device()).and_then(|y| x.f_add(&y)).map_err(|e| format!("tensor {i}: {}", e.to_string().lines().next().unwrap_or("")))
            })
            .collect()
    })
}

/// Element-wise sum of equally long tensor lists, in list order.
pub(crate) fn sum_lists(parts: Vec<Vec<Tensor>>) -> Result<Vec<Tensor>, String> {
    let mut it = parts.into_iter();
    let first = it.next().unwrap_or_default();
    it.try_fold(first, |acc, p| add_lists(&acc, &p))
}

#[allow(clippy::ptr_arg)] // the gather shares its `Vec<Tensor>` value type
fn share(ts: &Vec<Tensor>) -> Vec<Tensor> {
    ts.iter().map(|t| t.shallow_clone()).collect()
}

impl Transport for InProcess {
    fn send_forward(&mut self, mb: u64, tensors: Named) -> Result<(), String> {
        send(&self.fwd_out, mb, Some(tensors), "next")
    }
    fn send_stop(&mut self, mb: u64) -> Result<(), String> {
        send(&self.fwd_out, mb, None, "next")
    }
    fn recv_forward(&mut self, mb: u64) -> Result<Option<Named>, String> {
        recv(&self.fwd_in, mb, "previous", "activations", self.timeout)
    }
    fn send_backward(&mut self, mb: u64, grads: Named) -> Result<(), String> {
        send(&self.bwd_out, mb, Some(grads), "previous")
    }
    fn recv_backward(&mut self, mb: u64) -> Result<Named, String> {
        recv(&self.bwd_in, mb, "next", "gradients", self.timeout)?.ok_or_else(|| format!("a stop marker from the next stage in place of microbatch {mb}'s gradients"))
    }
    fn all_reduce_sum(&mut self, x: f64) -> Result<f64, String> {
        // The summing position, replica-major (replica, then stage): this order is the
        // reference the MPI job's `Layout::summing_order` repeats; it is not the MPI rank,
        // which is stage-major.
        let position = self.replica * (self.everyone.n / self.replicas.n.max(1)) + self.stage as usize;
        self.everyone.reduce(position, x, |xs| Ok(xs.into_iter().sum()), |x| *x, self.timeout)
    }
    fn all_reduce_replicas(&mut self, tensors: Vec<Tensor>) -> Result<Vec<Tensor>, String> {
        if self.replicas.n == 1 {
            return Ok(tensors);
        }
        self.replicas.reduce(self.replica, tensors, sum_lists, share, self.timeout)
    }
    fn all_reduce_tied(&mut self, stages: &[u32], tensors: Vec<Tensor>) -> Result<Vec<Tensor>, String> {
        let (g, rank) = self.tied_gather(stages)?;
        g.reduce(rank, tensors, sum_lists, share, self.timeout)
    }
    fn abort(&mut self) {
        for g in &self.all {
            g.abort();
        }
    }
    /// Contributes this worker's part and goes on; the last member to arrive adds the
    /// parts (on its own thread, in member order, as [`Transport::all_reduce_tied`] and
    /// [`Transport::all_reduce_replicas`] do), so nobody waits for a member still
    /// computing.
    fn begin_sum(&mut self, group: &SumGroup, tensors: Vec<Tensor>) -> Result<Option<Vec<Tensor>>, String> {
        let Some((g, rank)) = self.gather_of(group)? else { return Ok(Some(tensors)) };
        if self.in_flight.contains_key(group) {
            return Err(format!("{group}: begun while the last one was in flight"));
        }
        let gen = g.contribute(rank, tensors, sum_lists)?;
        if g.ready(gen) {
            return g.collect(gen, share, self.timeout).map(Some);
        }
        self.in_flight.insert(group.clone(), gen);
        Ok(None)
    }
    fn sums_in_background(&self, _group: &SumGroup) -> bool {
        true
    }
    fn finish_sum(&mut self, group: &SumGroup) -> Result<Vec<Tensor>, String> {
        let gen = self.in_flight.remove(group).ok_or_else(|| format!("no {group} is in flight"))?;
        let (g, _) = self.gather_of(group)?.ok_or_else(|| format!("no {group} is in flight"))?;
        g.collect(gen, share, self.timeout)
    }
    fn sum_done(&mut self, group: &SumGroup) -> bool {
        match (self.in_flight.get(group), self.gather_of(group)) {
            (Some(&gen), Ok(Some((g, _)))) => g.ready(gen),
            _ => true,
        }
    }
}

/// A gather of gradients and this worker's place (rank) in it.
type Member = (Arc<Gather<Vec<Tensor>>>, usize);

impl InProcess {
    /// The gather of tied stage set `stages` and this stage's place in it.
    fn tied_gather(&self, stages: &[u32]) -> Result<Member, String> {
        let g = self.tied.get(stages).ok_or_else(|| format!("stage {} is not in a tied-weight group {stages:?}", self.stage))?;
        let rank = stages.iter().position(|&s| s == self.stage).unwrap_or(0);
        Ok((g.clone(), rank))
    }

    /// The gather `group` sums over and this worker's place in it; `None` when this
    /// worker is its only member.
    fn gather_of(&self, group: &SumGroup) -> Result<Option<Member>, String> {
        match group {
            SumGroup::Replicas if self.replicas.n == 1 => Ok(None),
            SumGroup::Replicas => Ok(Some((self.replicas.clone(), self.replica))),
            SumGroup::Tied(stages) => self.tied_gather(stages).map(Some),
        }
    }
}

fn gather_aborted() -> String {
    "reduction aborted: another worker has stopped".to_string()
}

trait Abort: Send + Sync {
    fn abort(&self);
}

/// A reusable all-reduce over `n` ranked participants: each contributes a value, the last
/// to arrive combines them in rank order, and every participant gets a share of the result.
struct Gather<T> {
    n: usize,
    /// What is being reduced, for messages.
    what: String,
    state: Mutex<GState<T>>,
    cv: Condvar,
}

struct GState<T> {
    generation: u64,
    parts: Vec<Option<T>>,
    arrived: usize,
    result: Option<T>,
    aborted: bool,
}

impl<T: Send> Gather<T> {
    fn new(n: usize, what: String) -> Self {
        let state = GState { generation: 0, parts: (0..n).map(|_| None).collect(), arrived: 0, result: None, aborted: false };
        Gather { n, what, state: Mutex::new(state), cv: Condvar::new() }
    }

    /// Contributes `x` as participant `rank` and returns the combined result; errs when
    /// the others have not all contributed within `timeout`, naming the missing ones.
    fn reduce(&self, rank: usize, x: T, combine: impl FnOnce(Vec<T>) -> Result<T, String>, share: impl Fn(&T) -> T, timeout: Duration) -> Result<T, String> {
        let gen = self.contribute(rank, x, combine)?;
        self.collect(gen, share, timeout)
    }

    /// Contributes `x` as participant `rank` without waiting for the others, and returns
    /// the generation contributed to, for [`Gather::collect`]; the last to arrive combines
    /// the parts. A participant collects a generation before it contributes to the next,
    /// so a result stays until every participant has taken its share.
    fn contribute(&self, rank: usize, x: T, combine: impl FnOnce(Vec<T>) -> Result<T, String>) -> Result<u64, String> {
        let mut s = self.state.lock().map_err(|_| gather_aborted())?;
        if s.aborted {
            return Err(gather_aborted());
        }
        if rank >= self.n || s.parts[rank].is_some() {
            return Err(format!("reduction: rank {rank} of {} contributed twice or is out of range", self.n));
        }
        let gen = s.generation;
        s.parts[rank] = Some(x);
        s.arrived += 1;
        if s.arrived == self.n {
            let parts: Vec<T> = s.parts.iter_mut().map(|p| p.take()).collect::<Option<_>>().ok_or_else(gather_aborted)?;
            match combine(parts) {
                Ok(r) => s.result = Some(r),
                Err(e) => {
                    // The others would wait for a result that never comes: fail them too.
                    s.aborted = true;
                    self.cv.notify_all();
                    return Err(format!("{}: {e}", self.what));
                }
            }
            s.arrived = 0;
            s.generation += 1;
            self.cv.notify_all();
        }
        Ok(gen)
    }

    /// Whether generation `gen` is combined (or the gather aborted), without waiting.
    fn ready(&self, gen: u64) -> bool {
        self.state.lock().map_or(true, |s| s.generation != gen || s.aborted)
    }

    /// A share of generation `gen`'s result, waiting for it at most `timeout`; errs naming
    /// the participants that have not contributed.
    fn collect(&self, gen: u64, share: impl Fn(&T) -> T, timeout: Duration) -> Result<T, String> {
        let aborted = gather_aborted;
        let mut s = self.state.lock().map_err(|_| aborted())?;
        // The result of `gen` stays until all `n` have arrived at `gen + 1`, which needs
        // every waiter of `gen` to have left, so it cannot be overwritten under a waiter.
        let deadline = Instant::now() + timeout;
        while s.generation == gen && !s.aborted {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                let missing: Vec<usize> = s.parts.iter().enumerate().filter(|(_, p)| p.is_none()).map(|(i, _)| i).collect();
                return Err(format!("waited {} s for the {}: participant(s) {missing:?} of {} never contributed", timeout.as_secs_f64(), self.what, self.n));
            }
            s = self.cv.wait_timeout(s, left).map_err(|_| aborted())?.0;
        }
        if s.generation == gen {
            return Err(aborted());
        }
        s.result.as_ref().map(&share).ok_or_else(aborted)
    }
}

impl<T: Send> Abort for Gather<T> {
    fn abort(&self) {
        if let Ok(mut s) = self.state.lock() {
            s.aborted = true;
        }
        self.cv.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_reduction_nobody_joins_ends_with_an_error_naming_it() {
        let g = Gather::<f64>::new(3, "gradient-norm sum of every stage".into());
        let e = g.reduce(1, 1.0, |xs| Ok(xs.into_iter().sum()), |x| *x, Duration::from_millis(50)).unwrap_err();
        assert_eq!(e, "waited 0.05 s for the gradient-norm sum of every stage: participant(s) [0, 2] of 3 never contributed");
    }

    #[test]
    fn a_neighbour_that_sends_nothing_ends_with_an_error_naming_it() {
        let mut grid = InProcess::grid(2, 1, &[], Duration::from_millis(50));
        let e = grid[0][1].recv_forward(3).unwrap_err();
        assert_eq!(e, "waited 0.05 s for microbatch 3's activations from the previous stage, which sent nothing");
        let e = grid[0][0].recv_backward(0).unwrap_err();
        assert!(e.contains("microbatch 0's gradients from the next stage"), "{e}");
        // A tied group whose other stage never joins.
        let mut grid = InProcess::grid(2, 1, &[vec![0, 1]], Duration::from_millis(50));
        let e = grid[0][0].all_reduce_tied(&[0, 1], vec![Tensor::from(1.0)]).unwrap_err();
        assert!(e.contains("tied-weight gradient sum of stages [0, 1] (replica 0): participant(s) [1]"), "{e}");
    }

    #[test]
    fn a_sum_begun_in_the_background_completes_when_the_last_member_arrives() {
        let tied = SumGroup::Tied(vec![0, 1]);
        let mut grid = InProcess::grid(2, 2, &[vec![0, 1]], Duration::from_millis(50));
        // The first member goes on; the last one adds the parts, in member order.
        assert!(grid[0][0].begin_sum(&tied, vec![Tensor::from(1.0)]).unwrap().is_none());
        assert!(!grid[0][0].sum_done(&tied));
        assert_eq!(grid[0][0].begin_sum(&tied, vec![Tensor::from(5.0)]).unwrap_err(), "tied-weight gradient sum of stages [0, 1]: begun while the last one was in flight");
        let last = grid[0][1].begin_sum(&tied, vec![Tensor::from(2.0)]).unwrap().expect("the last member's sum is complete");
        assert_eq!(last[0].double_value(&[]), 3.0);
        assert!(grid[0][0].sum_done(&tied));
        assert_eq!(grid[0][0].finish_sum(&tied).unwrap()[0].double_value(&[]), 3.0);
        assert_eq!(grid[0][0].finish_sum(&tied).unwrap_err(), "no tied-weight gradient sum of stages [0, 1] is in flight");
        // The next step's sum starts afresh; a member that never comes is named.
        assert!(grid[0][1].begin_sum(&tied, vec![Tensor::from(4.0)]).unwrap().is_none());
        let e = grid[0][1].finish_sum(&tied).unwrap_err();
        assert_eq!(e, "waited 0.05 s for the tied-weight gradient sum of stages [0, 1] (replica 0): participant(s) [0] of 2 never contributed");
        // The replicas' sum likewise; with one replica there is nothing to wait for.
        assert!(grid[1][0].begin_sum(&SumGroup::Replicas, vec![Tensor::from(1.5)]).unwrap().is_none());
        let sum = grid[0][0].begin_sum(&SumGroup::Replicas, vec![Tensor::from(0.5)]).unwrap().expect("complete");
        assert_eq!(sum[0].double_value(&[]), 2.0);
        assert_eq!(grid[1][0].finish_sum(&SumGroup::Replicas).unwrap()[0].double_value(&[]), 2.0);
        let mut single = InProcess::grid(1, 1, &[], Duration::from_millis(50));
        assert_eq!(single[0][0].begin_sum(&SumGroup::Replicas, vec![Tensor::from(7.0)]).unwrap().expect("alone")[0].double_value(&[]), 7.0);
    }
}
