//! Workers in separate processes, started by an MPI launcher (`mpirun`, `srun --mpi=pmix`)
//! and linked by MPI (rsmpi on the system's Open MPI): the same [`Transport`] the embedded
//! executor uses, so a stage process runs the very schedule the embedded executor runs.
//!
//! Ranks follow the build's placement ([`Layout`]). Stage-major (the default), `stage *
//! replicas + replica`: the replicas of a stage on consecutive ranks, stage k's block
//! followed by stage k+1's. Launchers fill a node's slots with consecutive ranks, so when
//! the replica count divides the ranks per node the replicas of a stage share a server and
//! the per-step gradient all-reduce stays on the server's fast links
//! (`shared/design/2bw.md`); only the activations and gradients of a boundary cross
//! servers. Replica-major, `replica * depth + stage`: each pipeline on consecutive ranks,
//! so its boundaries stay in a server and the gradient sums cross (the planner chooses it
//! where that is faster). A stage's neighbours are therefore not `rank +- 1` in general:
//! every use goes through [`Layout`].
//!
//! - Activations and gradients go point to point, tagged by direction, sent non-blocking
//!   (a send never waits for its receiver, so the schedule cannot deadlock) and received
//!   by polling with a deadline (`--timeout`), so no wait lasts forever and a late one
//!   names what it waited for and from whom.
//! - Where a worker runs several stages (interleaved 1F1B, ZB-V), each stage is still a
//!   rank, and the ranks of one worker take turns in its order by passing the count of
//!   turns on in small messages ([`MpiTurns`]).
//! - Traces count from rank 0's clock at the agreement ([`Agreed`]), so ranks' traces line
//!   up.
//! - Evaluation during training runs forward through replica 0's stages on a tag of its
//!   own, from each rank's main thread while its stage worker trains on
//!   ([`super::eval`]).
//! - Gradient sums over the replicas of a stage and over the stages of a replica sharing
//!   a tied weight take MPI's own all-reduce by default ([`Reduction::Collective`]: a
//!   communicator per group, `MPI_Iallreduce` polled with a deadline, under 2BW left in
//!   the background while the next step computes); MPI adds in an order of its own.
//! - The fixed-order reductions (the scalar sums over every rank, gradient norm and fp16
//!   overflow, always; the gradient sums with [`Reduction::FixedOrder`]) are gathers to
//!   the group's first rank, a sum in fixed group order (the embedded executor's:
//!   replica-major then stage over every rank, not rank order; replica order within a
//!   stage; stage order within a replica) and a send of the result to the group, each kind
//!   of group on its own tag: bit-identical to the embedded executor.
//! - Liveness: a thread of its own sends every rank's ring neighbours (ranks `rank +- 1`,
//!   wrapping; usually the other replicas of its stage: every rank is watched by two
//!   others whatever the layout) a heartbeat each second and watches theirs; a neighbour
//!   silent for the heartbeat timeout (frozen by SIGSTOP, a dead node) stops the job with
//!   `MPI_Abort` and a message naming it and what this rank was waiting for. Computation
//!   never delays heartbeats, so a long step is not mistaken for a frozen rank. A rank
//!   stopped by the launcher (another rank died) says what it was waiting for before it
//!   exits.
//! - Agreement: before the first step every rank's run configuration is compared with
//!   rank 0's, and a difference stops every rank naming the first one.
//! - Stopping early: `SIGUSR1` (mpirun forwards it to every rank) asks the run to stop;
//!   the first stages decide where and pass a marker down the pipeline
//!   ([`super::StopGate`]), so every rank ends after the same step and rank 0 commits its
//!   checkpoint.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use ::mpi::environment::Universe;
use ::mpi::datatype::Equivalence;
use ::mpi::point_to_point::{Destination, Message, Source, Status};
use ::mpi::request::{Request, StaticScope};
use ::mpi::topology::{Communicator, SimpleCommunicator};
use ::mpi::collective::SystemOperation;
use ::mpi::topology::Group;
use ::mpi::traits::CommunicatorCollectives;
use ::mpi::Threading;
use tch::{Kind, Tensor};

use super::stop::StopGate;
use super::checkpoint::{commit_parts, discard_parts, write_stage_part, StagePart};
use super::eval::EvalLink;
use super::transport::{sum_lists, Named, SumGroup, Transport};
use super::turns::{abandoned, TurnLink};
use crate::exec::{tensor_from_bytes, tensor_to_bytes};
pub use pipewright_core::Reduction;
use pipewright_ops::DType;

/// Message tags: one per direction and per kind of reduction (parts to the group's first
/// rank, results back), so messages of different kinds never match each other.
const FORWARD: i32 = 1;
const BACKWARD: i32 = 2;
const SUM_PART: i32 = 3;
const SUM_RESULT: i32 = 4;
const REPLICAS_PART: i32 = 5;
const REPLICAS_RESULT: i32 = 6;
const TIED_PART: i32 = 7;
const TIED_RESULT: i32 = 8;
const AGREE_PART: i32 = 9;
const AGREE_RESULT: i32 = 10;
const HEARTBEAT: i32 = 11;
const GATHER_PART: i32 = 12;
const STEP: i32 = 13;
const CHECKPOINT: i32 = 14;
const EVAL_FORWARD: i32 = 15;
/// A member's note that it has begun a collective sum (to name the late ones).
const REDUCE_NOTE: i32 = 16;
/// A stage's note to the other stages of its worker that it passed a turn on (or gave up
/// its turns), under schedules that run several stages per worker ([`MpiTurns`]).
const TURN: i32 = 17;
/// The first of the tags communicators are made on ([`group_tag`]).
const GROUP_TAGS: i32 = 1 << 10;

/// [`MpiJob::start`]'s default heartbeat timeout: a neighbour silent this long is taken
/// for frozen or gone (heartbeats go every [`HEARTBEAT_PERIOD`]).
pub const DEFAULT_HEARTBEAT_TIMEOUT: Duration = Duration::from_secs(10);
/// How often a rank tells its neighbours it is alive.
pub const HEARTBEAT_PERIOD: Duration = Duration::from_secs(1);

pub use pipewright_core::Layout;

/// What the job's threads share: who this rank is, what it waits for (for the messages of
/// the heartbeat and the signal watcher) and whether to stop.
struct Shared {
    rank: usize,
    size: usize,
    /// The host this rank runs on (MPI's processor name), for messages about its disk.
    host: String,
    layout: Mutex<Option<Layout>>,
    waiting: Mutex<Option<String>>,
    stop: AtomicBool,
    /// Asked by `SIGUSR1` (mpirun forwards it to every rank; `pipewright launch` sends it
    /// on Ctrl-C): the run stops at a step boundary every rank agrees on.
    gate: Arc<StopGate>,
}

impl Shared {
    fn who(&self, rank: usize) -> String {
        match *self.layout.lock().unwrap_or_else(|p| p.into_inner()) {
            Some(l) => l.who(rank),
            None => format!("rank {rank}"),
        }
    }
    fn doing(&self) -> String {
        match &*self.waiting.lock().unwrap_or_else(|p| p.into_inner()) {
            Some(w) => format!("while waiting for {w}"),
            None => "while computing (waiting for no other rank)".into(),
        }
    }
    fn set_waiting(&self, what: Option<String>) {
        *self.waiting.lock().unwrap_or_else(|p| p.into_inner()) = what;
    }
}

/// This process's membership in an MPI job: initialised once per process (with
/// `MPI_THREAD_MULTIPLE`: the stage worker, the heartbeat and the main thread all talk
/// MPI), ended by [`MpiJob::finish`] (every rank done) or [`MpiJob::abort`].
pub struct MpiJob {
    universe: Option<Universe>,
    shared: Arc<Shared>,
    heartbeat: Option<std::thread::JoinHandle<()>>,
}

impl MpiJob {
    /// Initialises MPI (a process started without a launcher is a job of one rank), and
    /// starts the signal watcher and the heartbeat (`heartbeat_timeout`: how long a silent
    /// neighbour is tolerated).
    pub fn start(heartbeat_timeout: Duration) -> Result<MpiJob, String> {
        if heartbeat_timeout < 2 * HEARTBEAT_PERIOD {
            return Err(format!(
                "--heartbeat-timeout {}: must be at least {} s (heartbeats go every {} s)",
                heartbeat_timeout.as_secs_f64(),
                2 * HEARTBEAT_PERIOD.as_secs(),
                HEARTBEAT_PERIOD.as_secs()
            ));
        }
        // Before MPI and libtorch start threads, so that they all inherit the mask and the
        // launcher's SIGTERM reaches only the watcher.
        let sigs = block_termination_signals();
        let (universe, provided) = ::mpi::initialize_with_threading(Threading::Multiple).ok_or("MPI was already initialised in this process")?;
        if provided != Threading::Multiple {
            return Err(format!("the MPI library offers thread level {provided:?}, and the stage worker needs MPI_THREAD_MULTIPLE; use an MPI built with thread support"));
        }
        let world = SimpleCommunicator::world();
        let shared = Arc::new(Shared {
            rank: world.rank() as usize,
            size: world.size() as usize,
            host: ::mpi::environment::processor_name().unwrap_or_else(|_| "an unnamed host".into()),
            layout: Mutex::new(None),
            waiting: Mutex::new(None),
            stop: AtomicBool::new(false),
            gate: Arc::new(StopGate::new()),
        });
        if let Some(set) = sigs {
            let s = shared.clone();
            std::thread::Builder::new().name("pipewright-signals".into()).spawn(move || watch_signals(set, s)).map_err(|e| format!("cannot start the signal watcher: {e}"))?;
        }
        let s = shared.clone();
        let heartbeat = std::thread::Builder::new()
            .name("pipewright-heartbeat".into())
            .spawn(move || heartbeat(s, heartbeat_timeout))
            .map_err(|e| format!("cannot start the heartbeat: {e}"))?;
        Ok(MpiJob { universe: Some(universe), shared, heartbeat: Some(heartbeat) })
    }

    pub fn rank(&self) -> usize {
        self.shared.rank
    }

    /// Where a `SIGUSR1` asks this rank to stop; the run's [`super::TrainConfig::stop`].
    pub fn stop_gate(&self) -> Arc<StopGate> {
        self.shared.gate.clone()
    }
    pub fn size(&self) -> usize {
        self.shared.size
    }

    /// Names every rank by stage and replica from now on (in every message).
    pub fn set_layout(&self, layout: Layout) {
        *self.shared.layout.lock().unwrap_or_else(|p| p.into_inner()) = Some(layout);
    }

    /// `rank 1 (stage 1, replica 0)` once the layout is known, else `rank 1`.
    pub fn who(&self, rank: usize) -> String {
        self.shared.who(rank)
    }

    /// This rank's link to the others, for a job of `layout`'s shape; no wait lasts longer
    /// than `timeout`.
    pub fn transport(&self, layout: Layout, timeout: Duration) -> Result<Mpi, String> {
        if self.size() == 1 && layout.size() > 1 {
            return Err(format!(
                "this process is a job of one rank, but the pipeline has {} ({} stages x {} replicas): start it under an MPI launcher (`pipewright launch BUILD -- OPTIONS`, or `mpirun -np {} pipewright worker BUILD OPTIONS`)",
                layout.size(),
                layout.depth,
                layout.replicas,
                layout.size()
            ));
        }
        if layout.size() != self.size() {
            return Err(format!(
                "the launcher started {} processes but the job has {} ({} stages x {} replicas)",
                self.size(),
                layout.size(),
                layout.depth,
                layout.replicas
            ));
        }
        self.set_layout(layout);
        let (replica, stage) = layout.place(self.rank());
        Ok(Mpi { rank: self.rank(), layout, stage: stage as u32, replica, timeout, shared: self.shared.clone(), sends: Vec::new(), seq: HashMap::new(), aborted: false, reduction: Reduction::Collective, comms: HashMap::new(), notes: HashSet::new(), in_flight: HashMap::new() })
    }

    /// Stops the whole job (every rank) with exit status `code`: call it after printing why.
    pub fn abort(&self, code: i32) -> ! {
        SimpleCommunicator::world().abort(code)
    }

    /// Ends this rank's part once it is done: waits (heartbeat still running, so a frozen
    /// rank is still caught) until every rank is, then finalises MPI.
    pub fn finish(mut self) -> Result<(), String> {
        let world = SimpleCommunicator::world();
        self.shared.set_waiting(Some("the other ranks to finish".into()));
        // No deadline: a rank still training is not late; the heartbeat catches a frozen one.
        let _ = wait_for(world.immediate_barrier(), None);
        self.shared.stop.store(true, Ordering::SeqCst);
        if let Some(h) = self.heartbeat.take() {
            let _ = h.join();
        }
        // Heartbeats still in flight are received, so none is pending at finalisation.
        // Every rank has passed the barrier above, so this one is a matter of moments;
        // the heartbeat has stopped, so a deadline stands in for it.
        if wait_for(world.immediate_barrier(), Some(Instant::now() + FINISH_TIMEOUT)).is_err() {
            // Neither finalise (it would wait for the silent rank) nor abort before the caller
            // has printed why: the rank exits with an error and the launcher stops the rest.
            std::mem::forget(self.universe.take());
            return Err(format!("a rank stopped answering while the job finished (no reply within {} s)", FINISH_TIMEOUT.as_secs()));
        }
        // So are turn notes a rank did not need: with more than two stages per worker, a
        // peer's note can arrive after a later one that already ended the rank's waits.
        for tag in [HEARTBEAT, TURN] {
            while let Some(m) = world.any_process().immediate_matched_probe_with_tag(tag) {
                receive_bytes(m);
            }
        }
        drop(self.universe.take());
        Ok(())
    }
}

impl Drop for MpiJob {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        if let Some(h) = self.heartbeat.take() {
            let _ = h.join();
        }
        if self.universe.is_some() {
            // Not finished: a rank that leaves without `finish` or `abort` would leave the
            // others waiting in theirs; MPI_Finalize alone would hang with them.
            SimpleCommunicator::world().abort(1);
        }
    }
}

/// How long the last barrier of [`MpiJob::finish`] may take once every rank has finished.
const FINISH_TIMEOUT: Duration = Duration::from_secs(30);

/// Polls `request` until it completes (`Ok`) or `deadline` passes (`Err`).
fn wait_for(request: Request<'static, ()>, deadline: Option<Instant>) -> Result<(), ()> {
    let (mut request, mut pause) = (request, Backoff::new());
    loop {
        match request.test() {
            Ok(_) => return Ok(()),
            Err(r) if deadline.map_or(true, |d| Instant::now() < d) => {
                request = r;
                pause.wait();
            }
            // Abandoned incomplete: MPI_Finalize is never reached, the caller aborts.
            Err(r) => {
                std::mem::forget(r);
                return Err(());
            }
        }
    }
}

/// Sleeps a little longer each time, from a few microseconds to a millisecond: fast
/// reaction to a message that is about to come, little CPU taken from the computation
/// while a long wait lasts.
struct Backoff {
    n: u32,
}

impl Backoff {
    fn new() -> Self {
        Backoff { n: 0 }
    }
    fn wait(&mut self) {
        self.n = self.n.saturating_add(1);
        if self.n < 50 {
            std::thread::yield_now();
        } else {
            let us = (self.n as u64 - 49).saturating_mul(20).min(1000);
            std::thread::sleep(Duration::from_micros(us));
        }
    }
}

/// Receives a probed message into a byte buffer. (rsmpi's `matched_receive_vec` builds
/// its buffer element by element in code generic over the element type, which compiles
/// in the calling crate: unoptimised in debug builds, it made large messages slow.)
fn receive_bytes(probed: (Message, Status)) -> Vec<u8> {
    let (message, status) = probed;
    let count = usize::try_from(status.count(u8::equivalent_datatype())).unwrap_or(0);
    let mut buf = vec![0u8; count];
    message.matched_receive_into(&mut buf[..]);
    buf
}

/// The heartbeat thread: beats to the ring neighbours, watches theirs, and stops the job
/// when one stays silent for `timeout`.
fn heartbeat(shared: Arc<Shared>, timeout: Duration) {
    static BEAT: [u8; 1] = [1];
    let (rank, size) = (shared.rank, shared.size);
    if size < 2 {
        return;
    }
    let world = SimpleCommunicator::world();
    let mut peers = vec![(rank + size - 1) % size, (rank + 1) % size];
    peers.sort();
    peers.dedup();
    let start = Instant::now();
    let mut seen: HashMap<usize, Instant> = peers.iter().map(|&p| (p, start)).collect();
    let mut next_beat = start;
    let mut pending: Vec<Request<'static, [u8; 1]>> = Vec::new();
    let mut last_turn = start;
    while !shared.stop.load(Ordering::SeqCst) {
        let now = Instant::now();
        // This thread turns every 100 ms; a longer gap means this rank itself was stopped
        // (SIGSTOP, a paused machine), not that its neighbours went silent.
        let paused = now - std::mem::replace(&mut last_turn, now);
        if paused > timeout {
            let line = format!(
                "error: {}: this rank was itself stopped for {:.0} s (SIGSTOP, or its machine paused), longer than --heartbeat-timeout {} s: its neighbours take it for frozen; stopping the job\n",
                shared.who(rank),
                paused.as_secs_f64(),
                timeout.as_secs_f64()
            );
            let _ = std::io::Write::write_all(&mut std::io::stderr(), line.as_bytes());
            world.abort(1);
        }
        if paused > 2 * HEARTBEAT_PERIOD {
            // The neighbours' beats of that time are still queued: not their silence.
            seen.values_mut().for_each(|at| *at = now);
        }
        if now >= next_beat {
            for &p in &peers {
                pending.push(world.process_at_rank(p as i32).immediate_send_with_tag(StaticScope, &BEAT, HEARTBEAT));
            }
            next_beat = now + HEARTBEAT_PERIOD;
        }
        pending = pending.into_iter().filter_map(|r| r.test().err()).collect();
        while let Some(m) = world.any_process().immediate_matched_probe_with_tag(HEARTBEAT) {
            let from = m.1.source_rank() as usize;
            receive_bytes(m);
            seen.insert(from, Instant::now());
        }
        for (&p, &at) in &seen {
            if at.elapsed() > timeout {
                eprintln!(
                    "error: {}: {} sent no heartbeat for {} s (frozen or gone; --heartbeat-timeout) {}; stopping the job",
                    shared.who(rank),
                    shared.who(p),
                    timeout.as_secs_f64(),
                    shared.doing()
                );
                world.abort(1);
            }
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    // Sends a stopped heartbeat never completes are abandoned (their buffer is static).
    pending.into_iter().for_each(std::mem::forget);
}

/// Blocks SIGTERM, SIGINT and SIGUSR1 in this thread (and so in every thread started
/// after it); the set to wait for, or `None` when the mask cannot be set.
fn block_termination_signals() -> Option<libc::sigset_t> {
    // SAFETY: plain libc calls on a local signal set.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGTERM);
        libc::sigaddset(&mut set, libc::SIGINT);
        libc::sigaddset(&mut set, libc::SIGUSR1);
        (libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut()) == 0).then_some(set)
    }
}

/// Waits for signals: `SIGUSR1` asks the run to stop at the next step boundary (rank 0
/// says so once); SIGTERM or SIGINT (the launcher stopping the job: another rank died or
/// the job was cancelled) exits at once, saying what this rank was doing.
fn watch_signals(set: libc::sigset_t, shared: Arc<Shared>) {
    loop {
        let mut sig: libc::c_int = 0;
        // SAFETY: `set` is an initialised signal set; sigwait writes the signal number.
        if unsafe { libc::sigwait(&set, &mut sig) } != 0 {
            return;
        }
        if sig == libc::SIGUSR1 {
            if !shared.gate.requested() && shared.rank == 0 {
                let line = "rank 0: SIGUSR1: every rank stops after the current step and saves (SIGTERM stops the job at once)\n";
                let _ = std::io::Write::write_all(&mut std::io::stderr(), line.as_bytes());
            }
            shared.gate.request();
            continue;
        }
        let name = if sig == libc::SIGINT { "SIGINT" } else { "SIGTERM" };
        eprintln!("error: {}: stopped by {name} (the launcher stops every rank when one fails) {}", shared.who(shared.rank), shared.doing());
        // SAFETY: ends the process at once, without running exit handlers that could wait
        // on MPI peers that are gone.
        unsafe { libc::_exit(143) }
    }
}

/// A send in flight: MPI reads `buf` until the request completes, so both live together.
struct PendingSend {
    request: Request<'static, [u8]>,
    buf: *mut [u8],
}

// SAFETY: the request is an MPI handle (MPI_THREAD_MULTIPLE makes it usable from any
// thread), and `buf` is owned by this value alone (a leaked box, freed once the request
// completes).
unsafe impl Send for PendingSend {}

/// What the ranks of a job agreed on before the first step ([`Mpi::agree`]).
#[derive(Clone, Copy, Debug)]
pub struct Agreed {
    /// The job's id (rank 0's process id).
    pub job: u32,
    /// Rank 0's clock at the agreement: where every rank's trace starts.
    pub clock: SystemTime,
}

/// A worker's MPI links (see the module documentation).
pub struct Mpi {
    rank: usize,
    layout: Layout,
    stage: u32,
    replica: usize,
    timeout: Duration,
    shared: Arc<Shared>,
    sends: Vec<PendingSend>,
    /// Per group ([`group_key`]: its kind's tag and members): reductions begun, checked
    /// against the root's so a rank that skipped one is an error rather than a wrong sum.
    /// Counted per group, not per kind: a rank in two groups of one kind (stages 0 and 3
    /// sharing one tied weight, stages 0 to 3 another) counts each apart, as do the
    /// members that are in only one of them.
    seq: HashMap<u64, u64>,
    aborted: bool,
    reduction: Reduction,
    /// The communicators of the groups this rank sums over, by member ranks.
    comms: HashMap<Vec<usize>, GroupComm>,
    /// Notes (member, group key, reduction) received ahead of their sum's completion.
    notes: HashSet<(usize, u64, u64)>,
    /// The gradient sums left in the background ([`Transport::begin_sum`]).
    in_flight: HashMap<SumGroup, InFlightSum>,
}

impl Mpi {
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The job's shape and rank numbering.
    pub fn layout(&self) -> Layout {
        self.layout
    }

    /// Takes tensor sums by `reduction` (every rank of a job must take the same).
    pub fn with_reduction(mut self, reduction: Reduction) -> Mpi {
        self.reduction = reduction;
        self
    }

    /// The ranks of `group` (this rank's replicas, or its replica's stages sharing a tied
    /// weight), in summing order, the tags its reductions go on, and what it is called.
    fn sum_group(&self, group: &SumGroup) -> Result<(Vec<usize>, (i32, i32), String), String> {
        match group {
            SumGroup::Replicas => {
                let members = (0..self.layout.replicas).map(|r| self.layout.rank(r, self.stage as usize)).collect();
                Ok((members, (REPLICAS_PART, REPLICAS_RESULT), format!("gradient sum of stage {}'s replicas", self.stage)))
            }
            SumGroup::Tied(stages) => {
                if !stages.contains(&self.stage) || stages.iter().any(|&s| s as usize >= self.layout.depth) || !stages.windows(2).all(|w| w[0] < w[1]) {
                    return Err(format!("stage {} is not in a tied-weight group {stages:?}", self.stage));
                }
                let members = stages.iter().map(|&s| self.layout.rank(self.replica, s as usize)).collect();
                Ok((members, (TIED_PART, TIED_RESULT), format!("tied-weight gradient sum of stages {stages:?} (replica {})", self.replica)))
            }
        }
    }

    /// A sum of `tensors` over `members` by this link's [`Reduction`].
    fn sum_tensors(&mut self, members: &[usize], tags: (i32, i32), what: &str, tensors: Vec<Tensor>) -> Result<Vec<Tensor>, String> {
        match self.reduction {
            Reduction::Collective => self.collective_sum(members, tags, what, tensors),
            Reduction::FixedOrder => self.reduce_tensors(members, tags, what, tensors),
        }
    }

    /// Sends `bytes` to `to` without waiting for it to be received.
    fn isend(&mut self, to: usize, tag: i32, bytes: Vec<u8>) -> Result<(), String> {
        if bytes.len() > i32::MAX as usize {
            return Err(format!("a message to {} of {} bytes exceeds MPI's 2 GiB per message", self.layout.who(to), bytes.len()));
        }
        let buf: *mut [u8] = Box::into_raw(bytes.into_boxed_slice());
        // SAFETY: `buf` stays allocated until the request completes (`reap`), or forever
        // when it never does.
        let view: &'static [u8] = unsafe { &*buf };
        let request = SimpleCommunicator::world().process_at_rank(to as i32).immediate_send_with_tag(StaticScope, view, tag);
        self.sends.push(PendingSend { request, buf });
        self.reap();
        Ok(())
    }

    /// Frees the buffers of completed sends.
    fn reap(&mut self) {
        let sends = std::mem::take(&mut self.sends);
        for s in sends {
            match s.request.test() {
                Ok(_) => {
                    // SAFETY: the request has completed: MPI no longer reads the buffer.
                    drop(unsafe { Box::from_raw(s.buf) });
                }
                Err(request) => self.sends.push(PendingSend { request, buf: s.buf }),
            }
        }
    }

    /// The next message with `tag` from `from`, within the timeout; `what` says what it
    /// carries (for the error and the heartbeat's message).
    fn recv(&mut self, from: usize, tag: i32, what: &str) -> Result<Vec<u8>, String> {
        let whom = self.layout.who(from);
        self.shared.set_waiting(Some(format!("{what} from {whom}")));
        let deadline = Instant::now() + self.timeout;
        let world = SimpleCommunicator::world();
        let process = world.process_at_rank(from as i32);
        let mut pause = Backoff::new();
        loop {
            if let Some(m) = process.immediate_matched_probe_with_tag(tag) {
                let bytes = receive_bytes(m);
                self.shared.set_waiting(None);
                self.reap();
                return Ok(bytes);
            }
            if Instant::now() >= deadline {
                self.shared.set_waiting(None);
                return Err(format!("waited {} s (--timeout) for {what} from {whom}, which sent nothing", self.timeout.as_secs_f64()));
            }
            self.reap();
            pause.wait();
        }
    }

    /// A reduction over `members` (ranks, in summing order; this rank among them): the
    /// first gathers every part, combines them in member order and sends the result back.
    fn reduce(&mut self, members: &[usize], tags: (i32, i32), what: &str, mine: Wire, combine: impl FnOnce(Vec<Wire>) -> Result<Wire, String>) -> Result<Wire, String> {
        let seq = self.next_seq(group_key(tags.0, members));
        let root = members[0];
        if self.rank == root {
            let mut parts = vec![mine];
            for &r in &members[1..] {
                let part = Wire::decode(&self.recv(r, tags.0, &format!("its part of the {what}"))?).map_err(|e| format!("{what}: from {}: {e}", self.layout.who(r)))?;
                if part.a != seq {
                    return Err(format!("{what}: {} sent its part of reduction {} where {seq} was due (the ranks run different schedules)", self.layout.who(r), part.a));
                }
                parts.push(part);
            }
            let mut result = combine(parts).map_err(|e| format!("{what}: {e}"))?;
            result.a = seq;
            let bytes = result.encode()?;
            for &r in &members[1..] {
                self.isend(r, tags.1, bytes.clone())?;
            }
            Ok(result)
        } else {
            let mut mine = mine;
            mine.a = seq;
            self.isend(root, tags.0, mine.encode()?)?;
            let result = Wire::decode(&self.recv(root, tags.1, &format!("the result of the {what}"))?).map_err(|e| format!("{what}: from {}: {e}", self.layout.who(root)))?;
            if result.a != seq {
                return Err(format!("{what}: {} sent the result of reduction {} where {seq} was due", self.layout.who(root), result.a));
            }
            Ok(result)
        }
    }

    fn reduce_tensors(&mut self, members: &[usize], tags: (i32, i32), what: &str, tensors: Vec<Tensor>) -> Result<Vec<Tensor>, String> {
        let mine = Wire { a: 0, value: 0.0, text: Vec::new(), tensors: tensors.into_iter().map(|t| (String::new(), t)).collect() };
        let combine = |parts: Vec<Wire>| -> Result<Wire, String> {
            let lists: Vec<Vec<Tensor>> = parts.into_iter().map(|w| w.tensors.into_iter().map(|(_, t)| t).collect()).collect();
            let sum = sum_lists(lists)?;
            Ok(Wire { a: 0, value: 0.0, text: Vec::new(), tensors: sum.into_iter().map(|t| (String::new(), t)).collect() })
        };
        let r = self.reduce(members, tags, what, mine, combine)?;
        Ok(r.tensors.into_iter().map(|(_, t)| t).collect())
    }

    /// Compares this rank's run configuration (`name` -> value) with rank 0's, every rank
    /// at once (collective): `Err` naming the first difference (by rank, then name) on
    /// every rank when any rank differs. `Ok`: the job's id (rank 0's process id), which
    /// names the job's temporary checkpoint folders, and rank 0's clock at the agreement,
    /// the origin every rank's trace counts from (so that traces of ranks on one host, or
    /// on hosts with synchronised clocks, line up).
    pub fn agree(&mut self, config: &BTreeMap<String, String>) -> Result<Agreed, String> {
        let text: Vec<String> = config.iter().flat_map(|(k, v)| [k.clone(), v.clone()]).collect();
        let mine = Wire { a: 0, value: 0.0, text, tensors: Vec::new() };
        let layout = self.layout;
        let members: Vec<usize> = (0..layout.size()).collect();
        let combine = |parts: Vec<Wire>| -> Result<Wire, String> {
            let maps: Vec<BTreeMap<String, String>> = parts.iter().map(|w| w.text.chunks(2).filter(|c| c.len() == 2).map(|c| (c[0].clone(), c[1].clone())).collect()).collect();
            let verdict = first_difference(&maps, &layout).unwrap_or_default();
            let clock = SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or_default().as_micros();
            Ok(Wire { a: 0, value: 0.0, text: vec![verdict, std::process::id().to_string(), clock.to_string()], tensors: Vec::new() })
        };
        let verdict = self.reduce(&members, (AGREE_PART, AGREE_RESULT), "agreement on the run configuration", mine, combine)?;
        match &verdict.text[..] {
            [v, _, _] if !v.is_empty() => Err(v.clone()),
            [_, job, clock] => {
                let job = job.parse().map_err(|_| format!("rank 0 sent job id {job:?}"))?;
                let clock: u64 = clock.parse().map_err(|_| format!("rank 0 sent clock {clock:?}"))?;
                Ok(Agreed { job, clock: UNIX_EPOCH + Duration::from_micros(clock) })
            }
            _ => Err("rank 0 sent a malformed agreement".into()),
        }
    }

    /// Replica 0's ranks, at each checkpoint step: writes this stage's part of checkpoint
    /// `step` into the job's temporary folder under `dir` (a folder every rank reaches,
    /// e.g. on a shared file system); rank 0 then collects every stage's part (their
    /// checksums, or the error a rank met) and commits the manifest, returning the
    /// checkpoint's folder (`None` on the other ranks).
    #[allow(clippy::too_many_arguments)]
    pub fn checkpoint(
        &mut self,
        dir: &Path,
        step: u64,
        job: u32,
        state: &super::StageState,
        schedule: pipewright_core::Schedule,
        pipeline: &str,
        config: &BTreeMap<String, String>,
    ) -> Result<Option<PathBuf>, String> {
        // A failure names the host: each rank writes where it runs (its own disk, or its
        // mount of a shared one).
        let mine = write_stage_part(dir, step, job, state).map_err(|e| format!("on host {}: {e}", self.shared.host));
        if self.rank != 0 {
            let text = match &mine {
                Ok(p) => vec![p.file.clone(), p.checksum.clone(), p.size.to_string()],
                Err(e) => vec![e.clone()],
            };
            self.isend(0, CHECKPOINT, Wire { a: step, value: 0.0, text, tensors: Vec::new() }.encode()?)?;
            return mine.map(|_| None);
        }
        let mut parts = Vec::new();
        let mut failed = mine.as_ref().err().map(|e| format!("{}: {e}", self.layout.who(0)));
        parts.extend(mine.ok());
        for k in 1..self.layout.depth {
            let from = self.layout.rank(0, k);
            let w = Wire::decode(&self.recv(from, CHECKPOINT, &format!("its part of checkpoint step {step}"))?).map_err(|e| format!("from {}: {e}", self.layout.who(from)))?;
            if w.a != step {
                return Err(format!("{} sent its part of checkpoint step {} where step {step} was due", self.layout.who(from), w.a));
            }
            match &w.text[..] {
                [file, checksum, size] => match size.parse() {
                    Ok(size) => parts.push(StagePart { file: file.clone(), checksum: checksum.clone(), size }),
                    Err(_) => failed = failed.or(Some(format!("{} reported a malformed part", self.layout.who(from)))),
                },
                [e] => failed = failed.or(Some(format!("{}: {e}", self.layout.who(from)))),
                _ => failed = failed.or(Some(format!("{} reported a malformed part", self.layout.who(from)))),
            }
        }
        if let Some(e) = failed {
            discard_parts(dir, step, job);
            return Err(format!("checkpoint step {step} was not written: {e}"));
        }
        commit_parts(dir, step, job, schedule, pipeline, config, parts).map(Some).map_err(|e| format!("{} on host {}: {e}", self.layout.who(0), self.shared.host))
    }

    /// Every rank's `tensors` (named), gathered on rank 0 in rank order (collective: stage
    /// `k` of replica `r` at [`Layout::rank`]`(r, k)`): rank 0 gets `Some`, the others `None`.
    pub fn gather_to_first(&mut self, tensors: Named, what: &str) -> Result<Option<Vec<Named>>, String> {
        if self.rank != 0 {
            let bytes = Wire { a: 0, value: 0.0, text: Vec::new(), tensors }.encode()?;
            self.isend(0, GATHER_PART, bytes)?;
            return Ok(None);
        }
        let mut all = vec![tensors];
        for r in 1..self.layout.size() {
            let w = Wire::decode(&self.recv(r, GATHER_PART, what)?).map_err(|e| format!("{what}: from {}: {e}", self.layout.who(r)))?;
            all.push(w.tensors);
        }
        Ok(Some(all))
    }

    /// Whether this rank reports the job's steps (progress, metrics, the loss of every
    /// replica): the last stage of replica 0.
    pub fn reports_steps(&self) -> bool {
        self.rank == self.layout.rank(0, self.layout.depth - 1)
    }

    /// On a last stage: the report of step `r.step` over every replica. The reporting rank
    /// ([`Mpi::reports_steps`]) takes the other replicas' reports of the step and merges
    /// them as the embedded executor does (mean loss, summed in replica order; samples
    /// summed; skipped anywhere is skipped), returning `Some`; the others send theirs to it
    /// and get `None`.
    pub fn merge_step(&mut self, r: super::StepReport) -> Result<Option<super::StepReport>, String> {
        let w = self.layout.replicas;
        if w == 1 {
            return Ok(Some(r));
        }
        let reporter = self.layout.rank(0, self.layout.depth - 1);
        if !self.reports_steps() {
            let text = vec![r.samples.to_string(), r.skipped.to_string()];
            let bytes = Wire { a: r.step as u64, value: r.loss, text, tensors: Vec::new() }.encode()?;
            self.isend(reporter, STEP, bytes)?;
            return Ok(None);
        }
        let (mut sum, mut samples, mut skipped) = (r.loss, r.samples, r.skipped);
        for replica in 1..w {
            let from = self.layout.rank(replica, self.layout.depth - 1);
            let part = Wire::decode(&self.recv(from, STEP, &format!("the loss of step {}", r.step + 1))?).map_err(|e| format!("from {}: {e}", self.layout.who(from)))?;
            let parsed = match &part.text[..] {
                [n, s] => n.parse::<usize>().ok().zip(s.parse::<bool>().ok()),
                _ => None,
            };
            let Some((n, s)) = parsed.filter(|_| part.a == r.step as u64) else {
                return Err(format!("{} sent a malformed report of step {} (expected step {})", self.layout.who(from), part.a + 1, r.step + 1));
            };
            sum += part.value;
            samples += n;
            skipped |= s;
        }
        Ok(Some(super::StepReport { loss: sum / w as f64, samples, skipped, ..r }))
    }

    /// Waits (up to the timeout) until every send has been received, so that this process
    /// may end.
    fn flush(&mut self) {
        let deadline = Instant::now() + self.timeout;
        let mut pause = Backoff::new();
        while !self.sends.is_empty() && Instant::now() < deadline {
            self.reap();
            pause.wait();
        }
    }
}

/// A fingerprint of a batch (every microbatch's inputs by name and its labels): ranks
/// reading different data, or the same data in another order, disagree on it.
pub fn batch_fingerprint(batch: &[super::Microbatch]) -> Result<String, String> {
    let mut h = crc32fast::Hasher::new();
    for mb in batch {
        for (name, t) in mb.inputs.iter().map(|(n, t)| (n.as_str(), t)).chain(mb.labels.iter().map(|l| ("(labels)", l))) {
            let (elem, dims, data) = tensor_to_bytes(t).map_err(|e| format!("data {name:?}: {e}"))?;
            h.update(name.as_bytes());
            h.update(elem.name().as_bytes());
            dims.iter().for_each(|d| h.update(&d.to_le_bytes()));
            h.update(&data);
        }
    }
    Ok(format!("{} microbatches, crc32 {:08x} of the first batch", batch.len(), h.finalize()))
}

/// The first rank (after 0) whose configuration differs from rank 0's, and how.
fn first_difference(maps: &[BTreeMap<String, String>], layout: &Layout) -> Option<String> {
    let first = maps.first()?;
    for (r, m) in maps.iter().enumerate().skip(1) {
        let keys: std::collections::BTreeSet<&String> = first.keys().chain(m.keys()).collect();
        for k in keys {
            let (a, b) = (first.get(k), m.get(k));
            if a != b {
                let show = |v: Option<&String>| v.map_or("nothing".to_string(), |v| format!("{k} {v}"));
                return Some(format!(
                    "the ranks were started with different settings: {} has {} where {} has {}; start every rank with the same options",
                    layout.who(r),
                    show(b),
                    layout.who(0),
                    show(a)
                ));
            }
        }
    }
    None
}

impl Drop for Mpi {
    fn drop(&mut self) {
        if !self.aborted {
            self.flush();
        }
        // Sends that never completed keep their buffers: MPI may still read them.
        for s in self.sends.drain(..) {
            std::mem::forget(s.request);
        }
        // So does a sum never finished (the job is failing).
        for (_, sum) in self.in_flight.drain() {
            sum.pending.abandon();
        }
        self.shared.set_waiting(None);
    }
}

impl Transport for Mpi {
    fn send_forward(&mut self, mb: u64, tensors: Named) -> Result<(), String> {
        if self.stage as usize + 1 >= self.layout.depth {
            return Err("no next neighbour".into());
        }
        let bytes = Wire { a: mb, value: 0.0, text: Vec::new(), tensors }.encode()?;
        let to = self.layout.rank(self.replica, self.stage as usize + 1);
        self.isend(to, FORWARD, bytes)
    }
    fn send_stop(&mut self, mb: u64) -> Result<(), String> {
        if self.stage as usize + 1 >= self.layout.depth {
            return Err("no next neighbour".into());
        }
        let bytes = Wire { a: mb, value: 0.0, text: vec![STOP_MARKER.into()], tensors: Vec::new() }.encode()?;
        let to = self.layout.rank(self.replica, self.stage as usize + 1);
        self.isend(to, FORWARD, bytes)
    }
    fn recv_forward(&mut self, mb: u64) -> Result<Option<Named>, String> {
        if self.stage == 0 {
            return Err("no previous neighbour".into());
        }
        let from = self.layout.rank(self.replica, self.stage as usize - 1);
        let w = Wire::decode(&self.recv(from, FORWARD, &format!("microbatch {mb}'s activations"))?).map_err(|e| format!("from {}: {e}", self.layout.who(from)))?;
        if w.a != mb {
            return Err(format!("expected microbatch {mb}'s activations from {}, got microbatch {}'s", self.layout.who(from), w.a));
        }
        Ok(if w.text.iter().any(|t| t == STOP_MARKER) { None } else { Some(w.tensors) })
    }
    fn send_backward(&mut self, mb: u64, grads: Named) -> Result<(), String> {
        if self.stage == 0 {
            return Err("no previous neighbour".into());
        }
        let bytes = Wire { a: mb, value: 0.0, text: Vec::new(), tensors: grads }.encode()?;
        let to = self.layout.rank(self.replica, self.stage as usize - 1);
        self.isend(to, BACKWARD, bytes)
    }
    fn recv_backward(&mut self, mb: u64) -> Result<Named, String> {
        if self.stage as usize + 1 >= self.layout.depth {
            return Err("no next neighbour".into());
        }
        let from = self.layout.rank(self.replica, self.stage as usize + 1);
        let w = Wire::decode(&self.recv(from, BACKWARD, &format!("microbatch {mb}'s gradients"))?).map_err(|e| format!("from {}: {e}", self.layout.who(from)))?;
        if w.a != mb {
            return Err(format!("expected microbatch {mb}'s gradients from {}, got microbatch {}'s", self.layout.who(from), w.a));
        }
        Ok(w.tensors)
    }
    fn all_reduce_sum(&mut self, x: f64) -> Result<f64, String> {
        // Not rank order: the embedded executor's order (replica-major, then stage), whose
        // first member is rank 0 all the same.
        let members = self.layout.summing_order();
        let mine = Wire { a: 0, value: x, text: Vec::new(), tensors: Vec::new() };
        let combine = |parts: Vec<Wire>| -> Result<Wire, String> { Ok(Wire { a: 0, value: parts.into_iter().map(|w| w.value).sum(), text: Vec::new(), tensors: Vec::new() }) };
        Ok(self.reduce(&members, (SUM_PART, SUM_RESULT), "gradient-norm sum of every stage", mine, combine)?.value)
    }
    fn all_reduce_replicas(&mut self, tensors: Vec<Tensor>) -> Result<Vec<Tensor>, String> {
        if self.layout.replicas == 1 {
            return Ok(tensors);
        }
        let (members, tags, what) = self.sum_group(&SumGroup::Replicas)?;
        self.sum_tensors(&members, tags, &what, tensors)
    }
    fn all_reduce_tied(&mut self, stages: &[u32], tensors: Vec<Tensor>) -> Result<Vec<Tensor>, String> {
        let (members, tags, what) = self.sum_group(&SumGroup::Tied(stages.to_vec()))?;
        self.sum_tensors(&members, tags, &what, tensors)
    }
    fn abort(&mut self) {
        // The process stops the job (MPI_Abort) once it has printed why; nothing here may
        // wait for peers.
        self.aborted = true;
    }
    fn begin_sum(&mut self, group: &SumGroup, tensors: Vec<Tensor>) -> Result<Option<Vec<Tensor>>, String> {
        let (members, tags, what) = self.sum_group(group)?;
        if members.len() == 1 || self.reduction == Reduction::FixedOrder {
            return self.sum_tensors(&members, tags, &what, tensors).map(Some);
        }
        if self.in_flight.contains_key(group) {
            return Err(format!("{what}: begun while the last one was in flight"));
        }
        match self.begin_collective(&members, tags, &what, tensors)? {
            Begun::Done(sum) => Ok(Some(sum)),
            Begun::InFlight(sum) => {
                self.in_flight.insert(group.clone(), sum);
                Ok(None)
            }
        }
    }
    fn sums_in_background(&self, group: &SumGroup) -> bool {
        self.reduction == Reduction::Collective || self.sum_group(group).is_ok_and(|(members, ..)| members.len() == 1)
    }
    /// Under MPI's all-reduce, makes the communicator of each group with other members
    /// before the first step, so that no step pays for it. `MPI_Comm_create_group` blocks
    /// until every member calls it, so every rank makes its groups in one global order
    /// (by their ranks): the least group anyone waits in has all its members there.
    fn prepare_sums(&mut self, groups: &[SumGroup]) -> Result<(), String> {
        if self.reduction != Reduction::Collective {
            return Ok(());
        }
        let mut made = groups.iter().map(|g| self.sum_group(g)).collect::<Result<Vec<_>, _>>()?;
        made.retain(|(members, ..)| members.len() > 1);
        made.sort_by_key(|(members, ..)| {
            let mut key = members.clone();
            key.sort_unstable();
            key
        });
        made.iter().try_for_each(|(members, _, what)| self.make_communicator(members, what))
    }
    fn finish_sum(&mut self, group: &SumGroup) -> Result<Vec<Tensor>, String> {
        let sum = self.in_flight.remove(group).ok_or_else(|| format!("no {group} is in flight"))?;
        self.finish_collective(sum)
    }
    fn sum_done(&mut self, group: &SumGroup) -> bool {
        self.in_flight.get_mut(group).is_none_or(|s| s.pending.poll())
    }
}


/// A member's note that it began reduction `seq` of the group `group` ([`group_key`]).
fn note_bytes(group: u64, seq: u64) -> Vec<u8> {
    let mut b = seq.to_le_bytes().to_vec();
    b.extend(group.to_le_bytes());
    b
}

fn parse_note(b: &[u8]) -> Option<(u64, u64)> {
    let seq = u64::from_le_bytes(b.get(..8)?.try_into().ok()?);
    let group = u64::from_le_bytes(b.get(8..16)?.try_into().ok()?);
    Some((group, seq))
}

/// A group's key: the tag its kind of reduction goes on and its members, hashed (a
/// rank's groups of one kind differ in members).
fn group_key(tag: i32, members: &[usize]) -> u64 {
    members.iter().fold(tag as u64, |h, &r| h.wrapping_mul(1_000_003).wrapping_add(r as u64 + 1))
}

/// A sum [`Mpi::begin_collective`] began: done at once (the fixed order's kinds), or in
/// flight.
enum Begun {
    Done(Vec<Tensor>),
    InFlight(InFlightSum),
}

/// What finishing an all-reduce in flight needs.
struct InFlightSum {
    members: Vec<usize>,
    others: Vec<usize>,
    group: u64,
    seq: u64,
    what: String,
    shapes: Vec<Vec<i64>>,
    device: tch::Device,
    pending: PendingSum,
}

/// A communicator of a group of ranks, owned by one [`Mpi`].
struct GroupComm(SimpleCommunicator);

// SAFETY: an MPI handle; MPI_THREAD_MULTIPLE makes it usable from any thread, and the one
// `Mpi` that owns it uses it from one thread at a time.
unsafe impl Send for GroupComm {}

/// An all-reduce in flight: MPI reads `send` and writes `recv` until it completes, so the
/// tensors live as long as the request.
struct PendingSum {
    /// `None` once complete.
    request: Option<SumRequest>,
    send: Tensor,
    recv: Tensor,
}

// SAFETY: the request is an MPI handle (MPI_THREAD_MULTIPLE makes it usable from any
// thread) and the tensors are owned by this value alone; the one `Mpi` holding it uses it
// from one thread at a time.
unsafe impl Send for PendingSum {}

impl PendingSum {
    /// Whether the sum is complete (asking MPI, which also advances it).
    fn poll(&mut self) -> bool {
        match self.request.take().map(SumRequest::test) {
            None | Some(Ok(())) => true,
            Some(Err(r)) => {
                self.request = Some(r);
                false
            }
        }
    }

    /// Leaves the request and its tensors to MPI: never completed (the job is ending), and
    /// never freed while MPI may still touch them.
    fn abandon(self) {
        if let Some(r) = self.request {
            r.abandon();
        }
        std::mem::forget(self.send);
        std::mem::forget(self.recv);
    }
}

/// The request of an all-reduce of `f32` or `f64` elements.
enum SumRequest {
    F32(Request<'static, [f32]>),
    F64(Request<'static, [f64]>),
}

impl SumRequest {
    /// `Ok` once complete; the request back while not.
    fn test(self) -> Result<(), SumRequest> {
        match self {
            SumRequest::F32(r) => r.test().map(drop).map_err(SumRequest::F32),
            SumRequest::F64(r) => r.test().map(drop).map_err(SumRequest::F64),
        }
    }

    /// Leaves the request to MPI (the job is ending; it is never completed).
    fn abandon(self) {
        match self {
            SumRequest::F32(r) => std::mem::forget(r),
            SumRequest::F64(r) => std::mem::forget(r),
        }
    }
}

impl Mpi {
    /// Sums `tensors` over the ranks `members` (this rank among them) with
    /// [`Reduction::Collective`]; `tags.0` counts the group's reductions, as the fixed
    /// order's do. Kinds MPI cannot add (bf16, fp16) take the fixed order, alike on every
    /// member (they hold the same weights).
    fn collective_sum(&mut self, members: &[usize], tags: (i32, i32), what: &str, tensors: Vec<Tensor>) -> Result<Vec<Tensor>, String> {
        match self.begin_collective(members, tags, what, tensors)? {
            Begun::Done(sum) => Ok(sum),
            Begun::InFlight(sum) => self.finish_collective(sum),
        }
    }

    /// Begins a [`Mpi::collective_sum`]: this member's note that it has begun goes to the
    /// others (so that a sum that never completes names the members that had not), and the
    /// packed tensors to `MPI_Iallreduce`.
    fn begin_collective(&mut self, members: &[usize], tags: (i32, i32), what: &str, tensors: Vec<Tensor>) -> Result<Begun, String> {
        let Some(kind) = tensors.first().map(Tensor::kind) else { return Ok(Begun::Done(tensors)) };
        if !matches!(kind, Kind::Float | Kind::Double) || tensors.iter().any(|t| t.kind() != kind) {
            return self.reduce_tensors(members, tags, what, tensors).map(Begun::Done);
        }
        let group = group_key(tags.0, members);
        let seq = self.next_seq(group);
        self.make_communicator(members, what)?;
        let me = self.rank;
        let others: Vec<usize> = members.iter().copied().filter(|&r| r != me).collect();
        for &r in &others {
            self.isend(r, REDUCE_NOTE, note_bytes(group, seq))?;
        }
        let torch = |e: tch::TchError| format!("{what}: {e}");
        let flat: Vec<Tensor> = tensors.iter().map(|t| t.f_reshape([-1])).collect::<Result<_, _>>().map_err(torch)?;
        let send = Tensor::f_cat(&flat, 0).and_then(|t| t.f_to_device(tch::Device::Cpu)).and_then(|t| t.f_contiguous()).map_err(torch)?;
        if send.numel() > i32::MAX as usize {
            return Err(format!("{what}: {} gradient elements exceed MPI's count of 2^31 - 1 per all-reduce (split the stage: compile with more stages)", send.numel()));
        }
        let recv = send.f_empty_like().map_err(torch)?;
        let pending = start_sum(&self.comms[members].0, send, recv);
        let shapes = tensors.iter().map(Tensor::size).collect();
        Ok(Begun::InFlight(InFlightSum { members: members.to_vec(), others, group, seq, what: what.to_string(), shapes, device: tensors[0].device(), pending }))
    }

    /// Waits (up to the timeout) for a sum [`Mpi::begin_collective`] began, and takes the
    /// other members' notes of it.
    fn finish_collective(&mut self, sum: InFlightSum) -> Result<Vec<Tensor>, String> {
        let InFlightSum { members, others, group, seq, what, shapes, device, pending } = sum;
        let recv = match self.poll_sum(pending, &what) {
            Ok(recv) => recv,
            Err(waited) => return Err(self.late_members(&members, group, seq, &what, waited)),
        };
        for &r in &others {
            self.await_note(r, group, seq, &what)?;
        }
        let torch = |e: tch::TchError| format!("{what}: {e}");
        let sizes: Vec<i64> = shapes.iter().map(|s| s.iter().product()).collect();
        let parts = recv.f_split_with_sizes(&sizes, 0).map_err(torch)?;
        parts.into_iter().zip(&shapes).map(|(p, s)| p.f_view(s.as_slice()).and_then(|p| p.f_to_device(device))).collect::<Result<_, _>>().map_err(torch)
    }

    /// Receives `member`'s notes until the one of reduction `seq` of group `group` (notes
    /// of other sums in flight are kept for their turn).
    fn await_note(&mut self, member: usize, group: u64, seq: u64, what: &str) -> Result<(), String> {
        while !self.notes.remove(&(member, group, seq)) {
            let note = self.recv(member, REDUCE_NOTE, &format!("its note that it began the {what}"))?;
            let (g, s) = parse_note(&note).ok_or_else(|| format!("{what}: {} sent a malformed note", self.layout.who(member)))?;
            if g == group && s > seq {
                return Err(format!("{what}: {} began reduction {s} where {seq} was due (the ranks run different schedules)", self.layout.who(member)));
            }
            self.notes.insert((member, g, s));
        }
        Ok(())
    }

    /// The reduction number `group` ([`group_key`]) has reached (counted from 0).
    fn next_seq(&mut self, group: u64) -> u64 {
        let s = self.seq.entry(group).or_insert(0);
        *s += 1;
        *s - 1
    }

    /// The communicator of the ranks `members`, made by them alone
    /// (`MPI_Comm_create_group`; before the first step, [`Transport::prepare_sums`]) and
    /// kept for the job.
    fn make_communicator(&mut self, members: &[usize], what: &str) -> Result<(), String> {
        if self.comms.contains_key(members) {
            return Ok(());
        }
        let world = SimpleCommunicator::world();
        let ranks: Vec<i32> = members.iter().map(|&r| r as i32).collect();
        let group = world.group().include(&ranks);
        let tag = group_tag(members);
        let comm = world.split_by_subgroup_with_tag(&group, tag).ok_or_else(|| format!("{what}: MPI made no communicator of ranks {members:?}"))?;
        self.comms.insert(members.to_vec(), GroupComm(comm));
        Ok(())
    }

    /// Polls `pending` until it completes (its result) or the timeout passes (the seconds
    /// waited; the request and its tensors are abandoned to MPI: the job is ending).
    fn poll_sum(&mut self, pending: PendingSum, what: &str) -> Result<Tensor, f64> {
        let start = Instant::now();
        let mut pending = pending;
        self.shared.set_waiting(Some(format!("the {what} (MPI all-reduce)")));
        let mut pause = Backoff::new();
        loop {
            if pending.poll() {
                self.shared.set_waiting(None);
                return Ok(pending.recv);
            }
            if start.elapsed() >= self.timeout {
                pending.abandon();
                return Err(start.elapsed().as_secs_f64());
            }
            self.reap();
            pause.wait();
        }
    }

    /// The error for reduction `seq` of group `group` (`members`) that did not complete in
    /// `waited` seconds, naming the members whose note that they had begun it has not come.
    fn late_members(&mut self, members: &[usize], group: u64, seq: u64, what: &str, waited: f64) -> String {
        let world = SimpleCommunicator::world();
        let mut late = Vec::new();
        for &r in members.iter().filter(|&&r| r != self.rank) {
            while let Some(m) = world.process_at_rank(r as i32).immediate_matched_probe_with_tag(REDUCE_NOTE) {
                if let Some((g, s)) = parse_note(&receive_bytes(m)) {
                    self.notes.insert((r, g, s));
                }
            }
            if !self.notes.contains(&(r, group, seq)) {
                late.push(self.layout.who(r));
            }
        }
        let who = if late.is_empty() { "every member had begun it, and MPI did not complete it".to_string() } else { format!("not begun by {}", late.join(", ")) };
        format!("waited {waited:.0} s (--timeout) for the {what} over MPI's all-reduce: {who}")
    }
}

/// Starts the sum of `send` (contiguous, on the host, `f32` or `f64`) into `recv` (alike)
/// over `comm`.
fn start_sum(comm: &SimpleCommunicator, send: Tensor, recv: Tensor) -> PendingSum {
    let request = match send.kind() {
        Kind::Double => SumRequest::F64(start_typed(comm, &send, &recv)),
        _ => SumRequest::F32(start_typed(comm, &send, &recv)),
    };
    PendingSum { request: Some(request), send, recv }
}

fn start_typed<T: Equivalence + 'static>(comm: &SimpleCommunicator, send: &Tensor, recv: &Tensor) -> Request<'static, [T]> {
    let n = send.numel();
    // SAFETY: `send` and `recv` are contiguous host tensors of `n` elements of `T` (the
    // caller's kind check), kept alive with the request ([`PendingSum`]) or leaked with
    // it; MPI writes only `recv`, which nothing else reads until the request completes.
    let (s, r): (&'static [T], &'static mut [T]) = unsafe { (std::slice::from_raw_parts(send.data_ptr() as *const T, n), std::slice::from_raw_parts_mut(recv.data_ptr() as *mut T, n)) };
    comm.immediate_all_reduce_into(StaticScope, s, r, SystemOperation::sum())
}

/// The tag on which the ranks of `members` make their communicator: one per group (a
/// rank makes several, and its partners in one may be making another at that moment).
fn group_tag(members: &[usize]) -> i32 {
    let h = members.iter().fold(17u64, |h, &r| h.wrapping_mul(1_000_003).wrapping_add(r as u64 + 1));
    GROUP_TAGS + (h % (1 << 14)) as i32
}

/// Evaluation runs through replica 0's stages, on a tag of its own so that its
/// activations never match the training's (which flow at the same time).
impl EvalLink for Mpi {
    fn send_activations(&mut self, index: u64, tensors: Named) -> Result<(), String> {
        if self.stage as usize + 1 >= self.layout.depth || self.replica != 0 {
            return Err("no next stage to evaluate on".into());
        }
        let bytes = Wire { a: index, value: 0.0, text: Vec::new(), tensors }.encode()?;
        self.isend(self.layout.rank(0, self.stage as usize + 1), EVAL_FORWARD, bytes)
    }
    fn recv_activations(&mut self, index: u64) -> Result<Named, String> {
        if self.stage == 0 || self.replica != 0 {
            return Err("no previous stage to evaluate after".into());
        }
        let from = self.layout.rank(0, self.stage as usize - 1);
        let w = Wire::decode(&self.recv(from, EVAL_FORWARD, &format!("evaluation microbatch {index}'s activations"))?).map_err(|e| format!("from {}: {e}", self.layout.who(from)))?;
        if w.a != index {
            return Err(format!("expected evaluation microbatch {index}'s activations from {}, got microbatch {}'s", self.layout.who(from), w.a));
        }
        Ok(w.tensors)
    }
}

/// The turns of a worker whose stages are ranks of their own (interleaved 1F1B, ZB-V over
/// MPI): the ranks of one worker's stages, in one replica, each keep the worker's count of
/// passed turns, and the rank that passes a turn on tells the others the new count. Each
/// rank waits for the count its op's slot needs, so the worker's ranks compute one op at a
/// time in the worker's order, as the embedded executor's stage threads do. Counts only
/// grow: a rank keeps the largest it was told, whatever order its peers' notes arrive in.
pub struct MpiTurns {
    link: Mpi,
    /// The other ranks running stages of this rank's worker (this replica's).
    peers: Vec<usize>,
    passed: usize,
    abandoned_by: Option<usize>,
}

impl MpiJob {
    /// This rank's link to the other stages of its worker when `schedule` runs several
    /// stages per worker (`None` otherwise), for a job of `layout`'s shape.
    pub fn turn_link(&self, layout: Layout, schedule: pipewright_core::Schedule, timeout: Duration) -> Result<Option<MpiTurns>, String> {
        if schedule.virtual_stages() == 1 {
            return Ok(None);
        }
        let link = self.transport(layout, timeout)?;
        let (replica, stage) = layout.place(link.rank);
        let worker = schedule.worker_of(stage, layout.depth);
        let peers = schedule.stages_of(worker, layout.depth).into_iter().filter(|&k| k != stage).map(|k| layout.rank(replica, k)).collect();
        Ok(Some(MpiTurns { link, peers, passed: 0, abandoned_by: None }))
    }
}

impl MpiTurns {
    /// Takes the turn notes that have arrived, without waiting; `true` when any did.
    fn take_notes(&mut self) -> Result<bool, String> {
        let world = SimpleCommunicator::world();
        let mut any = false;
        while let Some(m) = world.any_process().immediate_matched_probe_with_tag(TURN) {
            let from = m.1.source_rank() as usize;
            let note = Wire::decode(&receive_bytes(m)).map_err(|e| format!("a turn note from {}: {e}", self.link.layout.who(from)))?;
            if note.text.iter().any(|t| t == ABANDONED) {
                self.abandoned_by.get_or_insert(note.a as usize);
            } else {
                self.passed = self.passed.max(note.a as usize);
            }
            any = true;
        }
        Ok(any)
    }

    fn tell_peers(&mut self, note: Wire) {
        let Ok(bytes) = note.encode() else { return };
        for to in self.peers.clone() {
            // A peer gone is the launcher's to report; the note cannot help it then.
            let _ = self.link.isend(to, TURN, bytes.clone());
        }
    }
}

impl TurnLink for MpiTurns {
    fn wait(&mut self, reached: &dyn Fn(usize) -> bool) -> Result<(), String> {
        if reached(self.passed) {
            return Ok(());
        }
        let peers: Vec<String> = self.peers.iter().map(|&r| self.link.layout.who(r)).collect();
        let what = format!("its turn on its worker (shared with {})", peers.join(", "));
        self.link.shared.set_waiting(Some(what.clone()));
        let deadline = Instant::now() + self.link.timeout;
        let mut pause = Backoff::new();
        let outcome = loop {
            match self.take_notes() {
                Err(e) => break Err(e),
                Ok(true) if reached(self.passed) => break Ok(()),
                Ok(_) => {}
            }
            if let Some(k) = self.abandoned_by {
                break Err(abandoned(k));
            }
            if Instant::now() >= deadline {
                break Err(format!("waited {} s (--timeout) for {what}", self.link.timeout.as_secs_f64()));
            }
            self.link.reap();
            pause.wait();
        };
        self.link.shared.set_waiting(None);
        outcome
    }

    fn pass(&mut self) {
        self.passed += 1;
        self.tell_peers(Wire { a: self.passed as u64, value: 0.0, text: Vec::new(), tensors: Vec::new() });
    }

    fn abandon(&mut self, stage: usize) {
        self.tell_peers(Wire { a: stage as u64, value: 0.0, text: vec![ABANDONED.into()], tensors: Vec::new() });
    }
}

/// The text of a turn note that says its stage gave up its turns.
const ABANDONED: &str = "abandoned";

/// One message: a number (microbatch, or reduction sequence), a value, strings and named
/// tensors, in a little-endian layout read with bounds checks.
struct Wire {
    a: u64,
    value: f64,
    text: Vec<String>,
    tensors: Named,
}

const MAGIC: &[u8; 4] = b"PWM1";
/// A forward message's text when it is the stop marker ([`Transport::send_stop`]).
const STOP_MARKER: &str = "stop";

fn put(out: &mut Vec<u8>, b: &[u8]) {
    out.extend_from_slice(&(b.len() as u64).to_le_bytes());
    out.extend_from_slice(b);
}

struct Cursor<'a> {
    b: &'a [u8],
    at: usize,
}

impl<'a> Cursor<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], String> {
        let end = self.at.checked_add(n).filter(|&e| e <= self.b.len()).ok_or_else(|| format!("message truncated at byte {} (wanted {n} more)", self.at))?;
        let s = &self.b[self.at..end];
        self.at = end;
        Ok(s)
    }
    fn u64(&mut self) -> Result<u64, String> {
        let mut w = [0u8; 8];
        w.copy_from_slice(self.take(8)?);
        Ok(u64::from_le_bytes(w))
    }
    fn len(&mut self) -> Result<usize, String> {
        let n = self.u64()?;
        usize::try_from(n).ok().filter(|&n| n <= self.b.len() - self.at).ok_or_else(|| format!("message field of {n} bytes exceeds the message"))
    }
    fn bytes(&mut self) -> Result<&'a [u8], String> {
        let n = self.len()?;
        self.take(n)
    }
    fn string(&mut self) -> Result<String, String> {
        String::from_utf8(self.bytes()?.to_vec()).map_err(|_| "message string is not UTF-8".to_string())
    }
}

impl Wire {
    fn encode(&self) -> Result<Vec<u8>, String> {
        let mut out = Vec::new();
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&self.a.to_le_bytes());
        out.extend_from_slice(&self.value.to_le_bytes());
        out.extend_from_slice(&(self.text.len() as u64).to_le_bytes());
        for t in &self.text {
            put(&mut out, t.as_bytes());
        }
        out.extend_from_slice(&(self.tensors.len() as u64).to_le_bytes());
        for (name, t) in &self.tensors {
            // CUDA tensors come to host memory here (the MPI need not be CUDA-aware).
            let (elem, dims, data) = tensor_to_bytes(t).map_err(|e| format!("tensor {name:?}: {e}"))?;
            put(&mut out, name.as_bytes());
            put(&mut out, elem.name().as_bytes());
            out.extend_from_slice(&(dims.len() as u64).to_le_bytes());
            for d in dims {
                out.extend_from_slice(&d.to_le_bytes());
            }
            put(&mut out, &data);
        }
        Ok(out)
    }

    fn decode(b: &[u8]) -> Result<Wire, String> {
        let mut c = Cursor { b, at: 0 };
        if c.take(4)? != MAGIC {
            return Err("not a pipewright message".into());
        }
        let a = c.u64()?;
        let value = f64::from_bits(c.u64()?);
        let n_text = c.len()?;
        let text = (0..n_text).map(|_| c.string()).collect::<Result<_, _>>()?;
        let n = c.len()?;
        let mut tensors = Vec::new();
        for _ in 0..n {
            let name = c.string()?;
            let elem_name = c.string()?;
            let elem = DType::from_name(&elem_name).ok_or_else(|| format!("tensor {name:?}: unknown element type {elem_name:?}"))?;
            let nd = c.len()?;
            let dims = (0..nd).map(|_| c.u64().map(|d| d as i64)).collect::<Result<Vec<_>, _>>()?;
            let data = c.bytes()?;
            let t = tensor_from_bytes(elem, &dims, data).map_err(|e| format!("tensor {name:?}: {e}"))?;
            tensors.push((name, t));
        }
        Ok(Wire { a, value, text, tensors })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_round_trip_and_damaged_ones_are_errors() {
        let w = Wire { a: 7, value: -0.25, text: vec!["--steps".into(), "10".into()], tensors: vec![("x".into(), Tensor::from_slice(&[1.5f32, -2.0, 3.25]).reshape([3, 1]))] };
        let bytes = w.encode().unwrap();
        let back = Wire::decode(&bytes).unwrap();
        assert_eq!((back.a, back.value, back.text.clone()), (7, -0.25, w.text.clone()));
        assert_eq!(back.tensors[0].0, "x");
        assert!(back.tensors[0].1.equal(&w.tensors[0].1));
        let cuts = [
            (0, "message truncated at byte 0 (wanted 4 more)"),
            (3, "message truncated at byte 0 (wanted 4 more)"),
            (10, "message truncated at byte 4 (wanted 8 more)"),
            (30, "message truncated at byte 28 (wanted 8 more)"),
            (bytes.len() - 1, "message field of 12 bytes exceeds the message"),
        ];
        for (cut, want) in cuts {
            assert_eq!(Wire::decode(&bytes[..cut]).err().as_deref(), Some(want), "a message cut at {cut} bytes");
        }
        // A length field claiming far more than the message holds.
        let mut huge = bytes.clone();
        huge[20..28].copy_from_slice(&(1u64 << 40).to_le_bytes());
        assert!(matches!(Wire::decode(&huge), Err(e) if e.contains("exceeds the message")));
    }

    /// Ranks are stage-major: a stage's replicas on consecutive ranks; `place` inverts
    /// `rank`, and the everyone-sum keeps the embedded executor's replica-major order.
    #[test]
    fn ranks_are_stage_major_and_sums_keep_the_embedded_order() {
        let l = Layout::new(3, 2);
        let ranks: Vec<usize> = (0..3).flat_map(|k| (0..2).map(move |r| l.rank(r, k))).collect();
        assert_eq!(ranks, vec![0, 1, 2, 3, 4, 5]);
        assert_eq!((l.rank(1, 0), l.rank(0, 1)), (1, 2));
        for rank in 0..l.size() {
            let (r, k) = l.place(rank);
            assert_eq!(l.rank(r, k), rank);
        }
        assert_eq!(l.who(3), "rank 3 (stage 1, replica 1)");
        assert_eq!(l.who(1), "rank 1 (stage 0, replica 1)");
        assert_eq!(l.summing_order(), vec![0, 2, 4, 1, 3, 5]);
        // One replica: ranks are stages.
        let one = Layout::new(4, 1);
        assert_eq!((0..4).map(|k| one.rank(0, k)).collect::<Vec<_>>(), vec![0, 1, 2, 3]);
        assert_eq!(one.summing_order(), vec![0, 1, 2, 3]);
        // Replica-major: a pipeline's stages on consecutive ranks, the same summing pairs.
        let r = l.placed(pipewright_core::Placement::ReplicaMajor);
        assert_eq!((r.rank(1, 0), r.rank(0, 1)), (3, 1));
        assert_eq!(r.summing_order(), vec![0, 1, 2, 3, 4, 5]);
    }

    #[test]
    fn the_first_difference_names_the_rank_and_the_setting() {
        let layout = Layout::new(2, 2);
        let a: BTreeMap<String, String> = [("--steps", "10"), ("--seed", "0")].into_iter().map(|(k, v)| (k.into(), v.into())).collect();
        let mut b = a.clone();
        assert_eq!(first_difference(&[a.clone(), b.clone(), a.clone()], &layout), None);
        b.insert("--steps".into(), "20".into());
        let e = first_difference(&[a.clone(), a.clone(), a.clone(), b], &layout).unwrap();
        assert!(e.contains("rank 3 (stage 1, replica 1) has --steps 20 where rank 0 (stage 0, replica 0) has --steps 10"), "{e}");
    }
}
