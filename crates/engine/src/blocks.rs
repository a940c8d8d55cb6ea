//! The KV block pool and its content-addressed prefix cache, as plain host
//! data: which block ids are free, who holds each one, and which token
//! blocks each one holds. A backend keeps the rows themselves on its device
//! and asks this for ids; when a block must be copied (a stream is about to
//! write into a block it shares) it is told which to copy where.
//!
//! Every full block of a keyed stream is *sealed*: indexed under a chained
//! hash of the cache salt and every token up to its end (so a block matches
//! only behind the same prefix). A block that no stream or mark holds any
//! more stays cached, idle, until the pool needs room: only then are idle
//! blocks evicted, least recently used first. A new stream starts from the
//! longest run of cached full blocks of its prompt, shared as they are, plus
//! the best partial match of the next block (a stream's last, partly filled
//! block is cached when it ends), copied, since the stream writes on in it.
//!
//! Lookups check the tokens and the parent link of every block they walk,
//! so a hash collision cannot hand a stream the wrong rows.
//!
//! Sliding-window layers keep their rows in a second pool of their own,
//! sealed under the same hashes: a stream's table there lets go of the
//! blocks no later query of it can see ([`BlockPool::drop_front`]), and a
//! new stream starts over both pools only where the window pool still
//! holds the window before its start ([`BlockPool::attach_windowed`]).

use std::collections::{BTreeMap, HashMap};

/// Names one KV block of a pool.
pub type BlockId = u32;

/// The hash a salt's chains start from.
pub fn chain_root(salt: u64) -> u64 {
    mix(0xCBF2_9CE4_8422_2325 ^ salt.wrapping_mul(0x9E37_79B9_7F4A_7C15))
}

/// The hash of a block of `tokens` behind a prefix hashed `parent`.
pub fn chain_hash(parent: u64, tokens: &[u32]) -> u64 {
    tokens.iter().fold(parent, |x, &t| mix(x ^ t as u64))
}

fn mix(x: u64) -> u64 {
    // splitmix64's finaliser: every input bit reaches every output bit.
    let x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    let x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

/// A sealed block: the tokens it holds behind the prefix hashed `parent`.
struct Sealed {
    parent: u64,
    /// `block_tokens` of them for a full block, fewer for a stream's tail.
    tokens: Vec<u32>,
    /// Its own chain hash (full blocks; tails are found through `parent`).
    hash: u64,
}

/// One stream's blocks, and (for a keyed stream) the tokens its rows hold
/// and the chain hash after each full block.
#[derive(Debug, Default)]
pub struct BlockTable {
    /// Block `i` holds rows `i * block_tokens ..`; the first `dropped`
    /// entries are stand-ins (see [`BlockPool::drop_front`]).
    pub blocks: Vec<BlockId>,
    /// Leading blocks let go (sliding-window layers: rows no query will
    /// see again). Their entries name the first block still held, so a
    /// kernel that reads a masked row reads valid memory.
    dropped: usize,
    /// `Some(chain)` when the stream is keyed: `chain[i]` covers the first
    /// `i` full blocks (`chain[0]` is the salt's root).
    chain: Option<Vec<u64>>,
    tokens: Vec<u32>,
}

impl BlockTable {
    /// Whether the stream's blocks are sealed into the cache as they fill.
    pub fn keyed(&self) -> bool {
        self.chain.is_some()
    }

    /// Seal nothing more of this stream (its rows are no longer known);
    /// blocks sealed already stay cached.
    pub fn unkey(&mut self) {
        self.chain = None;
        self.tokens = Vec::new();
    }

    /// An unkeyed table holding `held` after `dropped` blocks let go
    /// (stand-ins naming its first held block, or block 0 where none is):
    /// a mark's window blocks restored.
    pub fn dropped_before(held: Vec<BlockId>, dropped: usize) -> BlockTable {
        let stand_in = held.first().copied().unwrap_or(0);
        let mut blocks = vec![stand_in; dropped];
        blocks.extend(held);
        BlockTable { blocks, dropped, chain: None, tokens: Vec::new() }
    }

    /// Leading blocks let go ([`BlockPool::drop_front`]).
    pub fn dropped(&self) -> usize {
        self.dropped
    }

    /// Blocks the table holds (stand-ins not counted).
    pub fn held(&self) -> usize {
        self.blocks.len() - self.dropped
    }
}

/// The first block of the window a query at `pos` sees (`window` keys up
/// to and including its own; none beyond `pos`).
pub fn window_start(pos: usize, window: usize, block_tokens: usize) -> usize {
    (pos + 1).saturating_sub(window) / block_tokens
}

/// What [`BlockPool::attach`] gave a stream.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Attached {
    /// Rows the stream now holds.
    pub rows: usize,
    /// Copy block `.0` to `.1` on the device before the stream runs: its
    /// last block, matched in part, is its own copy.
    pub copy: Option<(BlockId, BlockId)>,
}

/// The pool's ids, their holders, and the cache of sealed blocks.
pub struct BlockPool {
    block_tokens: usize,
    /// Holders of each block: streams and marks.
    refs: Vec<u32>,
    free: Vec<BlockId>,
    sealed: Vec<Option<Sealed>>,
    /// Full sealed blocks by chain hash.
    full: HashMap<u64, BlockId>,
    /// Sealed blocks (full and tails) by their parent's hash, for the
    /// partial match at the end of a lookup.
    children: HashMap<u64, Vec<BlockId>>,
    /// Sealed blocks nobody holds, by when they were last let go.
    idle: BTreeMap<u64, BlockId>,
    /// Each idle block's key in `idle`.
    idle_at: Vec<u64>,
    clock: u64,
    evicted: u64,
}

impl BlockPool {
    pub fn new(blocks: usize, block_tokens: usize) -> BlockPool {
        BlockPool {
            block_tokens: block_tokens.max(1),
            refs: vec![0; blocks],
            free: (0..blocks as BlockId).rev().collect(),
            sealed: (0..blocks).map(|_| None).collect(),
            full: HashMap::new(),
            children: HashMap::new(),
            idle: BTreeMap::new(),
            idle_at: vec![0; blocks],
            clock: 0,
            evicted: 0,
        }
    }

    pub fn block_tokens(&self) -> usize {
        self.block_tokens
    }

    pub fn total(&self) -> usize {
        self.refs.len()
    }

    /// Blocks a new row could take: free ones and idle cached ones.
    pub fn available(&self) -> usize {
        self.free.len() + self.idle.len()
    }

    /// Blocks held by streams or marks.
    pub fn in_use(&self) -> usize {
        self.total() - self.available()
    }

    /// Blocks only the cache holds (evictable).
    pub fn cached(&self) -> usize {
        self.idle.len()
    }

    /// Cached blocks evicted so far to make room.
    pub fn evicted(&self) -> u64 {
        self.evicted
    }

    /// Holders of `b` (for tests and checks).
    pub fn holders(&self, b: BlockId) -> u32 {
        self.refs[b as usize]
    }

    /// A block for one holder: a free one, else the least recently used
    /// idle one, evicted from the cache. `None` when every block is held.
    pub fn alloc(&mut self) -> Option<BlockId> {
        let b = match self.free.pop() {
            Some(b) => b,
            None => {
                let (_, b) = self.idle.pop_first()?;
                self.unseal(b);
                self.evicted += 1;
                b
            }
        };
        self.refs[b as usize] = 1;
        Some(b)
    }

    /// One more holder of `b` (a stream sharing it, a mark).
    pub fn retain(&mut self, b: BlockId) {
        if self.refs[b as usize] == 0 {
            self.idle.remove(&self.idle_at[b as usize]);
        }
        self.refs[b as usize] += 1;
    }

    /// One holder fewer: a block nobody holds stays cached if it is sealed,
    /// else it is free.
    pub fn release(&mut self, b: BlockId) {
        let r = &mut self.refs[b as usize];
        debug_assert!(*r > 0, "block {b} released more often than held");
        *r = r.saturating_sub(1);
        if *r > 0 {
            return;
        }
        if self.sealed[b as usize].is_some() {
            self.clock += 1;
            self.idle_at[b as usize] = self.clock;
            self.idle.insert(self.clock, b);
        } else {
            self.free.push(b);
        }
    }

    /// Grow `table` to hold `len` rows; all or nothing.
    pub fn grow(&mut self, table: &mut BlockTable, len: usize) -> Result<(), String> {
        let need = len.div_ceil(self.block_tokens).saturating_sub(table.blocks.len());
        if need > self.available() {
            return Err(format!("KV pool full: {need} more blocks needed, {} free", self.available()));
        }
        for _ in 0..need {
            table.blocks.push(self.alloc().expect("counted above"));
        }
        Ok(())
    }

    /// Start an empty `table` keyed by `salt` from the longest prefix of
    /// `prompt` the cache holds, at most `max_len` rows. The stream's
    /// blocks are sealed as they fill from now on.
    pub fn attach(&mut self, table: &mut BlockTable, prompt: &[u32], salt: u64, max_len: usize) -> Attached {
        debug_assert!(table.blocks.is_empty() && table.chain.is_none(), "attach needs an empty table");
        let bt = self.block_tokens;
        let max_len = max_len.min(prompt.len());
        let mut chain = vec![chain_root(salt)];
        let mut parent = chain[0];
        while table.blocks.len() * bt + bt <= max_len {
            let start = table.blocks.len() * bt;
            let toks = &prompt[start..start + bt];
            let hash = chain_hash(parent, toks);
            let Some(b) = self.cached_block(parent, hash, toks) else { break };
            self.retain(b);
            table.blocks.push(b);
            chain.push(hash);
            parent = hash;
        }
        let start = table.blocks.len() * bt;
        let mut out = Attached { rows: start, copy: None };
        let rest = &prompt[start..max_len.min(start + bt)];
        if let Some((src, rows)) = self.best_child(parent, rest) {
            // Held while the copy's block is found, so it cannot be the one evicted.
            self.retain(src);
            let dst = self.alloc();
            self.release(src);
            if let Some(dst) = dst {
                table.blocks.push(dst);
                out = Attached { rows: start + rows, copy: Some((src, dst)) };
            }
        }
        table.tokens = prompt[..out.rows].to_vec();
        table.chain = Some(chain);
        out
    }

    /// [`BlockPool::attach`] over a pair of pools of one block size: this
    /// one holds the rows of layers that see the whole context, `win` those
    /// of sliding-window layers (`window` keys), whose tables hold only the
    /// blocks a query can still see. Both seal blocks under the same chain
    /// hashes. A cached run of full blocks is usable up to the longest
    /// block-aligned start at which `win` still caches every block of the
    /// window before it; then the partial match of the next block, as far
    /// as both pools hold it, is copied in both. O(prompt blocks). The
    /// second pair to copy, if any, is `win`'s.
    #[allow(clippy::too_many_arguments)]
    pub fn attach_windowed(
        &mut self,
        table: &mut BlockTable,
        win: &mut BlockPool,
        win_table: &mut BlockTable,
        prompt: &[u32],
        salt: u64,
        max_len: usize,
        window: usize,
    ) -> (Attached, Option<(BlockId, BlockId)>) {
        debug_assert!(table.blocks.is_empty() && win_table.blocks.is_empty(), "attach needs empty tables");
        debug_assert_eq!(self.block_tokens, win.block_tokens, "paired pools of one block size");
        let bt = self.block_tokens;
        let max_len = max_len.min(prompt.len());
        let run = self.cached_run(prompt, salt, max_len);
        // The longest start `k` blocks in with no block of its window missing from `win`.
        let (mut k, mut missing) = (0, None);
        for i in 0..run.len() {
            if missing.is_none_or(|m| m < window_start(i * bt, window, bt)) {
                k = i;
            }
            if i + 1 < run.len() && win.cached_block(run[i], run[i + 1], &prompt[i * bt..(i + 1) * bt]).is_none() {
                missing = Some(i);
            }
        }
        // Held before the partial block's copies are found, so that none of
        // them is the one evicted: the full run, and the window before it.
        let start = k * bt;
        for i in 0..k {
            let b = self.full[&run[i + 1]];
            self.retain(b);
            table.blocks.push(b);
        }
        let first = window_start(start, window, bt).min(k);
        for i in first..k {
            let b = win.full[&run[i + 1]];
            win.retain(b);
            win_table.blocks.push(b);
        }
        // The next block's leading rows, as far as both pools match them.
        let rest = &prompt[start..max_len.min(start + bt)];
        let (mut rows, mut copy, mut win_copy) = (start, None, None);
        if let (Some((src, n)), Some((wsrc, wn))) = (self.best_child(run[k], rest), win.best_child(run[k], rest)) {
            self.retain(src);
            win.retain(wsrc);
            let (dst, wdst) = (self.alloc(), win.alloc());
            self.release(src);
            win.release(wsrc);
            match (dst, wdst) {
                (Some(dst), Some(wdst)) => {
                    rows += n.min(wn);
                    table.blocks.push(dst);
                    win_table.blocks.push(wdst);
                    copy = Some((src, dst));
                    win_copy = Some((wsrc, wdst));
                }
                (dst, wdst) => {
                    dst.into_iter().for_each(|b| self.release(b));
                    wdst.into_iter().for_each(|b| win.release(b));
                }
            }
        }
        // Stand-ins for the window blocks not held (block 0 where none is).
        let stand_in = win_table.blocks.first().copied().unwrap_or(0);
        win_table.blocks.splice(0..0, std::iter::repeat_n(stand_in, first));
        win_table.dropped = first;
        for t in [&mut *table, &mut *win_table] {
            t.tokens = prompt[..rows].to_vec();
            t.chain = Some(run[..=k].to_vec());
        }
        (Attached { rows, copy }, win_copy)
    }

    /// The sealed block behind `parent` sharing the longest run of leading
    /// tokens with `rest`, and that run's length (at least 1).
    fn best_child(&self, parent: u64, rest: &[u32]) -> Option<(BlockId, usize)> {
        let kids = self.children.get(&parent)?;
        let common = |b: &BlockId| self.sealed[*b as usize].as_ref().map_or(0, |s| s.tokens.iter().zip(rest).take_while(|(a, b)| a == b).count());
        kids.iter().map(|b| (*b, common(b))).filter(|&(_, n)| n > 0).max_by_key(|&(_, n)| n)
    }

    /// `tokens` were written after `table`'s rows: seal every block they
    /// filled (a keyed table; others keep no tokens).
    pub fn append(&mut self, table: &mut BlockTable, tokens: &[u32]) {
        let Some(chain) = table.chain.as_mut() else { return };
        table.tokens.extend_from_slice(tokens);
        let bt = self.block_tokens;
        while chain.len() * bt <= table.tokens.len() {
            let i = chain.len() - 1;
            let parent = chain[i];
            let toks = &table.tokens[i * bt..(i + 1) * bt];
            let hash = chain_hash(parent, toks);
            let b = table.blocks[i];
            // A block holding the same rows is cached already: this one
            // stays the stream's own. (A block let go was sealed before.)
            if i >= table.dropped && !self.full.contains_key(&hash) && self.sealed[b as usize].is_none() {
                self.seal(b, Sealed { parent, tokens: toks.to_vec(), hash });
            }
            chain.push(hash);
        }
    }

    /// Cut `table` back to `len` rows. The block the stream writes on in
    /// must be its own: one it shares is copied (the pair returned, to copy
    /// on the device; an error when no block is left for the copy, and the
    /// stream must not run on), one only it holds leaves the cache.
    pub fn truncate(&mut self, table: &mut BlockTable, len: usize) -> Result<Option<(BlockId, BlockId)>, String> {
        let bt = self.block_tokens;
        if len / bt < table.dropped {
            return Err(format!("cannot cut back to row {len}: the blocks before row {} were let go", table.dropped * bt));
        }
        for b in table.blocks.split_off(len.div_ceil(bt).min(table.blocks.len())) {
            self.release(b);
        }
        if let Some(chain) = table.chain.as_mut() {
            table.tokens.truncate(len);
            chain.truncate(len / bt + 1);
        }
        let i = len / bt;
        if len.is_multiple_of(bt) || i >= table.blocks.len() {
            return Ok(None);
        }
        let b = table.blocks[i];
        if self.refs[b as usize] > 1 {
            let dst = self.alloc().ok_or("KV pool full: no block left to copy a shared one into")?;
            self.release(b);
            table.blocks[i] = dst;
            return Ok(Some((b, dst)));
        }
        self.unseal(b);
        Ok(None)
    }

    /// The stream is gone: cache its partly filled last block (a keyed
    /// stream's, unless the cache holds those rows already) and let go of
    /// every block, last first, so its tail is the first evicted.
    pub fn free_table(&mut self, table: BlockTable) {
        let bt = self.block_tokens;
        if let Some(chain) = &table.chain {
            let (n, i) = (table.tokens.len(), chain.len() - 1);
            let tail = &table.tokens[(i * bt).min(n)..];
            if !tail.is_empty() && n < (i + 1) * bt && i < table.blocks.len() {
                let b = table.blocks[i];
                let parent = chain[i];
                if self.sealed[b as usize].is_none() && self.best_child(parent, tail).is_none_or(|(_, n)| n < tail.len()) {
                    self.seal(b, Sealed { parent, tokens: tail.to_vec(), hash: 0 });
                }
            }
        }
        for &b in table.blocks[table.dropped..].iter().rev() {
            self.release(b);
        }
    }

    /// Let go of `table`'s blocks before block `upto` (their rows are
    /// older than any query will see), keeping at least its last block:
    /// each stays cached, idle, like any block a stream lets go, and its
    /// entry names the first block still held.
    pub fn drop_front(&mut self, table: &mut BlockTable, upto: usize) {
        let upto = upto.min(table.blocks.len().saturating_sub(1));
        if upto <= table.dropped {
            return;
        }
        for i in table.dropped..upto {
            self.release(table.blocks[i]);
        }
        let first = table.blocks[upto];
        table.blocks[..upto].fill(first);
        table.dropped = upto;
    }

    /// The chain hashes of the longest run of cached full blocks `prompt`
    /// begins with (at most `max_len` rows), from the salt's root: entry
    /// `i + 1` is block `i`'s. Nothing is held.
    pub fn cached_run(&self, prompt: &[u32], salt: u64, max_len: usize) -> Vec<u64> {
        let bt = self.block_tokens;
        let max_len = max_len.min(prompt.len());
        let mut chain = vec![chain_root(salt)];
        while chain.len() * bt <= max_len {
            let i = chain.len() - 1;
            let hash = chain_hash(chain[i], &prompt[i * bt..(i + 1) * bt]);
            if self.cached_block(chain[i], hash, &prompt[i * bt..(i + 1) * bt]).is_none() {
                break;
            }
            chain.push(hash);
        }
        chain
    }

    /// The cached full block of `toks` behind the prefix hashed `parent`.
    fn cached_block(&self, parent: u64, hash: u64, toks: &[u32]) -> Option<BlockId> {
        let &b = self.full.get(&hash)?;
        self.sealed[b as usize].as_ref().is_some_and(|s| s.parent == parent && s.tokens == toks).then_some(b)
    }

    fn seal(&mut self, b: BlockId, s: Sealed) {
        if s.tokens.len() == self.block_tokens {
            self.full.insert(s.hash, b);
        }
        self.children.entry(s.parent).or_default().push(b);
        self.sealed[b as usize] = Some(s);
    }

    fn unseal(&mut self, b: BlockId) {
        let Some(s) = self.sealed[b as usize].take() else { return };
        if s.tokens.len() == self.block_tokens && self.full.get(&s.hash) == Some(&b) {
            self.full.remove(&s.hash);
        }
        if let Some(kids) = self.children.get_mut(&s.parent) {
            kids.retain(|&k| k != b);
            if kids.is_empty() {
                self.children.remove(&s.parent);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(pool: &mut BlockPool, t: &mut BlockTable, tokens: &[u32]) {
        let len = t.tokens.len() + tokens.len();
        pool.grow(t, len).unwrap();
        pool.append(t, tokens);
    }

    /// A new stream that attached `p` (under `salt`) and ran it all.
    fn ran(pool: &mut BlockPool, p: &[u32], salt: u64) -> BlockTable {
        let mut t = BlockTable::default();
        pool.attach(&mut t, p, salt, p.len());
        run(pool, &mut t, p);
        t
    }

    fn seq(n: usize, seed: u32) -> Vec<u32> {
        (0..n as u32).map(|i| i * 7 + seed).collect()
    }

    #[test]
    fn a_prompt_seen_before_attaches_its_blocks_and_a_copy_of_its_tail() {
        let mut pool = BlockPool::new(16, 4);
        let p = seq(10, 1);
        let mut a = BlockTable::default();
        assert_eq!(pool.attach(&mut a, &p, 0, 9), Attached { rows: 0, copy: None });
        run(&mut pool, &mut a, &p);
        let a_blocks = a.blocks.clone();
        // While A runs, its two full blocks are shared; its tail is not cached yet.
        let mut b = BlockTable::default();
        assert_eq!(pool.attach(&mut b, &p, 0, 9).rows, 8);
        assert_eq!(b.blocks, a_blocks[..2]);
        assert_eq!(pool.holders(a_blocks[0]), 2);
        pool.free_table(b);
        pool.free_table(a);
        assert_eq!((pool.in_use(), pool.cached()), (0, 3), "every block of A stays cached");
        // The same prompt again: everything but its last row.
        let mut c = BlockTable::default();
        let got = pool.attach(&mut c, &p, 0, 9);
        assert_eq!(got.rows, 9);
        let (src, dst) = got.copy.unwrap();
        assert_eq!(src, a_blocks[2]);
        assert_ne!(dst, src, "the tail is the stream's own copy");
        assert_eq!(c.blocks, vec![a_blocks[0], a_blocks[1], dst]);
    }

    #[test]
    fn a_block_matches_only_behind_the_same_prefix_and_salt() {
        let mut pool = BlockPool::new(16, 4);
        let p = seq(8, 1);
        let a = ran(&mut pool, &p, 7);
        pool.free_table(a);
        let mut other_salt = BlockTable::default();
        assert_eq!(pool.attach(&mut other_salt, &p, 8, 8).rows, 0);
        // The second block's tokens behind a different first block.
        let mut q = seq(4, 99);
        q.extend_from_slice(&p[4..]);
        let mut shifted = BlockTable::default();
        assert_eq!(pool.attach(&mut shifted, &q, 7, 8).rows, 0);
        // Diverging inside the second block matches its leading rows, copied.
        let mut r = p.clone();
        r[6] = 1000;
        let mut part = BlockTable::default();
        let got = pool.attach(&mut part, &r, 7, 8);
        assert_eq!(got.rows, 6);
        assert!(got.copy.is_some());
    }

    #[test]
    fn idle_blocks_are_evicted_only_for_room_oldest_first() {
        let mut pool = BlockPool::new(4, 2);
        let (p, q) = (seq(4, 1), seq(4, 2));
        for x in [&p, &q] {
            let t = ran(&mut pool, x, 0);
            pool.free_table(t);
        }
        assert_eq!((pool.cached(), pool.available(), pool.evicted()), (4, 4, 0));
        // Using p makes q the oldest: a new stream of one block evicts q's
        // last block first (a stream's tail goes before its head).
        let mut t = BlockTable::default();
        assert_eq!(pool.attach(&mut t, &p, 0, 4).rows, 4);
        pool.free_table(t);
        let mut n = BlockTable::default();
        pool.grow(&mut n, 2).unwrap();
        assert_eq!(pool.evicted(), 1);
        let mut t = BlockTable::default();
        assert_eq!(pool.attach(&mut t, &q, 0, 4).rows, 2, "q lost its second block");
        pool.free_table(t);
        let mut t = BlockTable::default();
        assert_eq!(pool.attach(&mut t, &p, 0, 4).rows, 4, "p kept both");
    }

    #[test]
    fn rewinding_into_a_shared_block_copies_it_and_into_an_own_one_unseals_it() {
        let mut pool = BlockPool::new(8, 4);
        let p = seq(8, 3);
        let mut a = ran(&mut pool, &p, 0);
        let mut b = BlockTable::default();
        assert_eq!(pool.attach(&mut b, &p, 0, 8).rows, 8);
        let shared = b.blocks[1];
        let (src, dst) = pool.truncate(&mut b, 6).unwrap().unwrap();
        assert_eq!(src, shared);
        assert_eq!(b.blocks[1], dst);
        pool.free_table(b);
        // A alone holds its second block: cut into, it leaves the cache.
        assert_eq!(pool.truncate(&mut a, 5), Ok(None));
        pool.append(&mut a, &[500, 501, 502]);
        pool.free_table(a);
        let mut c = BlockTable::default();
        let mut q = p[..5].to_vec();
        q.extend([500, 501, 502]);
        assert_eq!(pool.attach(&mut c, &q, 0, 8).rows, 8);
        let mut d = BlockTable::default();
        assert_eq!(pool.attach(&mut d, &p, 0, 8).rows, 5, "the old second block is gone: one row matches A's rewritten one");
    }

    #[test]
    fn an_unkeyed_table_seals_nothing() {
        let mut pool = BlockPool::new(4, 2);
        let mut t = BlockTable::default();
        run(&mut pool, &mut t, &[1, 2, 3]);
        assert!(!t.keyed());
        pool.free_table(t);
        assert_eq!((pool.cached(), pool.available()), (0, 4));
    }

    #[test]
    fn dropping_front_blocks_keeps_stand_ins_and_frees_only_held_ones() {
        let mut pool = BlockPool::new(8, 2);
        let p = seq(9, 4);
        let mut t = BlockTable::default();
        pool.attach(&mut t, &p, 0, 9);
        run(&mut pool, &mut t, &p);
        let blocks = t.blocks.clone();
        pool.drop_front(&mut t, 3);
        assert_eq!((t.dropped(), t.held()), (3, 2));
        assert_eq!(t.blocks, vec![blocks[3], blocks[3], blocks[3], blocks[3], blocks[4]], "stand-ins name the first block held");
        assert_eq!(pool.in_use(), 2);
        assert_eq!(pool.cached(), 3, "blocks let go stay cached, idle");
        assert!(pool.truncate(&mut t, 5).is_err(), "rows let go cannot be cut back into");
        assert_eq!(pool.truncate(&mut t, 7), Ok(None));
        // Never the last block; dropping less than before does nothing.
        pool.drop_front(&mut t, 10);
        assert_eq!(t.dropped(), 3);
        pool.drop_front(&mut t, 1);
        assert_eq!(t.dropped(), 3);
        pool.free_table(t);
        assert_eq!(pool.in_use(), 0);
    }

    #[test]
    fn a_windowed_attach_starts_where_the_window_pool_still_holds_the_window() {
        let (bt, window) = (4, 6);
        let (mut full, mut win) = (BlockPool::new(32, bt), BlockPool::new(32, bt));
        let p = seq(30, 5);
        // A stream runs p, its window table letting go of what its last row cannot see.
        let (mut t, mut w) = (BlockTable::default(), BlockTable::default());
        assert_eq!(full.attach_windowed(&mut t, &mut win, &mut w, &p, 0, 30, window).0.rows, 0);
        run(&mut full, &mut t, &p);
        run(&mut win, &mut w, &p);
        let wblocks = w.blocks.clone();
        win.drop_front(&mut w, window_start(30, window, bt));
        assert_eq!(w.held(), 2, "rows 24..30 in two blocks");
        full.free_table(t);
        win.free_table(w);
        // Every block cached in both: the whole prompt but its last row.
        let (mut t, mut w) = (BlockTable::default(), BlockTable::default());
        let (got, wcopy) = full.attach_windowed(&mut t, &mut win, &mut w, &p, 0, 29, window);
        assert_eq!(got.rows, 29);
        assert!(got.copy.is_some() && wcopy.is_some(), "the partial block is copied in both pools");
        assert_eq!(w.blocks.len(), t.blocks.len());
        assert_eq!(w.dropped(), window_start(28, window, bt), "the window of the start block's first row is held");
        assert_eq!(w.held(), 3);
        assert!(w.blocks[..w.dropped()].iter().all(|&b| b == w.blocks[w.dropped()]), "stand-ins name the first block held");
        full.free_table(t);
        win.free_table(w);
        // The window pool loses the blocks of rows 16..24: the start falls
        // back to 16 rows, whose window (rows 11..16) it holds; block 4 is
        // matched in the full pool alone, so it is not used.
        for b in [wblocks[4], wblocks[5]] {
            win.retain(b);
            win.unseal(b);
            win.release(b);
        }
        let (mut t, mut w) = (BlockTable::default(), BlockTable::default());
        let (got, wcopy) = full.attach_windowed(&mut t, &mut win, &mut w, &p, 0, 29, window);
        assert_eq!((got, wcopy), (Attached { rows: 16, copy: None }, None));
        assert_eq!((t.blocks.len(), w.blocks.len(), w.dropped()), (4, 4, 2));
        full.free_table(t);
        win.free_table(w);
        assert_eq!((full.in_use(), win.in_use()), (0, 0));
    }

    #[test]
    fn a_windowed_attach_never_evicts_the_blocks_it_hands_out() {
        let (bt, window) = (4, 6);
        // Pools of exactly the prompt's blocks: once it ran, every block is idle.
        let (mut full, mut win) = (BlockPool::new(8, bt), BlockPool::new(8, bt));
        let p = seq(30, 5);
        let (mut t, mut w) = (BlockTable::default(), BlockTable::default());
        full.attach_windowed(&mut t, &mut win, &mut w, &p, 0, 30, window);
        run(&mut full, &mut t, &p);
        run(&mut win, &mut w, &p);
        full.free_table(t);
        win.free_table(w);
        assert_eq!((full.available(), full.cached()), (8, 8));
        // The partial block's copy finds no block the stream does not take
        // whole (its source, the tail, is held meanwhile): no copy, 28 rows.
        let (mut t, mut w) = (BlockTable::default(), BlockTable::default());
        assert_eq!(full.attach_windowed(&mut t, &mut win, &mut w, &p, 0, 29, window), (Attached { rows: 28, copy: None }, None));
        assert_eq!(full.evicted(), 0, "none of the blocks handed out was evicted");
        assert!(t.blocks.iter().all(|&b| full.holders(b) == 1));
        assert!(w.blocks[w.dropped()..].iter().all(|&b| win.holders(b) == 1));
        full.free_table(t);
        win.free_table(w);
    }
}
