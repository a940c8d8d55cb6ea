//! The prefix cache index of marks: which kept marks hold which token
//! prefixes (for backends whose state cannot be rebuilt from cached KV
//! blocks; see `blocks` for those that can), and which prefixes recent
//! prompts shared, so the lane knows where a mark pays.
//!
//! Each mark is keyed by its cache salt, its length and a chained hash of
//! the tokens before it, and keeps those tokens so a hit is checked exactly
//! (a hash collision cannot hand a stream the wrong state). A lookup hashes
//! the prompt once and probes only the lengths that some mark has. The
//! index is bounded; the least recently used mark goes first, and the
//! caller drops it on the backend.

use std::collections::{BTreeMap, HashMap};

use crate::backend::MarkId;
use crate::blocks::{chain_hash, chain_root};

struct Entry {
    salt: u64,
    tokens: Vec<u32>,
    hash: u64,
    last_used: u64,
}

pub struct PrefixIndex {
    capacity: usize,
    entries: HashMap<MarkId, Entry>,
    by_key: HashMap<(u64, usize, u64), MarkId>,
    /// How many marks have each length.
    lengths: BTreeMap<usize, usize>,
    clock: u64,
}

/// Chained hash of every prefix: `h[i]` covers `tokens[..i]`.
pub fn prefix_hashes(tokens: &[u32]) -> Vec<u64> {
    let mut h = Vec::with_capacity(tokens.len() + 1);
    let mut x: u64 = 0xCBF2_9CE4_8422_2325;
    h.push(x);
    for &t in tokens {
        // One multiply-xorshift round per token; the chain makes each value
        // depend on the whole prefix.
        x = (x ^ t as u64).wrapping_mul(0x0100_0000_01B3).rotate_left(29) ^ 0x9E37_79B9_7F4A_7C15;
        x = (x ^ (x >> 32)).wrapping_mul(0xD6E8_FEB8_6659_FD93);
        h.push(x);
    }
    h
}

impl PrefixIndex {
    /// An index of at most `capacity` marks (0 turns the cache off).
    pub fn new(capacity: usize) -> PrefixIndex {
        PrefixIndex { capacity, entries: HashMap::new(), by_key: HashMap::new(), lengths: BTreeMap::new(), clock: 0 }
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    fn tick(&mut self) -> u64 {
        self.clock += 1;
        self.clock
    }

    /// The longest mark kept under `salt` that is a prefix of `prompt` and
    /// at most `max_len` long: its id and length. Marks it as used.
    pub fn lookup(&mut self, prompt: &[u32], salt: u64, max_len: usize) -> Option<(MarkId, usize)> {
        let max_len = max_len.min(prompt.len());
        if self.entries.is_empty() || max_len == 0 {
            return None;
        }
        let h = prefix_hashes(&prompt[..max_len]);
        let lens: Vec<usize> = self.lengths.range(1..=max_len).rev().map(|(&l, _)| l).collect();
        for len in lens {
            if let Some(&mark) = self.by_key.get(&(salt, len, h[len])) {
                let now = self.tick();
                let e = self.entries.get_mut(&mark)?;
                if e.tokens[..] == prompt[..len] {
                    e.last_used = now;
                    return Some((mark, len));
                }
            }
        }
        None
    }

    /// Whether a mark holds exactly `tokens` under `salt`.
    pub fn contains(&self, salt: u64, tokens: &[u32]) -> bool {
        let h = prefix_hashes(tokens);
        self.contains_hashed(salt, tokens, h[tokens.len()])
    }

    fn contains_hashed(&self, salt: u64, tokens: &[u32], hash: u64) -> bool {
        self.by_key.get(&(salt, tokens.len(), hash)).and_then(|m| self.entries.get(m)).is_some_and(|e| e.tokens[..] == tokens[..])
    }

    /// Which of `positions` (lengths into `prompt`) no mark under `salt` holds yet.
    pub fn missing(&self, prompt: &[u32], salt: u64, positions: &[usize]) -> Vec<usize> {
        let Some(&top) = positions.iter().max() else { return Vec::new() };
        let h = prefix_hashes(&prompt[..top.min(prompt.len())]);
        positions.iter().copied().filter(|&p| p <= prompt.len() && !self.contains_hashed(salt, &prompt[..p], h[p])).collect()
    }

    /// Index `mark`, which holds `tokens`, under `salt`. Returns the marks
    /// the caller must now drop on the backend: the new one itself if that
    /// prefix is already held (or the cache is off), else any evicted to
    /// stay within capacity.
    pub fn insert(&mut self, mark: MarkId, salt: u64, tokens: &[u32]) -> Vec<MarkId> {
        if self.capacity == 0 || tokens.is_empty() || self.contains(salt, tokens) || self.entries.contains_key(&mark) {
            return vec![mark];
        }
        let hash = prefix_hashes(tokens)[tokens.len()];
        let now = self.tick();
        self.by_key.insert((salt, tokens.len(), hash), mark);
        *self.lengths.entry(tokens.len()).or_insert(0) += 1;
        self.entries.insert(mark, Entry { salt, tokens: tokens.to_vec(), hash, last_used: now });
        let mut evicted = Vec::new();
        while self.entries.len() > self.capacity {
            match self.pop_lru() {
                Some(m) => evicted.push(m),
                None => break,
            }
        }
        evicted
    }

    /// Remove the least recently used mark from the index and return it.
    pub fn pop_lru(&mut self) -> Option<MarkId> {
        let mark = self.entries.iter().min_by_key(|(_, e)| e.last_used).map(|(&m, _)| m)?;
        self.remove(mark);
        Some(mark)
    }

    /// Forget `mark` (the caller drops it on the backend).
    pub fn remove(&mut self, mark: MarkId) {
        if let Some(e) = self.entries.remove(&mark) {
            let len = e.tokens.len();
            self.by_key.remove(&(e.salt, len, e.hash));
            if let Some(c) = self.lengths.get_mut(&len) {
                *c -= 1;
                if *c == 0 {
                    self.lengths.remove(&len);
                }
            }
        }
    }

    /// Every indexed mark (for shutdown).
    pub fn marks(&self) -> Vec<MarkId> {
        self.entries.keys().copied().collect()
    }
}

/// Block-aligned prefixes of recent prompts, with how many prompts had
/// each: where two prompts shared a prefix, a third likely will, so a mark
/// at its end pays. Bounded: two generations of counts, the older dropped
/// whole when the newer fills.
pub struct SeenPrefixes {
    block_tokens: usize,
    /// Prefixes per generation.
    capacity: usize,
    new: HashMap<u64, u32>,
    old: HashMap<u64, u32>,
}

impl SeenPrefixes {
    pub fn new(block_tokens: usize, capacity: usize) -> SeenPrefixes {
        SeenPrefixes { block_tokens: block_tokens.max(1), capacity: capacity.max(1), new: HashMap::new(), old: HashMap::new() }
    }

    pub fn block_tokens(&self) -> usize {
        self.block_tokens
    }

    /// The chain hash of each block-aligned prefix of `prompt` under `salt`.
    fn blocks<'a>(&self, prompt: &'a [u32], salt: u64) -> impl Iterator<Item = u64> + 'a {
        prompt.chunks_exact(self.block_tokens).scan(chain_root(salt), |h, block| {
            *h = chain_hash(*h, block);
            Some(*h)
        })
    }

    fn count(&self, h: u64) -> u32 {
        self.new.get(&h).copied().unwrap_or(0) + self.old.get(&h).copied().unwrap_or(0)
    }

    /// Count `prompt`'s prefixes.
    pub fn note(&mut self, prompt: &[u32], salt: u64) {
        let hashes: Vec<u64> = self.blocks(prompt, salt).collect();
        for h in hashes {
            if self.new.len() >= self.capacity && !self.new.contains_key(&h) {
                self.old = std::mem::take(&mut self.new);
            }
            *self.new.entry(h).or_insert(0) += 1;
        }
    }

    /// The longest block-aligned prefix of `prompt`, at most `limit` long,
    /// that at least two noted prompts had (`prompt` itself among them once
    /// noted); 0 if none.
    pub fn shared(&self, prompt: &[u32], salt: u64, limit: usize) -> usize {
        let blocks = self.blocks(&prompt[..limit.min(prompt.len())], salt).take_while(|&h| self.count(h) >= 2).count();
        blocks * self.block_tokens
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_longest_matching_prefix_wins_within_the_limit() {
        let mut ix = PrefixIndex::new(8);
        let p: Vec<u32> = (0..100).collect();
        assert!(ix.insert(1, 0, &p[..32]).is_empty());
        assert!(ix.insert(2, 0, &p[..64]).is_empty());
        let mut q = p[..80].to_vec();
        q[70] = 999;
        assert_eq!(ix.lookup(&q, 0, q.len() - 1), Some((2, 64)));
        assert_eq!(ix.lookup(&q, 0, 63), Some((1, 32)));
        // Diverging before 32 misses everything.
        let mut r = q.clone();
        r[5] = 999;
        assert_eq!(ix.lookup(&r, 0, r.len() - 1), None);
    }

    #[test]
    fn a_duplicate_prefix_is_handed_back() {
        let mut ix = PrefixIndex::new(8);
        assert!(ix.insert(1, 0, &[1, 2, 3]).is_empty());
        assert_eq!(ix.insert(2, 0, &[1, 2, 3]), vec![2]);
        assert_eq!(ix.len(), 1);
    }

    #[test]
    fn least_recently_used_marks_are_evicted() {
        let mut ix = PrefixIndex::new(2);
        ix.insert(1, 0, &[1, 1]);
        ix.insert(2, 0, &[2, 2]);
        // Using mark 1 makes mark 2 the oldest.
        assert_eq!(ix.lookup(&[1, 1, 5], 0, 2), Some((1, 2)));
        assert_eq!(ix.insert(3, 0, &[3, 3]), vec![2]);
        assert_eq!(ix.lookup(&[2, 2, 5], 0, 2), None);
        assert_eq!(ix.lookup(&[3, 3, 5], 0, 2), Some((3, 2)));
        assert_eq!(ix.missing(&[1, 1, 3, 3], 0, &[2, 4]), vec![4]);
    }

    #[test]
    fn zero_capacity_keeps_nothing() {
        let mut ix = PrefixIndex::new(0);
        assert_eq!(ix.insert(1, 0, &[1, 2]), vec![1]);
        assert!(ix.is_empty());
    }

    #[test]
    fn a_mark_is_found_only_under_its_salt() {
        let mut ix = PrefixIndex::new(8);
        assert!(ix.insert(1, 5, &[1, 2, 3]).is_empty());
        assert_eq!(ix.lookup(&[1, 2, 3, 4], 6, 3), None);
        assert_eq!(ix.lookup(&[1, 2, 3, 4], 5, 3), Some((1, 3)));
        assert!(ix.insert(2, 6, &[1, 2, 3]).is_empty(), "the same prefix under another salt is another entry");
    }

    #[test]
    fn a_prefix_two_prompts_shared_is_found_block_aligned() {
        let mut seen = SeenPrefixes::new(4, 64);
        let doc: Vec<u32> = (0..10).collect();
        let mut a = doc.clone();
        a.extend([50, 51, 52]);
        let mut b = doc.clone();
        b.extend([60, 61]);
        seen.note(&a, 0);
        assert_eq!(seen.shared(&a, 0, a.len()), 0, "one prompt shares nothing");
        seen.note(&b, 0);
        // They diverge at 10: the shared blocks end at 8.
        assert_eq!(seen.shared(&b, 0, b.len()), 8);
        assert_eq!(seen.shared(&b, 0, 7), 4);
        assert_eq!(seen.shared(&b, 1, b.len()), 0, "under another salt nothing was seen");
    }
}
