//! Balancing workers that run several stages (interleaved 1F1B, ZB-V).
//!
//! [`PartitionProblem::optimal_partition`] minimises the slowest *stage*. When a worker
//! runs several stages, its rate is set by the sum of its stages' times, and a split whose
//! slowest stage is as fast as can be may still pair a heavy stage with a heavy one (under
//! ZB-V worker 0 runs the first and the last stage, which on a CNN are the stem and the
//! classifier's widest blocks). [`PartitionProblem::balance_workers`] starts from such a
//! split and lowers, in this order, the busiest worker's time, the sum of the squared
//! worker times and the slowest stage's time; every stage keeps fitting its memory model
//! and no stage gets slower than the start's slowest (balancing workers by leaving one
//! stage nearly empty beside a heavy one makes the schedules' hand-offs wait: their
//! orders assume stages of similar times, which replays showed). The result is never
//! worse than the start by the first measure.
//!
//! A worker's stages are not contiguous, so the partitioner's reachability DP does not
//! apply. Two steps instead:
//! 1. A descent: cuts move one at a time to the position that improves the measures most
//!    (a cut between two workers balances them, one between two stages of a worker
//!    balances those stages), anywhere between its neighbours when they are at most
//!    [`FULL_SCAN`] positions apart, else within [`WINDOW`] positions of the balancing
//!    point; sweeps stop when no cut moves or after [`MAX_SWEEPS`]. Alone it stalls where
//!    several cuts must move together (a heavy middle under ZB-V).
//! 2. A depth-first branch and bound over the stages' ends for a less busy busiest worker
//!    than the descent's (a worker's load and a stage's memory only grow as the stage
//!    grows; what is left must fit in what the later stages' workers have left), then the
//!    descent again from what it finds. It is exact when it finishes within
//!    [`SEARCH_STEPS`]; otherwise the best split found so far stands. The tests compare
//!    the result with an exhaustive search.

use std::cmp::Ordering;

use super::{stage_ranges, valid_cuts, PartitionProblem, PipelineMemory, Prefix, MEMORY_SLACK};

/// Positions tried on either side of a cut's balancing point (nodes of zero time make
/// several positions balance equally well; the communication differs between them).
const WINDOW: usize = 4;

/// Stages of up to this many positions are tried at every position: where communication
/// or memory varies along the order, the best position need not be near the balancing
/// point.
const FULL_SCAN: usize = 256;

/// Sweeps over every cut at most.
const MAX_SWEEPS: usize = 64;

/// Branch-and-bound steps (stage ends tried) one search may take: about a millisecond's
/// worth. Graphs of a few hundred nodes cut into a few stages finish well within it.
const SEARCH_STEPS: usize = 200_000;

/// How much smaller a measure must get for a move to count, relative to it: far below any
/// cost the model knows, far above rounding.
const RELATIVE_GAIN: f64 = 1e-12;

impl PartitionProblem {
    /// `cuts` moved to balance the workers that run the stages (`workers[k]`: the worker
    /// of stage `k`; see the module docs), every stage within `mem`'s limit. Returns
    /// `cuts` unchanged when one worker runs every stage, when `workers` does not give one
    /// worker per stage, or when `cuts` already break the limit.
    pub fn balance_workers(&self, cuts: &[usize], workers: &[usize], mem: &PipelineMemory) -> Vec<usize> {
        let n = self.len();
        let single = workers.iter().all(|&w| w == workers[0]);
        if single || workers.len() != cuts.len() + 1 || !valid_cuts(cuts, n) {
            return cuts.to_vec();
        }
        let Some(slowest) = self.bottleneck_of(cuts, mem) else {
            return cuts.to_vec();
        };
        let balancer = Balancer { pre: self.prefix(mem), workers, limit: mem.limit(), cap: slowest * (1.0 + RELATIVE_GAIN), n };
        let descended = balancer.descend(cuts.to_vec());
        match balancer.search(&descended) {
            // The search minimises the busiest worker only: descend from its split for
            // the other measures (which never makes the busiest busier).
            Some(found) => balancer.descend(found),
            None => descended,
        }
    }
}

/// How many workers `workers` (the worker of each stage) numbers.
fn worker_count(workers: &[usize]) -> usize {
    workers.iter().max().map_or(0, |&w| w + 1)
}

/// The sum of `times` per worker.
fn loads_of(times: &[f64], workers: &[usize]) -> Vec<f64> {
    let mut loads = vec![0.0; worker_count(workers)];
    for (t, &w) in times.iter().zip(workers) {
        loads[w] += t;
    }
    loads
}

/// What a move must lower, compared in order.
#[derive(Clone, Copy, Debug)]
struct Measure {
    busiest: f64,
    squares: f64,
    slowest_stage: f64,
}

impl Measure {
    /// `Less` when `self` is better than `other` by more than [`RELATIVE_GAIN`] in the
    /// first measure that differs by that much.
    fn compare(&self, other: &Measure) -> Ordering {
        let pairs = [(self.busiest, other.busiest), (self.squares, other.squares), (self.slowest_stage, other.slowest_stage)];
        for (a, b) in pairs {
            let margin = RELATIVE_GAIN * a.abs().max(b.abs());
            if a < b - margin {
                return Ordering::Less;
            }
            if a > b + margin {
                return Ordering::Greater;
            }
        }
        Ordering::Equal
    }
}

/// A branch and bound's progress ([`Balancer::search`]).
struct Search {
    /// The busiest worker's time to beat: the start's, then the best split found's.
    bound: f64,
    found: Option<Vec<usize>>,
    /// The ends of the stages placed so far.
    path: Vec<usize>,
    /// Each worker's time over the stages placed so far.
    loads: Vec<f64>,
    steps: usize,
    /// `later[k]`: the workers that run a stage after stage `k`.
    later: Vec<Vec<usize>>,
}

struct Balancer<'a> {
    pre: Prefix,
    workers: &'a [usize],
    limit: f64,
    /// No stage may take longer.
    cap: f64,
    n: usize,
}

impl Balancer<'_> {
    /// Whether stage `k` over `[i, j)` fits its memory model (with the partitioner's
    /// slack for rounding).
    fn fits(&self, k: usize, i: usize, j: usize) -> bool {
        let model = k.min(self.pre.g.len() - 1);
        self.pre.fits(model, i, j, self.limit * (1.0 + MEMORY_SLACK))
    }

    /// Each stage's `T(i, j)` under `cuts`.
    fn stage_times(&self, cuts: &[usize]) -> Vec<f64> {
        stage_ranges(cuts, self.n).iter().map(|r| self.pre.stage_time(r.start, r.end)).collect()
    }

    fn measure(&self, cuts: &[usize]) -> Measure {
        let times = self.stage_times(cuts);
        let loads = loads_of(&times, self.workers);
        Measure {
            busiest: loads.iter().copied().fold(0.0, f64::max),
            squares: loads.iter().map(|l| l * l).sum(),
            slowest_stage: times.iter().copied().fold(0.0, f64::max),
        }
    }

    /// A split whose busiest worker is less busy than under `cuts`, by a depth-first
    /// branch and bound over the stages' ends: `None` when there is none, or when
    /// [`SEARCH_STEPS`] ran out before one was found (the best found is returned when it
    /// ran out after).
    fn search(&self, cuts: &[usize]) -> Option<Vec<usize>> {
        let mut state = Search {
            bound: self.measure(cuts).busiest,
            found: None,
            path: Vec::with_capacity(cuts.len()),
            loads: vec![0.0; worker_count(self.workers)],
            steps: 0,
            // later[k]: the workers that run a stage after stage k.
            later: (0..self.workers.len())
                .map(|k| {
                    let mut ws: Vec<usize> = self.workers[k + 1..].to_vec();
                    ws.sort_unstable();
                    ws.dedup();
                    ws
                })
                .collect(),
        };
        self.extend(&mut state, 0, 0);
        state.found
    }

    /// Tries every end of stage `k`, which starts at `i`.
    fn extend(&self, st: &mut Search, k: usize, i: usize) {
        let d = self.workers.len();
        let w = self.workers[k];
        let (s, comm) = (&self.pre.s, &self.pre.comm);
        let last_end = if k + 1 == d { self.n } else { self.n - (d - 1 - k) };
        let first_end = if k + 1 == d { self.n } else { i + 1 };
        for j in first_end..=last_end {
            st.steps += 1;
            if st.steps > SEARCH_STEPS {
                return;
            }
            // The bound tightens whenever a split is found deeper down.
            let to_beat = st.bound * (1.0 - RELATIVE_GAIN);
            // Neither the stage's compute nor its memory shrinks as it grows.
            let least = s[j] - s[i] + comm[i];
            if st.loads[w] + least >= to_beat || least > self.cap || !self.fits(k, i, j) {
                return;
            }
            let time = self.pre.stage_time(i, j);
            let load = st.loads[w] + time;
            if load >= to_beat || time > self.cap {
                continue;
            }
            if k + 1 == d {
                // Every other worker's load was held under the bound when its stages
                // were placed, but the bound may have tightened since.
                let busiest = st.loads.iter().enumerate().map(|(x, &l)| if x == w { load } else { l }).fold(0.0, f64::max);
                if busiest >= to_beat {
                    return;
                }
                st.bound = busiest;
                // The ends of stages 0..d - 1: the cuts.
                st.found = Some(st.path.clone());
                return;
            }
            // What is left must fit in what the later stages' workers have left.
            let room: f64 = st.later[k].iter().map(|&x| to_beat - if x == w { load } else { st.loads[x] }).sum();
            if s[self.n] - s[j] > room {
                continue;
            }
            let before = st.loads[w];
            st.loads[w] = load;
            st.path.push(j);
            self.extend(st, k + 1, j);
            st.path.pop();
            st.loads[w] = before;
            if st.steps > SEARCH_STEPS {
                return;
            }
        }
    }

    /// Sweeps over the cuts until none moves.
    fn descend(&self, mut cuts: Vec<usize>) -> Vec<usize> {
        let mut current = self.measure(&cuts);
        for _ in 0..MAX_SWEEPS {
            let mut moved = false;
            for c in 0..cuts.len() {
                if let Some((position, measure)) = self.best_move(&cuts, c, &current) {
                    cuts[c] = position;
                    current = measure;
                    moved = true;
                }
            }
            if !moved {
                break;
            }
        }
        cuts
    }

    /// The position of cut `c` (anywhere between its neighbours, or near its balancing
    /// point when they are far apart) that improves `current` most, if any.
    fn best_move(&self, cuts: &[usize], c: usize, current: &Measure) -> Option<(usize, Measure)> {
        let (start, end) = (if c == 0 { 0 } else { cuts[c - 1] }, cuts.get(c + 1).copied().unwrap_or(self.n));
        if end - start < 2 {
            return None;
        }
        let candidates = if end - start <= FULL_SCAN {
            start + 1..=end - 1
        } else {
            let target = self.balancing_prefix(cuts, c, start, end);
            let s = &self.pre.s[start + 1..end];
            let around = start + 1 + s.partition_point(|&x| x < target);
            around.saturating_sub(WINDOW).max(start + 1)..=(around + WINDOW).min(end - 1)
        };
        let mut best: Option<(usize, Measure)> = None;
        let mut trial = cuts.to_vec();
        for y in candidates {
            if y == cuts[c] || !self.fits(c, start, y) || !self.fits(c + 1, y, end) || self.pre.stage_time(start, y) > self.cap || self.pre.stage_time(y, end) > self.cap {
                continue;
            }
            trial[c] = y;
            let m = self.measure(&trial);
            let to_beat = best.as_ref().map_or(current, |(_, b)| b);
            if m.compare(to_beat) == Ordering::Less {
                best = Some((y, m));
            }
        }
        best
    }

    /// The prefix time `S(y)` at which cut `c` (between stage `c` over `[start, y)` and
    /// stage `c + 1` over `[y, end)`) balances its two sides: the two workers' times when
    /// the stages are on different workers, the two stages' times otherwise
    /// (communication left out; the window around it sorts that out).
    fn balancing_prefix(&self, cuts: &[usize], c: usize, start: usize, end: usize) -> f64 {
        let s = &self.pre.s;
        let (left, right) = (self.workers[c], self.workers[c + 1]);
        if left == right {
            return (s[start] + s[end]) / 2.0;
        }
        let times = self.stage_times(cuts);
        let others = |w: usize, skip: usize| -> f64 {
            (0..self.workers.len()).filter(|&k| self.workers[k] == w && k != skip).map(|k| times[k]).sum()
        };
        // others(left) + S(y) - S(start) = others(right) + S(end) - S(y).
        (others(right, c + 1) - others(left, c) + s[start] + s[end]) / 2.0
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::super::{valid_cuts, MemoryModel, PartitionProblem, PipelineMemory};
    use super::loads_of;
    use pipewright_core::Schedule;

    fn problem(time: Vec<f64>, live: Vec<f64>, params: Vec<f64>) -> PartitionProblem {
        let n = time.len();
        PartitionProblem { time, param_bytes: params, act_bytes: vec![0.0; n], kept_bytes: Vec::new(), live_bytes: live, bandwidth: 100.0, transfer_share: 1.0, awaiting_bytes: Vec::new(), keeps_graph: Vec::new() }
    }

    /// The busiest worker's time under `cuts`, from the partitioner's own stage times.
    fn busiest(prob: &PartitionProblem, cuts: &[usize], workers: &[usize]) -> f64 {
        let times = prob.evaluate(cuts, &PipelineMemory::unlimited()).0;
        loads_of(&times, workers).into_iter().fold(0.0, f64::max)
    }

    /// The least busiest-worker time over every split into `d` stages that fits `mem` with
    /// no stage slower than `cap`.
    fn exhaustive(prob: &PartitionProblem, d: usize, workers: &[usize], mem: &PipelineMemory, cap: f64) -> Option<f64> {
        let n = prob.len();
        let mut best: Option<f64> = None;
        let mut cuts: Vec<usize> = (1..d).collect();
        loop {
            if prob.bottleneck_of(&cuts, mem).is_some_and(|b| b <= cap * (1.0 + 1e-12)) {
                let b = busiest(prob, &cuts, workers);
                best = Some(best.map_or(b, |x: f64| x.min(b)));
            }
            let k = cuts.len();
            let mut idx = k;
            while idx > 0 && cuts[idx - 1] == n - (k - idx) - 1 {
                idx -= 1;
            }
            if idx == 0 {
                return best;
            }
            cuts[idx - 1] += 1;
            for t in idx..k {
                cuts[t] = cuts[t - 1] + 1;
            }
        }
    }

    fn balanced(time: Vec<f64>, d: usize) -> (PartitionProblem, Vec<usize>, Vec<usize>, Vec<usize>) {
        let n = time.len();
        let prob = problem(time, vec![0.0; n + 1], vec![0.0; n]);
        let workers = Schedule::ZbV.placement(d);
        let free = PipelineMemory::unlimited();
        let start = prob.optimal_partition(d, &free).expect("split").cuts;
        let balanced = prob.balance_workers(&start, &workers, &free);
        assert!(valid_cuts(&balanced, prob.len()));
        (prob, workers, start, balanced)
    }

    #[test]
    fn light_stages_are_paired_with_heavy_ones_without_slowing_any_stage() {
        // The partitioner's split, 6 4 3 6, gives worker 0 (the first and the last stage
        // under ZB-V) 12 against worker 1's 7; 6 4 6 3 gives 9 and 10.
        let (prob, workers, start, balanced) = balanced(vec![1.0, 2.0, 3.0, 2.0, 2.0, 3.0, 3.0, 2.0, 1.0], 4);
        let slowest = |c: &[usize]| prob.bottleneck_of(c, &PipelineMemory::unlimited()).expect("fits");
        assert_eq!((start.as_slice(), busiest(&prob, &start, &workers), slowest(&start)), ([3, 5, 6].as_slice(), 12.0, 6.0));
        assert_eq!((balanced.as_slice(), busiest(&prob, &balanced, &workers), slowest(&balanced)), ([3, 5, 7].as_slice(), 10.0, 6.0));
        assert_eq!(exhaustive(&prob, 4, &workers, &PipelineMemory::unlimited(), 6.0), Some(10.0));
    }

    #[test]
    fn a_heavy_middle_stays_where_moving_it_would_slow_a_stage() {
        // The middle two stages, both worker 1's under ZB-V, hold a 5 each: any split
        // easing worker 1 puts both 5s, or a 5 and the three 1s, in one stage.
        let (prob, workers, start, balanced) = balanced(vec![1.0, 1.0, 1.0, 5.0, 5.0, 1.0, 1.0, 1.0], 4);
        assert_eq!(busiest(&prob, &start, &workers), 10.0);
        assert_eq!(busiest(&prob, &balanced, &workers), 10.0);
        assert_eq!(exhaustive(&prob, 4, &workers, &PipelineMemory::unlimited(), 5.0), Some(10.0));
        assert!(exhaustive(&prob, 4, &workers, &PipelineMemory::unlimited(), f64::INFINITY).is_some_and(|b| b < 10.0));
    }

    #[test]
    fn one_worker_or_a_placement_of_the_wrong_length_leaves_the_cuts_alone() {
        let prob = problem(vec![1.0, 9.0, 1.0, 1.0], vec![0.0; 5], vec![0.0; 4]);
        let free = PipelineMemory::unlimited();
        assert_eq!(prob.balance_workers(&[1, 2], &[0, 0, 0], &free), vec![1, 2]);
        assert_eq!(prob.balance_workers(&[1, 2], &[0, 1], &free), vec![1, 2]);
        assert_eq!(prob.balance_workers(&[2, 1], &[0, 1, 0], &free), vec![2, 1]);
    }

    /// A problem of `n` nodes with times in `times`, live bytes and parameters, and which
    /// placement to balance for.
    fn case(n: std::ops::RangeInclusive<usize>, times: std::ops::Range<f64>) -> impl Strategy<Value = (Vec<f64>, Vec<f64>, Vec<f64>, usize)> {
        n.prop_flat_map(move |n| {
            (
                prop::collection::vec(times.clone(), n),
                prop::collection::vec(0.0f64..50.0, n + 1),
                prop::collection::vec(0.0f64..10.0, n),
                0usize..4,
            )
        })
    }

    const PLACEMENTS: [(Schedule, usize); 4] = [(Schedule::ZbV, 4), (Schedule::Interleaved2, 4), (Schedule::ZbV, 6), (Schedule::Interleaved2, 6)];

    /// Balances `time` for placement `which` with and without a memory limit; checks that
    /// the result is a split within the limit, with no stage slower than the stage-optimal
    /// split's slowest, that never leaves the busiest worker busier than that split did;
    /// returns the busiest worker's time over the exhaustive optimum's under the same
    /// constraints (per limit).
    fn check(time: Vec<f64>, live: Vec<f64>, params: Vec<f64>, which: usize) -> Result<Vec<f64>, TestCaseError> {
        let (schedule, d) = PLACEMENTS[which];
        let prob = problem(time, live, params.clone());
        let workers = schedule.placement(d);
        let total: f64 = params.iter().sum();
        let limited = PipelineMemory::uniform(MemoryModel { weight_factor: 1.0, act_factor: 0.0, kept_factor: 0.0, input_factor: 0.0, update_factor: 0.0, awaiting_factor: 0.0, limit: total / 2.0 });
        let mut ratios = Vec::new();
        for mem in [PipelineMemory::unlimited(), limited] {
            let Some(start) = prob.optimal_partition(d, &mem) else { continue };
            let balanced = prob.balance_workers(&start.cuts, &workers, &mem);
            prop_assert!(prob.bottleneck_of(&balanced, &mem).is_some(), "{balanced:?} breaks the limit");
            let (before, after) = (busiest(&prob, &start.cuts, &workers), busiest(&prob, &balanced, &workers));
            prop_assert!(after <= before * (1.0 + 1e-12), "{after} > {before}");
            let cap = prob.bottleneck_of(&start.cuts, &mem).expect("fits");
            prop_assert!(prob.bottleneck_of(&balanced, &mem).is_some_and(|b| b <= cap * (1.0 + 1e-12)), "a stage got slower");
            let best = exhaustive(&prob, d, &workers, &mem, cap).expect("the start fits");
            ratios.push(after / best);
        }
        Ok(ratios)
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 200, ..ProptestConfig::default() })]

        /// Nodes of any size, down to a handful per stage, and many of similar size (as
        /// layers are): the search finishes on these and finds the optimum.
        #[test]
        fn balancing_finds_the_exhaustive_optimum((time, live, params, which) in case(6..=11, 0.1..10.0)) {
            for r in check(time, live, params, which)? {
                prop_assert!(r <= 1.0 + 1e-9, "{r}");
            }
        }

        #[test]
        fn balancing_many_similar_nodes_finds_the_exhaustive_optimum((time, live, params, which) in case(14..=18, 1.0..3.0)) {
            for r in check(time, live, params, which)? {
                prop_assert!(r <= 1.0 + 1e-9, "{r}");
            }
        }
    }
}
