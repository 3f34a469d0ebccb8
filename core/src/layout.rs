//! The shape of a data-parallel pipeline job and its worker numbering: `depth` stages,
//! `replicas` pipelines, numbered by a [`Placement`]. One definition, read by the MPI
//! runtime (which rank runs which stage of which replica), the embedded executor (which
//! device) and the planner and simulator (which workers share a server).

use crate::Placement;

/// `depth` stages times `replicas` pipelines, numbered by `placement`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Layout {
    pub depth: usize,
    pub replicas: usize,
    pub placement: Placement,
}

impl Layout {
    /// A stage-major layout (the default placement).
    pub fn new(depth: usize, replicas: usize) -> Layout {
        Layout { depth, replicas, placement: Placement::StageMajor }
    }

    /// The same shape numbered by `placement`.
    pub fn placed(self, placement: Placement) -> Layout {
        Layout { placement, ..self }
    }

    /// Workers (ranks) in the job.
    pub fn size(&self) -> usize {
        self.depth * self.replicas
    }

    /// The worker of stage `stage` of replica `replica`.
    pub fn rank(&self, replica: usize, stage: usize) -> usize {
        match self.placement {
            Placement::StageMajor => stage * self.replicas + replica,
            Placement::ReplicaMajor => replica * self.depth + stage,
        }
    }

    /// `(replica, stage)` of a worker: the inverse of [`Layout::rank`].
    pub fn place(&self, rank: usize) -> (usize, usize) {
        match self.placement {
            Placement::StageMajor => (rank % self.replicas.max(1), rank / self.replicas.max(1)),
            Placement::ReplicaMajor => (rank / self.depth.max(1), rank % self.depth.max(1)),
        }
    }

    /// Every worker in the embedded executor's summing order (replica-major: for each
    /// replica, its stages in order), so that sums over every rank add in the order
    /// `pipewright train` adds them, whatever the placement.
    pub fn summing_order(&self) -> Vec<usize> {
        (0..self.replicas).flat_map(|r| (0..self.depth).map(move |k| self.rank(r, k))).collect()
    }

    /// How it numbers its ranks, for messages: `rank = stage x 2 replicas + replica`.
    pub fn numbering(&self) -> String {
        match self.placement {
            Placement::StageMajor => format!("rank = stage x {} replicas + replica", self.replicas),
            Placement::ReplicaMajor => format!("replica-major: rank = replica x {} stages + stage", self.depth),
        }
    }

    /// `rank 3 (stage 1, replica 1)`, for messages.
    pub fn who(&self, rank: usize) -> String {
        let (r, k) = self.place(rank);
        format!("rank {rank} (stage {k}, replica {r})")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Both placements number every `(replica, stage)` once and `place` inverts `rank`;
    /// stage-major keeps a stage's replicas together, replica-major a pipeline's stages.
    #[test]
    fn both_placements_are_bijections() {
        for placement in Placement::ALL.iter().copied() {
            let l = Layout::new(3, 2).placed(placement);
            let mut seen: Vec<usize> = (0..2).flat_map(|r| (0..3).map(move |k| l.rank(r, k))).collect();
            for r in 0..2 {
                for k in 0..3 {
                    assert_eq!(l.place(l.rank(r, k)), (r, k));
                }
            }
            seen.sort();
            assert_eq!(seen, (0..6).collect::<Vec<_>>());
        }
        let stage_major = Layout::new(3, 2);
        assert_eq!((stage_major.rank(1, 0), stage_major.rank(0, 1)), (1, 2));
        let replica_major = stage_major.placed(Placement::ReplicaMajor);
        assert_eq!((replica_major.rank(1, 0), replica_major.rank(0, 1)), (3, 1));
        assert_eq!(replica_major.who(4), "rank 4 (stage 1, replica 1)");
        assert_eq!((stage_major.numbering(), replica_major.numbering()), ("rank = stage x 2 replicas + replica".to_string(), "replica-major: rank = replica x 3 stages + stage".to_string()));
        // The summing order is the same pairs in the same order under both.
        let pairs = |l: Layout| l.summing_order().into_iter().map(|rank| l.place(rank)).collect::<Vec<_>>();
        assert_eq!(pairs(stage_major), pairs(replica_major));
    }
}
