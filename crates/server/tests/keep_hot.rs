//! `ServerConfig::keep_hot`: one async worker polls while requests run
//! and sleeps when none do. A binary of its own: it reads the process's
//! CPU time, which other tests running beside it would add to.
#![cfg(target_os = "linux")]

mod common;

use std::time::{Duration, Instant};

use braid_server::{Server, ServerConfig};
use common::fake::{self, FakeLane};
use common::*;
use serde_json::json;

/// CPU time this process has used, user and system.
fn cpu_time() -> Duration {
    // SAFETY: getrusage fills the struct it is given.
    let mut u: libc::rusage = unsafe { std::mem::zeroed() };
    assert_eq!(unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut u) }, 0);
    let tv = |t: libc::timeval| Duration::new(t.tv_sec as u64, t.tv_usec as u32 * 1000);
    tv(u.ru_utime) + tv(u.ru_stime)
}

/// The process's CPU time over `window` of wall time, as cores busy.
async fn cores_busy(window: Duration) -> f64 {
    let (cpu, wall) = (cpu_time(), Instant::now());
    tokio::time::sleep(window).await;
    (cpu_time() - cpu).as_secs_f64() / wall.elapsed().as_secs_f64()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hot_worker_polls_while_a_request_runs_and_sleeps_when_none_does() {
    for keep_hot in [false, true] {
        // A token each 20 ms: the lane and the stream's task sleep between.
        let lane = FakeLane::new(2, 2, Duration::from_millis(20));
        let cfg = ServerConfig { port: 0, model_name: "fake".into(), keep_hot, ..ServerConfig::default() };
        let server = Server::bind(cfg).await.unwrap();
        server.ready_with(lane, fake::model_info(false, 256));
        let addr = server.local_addr();
        let idle_before = cores_busy(Duration::from_millis(300)).await;
        let body = json!({"prompt": "hi", "max_tokens": 40, "ignore_eos": true, "stream": true});
        let mut open = post_stream(addr, "/v1/completions", &body).await;
        let running = cores_busy(Duration::from_millis(400)).await;
        let events = open.events().await;
        assert_eq!(stream_texts(&events, 1)[0].len(), 40, "every token delivered (keep_hot {keep_hot})");
        tokio::time::sleep(Duration::from_millis(100)).await;
        let idle_after = cores_busy(Duration::from_millis(300)).await;
        let seen = format!("keep_hot {keep_hot}: idle {idle_before:.2}, running {running:.2}, idle again {idle_after:.2} cores");
        assert!(idle_before < 0.25 && idle_after < 0.25, "{seen}");
        if keep_hot {
            assert!(running > 0.5, "{seen}");
        } else {
            assert!(running < 0.25, "{seen}");
        }
        server.shutdown().await.unwrap();
    }
}
