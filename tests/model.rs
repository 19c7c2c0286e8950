//! The forward pass against an independent, straightforward implementation written here (f64,
//! dequantized weights, full attention over the history), and the packed-batch invariants.

mod common;

use common::naive::naive_logprobs;
use common::{write_tiny, TinySpec};
use flywheel::kernels::{reference, Cpu, Isa, ThreadPool};
use flywheel::model::decoder::{BatchSeq, Decoder, Logits};
use flywheel::model::gguf::Gguf;
use flywheel::model::kv_cache::{BlockAllocator, KvCache};
use std::time::Duration;

fn cpu(isa: Isa) -> Cpu {
    Cpu::new(isa, ThreadPool::new(2, Duration::from_micros(50)))
}

fn run_all(model: &Decoder, cpu: &Cpu, tokens: &[u32]) -> Vec<Vec<f32>> {
    common::logprobs_all(model, cpu, tokens, None)
}

fn min_lp(b: &[Vec<f64>]) -> f64 {
    b.iter().flatten().cloned().fold(0.0, f64::min)
}

fn max_diff(a: &[Vec<f32>], b: &[Vec<f64>]) -> f64 {
    a.iter()
        .zip(b)
        .flat_map(|(x, y)| x.iter().zip(y).map(|(p, q)| (*p as f64 - q).abs()))
        .fold(0.0, f64::max)
}

#[test]
fn reference_kernels_match_the_naive_implementation() {
    for spec in TinySpec::families()
        .into_iter()
        .chain([TinySpec::k_quants(), TinySpec::q5()])
    {
        let (_dir, path) = write_tiny(&spec);
        let tokens: Vec<u32> = (0..19).map(|i| (i * 37 + 5) % 250 + 3).collect();
        let want = naive_logprobs(&path, &tokens);
        let model = Decoder::open(&path).unwrap();
        let got = run_all(&model, &cpu(Isa::Reference), &tokens);
        let d = max_diff(&got, &want);
        eprintln!(
            "{} hidden {}: reference vs naive max |Δ log-prob| {d:.2e}, range {:.1}",
            spec.arch,
            spec.hidden,
            min_lp(&want)
        );
        assert!(
            d < 2e-5,
            "reference forward vs naive: max |Δ log-prob| = {d}"
        );
    }
}

#[test]
fn fast_kernels_match_the_naive_implementation() {
    for spec in TinySpec::families()
        .into_iter()
        .chain([TinySpec::k_quants(), TinySpec::q5()])
    {
        let (_dir, path) = write_tiny(&spec);
        let tokens: Vec<u32> = (0..40).map(|i| (i * 53 + 1) % 250 + 3).collect();
        let want = naive_logprobs(&path, &tokens);
        let model = Decoder::open(&path).unwrap();
        for isa in Isa::available() {
            let d = max_diff(&run_all(&model, &cpu(isa), &tokens), &want);
            eprintln!(
                "{} hidden {}: {isa:?} vs naive max |Δ log-prob| {d:.2e}, range {:.1}",
                spec.arch,
                spec.hidden,
                min_lp(&want)
            );
            // Budget: f32 accumulation (the reference sums in f64) over log-probs down to about -20.
            assert!(d < 1e-4, "{isa:?} forward vs naive: max |Δ log-prob| = {d}");
        }
    }
}

/// Two sequences in one packed batch, one of them prefilled in two chunks, give the same logits
/// as each sequence run alone in one go.
#[test]
fn packed_batches_and_chunked_prefill_agree_exactly_with_single_runs() {
    for spec in TinySpec::families() {
        packed_equals_single(&spec);
    }
}

fn packed_equals_single(spec: &TinySpec) {
    let (_dir, path) = write_tiny(spec);
    let model = Decoder::open(&path).unwrap();
    let c = cpu(Isa::detect());
    let a: Vec<u32> = (0..23).map(|i| (i * 7 + 3) % 250 + 3).collect();
    let b: Vec<u32> = (0..9).map(|i| (i * 11 + 1) % 250 + 3).collect();
    let alone_a = run_all(&model, &c, &a);
    let alone_b = run_all(&model, &c, &b);

    let bs = 4;
    let mut cache = KvCache::new(model.config.num_layers, model.config.kv_dim(), bs, 32);
    let mut alloc = BlockAllocator::new(32);
    let (mut ta, mut tb) = (Vec::new(), Vec::new());
    alloc.ensure(&mut tb, b.len(), bs);
    alloc.ensure(&mut ta, a.len(), bs);
    let v = model.config.vocab_size;
    // Step 1: a's first 10 tokens and all of b.
    let l1 = model
        .forward(
            &c,
            &mut cache,
            &[
                BatchSeq {
                    tokens: &a[..10],
                    first_pos: 0,
                    block_table: &ta,
                    window_table: &[],
                    logits: Logits::All,
                    adapter: None,
                },
                BatchSeq {
                    tokens: &b,
                    first_pos: 0,
                    block_table: &tb,
                    window_table: &[],
                    logits: Logits::Last,
                    adapter: None,
                },
            ],
        )
        .unwrap();
    // Step 2: the rest of a.
    let l2 = model
        .forward(
            &c,
            &mut cache,
            &[BatchSeq {
                tokens: &a[10..],
                first_pos: 10,
                block_table: &ta,
                window_table: &[],
                logits: Logits::All,
                adapter: None,
            }],
        )
        .unwrap();
    let rows: Vec<Vec<f32>> = l1
        .chunks(v)
        .chain(l2.chunks(v))
        .map(|r| r.to_vec())
        .collect();
    let lsm = |mut r: Vec<f32>| {
        reference::log_softmax(&mut r);
        r
    };
    for i in 0..10 {
        assert_close(&lsm(rows[i].clone()), &alone_a[i], "a, first chunk");
    }
    assert_close(&lsm(rows[10].clone()), &alone_b[b.len() - 1], "b");
    for i in 10..a.len() {
        assert_close(&lsm(rows[i + 1].clone()), &alone_a[i], "a, second chunk");
    }
}

/// Equal to the bit: the kernels are batch-invariant (see `kernels/src/cpu/matmul.rs`), so a
/// sequence's logits do not depend on what it is batched with or how its prompt is chunked.
fn assert_close(a: &[f32], b: &[f32], what: &str) {
    let d = a
        .iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0f32, f32::max);
    assert!(
        a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits()),
        "{what}: not bitwise equal (max diff {d})"
    );
}

#[test]
fn bad_batches_are_errors_not_panics() {
    let (_dir, path) = write_tiny(&TinySpec::small());
    let model = Decoder::open(&path).unwrap();
    let c = cpu(Isa::detect());
    let mut cache = KvCache::new(model.config.num_layers, model.config.kv_dim(), 4, 4);
    let table = [0u32, 1];
    let too_long: Vec<u32> = vec![5; 9];
    let cases: Vec<(Vec<u32>, usize, &str)> = vec![
        (vec![], 0, "no tokens"),
        (too_long, 0, "block table"),
        (vec![100_000], 0, "vocabulary"),
        (vec![5], 300, "context"),
    ];
    for (toks, first_pos, msg) in cases {
        let e = model
            .forward(
                &c,
                &mut cache,
                &[BatchSeq {
                    tokens: &toks,
                    first_pos,
                    block_table: &table,
                    window_table: &[],
                    logits: Logits::Last,
                    adapter: None,
                }],
            )
            .unwrap_err()
            .to_string();
        assert!(e.contains(msg), "{e} should mention {msg}");
    }
}

#[test]
fn incremental_detokenization_equals_whole_decoding_even_on_invalid_utf8() {
    use flywheel::model::tokenizer::{Detokenizer, Tokenizer};
    let (_d, path) = write_tiny(&TinySpec::small());
    let tok = Tokenizer::from_gguf(&Gguf::open(&path).unwrap()).unwrap();
    let mut rng = common::Rng(5);
    for _ in 0..200 {
        // Byte tokens are ids 3..259: random runs make valid, invalid and split characters.
        let ids: Vec<u32> = (0..12).map(|_| 3 + (rng.next() % 259) as u32).collect();
        let mut d = Detokenizer::default();
        let mut text: String = ids.iter().map(|&i| d.push(&tok, i)).collect();
        text.push_str(&d.finish());
        assert_eq!(text, tok.decode(&ids), "{ids:?}");
    }
}

/// Gemma 2's soft-caps: the file's keys where it has them (0 turns one off), llama.cpp's 50 and
/// 30 where it does not (and its window of 4096); no other family caps unless its file says. The tiny Gemma 2's caps bend
/// its scores and logits (so the families' comparisons with the naive forward and llama.cpp
/// would fail without them).
#[test]
fn gemma2_soft_caps_and_window_come_from_the_file_or_the_family() {
    let caps = |spec: &TinySpec| {
        let (_dir, path) = write_tiny(spec);
        let c = Decoder::open(&path).unwrap().config;
        (c.attn_softcap, c.final_softcap)
    };
    let gemma2 = TinySpec::gemma2();
    assert_eq!(caps(&gemma2), (Some(0.5), Some(2.0)));
    let defaults = TinySpec {
        softcaps: None,
        ..gemma2
    };
    assert_eq!(caps(&defaults), (Some(50.0), Some(30.0)));
    let off = TinySpec {
        softcaps: Some((0.0, 0.0)),
        ..gemma2
    };
    assert_eq!(caps(&off), (None, None));
    assert_eq!(caps(&TinySpec::gemma3()), (None, None));
    let gemma3_capped = TinySpec {
        softcaps: Some((0.5, 2.0)),
        ..TinySpec::gemma3()
    };
    assert_eq!(caps(&gemma3_capped), (Some(0.5), Some(2.0)));
    // Without `attention.sliding_window`, Gemma 2's window is llama.cpp's 4096; Gemma 3's file
    // must say (none: every layer global).
    let window = |spec: &TinySpec| {
        let (_dir, path) = write_tiny(spec);
        Decoder::open(&path).unwrap().config.sliding_window
    };
    assert_eq!(window(&gemma2), Some(5));
    assert_eq!(
        window(&TinySpec {
            window: None,
            ..gemma2
        }),
        Some(4096)
    );
    let gemma3 = TinySpec {
        window: None,
        ..TinySpec::gemma3()
    };
    assert_eq!(window(&gemma3), None);
    // The caps matter on this model: exact math with and without them differs.
    let tokens: Vec<u32> = (0..12).map(|i| (i * 37 + 5) % 250 + 3).collect();
    let (_d1, capped) = write_tiny(&gemma2);
    let (_d2, uncapped) = write_tiny(&off);
    let d = max_diff_f64(
        &naive_logprobs(&capped, &tokens),
        &naive_logprobs(&uncapped, &tokens),
    );
    assert!(
        d > 0.1,
        "the tiny Gemma 2's caps move its log-probs by only {d}"
    );
}

fn max_diff_f64(a: &[Vec<f64>], b: &[Vec<f64>]) -> f64 {
    a.iter()
        .zip(b)
        .flat_map(|(x, y)| x.iter().zip(y).map(|(p, q)| (p - q).abs()))
        .fold(0.0, f64::max)
}
