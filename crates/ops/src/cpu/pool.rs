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
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU64, AtomicUsize, Ordering};
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

/// Index half of `Shared::counter` while no job is open.
const CLOSED: u32 = u32::MAX;

struct Shared {
    /// `epoch << 32 | next task index`. A job opens with a new epoch and
    /// index 0; tasks are claimed by compare-and-swap, so a worker that
    /// wakes late (descheduled on a busy machine) can never claim a task of
    /// a job that has moved on. The caller waits only for claimed tasks,
    /// never for workers that did not show up.
    counter: AtomicU64,
    /// Thin pointer to the caller's `&dyn Fn(usize)`, valid while the job
    /// is open. Written only while the counter is CLOSED.
    job: AtomicPtr<()>,
    n_tasks: AtomicUsize,
    /// Tasks finished (panicked ones included).
    done: AtomicUsize,
    panicked: AtomicBool,
    shutdown: AtomicBool,
    /// Parked workers; the caller only takes the mutex when this is nonzero.
    sleepers: AtomicUsize,
    lock: Mutex<()>,
    wake: Condvar,
}

type JobRef<'a> = &'a (dyn Fn(usize) + Sync);

struct Pool {
    shared: Arc<Shared>,
    workers: Vec<JoinHandle<()>>,
}

impl Pool {
    fn new(n_workers: usize) -> Pool {
        let shared = Arc::new(Shared {
            counter: AtomicU64::new(CLOSED as u64),
            job: AtomicPtr::new(std::ptr::null_mut()),
            n_tasks: AtomicUsize::new(0),
            done: AtomicUsize::new(0),
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
        if n_tasks >= CLOSED as usize {
            return run_inline(n_tasks, f);
        }
        // The counter is CLOSED here (every `run` closes it before
        // returning), so no worker reads `job` or `n_tasks` now.
        let job: JobRef<'_> = f;
        s.job.store(&job as *const JobRef<'_> as *mut (), Ordering::SeqCst);
        s.n_tasks.store(n_tasks, Ordering::SeqCst);
        s.done.store(0, Ordering::SeqCst);
        s.panicked.store(false, Ordering::SeqCst);
        let epoch = (s.counter.load(Ordering::SeqCst) >> 32).wrapping_add(1) & 0xffff_ffff;
        s.counter.store(epoch << 32, Ordering::SeqCst);
        if s.sleepers.load(Ordering::SeqCst) > 0 {
            let _g = s.lock.lock().unwrap_or_else(|p| p.into_inner());
            s.wake.notify_all();
        }
        IN_JOB.with(|c| c.set(true));
        take_tasks(s, epoch as u32);
        let mut spins = 0u32;
        while s.done.load(Ordering::Acquire) < n_tasks {
            spins = spins.wrapping_add(1);
            if spins.is_multiple_of(256) {
                std::thread::yield_now();
            } else {
                std::hint::spin_loop();
            }
        }
        s.counter.store((epoch << 32) | CLOSED as u64, Ordering::SeqCst);
        IN_JOB.with(|c| c.set(false));
        if s.panicked.load(Ordering::SeqCst) {
            panic!("a parallel_for task panicked");
        }
    }
}

/// Claim and run tasks of job `epoch` until none are left.
fn take_tasks(s: &Shared, epoch: u32) {
    loop {
        let v = s.counter.load(Ordering::SeqCst);
        let (e, i) = ((v >> 32) as u32, v as u32);
        if e != epoch || i == CLOSED {
            return;
        }
        // Read while the counter still holds `v`; the CAS below proves it
        // did throughout, so these belong to this job.
        let n = s.n_tasks.load(Ordering::SeqCst);
        let job = s.job.load(Ordering::SeqCst) as *const JobRef<'static>;
        if i as usize >= n {
            return;
        }
        if s.counter.compare_exchange(v, v + 1, Ordering::SeqCst, Ordering::SeqCst).is_err() {
            continue;
        }
        // SAFETY: task i is claimed, so the caller is still waiting in
        // `run` and its `job` reference is alive.
        let f: JobRef<'_> = unsafe { *job };
        if catch_unwind(AssertUnwindSafe(|| f(i as usize))).is_err() {
            s.panicked.store(true, Ordering::SeqCst);
        }
        s.done.fetch_add(1, Ordering::Release);
    }
}

fn worker(s: &Shared) {
    IN_JOB.with(|c| c.set(true));
    let epoch_of = |s: &Shared| (s.counter.load(Ordering::SeqCst) >> 32) as u32;
    // Pools start at epoch 0, closed; a job may already be open by the
    // time this thread runs, so don't start from the current epoch.
    let mut seen = 0u32;
    loop {
        // Wait for a new job: spin, then park.
        let mut spins = 0u32;
        let mut since: Option<Instant> = None;
        loop {
            if s.shutdown.load(Ordering::Relaxed) {
                return;
            }
            let e = epoch_of(s);
            if e != seen {
                seen = e;
                break;
            }
            spins = spins.wrapping_add(1);
            if !spins.is_multiple_of(64) {
                std::hint::spin_loop();
                continue;
            }
            let start = *since.get_or_insert_with(Instant::now);
            if start.elapsed() < SPIN {
                continue;
            }
            let g = s.lock.lock().unwrap_or_else(|p| p.into_inner());
            s.sleepers.fetch_add(1, Ordering::SeqCst);
            // Re-check under the lock: the caller opens the job before it
            // reads `sleepers`, so either it sees us or we see its job.
            if epoch_of(s) == seen && !s.shutdown.load(Ordering::SeqCst) {
                drop(s.wake.wait(g).unwrap_or_else(|p| p.into_inner()));
            } else {
                drop(g);
            }
            s.sleepers.fetch_sub(1, Ordering::SeqCst);
            since = None;
        }
        take_tasks(s, seen);
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
