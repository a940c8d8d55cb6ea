//! Stop rules and incremental text: token bytes become UTF-8 text as soon
//! as it is whole, and text that may be the start of a stop string is held
//! back until it cannot be.

/// Bytes of each token, as the tokenizer knows them. The engine builds text
/// from these incrementally; the tokenizer implements this.
pub trait TokenText: Send + Sync {
    /// The raw bytes token `id` stands for (empty for special tokens that
    /// print nothing, or ids the tokenizer does not know).
    fn token_bytes(&self, id: u32) -> Vec<u8>;
}

/// When a stream stops, besides running out of context.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StopRules {
    /// Most completion tokens; `None` runs to the context limit.
    pub max_tokens: Option<usize>,
    /// Token ids that end the stream (in addition to the lane's EOS ids);
    /// always honoured.
    pub stop_ids: Vec<u32>,
    /// Strings that end the stream; the string itself is not emitted.
    pub stop_strings: Vec<String>,
    /// Ignore the lane's EOS ids (`LaneConfig::eos_ids`), as llama.cpp's
    /// `ignore_eos`. `stop_ids` still apply.
    pub ignore_eos: bool,
}

/// Turns a stream's token bytes into released text.
#[derive(Clone, Debug, Default)]
pub struct TextStops {
    stops: Vec<String>,
    /// Bytes of an incomplete UTF-8 character at the end.
    partial: Vec<u8>,
    /// Whole text not released yet: it may be the start of a stop string.
    held: String,
    stopped: bool,
}

/// What one token's bytes released.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Released {
    /// Text that can be shown now (may be empty).
    pub text: String,
    /// The index of the stop string that was completed, if one was; the
    /// stream ends, and `text` holds everything before the stop string.
    pub stop: Option<usize>,
}

impl TextStops {
    pub fn new(stop_strings: &[String]) -> TextStops {
        TextStops { stops: stop_strings.iter().filter(|s| !s.is_empty()).cloned().collect(), ..TextStops::default() }
    }

    /// Append one token's bytes.
    pub fn push(&mut self, bytes: &[u8]) -> Released {
        if self.stopped {
            return Released { text: String::new(), stop: None };
        }
        self.partial.extend_from_slice(bytes);
        decode_utf8(&mut self.partial, &mut self.held, false);

        // The earliest completed stop string wins; earlier pushes found
        // none, so any match involves text held back until now.
        let found = self.stops.iter().enumerate().filter_map(|(i, s)| self.held.find(s.as_str()).map(|at| (at, i))).min();
        if let Some((at, i)) = found {
            self.stopped = true;
            let text = self.held[..at].to_string();
            self.held.clear();
            self.partial.clear();
            return Released { text, stop: Some(i) };
        }

        let keep = self.held_suffix();
        let cut = self.held.len() - keep;
        let text = self.held[..cut].to_string();
        self.held.drain(..cut);
        Released { text, stop: None }
    }

    /// Length in bytes of the longest suffix of `held` that begins some
    /// stop string.
    fn held_suffix(&self) -> usize {
        let h = &self.held;
        let mut best = 0;
        for s in &self.stops {
            let most = (s.len() - 1).min(h.len());
            for k in (best + 1..=most).rev() {
                if s.is_char_boundary(k) && h.is_char_boundary(h.len() - k) && h.ends_with(&s[..k]) {
                    best = k;
                    break;
                }
            }
        }
        best
    }

    /// The stream ended for another reason: release everything held (an
    /// unfinished character becomes U+FFFD).
    pub fn finish(&mut self) -> String {
        if self.stopped {
            return String::new();
        }
        decode_utf8(&mut self.partial, &mut self.held, true);
        self.stopped = true;
        std::mem::take(&mut self.held)
    }
}

/// Move the decodable prefix of `bytes` into `out`. Invalid sequences
/// become U+FFFD; an incomplete character at the end stays in `bytes`
/// unless `flush`.
fn decode_utf8(bytes: &mut Vec<u8>, out: &mut String, flush: bool) {
    let mut rest: &[u8] = bytes;
    loop {
        match std::str::from_utf8(rest) {
            Ok(s) => {
                out.push_str(s);
                rest = &[];
                break;
            }
            Err(e) => {
                let (good, bad) = rest.split_at(e.valid_up_to());
                // `good` is valid by construction.
                out.push_str(std::str::from_utf8(good).unwrap_or_default());
                match e.error_len() {
                    Some(n) => {
                        out.push('\u{FFFD}');
                        rest = &bad[n..];
                    }
                    None if flush => {
                        out.push('\u{FFFD}');
                        rest = &[];
                        break;
                    }
                    None => {
                        rest = bad;
                        break;
                    }
                }
            }
        }
    }
    let keep = rest.len();
    let from = bytes.len() - keep;
    bytes.drain(..from);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(stops: &[&str], pieces: &[&[u8]]) -> (Vec<String>, Option<usize>, String) {
        let stops: Vec<String> = stops.iter().map(|s| s.to_string()).collect();
        let mut t = TextStops::new(&stops);
        let mut out = Vec::new();
        for p in pieces {
            let r = t.push(p);
            out.push(r.text);
            if r.stop.is_some() {
                return (out, r.stop, String::new());
            }
        }
        let tail = t.finish();
        (out, None, tail)
    }

    #[test]
    fn plain_text_is_released_at_once() {
        let (out, stop, tail) = run(&[], &[b"Hel", b"lo", b" world"]);
        assert_eq!(out, vec!["Hel", "lo", " world"]);
        assert_eq!(stop, None);
        assert_eq!(tail, "");
    }

    #[test]
    fn a_stop_string_across_tokens_is_held_then_cut() {
        // "END" arrives as "E" + "N" + "D"; "E" and "EN" are held back.
        let (out, stop, _) = run(&["END"], &[b"abc", b"xE", b"N", b"Dtail"]);
        assert_eq!(out, vec!["abc", "x", "", ""]);
        assert_eq!(stop, Some(0));
    }

    #[test]
    fn text_before_the_stop_in_the_same_token_is_released() {
        let (out, stop, _) = run(&["\n\n"], &[b"one\n", b"\ntwo"]);
        assert_eq!(out.concat(), "one");
        assert_eq!(stop, Some(0));
    }

    #[test]
    fn a_false_start_is_released_once_it_cannot_match() {
        let (out, stop, tail) = run(&["STOP"], &[b"ST", b"O", b"P!"]);
        // "STO" then "P!" completes STOP.
        assert_eq!(stop, Some(0));
        assert_eq!(out.concat(), "");
        assert_eq!(tail, "");
        let (out, stop, tail) = run(&["STOP"], &[b"ST", b"OR", b"Y"]);
        assert_eq!(stop, None);
        assert_eq!(out, vec!["", "STOR", "Y"]);
        assert_eq!(tail, "");
    }

    #[test]
    fn held_text_is_flushed_at_the_end() {
        let (out, stop, tail) = run(&["###"], &[b"a#", b"#"]);
        assert_eq!(stop, None);
        assert_eq!(out.concat(), "a");
        assert_eq!(tail, "##");
    }

    #[test]
    fn the_earliest_stop_string_wins() {
        let (out, stop, _) = run(&["cd", "bc"], &[b"abcd"]);
        assert_eq!(out, vec!["a"]);
        assert_eq!(stop, Some(1));
    }

    #[test]
    fn multi_byte_characters_split_over_tokens_come_out_whole() {
        // "é" = C3 A9, "€" = E2 82 AC, "😀" = F0 9F 98 80.
        let (out, _, tail) = run(&[], &[b"caf\xC3", b"\xA9 \xE2", b"\x82", b"\xAC\xF0\x9F", b"\x98\x80"]);
        assert_eq!(out, vec!["caf", "é ", "", "€", "😀"]);
        assert_eq!(tail, "");
        // Every released piece is whole text (a String), and they join up.
        assert_eq!(out.concat(), "café €😀");
    }

    #[test]
    fn a_stop_string_with_multi_byte_characters() {
        let (out, stop, _) = run(&["€!"], &[b"a\xE2\x82", b"\xAC", b"!b"]);
        assert_eq!(stop, Some(0));
        assert_eq!(out.concat(), "a");
    }

    #[test]
    fn invalid_bytes_become_replacement_characters() {
        let (out, _, tail) = run(&[], &[b"a\xFFb", b"\xE2\x82"]);
        assert_eq!(out, vec!["a\u{FFFD}b", ""]);
        assert_eq!(tail, "\u{FFFD}");
    }
}
