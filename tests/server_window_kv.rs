//! KV sized by the window: a model's sliding-window layers keep their K/V in a pool of their own,
//! and a sequence gives back the blocks before its window as it advances. Served through it, a
//! Gemma 3 (and a Gemma 2) answers with the same tokens and log-probs, to the bit, as with every
//! position kept: long prompts prefilled in chunks, several choices sharing their prompt, a
//! prompt served again from the prefix cache, sequences running side by side.

mod common;

use common::server::*;
use common::{write_tiny, TinySpec};
use serde_json::{json, Value};

/// `max_num_seqs` decides it: 2 sequences' windows are far less than what the global layers'
/// share of 1 MiB gives (a window pool); 64 sequences' are not (none: every layer global).
fn config(max_num_seqs: usize) -> String {
    format!(
        "[server]\nserved_model_name = \"tiny\"\n[engine]\nkv_cache_mb = 1\nblock_size = 16\n\
         max_num_batched_tokens = 24\nmax_num_seqs = {max_num_seqs}\n"
    )
}

/// Each request's tokens and log-probs, in order.
fn answers(s: &Server) -> Vec<Value> {
    let long: String = (0..40).map(|i| format!("w{} ", i * 7 % 13)).collect();
    let mut out = Vec::new();
    for (prompt, n, seed) in [(&long, 1, 0), (&long, 3, 1), (&long, 1, 0)] {
        let b = json!({"model": "tiny", "prompt": prompt, "max_tokens": 40, "n": n, "seed": seed,
                       "temperature": if n == 1 { 0.0 } else { 1.0 }, "logprobs": 1,
                       "ignore_eos": true});
        let r = s.post("/v1/completions", &b);
        assert_eq!(r.status, 200, "{}", r.body_text());
        for c in r.json()["choices"].as_array().unwrap() {
            out.push(json!([c["text"], c["logprobs"]["token_logprobs"]]));
        }
    }
    // Two at once, in a batch.
    let threads: Vec<_> = (0..2)
        .map(|i| {
            let b = json!({"model": "tiny", "prompt": format!("{long} x{i}"), "max_tokens": 30,
                           "temperature": 0.0, "logprobs": 1, "ignore_eos": true});
            let c = Server::client_for(&s.addr);
            std::thread::spawn(move || c.post("/v1/completions", &b).json())
        })
        .collect();
    for t in threads {
        let r = t.join().unwrap();
        let c = &r["choices"][0];
        out.push(json!([c["text"], c["logprobs"]["token_logprobs"]]));
    }
    out
}

#[test]
fn window_sized_kv_serves_the_same_bits_as_the_full_cache() {
    for spec in [TinySpec::gemma3(), TinySpec::gemma2()] {
        let (_d, path) = write_tiny(&TinySpec { ctx: 512, ..spec });
        let pooled = Server::start(&path, &config(2), &[]);
        let full = Server::start(&path, &config(64), &[]);
        let (a, b) = (answers(&pooled), answers(&full));
        assert_eq!(a.len(), 7);
        assert_eq!(a, b, "{}", spec.arch);
        // The pool was there, and its blocks were given back as the sequences advanced.
        let log = pooled.stderr();
        assert!(
            log.contains("sliding-window layers (window 5) keep"),
            "{log}"
        );
        assert!(!full.stderr().contains("sliding-window layers"));
        assert!(pooled.metric("flywheel_kv_cache_window_blocks") > 0.0);
        assert_eq!(full.metric("flywheel_kv_cache_window_blocks"), 0.0);
        // Every sequence ended: nothing of either pool is held.
        wait_for_no_blocks(&pooled);
        assert_eq!(pooled.metric("flywheel_kv_cache_window_blocks_used"), 0.0);
        // The repeated prompt hit the prefix cache (window blocks included) at least as much as
        // without the pool (whose global layers have less room to keep blocks cached).
        let hits = |s: &Server| s.metric("flywheel_prefix_cache_hits_total");
        assert!(hits(&pooled) > 0.0 && hits(&pooled) >= hits(&full));
    }
}
