//! A lane's counters and gauges.

use crate::backend::Fill;

/// Counters and gauges of one lane.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct LaneStats {
    /// Streams waiting for admission (including submissions in transit).
    pub queued: usize,
    pub prefilling: usize,
    pub decoding: usize,
    /// The backend's fill after the last round (default if not reported).
    pub fill: Fill,
    /// Marks held by the prefix cache (backends that cache KV blocks
    /// report theirs in `fill`).
    pub marks: usize,
    pub submitted: u64,
    /// Submissions refused (invalid, too long, queue full).
    pub rejected: u64,
    pub admitted: u64,
    /// Streams that ended with Stop or Length (or a warm feed completed).
    pub finished: u64,
    /// Streams cancelled, left, or cut by shutdown.
    pub cancelled: u64,
    /// Streams that ended with an error.
    pub errors: u64,
    /// Panics the lane caught (each failed the streams running then).
    pub lane_failures: u64,
    pub prefill_chunks: u64,
    pub prefill_tokens: u64,
    /// Prompt tokens looked up in the prefix cache (every prompt's whole
    /// length, while the cache is on).
    pub prefix_query_tokens: u64,
    /// Prompt tokens served from the prefix cache (hits).
    pub cached_tokens: u64,
    /// Passes stopped between chunks for lack of memory.
    pub prefill_pauses: u64,
    /// Images whose rows were made, and the time that took.
    pub images_encoded: u64,
    pub image_encode_secs: f64,
    /// Rounds with decode rows (with or without a prompt chunk).
    pub decode_rounds: u64,
    /// Decode rounds that carried a prompt chunk in the same forward.
    pub fused_rounds: u64,
    /// Decode rounds picked by argmax on the backend (no logits moved).
    pub greedy_rounds: u64,
    /// Decode rounds picked by top-k on the backend, tokens drawn from the
    /// candidates (k values a row moved, not the row).
    pub top_rounds: u64,
    /// Decode rounds whose sampled tokens the backend drew (no logits rows
    /// moved).
    pub draw_rounds: u64,
    /// Seconds spent in plain decode rounds (no chunk; the backend call alone).
    pub plain_round_secs: f64,
    pub plain_rounds: u64,
    /// The longest plain round and the longest fused one (backend calls).
    pub longest_plain_round_secs: f64,
    pub longest_fused_round_secs: f64,
    /// Rounds with a prompt chunk whose decode rows alone the pacer's cost
    /// model predicted past `itl_target` (the chunk then took one row).
    pub itl_target_misses: u64,
    /// Rounds with decode rows whose backend call took longer than
    /// `itl_target`.
    pub rounds_over_target: u64,
    /// Streams in decode rounds, summed (÷ rounds = mean batch).
    pub decode_streams: u64,
    /// Token rows in decode rounds, summed (drafts included).
    pub decode_rows: u64,
    pub max_decode_batch: usize,
    /// Tokens sampled (first tokens included).
    pub generated_tokens: u64,
    pub draft_proposed: u64,
    pub draft_accepted: u64,
    /// Verified proposals by how many of their tokens were accepted
    /// (index 0: none; the last index counts that many or more).
    pub draft_accept_lengths: Vec<u64>,
    /// Masks computed for guided streams (drafted rows' included).
    pub guided_masks: u64,
    /// Tokens a guided stream that checks first took without a mask (its
    /// grammar took its argmax).
    pub guided_checks: u64,
    /// Times a guided stream's rows waited for their masks (it sat out
    /// rounds while the others went on).
    pub mask_waits: u64,
    pub marks_kept: u64,
    pub marks_dropped: u64,
    /// Completed loop iterations.
    pub rounds: u64,
}
