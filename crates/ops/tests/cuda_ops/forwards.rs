//! A small model's forwards: graphs, and forwards done ahead.

use super::fusion::EPS;
use super::*;

const MV: usize = 500;
const MH: usize = 256;
const MHEADS: usize = 4;
const MKVH: usize = 2;
const MHD: usize = 64;
const MFF: usize = 512;

/// A one-layer Llama with an embedding table and its own head.
struct Mini {
    emb: W,
    wq: W,
    wk: W,
    wv: W,
    wo: W,
    wg: W,
    wu: W,
    wd: W,
    head: W,
    norms: [T; 3],
}

/// The host values of a `Mini` (each copy on the device made from them).
struct MiniHost(Vec<Vec<f32>>);

impl MiniHost {
    fn new(r: &mut Rng) -> MiniHost {
        let shapes = [(MV, MH), (MHEADS * MHD, MH), (MKVH * MHD, MH), (MKVH * MHD, MH), (MH, MHEADS * MHD), (MFF, MH), (MFF, MH), (MH, MFF), (MV, MH)];
        let mut v: Vec<Vec<f32>> = shapes.iter().map(|&(a, b)| r.vec(a * b, if a == MV { 1.0 } else { 0.08 })).collect();
        for _ in 0..3 {
            v.push(r.vec(MH, 0.5).iter().map(|x| 1.0 + x).collect());
        }
        MiniHost(v)
    }

    fn on(&self, d: &Cuda) -> Mini {
        let v = &self.0;
        let w = |i: usize, rows: usize| d.weight_from_f32(&v[i], rows, v[i].len() / rows).unwrap();
        let n = |i: usize| d.upload(&v[i], 1, MH).unwrap();
        Mini {
            emb: w(0, MV),
            wq: w(1, MHEADS * MHD),
            wk: w(2, MKVH * MHD),
            wv: w(3, MKVH * MHD),
            wo: w(4, MH),
            wg: w(5, MFF),
            wu: w(6, MFF),
            wd: w(7, MH),
            head: w(8, MV),
            norms: [n(9), n(10), n(11)],
        }
    }
}

struct MiniScratch {
    x: T,
    h: T,
    q: T,
    k: T,
    v: T,
    att: T,
    out: T,
    gate: T,
    up: T,
    act: T,
    last: T,
    logits: T,
}

impl MiniScratch {
    fn new(d: &Cuda) -> MiniScratch {
        let t = || d.tensor(0, 0);
        MiniScratch { x: t(), h: t(), q: t(), k: t(), v: t(), att: t(), out: t(), gate: t(), up: t(), act: t(), last: t(), logits: t() }
    }
}

/// Streams of a `Mini` batch: each stream's block table (four blocks, so a
/// round never changes it) and length.
struct Streams {
    tables: Vec<Vec<u32>>,
    lens: Vec<usize>,
}

/// One forward's host arrays over the streams, one token each at its length.
struct MiniBatch {
    pos: Vec<u32>,
    slots: Vec<u32>,
    kv_lens: Vec<usize>,
    rows: Vec<usize>,
}

impl Streams {
    fn batch(&self) -> MiniBatch {
        let n = self.lens.len();
        MiniBatch {
            pos: self.lens.iter().map(|&l| l as u32).collect(),
            slots: (0..n).map(|s| self.tables[s][self.lens[s] / 16] * 16 + (self.lens[s] % 16) as u32).collect(),
            kv_lens: self.lens.iter().map(|&l| l + 1).collect(),
            rows: (0..n).collect(),
        }
    }
}

impl MiniBatch {
    /// What `Forward::key` hashes: everything but the token ids.
    fn key(&self) -> u64 {
        use std::hash::{Hash, Hasher};
        let mut h = std::collections::hash_map::DefaultHasher::new();
        (&self.pos, &self.slots, &self.kv_lens).hash(&mut h);
        h.finish()
    }
}

fn mini_forward(d: &Cuda, m: &Mini, tokens: &[u32], b: &MiniBatch, tables: &[Vec<u32>], kv: &mut CudaKv, s: &mut MiniScratch) {
    let rope = Rope::new(10000.0, MHD, true);
    let seqs: Vec<AttnSeq> = (0..tokens.len()).map(|i| AttnSeq { q_start: i, q_len: 1, kv_len: b.kv_lens[i], blocks: &tables[i], window: None }).collect();
    d.embed(&m.emb, tokens, 1.0, &mut s.x);
    d.rms_norm(&s.x, &m.norms[0], EPS, &mut s.h);
    d.matmul(&s.h, &[&m.wq, &m.wk, &m.wv], &mut [&mut s.q, &mut s.k, &mut s.v]);
    d.rope(&mut s.q, &b.pos, MHD, &rope);
    d.rope(&mut s.k, &b.pos, MHD, &rope);
    d.kv_write(kv, 0, &s.k, &s.v, &b.slots);
    d.attention(&s.q, kv, 0, &seqs, 0.125, None, &mut s.att);
    d.matmul(&s.att, &[&m.wo], &mut [&mut s.out]);
    d.add(&mut s.x, &s.out);
    d.rms_norm(&s.x, &m.norms[1], EPS, &mut s.h);
    d.matmul(&s.h, &[&m.wg, &m.wu], &mut [&mut s.gate, &mut s.up]);
    d.gated(Act::Silu, &s.gate, &s.up, &mut s.act);
    d.matmul(&s.act, &[&m.wd], &mut [&mut s.out]);
    d.add(&mut s.x, &s.out);
    d.gather_rows(&s.x, &b.rows, &mut s.last);
    d.rms_norm(&s.last, &m.norms[2], EPS, &mut s.h);
    d.matmul(&s.h, &[&m.head], &mut [&mut s.logits]);
}

/// A `Mini` on the device with its pool and scratch, three streams of
/// given context lengths (their KV filled by one-token forwards).
struct MiniRun {
    m: Mini,
    kv: CudaKv,
    s: MiniScratch,
    st: Streams,
}

impl MiniRun {
    fn new(d: &Cuda, host: &MiniHost, prepared: bool, lens: &[usize]) -> MiniRun {
        let m = host.on(d);
        let spec = KvPoolSpec::new(16, 16, vec![KvShape { kv_heads: MKVH, head_dim: MHD }]);
        let mut run = MiniRun { m, kv: d.kv_pool(&spec, KvDtype::F16).unwrap(), s: MiniScratch::new(d), st: Streams { tables: Vec::new(), lens: Vec::new() } };
        run.st.tables = (0..lens.len() as u32).map(|s| (4 * s..4 * s + 4).collect()).collect();
        run.st.lens = vec![0; lens.len()];
        if prepared {
            // As `ModelBackend::new` does: one row at position 0.
            let one = Streams { tables: vec![vec![15]], lens: vec![0] };
            let b = one.batch();
            let (m, kv, s) = (&run.m, &mut run.kv, &mut run.s);
            prepare(d, &mut || mini_forward(d, m, &[0], &b, &one.tables, kv, s));
        }
        // The contexts: token (p * 7 + s) % MV at each position, eagerly.
        for p in 0..*lens.iter().max().unwrap_or(&0) {
            let ids: Vec<usize> = (0..lens.len()).filter(|&s| p < lens[s]).collect();
            let sub = Streams { tables: ids.iter().map(|&s| run.st.tables[s].clone()).collect(), lens: ids.iter().map(|&s| run.st.lens[s]).collect() };
            let b = sub.batch();
            let toks: Vec<u32> = ids.iter().map(|&s| ((p * 7 + s) % MV) as u32).collect();
            run.step_with(d, None, &toks, &sub, &b);
            for &s in &ids {
                run.st.lens[s] += 1;
            }
        }
        run
    }

    fn step_with(&mut self, d: &Cuda, key: Option<u64>, tokens: &[u32], st: &Streams, b: &MiniBatch) {
        let (m, kv, s) = (&self.m, &mut self.kv, &mut self.s);
        d.forward(Forward { key, tokens }, &mut || {
            mini_forward(d, m, tokens, b, &st.tables, kv, s);
            Ok(())
        })
        .unwrap();
    }

    /// One decode round of every stream (one token each), keyed or not;
    /// the logits, and the streams one further.
    fn round(&mut self, d: &Cuda, keyed: bool, tokens: &[u32]) -> Vec<f32> {
        let b = self.st.batch();
        let st = Streams { tables: self.st.tables.clone(), lens: self.st.lens.clone() };
        self.step_with(d, keyed.then(|| b.key()), tokens, &st, &b);
        self.st.lens.iter_mut().for_each(|l| *l += 1);
        d.download(&self.s.logits).unwrap()
    }

    /// The same round outside any forward (unfused; an unprepared model).
    fn round_plain(&mut self, d: &Cuda, tokens: &[u32]) -> Vec<f32> {
        let b = self.st.batch();
        mini_forward(d, &self.m, tokens, &b, &self.st.tables, &mut self.kv, &mut self.s);
        self.st.lens.iter_mut().for_each(|l| *l += 1);
        d.download(&self.s.logits).unwrap()
    }
}

/// A small model's decode rounds as replayed CUDA graphs give the eager
/// rounds' bits, round after round (and within bf16 rounding the same ops
/// outside any forward, unfolded); each round's shape after the first
/// replays its graph.
#[test]
fn graph_replay_equals_eager() {
    let Some(d) = gpu() else { return };
    let mut r = Rng(seed());
    let host = MiniHost::new(&mut r);
    let lens = [5, 25, 40];
    let mut plain = MiniRun::new(&d, &host, false, &lens);
    let mut eager = MiniRun::new(&d, &host, true, &lens);
    let mut graphed = MiniRun::new(&d, &host, true, &lens);
    let before = d.graph_stats();
    for step in 0..10usize {
        let toks: Vec<u32> = (0..3).map(|s| ((step * 31 + s * 7) % MV) as u32).collect();
        let p = plain.round_plain(&d, &toks);
        let e = eager.round(&d, false, &toks);
        let g = graphed.round(&d, true, &toks);
        assert!(same_bits(&g, &e), "round {step}: graph replay differs from eager");
        let err = rel(&e, &p);
        assert!(err < 2e-2, "round {step}: the folded forward vs the ops unfused: rel err {err}");
    }
    let (replays, captures) = (d.graph_stats().0 - before.0, d.graph_stats().1 - before.1);
    eprintln!("graph replays {replays} captures {captures}");
    assert!(replays >= 8, "the graph was not replayed ({replays} replays, {captures} captures)");
}

/// Forwards prepared ahead (`Device::forward_ahead`) and launched by the
/// argmax that picks their tokens (`Device::pick` with `launch_ahead`)
/// give the eager forwards' bits, through rounds that are not the one
/// expected: other tokens than the ones picked, another shape (a stream
/// moved back), an upload or an allocation between, a round not launched,
/// one not prepared. Hits and launches are counted (run the tests on one
/// thread: any thread's allocation retires a forward prepared ahead).
#[test]
fn forwards_prepared_and_launched_ahead_equal_eager() {
    let Some(d) = gpu() else { return };
    let mut r = Rng(seed());
    let host = MiniHost::new(&mut r);
    let lens = [3, 17, 30];
    let mut ahead = MiniRun::new(&d, &host, true, &lens);
    let eager_dev = gpu().unwrap();
    let mut eager = MiniRun::new(&eager_dev, &host, true, &lens);
    // The first argmax on a device makes its key buffer: an allocation,
    // which retires whatever was prepared ahead. Make it now.
    d.pick(&ahead.s.logits, RowPick::Argmax, &[], false).unwrap();
    let mut toks: Vec<u32> = vec![1, 2, 3];
    let (hits0, launched0) = d.ahead_hits();
    let (mut want_hits, mut want_launched) = (0u64, 0u64);
    let mut expect: Option<bool> = None;
    for round in 0..24usize {
        // This round's forward: served from the one prepared ahead or not.
        let logits = ahead.round(&d, true, &toks);
        let want = eager.round(&eager_dev, false, &toks);
        assert!(same_bits(&logits, &want), "round {round}: the round done ahead differs from eager");
        let (h, l) = d.ahead_hits();
        if let Some(launched) = expect.take() {
            want_hits += 1;
            want_launched += launched as u64;
        }
        if (h - hits0, l - launched0) != (want_hits, want_launched) {
            eprintln!("round {round}: ahead hits {} (launched {}), expected {want_hits} ({want_launched})", h - hits0, l - launched0);
        }
        // Prepare the next round (the same streams one further) with this
        // round's tokens standing in, then pick this round's tokens.
        let prepare_next = round % 8 != 6;
        let launch = round % 8 != 4;
        if prepare_next {
            let b = ahead.st.batch();
            let st = Streams { tables: ahead.st.tables.clone(), lens: ahead.st.lens.clone() };
            let (m, kv, s) = (&ahead.m, &mut ahead.kv, &mut ahead.s);
            d.forward_ahead(Forward { key: Some(b.key()), tokens: &toks }, &mut || {
                mini_forward(&d, m, &toks, &b, &st.tables, kv, s);
                Ok(())
            });
        }
        let picked = match d.pick(&ahead.s.logits, RowPick::Argmax, &[], launch).unwrap() {
            RowPicked::Argmax(t) => t,
            other => panic!("pick(Argmax) answered {other:?}"),
        };
        assert_eq!(picked, want.chunks(MV).map(braid_ops::argmax_host).collect::<Vec<_>>(), "round {round}: the device's argmax");
        toks = picked;
        expect = prepare_next.then_some(launch);
        match round % 8 {
            // Other tokens than the ones picked (the launched forward ran for nothing).
            1 => {
                toks[1] = (toks[1] + 1) % MV as u32;
                expect = None;
            }
            // A stream moved back: another shape, another key.
            2 => {
                for run in [&mut ahead, &mut eager] {
                    run.st.lens[0] -= 2;
                }
                expect = None;
            }
            // An upload outside a forward: the arena may hold other data now.
            3 => {
                let x = d.upload(&[1.0; MH], 1, MH).unwrap();
                let mut o = d.tensor(0, 0);
                d.gather_rows(&x, &[0], &mut o);
                expect = None;
            }
            // Memory allocated: pointers the forward baked in may be stale.
            5 => {
                let _t = d.tensor(64, 64);
                expect = None;
            }
            _ => {}
        }
    }
    let (h, l) = d.ahead_hits();
    eprintln!("rounds served ahead: {} (launched {}), expected {want_hits} ({want_launched})", h - hits0, l - launched0);
    assert_eq!((h - hits0, l - launched0), (want_hits, want_launched), "rounds served from the forward done ahead (run on one test thread)");
}
