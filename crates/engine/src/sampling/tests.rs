use super::*;
use std::collections::HashSet;

/// Logits whose softmax is exactly `probs`.
fn from_probs(probs: &[f64]) -> Vec<f32> {
    probs.iter().map(|&p| p.ln() as f32).collect()
}

fn support(params: SamplingParams, logits: &[f32], draws: usize) -> HashSet<u32> {
    let mut s = Sampler::new(&SamplingParams { seed: Some(7), ..params }, &[]);
    (0..draws).map(|_| s.sample(&mut logits.to_vec(), None).token).collect()
}

fn pseudo_logits(n: usize, seed: u64) -> Vec<f32> {
    let mut r = Rng::new(seed);
    (0..n).map(|_| (r.next_f64() * 12.0 - 6.0) as f32).collect()
}

/// Top-p over a whole row, as a sort would take it: the row sorted
/// (largest logit first, the lower index first on ties), cut where the
/// running weight reaches `top_p` of the row's, min-p applied, and the
/// token at which the running weight of what is kept passes `u` times
/// its sum.
fn nucleus_by_sort(row: &[f32], p: &SamplingParams, u: f64) -> u32 {
    let max = row_max(row);
    let inv_t = 1.0 / p.temperature;
    let weight = |l: f32| exp_nonpositive((key(l) - max) * inv_t) as f64;
    let total = row_weights(row, max, inv_t, &mut Vec::new(), &mut Vec::new());
    let mut all = top_n(row, row.len());
    let mut cum = 0.0;
    let cut = all.iter().position(|&(_, l)| {
        cum += weight(l);
        cum >= p.top_p as f64 * total
    });
    all.truncate(cut.map_or(all.len(), |c| c + 1));
    if p.min_p > 0.0 {
        let floor = max as f64 + (p.min_p as f64).ln() * p.temperature as f64;
        all.retain(|&(_, l)| key(l) as f64 >= floor);
    }
    let target = u * all.iter().map(|&(_, l)| weight(l)).sum::<f64>();
    let mut cum = 0.0;
    for &(t, l) in &all {
        cum += weight(l);
        if cum > target {
            return t;
        }
    }
    all[all.len() - 1].0
}

/// Where in the row's order the running weight passes a mass, found
/// without a sort, is where a sorted walk finds it; a mass past the
/// row's (rounding) keeps every possible token.
#[test]
fn the_order_finds_where_a_sorted_walk_passes_a_mass() {
    let mut rng = Rng::new(7);
    for round in 0..50 {
        let mut row = pseudo_logits(1500, round);
        for i in (0..1500).step_by(13) {
            row[i] = row[(i * 5 + 1) % 1500]; // ties
        }
        row[0] = f32::NEG_INFINITY; // impossible, and last in the order
        let max = row_max(&row);
        let w: Vec<f32> = row.iter().map(|&l| exp_nonpositive(key(l) - max)).collect();
        let sorted = top_n(&row, row.len());
        let total: f64 = w.iter().map(|&x| x as f64).sum();
        let o = Ordered::new(&row, &w);
        for _ in 0..20 {
            let goal = rng.next_f64() * total;
            let mut cum = 0.0;
            let want = sorted.iter().find(|&&(t, _)| {
                cum += w[t as usize] as f64;
                cum > goal
            });
            assert_eq!(o.crossing(goal, true).map(|c| c.0 as u32), want.map(|&(t, _)| t), "round {round}");
        }
        // Past the row's mass: no crossing, and a draw at the very end
        // takes the last possible token.
        assert_eq!(o.crossing(total * 1.001, false), None);
        let last_possible = sorted.iter().rev().find(|&&(t, _)| w[t as usize] > 0.0).unwrap().0;
        assert_eq!(o.draw_nucleus(total * 1.001, None, 1.0 - 1e-12) as u32, last_possible);
        assert_eq!(o.last_of(|i| w[i] > 0.0) as u32, last_possible);
    }
}

/// Top-p alone over a row whose nucleus is past the first 64 tokens
/// (found without sorting the row) draws the token a sort of the row
/// would, draw for draw: flat and peaked rows, ties, NaN and masked
/// (-inf) tokens, with and without min-p.
#[test]
fn a_wide_nucleus_draws_what_a_sorted_row_would() {
    let mut cases = 0;
    for (c, (top_p, temperature, min_p)) in
        [(0.95, 1.0, 0.0), (0.5, 0.7, 0.0), (0.999, 1.5, 0.0), (0.9, 1.0, 0.05), (0.95, 2.0, 0.5), (0.3, 1.0, 0.0)].into_iter().enumerate()
    {
        let params = SamplingParams { top_p, temperature, min_p, seed: Some(c as u64), ..Default::default() };
        let mut sampler = Sampler::new(&params, &[]);
        let mut rng = Rng::new(c as u64);
        for round in 0..60 {
            let n = 2000 + 37 * round;
            let mut row = pseudo_logits(n, (c * 100 + round) as u64);
            if round % 3 == 1 {
                // Peaked: a few dozen likely tokens over a flat tail.
                for (i, l) in row.iter_mut().enumerate().filter(|(i, _)| i % 29 == 0) {
                    *l += 4.0 + (i % 7) as f32;
                }
            }
            if round % 4 == 0 {
                // Ties (within and across the buckets), NaN, masked tokens.
                for i in (0..n).step_by(11) {
                    row[i] = row[(i * 7 + 3) % n];
                }
                row[5] = f32::NAN;
                row[n - 1] = f32::NEG_INFINITY;
                row[n / 2] = f32::NEG_INFINITY;
            }
            let u = rng.next_f64();
            let want = nucleus_by_sort(&row, &params, u);
            let got = sampler.sample(&mut row.clone(), None).token;
            assert_eq!(got, want, "case {c} round {round}");
            cases += 1;
        }
    }
    assert_eq!(cases, 360);
}

/// A top-k of the whole vocabulary or more narrows nothing: top-p then
/// applies once, over the row (it applied a second time, over its own
/// nucleus, before).
#[test]
fn top_k_past_the_vocabulary_leaves_top_p_as_it_is() {
    for (n, top_p) in [(50, 0.5), (3000, 0.5), (3000, 0.9)] {
        let whole = SamplingParams { top_p, seed: Some(4), ..Default::default() };
        let wide = SamplingParams { top_k: n + 5, ..whole.clone() };
        let (mut a, mut b) = (Sampler::new(&whole, &[]), Sampler::new(&wide, &[]));
        for round in 0..100 {
            let row = pseudo_logits(n, round);
            assert_eq!(a.sample(&mut row.clone(), None).token, b.sample(&mut row.clone(), None).token, "{n} tokens, top_p {top_p}, round {round}");
        }
    }
}

/// A backend's top-k candidates stand in for the whole row: the same
/// tokens from the same seed, draw for draw, under every filter that
/// applies among them; penalties and plain temperature need the row.
#[test]
fn sampling_from_the_top_candidates_equals_sampling_the_row() {
    let cases = [
        SamplingParams::greedy(),
        SamplingParams { top_k: 1, ..Default::default() },
        SamplingParams { top_k: 5, temperature: 0.7, ..Default::default() },
        SamplingParams { top_k: 40, top_p: 0.9, ..Default::default() },
        SamplingParams { top_k: 64, min_p: 0.05, temperature: 1.3, ..Default::default() },
        SamplingParams { top_k: 20, top_p: 0.5, min_p: 0.1, ..Default::default() },
    ];
    for (c, params) in cases.iter().enumerate() {
        let k = Sampler::new(params, &[]).needs_only_top().expect("top-k or greedy");
        let seeded = SamplingParams { seed: Some(9), ..params.clone() };
        let (mut whole, mut top) = (Sampler::new(&seeded, &[]), Sampler::new(&seeded, &[]));
        for round in 0..200 {
            let mut logits = pseudo_logits(3000, (c * 1000 + round) as u64);
            if round % 7 == 0 {
                logits[round] = logits[(round + 1) % 3000]; // a tie
                logits[2999] = f32::NAN;
            }
            let cands = top_n(&logits, k);
            let a = whole.sample(&mut logits.clone(), None).token;
            let b = top.sample_top(&cands);
            assert_eq!(a, b, "case {c} round {round}");
        }
    }
    for params in [
        SamplingParams { repetition_penalty: 1.1, ..SamplingParams::greedy() },
        SamplingParams { presence_penalty: 0.5, top_k: 5, ..Default::default() },
        SamplingParams { top_p: 0.9, ..Default::default() },
        SamplingParams::default(),
    ] {
        assert_eq!(Sampler::new(&params, &[]).needs_only_top(), None, "{params:?}");
    }
}

#[test]
fn greedy_is_argmax_and_needs_no_seed() {
    for seed in 0..20 {
        let logits = pseudo_logits(1000, seed);
        let (best, _) = logits.iter().enumerate().fold((0, f32::MIN), |a, (i, &v)| if v > a.1 { (i, v) } else { a });
        let mut s = Sampler::new(&SamplingParams::greedy(), &[]);
        assert_eq!(s.sample(&mut logits.clone(), None).token, best as u32);
    }
}

#[test]
fn same_seed_same_tokens_other_seed_other_tokens() {
    let logits = pseudo_logits(500, 1);
    let run = |seed| {
        let mut s = Sampler::new(&SamplingParams { seed: Some(seed), temperature: 1.5, ..Default::default() }, &[1, 2, 3]);
        (0..64)
            .map(|_| {
                let t = s.sample(&mut logits.clone(), None).token;
                s.accept(t);
                t
            })
            .collect::<Vec<u32>>()
    };
    assert_eq!(run(11), run(11));
    assert_ne!(run(11), run(12));
}

#[test]
fn temperature_sampling_follows_the_softmax() {
    let probs = [0.5, 0.3, 0.15, 0.05];
    let logits = from_probs(&probs);
    let mut s = Sampler::new(&SamplingParams { seed: Some(3), ..Default::default() }, &[]);
    let mut counts = [0usize; 4];
    let n = 20_000;
    for _ in 0..n {
        counts[s.sample(&mut logits.clone(), None).token as usize] += 1;
    }
    for (c, p) in counts.iter().zip(probs) {
        let f = *c as f64 / n as f64;
        assert!((f - p).abs() < 0.015, "frequency {f} for probability {p}");
    }
}

#[test]
fn top_k_restricts_the_support_to_the_k_best() {
    let logits = pseudo_logits(5000, 2);
    let mut order: Vec<u32> = (0..5000).collect();
    order.sort_by(|&a, &b| logits[b as usize].total_cmp(&logits[a as usize]));
    let best3: HashSet<u32> = order[..3].iter().copied().collect();
    // A high temperature flattens the distribution so all three show up.
    let got = support(SamplingParams { top_k: 3, temperature: 5.0, ..Default::default() }, &logits, 2000);
    assert_eq!(got, best3);
}

#[test]
fn top_p_keeps_the_smallest_set_reaching_p() {
    let logits = from_probs(&[0.05, 0.5, 0.15, 0.3]);
    let got = support(SamplingParams { top_p: 0.7, ..Default::default() }, &logits, 2000);
    assert_eq!(got, HashSet::from([1, 3]));
    let got = support(SamplingParams { top_p: 0.9, ..Default::default() }, &logits, 2000);
    assert_eq!(got, HashSet::from([1, 3, 2]));
}

#[test]
fn top_p_over_a_large_vocabulary_matches_a_full_sort() {
    let v = 262_144;
    let logits = pseudo_logits(v, 9);
    let mut order: Vec<u32> = (0..v as u32).collect();
    order.sort_by(|&a, &b| logits[b as usize].total_cmp(&logits[a as usize]));
    let max = logits[order[0] as usize] as f64;
    let w: Vec<f64> = logits.iter().map(|&l| (l as f64 - max).exp()).collect();
    let total: f64 = w.iter().sum();
    let mut cum = 0.0;
    let mut nucleus = HashSet::new();
    for &t in &order {
        nucleus.insert(t);
        cum += w[t as usize];
        if cum >= 0.2 * total {
            break;
        }
    }
    let got = support(SamplingParams { top_p: 0.2, ..Default::default() }, &logits, 300);
    assert!(nucleus.len() > 64, "the nucleus should need more than one growth step");
    assert!(got.is_subset(&nucleus), "sampled outside the nucleus");
    assert!(got.len() > 10);
}

#[test]
fn top_k_then_top_p_renormalises_over_the_survivors() {
    // Top-2 leaves {1: 0.5, 3: 0.3}; renormalised 0.625 / 0.375, so
    // top_p 0.6 keeps only token 1.
    let logits = from_probs(&[0.05, 0.5, 0.15, 0.3]);
    let got = support(SamplingParams { top_k: 2, top_p: 0.6, ..Default::default() }, &logits, 500);
    assert_eq!(got, HashSet::from([1]));
}

#[test]
fn min_p_drops_tokens_below_a_fraction_of_the_best() {
    let logits = from_probs(&[0.5, 0.3, 0.15, 0.05]);
    // 0.25 * 0.5 = 0.125: tokens 0, 1, 2 stay.
    let got = support(SamplingParams { min_p: 0.25, ..Default::default() }, &logits, 3000);
    assert_eq!(got, HashSet::from([0, 1, 2]));
    // 0.7 * 0.5 = 0.35: only token 0 stays.
    let got = support(SamplingParams { min_p: 0.7, ..Default::default() }, &logits, 500);
    assert_eq!(got, HashSet::from([0]));
}

#[test]
fn repetition_penalty_touches_only_the_window() {
    let params = SamplingParams { repetition_penalty: 2.0, repetition_window: 3, ..Default::default() };
    // Prompt tail within the window: 2, 3, 4 (token 1 falls outside).
    let s = Sampler::new(&params, &[1, 2, 3, 4]);
    let mut l = vec![1.0, 1.0, -1.0, 4.0, 0.5, 1.0];
    s.apply_penalties(&mut l);
    assert_eq!(l, vec![1.0, 1.0, -2.0, 2.0, 0.25, 1.0]);
}

#[test]
fn presence_and_frequency_penalties_see_only_the_completion() {
    let params = SamplingParams { presence_penalty: 0.5, frequency_penalty: 0.25, ..Default::default() };
    let mut s = Sampler::new(&params, &[0, 1, 2]);
    s.accept(2);
    s.accept(2);
    s.accept(3);
    let mut l = vec![0.0; 5];
    s.apply_penalties(&mut l);
    // Token 2: 0.5 + 2 * 0.25; token 3: 0.5 + 0.25; prompt tokens 0, 1 untouched.
    assert_eq!(l, vec![0.0, 0.0, -1.0, -0.75, 0.0]);
}

#[test]
fn penalties_steer_greedy_away_from_repeats() {
    let mut s = Sampler::new(&SamplingParams { repetition_penalty: 4.0, ..SamplingParams::greedy() }, &[0]);
    let logits = vec![3.0, 2.0, 1.0];
    assert_eq!(s.sample(&mut logits.clone(), None).token, 1);
}

#[test]
fn logprobs_are_the_raw_log_softmax() {
    let logits = pseudo_logits(300, 5);
    let lse = logits.iter().map(|&x| (x as f64).exp()).sum::<f64>().ln();
    let mut s = Sampler::new(&SamplingParams { seed: Some(1), temperature: 0.7, repetition_penalty: 1.5, ..Default::default() }, &[5, 6, 7]);
    let out = s.sample(&mut logits.clone(), Some(5));
    let want = logits[out.token as usize] as f64 - lse;
    assert!((out.logprob.unwrap() as f64 - want).abs() < 1e-4);
    assert_eq!(out.top.len(), 5);
    let mut order: Vec<usize> = (0..300).collect();
    order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]));
    for (i, &(t, lp)) in out.top.iter().enumerate() {
        assert_eq!(t as usize, order[i]);
        assert!((lp as f64 - (logits[order[i]] as f64 - lse)).abs() < 1e-4);
    }
}

#[test]
fn top_n_agrees_with_sorting_for_small_and_large_n() {
    let logits = pseudo_logits(4000, 4);
    let mut order: Vec<u32> = (0..4000).collect();
    order.sort_by(|&a, &b| logits[b as usize].total_cmp(&logits[a as usize]));
    for n in [1, 7, 64, 65, 500, 4000, 5000] {
        let got: Vec<u32> = top_n(&logits, n).into_iter().map(|(t, _)| t).collect();
        assert_eq!(got, order[..n.min(4000)].to_vec(), "n = {n}");
    }
}

#[test]
fn nan_logits_do_not_win_or_panic() {
    let mut s = Sampler::new(&SamplingParams::greedy(), &[]);
    assert_eq!(s.sample(&mut [f32::NAN, 1.0, f32::NAN], None).token, 1);
    let mut s = Sampler::new(&SamplingParams { seed: Some(1), top_k: 2, ..Default::default() }, &[]);
    for _ in 0..50 {
        let t = s.sample(&mut [f32::NAN, 1.0, 0.5, f32::NAN], None).token;
        assert!(t == 1 || t == 2);
    }
    let mut s = Sampler::new(&SamplingParams { seed: Some(1), ..Default::default() }, &[]);
    s.sample(&mut [f32::NAN; 4], Some(2));
}

#[test]
fn the_fast_exp_matches_libm() {
    let mut worst = 0.0f64;
    let mut x = 0.0f32;
    while x > -80.0 {
        let got = exp_nonpositive(x) as f64;
        let want = (x as f64).exp();
        worst = worst.max((got - want).abs() / want);
        x -= 0.001_3;
    }
    // The error grows with |x| (rounding of x * log2(e)); weights that
    // small hardly matter, and near the top it is float-exact.
    assert!(worst < 1e-5, "worst relative error {worst}");
    let near: f64 =
        (0..10_000).map(|i| -(i as f32) * 0.001).map(|x| ((exp_nonpositive(x) as f64) - (x as f64).exp()).abs() / (x as f64).exp()).fold(0.0, f64::max);
    assert!(near < 1e-6, "relative error near 0: {near}");
    assert_eq!(exp_nonpositive(0.0), 1.0);
    assert_eq!(exp_nonpositive(-100.0), 0.0);
    assert_eq!(exp_nonpositive(f32::NEG_INFINITY), 0.0);
}

#[test]
fn argmax_is_the_first_largest_whatever_the_row() {
    // The one-pass definition argmax must keep to.
    let naive = |l: &[f32]| l.iter().enumerate().fold((0usize, f32::NEG_INFINITY), |(b, bv), (i, &v)| if v > bv { (i, v) } else { (b, bv) }).0 as u32;
    for (n, seed) in [(0, 1), (1, 2), (15, 3), (16, 4), (17, 5), (1000, 6), (128_256, 7)] {
        let mut row = pseudo_logits(n, seed);
        assert_eq!(argmax(&row), naive(&row), "n {n}");
        if n > 3 {
            // Ties (the first wins), NaN and -inf, ±0.
            let (a, b) = (n / 3, 2 * n / 3);
            row[a] = 1e9;
            row[b] = 1e9;
            row[0] = f32::NAN;
            assert_eq!(argmax(&row), a as u32, "n {n}");
            row.iter_mut().for_each(|v| *v = if v.is_nan() { *v } else { f32::NEG_INFINITY });
            assert_eq!(argmax(&row), 0, "n {n}: no finite logit");
            row.iter_mut().for_each(|v| *v = -0.0);
            row[n - 1] = 0.0;
            assert_eq!(argmax(&row), naive(&row), "n {n}: signed zeros");
        }
    }
}

#[test]
fn bad_parameters_are_named() {
    let e = SamplingParams { top_p: 0.0, ..Default::default() }.validate().unwrap_err();
    assert!(e.contains("top_p"));
    let e = SamplingParams { repetition_penalty: -1.0, ..Default::default() }.validate().unwrap_err();
    assert!(e.contains("repetition_penalty"));
    assert!(SamplingParams::default().validate().is_ok());
}
