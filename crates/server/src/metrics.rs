//! Prometheus text exposition, written by hand (no metrics crate): request
//! counts by status, token counts, finish reasons, latency histograms, and
//! the lane's gauges. Every series carries a `model_name` label (vLLM's
//! name for it), so one dashboard can tell the models it scrapes apart.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use braid_engine::LaneStats;

/// A fixed-bucket histogram.
pub struct Histogram {
    bounds: &'static [f64],
    inner: Mutex<HistInner>,
}

#[derive(Default)]
struct HistInner {
    /// Per-bucket (not cumulative) counts; one extra for +Inf.
    counts: Vec<u64>,
    sum: f64,
    count: u64,
}

impl Histogram {
    pub fn new(bounds: &'static [f64]) -> Histogram {
        Histogram { bounds, inner: Mutex::new(HistInner { counts: vec![0; bounds.len() + 1], ..HistInner::default() }) }
    }

    pub fn observe(&self, v: f64) {
        let i = self.bounds.iter().position(|&b| v <= b).unwrap_or(self.bounds.len());
        let mut h = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        h.counts[i] += 1;
        h.sum += v;
        h.count += 1;
    }

    /// `labels`: `key="value",` pairs each series starts with (or "").
    fn render(&self, out: &mut String, labels: &str, name: &str, help: &str) {
        let h = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        let mut cum = 0;
        for (b, c) in self.bounds.iter().zip(&h.counts) {
            cum += c;
            let _ = writeln!(out, "{name}_bucket{{{labels}le=\"{b}\"}} {cum}");
        }
        let _ = writeln!(out, "{name}_bucket{{{labels}le=\"+Inf\"}} {}", h.count);
        let labels = labels.trim_end_matches(',');
        let _ = writeln!(out, "{name}_sum{{{labels}}} {}", h.sum);
        let _ = writeln!(out, "{name}_count{{{labels}}} {}", h.count);
    }
}

const LATENCY: &[f64] = &[0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0];
const DURATION: &[f64] = &[0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0];

/// Everything `/metrics` reports that the server itself measures.
pub struct Metrics {
    /// (route, status) -> count.
    requests: Mutex<BTreeMap<(&'static str, u16), u64>>,
    pub prompt_tokens: AtomicU64,
    pub generated_tokens: AtomicU64,
    pub ttft: Histogram,
    pub inter_token: Histogram,
    pub duration: Histogram,
    /// Submission to admission, per stream.
    pub queue_time: Histogram,
    /// Admission to the first token, per stream.
    pub prefill_time: Histogram,
    /// OpenAI's finish reason (and `cancelled`) -> streams.
    finish_reasons: Mutex<BTreeMap<String, u64>>,
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics {
            requests: Mutex::new(BTreeMap::new()),
            prompt_tokens: AtomicU64::new(0),
            generated_tokens: AtomicU64::new(0),
            ttft: Histogram::new(LATENCY),
            inter_token: Histogram::new(LATENCY),
            duration: Histogram::new(DURATION),
            queue_time: Histogram::new(LATENCY),
            prefill_time: Histogram::new(LATENCY),
            finish_reasons: Mutex::new(BTreeMap::new()),
        }
    }
}

impl Metrics {
    pub fn request(&self, route: &'static str, status: u16) {
        *self.requests.lock().unwrap_or_else(|e| e.into_inner()).entry((route, status)).or_default() += 1;
    }

    pub fn add_tokens(&self, prompt: usize, generated: usize) {
        self.prompt_tokens.fetch_add(prompt as u64, Ordering::Relaxed);
        self.generated_tokens.fetch_add(generated as u64, Ordering::Relaxed);
    }

    /// A stream ended with OpenAI's finish `reason` (or `cancelled`).
    pub fn finish(&self, reason: &str) {
        *self.finish_reasons.lock().unwrap_or_else(|e| e.into_inner()).entry(reason.to_string()).or_default() += 1;
    }

    /// A stream's time in the queue and in its prompt pass (`None`: it
    /// made no token).
    pub fn timing(&self, queued: Duration, prefill: Option<Duration>) {
        self.queue_time.observe(queued.as_secs_f64());
        if let Some(p) = prefill {
            self.prefill_time.observe(p.as_secs_f64());
        }
    }

    /// The whole exposition, every series labelled with `model`; `lane`
    /// is `None` while the model loads; `method` names the lane's drafter.
    pub fn render(&self, model: &str, method: Option<&str>, lane: Option<&LaneStats>) -> String {
        let mut out = String::new();
        // Label values escape `\`, `"` and newlines.
        let model = model.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n");
        let l = format!("model_name=\"{model}\",");
        let one = format!("{{model_name=\"{model}\"}}");
        out.push_str("# HELP braid_requests_total HTTP requests answered, by route and status.\n");
        out.push_str("# TYPE braid_requests_total counter\n");
        for ((route, status), n) in self.requests.lock().unwrap_or_else(|e| e.into_inner()).iter() {
            let _ = writeln!(out, "braid_requests_total{{{l}route=\"{route}\",status=\"{status}\"}} {n}");
        }
        out.push_str("# HELP braid_finished_streams_total Streams ended, by OpenAI's finish reason (cancelled: the client left or the server stopped).\n");
        out.push_str("# TYPE braid_finished_streams_total counter\n");
        for (reason, n) in self.finish_reasons.lock().unwrap_or_else(|e| e.into_inner()).iter() {
            let _ = writeln!(out, "braid_finished_streams_total{{{l}finish_reason=\"{reason}\"}} {n}");
        }
        let (counter, gauge) = (
            |out: &mut String, name: &str, help: &str, v: u64| counter(out, &one, name, help, v),
            |out: &mut String, name: &str, help: &str, v: f64| gauge(out, &one, name, help, v),
        );
        counter(&mut out, "braid_prompt_tokens_total", "Prompt tokens of accepted requests.", self.prompt_tokens.load(Ordering::Relaxed));
        counter(&mut out, "braid_generated_tokens_total", "Tokens generated.", self.generated_tokens.load(Ordering::Relaxed));
        self.ttft.render(&mut out, &l, "braid_time_to_first_token_seconds", "Time from request arrival to a stream's first token.");
        self.inter_token.render(&mut out, &l, "braid_inter_token_seconds", "Gap between consecutive tokens of one stream.");
        self.duration.render(&mut out, &l, "braid_request_duration_seconds", "Time from request arrival to its last token.");
        self.queue_time.render(&mut out, &l, "braid_queue_time_seconds", "Time a stream waited for admission.");
        self.prefill_time.render(&mut out, &l, "braid_prefill_time_seconds", "Time from a stream's admission to its first token (its prompt pass).");
        gauge(&mut out, "braid_model_loaded", "Whether the model is loaded and serving.", f64::from(u8::from(lane.is_some())));
        if let Some(l) = lane {
            gauge(&mut out, "braid_queue_depth", "Streams waiting to start.", l.queued as f64);
            gauge(&mut out, "braid_running_streams", "Streams prefilling or decoding.", (l.prefilling + l.decoding) as f64);
            let fill = &l.fill;
            gauge(&mut out, "braid_fill_used", "State memory in use (KV blocks held by streams and marks; cached blocks give way).", fill.blocks_used as f64);
            gauge(&mut out, "braid_fill_total", "State memory available (KV blocks).", fill.blocks_total as f64);
            gauge(&mut out, "braid_slots_used", "Stream state slots in use.", fill.slots_used as f64);
            if fill.window_blocks_total > 0 {
                let (used, total) = (fill.window_blocks_used as f64, fill.window_blocks_total as f64);
                gauge(
                    &mut out,
                    "braid_window_fill_used",
                    "Window KV blocks held (sliding-window layers keep only their window; cached blocks give way).",
                    used,
                );
                gauge(&mut out, "braid_window_fill_total", "Window KV blocks available (a group of their own, fewer than the KV blocks).", total);
            }
            let ratio = if fill.blocks_total > 0 { fill.blocks_used as f64 / fill.blocks_total as f64 } else { 0.0 };
            gauge(&mut out, "braid_fill_ratio", "Fraction of state memory in use.", ratio);
            counter(&mut out, "braid_prefill_chunks_total", "Prefill chunks run.", l.prefill_chunks);
            counter(&mut out, "braid_images_encoded_total", "Images whose rows the vision tower made.", l.images_encoded);
            let (name, help) = ("braid_image_encode_seconds_total", "Time the vision tower took, over every image.");
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} counter\n{name}{one} {}", l.image_encode_secs);
            counter(&mut out, "braid_prefill_tokens_total", "Prompt tokens prefilled.", l.prefill_tokens);
            counter(&mut out, "braid_cached_prompt_tokens_total", "Prompt tokens served from the prefix cache.", l.cached_tokens);
            counter(&mut out, "braid_prefix_cache_queries_total", "Prompt tokens looked up in the prefix cache.", l.prefix_query_tokens);
            counter(&mut out, "braid_prefix_cache_hits_total", "Prompt tokens found in the prefix cache (hit rate = this / queries).", l.cached_tokens);
            gauge(&mut out, "braid_prefix_cache_blocks", "KV blocks only the prefix cache holds (evicted when memory is needed).", fill.blocks_cached as f64);
            counter(&mut out, "braid_prefix_cache_evicted_blocks_total", "Cached KV blocks evicted to make room.", fill.blocks_evicted);
            gauge(&mut out, "braid_prefix_cache_marks", "Marks (state snapshots) the prefix cache holds.", l.marks as f64);
            counter(&mut out, "braid_prefix_cache_marks_kept_total", "Marks kept.", l.marks_kept);
            counter(&mut out, "braid_decode_rounds_total", "Decode rounds run.", l.decode_rounds);
            counter(
                &mut out,
                "braid_decode_batch_streams_total",
                "Streams in decode rounds, summed (mean decode batch = this / braid_decode_rounds_total).",
                l.decode_streams,
            );
            gauge(&mut out, "braid_decode_batch_max", "Largest decode round so far, in streams.", l.max_decode_batch as f64);
            let mean = if l.decode_rounds > 0 { l.decode_streams as f64 / l.decode_rounds as f64 } else { 0.0 };
            gauge(&mut out, "braid_decode_batch_mean", "Mean streams per decode round so far.", mean);
            counter(&mut out, "braid_greedy_rounds_total", "Decode rounds whose greedy tokens the backend picked (no logits moved).", l.greedy_rounds);
            counter(&mut out, "braid_top_k_rounds_total", "Decode rounds drawn from the backend's top-k candidates (no logits rows moved).", l.top_rounds);
            counter(
                &mut out,
                "braid_guided_masks_total",
                "Token masks computed for streams under a grammar (response_format, tools, grammar, regex).",
                l.guided_masks,
            );
            counter(
                &mut out,
                "braid_guided_checks_total",
                "Tokens a greedy stream under a grammar took on a one-token check, with no mask computed.",
                l.guided_checks,
            );
            counter(&mut out, "braid_guided_mask_waits_total", "Times a stream under a grammar sat out rounds waiting for its mask.", l.mask_waits);
            counter(
                &mut out,
                "braid_draw_rounds_total",
                "Decode rounds whose sampled tokens the backend drew (top-p, min-p; no logits rows moved).",
                l.draw_rounds,
            );
            counter(
                &mut out,
                "braid_itl_target_misses_total",
                "Rounds beside a prompt whose decode rows alone the pacer predicted past --itl-target (the prompt then took one row).",
                l.itl_target_misses,
            );
            counter(&mut out, "braid_rounds_over_itl_target_total", "Decode rounds whose backend call took longer than --itl-target.", l.rounds_over_target);
            counter(&mut out, "braid_lane_failures_total", "Panics the lane caught (each failed the streams running then).", l.lane_failures);
            counter(&mut out, "braid_cancelled_streams_total", "Streams cancelled before their end.", l.cancelled);
            counter(&mut out, "braid_rejected_streams_total", "Submissions the lane refused (queue full, too long, invalid).", l.rejected);
            if let Some(m) = method {
                draft_series(&mut out, &format!("model_name=\"{model}\",method=\"{m}\","), l);
            }
        }
        out
    }
}

/// The drafter's counters under `labels` (model and method): tokens
/// proposed and accepted, and each verified proposal's acceptance length
/// as a histogram (buckets 0, 1, 2, ...: tokens accepted).
fn draft_series(out: &mut String, labels: &str, l: &LaneStats) {
    let one = format!("{{{}}}", labels.trim_end_matches(','));
    counter(out, &one, "braid_draft_proposed_tokens_total", "Draft tokens verified.", l.draft_proposed);
    counter(out, &one, "braid_draft_accepted_tokens_total", "Draft tokens accepted (acceptance rate = this / proposed).", l.draft_accepted);
    let name = "braid_draft_acceptance_length";
    let _ = writeln!(out, "# HELP {name} Draft tokens accepted per verified proposal.\n# TYPE {name} histogram");
    let hist = &l.draft_accept_lengths;
    let (mut cum, mut sum) = (0u64, 0u64);
    for (i, c) in hist.iter().enumerate() {
        cum += c;
        sum += i as u64 * c;
        let _ = writeln!(out, "{name}_bucket{{{labels}le=\"{i}\"}} {cum}");
    }
    let _ = writeln!(out, "{name}_bucket{{{labels}le=\"+Inf\"}} {cum}");
    let _ = writeln!(out, "{name}_sum{one} {sum}\n{name}_count{one} {cum}");
}

fn counter(out: &mut String, labels: &str, name: &str, help: &str, v: u64) {
    let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} counter\n{name}{labels} {v}");
}

fn gauge(out: &mut String, labels: &str, name: &str, help: &str, v: f64) {
    let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} gauge\n{name}{labels} {v}");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_buckets_are_cumulative() {
        let h = Histogram::new(&[0.1, 1.0]);
        for v in [0.05, 0.5, 0.7, 3.0] {
            h.observe(v);
        }
        let mut s = String::new();
        h.render(&mut s, "m=\"a\",", "x", "help");
        assert!(s.contains("x_bucket{m=\"a\",le=\"0.1\"} 1\n"), "{s}");
        assert!(s.contains("x_bucket{m=\"a\",le=\"1\"} 3\n"), "{s}");
        assert!(s.contains("x_bucket{m=\"a\",le=\"+Inf\"} 4\n"), "{s}");
        assert!(s.contains("x_count{m=\"a\"} 4\n"), "{s}");
        assert!(s.contains("x_sum{m=\"a\"} 4.25\n"), "{s}");
    }

    #[test]
    fn requests_are_counted_by_route_and_status() {
        let m = Metrics::default();
        m.request("/v1/completions", 200);
        m.request("/v1/completions", 200);
        m.request("/v1/completions", 400);
        m.finish("stop");
        m.finish("tool_calls");
        m.finish("stop");
        let s = m.render("my \"model\"", None, None);
        assert!(s.contains("braid_requests_total{model_name=\"my \\\"model\\\"\",route=\"/v1/completions\",status=\"200\"} 2\n"), "{s}");
        assert!(s.contains("braid_requests_total{model_name=\"my \\\"model\\\"\",route=\"/v1/completions\",status=\"400\"} 1\n"), "{s}");
        assert!(s.contains("braid_finished_streams_total{model_name=\"my \\\"model\\\"\",finish_reason=\"stop\"} 2\n"), "{s}");
        assert!(s.contains("braid_model_loaded{model_name=\"my \\\"model\\\"\"} 0\n"), "{s}");
    }

    #[test]
    fn guided_counters_are_served() {
        let lane = LaneStats { guided_masks: 7, guided_checks: 40, mask_waits: 2, ..LaneStats::default() };
        let s = Metrics::default().render("m", None, Some(&lane));
        for (name, n) in [("braid_guided_masks_total", 7), ("braid_guided_checks_total", 40), ("braid_guided_mask_waits_total", 2)] {
            assert!(s.contains(&format!("{name}{{model_name=\"m\"}} {n}\n")), "{name}: {s}");
        }
    }

    #[test]
    fn draft_counters_and_acceptance_lengths_carry_the_method() {
        let m = Metrics::default();
        let lane = LaneStats { draft_proposed: 9, draft_accepted: 5, draft_accept_lengths: vec![1, 0, 2, 1], ..LaneStats::default() };
        let s = m.render("m", Some("ngram"), Some(&lane));
        let l = "model_name=\"m\",method=\"ngram\"";
        assert!(s.contains(&format!("braid_draft_proposed_tokens_total{{{l}}} 9\n")), "{s}");
        assert!(s.contains(&format!("braid_draft_accepted_tokens_total{{{l}}} 5\n")), "{s}");
        for (le, n) in [("0", 1), ("1", 1), ("2", 3), ("3", 4), ("+Inf", 4)] {
            assert!(s.contains(&format!("braid_draft_acceptance_length_bucket{{{l},le=\"{le}\"}} {n}\n")), "{le}: {s}");
        }
        assert!(s.contains(&format!("braid_draft_acceptance_length_sum{{{l}}} 7\n")), "{s}");
        assert!(s.contains(&format!("braid_draft_acceptance_length_count{{{l}}} 4\n")), "{s}");
        // No drafter, no draft series.
        assert!(!m.render("m", None, Some(&lane)).contains("braid_draft"));
    }
}
