//! What watches each execution: a global allocator with a cap (an input that makes a
//! loader allocate more than the cap, at once or in total during one execution, is
//! saved and reported instead of taking the machine's memory, or aborting in
//! `Vec::with_capacity`), a watchdog thread that saves and reports an input running
//! past the time limit, a resident-memory check between executions, and a panic hook
//! that keeps the message of a panic `catch_unwind` then catches.
//!
//! An allocator must not unwind, and a hung execution cannot be stopped from outside, so
//! both end the process after saving the input (as libFuzzer does): exit code
//! [`EXIT_ALLOC`] or [`EXIT_HANG`]. libtorch allocates through C++, not this allocator;
//! the resident-memory check covers it.

use std::alloc::{GlobalAlloc, Layout, System};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::sync::{Mutex, Once};
use std::time::{Duration, Instant};

pub const EXIT_ALLOC: i32 = 70;
pub const EXIT_HANG: i32 = 71;
pub const EXIT_RSS: i32 = 72;

pub struct CappedAlloc;

static ARMED: AtomicBool = AtomicBool::new(false);
/// Bytes allocated minus bytes freed since the execution began (frees of older blocks
/// make it dip below zero, which only makes the cap more lenient).
static LIVE: AtomicI64 = AtomicI64::new(0);
static CAP: AtomicU64 = AtomicU64::new(u64::MAX);

/// The execution in progress, for the reports: target name, crash folder, input.
struct Current {
    target: &'static str,
    crash_dir: PathBuf,
    input: Vec<u8>,
}

static CURRENT: Mutex<Option<Current>> = Mutex::new(None);
/// Milliseconds since [`epoch`] when the current execution began; 0 when idle.
static STARTED_MS: AtomicU64 = AtomicU64::new(0);
static TIMEOUT_MS: AtomicU64 = AtomicU64::new(u64::MAX);
static PANIC_MESSAGE: Mutex<String> = Mutex::new(String::new());
static IN_EXEC: AtomicBool = AtomicBool::new(false);

fn epoch() -> Instant {
    static E: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
    *E.get_or_init(Instant::now)
}

fn now_ms() -> u64 {
    epoch().elapsed().as_millis() as u64 + 1
}

impl CappedAlloc {
    fn charge(&self, size: usize) {
        if !ARMED.load(Ordering::Relaxed) {
            return;
        }
        let live = LIVE.fetch_add(size as i64, Ordering::Relaxed) + size as i64;
        let cap = CAP.load(Ordering::Relaxed);
        if size as u64 > cap || (live > 0 && live as u64 > cap) {
            // Disarm first: the report below allocates.
            ARMED.store(false, Ordering::SeqCst);
            // Where it was asked for is the finding; release builds keep symbols.
            eprintln!("{}", std::backtrace::Backtrace::force_capture());
            report_fatal(
                "allocation",
                &format!("asked for {size} bytes with {live} bytes live in this execution (cap {cap} bytes)"),
                EXIT_ALLOC,
            );
        }
    }
}

unsafe impl GlobalAlloc for CappedAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        self.charge(layout.size());
        System.alloc(layout)
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        self.charge(layout.size());
        System.alloc_zeroed(layout)
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        if ARMED.load(Ordering::Relaxed) {
            LIVE.fetch_sub(layout.size() as i64, Ordering::Relaxed);
        }
        System.dealloc(ptr, layout)
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if new_size > layout.size() {
            self.charge(new_size - layout.size());
        } else if ARMED.load(Ordering::Relaxed) {
            LIVE.fetch_sub((layout.size() - new_size) as i64, Ordering::Relaxed);
        }
        System.realloc(ptr, layout, new_size)
    }
}

/// FNV-1a 64: names a saved input by its content.
pub fn hash(data: &[u8]) -> u64 {
    data.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3))
}

/// Writes `data` as `DIR/TARGET-HASH.bin` and returns that path.
pub fn save(crash_dir: &std::path::Path, target: &str, data: &[u8]) -> std::io::Result<PathBuf> {
    std::fs::create_dir_all(crash_dir)?;
    let path = crash_dir.join(format!("{target}-{:016x}.bin", hash(data)));
    std::fs::write(&path, data)?;
    Ok(path)
}

/// Saves the current input, prints what happened and ends the process.
fn report_fatal(kind: &str, detail: &str, code: i32) -> ! {
    // try_lock: the watchdog and the allocator never wait on each other.
    let saved = match CURRENT.try_lock() {
        Ok(guard) => match guard.as_ref() {
            Some(c) => match save(&c.crash_dir, c.target, &c.input) {
                Ok(p) => format!("{} target: input saved as {}", c.target, p.display()),
                Err(e) => format!("{} target: could not save the input: {e}", c.target),
            },
            None => "no execution in progress".to_string(),
        },
        Err(_) => "the input could not be saved (busy)".to_string(),
    };
    eprintln!("pipewright-fuzz: FATAL {kind}: {detail}; {saved}");
    std::process::exit(code)
}

/// Installs the panic hook and the watchdog (once per process).
pub fn install(timeout: Duration) {
    TIMEOUT_MS.store(timeout.as_millis() as u64, Ordering::SeqCst);
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        epoch();
        let default = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            if IN_EXEC.load(Ordering::SeqCst) {
                let mut m = PANIC_MESSAGE.lock().unwrap_or_else(|e| e.into_inner());
                *m = info.to_string();
            } else {
                default(info);
            }
        }));
        std::thread::Builder::new()
            .name("pipewright-fuzz-watchdog".into())
            .spawn(|| loop {
                std::thread::sleep(Duration::from_millis(20));
                let started = STARTED_MS.load(Ordering::SeqCst);
                let limit = TIMEOUT_MS.load(Ordering::SeqCst);
                if started != 0 && now_ms().saturating_sub(started) > limit {
                    report_fatal("hang", &format!("one execution ran for more than {limit} ms"), EXIT_HANG);
                }
            })
            .expect("the watchdog thread starts");
    });
}

/// Sets the allocation cap (bytes) for the executions that follow.
pub fn set_alloc_cap(bytes: u64) {
    CAP.store(bytes, Ordering::SeqCst);
}

/// How one execution ended.
pub enum Outcome {
    Accepted,
    Refused(String),
    Panicked(String),
}

/// Runs `f` on `input` as one watched execution.
pub fn execute(target: &'static str, crash_dir: &std::path::Path, input: &[u8], f: impl FnOnce(&[u8]) -> Result<(), String>) -> Outcome {
    {
        let mut cur = CURRENT.lock().unwrap_or_else(|e| e.into_inner());
        match cur.as_mut() {
            Some(c) if c.target == target && c.crash_dir == crash_dir => {
                c.input.clear();
                c.input.extend_from_slice(input);
            }
            _ => *cur = Some(Current { target, crash_dir: crash_dir.to_path_buf(), input: input.to_vec() }),
        }
    }
    IN_EXEC.store(true, Ordering::SeqCst);
    LIVE.store(0, Ordering::SeqCst);
    STARTED_MS.store(now_ms(), Ordering::SeqCst);
    ARMED.store(true, Ordering::SeqCst);
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(input)));
    ARMED.store(false, Ordering::SeqCst);
    STARTED_MS.store(0, Ordering::SeqCst);
    IN_EXEC.store(false, Ordering::SeqCst);
    match result {
        Ok(Ok(())) => Outcome::Accepted,
        Ok(Err(m)) => Outcome::Refused(m),
        Err(_) => Outcome::Panicked(std::mem::take(&mut *PANIC_MESSAGE.lock().unwrap_or_else(|e| e.into_inner()))),
    }
}

/// Resident memory of this process in MiB (Linux; 0 elsewhere).
pub fn rss_mib() -> u64 {
    std::fs::read_to_string("/proc/self/statm")
        .ok()
        .and_then(|s| s.split_whitespace().nth(1).and_then(|p| p.parse::<u64>().ok()))
        .map_or(0, |pages| pages * 4096 / (1 << 20))
}

/// Ends the process with a report if resident memory is over `limit_mib` (the last
/// input is saved: it is the likeliest cause, as with libFuzzer's -rss_limit_mb).
pub fn check_rss(limit_mib: u64) {
    let rss = rss_mib();
    if rss > limit_mib {
        report_fatal("memory", &format!("resident memory {rss} MiB is over the limit of {limit_mib} MiB"), EXIT_RSS);
    }
}
