//! Cutting special-token text out of the input before tokenizing the rest.
//!
//! llama.cpp takes the special tokens longest first and, for each, splits
//! every remaining stretch of plain text at its (left to right,
//! non-overlapping) occurrences. So a longer special token wins over a
//! shorter one that overlaps it, even one that starts earlier. We get the same
//! result in one pass: find every occurrence of every special token with a
//! trie, then accept them in order (longest first, then leftmost), skipping
//! any that overlap one already accepted.

/// A piece of the input: plain text to tokenize, or a special token.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Fragment<'a> {
    Text(&'a str),
    Token(u32),
}

#[derive(Default)]
struct Node {
    /// Sorted by byte.
    edges: Vec<(u8, u32)>,
    token: Option<u32>,
}

/// A byte trie over the texts of the special tokens.
pub(crate) struct SpecialMatcher {
    nodes: Vec<Node>,
}

impl SpecialMatcher {
    /// `tokens`: (id, text) pairs; empty texts are ignored. Where two tokens
    /// share a text the lower id is kept.
    pub(crate) fn new<'a>(tokens: impl IntoIterator<Item = (u32, &'a str)>) -> SpecialMatcher {
        let mut nodes = vec![Node::default()];
        for (id, text) in tokens {
            if text.is_empty() {
                continue;
            }
            let mut cur = 0usize;
            for &b in text.as_bytes() {
                cur = match nodes[cur].edges.binary_search_by_key(&b, |e| e.0) {
                    Ok(k) => nodes[cur].edges[k].1 as usize,
                    Err(k) => {
                        let next = nodes.len();
                        nodes.push(Node::default());
                        nodes[cur].edges.insert(k, (b, next as u32));
                        next
                    }
                };
            }
            match nodes[cur].token {
                Some(old) if old <= id => {}
                _ => nodes[cur].token = Some(id),
            }
        }
        SpecialMatcher { nodes }
    }

    fn is_empty(&self) -> bool {
        self.nodes[0].edges.is_empty()
    }

    /// Splits `text` into plain-text stretches and special tokens, in order.
    pub(crate) fn partition<'a>(&self, text: &'a str) -> Vec<Fragment<'a>> {
        self.partition_with(text, |_, _, _| true)
    }

    /// Like [`partition`](Self::partition), taking only the occurrences
    /// `accept(start, len, id)` allows (the rest stay plain text).
    pub(crate) fn partition_with<'a>(&self, text: &'a str, accept: impl Fn(usize, usize, u32) -> bool) -> Vec<Fragment<'a>> {
        if text.is_empty() {
            return Vec::new();
        }
        if self.is_empty() {
            return vec![Fragment::Text(text)];
        }
        let bytes = text.as_bytes();
        // Every occurrence, bucketed by length; each bucket is in text order.
        let mut by_len: Vec<Vec<(u32, u32)>> = Vec::new();
        for start in 0..bytes.len() {
            let mut cur = 0usize;
            for (k, &b) in bytes[start..].iter().enumerate() {
                let node = &self.nodes[cur];
                match node.edges.binary_search_by_key(&b, |e| e.0) {
                    Ok(e) => cur = node.edges[e].1 as usize,
                    Err(_) => break,
                }
                if let Some(id) = self.nodes[cur].token.filter(|&id| accept(start, k + 1, id)) {
                    let len = k + 1;
                    if by_len.len() <= len {
                        by_len.resize_with(len + 1, Vec::new);
                    }
                    by_len[len].push((start as u32, id));
                }
            }
        }
        if by_len.is_empty() {
            return vec![Fragment::Text(text)];
        }
        // Longest first, then leftmost. (Equal-length tokens that overlap
        // each other are taken leftmost first; llama.cpp leaves their order
        // unspecified.) Every interval accepted so far is at least as long as
        // the candidate, so it overlaps the candidate exactly when it covers
        // one of the candidate's two ends.
        let mut covered = vec![false; bytes.len()];
        let mut accepted: Vec<(usize, usize, u32)> = Vec::new();
        for (len, found) in by_len.iter().enumerate().rev() {
            for &(start, id) in found {
                let start = start as usize;
                if covered[start] || covered[start + len - 1] {
                    continue;
                }
                covered[start..start + len].iter_mut().for_each(|c| *c = true);
                accepted.push((start, len, id));
            }
        }
        accepted.sort_unstable_by_key(|a| a.0);
        let mut out = Vec::with_capacity(accepted.len() * 2 + 1);
        let mut pos = 0;
        for (start, len, id) in accepted {
            // Special-token texts are whole UTF-8 strings, so both ends of a
            // match fall on character boundaries of `text`.
            if start > pos {
                out.push(Fragment::Text(&text[pos..start]));
            }
            out.push(Fragment::Token(id));
            pos = start + len;
        }
        if pos < text.len() {
            out.push(Fragment::Text(&text[pos..]));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use Fragment::*;

    #[test]
    fn longer_token_wins_over_earlier_shorter_one() {
        let m = SpecialMatcher::new([(1, "ab"), (2, "bcd")]);
        assert_eq!(m.partition("abcd"), vec![Text("a"), Token(2)]);
        assert_eq!(m.partition("xaby"), vec![Text("x"), Token(1), Text("y")]);
    }

    #[test]
    fn runs_split_longest_first() {
        let m = SpecialMatcher::new([(3, "   "), (2, "  ")]);
        // Five spaces: the three-space token first, then the two-space one.
        assert_eq!(m.partition("a     b"), vec![Text("a"), Token(3), Token(2), Text("b")]);
        assert_eq!(m.partition("  "), vec![Token(2)]);
        assert_eq!(m.partition(" "), vec![Text(" ")]);
    }

    #[test]
    fn same_token_does_not_overlap_itself() {
        let m = SpecialMatcher::new([(7, "aa")]);
        assert_eq!(m.partition("aaa"), vec![Token(7), Text("a")]);
    }

    #[test]
    fn no_specials_or_empty_text() {
        let m = SpecialMatcher::new(std::iter::empty());
        assert_eq!(m.partition("hi"), vec![Text("hi")]);
        let m = SpecialMatcher::new([(1, "<s>")]);
        assert_eq!(m.partition(""), vec![]);
        assert_eq!(m.partition("é<s>é"), vec![Text("é"), Token(1), Text("é")]);
    }
}
