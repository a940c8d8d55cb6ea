//! `ModelBackend`'s rounds launched ahead, on the CPU.
//!
//! Only a device whose `caps().ahead` is set (CUDA) makes `ModelBackend`
//! launch rounds ahead and serve the next round from them. The CPU device
//! wrapped to claim it runs those paths too (its `forward_ahead` and launch
//! do nothing, so the backend's served rows come from the forward it runs
//! for them), and the CPU is batch-invariant: there, ahead on and ahead off
//! must give the same bits. This checks the backend's bookkeeping (which
//! rows are served, the rest run, picks merged back in order, lengths)
//! without a GPU.

use super::rounds::{decode_rows, script, Event};
use super::*;
use braid_formats::{Bytes, DType, TensorView};
use braid_ops::cpu::{Cpu, CpuKv, CpuTensor, CpuWeight};
use braid_ops::{Act, DeviceCaps, Map, Rope};

/// The CPU device, claiming `ahead` (and top-k and draws on the host),
/// and with the second flag `replays` (so the backend pads chunks).
#[derive(Clone, Copy)]
pub struct AheadCpu(Cpu, bool, bool);

impl Device for AheadCpu {
    type Tensor = CpuTensor;
    type Weight = CpuWeight;
    type Kv = CpuKv;
    fn name(&self) -> String {
        format!("cpu claiming ahead {}, replays {}", self.1, self.2)
    }
    fn caps(&self) -> DeviceCaps {
        DeviceCaps { ahead: self.1, replays: self.2, argmax: true, top_k: 64, draw: true, ..self.0.caps() }
    }
    fn tensor(&self, r: usize, c: usize) -> CpuTensor {
        self.0.tensor(r, c)
    }
    fn resize(&self, t: &mut CpuTensor, r: usize, c: usize) {
        self.0.resize(t, r, c)
    }
    fn shape(&self, t: &CpuTensor) -> (usize, usize) {
        self.0.shape(t)
    }
    fn upload(&self, d: &[f32], r: usize, c: usize) -> anyhow::Result<CpuTensor> {
        self.0.upload(d, r, c)
    }
    fn download(&self, t: &CpuTensor) -> anyhow::Result<Vec<f32>> {
        self.0.download(t)
    }
    fn weight(&self, v: &TensorView) -> anyhow::Result<CpuWeight> {
        self.0.weight(v)
    }
    fn weight_shape(&self, w: &CpuWeight) -> (usize, usize) {
        self.0.weight_shape(w)
    }
    fn vector(&self, v: &TensorView, o: f32) -> anyhow::Result<CpuTensor> {
        self.0.vector(v, o)
    }
    fn kv_pool(&self, s: &KvPoolSpec, d: KvDtype) -> anyhow::Result<CpuKv> {
        self.0.kv_pool(s, d)
    }
    fn embed(&self, t: &CpuWeight, ids: &[u32], s: f32, o: &mut CpuTensor) {
        self.0.embed(t, ids, s, o)
    }
    fn matmul(&self, x: &CpuTensor, ws: &[&CpuWeight], o: &mut [&mut CpuTensor]) {
        self.0.matmul(x, ws, o)
    }
    fn gather_rows(&self, x: &CpuTensor, r: &[usize], o: &mut CpuTensor) {
        self.0.gather_rows(x, r, o)
    }
    fn rms_norm(&self, x: &CpuTensor, w: &CpuTensor, e: f32, o: &mut CpuTensor) {
        self.0.rms_norm(x, w, e, o)
    }
    fn add(&self, x: &mut CpuTensor, y: &CpuTensor) {
        self.0.add(x, y)
    }
    fn map(&self, x: &mut CpuTensor, f: Map) {
        self.0.map(x, f)
    }
    fn gated(&self, a: Act, g: &CpuTensor, u: &CpuTensor, o: &mut CpuTensor) {
        self.0.gated(a, g, u, o)
    }
    fn rope(&self, x: &mut CpuTensor, p: &[u32], h: usize, r: &Rope) {
        self.0.rope(x, p, h, r)
    }
    fn kv_write(&self, kv: &mut CpuKv, l: usize, k: &CpuTensor, v: &CpuTensor, s: &[u32]) {
        self.0.kv_write(kv, l, k, v, s)
    }
    fn kv_copy_blocks(&self, kv: &mut CpuKv, g: usize, s: &[u32], d: &[u32]) {
        self.0.kv_copy_blocks(kv, g, s, d)
    }
    fn attention(&self, q: &CpuTensor, kv: &CpuKv, l: usize, s: &[AttnSeq<'_>], sc: f32, c: Option<f32>, o: &mut CpuTensor) {
        self.0.attention(q, kv, l, s, sc, c, o)
    }
    fn copy_rows(&self, t: &mut CpuTensor, s: &[u32], d: &[u32]) {
        self.0.copy_rows(t, s, d)
    }
    fn zero_rows(&self, t: &mut CpuTensor, r: &[u32]) {
        self.0.zero_rows(t, r)
    }
}

impl braid_models::random::RandomInit for AheadCpu {
    fn random_weight(&self, rows: usize, cols: usize, seed: u64, amp: f32) -> anyhow::Result<CpuWeight> {
        let mut s = seed | 1;
        let bytes: Vec<u8> = (0..rows * cols)
            .flat_map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                (((s >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * amp).to_le_bytes()
            })
            .collect();
        self.weight(&TensorView { name: "random".into(), dtype: DType::F32, shape: vec![rows, cols], data: Bytes::from_vec(bytes) })
    }
    fn const_vector(&self, n: usize, v: f32) -> anyhow::Result<CpuTensor> {
        self.upload(&vec![v; n], 1, n)
    }
}

/// The scenario's rounds on a backend over `dev`: each round's picks
/// (logits as bits) and chunk logits, as text.
const VOCAB: usize = 100;

/// A backend of a tiny random Llama on `dev`.
fn tiny_llama(dev: AheadCpu, cfg: BackendConfig) -> ModelBackend<AheadCpu> {
    let llama = braid_models::llama::LlamaConfig {
        hidden: 64,
        layers: 2,
        heads: 4,
        kv_heads: 2,
        head_dim: 16,
        ffn: 128,
        vocab: VOCAB,
        eps: 1e-5,
        rope: Rope::new(1e4, 16, true),
        context: 512,
    };
    let model = braid_models::random::llama(&dev, llama, 5, false).unwrap();
    ModelBackend::new(dev, Box::new(model), cfg).unwrap()
}

/// A tiny random Llama on `dev`, and streams 0, 1, 2 prefilled with
/// their next tokens and lengths.
fn three_streams(dev: AheadCpu) -> (ModelBackend<AheadCpu>, HashMap<StreamId, u32>, HashMap<StreamId, usize>) {
    let vocab = VOCAB;
    let mut be = tiny_llama(dev, BackendConfig { kv_tokens: 2048, context: 512, ..Default::default() });
    let prompt = |s: u64, n: usize| -> Vec<u32> { (0..n as u32).map(|i| (i * 31 + 7 * s as u32) % vocab as u32).collect() };
    let (mut next, mut lens) = (HashMap::new(), HashMap::new());
    for s in 0..3u64 {
        be.open(s).unwrap();
        let p = prompt(s, 10 + 5 * s as usize);
        let l = be.prefill_step(s, Chunk { start: 0, tokens: &p, want_logits: true }).unwrap().unwrap();
        next.insert(s, argmax(&l) as u32);
        lens.insert(s, p.len());
    }
    (be, next, lens)
}

/// Each round's picks (and chunk logits; with `taps`, its features) as
/// text, with the blocks in use after it, the streams open, and the
/// blocks free for the plan.
fn drive(dev: AheadCpu, script: &[(usize, Event)], taps: Taps) -> Vec<(String, usize, usize, usize)> {
    let vocab = VOCAB;
    let (mut be, mut next, mut lens) = three_streams(dev);
    if taps != Taps::Off {
        be.set_feature_layers(&[0], 64).unwrap();
    }
    let kept = (taps == Taps::Kept).then(|| be.share_taps());
    let prompt = |s: u64, n: usize| -> Vec<u32> { (0..n as u32).map(|i| (i * 31 + 7 * s as u32) % vocab as u32).collect() };
    let mut log = Vec::new();
    let mut pending: Option<(StreamId, Vec<u32>)> = None;
    for round in 0..32usize {
        let (mut draft, mut other, mut reversed, mut pick) = (None, None, false, Pick::Argmax);
        for (_, ev) in script.iter().filter(|(r, _)| *r == round) {
            match *ev {
                Event::Join(s, n) => {
                    be.open(s).unwrap();
                    let l = be.prefill_step(s, Chunk { start: 0, tokens: &prompt(s, n), want_logits: true }).unwrap().unwrap();
                    next.insert(s, argmax(&l) as u32);
                    lens.insert(s, n);
                }
                Event::Open(s, n) => {
                    be.open(s).unwrap();
                    lens.insert(s, 0);
                    pending = Some((s, prompt(s, n)));
                }
                Event::Forget(s) => {
                    be.forget(s);
                    next.remove(&s);
                    lens.remove(&s);
                }
                Event::Rewind(s, n) => {
                    let len = lens[&s] - n;
                    be.rewind(s, len).unwrap();
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
        let chunk = pending.take();
        let step_chunk = chunk.as_ref().map(|(s, p)| (*s, Chunk { start: 0, tokens: p.as_slice(), want_logits: true }));
        // A draw round's rows: the first greedy, the rest top-p at their own numbers.
        let token_rows: usize = rows.iter().map(|r| r.tokens.len()).sum();
        let draws: Vec<Draw> = match pick {
            Pick::Draw => (0..token_rows)
                .map(|i| Draw { temperature: if i == 0 { 0.0 } else { 0.9 }, top_k: 0, top_p: 0.9, min_p: 0.0, u: ((round * 7 + i * 3) % 10) as f64 / 10.0 })
                .collect(),
            _ => Vec::new(),
        };
        let mut out = be.round(Step { draws: &draws, ..Step::new(&rows, step_chunk, pick) }).unwrap();
        // A draw round may come back whole (where part of it was launched
        // ahead): drawn here then, as the device would.
        if let (Pick::Draw, Picked::Logits(l)) = (pick, &out.picked) {
            let drawn = l.chunks(vocab).zip(&draws).map(|(row, d)| braid_ops::draw_host(row, &device_draw(d), None)).collect();
            out.picked = Picked::Tokens(drawn);
        }
        if let Some((s, p)) = &chunk {
            let l = out.chunk_logits.as_ref().unwrap();
            log.push((format!("round {round}: chunk logits {:?}", l.iter().map(|v| v.to_bits()).collect::<Vec<_>>()), 0, 0, 0));
            next.insert(*s, argmax(l) as u32);
            *lens.get_mut(s).unwrap() += p.len();
        }
        let firsts: Vec<u32> = match &out.picked {
            Picked::Tokens(t) => t.clone(),
            Picked::Top(c) => c.iter().map(|c| c[0].0).collect(),
            Picked::Logits(l) => l.chunks(vocab).map(|r| argmax(r) as u32).collect(),
        };
        let mut picked = match &out.picked {
            Picked::Logits(l) => format!("{:?}", l.iter().map(|v| v.to_bits()).collect::<Vec<_>>()),
            other => format!("{other:?}"),
        };
        if let Some(kept) = &kept {
            // Each stream's rows where the backend keeps them, by its id.
            let mut store = kept.lock().unwrap();
            let fed = rows.iter().map(|r| (r.stream, r.tokens.len())).chain(chunk.as_ref().map(|(s, p)| (*s, p.len())));
            let mut f = Vec::new();
            for (s, n) in fed {
                let (seq, first) = store.take(s, n).unwrap_or_else(|| panic!("round {round}: stream {s}'s rows are not kept"));
                let all = be.device().download(&store.read(seq, 1).unwrap()[0]).unwrap();
                f.extend_from_slice(&all[first * 64..(first + n) * 64]);
            }
            picked += &format!(" kept rows {:?}", f.iter().map(|v| v.to_bits()).collect::<Vec<_>>());
        } else if taps == Taps::Host {
            let f = be.features().unwrap();
            let rows = rows.iter().map(|r| r.tokens.len()).sum::<usize>() + chunk.as_ref().map_or(0, |c| c.1.len());
            assert_eq!(f.len(), rows * 64, "round {round}: one feature row a token row");
            picked += &format!(" features {:?}", f.iter().map(|v| v.to_bits()).collect::<Vec<_>>());
        }
        // Blocks in use too: a stream that left keeps its blocks for the
        // round launched ahead of it, and only until that round.
        log.push((
            format!("round {round}: rows {:?}: {picked}", rows.iter().map(|r| (r.stream, r.tokens.clone())).collect::<Vec<_>>()),
            be.fill().blocks_used,
            next.len(),
            be.fill().blocks_free(),
        ));
        let mut at = 0;
        for r in &rows {
            next.insert(r.stream, firsts[at]);
            at += r.tokens.len();
            *lens.get_mut(&r.stream).unwrap() += r.tokens.len();
        }
        if let Some((s, n)) = draft {
            let len = lens[&s] - n;
            be.rewind(s, len).unwrap();
            lens.insert(s, len);
        }
    }
    log
}

/// Where a round's tapped rows go: none tapped, to the host
/// (`features()`), or kept on the device (`share_taps`).
#[derive(Clone, Copy, Debug, PartialEq)]
enum Taps {
    Off,
    Host,
    Kept,
}

fn check(script: &[(usize, Event)], taps: Taps) {
    let on = drive(AheadCpu(Cpu::new(Some(1)), true, false), script, taps);
    let off = drive(AheadCpu(Cpu::new(Some(1)), false, false), script, taps);
    assert_eq!(on.len(), off.len());
    for ((a, used_on, open, free_on), (b, used_off, _, free_off)) in on.iter().zip(&off) {
        assert_eq!(a, b, "ahead on and off differ");
        // A round launched ahead holds the blocks of its rows: at most
        // one more a stream (one whose blocks were full). The lane's
        // plan counts those rows' blocks, so it sees them free.
        assert!(used_off <= used_on && *used_on <= used_off + open, "{a}: {used_on} blocks used with ahead on, {used_off} off ({open} streams)");
        assert_eq!(free_on, free_off, "{a}: blocks free for the plan with ahead on and off");
    }
    assert!(on.iter().zip(&off).any(|(a, b)| a.1 > b.1), "no round launched ahead past a block's end");
}

/// The scenario of `rounds_that_differ_from_the_one_launched_ahead`
/// (but the stream leaving) on the CPU: ahead on equals ahead off, bit
/// for bit.
#[test]
fn rounds_that_differ_from_the_one_launched_ahead_on_the_cpu() {
    check(&script(false), Taps::Off);
}

/// A stream forgotten after a round launched ahead for it, the others
/// going on: the launched round is not served for the stream gone.
#[test]
fn a_stream_leaving_after_a_round_launched_ahead_on_the_cpu() {
    check(&script(true), Taps::Off);
}

/// With a feature tap (a drafter's), rounds are launched ahead too, and
/// each round's features are its rows' in the step's order: from the
/// round launched, the second forward, or both merged (a row served, a
/// draft run afresh, a chunk last), as with ahead off, bit for bit.
#[test]
fn features_of_rounds_launched_ahead_on_the_cpu() {
    check(&script(true), Taps::Host);
}

/// The same with the tapped rows kept on the device for a drafter there
/// (`share_taps`): each stream's rows are found by its id after every
/// round, served by the round launched ahead or run afresh, as with ahead
/// off, bit for bit.
#[test]
fn kept_rows_of_rounds_launched_ahead_on_the_cpu() {
    check(&script(true), Taps::Kept);
}

/// Draw rounds (a row greedy, the rest top-p) right after a round
/// launched ahead: served by it whole, in another order, or in part (a
/// stream fed another token): the same tokens as with ahead off.
#[test]
fn draw_rounds_after_a_round_launched_ahead_on_the_cpu() {
    let mut s = script(false);
    s.extend([
        (8, Event::Pick(Pick::Draw)),
        (11, Event::Pick(Pick::Draw)),
        (24, Event::Other(1)),
        (24, Event::Pick(Pick::Draw)),
        (27, Event::Pick(Pick::Draw)),
        (28, Event::Pick(Pick::Draw)),
    ]);
    check(&s, Taps::Off);
}

/// A stream still open that sits a round out (a guided stream waiting
/// for its mask) keeps the round after from being launched ahead: the
/// stream likely rejoins, and a round launched without it would serve
/// that round only in part (two forwards). A stream that left does
/// not, nor rows asked in another order.
#[test]
fn no_round_is_launched_ahead_while_an_open_stream_sits_out() {
    let (mut be, mut next, _) = three_streams(AheadCpu(Cpu::new(Some(1)), true, false));
    let round = |be: &mut ModelBackend<AheadCpu>, next: &mut HashMap<StreamId, u32>, streams: &[StreamId], pick: Pick| -> bool {
        let rows: Vec<DecodeRow> = streams.iter().map(|&s| DecodeRow { stream: s, tokens: vec![next[&s]] }).collect();
        let firsts: Vec<u32> = match be.round(Step::new(&rows, None, pick)).unwrap().picked {
            Picked::Tokens(t) => t,
            Picked::Logits(l) => l.chunks(VOCAB).map(|r| argmax(r) as u32).collect(),
            Picked::Top(c) => c.iter().map(|c| c[0].0).collect(),
        };
        for (&s, &t) in streams.iter().zip(&firsts) {
            next.insert(s, t);
        }
        be.launched_ahead()
    };
    // (The first round follows the prompts' chunks: nothing launched.)
    round(&mut be, &mut next, &[0, 1, 2], Pick::Argmax);
    assert!(round(&mut be, &mut next, &[0, 1, 2], Pick::Argmax), "the same streams again: launched ahead");
    // A guided stream's rounds: all the rows' logits (nothing launched),
    // then a greedy round while it waits for its mask.
    assert!(!round(&mut be, &mut next, &[0, 1, 2], Pick::Logits));
    assert!(!round(&mut be, &mut next, &[1, 2], Pick::Argmax), "stream 0 sits out, still open: not launched ahead");
    assert!(!round(&mut be, &mut next, &[0, 1, 2], Pick::Logits));
    be.forget(0);
    assert!(round(&mut be, &mut next, &[1, 2], Pick::Argmax), "stream 0 left: the others go on launched ahead");
    // One leaving after a round was launched for it: that round serves
    // the others, and the round after them is launched too.
    assert!(round(&mut be, &mut next, &[1, 2], Pick::Argmax));
    be.forget(1);
    assert!(round(&mut be, &mut next, &[2], Pick::Argmax), "stream 1 left after a round launched with it: the next still launched ahead");
    // Or the rows asked in another order than launched.
    be.open(1).unwrap();
    let l = be.prefill_step(1, Chunk { start: 0, tokens: &[5, 6, 7], want_logits: true }).unwrap().unwrap();
    next.insert(1, argmax(&l) as u32);
    round(&mut be, &mut next, &[1, 2], Pick::Argmax);
    assert!(round(&mut be, &mut next, &[1, 2], Pick::Argmax));
    assert!(round(&mut be, &mut next, &[2, 1], Pick::Argmax), "the same rows reversed: launched ahead");
}

/// A step that says drafts likely come next (`Step::next_drafts`) starts
/// no round ahead: one token a stream would serve only part of the next
/// round, run before it on the device. The step after, saying none, does.
#[test]
fn no_round_is_launched_ahead_when_drafts_come_next() {
    let (mut be, mut next, _) = three_streams(AheadCpu(Cpu::new(Some(1)), true, false));
    let mut round = |drafts: bool| -> bool {
        let rows: Vec<DecodeRow> = (0..3).map(|s| DecodeRow { stream: s, tokens: vec![next[&s]] }).collect();
        let Picked::Tokens(t) = be.round(Step { next_drafts: drafts, ..Step::new(&rows, None, Pick::Argmax) }).unwrap().picked else {
            panic!("an argmax round")
        };
        for (s, t) in t.into_iter().enumerate() {
            next.insert(s as StreamId, t);
        }
        be.launched_ahead()
    };
    round(false);
    assert!(round(false), "greedy rounds of the same streams: launched ahead");
    assert!(!round(true), "drafts likely next: nothing launched");
    assert!(round(false));
}

/// Masks given once, or late (None: the round returns logits).
struct Masks(Option<Vec<Option<TokenMask>>>);

impl RoundMasks for Masks {
    fn masks(&self) -> Option<Vec<Option<TokenMask>>> {
        self.0.clone()
    }
}

/// Guided greedy rows picked within their masks by the device's argmax
/// equal the host's masked argmax of the same rounds' logits, rounds
/// launched ahead as without masks, also once another stream has left;
/// a late mask makes the round return its logits and launch nothing
/// ahead.
#[test]
fn masked_argmax_rounds_pick_what_the_host_would() {
    let (mut be, mut next, _) = three_streams(AheadCpu(Cpu::new(Some(1)), true, false));
    let (mut host, mut host_next, _) = three_streams(AheadCpu(Cpu::new(Some(1)), false, false));
    // Stream 1 guided: a mask allowing a third of the vocabulary, which
    // changes with the round.
    let mask = |round: usize| TokenMask::of(VOCAB, (0..VOCAB as u32).filter(|t| (t + round as u32).is_multiple_of(3)));
    let (mut changed, mut ahead) = (0, 0);
    for round in 0..12 {
        // Stream 0 leaves after round 8, a round launched ahead with it
        // running: that round serves streams 1 and 2 (1 now the first row).
        if round == 9 {
            be.forget(0);
            host.forget(0);
        }
        let streams: &[StreamId] = if round < 9 { &[0, 1, 2] } else { &[1, 2] };
        let g = usize::from(round < 9);
        let rows = |next: &HashMap<StreamId, u32>| -> Vec<DecodeRow> { streams.iter().map(|&s| DecodeRow { stream: s, tokens: vec![next[&s]] }).collect() };
        let late = round == 7;
        let mut row_masks = vec![None; streams.len()];
        row_masks[g] = Some(mask(round));
        let masks = Masks((!late).then_some(row_masks));
        let r = rows(&next);
        let got = be.round(Step { masks: Some(&masks), ..Step::new(&r, None, Pick::Argmax) }).unwrap().picked;
        let r = rows(&host_next);
        let Picked::Logits(mut l) = host.round(Step::new(&r, None, Pick::Logits)).unwrap().picked else { panic!("logits asked") };
        let free = argmax(&l[g * VOCAB..(g + 1) * VOCAB]) as u32;
        mask(round).apply(&mut l[g * VOCAB..(g + 1) * VOCAB]);
        let want: Vec<u32> = l.chunks(VOCAB).map(|r| argmax(r) as u32).collect();
        let picked: Vec<u32> = match got {
            Picked::Tokens(t) => {
                assert!(!late, "round {round}: a late mask, yet tokens");
                t
            }
            Picked::Logits(l) => {
                assert!(late, "round {round}: masks given, yet logits");
                assert!(!be.launched_ahead(), "a round returning logits launched the next ahead");
                let mut l = l;
                mask(round).apply(&mut l[g * VOCAB..(g + 1) * VOCAB]);
                l.chunks(VOCAB).map(|r| argmax(r) as u32).collect()
            }
            other => panic!("round {round}: {other:?}"),
        };
        assert_eq!(picked, want, "round {round}");
        // Every round launches the next but the first (right after the
        // prompts' chunks: another chunk likely follows) and the one
        // with the late mask, block ends or not (streams cross them),
        // and a stream leaving or not.
        ahead += usize::from(be.launched_ahead());
        changed += usize::from(free != want[g]);
        for (i, &s) in streams.iter().enumerate() {
            next.insert(s, picked[i]);
            host_next.insert(s, want[i]);
        }
    }
    assert!(changed >= 4, "the mask changed stream 1's pick in {changed} of 12 rounds: the test shows little");
    assert_eq!(ahead, 10, "{ahead} of 12 masked rounds launched the next ahead");
}

/// A top-k round with a guided row: the backend asks for the masks
/// when it picks and that row's candidates are the host's top k of the
/// masked row (-inf past what the mask allows, in column order); a late
/// mask gives the logits.
#[test]
fn masked_top_k_rounds_find_what_the_host_would() {
    let (mut be, mut next, _) = three_streams(AheadCpu(Cpu::new(Some(1)), true, false));
    let (mut host, _, _) = three_streams(AheadCpu(Cpu::new(Some(1)), false, false));
    // Stream 1's mask allows 3 tokens a round: fewer than k.
    let mask = |round: usize| TokenMask::of(VOCAB, (0..3u32).map(|i| (i * 37 + round as u32 * 11) % VOCAB as u32));
    let k = 5;
    for round in 0..8 {
        let streams = [0u64, 1, 2];
        let r: Vec<DecodeRow> = streams.iter().map(|&s| DecodeRow { stream: s, tokens: vec![next[&s]] }).collect();
        let late = round == 5;
        let masks = Masks((!late).then(|| vec![None, Some(mask(round)), None]));
        let got = be.round(Step { masks: Some(&masks), ..Step::new(&r, None, Pick::TopK(k)) }).unwrap().picked;
        let Picked::Logits(mut l) = host.round(Step::new(&r, None, Pick::Logits)).unwrap().picked else { panic!("logits asked") };
        match got {
            Picked::Top(c) => {
                assert!(!late, "round {round}: a late mask, yet candidates");
                mask(round).apply(&mut l[VOCAB..2 * VOCAB]);
                let want = braid_ops::top_k_host(&l, VOCAB, k);
                assert_eq!(c, want, "round {round}");
                assert!(c[1][..3].iter().all(|&(t, v)| mask(round).allows(t) && v.is_finite()) && c[1][3..].iter().all(|&(_, v)| v == f32::NEG_INFINITY));
                streams.iter().enumerate().for_each(|(i, &s)| _ = next.insert(s, c[i][0].0));
            }
            Picked::Logits(got) => {
                assert!(late, "round {round}: masks given, yet logits");
                assert_eq!(got, l);
                streams.iter().enumerate().for_each(|(i, &s)| _ = next.insert(s, argmax(&l[i * VOCAB..(i + 1) * VOCAB]) as u32));
            }
            other => panic!("round {round}: {other:?}"),
        }
    }
}

/// A prompt fed in chunks of sizes that do not replay (5, 7, 13, 20 rows)
/// beside three decoding streams, each chunk named a round ahead, then
/// decoded with them: each round's picks and the chunks' last-row logits
/// as bits, and after the last chunk the blocks held past the streams'
/// lengths; first, whether the backend says it pads chunks.
fn odd_chunks(dev: AheadCpu) -> (Vec<String>, usize) {
    let (mut be, mut next, _) = three_streams(dev);
    let mut log = vec![format!("pads chunks: {}", be.capabilities().pads_chunks)];
    let prompt: Vec<u32> = (0..45u32).map(|i| (i * 13 + 5) % VOCAB as u32).collect();
    let cuts = [0, 5, 12, 25, 45];
    let chunk = |i: usize| Chunk { start: cuts[i], tokens: &prompt[cuts[i]..cuts[i + 1]], want_logits: true };
    be.open(9).unwrap();
    let mut ahead_blocks = 0;
    for round in 0..10 {
        let rows = decode_rows(&next, None, None, false, VOCAB);
        let this = (round < 4).then(|| (9, chunk(round)));
        let named = (round < 3).then(|| (9, chunk(round + 1)));
        let out = be.round(Step { next_chunk: named, ..Step::new(&rows, this, Pick::Argmax) }).unwrap();
        let Picked::Tokens(t) = &out.picked else { panic!("round {round}: {:?}", out.picked) };
        for (r, &tok) in rows.iter().zip(t) {
            next.insert(r.stream, tok);
        }
        if let Some(l) = &out.chunk_logits {
            log.push(format!("round {round}: chunk logits {:?}", l.iter().map(|v| v.to_bits()).collect::<Vec<_>>()));
            if round == 3 {
                next.insert(9, argmax(l) as u32);
                ahead_blocks = be.fill().blocks_ahead;
            }
        }
        log.push(format!("round {round}: {t:?}"));
    }
    (log, ahead_blocks)
}

#[test]
fn chunks_padded_to_a_replayed_size_give_the_chunks_own_results_on_the_cpu() {
    // The CPU is batch-invariant: pad rows past a chunk's end must change
    // no bit of its rows, the other rows of its round, or the rounds after
    // (which write over the pad rows' KV before reading it).
    for ahead in [false, true] {
        let (kept, kept_ahead) = odd_chunks(AheadCpu(Cpu::new(Some(1)), ahead, false));
        let (padded, padded_ahead) = odd_chunks(AheadCpu(Cpu::new(Some(1)), ahead, true));
        assert_eq!((&kept[0][..], &padded[0][..]), ("pads chunks: false", "pads chunks: true"));
        assert_eq!(kept[1..], padded[1..], "ahead {ahead}");
        if !ahead {
            // The last chunk, rows 25..45, ran as 24 rows (25..49): their
            // fourth block is held past the stream's 45 rows.
            assert_eq!((kept_ahead, padded_ahead), (0, 1));
        }
    }
}

#[test]
fn a_chunk_is_not_padded_into_blocks_the_pool_lacks_on_the_cpu() {
    // Three blocks of 16: stream 0's 10 rows hold one, stream 1's first
    // chunk (20 rows, run as 24) two. Its second chunk, rows 20..30, would
    // run as 16 rows (20..36) in a fourth block there is not: it runs as
    // its own 10 rows, the results those of a backend that never pads.
    let run = |replays: bool| {
        let mut be = tiny_llama(AheadCpu(Cpu::new(Some(1)), false, replays), BackendConfig { kv_tokens: 48, context: 512, ..Default::default() });
        let prompt: Vec<u32> = (0..30u32).map(|i| (i * 17 + 3) % VOCAB as u32).collect();
        be.open(0).unwrap();
        let l = be.prefill_step(0, Chunk { start: 0, tokens: &prompt[..10], want_logits: true }).unwrap().unwrap();
        let mut next = argmax(&l) as u32;
        be.open(1).unwrap();
        let mut log = Vec::new();
        for (a, b) in [(0, 20), (20, 30)] {
            let rows = [DecodeRow { stream: 0, tokens: vec![next] }];
            let chunk = Chunk { start: a, tokens: &prompt[a..b], want_logits: true };
            let out = be.round(Step::new(&rows, Some((1, chunk)), Pick::Argmax)).unwrap();
            let Picked::Tokens(t) = &out.picked else { panic!("{:?}", out.picked) };
            next = t[0];
            log.push(format!("{t:?} {:?}", out.chunk_logits.unwrap().iter().map(|v| v.to_bits()).collect::<Vec<_>>()));
        }
        (log, be.fill().blocks_used)
    };
    let (kept, padded) = (run(false), run(true));
    assert_eq!(kept, padded);
    assert_eq!(padded.1, 3);
}
