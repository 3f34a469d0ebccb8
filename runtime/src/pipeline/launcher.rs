//! What an MPI launcher tells the processes it starts: each process's rank and the number
//! of processes, from the environment variables Open MPI, MPICH (PMI) and PMIx set.

fn env_usize(names: &[&str]) -> Option<usize> {
    names.iter().find_map(|n| std::env::var(n).ok()).and_then(|v| v.trim().parse().ok())
}

/// This process's rank, when an MPI launcher started it.
pub fn launcher_rank() -> Option<usize> {
    env_usize(&["OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK"])
}

/// The number of processes the launcher started, when an MPI launcher started this one.
pub fn launcher_size() -> Option<usize> {
    env_usize(&["OMPI_COMM_WORLD_SIZE", "PMI_SIZE"])
}
