//! `ModelBackend`'s rounds on the GPU: stepped prefill equal to the whole
//! pass, graphs against eager rounds, greedy and top-k rounds against host
//! picks, rounds prepared and launched ahead, and rounds that differ from
//! the one launched ahead against a backend with ahead off.

use super::*;

/// A prompt run whole (chunks back to back) and stepped (the same cuts, a
/// decode round of another stream between chunks) gives bit-identical
/// logits and the same greedy continuation.
#[test]
fn stepped_prefill_equals_whole() {
    let Some(dev) = gpu() else { return };
    for name in ["llama", "qwen3"] {
        let r = reference(name);
        let toks: Vec<u32> = r["tokens"].1.iter().map(|&t| t as u32).collect();
        let mut be = backend(&dev, &fixture_dir(name));
        let vocab = be.capabilities().vocab_size;
        let run = |be: &mut ModelBackend<Cuda>, id: u64, interleave: bool| -> (Vec<f32>, Vec<u32>) {
            be.open(id).unwrap();
            if interleave {
                be.open(id + 100).unwrap();
                be.prefill_step(id + 100, Chunk { start: 0, tokens: &toks[..5], want_logits: false }).unwrap();
            }
            let mut last = Vec::new();
            let mut start = 0;
            for cut in toks.chunks(7) {
                let want = start + cut.len() == toks.len();
                if let Some(l) = be.prefill_step(id, Chunk { start, tokens: cut, want_logits: want }).unwrap() {
                    last = l;
                }
                start += cut.len();
                if interleave {
                    be.decode_logits(&[DecodeRow { stream: id + 100, tokens: vec![1] }]).unwrap();
                }
            }
            let mut out = Vec::new();
            let mut t = argmax(&last) as u32;
            for _ in 0..8 {
                out.push(t);
                let l = feed(be, id, &[t]);
                t = argmax(&l[..vocab]) as u32;
            }
            be.forget(id);
            be.forget(id + 100);
            (last, out)
        };
        let (whole, wt) = run(&mut be, 1, false);
        let (stepped, st) = run(&mut be, 2, true);
        eprintln!("{name}: whole {wt:?} stepped {st:?}");
        assert_eq!(wt, st, "{name}: greedy continuations differ");
        assert!(whole.iter().zip(&stepped).all(|(a, b)| a.to_bits() == b.to_bits()), "{name}: last-row logits not bit-identical");
    }
}

/// A two-layer Llama shape for random-weight tests.
fn tiny_llama() -> braid_models::llama::LlamaConfig {
    braid_models::llama::LlamaConfig {
        hidden: 256,
        layers: 2,
        heads: 8,
        kv_heads: 2,
        head_dim: 32,
        ffn: 512,
        vocab: 1000,
        eps: 1e-5,
        rope: braid_ops::Rope::new(10000.0, 32, true),
        context: 4096,
    }
}

fn tiny_backend(dev: &Cuda, seed: u64) -> ModelBackend<Cuda> {
    let model = braid_models::random::llama(dev, tiny_llama(), seed, false).unwrap();
    ModelBackend::new(dev.clone(), Box::new(model), BackendConfig { kv_tokens: 4096, context: 1024, ..Default::default() }).unwrap()
}

/// The benchmark's greedy rounds (`Backend::round`, picked and launched
/// ahead on the device) give the same tokens as graphs or eager rounds.
#[test]
fn graphs_equal_eager_on_a_model() {
    let Some(dev) = gpu() else { return };
    let model = || Box::new(braid_models::random::llama(&dev, tiny_llama(), 3, false).unwrap());
    let mut be = braid_models::gpubench::backend(&dev, model(), 5, 60).unwrap();
    let (eager_tok_s, eager) = braid_models::gpubench::decode_run(&mut be, 5, 40, 2, 10, false).unwrap();
    let (graph_tok_s, graphed) = braid_models::gpubench::decode_run(&mut be, 5, 40, 2, 10, true).unwrap();
    eprintln!("tiny model: eager {eager_tok_s:.0} tok/s, graphs {graph_tok_s:.0} tok/s, stats {:?}, ahead {:?}", dev.graph_stats(), dev.ahead_hits());
    assert_eq!(eager, graphed, "graph rounds differ from eager rounds");
    assert!(dev.graph_stats().0 > 0, "no graph was replayed");
}

/// Decode rounds served by `ModelBackend` replay CUDA graphs (one per
/// batch shape) and give the same logits, bit for bit, as eager rounds;
/// a round with a prompt chunk runs eagerly beside them.
#[test]
fn backend_decode_rounds_replay_graphs() {
    let Some(dev) = gpu() else { return };
    let mut runs = Vec::new();
    for graphs in [false, true] {
        dev.set_graphs(graphs);
        let before = dev.graph_stats();
        let mut be = tiny_backend(&dev, 7);
        let mut out = Vec::new();
        for s in 0..3u64 {
            be.open(s).unwrap();
            let prompt: Vec<u32> = (0..20 + 7 * s as u32).map(|i| (i * 37 + s as u32) % 1000).collect();
            out.extend(be.prefill_step(s, Chunk { start: 0, tokens: &prompt, want_logits: true }).unwrap().unwrap());
        }
        be.open(9).unwrap();
        let late: Vec<u32> = (0..40).map(|i| (i * 11 + 5) % 1000).collect();
        for round in 0..8u32 {
            let rows: Vec<DecodeRow> = (0..3).map(|s| DecodeRow { stream: s, tokens: vec![(round * 13 + s as u32) % 1000] }).collect();
            if round == 4 {
                let o = be.round(Step::new(&rows, Some((9, Chunk { start: 0, tokens: &late, want_logits: true })), Pick::Logits)).unwrap();
                match o.picked {
                    Picked::Logits(l) => out.extend(l),
                    other => panic!("a logits round returned {other:?}"),
                }
                out.extend(o.chunk_logits.unwrap());
            } else {
                out.extend(be.decode_logits(&rows).unwrap());
            }
        }
        let after = dev.graph_stats();
        if graphs {
            assert!(after.0 - before.0 >= 3, "decode rounds did not replay graphs: {before:?} -> {after:?}");
        }
        runs.push(out);
    }
    dev.set_graphs(true);
    assert!(runs[0].iter().zip(&runs[1]).all(|(a, b)| a.to_bits() == b.to_bits()), "graph-replayed decode rounds differ from eager ones");
}

/// A backend over a random tiny Llama (vocabulary 1000) with streams 0-2
/// prompted, and each one's greedy first token.
fn three_prompted_streams(dev: &Cuda) -> (ModelBackend<Cuda>, Vec<u32>) {
    let mut be = tiny_backend(dev, 11);
    let mut first = Vec::new();
    for s in 0..3u64 {
        be.open(s).unwrap();
        let l = be.prefill_step(s, Chunk { start: 0, tokens: &prompt(s, 10 + 5 * s as usize), want_logits: true }).unwrap().unwrap();
        first.push(argmax(&l) as u32);
    }
    (be, first)
}

fn prompt(s: u64, n: usize) -> Vec<u32> {
    (0..n as u32).map(|i| (i * 31 + 7 * s as u32) % 1000).collect()
}

/// Greedy rounds picked on the device (only token ids come back, each
/// round launched ahead) give the tokens that the host's argmax of the
/// round's logits gives.
#[test]
fn backend_greedy_rounds_equal_host_argmax() {
    let Some(dev) = gpu() else { return };
    let mut runs = Vec::new();
    for on_device in [false, true] {
        let (mut be, mut last) = three_prompted_streams(&dev);
        assert!(be.capabilities().picks.argmax);
        let mut out = last.clone();
        for _ in 0..10 {
            let rows: Vec<DecodeRow> = (0..3).map(|s| DecodeRow { stream: s, tokens: vec![last[s as usize]] }).collect();
            last = if on_device {
                tokens(be.round(Step::new(&rows, None, Pick::Argmax)).unwrap())
            } else {
                be.decode_logits(&rows).unwrap().chunks(1000).map(|r| argmax(r) as u32).collect()
            };
            out.extend(&last);
        }
        runs.push(out);
    }
    assert_eq!(runs[0], runs[1], "device-picked greedy tokens differ from the host's argmax");
}

/// Greedy rounds whose host work was done ahead, while the GPU ran the
/// round before, and which were launched before the engine asked for them,
/// give the tokens eager rounds give (graphs off: the same batches, nothing
/// done ahead), through rounds that are not the one expected: a stream
/// leaves, one joins, one is rewound, block boundaries pass.
#[test]
fn rounds_prepared_ahead_equal_eager() {
    let Some(dev) = gpu() else { return };
    let mut runs = Vec::new();
    for graphs in [false, true] {
        dev.set_graphs(graphs);
        let hits = dev.ahead_hits();
        let (mut be, first) = three_prompted_streams(&dev);
        let mut last: HashMap<u64, u32> = (0..3u64).zip(first).collect();
        let mut lens: HashMap<u64, usize> = [(0, 10), (1, 15), (2, 20)].into();
        let mut out = Vec::new();
        for round in 0..40 {
            if round == 12 {
                be.forget(1);
                last.remove(&1);
            }
            if round == 20 {
                be.open(5).unwrap();
                let p: Vec<u32> = (0..13).map(|i| (i * 17 + 3) % 1000).collect();
                let l = be.prefill_step(5, Chunk { start: 0, tokens: &p, want_logits: true }).unwrap().unwrap();
                last.insert(5, argmax(&l) as u32);
                lens.insert(5, 13);
            }
            if round == 28 {
                // Back two rows: the next round repeats a position the
                // round launched ahead did not expect.
                let l = lens[&0] - 2;
                be.rewind(0, l).unwrap();
                lens.insert(0, l);
                last.insert(0, 42);
            }
            let mut ids: Vec<u64> = last.keys().copied().collect();
            ids.sort();
            let rows: Vec<DecodeRow> = ids.iter().map(|&s| DecodeRow { stream: s, tokens: vec![last[&s]] }).collect();
            let toks = tokens(be.round(Step::new(&rows, None, Pick::Argmax)).unwrap());
            for (&s, &t) in ids.iter().zip(&toks) {
                last.insert(s, t);
                *lens.get_mut(&s).unwrap() += 1;
            }
            out.push(toks);
        }
        if graphs {
            let (n, launched) = (dev.ahead_hits().0 - hits.0, dev.ahead_hits().1 - hits.1);
            eprintln!("rounds served from a forward done ahead: {n} of 40, {launched} of them launched before they were asked for");
            assert!(n >= 20, "only {n} of 40 rounds were prepared ahead");
            assert!(launched >= 20, "only {launched} of 40 rounds were launched ahead");
        }
        runs.push(out);
    }
    dev.set_graphs(true);
    assert_eq!(runs[0], runs[1], "rounds prepared ahead differ from eager rounds");
}

/// Rounds that carry a prompt chunk and name the next one (as the lane's
/// pacer does, `Step::next_chunk`) start that round on the device before
/// it is asked for; the tokens and the prompt's last logits equal eager
/// rounds' (graphs off: nothing started ahead), also where the chunk that
/// runs is not the one named.
#[test]
fn rounds_with_a_named_chunk_started_ahead_equal_eager() {
    let Some(dev) = gpu() else { return };
    let p = prompt(9, 44);
    // The chunks run, and the one each round names for the next (the
    // fourth names 8 rows, then 4 run).
    let runs_rows = [4usize, 8, 8, 16, 4, 4];
    let named = [Some(8usize), Some(8), Some(16), Some(8), Some(4), None];
    let mut runs = Vec::new();
    for graphs in [false, true] {
        dev.set_graphs(graphs);
        let hits = dev.ahead_hits();
        let (mut be, mut last) = three_prompted_streams(&dev);
        be.open(9).unwrap();
        let (mut out, mut pos, mut first, mut last_ahead) = (Vec::new(), 0, None, 0);
        for (i, &n) in runs_rows.iter().enumerate() {
            let rows: Vec<DecodeRow> = (0..3).map(|s| DecodeRow { stream: s, tokens: vec![last[s as usize]] }).collect();
            // The first chunk wants logits too: the logits buffer then holds
            // the row the last chunk adds, so that one can start ahead.
            let chunk = Chunk { start: pos, tokens: &p[pos..pos + n], want_logits: pos + n == p.len() || i == 0 };
            let next = named[i].map(|m| Chunk { start: pos + n, tokens: &p[pos + n..pos + n + m], want_logits: pos + n + m == p.len() });
            let before = dev.ahead_hits().1;
            let o = be.round(Step { next_chunk: next.map(|c| (9, c)), ..Step::new(&rows, Some((9, chunk)), Pick::Argmax) }).unwrap();
            if i + 1 == runs_rows.len() {
                last_ahead = dev.ahead_hits().1 - before;
            }
            if let Some(l) = &o.chunk_logits {
                first = Some(argmax(l) as u32);
            }
            last = tokens(o);
            out.push(last.clone());
            pos += n;
        }
        last.push(first.expect("the last chunk's logits"));
        let in_pass = dev.ahead_hits().1 - hits.1;
        for _ in 0..6 {
            let rows: Vec<DecodeRow> = [0u64, 1, 2, 9].iter().zip(&last).map(|(&s, &t)| DecodeRow { stream: s, tokens: vec![t] }).collect();
            last = tokens(be.round(Step::new(&rows, None, Pick::Argmax)).unwrap());
            out.push(last.clone());
        }
        if graphs {
            let launched = dev.ahead_hits().1 - hits.1;
            eprintln!("{launched} rounds found themselves launched ahead, {in_pass} of them with a chunk");
            // The second and third chunks ran as named ahead (8, 16); the
            // first could not start ahead (stream 1 filled its block, whose
            // next is given only with the round that needs it).
            assert!(in_pass >= 2, "only {in_pass} rounds with a chunk were launched ahead");
            assert_eq!(last_ahead, 1, "the last chunk, which wants logits, was not launched ahead");
            assert!(launched > in_pass, "no decode round after the pass was launched ahead");
        }
        runs.push(out);
    }
    dev.set_graphs(true);
    assert_eq!(runs[0], runs[1], "rounds started ahead with a chunk differ from eager rounds");
}

/// One scripted step of [`rounds_that_differ_from_the_one_launched_ahead`].
#[derive(Clone, Debug)]
pub(super) enum Event {
    /// Open a stream and prefill its prompt in a chunk-only round.
    Join(StreamId, usize),
    /// Open a stream whose prompt arrives as the chunk of the next round.
    Open(StreamId, usize),
    Forget(StreamId),
    /// Drop the stream's last rows.
    Rewind(StreamId, usize),
    /// The next round: this stream's row carries a draft of `n` tokens after its token.
    Draft(StreamId, usize),
    /// The next round: this stream is fed another token than the one picked.
    Other(StreamId),
    /// The next round: the rows in reverse order.
    Reversed,
    /// The next round asks for `pick` (not argmax).
    Pick(Pick),
}

/// A round's decode rows: each stream of `next` fed its next token
/// (another one for `other`), `draft`'s stream with `n` draft tokens after
/// it, in stream order or `reversed`.
pub(super) fn decode_rows(
    next: &HashMap<StreamId, u32>,
    draft: Option<(StreamId, usize)>,
    other: Option<StreamId>,
    reversed: bool,
    vocab: usize,
) -> Vec<DecodeRow> {
    let mut ids: Vec<StreamId> = next.keys().copied().collect();
    ids.sort();
    if reversed {
        ids.reverse();
    }
    ids.iter()
        .map(|&s| {
            let mut t = vec![if other == Some(s) { (next[&s] + 1) % vocab as u32 } else { next[&s] }];
            if let Some((_, n)) = draft.filter(|d| d.0 == s) {
                let t0 = t[0];
                t.extend((0..n as u32).map(|i| (t0 + 7 * i + 3) % vocab as u32));
            }
            DecodeRow { stream: s, tokens: t }
        })
        .collect()
}

/// The rounds of the scenario: (round, what happens before it), a stream
/// leaving last when `leave`.
pub(super) fn script(leave: bool) -> Vec<(usize, Event)> {
    let mut v = vec![
        (4, Event::Open(3, 13)),
        (7, Event::Other(1)),
        (9, Event::Draft(0, 2)),
        (11, Event::Reversed),
        (13, Event::Join(4, 9)),
        (15, Event::Pick(Pick::TopK(5))),
        (16, Event::Pick(Pick::Logits)),
        (18, Event::Rewind(2, 3)),
        (20, Event::Draft(3, 3)),
        (22, Event::Reversed),
    ];
    if leave {
        v.push((26, Event::Forget(1)));
    }
    v
}

/// `ModelBackend` decides when to launch the next round ahead (after an
/// argmax round of one token per stream); when the next round differs from
/// the one launched, the rows it asks again come from the launched round
/// and the rest (and a chunk) run in another forward. Against a backend
/// with ahead off (`Tuning { ahead: false, launch_ahead: false }`) over the
/// same weights, fed the same tokens: each round's picks are the other's
/// argmax (or a near-tie of it: the batches differ where one splits a
/// round), its chunk logits the same within rounding, through a chunk
/// arriving beside decode rows, a stream joining, one fed another token, a
/// draft row, rows in another order, top-k and logits rounds, a rewind,
/// block boundaries and, last, a stream leaving.
#[test]
fn rounds_that_differ_from_the_one_launched_ahead() {
    let Some(dev) = gpu() else { return };
    let off_dev = Cuda::with_tuning(0, Tuning { ahead: false, launch_ahead: false, ..Tuning::default() }).unwrap();
    assert!(dev.caps().ahead && !off_dev.caps().ahead);
    let vocab = 1000;
    let (mut on, mut off) = (tiny_backend(&dev, 23), tiny_backend(&off_dev, 23));
    let mut next: HashMap<StreamId, u32> = HashMap::new();
    // Each stream's rows, as both backends hold them.
    let mut lens: HashMap<StreamId, usize> = HashMap::new();
    for s in 0..3u64 {
        let p = prompt(s, 10 + 5 * s as usize);
        lens.insert(s, p.len());
        let mut firsts = Vec::new();
        for be in [&mut on, &mut off] {
            be.open(s).unwrap();
            firsts.push(be.prefill_step(s, Chunk { start: 0, tokens: &p, want_logits: true }).unwrap().unwrap());
        }
        assert!(firsts[0].iter().zip(&firsts[1]).all(|(a, b)| a.to_bits() == b.to_bits()), "stream {s}: prompt logits differ");
        next.insert(s, argmax(&firsts[0]) as u32);
    }
    let script = script(true);
    let hits0 = dev.ahead_hits();
    let (mut exact, mut total) = (0usize, 0usize);
    let mut pending_chunk: Option<(StreamId, Vec<u32>)> = None;
    for round in 0..32usize {
        let (mut draft, mut other, mut reversed, mut pick) = (None, None, false, Pick::Argmax);
        for (_, ev) in script.iter().filter(|(r, _)| *r == round) {
            eprintln!("round {round}: {ev:?}");
            match *ev {
                Event::Join(s, n) => {
                    let p = prompt(s, n);
                    let mut l = Vec::new();
                    for be in [&mut on, &mut off] {
                        be.open(s).unwrap();
                        l.push(be.prefill_step(s, Chunk { start: 0, tokens: &p, want_logits: true }).unwrap().unwrap());
                    }
                    let (rel, _, _) = compare(&l[0], &l[1], vocab);
                    assert!(rel < 1e-6, "round {round}: the joining stream's prompt logits differ ({rel})");
                    next.insert(s, argmax(&l[0]) as u32);
                    lens.insert(s, n);
                }
                Event::Open(s, n) => {
                    for be in [&mut on, &mut off] {
                        be.open(s).unwrap();
                    }
                    lens.insert(s, 0);
                    pending_chunk = Some((s, prompt(s, n)));
                }
                Event::Forget(s) => {
                    for be in [&mut on, &mut off] {
                        be.forget(s);
                    }
                    next.remove(&s);
                    lens.remove(&s);
                }
                Event::Rewind(s, n) => {
                    let len = lens[&s] - n;
                    for be in [&mut on, &mut off] {
                        be.rewind(s, len).unwrap();
                    }
                    lens.insert(s, len);
                    next.insert(s, 42);
                }
                Event::Draft(s, n) => draft = Some((s, n)),
                Event::Other(s) => other = Some(s),
                Event::Reversed => reversed = true,
                Event::Pick(p) => pick = p,
            }
        }
        let rows = decode_rows(&next, draft, other, reversed, vocab);
        let chunk = pending_chunk.take();
        let step_chunk = chunk.as_ref().map(|(s, p)| (*s, Chunk { start: 0, tokens: p.as_slice(), want_logits: true }));
        let a = on.round(Step::new(&rows, step_chunk, pick)).unwrap();
        let b = off.round(Step::new(&rows, step_chunk, Pick::Logits)).unwrap();
        let Picked::Logits(want) = b.picked else { panic!("a logits round returned other picks") };
        if let Some((s, p)) = &chunk {
            let (l_on, l_off) = (a.chunk_logits.as_ref().unwrap(), b.chunk_logits.as_ref().unwrap());
            let (rel, _, _) = compare(l_on, l_off, vocab);
            assert!(rel < 1e-2 && near_best(l_off, argmax(l_on) as u32), "round {round}: stream {s}'s chunk logits differ (rel err {rel})");
            next.insert(*s, argmax(l_on) as u32);
            *lens.get_mut(s).unwrap() += p.len();
        }
        // Each token row's pick against the other backend's logits.
        let n_rows = want.len() / vocab;
        let want_rows: Vec<&[f32]> = want.chunks(vocab).collect();
        let picked_first: Vec<u32> = match &a.picked {
            Picked::Tokens(t) => {
                assert_eq!(t.len(), n_rows, "round {round}: picks for {} rows of {n_rows}", t.len());
                for (i, (&tok, row)) in t.iter().zip(&want_rows).enumerate() {
                    total += 1;
                    exact += (tok as usize == argmax(row)) as usize;
                    assert!(
                        near_best(row, tok),
                        "round {round}: row {i} picked {tok}, the other backend's best is {} ({} against {})",
                        argmax(row),
                        row[tok as usize],
                        row[argmax(row)]
                    );
                }
                t.clone()
            }
            Picked::Top(c) => {
                assert_eq!(c.len(), n_rows);
                for (i, (cands, row)) in c.iter().zip(&want_rows).enumerate() {
                    assert!(near_best(row, cands[0].0), "round {round}: row {i}'s best candidate {:?} is not the other's best", cands[0]);
                    for &(t, v) in cands {
                        assert!(
                            (v - row[t as usize]).abs() <= 1e-2 * row[t as usize].abs().max(0.1),
                            "round {round}: row {i} candidate {t}: {v} against {}",
                            row[t as usize]
                        );
                    }
                }
                c.iter().map(|c| c[0].0).collect()
            }
            Picked::Logits(l) => {
                let (rel, agree, rows) = compare(l, &want, vocab);
                assert!(rel < 1e-2 && agree * 10 >= rows * 9, "round {round}: logits differ (rel err {rel}, top-1 {agree}/{rows})");
                want_rows.iter().map(|r| argmax(r) as u32).collect()
            }
        };
        // Each stream goes on from its row's first pick (a draft's other
        // picks are checked above; its drafts are then dropped).
        let mut at = 0;
        for r in &rows {
            next.insert(r.stream, picked_first[at]);
            at += r.tokens.len();
            *lens.get_mut(&r.stream).unwrap() += r.tokens.len();
        }
        if let Some((s, n)) = draft {
            let len = lens[&s] - n;
            for be in [&mut on, &mut off] {
                be.rewind(s, len).unwrap();
            }
            lens.insert(s, len);
        }
    }
    let (h, l) = (dev.ahead_hits().0 - hits0.0, dev.ahead_hits().1 - hits0.1);
    eprintln!(
        "rounds differing from the one launched ahead: {exact}/{total} picks exactly the other backend's argmax; {h} forwards served ahead, {l} launched"
    );
    assert!(l >= 10, "only {l} rounds were launched ahead: the scenario did not exercise it");
    assert!(exact * 10 >= total * 9, "only {exact}/{total} picks equal the other backend's argmax");
}

/// Top-k rounds (only each row's k best logits come back) give the
/// candidates the host finds in the same round's logits.
#[test]
fn backend_top_k_rounds_equal_host_top_k() {
    let Some(dev) = gpu() else { return };
    let mut runs = Vec::new();
    for on_device in [false, true] {
        let (mut be, mut last) = three_prompted_streams(&dev);
        assert_eq!(be.capabilities().picks.top_k, 64);
        let mut out = Vec::new();
        for round in 0..10 {
            let rows: Vec<DecodeRow> = (0..3).map(|s| DecodeRow { stream: s, tokens: vec![last[s as usize]] }).collect();
            let cands = if on_device {
                match be.round(Step::new(&rows, None, Pick::TopK(40))).unwrap().picked {
                    Picked::Top(c) => c,
                    other => panic!("a top-k round returned {other:?}"),
                }
            } else {
                braid_ops::top_k_host(&be.decode_logits(&rows).unwrap(), 1000, 40)
            };
            // Walk on through the candidates (not always the first).
            last = cands.iter().map(|c| c[round % 3].0).collect();
            out.push(cands);
        }
        runs.push(out);
    }
    assert_eq!(runs[0], runs[1], "device top-k candidates differ from the host's");
}

/// Rounds drawn on the device (top-p, min-p, plain temperature beside a
/// greedy row; only token ids come back) give the tokens `draw_host` draws
/// from the same round's logits with the same numbers, but for draws within
/// rounding of a boundary (at most one in 20 here).
#[test]
fn backend_draw_rounds_equal_host_draws() {
    let Some(dev) = gpu() else { return };
    let draw = |i: usize, round: usize| {
        let kinds = [(0.0, 0, 1.0, 0.0), (0.8, 0, 0.9, 0.0), (1.0, 0, 1.0, 0.05), (1.3, 0, 1.0, 0.0)];
        let (temperature, top_k, top_p, min_p) = kinds[(i + round) % kinds.len()];
        Draw { temperature, top_k, top_p, min_p, u: ((i * 7 + round * 13) % 97) as f64 / 97.0 }
    };
    let (mut be, mut last) = three_prompted_streams(&dev);
    assert!(be.capabilities().picks.draw);
    let (mut drawn, mut differ) = (0, 0);
    for round in 0..20 {
        let rows: Vec<DecodeRow> = (0..3).map(|s| DecodeRow { stream: s, tokens: vec![last[s as usize]] }).collect();
        let draws: Vec<Draw> = (0..3).map(|i| draw(i, round)).collect();
        // The same round twice: once for its logits (then rewound), once drawn.
        let logits = be.decode_logits(&rows).unwrap();
        for s in 0..3u64 {
            be.rewind(s, 10 + 5 * s as usize + round).unwrap();
        }
        let got = tokens(be.round(Step { draws: &draws, ..Step::new(&rows, None, Pick::Draw) }).unwrap());
        for (i, d) in draws.iter().enumerate() {
            let want = braid_ops::draw_host(&logits[i * 1000..(i + 1) * 1000], &device_draw(d), None);
            if d.temperature == 0.0 {
                assert_eq!(got[i], want, "a greedy row in a draw round");
            } else {
                drawn += 1;
                differ += usize::from(got[i] != want);
            }
        }
        last = got;
    }
    assert!(differ * 20 <= drawn, "{differ} of {drawn} draws differ from the host's");
}
