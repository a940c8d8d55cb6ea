//! Client-sent values as they may appear in a log line or an error body:
//! control characters escaped (no forged lines, no binary logs) and cut to
//! a bounded length (no multi-megabyte echoes).

/// Most characters of a client value written out.
pub const MAX_SHOWN: usize = 64;

/// `s` with control characters (and the backslash, so the result reads
/// unambiguously) escaped, at most [`MAX_SHOWN`] characters of it,
/// `…` marking a cut.
pub fn clip(s: &str) -> String {
    clip_to(s, MAX_SHOWN)
}

/// [`clip`] to `max` characters (an error message that quotes a value).
pub fn clip_to(s: &str, max: usize) -> String {
    let mut out = String::with_capacity(s.len().min(max * 2));
    for (i, c) in s.chars().enumerate() {
        if i == max {
            out.push('…');
            break;
        }
        // Line and paragraph separators break lines in some log viewers.
        if c.is_control() || c == '\\' || c == '\u{2028}' || c == '\u{2029}' {
            out.extend(c.escape_default());
        } else {
            out.push(c);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn escapes_and_cuts() {
        assert_eq!(clip("gpt-4o"), "gpt-4o");
        assert_eq!(clip("a\nINFO forged\0"), "a\\nINFO forged\\u{0}");
        let long = "x".repeat(10_000);
        assert_eq!(clip(&long).chars().count(), MAX_SHOWN + 1);
        assert!(clip(&long).ends_with('…'));
    }
}
