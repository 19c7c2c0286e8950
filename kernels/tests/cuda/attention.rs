//! Paged attention and the cache writer against the CPU's, on random page tables.

use super::{close, gpu};
use crate::common::{packed_seqs, scattered_tables, seq, Rng, LONG_SHAPES};
use flywheel_kernels::cuda::{att_chunks, AttentionKernel, ChunkLaunch, Gpu, GpuKv};
use flywheel_kernels::quant::{f16_to_f32, f32_to_f16};
use flywheel_kernels::reference::{self, AttnOpts, PagedKv, F16};

/// The cache writes (the same bits as the CPU's layout, halves rounded as the CPU rounds them)
/// and paged attention against the reference on scattered page tables: prefill, decode, a chunk
/// continuing, sliding windows, GQA groups, head dims that are and are not multiples of 32.
#[test]
fn paged_attention_and_cache_writes_match_the_cpu() {
    let Some(g) = gpu() else { return };
    for (n_heads, n_kv, hd) in [(8, 2, 64), (4, 4, 128), (6, 1, 80), (2, 1, 256)] {
        for window in [None, Some(1), Some(19)] {
            attention_case::<f32>(&g, 16, n_heads, n_kv, hd, window.into());
            attention_case::<u16>(&g, 16, n_heads, n_kv, hd, window.into());
        }
        // Gemma 2's soft-capped scores, with and without a window.
        for window in [None, Some(19)] {
            let opts = AttnOpts {
                window,
                softcap: Some(0.3),
            };
            attention_case::<f32>(&g, 16, n_heads, n_kv, hd, opts);
        }
    }
    attention_case::<u16>(&g, 32, 8, 2, 64, None.into());
    attention_case::<f32>(&g, 7, 8, 2, 64, Some(9).into());
}

fn attention_case<E: GpuKv>(
    g: &Gpu,
    bs: usize,
    n_heads: usize,
    n_kv: usize,
    hd: usize,
    window: AttnOpts,
) {
    let half = E::NAME == "f16";
    let mut rng = Rng(17 + hd as u64);
    let kv_dim = n_kv * hd;
    let n_blocks = 200 / bs + 12;
    // Three sequences on scattered blocks: a prefill of 21 from 0, a decode at 37, a chunk of 5
    // from 9 (as tests/attention.rs).
    let need = |n: usize| n.div_ceil(bs);
    let t1: Vec<u32> = (0..need(21))
        .map(|i| (n_blocks - 1 - 2 * i) as u32)
        .collect();
    let t2: Vec<u32> = (0..need(38)).map(|i| (2 * i) as u32).collect();
    let t3: Vec<u32> = (0..need(14))
        .map(|i| (n_blocks - 2 - 2 * i) as u32)
        .collect();
    // The whole context of each, written through the GPU's cache writer.
    let ctx = [seq(0, 21, 0, &t1), seq(21, 38, 0, &t2), seq(59, 14, 0, &t3)];
    let n_ctx = 73;
    let k = rng.vec(n_ctx * kv_dim, 1.0);
    let v = rng.vec(n_ctx * kv_dim, 1.0);
    let cache_len = n_blocks * bs * kv_dim;
    let mut kc = g.zeros::<E>(cache_len).unwrap();
    let mut vc = g.zeros::<E>(cache_len).unwrap();
    let toks = g.tokens(&ctx, bs, n_blocks).unwrap();
    let (dk, dv) = (g.upload(&k).unwrap(), g.upload(&v).unwrap());
    g.kv_write(&dk, &dv, &toks, kv_dim, &mut kc, &mut vc)
        .unwrap();
    // The CPU's layout of the same writes.
    let round = |x: f32| if half { f16_to_f32(f32_to_f16(x)) } else { x };
    let mut want_k = vec![0f32; cache_len];
    let mut want_v = vec![0f32; cache_len];
    let layout = PagedKv::<f32> {
        k: &[],
        v: &[],
        block_size: bs,
        kv_dim,
    };
    for s in &ctx {
        for i in 0..s.q_len {
            let t = s.q_start + i;
            for c in 0..kv_dim {
                want_k[layout.k_index(s.block_table, i, c)] = round(k[t * kv_dim + c]);
                want_v[layout.v_offset(s.block_table, i) + c] = round(v[t * kv_dim + c]);
            }
        }
    }
    let as_f32 = |x: Vec<E>| -> Vec<f32> {
        // SAFETY: E is f32 or u16 (GpuKv's two implementations), read as what it is.
        if half {
            x.iter()
                .map(|e| f16_to_f32(unsafe { *(e as *const E as *const u16) }))
                .collect()
        } else {
            x.iter()
                .map(|e| unsafe { *(e as *const E as *const f32) })
                .collect()
        }
    };
    let got_k = as_f32(g.download(&kc).unwrap());
    let got_v = as_f32(g.download(&vc).unwrap());
    assert!(
        got_k
            .iter()
            .zip(&want_k)
            .all(|(a, b)| a.to_bits() == b.to_bits()),
        "K cache ({})",
        E::NAME
    );
    assert!(
        got_v
            .iter()
            .zip(&want_v)
            .all(|(a, b)| a.to_bits() == b.to_bits()),
        "V cache ({})",
        E::NAME
    );

    // Queries: the prefill's 21, the decode's 1 at 37, the chunk's 5 at 9..14.
    let seqs = [seq(0, 21, 0, &t1), seq(21, 1, 37, &t2), seq(22, 5, 9, &t3)];
    let n = 27;
    let q = rng.vec(n * n_heads * hd, 1.0);
    let mut want = vec![0f32; q.len()];
    if half {
        let kh: Vec<F16> = want_k.iter().map(|&x| F16(f32_to_f16(x))).collect();
        let vh: Vec<F16> = want_v.iter().map(|&x| F16(f32_to_f16(x))).collect();
        let kv = PagedKv {
            k: &kh,
            v: &vh,
            block_size: bs,
            kv_dim,
        };
        reference::attention_windowed(&q, &mut want, &seqs, kv, n_heads, n_kv, hd, 0.125, window);
    } else {
        let kv = PagedKv {
            k: &want_k,
            v: &want_v,
            block_size: bs,
            kv_dim,
        };
        reference::attention_windowed(&q, &mut want, &seqs, kv, n_heads, n_kv, hd, 0.125, window);
    }
    let qt = g.tokens(&seqs, bs, n_blocks).unwrap();
    let dq = g.upload(&q).unwrap();
    let mut out = g.zeros::<f32>(q.len()).unwrap();
    g.attention(
        &dq, &mut out, &qt, &kc, &vc, n_heads, n_kv, hd, 0.125, window,
    )
    .unwrap();
    // A convex mix of V rows (|v| ≤ 1): f32 sums in another order.
    close(&g.download(&out).unwrap(), &want, |_| 2e-5).unwrap_or_else(|e| {
        panic!(
            "attention ({}, bs {bs}, {n_heads}/{n_kv}×{hd}, window {window:?}): {e}",
            E::NAME
        )
    });
}

/// The chunks kernel (`cuda/attention.cuh`) at contexts of 1 to 32 chunks (up to 3001 positions),
/// windows shorter and longer than a chunk, Gemma 2's soft-cap, f32 and f16 caches: folded and
/// split launches give the same bits (twice over: the split's counters reset themselves), each
/// within the rows kernel's tolerance of the reference, and `attention` launches it where it is
/// the `Gpu`'s kernel.
#[test]
fn chunked_attention_folds_and_splits_to_the_same_bits() {
    let Some(mut g) = gpu() else { return };
    // GQA groups of 4 heads (one unit of the groups launch), 6 (4 + 2) and 2 (a unit at 256).
    for (bs, n_heads, n_kv, hd) in [(16, 8, 2, 64), (7, 6, 1, 80), (32, 2, 1, 256)] {
        for (window, softcap) in [
            (None, None),
            (Some(19), None),
            (Some(600), None),
            (None, Some(0.3)),
        ] {
            let opts = AttnOpts { window, softcap };
            chunks_case::<f32>(&mut g, bs, (n_heads, n_kv, hd), opts);
            chunks_case::<u16>(&mut g, bs, (n_heads, n_kv, hd), opts);
        }
    }
}

fn chunks_case<E: GpuKv>(
    g: &mut Gpu,
    bs: usize,
    (n_heads, n_kv, hd): (usize, usize, usize),
    opts: AttnOpts,
) {
    let half = E::NAME == "f16";
    let mut rng = Rng(5 + bs as u64 + hd as u64);
    assert_eq!(att_chunks(3001), (96, 32));
    let kv_dim = n_kv * hd;
    let (tables, n_blocks) = scattered_tables(&mut rng, &LONG_SHAPES, bs);
    let round = |x: f32| if half { f16_to_f32(f32_to_f16(x)) } else { x };
    let kc: Vec<f32> = rng
        .vec(n_blocks * bs * kv_dim, 1.0)
        .into_iter()
        .map(round)
        .collect();
    let vc: Vec<f32> = rng
        .vec(n_blocks * bs * kv_dim, 1.0)
        .into_iter()
        .map(round)
        .collect();
    let (seqs, n) = packed_seqs(&LONG_SHAPES, &tables);
    let q = rng.vec(n * n_heads * hd, 1.0);
    let scale = 1.0 / (hd as f32).sqrt();
    let mut want = vec![0f32; q.len()];
    if half {
        let kh: Vec<F16> = kc.iter().map(|&x| F16(f32_to_f16(x))).collect();
        let vh: Vec<F16> = vc.iter().map(|&x| F16(f32_to_f16(x))).collect();
        let kv = PagedKv {
            k: &kh,
            v: &vh,
            block_size: bs,
            kv_dim,
        };
        reference::attention_windowed(&q, &mut want, &seqs, kv, n_heads, n_kv, hd, scale, opts);
    } else {
        let kv = PagedKv {
            k: &kc,
            v: &vc,
            block_size: bs,
            kv_dim,
        };
        reference::attention_windowed(&q, &mut want, &seqs, kv, n_heads, n_kv, hd, scale, opts);
    }
    // The caches as the kernels read them: f32, or halves' bits.
    let cache = |x: &[f32]| -> Vec<E> {
        x.iter()
            .map(|&v| {
                // SAFETY: E is f32 or u16 (GpuKv's two implementations), written as what it is.
                unsafe {
                    if half {
                        std::mem::transmute_copy::<u16, E>(&f32_to_f16(v))
                    } else {
                        std::mem::transmute_copy::<f32, E>(&v)
                    }
                }
            })
            .collect()
    };
    let (dk, dv) = (
        g.upload(&cache(&kc)).unwrap(),
        g.upload(&cache(&vc)).unwrap(),
    );
    let toks = g.tokens(&seqs, bs, n_blocks).unwrap();
    let dq = g.upload(&q).unwrap();
    let what = format!("{}, bs {bs}, {n_heads}/{n_kv}×{hd}, {opts:?}", E::NAME);
    let run = |g: &Gpu, how: Option<ChunkLaunch>| -> Vec<f32> {
        let mut out = g.zeros::<f32>(q.len()).unwrap();
        match how {
            Some(how) => g
                .attention_chunks(
                    &dq,
                    &mut out,
                    &toks,
                    &dk,
                    &dv,
                    (n_heads, n_kv, hd),
                    scale,
                    opts,
                    how,
                )
                .unwrap(),
            None => g
                .attention(
                    &dq, &mut out, &toks, &dk, &dv, n_heads, n_kv, hd, scale, opts,
                )
                .unwrap(),
        }
        g.download(&out).unwrap()
    };
    let fold = run(g, Some(ChunkLaunch::Fold));
    close(&fold, &want, |_| 2e-5).unwrap_or_else(|e| panic!("chunks, folded ({what}): {e}"));
    let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
    for round in 0..2 {
        let split = run(g, Some(ChunkLaunch::Split));
        assert!(
            bits(&split) == bits(&fold),
            "split ≠ fold ({what}, launch {round})"
        );
    }
    assert!(
        bits(&run(g, Some(ChunkLaunch::Auto))) == bits(&fold),
        "auto ≠ fold ({what})"
    );
    // Split by GQA group (a warp up to 4 heads of a KV head at up to 128 values a head, 2 at
    // 256): each head's arithmetic is the split's, so its bits.
    for round in 0..2 {
        let groups = run(g, Some(ChunkLaunch::Groups));
        assert!(
            bits(&groups) == bits(&fold),
            "groups ≠ fold ({what}, launch {round})"
        );
    }
    let before = g.attention_kernel();
    for kernel in [AttentionKernel::Chunks, AttentionKernel::Groups] {
        g.set_attention_kernel(kernel);
        assert!(
            bits(&run(g, None)) == bits(&fold),
            "attention by {} ≠ fold ({what})",
            kernel.name()
        );
    }
    g.set_attention_kernel(AttentionKernel::Rows);
    let rows = run(g, None);
    close(&rows, &want, |_| 2e-5).unwrap_or_else(|e| panic!("rows ({what}): {e}"));
    g.set_attention_kernel(before);
    // A split launch takes at most SPLIT_PAIRS (token, head) pairs.
    let many = g
        .tokens(&[seq(0, 600, 0, &tables[3])], bs, n_blocks)
        .unwrap();
    let dq_many = g.upload(&vec![0.5f32; 600 * n_heads * hd]).unwrap();
    let mut out_many = g.zeros::<f32>(600 * n_heads * hd).unwrap();
    for how in [ChunkLaunch::Split, ChunkLaunch::Groups] {
        let heads = (n_heads, n_kv, hd);
        let r = g.attention_chunks(
            &dq_many,
            &mut out_many,
            &many,
            &dk,
            &dv,
            heads,
            scale,
            opts,
            how,
        );
        assert!(r.is_err(), "{how:?} of {} pairs", 600 * n_heads);
    }
}
