//! The pacer through a lane, against a recording fake whose rounds cost
//! what a script says, on the fake's own clock (no real time passes, so
//! the pacer sees exactly the script): with an inter-token-latency target a
//! prompt arriving beside decoding streams is cut so that rounds keep
//! within the target, and it advances every round.

mod common;

use std::time::Duration;

use braid_engine::fake::{Call, FakeConfig};
use braid_engine::{replayed_size, Capabilities, Event, LaneConfig, RoundCost};
use common::*;

/// 3 ms a forward, 0.2 ms a decode row, 0.05 ms a prompt row.
fn cost(decode: usize, chunk: usize) -> Duration {
    Duration::from_micros(3000 + 200 * decode as u64 + 50 * chunk as u64)
}

/// The arriving prompt's stream (the lane numbers streams from 1 as submitted).
const ARRIVAL: u64 = 5;

fn paced(target: Option<Duration>) -> Vec<Call> {
    paced_on(target, 0, 4096)
}

/// [`paced`] on a backend that replays chunks of up to `replayed` rows,
/// the pass cut every `chunk_tokens`.
fn paced_on(target: Option<Duration>, replayed: usize, chunk_tokens: usize) -> Vec<Call> {
    paced_with(target, None, replayed, chunk_tokens)
}

/// [`paced_on`], or with a `share` of a plain round instead of a target.
fn paced_with(target: Option<Duration>, share: Option<f32>, replayed: usize, chunk_tokens: usize) -> Vec<Call> {
    paced_told(target, share, replayed, chunk_tokens, Vec::new())
}

/// [`paced_with`], the lane told `round_costs` before it runs.
fn paced_told(target: Option<Duration>, share: Option<f32>, replayed: usize, chunk_tokens: usize, round_costs: Vec<RoundCost>) -> Vec<Call> {
    paced_ahead(target, share, replayed, chunk_tokens, round_costs, false, cost)
}

/// [`paced_told`] on a backend that launches rounds ahead or not, its
/// rounds costing `cost`.
fn paced_ahead(
    target: Option<Duration>,
    share: Option<f32>,
    replayed: usize,
    chunk_tokens: usize,
    round_costs: Vec<RoundCost>,
    ahead: bool,
    cost: fn(usize, usize) -> Duration,
) -> Vec<Call> {
    paced_caps(1800, target, share, replayed, chunk_tokens, round_costs, |c| c.launches_ahead = ahead, cost)
}

/// [`paced_ahead`], a prompt of `arrival` rows arriving, the fake's
/// capabilities set by `caps`.
#[allow(clippy::too_many_arguments)]
fn paced_caps(
    arrival: usize,
    target: Option<Duration>,
    share: Option<f32>,
    replayed: usize,
    chunk_tokens: usize,
    round_costs: Vec<RoundCost>,
    caps: impl Fn(&mut Capabilities),
    cost: fn(usize, usize) -> Duration,
) -> Vec<Call> {
    let mut fc = FakeConfig { round_cost: Some(cost), ..FakeConfig::default() };
    fc.caps.chunk_invariant = true;
    fc.caps.max_batch = 4096;
    fc.caps.replayed_chunk_rows = replayed;
    caps(&mut fc.caps);
    let lc = LaneConfig { itl_target: target, prefill_share: share, chunk_tokens, prefix_marks: 0, round_costs, ..no_marks() };
    let (lane, log) = lane(fc, lc);
    // Four streams decode, then the prompt arrives.
    let bg: Vec<_> = (0..4).map(|i| lane.submit(greedy(prompt(8, i), LONG)).unwrap()).collect();
    for h in &bg {
        wait_event(h, |e| matches!(e, Event::Token { .. }));
    }
    let arrival = lane.submit(greedy(prompt(arrival, 9), 1)).unwrap();
    let out = drain(&arrival);
    assert_eq!(out.tokens.len(), 1, "the arrival gets its token");
    drop(bg);
    lane.shutdown();
    log.snapshot()
}

#[test]
fn a_target_keeps_shared_rounds_within_it_and_the_arrival_advances() {
    let target = Duration::from_millis(12);
    let calls = paced(Some(target));
    // Every round that carried both the decode rows and a chunk, in order.
    let shared: Vec<(usize, usize)> = calls
        .iter()
        .filter_map(|c| match (c.chunk(), c.rows().len()) {
            (Some(ch), n) if n > 0 && ch.stream == ARRIVAL => Some((c.rows().iter().map(|r| r.1.len()).sum(), ch.tokens.len())),
            _ => None,
        })
        .collect();
    let around: Vec<String> = calls
        .iter()
        .filter(|c| c.chunk().is_some() || !c.rows().is_empty())
        .take(40)
        .map(|c| format!("{:?}/{:?}", c.rows().iter().map(|r| r.0).collect::<Vec<_>>(), c.chunk().map(|ch| (ch.stream, ch.start, ch.tokens.len()))))
        .collect();
    assert!(shared.len() > 8, "the prompt was cut over the decode rounds: {shared:?}\n{around:?}");
    // The arrival's chunks cover it, one a round.
    let arrival: Vec<usize> = calls.iter().filter_map(Call::chunk).filter(|c| c.stream == ARRIVAL).map(|c| c.tokens.len()).collect();
    assert_eq!(arrival.iter().sum::<usize>(), 1800, "{arrival:?}");
    // After the model's first rounds (the pacer probes, doubling), no
    // shared round's scripted cost passes the target.
    let late: Vec<Duration> = shared.iter().skip(8).map(|&(d, c)| cost(d, c)).collect();
    assert!(late.iter().all(|&c| c <= target + Duration::from_micros(100)), "rounds past the target: {late:?}");
    // The target is used: 12 ms leaves room for ~160 rows beside 4 streams.
    let biggest = shared.iter().map(|s| s.1).max().unwrap_or(0);
    assert!(biggest >= 40, "chunks stayed small: {shared:?}");
}

#[test]
fn beside_decode_rows_a_replaying_backend_gets_only_the_sizes_it_replays() {
    // The target would allow ~160 rows; the pass is cut every 100 rows,
    // which no replayed size divides.
    let calls = paced_on(Some(Duration::from_millis(12)), 64, 100);
    let shared = shared_chunks(&calls);
    assert!(shared.len() > 8 && shared.contains(&64), "{shared:?}");
    assert!(shared.iter().all(|&n| replayed_size(n) && n <= 64), "a shared chunk the backend does not replay: {shared:?}");
    let all: usize = calls.iter().filter_map(Call::chunk).filter(|c| c.stream == ARRIVAL).map(|c| c.tokens.len()).sum();
    assert_eq!(all, 1800);
}

#[test]
fn a_backend_that_pads_takes_a_prompts_last_rows_in_one_round() {
    // A 12 ms target (~160 rows a round) on a backend replaying up to 64
    // rows, a 1799-row prompt: its last 23 rows go as one chunk (run as
    // 24) on a backend that pads, as 16, 4, 2 and 1 on one that does not.
    let target = Some(Duration::from_millis(12));
    let arrive = |pads: bool| paced_caps(1799, target, None, 64, 4096, Vec::new(), |c| c.pads_chunks = pads, cost);
    let kept = shared_chunks(&arrive(false));
    let calls = arrive(true);
    let padded = shared_chunks(&calls);
    assert!(kept.ends_with(&[16, 4, 2, 1]), "{kept:?}");
    assert_eq!(padded.last(), Some(&23), "{padded:?}");
    assert_eq!(padded.len() + 3, kept.len(), "padded {padded:?}, kept {kept:?}");
    // Only the prompt's last rows are not a replayed size.
    let arrival: Vec<usize> = calls.iter().filter_map(Call::chunk).filter(|c| c.stream == ARRIVAL).map(|c| c.tokens.len()).collect();
    assert_eq!(arrival.iter().sum::<usize>(), 1799);
    assert!(arrival[..arrival.len() - 1].iter().all(|&n| replayed_size(n)), "{arrival:?}");
}

/// The arrival's chunks that shared a round with the decode rows.
fn shared_chunks(calls: &[Call]) -> Vec<usize> {
    calls.iter().filter_map(|c| c.chunk().filter(|ch| ch.stream == ARRIVAL && !c.rows().is_empty()).map(|ch| ch.tokens.len())).collect()
}

#[test]
fn a_target_and_a_share_take_the_largest_replayed_sizes_within_them() {
    // Replays up to 256 rows. A 12 ms target leaves room for ~160 rows a
    // round: it runs chunks of 128 rows or more, none past the room.
    let target = shared_chunks(&paced_with(Some(Duration::from_millis(12)), None, 256, 4096));
    let largest = target.iter().copied().max().unwrap_or(0);
    assert!((128..=160).contains(&largest) && target.iter().all(|&n| replayed_size(n)), "{target:?}");
    // A share of 1.9 plain rounds (7.2 ms beside four streams' 3.8) holds
    // 144 rows: untold, it probes up a size at a time, passes the share
    // once (160 rows, 2.1), then keeps to 128 (1.7). (Each size runs twice
    // as it probes: the next chunk is sized a round early.)
    let share = shared_chunks(&paced_with(None, Some(1.9), 256, 4096));
    assert!(share.iter().all(|&n| replayed_size(n) && n <= 160), "{share:?}");
    assert!(share.iter().filter(|&&n| n == 160).count() <= 2, "{share:?}");
    let after = share.iter().rposition(|&n| n == 160).expect("the probe passes the share") + 1;
    assert!(share[after..].iter().all(|&n| n <= 128) && share[after..].iter().filter(|&&n| n == 128).count() >= 2, "{share:?}");
}

/// The rounds a warm-up would time: each count of decode rows (of 9
/// tokens each) beside each chunk size (0: none), at `cost`.
fn warm_up(decode: &[usize], chunks: &[usize], cost: fn(usize, usize) -> Duration) -> Vec<RoundCost> {
    let round = |d: usize, c: usize| RoundCost { decode_rows: d, decode_ctx: 9 * d, chunk_rows: c, chunk_start: 0, secs: cost(d, c).as_secs_f64() };
    decode.iter().flat_map(|&d| chunks.iter().map(move |&c| round(d, c))).collect()
}

#[test]
fn rounds_timed_before_serving_size_the_first_arrival_without_probing() {
    // What a warm-up would time: 1–8 decode rows, alone and beside chunks
    // of 16–256 rows, each at the script's cost.
    let told = warm_up(&[1, 2, 4, 8], &[0, 16, 64, 128, 256], cost);
    let target = Some(Duration::from_millis(12));
    let cold = shared_chunks(&paced_told(target, None, 256, 4096, Vec::new()));
    let warm = shared_chunks(&paced_told(target, None, 256, 4096, told));
    // Cold, the pacer probes up (doubling from what the decoding streams'
    // own short prompts showed it); told, its first chunk takes the room
    // 12 ms leaves beside four streams (~160 rows), and no chunk passes it.
    assert!(cold[0] < 64, "{cold:?}");
    assert!((128..=160).contains(&warm[0]), "{warm:?}");
    assert!(warm.iter().all(|&n| n <= 160), "{warm:?}");
    assert!(warm.len() < cold.len(), "told {} rounds, cold {}", warm.len(), cold.len());
}

/// A GPU's step: 3 ms a forward, 0.2 ms a decode row, 0.01 ms a prompt
/// row, and 3 ms more for a chunk past 16 rows (other kernels).
fn stepped(decode: usize, chunk: usize) -> Duration {
    Duration::from_micros(3000 + 200 * decode as u64 + 10 * chunk as u64 + if chunk > 16 { 3000 } else { 0 })
}

#[test]
fn a_share_passes_over_chunk_sizes_that_cost_a_step_more() {
    // A share of 0.3 of a 3.8 ms round allows ~1.1 ms of chunk: 16 rows
    // add 0.16 ms, 32 rows 3.3. Told the warm-up's rounds, the pacer never
    // runs a dear size; left to find it, it runs one once (or twice: the
    // next chunk is sized a round early, before the first one's cost is in).
    let told = warm_up(&[1, 4], &[0, 16, 24, 32, 64], stepped);
    let warm = shared_chunks(&paced_ahead(None, Some(0.3), 64, 4096, told, false, stepped));
    assert!(warm.len() > 8 && warm.iter().all(|&n| n <= 16), "{warm:?}");
    assert!(warm.iter().filter(|&&n| n == 16).count() * 2 > warm.len(), "mostly the largest affordable size: {warm:?}");
    let cold = shared_chunks(&paced_ahead(None, Some(0.3), 64, 4096, Vec::new(), false, stepped));
    assert!(cold.iter().filter(|&&n| n > 16).count() <= 2, "{cold:?}");
    // Without the step, the same share takes larger chunks.
    let flat = shared_chunks(&paced_ahead(None, Some(0.3), 64, 4096, Vec::new(), false, |d, c| stepped(d, c.min(16))));
    assert!(flat.iter().any(|&n| n > 16), "{flat:?}");
}

#[test]
fn without_a_target_or_share_the_chunk_is_the_whole_cap() {
    let calls = paced(None);
    let chunks: Vec<usize> = calls.iter().filter_map(Call::chunk).filter(|c| c.stream == ARRIVAL).map(|c| c.tokens.len()).collect();
    assert_eq!(chunks, vec![1800], "one chunk of the whole prompt");
}

#[test]
fn each_shared_round_names_the_chunk_the_next_round_runs() {
    let calls = paced(Some(Duration::from_millis(12)));
    let rounds: Vec<&Call> = calls.iter().filter(|c| matches!(c, Call::Round { .. })).collect();
    let streams = |c: &Call| c.rows().iter().map(|r| r.0).collect::<Vec<_>>();
    let mut kept = 0;
    let mut named_arrival = 0;
    for w in rounds.windows(2) {
        let Call::Round { next_chunk: Some(named), .. } = w[0] else { continue };
        // The same streams decode a token further: the next round runs
        // the very chunk named (so a backend may have started it).
        if streams(w[0]) == streams(w[1]) {
            assert_eq!(w[1].chunk(), Some(named), "round {:?} named {named:?}", w[0].chunk());
            kept += (named.stream == ARRIVAL) as usize;
        }
        named_arrival += (named.stream == ARRIVAL) as usize;
    }
    // Every shared chunk of the arrival but its first was named a round
    // ahead; the round with its last chunk names none.
    let shared: Vec<&&Call> = rounds.iter().filter(|c| c.chunk().is_some_and(|ch| ch.stream == ARRIVAL) && !c.rows().is_empty()).collect();
    assert!(shared.len() > 8 && kept + 1 >= shared.len() && named_arrival == kept, "{kept} named of {} shared chunks", shared.len());
    let last = shared.last().expect("shared chunks");
    assert!(matches!(last, Call::Round { next_chunk: None, .. }), "the pass's last chunk names no next one");
}

/// Under a share on a backend that replays no chunk sizes, the pacer
/// times the decode rows alone every few shared rounds. Each such round
/// mid-pass is said (`next_plain`) by the round before it, and names the
/// chunk after it, so a backend that launches rounds ahead starts both (on
/// the H100 one started afresh cost a third of a round more, twice in
/// every ten); so are the rounds after the pass. A replaying backend's
/// pass times none: the plain round before it serves it whole.
#[test]
fn a_plain_round_mid_pass_is_said_a_round_before_and_names_the_next_chunk() {
    let replaying = paced_ahead(None, Some(0.3), 64, 4096, Vec::new(), true, cost);
    let rounds: Vec<&Call> = replaying.iter().filter(|c| matches!(c, Call::Round { .. }) && !c.rows().is_empty()).collect();
    let arrival = |c: &Call| c.chunk().is_some_and(|ch| ch.stream == ARRIVAL);
    let (first, last) = (rounds.iter().position(|c| arrival(c)).unwrap(), rounds.iter().rposition(|c| arrival(c)).unwrap());
    assert!(rounds[first..=last].iter().all(|c| arrival(c)), "a plain round mid-pass on a replaying backend");
    let calls = paced_ahead(None, Some(0.3), 0, 4096, Vec::new(), true, cost);
    let rounds: Vec<&Call> = calls.iter().filter(|c| matches!(c, Call::Round { .. }) && !c.rows().is_empty()).collect();
    let arrival = |c: &Call| c.chunk().is_some_and(|ch| ch.stream == ARRIVAL);
    let (first, last) = (rounds.iter().position(|c| arrival(c)).unwrap(), rounds.iter().rposition(|c| arrival(c)).unwrap());
    let mut plain = 0;
    for i in first + 1..last {
        if rounds[i].chunk().is_some() {
            continue;
        }
        plain += 1;
        assert!(matches!(rounds[i - 1], Call::Round { next_plain: true, next_chunk: None, .. }), "round before a plain one: {:?}", rounds[i - 1]);
        let Call::Round { next_chunk: Some(named), .. } = rounds[i] else { panic!("a plain round mid-pass named no chunk: {:?}", rounds[i]) };
        assert_eq!(rounds[i + 1].chunk(), Some(named));
    }
    assert!(plain >= 2, "{plain} plain rounds mid-pass");
    // Past the pass, no prompt is under way: each round says so.
    assert!(rounds[last + 1..].iter().all(|c| matches!(c, Call::Round { next_plain: true, .. })), "{:?}", &rounds[last + 1..]);
    // No round says a plain one that does not come.
    for w in rounds.windows(2) {
        if let Call::Round { next_plain: true, .. } = w[0] {
            assert_eq!(w[1].chunk(), None, "said plain, ran {:?}", w[1]);
        }
    }
}

#[test]
fn where_rounds_launch_ahead_the_first_shared_chunk_is_named_a_round_before() {
    let calls = paced_ahead(Some(Duration::from_millis(12)), None, 256, 4096, Vec::new(), true, cost);
    let rounds: Vec<&Call> = calls.iter().filter(|c| matches!(c, Call::Round { .. })).collect();
    let first = rounds.iter().position(|c| c.chunk().is_some_and(|ch| ch.stream == ARRIVAL)).expect("the arrival shares rounds");
    assert!(!rounds[first].rows().is_empty(), "its first chunk rides beside the decode rows");
    // The round before it ran the decode rows alone and named that chunk,
    // so a backend could start the round with it.
    let Call::Round { next_chunk: Some(named), .. } = rounds[first - 1] else { panic!("the round before named no chunk: {:?}", rounds[first - 1]) };
    assert_eq!(rounds[first - 1].chunk(), None);
    assert_eq!(rounds[first].chunk(), Some(named));
    // It waited one round, not more: the round before that named nothing
    // of the arrival's.
    assert!(!matches!(rounds[first - 2], Call::Round { next_chunk: Some(n), .. } if n.stream == ARRIVAL));
    // Without launching ahead, the first chunk runs at once, unnamed.
    let calls = paced_ahead(Some(Duration::from_millis(12)), None, 256, 4096, Vec::new(), false, cost);
    let rounds: Vec<&Call> = calls.iter().filter(|c| matches!(c, Call::Round { .. })).collect();
    let first = rounds.iter().position(|c| c.chunk().is_some_and(|ch| ch.stream == ARRIVAL)).expect("the arrival shares rounds");
    assert!(!matches!(rounds[first - 1], Call::Round { next_chunk: Some(n), .. } if n.stream == ARRIVAL));
}
