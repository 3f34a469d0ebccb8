//! The process heap under training: glibc's allocator settings that keep the memory a
//! microbatch frees for the next one.
//!
//! libtorch takes every CPU tensor from `malloc`. A training step frees and allocates the
//! same activations, gradients and kept graphs microbatch after microbatch; left at its
//! defaults, glibc gives the top of each heap back to the kernel when more than 128 KiB
//! is free there and maps each block over its (adaptive) threshold on its own, so the next
//! microbatch faults the same pages in again, zero-filled. [`keep_freed_memory`] makes the
//! heaps keep what they have held (the process's peak is the step's peak either way),
//! grow in large steps, and serve blocks up to [`MMAP_THRESHOLD`] from them.

/// Blocks at least this large are mapped on their own (and unmapped when freed): glibc's
/// own ceiling for its adaptive threshold, fixed so that it does not start lower.
pub const MMAP_THRESHOLD: usize = 32 << 20;
/// How much a heap grows by beyond a request, so that it grows in few steps.
pub const TOP_PAD: usize = 64 << 20;

/// The glibc variables that set what [`keep_freed_memory`] sets: when any is in the
/// environment, the user has chosen, and the allocator is left as they set it.
const USER_SETTINGS: [&str; 4] = ["MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_THRESHOLD_", "GLIBC_TUNABLES"];

/// Whether the allocator now keeps freed memory: `false` where the user set glibc's
/// malloc variables themselves, where glibc refused a setting, or off glibc.
pub fn keep_freed_memory() -> bool {
    !user_has_chosen(|v| std::env::var_os(v).is_some()) && set_options()
}

/// Whether any of glibc's malloc variables is set (`is_set` says whether one is).
fn user_has_chosen(is_set: impl Fn(&str) -> bool) -> bool {
    USER_SETTINGS.iter().any(|v| is_set(v))
}

#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn set_options() -> bool {
    let as_int = |n: usize| libc::c_int::try_from(n).unwrap_or(libc::c_int::MAX);
    // SAFETY: mallopt takes no pointers and holds the allocator's lock while it changes
    // its thresholds; blocks already allocated stay valid.
    unsafe {
        libc::mallopt(libc::M_TRIM_THRESHOLD, libc::c_int::MAX) == 1
            && libc::mallopt(libc::M_TOP_PAD, as_int(TOP_PAD)) == 1
            && libc::mallopt(libc::M_MMAP_THRESHOLD, as_int(MMAP_THRESHOLD)) == 1
    }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn set_options() -> bool {
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn any_of_glibcs_malloc_variables_leaves_the_allocator_as_the_user_set_it() {
        assert!(!user_has_chosen(|_| false));
        for v in USER_SETTINGS {
            assert!(user_has_chosen(|name| name == v), "{v}");
        }
    }

    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    #[test]
    fn glibc_takes_every_setting() {
        assert!(set_options(), "mallopt refused a setting");
    }
}
