//! A persistent thread pool for the CPU kernels.
//!
//! Decode-time matmuls take microseconds, so spawning threads (or even
//! waking sleeping ones through the OS) per call would cost more than the
//! work. The workers here live for the whole process, spin briefly on a
//! job counter after each job, and only then park on a condvar. The calling
//! thread runs tasks too, so `threads()` counts it.
//!
//! One job runs at a time. A call made while a job is running (from a task,
//! or from another thread) runs its tasks inline on the calling thread:
//! correct, never deadlocks, just not parallel.

use std::cell::Cell;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, TryLockError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How long a worker spins for the next job before parking: long enough
/// to span the gaps between the ops of one forward pass, short enough not
/// to burn a shared core when idle. (Timed, as `pause` costs anywhere from
/// 10 to 140 cycles depending on the CPU.)
const SPIN: Duration = Duration::from_micros(100);

/// 0 = not set: use the machine's parallelism.
static WANTED: AtomicUsize = AtomicUsize::new(0);
static POOL: Mutex<Option<Pool>> = Mutex::new(None);

thread_local! {
    /// True on pool workers and on a caller while it runs a job: nested
    /// calls run inline.
    static IN_JOB: Cell<bool> = const { Cell::new(false) };
}

/// Set the number of threads (the caller included). Takes effect at the
/// next `parallel_for`; 0 means the machine's parallelism.
pub fn set_threads(n: usize) {
    WANTED.store(n, Ordering::Relaxed);
}

/// Threads that `parallel_for` uses (the calling thread included).
pub fn threads() -> usize {
    match WANTED.load(Ordering::Relaxed) {
        0 => default_threads(),
        n => n,
    }
}

fn default_threads() -> usize {
    static DEFAULT: AtomicUsize = AtomicUsize::new(0);
    match DEFAULT.load(Ordering::Relaxed) {
        0 => {
            let n = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
            DEFAULT.store(n, Ordering::Relaxed);
            n
        }
        n => n,
    }
}

/// Run `f(0..n_tasks)` on the pool; returns when every task has finished.
/// Tasks are handed out dynamically, so uneven tasks balance. A panic in a
/// task is re-raised here after all tasks have stopped.
pub fn parallel_for(n_tasks: usize, f: &(dyn Fn(usize) + Sync)) {
    if n_tasks == 0 {
        return;
    }
    let want = threads();
    if n_tasks == 1 || want <= 1 || IN_JOB.with(|c| c.get()) {
        return run_inline(n_tasks, f);
    }
    let mut guard = match POOL.try_lock() {
        Ok(g) => g,
        Err(TryLockError::Poisoned(p)) => p.into_inner(),
        // Another thread's job is running: don't wait for it.
        Err(TryLockError::WouldBlock) => return run_inline(n_tasks, f),
    };
    if guard.as_ref().map(|p| p.workers.len() + 1) != Some(want) {
        // Dropping the old pool stops and joins its workers.
        *guard = None;
        *guard = Some(Pool::new(want - 1));
    }
    let pool = guard.as_ref().expect("pool was just created");
    pool.run(n_tasks, f);
}

fn run_inline(n_tasks: usize, f: &(dyn Fn(usize) + Sync)) {
    for i in 0..n_tasks {
        f(i);
    }
}

/// The job a worker reads: a type-erased `&dyn Fn(usize)`. Its lifetime is
/// extended to 'static in the pointer; `Pool::run` does not return (nor
/// unwind) until every worker has stopped using it.
type JobFn = *const (dyn Fn(usize) + Sync + 'static);

struct Shared {
    /// Bumped once per job; workers wait for it to change.
    epoch: AtomicU64,
    job: std::cell::UnsafeCell<JobFn>,
    n_tasks: AtomicUsize,
    next: AtomicUsize,
    /// Workers that have not yet finished the current job.
    pending: AtomicUsize,
    panicked: AtomicBool,
    shutdown: AtomicBool,
    /// Parked workers; the caller only takes the mutex when this is nonzero.
    sleepers: AtomicUsize,
    lock: Mutex<()>,
    wake: Condvar,
}

// SAFETY: `job` is written only by the thread running `Pool::run` while no
// worker reads it (all have finished the previous job), and published to
// workers through the `epoch` release/acquire pair.
unsafe impl Sync for Shared {}
unsafe impl Send for Shared {}

struct Pool {
    shared: Arc<Shared>,
    workers: Vec<JoinHandle<()>>,
}

fn noop(_: usize) {}

impl Pool {
    fn new(n_workers: usize) -> Pool {
        let noop_ref: &'static (dyn Fn(usize) + Sync) = &noop;
        let shared = Arc::new(Shared {
            epoch: AtomicU64::new(0),
            job: std::cell::UnsafeCell::new(noop_ref as JobFn),
            n_tasks: AtomicUsize::new(0),
            next: AtomicUsize::new(0),
            pending: AtomicUsize::new(0),
            panicked: AtomicBool::new(false),
            shutdown: AtomicBool::new(false),
            sleepers: AtomicUsize::new(0),
            lock: Mutex::new(()),
            wake: Condvar::new(),
        });
        let mut workers = Vec::with_capacity(n_workers);
        for i in 0..n_workers {
            let s = shared.clone();
            let spawned = std::thread::Builder::new().name(format!("braid-cpu-{}", i + 1)).spawn(move || worker(&s));
            match spawned {
                Ok(h) => workers.push(h),
                // Fewer workers still give correct results.
                Err(_) => break,
            }
        }
        Pool { shared, workers }
    }

    fn run(&self, n_tasks: usize, f: &(dyn Fn(usize) + Sync)) {
        let s = &*self.shared;
        // SAFETY: erase the lifetime; see `JobFn`. All workers finished the
        // previous job (pending was 0 when the last `run` returned).
        unsafe {
            let erased: JobFn = std::mem::transmute::<*const (dyn Fn(usize) + Sync + '_), JobFn>(f);
            *s.job.get() = erased;
        }
        s.n_tasks.store(n_tasks, Ordering::Relaxed);
        s.next.store(0, Ordering::Relaxed);
        s.panicked.store(false, Ordering::Relaxed);
        s.pending.store(self.workers.len(), Ordering::Relaxed);
        s.epoch.fetch_add(1, Ordering::SeqCst);
        if s.sleepers.load(Ordering::SeqCst) > 0 {
            let _g = s.lock.lock().unwrap_or_else(|p| p.into_inner());
            s.wake.notify_all();
        }

        // Waits for the workers even if our own tasks panic, so `f` stays
        // alive while they use it.
        struct WaitGuard<'a>(&'a Shared);
        impl Drop for WaitGuard<'_> {
            fn drop(&mut self) {
                let mut spins = 0u32;
                while self.0.pending.load(Ordering::Acquire) != 0 {
                    spins = spins.wrapping_add(1);
                    if spins % 1024 == 0 {
                        std::thread::yield_now();
                    } else {
                        std::hint::spin_loop();
                    }
                }
                IN_JOB.with(|c| c.set(false));
            }
        }
        IN_JOB.with(|c| c.set(true));
        let guard = WaitGuard(s);
        take_tasks(s, f);
        drop(guard);
        if s.panicked.load(Ordering::Relaxed) {
            panic!("a parallel_for task panicked on a pool worker");
        }
    }
}

fn take_tasks(s: &Shared, f: &(dyn Fn(usize) + Sync)) {
    let n = s.n_tasks.load(Ordering::Relaxed);
    loop {
        let i = s.next.fetch_add(1, Ordering::Relaxed);
        if i >= n {
            break;
        }
        f(i);
    }
}

fn worker(s: &Shared) {
    IN_JOB.with(|c| c.set(true));
    // Not the current epoch: a job may already have been posted before
    // this thread started running. Pools start at epoch 0.
    let mut seen = 0u64;
    loop {
        // Wait for a new job: spin, then park.
        let mut spins = 0u32;
        let mut since: Option<Instant> = None;
        loop {
            if s.shutdown.load(Ordering::Relaxed) {
                return;
            }
            let e = s.epoch.load(Ordering::Acquire);
            if e != seen {
                seen = e;
                break;
            }
            spins = spins.wrapping_add(1);
            if spins % 64 != 0 {
                std::hint::spin_loop();
                continue;
            }
            let start = *since.get_or_insert_with(Instant::now);
            if start.elapsed() < SPIN {
                continue;
            }
            let g = s.lock.lock().unwrap_or_else(|p| p.into_inner());
            s.sleepers.fetch_add(1, Ordering::SeqCst);
            // Re-check under the lock: the caller bumps the epoch before it
            // reads `sleepers`, so either it sees us or we see its epoch.
            let e = s.epoch.load(Ordering::SeqCst);
            if e == seen && !s.shutdown.load(Ordering::SeqCst) {
                drop(s.wake.wait(g).unwrap_or_else(|p| p.into_inner()));
            } else {
                drop(g);
            }
            s.sleepers.fetch_sub(1, Ordering::SeqCst);
            since = None;
        }
        // SAFETY: published before the epoch bump we acquired; valid until
        // we decrement `pending`.
        let f: &(dyn Fn(usize) + Sync) = unsafe { &**s.job.get() };
        if catch_unwind(AssertUnwindSafe(|| take_tasks(s, f))).is_err() {
            s.panicked.store(true, Ordering::Relaxed);
        }
        s.pending.fetch_sub(1, Ordering::Release);
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        self.shared.shutdown.store(true, Ordering::SeqCst);
        {
            let _g = self.shared.lock.lock().unwrap_or_else(|p| p.into_inner());
            self.shared.wake.notify_all();
        }
        for h in self.workers.drain(..) {
            let _ = h.join();
        }
    }
}
