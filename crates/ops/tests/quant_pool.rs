//! The persistent pool: every task runs once, nesting and concurrent
//! callers work, panics propagate and leave the pool usable.

use braid_ops::cpu::pool::{parallel_for, set_threads, threads};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

// Tests in this file change the global thread count; run them one at a time.
static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

/// Two threads for one test, the file's lock held; back to the default
/// (0) when dropped.
struct TwoThreads {
    _lock: std::sync::MutexGuard<'static, ()>,
}

fn two_threads() -> TwoThreads {
    let g = serial();
    set_threads(2);
    TwoThreads { _lock: g }
}

impl Drop for TwoThreads {
    fn drop(&mut self) {
        set_threads(0);
    }
}

#[test]
fn every_task_runs_exactly_once() {
    let _g = serial();
    for n_threads in [1, 2, 3, 4] {
        set_threads(n_threads);
        assert_eq!(threads(), n_threads);
        for n in [0usize, 1, 2, 5, 64, 1000] {
            let hits: Vec<AtomicUsize> = (0..n).map(|_| AtomicUsize::new(0)).collect();
            parallel_for(n, &|i| {
                hits[i].fetch_add(1, Ordering::Relaxed);
            });
            assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 1), "{n_threads} threads, {n} tasks");
        }
    }
    set_threads(0);
}

#[test]
fn work_is_spread_over_threads() {
    let _g = two_threads();
    let ids = Mutex::new(std::collections::HashSet::new());
    // Tasks that take a while, so the worker surely picks some up.
    parallel_for(64, &|_| {
        ids.lock().unwrap().insert(std::thread::current().id());
        std::thread::sleep(std::time::Duration::from_millis(1));
    });
    assert_eq!(ids.lock().unwrap().len(), 2);
}

#[test]
fn nested_and_concurrent_calls_complete() {
    let _g = two_threads();
    let total = AtomicUsize::new(0);
    parallel_for(8, &|_| {
        parallel_for(10, &|_| {
            total.fetch_add(1, Ordering::Relaxed);
        });
    });
    assert_eq!(total.load(Ordering::Relaxed), 80);

    let total = AtomicUsize::new(0);
    std::thread::scope(|s| {
        for _ in 0..3 {
            s.spawn(|| {
                for _ in 0..200 {
                    parallel_for(7, &|_| {
                        total.fetch_add(1, Ordering::Relaxed);
                    });
                }
            });
        }
    });
    assert_eq!(total.load(Ordering::Relaxed), 3 * 200 * 7);
}

#[test]
fn a_panicking_task_propagates_and_the_pool_survives() {
    let _g = two_threads();
    for _ in 0..3 {
        let r = std::panic::catch_unwind(|| {
            parallel_for(16, &|i| {
                if i % 5 == 3 {
                    panic!("task {i} fails");
                }
            });
        });
        assert!(r.is_err());
    }
    let count = AtomicUsize::new(0);
    parallel_for(100, &|_| {
        count.fetch_add(1, Ordering::Relaxed);
    });
    assert_eq!(count.load(Ordering::Relaxed), 100);
}

#[test]
fn many_small_jobs_back_to_back() {
    let _g = two_threads();
    // Exercises the spin / park hand-off many times, with pauses long
    // enough that workers park in between.
    let sum = AtomicUsize::new(0);
    for round in 0..2000 {
        parallel_for(3, &|i| {
            sum.fetch_add(i + 1, Ordering::Relaxed);
        });
        if round % 500 == 0 {
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
    }
    assert_eq!(sum.load(Ordering::Relaxed), 2000 * 6);
}
