//! Paged attention against the scalar reference: every block size, grouping and head dim the
//! kernels take (and the scalar fallback), sliding windows, Gemma 2's soft-capping, batch
//! invariance, and the f16 KV cache (over halves, the same bits as over the same values in f32).

mod common;

use common::{cpu, fast_isas, Rng};
use flywheel_kernels::cpu::ops;
use flywheel_kernels::reference::{self, AttnOpts, AttnSeq, PagedKv, F16};
use flywheel_kernels::Isa;

#[test]
fn paged_attention_matches_reference() {
    // Block size 16 takes the vector path (whole blocks of keys per FMA); 4 and 24 the others.
    for bs in [4usize, 16, 24] {
        // (heads, KV heads, head dim): groups of 3, 8 (two chunks of 4), 1, 4 (chunks of 3 and 1
        // at 8 vectors per head); head dims of 1, 2, 3, 4 and 8 AVX-512 vectors. Block sizes 4
        // and 24 (not whole vectors) take the scalar fallback.
        for (n_heads, n_kv, hd) in [
            (6, 2, 64),
            (8, 1, 32),
            (10, 10, 16),
            (4, 2, 48),
            (4, 1, 128),
        ] {
            // Full causal attention, and sliding windows (one key; a window inside a block; one
            // spanning blocks).
            for window in [None, Some(1), Some(3), Some(19)] {
                paged_attention_case(bs, n_heads, n_kv, hd, window.into());
            }
            // Soft-capped scores (Gemma 2), with and without a window: a cap near the scores'
            // size bends them (a missing or misplaced cap fails the comparison).
            for window in [None, Some(3)] {
                let opts = AttnOpts {
                    window,
                    softcap: Some(0.3),
                };
                paged_attention_case(bs, n_heads, n_kv, hd, opts);
            }
        }
    }
}

/// An f16 KV cache: the attention over halves equals, to the bit, the attention over the same
/// values as f32 (the loads widen exactly), on every ISA and shape; and the F16C rounding is the
/// scalar one's, bit for bit (ties, subnormals, overflow, signed zeros).
#[test]
fn f16_kv_attention_is_the_f32_attention_of_the_rounded_values() {
    let mut rng = Rng(41);
    let mut edge: Vec<f32> = vec![
        0.0,
        -0.0,
        1.0,
        -1.0,
        65504.0,
        65520.0,
        1e6,
        -1e6,
        6.1e-5,
        5.96e-8,
        2.98e-8,
        1e-9,
        1.000_488_3,
        1.000_976_6,
        0.333_333_34,
        f32::INFINITY,
        f32::NEG_INFINITY,
    ];
    edge.extend(rng.vec(1003, 10.0));
    for isa in std::iter::once(Isa::Reference).chain(fast_isas()) {
        let mut x = edge.clone();
        let mut h = vec![F16::default(); x.len()];
        ops::round_to_f16(isa, &mut x, &mut h);
        for (i, (&r, &b)) in x.iter().zip(&h).enumerate() {
            let want = flywheel_kernels::quant::f32_to_f16(edge[i]);
            assert_eq!(b.0, want, "{isa:?} {}", edge[i]);
            assert_eq!(
                r.to_bits(),
                flywheel_kernels::quant::f16_to_f32(want).to_bits()
            );
        }
    }
    let (bs, n_heads, n_kv, hd) = (16usize, 6usize, 2usize, 64usize);
    let kv_dim = n_kv * hd;
    let num_blocks = 6;
    let mut k = rng.vec(num_blocks * bs * kv_dim, 1.0);
    let mut v = rng.vec(num_blocks * bs * kv_dim, 1.0);
    let (mut k16, mut v16) = (vec![F16::default(); k.len()], vec![F16::default(); v.len()]);
    ops::round_to_f16(Isa::Reference, &mut k, &mut k16);
    ops::round_to_f16(Isa::Reference, &mut v, &mut v16);
    let table: Vec<u32> = (0..num_blocks as u32).rev().collect();
    let seqs = [AttnSeq {
        q_start: 0,
        q_len: 70,
        first_pos: 0,
        block_table: &table,
    }];
    let q = rng.vec(70 * n_heads * hd, 1.0);
    let wide = PagedKv {
        k: &k,
        v: &v,
        block_size: bs,
        kv_dim,
    };
    let half = PagedKv {
        k: &k16,
        v: &v16,
        block_size: bs,
        kv_dim,
    };
    for window in [None, Some(5)] {
        let mut a = vec![0.0; q.len()];
        let mut b = vec![0.0; q.len()];
        reference::attention_windowed(&q, &mut a, &seqs, wide, n_heads, n_kv, hd, 0.125, window);
        reference::attention_windowed(&q, &mut b, &seqs, half, n_heads, n_kv, hd, 0.125, window);
        assert_eq!(a, b);
        for isa in fast_isas() {
            let c = cpu(isa, 2);
            c.attention_windowed(&q, &mut a, &seqs, wide, n_heads, n_kv, hd, 0.125, window);
            c.attention_windowed(&q, &mut b, &seqs, half, n_heads, n_kv, hd, 0.125, window);
            assert_eq!(a, b, "{isa:?} {window:?}");
            // The scalar fallback (a block size that is not whole vectors) too.
            let odd_wide = PagedKv {
                block_size: 8,
                ..wide
            };
            let odd_half = PagedKv {
                block_size: 8,
                ..half
            };
            let table8: Vec<u32> = (0..(num_blocks * 2) as u32).collect();
            let s8 = [AttnSeq {
                block_table: &table8,
                ..seqs[0]
            }];
            c.attention_windowed(&q, &mut a, &s8, odd_wide, n_heads, n_kv, hd, 0.125, window);
            c.attention_windowed(&q, &mut b, &s8, odd_half, n_heads, n_kv, hd, 0.125, window);
            assert_eq!(a, b, "{isa:?} {window:?} block 8");
        }
    }
}

fn paged_attention_case(bs: usize, n_heads: usize, n_kv: usize, hd: usize, opts: AttnOpts) {
    let window = opts.window;
    let mut rng = Rng(6 + bs as u64);
    let kv_dim = n_kv * hd;
    let num_blocks = 160 / bs + 8;
    let k = rng.vec(num_blocks * bs * kv_dim, 1.0);
    let v = rng.vec(num_blocks * bs * kv_dim, 1.0);
    let kv = PagedKv {
        k: &k,
        v: &v,
        block_size: bs,
        kv_dim,
    };
    // Scattered blocks: one sequence prefilling 21 tokens from position 0, one decoding 1 token
    // at position 37, one continuing a chunk of 5 at position 9.
    let need = |n: usize| n.div_ceil(bs);
    let t1: Vec<u32> = (0..need(21))
        .map(|i| (num_blocks - 1 - 2 * i) as u32)
        .collect();
    let t2: Vec<u32> = (0..need(38)).map(|i| (2 * i) as u32).collect();
    let t3: Vec<u32> = (0..need(14))
        .map(|i| (num_blocks - 2 - 2 * i) as u32)
        .collect();
    let seqs = [
        AttnSeq {
            q_start: 0,
            q_len: 21,
            first_pos: 0,
            block_table: &t1,
        },
        AttnSeq {
            q_start: 21,
            q_len: 1,
            first_pos: 37,
            block_table: &t2,
        },
        AttnSeq {
            q_start: 22,
            q_len: 5,
            first_pos: 9,
            block_table: &t3,
        },
    ];
    let num_tokens = 27;
    let q = rng.vec(num_tokens * n_heads * hd, 1.0);
    let mut want = vec![0.0; q.len()];
    reference::attention_windowed(&q, &mut want, &seqs, kv, n_heads, n_kv, hd, 0.125, opts);
    if let Some(cap) = opts.softcap {
        // The cap changes the result (it is applied).
        let mut uncapped = vec![0.0; q.len()];
        reference::attention_windowed(
            &q,
            &mut uncapped,
            &seqs,
            kv,
            n_heads,
            n_kv,
            hd,
            0.125,
            window,
        );
        let moved = want
            .iter()
            .zip(&uncapped)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0, f32::max);
        assert!(moved > 1e-3, "a soft-cap of {cap} moved nothing ({moved})");
    }
    if let Some(w) = window {
        // The windowed reference is the full one over the window's keys alone: a sequence
        // whose block table starts at its window (positions shifted by whole blocks).
        let i = 20; // the prefill's last query, position 20
        let skip = (i + 1 - w.min(i + 1)) / bs;
        let shifted = [AttnSeq {
            q_start: i,
            q_len: 1,
            first_pos: i - skip * bs,
            block_table: &t1[skip..],
        }];
        let mut full = vec![0.0; q.len()];
        if (i + 1 - w.min(i + 1)).is_multiple_of(bs) {
            let capped = AttnOpts {
                window: None,
                ..opts
            };
            reference::attention_windowed(
                &q, &mut full, &shifted, kv, n_heads, n_kv, hd, 0.125, capped,
            );
            let qdim = n_heads * hd;
            assert_eq!(
                &full[i * qdim..(i + 1) * qdim],
                &want[i * qdim..(i + 1) * qdim]
            );
        }
    }
    for isa in fast_isas() {
        for threads in [1, 2] {
            let c = cpu(isa, threads);
            let mut got = vec![f32::NAN; q.len()];
            c.attention_windowed(&q, &mut got, &seqs, kv, n_heads, n_kv, hd, 0.125, opts);
            for i in 0..q.len() {
                assert!(
                    (got[i] - want[i]).abs() < 2e-6,
                    "bs={bs} heads={n_heads}/{n_kv} hd={hd} {isa:?} t={threads} {opts:?} i={i}: {} vs {}",
                    got[i],
                    want[i]
                );
            }
            // Batch invariance: each query of the 21-token chunk, computed alone (as a decode
            // step would), gives the same bits as inside the chunk.
            let qdim = n_heads * hd;
            for i in 0..21 {
                let one = [AttnSeq {
                    q_start: 0,
                    q_len: 1,
                    first_pos: i,
                    block_table: &t1,
                }];
                let mut alone = vec![f32::NAN; qdim];
                c.attention_windowed(
                    &q[i * qdim..(i + 1) * qdim],
                    &mut alone,
                    &one,
                    kv,
                    n_heads,
                    n_kv,
                    hd,
                    0.125,
                    opts,
                );
                let chunk = &got[i * qdim..(i + 1) * qdim];
                assert!(
                    alone.iter().zip(chunk).all(|(a, b)| a.to_bits() == b.to_bits()),
                    "bs={bs} heads={n_heads}/{n_kv} hd={hd} {isa:?} query {i}: alone differs from in the chunk"
                );
            }
        }
    }
}
