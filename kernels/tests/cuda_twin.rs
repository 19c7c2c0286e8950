//! The GPU's index and dequantization arithmetic, checked on every machine: `cuda/common.cuh`'s
//! helpers, compiled by nvcc for the host from the source the kernels use (`cuda::TWIN`), against
//! the CPU kernels, bit for bit.
#![cfg(feature = "cuda")]

mod common;

use common::Rng;
use flywheel_kernels::cuda::{type_code, TWIN};
use flywheel_kernels::quant::quantize::quantize;
use flywheel_kernels::reference::{self, PagedKv};
use flywheel_kernels::QuantType;
use std::io::Write;
use std::process::{Command, Stdio};

fn twin(args: &[String], input: &[u8]) -> Vec<u8> {
    let mut child = Command::new(TWIN)
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("{TWIN}: {e}"));
    child.stdin.take().unwrap().write_all(input).unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "fw_twin {args:?}: {}", out.status);
    out.stdout
}

fn twin_dequant(ty: QuantType, rows: usize, cols: usize, bytes: &[u8]) -> Vec<f32> {
    let row_bytes = ty.row_bytes(cols).unwrap();
    let args = [
        "dequant".to_string(),
        type_code(ty).to_string(),
        rows.to_string(),
    ]
    .into_iter()
    .chain([cols.to_string(), row_bytes.to_string()])
    .collect::<Vec<_>>();
    twin(&args, bytes)
        .chunks(4)
        .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
        .collect()
}

/// Equal bits, or both NaN (a NaN's payload is not part of the contract).
fn same(a: f32, b: f32) -> bool {
    a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan())
}

#[test]
fn dequantization_equals_the_cpu_reference_bit_for_bit_for_every_format() {
    let mut rng = Rng(7);
    let (rows, cols) = (5, 512);
    for ty in QuantType::ALL {
        // Blocks a quantizer writes, and raw random bytes (subnormal, infinite and NaN scales).
        let quantized: Vec<u8> = (0..rows)
            .flat_map(|_| quantize(ty, &rng.vec(cols, 3.0)))
            .collect();
        let raw: Vec<u8> = (0..quantized.len()).map(|_| rng.next() as u8).collect();
        for (what, bytes) in [("quantized", &quantized), ("random bytes", &raw)] {
            let gpu = twin_dequant(ty, rows, cols, bytes);
            let mut cpu = vec![0f32; rows * cols];
            let rb = ty.row_bytes(cols).unwrap();
            for r in 0..rows {
                reference::dequantize_row(
                    ty,
                    &bytes[r * rb..(r + 1) * rb],
                    &mut cpu[r * cols..(r + 1) * cols],
                );
            }
            assert_eq!(gpu.len(), cpu.len());
            let bad = (0..cpu.len()).find(|&i| !same(gpu[i], cpu[i]));
            assert!(
                bad.is_none(),
                "{} ({what}): value {} is {} on the GPU's path, {} on the CPU",
                ty.name(),
                bad.unwrap(),
                gpu[bad.unwrap()],
                cpu[bad.unwrap()]
            );
        }
    }
}

#[test]
fn paged_cache_indices_equal_the_cpu_layout() {
    let mut rng = Rng(11);
    for (block_size, kv_dim) in [(16, 64), (32, 128), (1, 8), (7, 24)] {
        let blocks = 9;
        let table: Vec<u32> = (0..blocks).map(|_| (rng.next() % 1000) as u32).collect();
        let positions = blocks * block_size;
        let bytes: Vec<u8> = table.iter().flat_map(|b| b.to_le_bytes()).collect();
        let args = [
            "kv",
            &block_size.to_string(),
            &kv_dim.to_string(),
            &positions.to_string(),
        ]
        .map(String::from);
        let got: Vec<u64> = twin(&args, &bytes)
            .chunks(8)
            .map(|b| u64::from_le_bytes(b.try_into().unwrap()))
            .collect();
        let kv = PagedKv::<f32> {
            k: &[],
            v: &[],
            block_size,
            kv_dim,
        };
        let mut want = Vec::new();
        for p in 0..positions {
            want.push(kv.v_offset(&table, p) as u64);
            for c in 0..kv_dim {
                want.push(kv.k_index(&table, p, c) as u64);
            }
        }
        assert_eq!(got, want, "block size {block_size}, kv_dim {kv_dim}");
    }
}

#[test]
fn the_first_key_a_window_lets_a_query_see_is_the_cpus() {
    for pos in [0usize, 1, 5, 63, 64, 65, 1000] {
        for window in [None, Some(1), Some(4), Some(64), Some(4096)] {
            let out = twin(
                &[
                    "first_key".into(),
                    pos.to_string(),
                    window.unwrap_or(0).to_string(),
                ],
                &[],
            );
            let got: usize = String::from_utf8(out).unwrap().trim().parse().unwrap();
            // reference::attention_windowed: n_ctx.saturating_sub(window)
            let want = (pos + 1).saturating_sub(window.unwrap_or(usize::MAX));
            assert_eq!(got, want, "pos {pos}, window {window:?}");
        }
    }
}

/// x with the blocks the quantizer treats apart: one of zeros (d = 0), one tiny enough that d is
/// subnormal and 1/d infinite, one holding a NaN (its code 0), one of large values.
fn edge_activations(rng: &mut Rng, n: usize, cols: usize) -> Vec<f32> {
    let mut x = rng.vec(n * cols, 2.0);
    let blocks = n * cols / 32;
    for (i, b) in [1usize, 2, 3, 5].into_iter().enumerate() {
        if b >= blocks {
            continue;
        }
        let v = &mut x[32 * b..32 * b + 32];
        match i {
            0 => v.fill(0.0),
            1 => v.iter_mut().for_each(|e| *e *= 1e-40),
            2 => v[7] = f32::NAN,
            _ => v.iter_mut().for_each(|e| *e *= 3e4),
        }
    }
    x
}

#[test]
fn int8_products_equal_the_cpu_int8_reference_bit_for_bit_for_every_format() {
    let mut rng = Rng(21);
    let rows = 7;
    for ty in QuantType::ALL {
        // Odd block counts (a pair's missing block) where the format allows them, widths of
        // several K-quant super-blocks, rows of 1 to 3 of the lanes layout's chunks (64 blocks).
        let widths: &[usize] = if ty.block_size() == 256 {
            &[256, 2816]
        } else {
            &[96, 800, 4160]
        };
        if !reference::int8_applies(ty, widths[0]) {
            continue;
        }
        for &cols in widths {
            let rb = ty.row_bytes(cols).unwrap();
            let w: Vec<u8> = (0..rows)
                .flat_map(|_| quantize(ty, &rng.vec(cols, 1.5)))
                .collect();
            for n in [1usize, 5, 11] {
                let x = edge_activations(&mut rng, n, cols);
                let mut want = vec![0f32; n * rows];
                reference::matmul_int8(ty, &w, rows, cols, &x, &mut want);
                let args = ["int8".to_string(), type_code(ty).to_string()]
                    .into_iter()
                    .chain([rows, cols, rb, n].map(|v| v.to_string()))
                    .collect::<Vec<_>>();
                let input: Vec<u8> = w
                    .iter()
                    .copied()
                    .chain(x.iter().flat_map(|v| v.to_le_bytes()))
                    .collect();
                let got: Vec<f32> = twin(&args, &input)
                    .chunks(4)
                    .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
                    .collect();
                assert_eq!(got.len(), want.len());
                let bad = (0..want.len()).find(|&i| !same(got[i], want[i]));
                assert!(
                    bad.is_none(),
                    "{} {rows}×{cols}, n={n}: value {} is {} on the GPU's path, {} on the CPU's",
                    ty.name(),
                    bad.unwrap(),
                    got[bad.unwrap()],
                    want[bad.unwrap()]
                );
                assert!(want.iter().all(|v| v.is_finite()), "{}", ty.name());
            }
        }
    }
}

/// A row of logits with what a draw must get right: ties at the top (the lower index first),
/// masked tokens (-inf), and a spread wide enough that the inverse CDF crosses many chunks.
fn draw_logits(rng: &mut Rng, vocab: usize) -> Vec<f32> {
    let mut x = rng.vec(vocab, 6.0);
    if vocab > 10 {
        let top = x.iter().cloned().fold(f32::NEG_INFINITY, f32::max) + 0.5;
        (x[9], x[4]) = (top, top);
        x[3] = f32::NEG_INFINITY;
        x[vocab - 1] = f32::NEG_INFINITY;
    }
    x
}

#[test]
fn device_draws_equal_the_samplers_reference_draws() {
    let mut rng = Rng(33);
    // (top-k, top-p, min-p): the whole distribution, llama.cpp's defaults, a narrow nucleus, the
    // largest top-k drawn on the device, one candidate; then nuclei of the whole row (no top-k):
    // top-p alone (OpenAI's clients' cut), min-p alone, both.
    let cuts = [
        (0usize, 1.0f32, 0.0f32),
        (40, 0.95, 0.05),
        (40, 1.0, 0.0),
        (5, 0.5, 0.0),
        (128, 0.9, 0.0),
        (1, 1.0, 0.0),
        (0, 0.9, 0.0),
        (0, 0.5, 0.0),
        (0, 1.0, 0.05),
        (0, 0.95, 0.1),
    ];
    let (mut on_device, mut to_host) = (0, 0);
    // One token, fewer tokens than threads, a row not a multiple of the threads, SmolLM2's and
    // Llama 3's vocabularies; spread 1 (flat: a nucleus reaches past the candidates) and 4 (a few
    // tokens hold most of the mass).
    for (vocab, spread) in [
        (1usize, 1.0f32),
        (7, 1.0),
        (1000, 1.0),
        (1000, 4.0),
        (49152, 1.0),
        (49152, 4.0),
        (128256, 1.0),
        (128256, 4.0),
    ] {
        let x: Vec<f32> = draw_logits(&mut rng, vocab)
            .into_iter()
            .map(|v| v * spread)
            .collect();
        let k = 20.min(vocab);
        for temperature in [None, Some(0.7f32), Some(1.0), Some(1.3)] {
            let greedy = temperature.is_none();
            for &(top_k, top_p, min_p) in if greedy { &cuts[..1] } else { &cuts[..] } {
                let cut = (top_k, top_p, min_p);
                let mut us: Vec<f64> = (0..40)
                    .map(|_| (rng.next() >> 11) as f64 / (1u64 << 53) as f64)
                    .collect();
                us.extend([0.0, 0.5]);
                // u within 2⁻⁵³ of 1 lands where the two orders of f64 sums round differently
                // on a peaked row (its tail adds nothing to either sum): on flat rows only.
                if spread == 1.0 {
                    us.push(1.0 - f64::EPSILON / 2.0);
                }
                let inv = match temperature {
                    Some(t) if t != 1.0 => 1.0 / t,
                    _ => 1.0f32,
                };
                // What the engine's sampler computes: scale (not when greedy or T = 1), log-softmax.
                let mut lp = x.clone();
                if inv != 1.0 {
                    lp.iter_mut().for_each(|v| *v *= inv);
                }
                reference::log_softmax(&mut lp);
                let sent: Vec<f64> = if greedy { vec![-1.0] } else { us.clone() };
                let input: Vec<u8> = inv
                    .to_le_bytes()
                    .into_iter()
                    .chain(x.iter().flat_map(|v| v.to_le_bytes()))
                    .chain(sent.iter().flat_map(|u| u.to_le_bytes()))
                    .collect();
                let args = [
                    "draw".to_string(),
                    vocab.to_string(),
                    k.to_string(),
                    sent.len().to_string(),
                    top_k.to_string(),
                    top_p.to_string(),
                    min_p.to_string(),
                ];
                let words: Vec<u32> = twin(&args, &input)
                    .chunks(4)
                    .map(|b| u32::from_le_bytes(b.try_into().unwrap()))
                    .collect();
                assert_eq!(words.len(), vocab + sent.len() * (3 + k));
                let what = format!("vocab {vocab}, T {temperature:?}, cut {cut:?}");
                let bad = (0..vocab).find(|&i| !same(f32::from_bits(words[i]), lp[i]));
                assert!(
                    bad.is_none(),
                    "{what}: log-prob {bad:?} differs from the reference's"
                );
                let top = reference::top_indices(&lp, k);
                let c = reference::Truncate {
                    top_k,
                    top_p,
                    min_p,
                };
                let nucleus = top_k == 0 && c.cuts();
                // Whether the nucleus's cut reaches past the 128 best (where the host draws it).
                let past = nucleus && vocab > 128 && {
                    let p: Vec<f64> = reference::top_indices(&lp, vocab)
                        .iter()
                        .map(|&i| (lp[i as usize] as f64).exp())
                        .collect();
                    let share = p[..128].iter().sum::<f64>() / p.iter().sum::<f64>();
                    (top_p >= 1.0 || share < top_p as f64)
                        && (min_p <= 0.0 || p[127] >= p[0] * min_p as f64)
                };
                for (j, (&u, got)) in sent.iter().zip(words[vocab..].chunks(3 + k)).enumerate() {
                    let (want, kept) = match greedy {
                        true => (reference::argmax(&lp), 1.0),
                        false => reference::draw_cut(&lp, c, u),
                    };
                    if !greedy && nucleus {
                        // Left to the host exactly where the cut reaches past the 128 best.
                        assert_eq!(
                            got[0] == u32::MAX,
                            past,
                            "{what}, draw {j}: left to the host"
                        );
                        if past {
                            to_host += 1;
                            continue;
                        }
                    }
                    on_device += nucleus as usize;
                    let got_kept = f64::from_bits(got[1] as u64 | (got[2] as u64) << 32);
                    assert_eq!(got[0], want, "{what}, draw {j} at u = {u}");
                    assert_eq!(
                        got_kept.to_bits(),
                        kept.to_bits(),
                        "{what}, draw {j}: mass kept"
                    );
                    assert_eq!(&got[3..], &top[..], "{what}: the top {k}");
                }
                if vocab > 10 {
                    assert_eq!(
                        top[..2],
                        [4, 9],
                        "{what}: the tie at the top, lower index first"
                    );
                    assert!(!top.contains(&3), "{what}: a masked token among the best");
                }
            }
        }
    }
    // Both ways of a nucleus were taken.
    assert!(
        on_device > 0 && to_host > 0,
        "{on_device} on the device, {to_host} left to the host"
    );
}

/// The chunks attention kernel's arithmetic (`cuda/attention.cuh`: the chunk bounds, each warp's
/// online softmax over its tiles, the merge of the chunks in order), its lanes walked by the twin,
/// against `reference::attention_windowed` on scattered page tables: a prefill, decodes that see
/// 1 to 32 chunks (up to 3001 positions: chunks of 96), a chunk of tokens continuing, sliding
/// windows shorter and longer than a chunk, Gemma 2's soft-cap, block sizes that are and are not
/// powers of two, head dims up to 256. (Whether a split launch gives the fold's bits is the GPU
/// test's: on the host both are this one walk.)
#[test]
fn chunked_attention_matches_the_reference() {
    let mut rng = Rng(41);
    for (bs, n_heads, n_kv, hd) in [
        (16, 8, 2, 64),
        (7, 6, 1, 80),
        (32, 2, 1, 256),
        (16, 3, 3, 32),
    ] {
        for (window, softcap) in [
            (None, None),
            (Some(19), None),
            (Some(600), None),
            (None, Some(0.3)),
        ] {
            let opts = reference::AttnOpts { window, softcap };
            let kv_dim = n_kv * hd;
            let (tables, n_blocks) = common::scattered_tables(&mut rng, &common::LONG_SHAPES, bs);
            let kc = rng.vec(n_blocks * bs * kv_dim, 1.0);
            let vc = rng.vec(n_blocks * bs * kv_dim, 1.0);
            let (seqs, n) = common::packed_seqs(&common::LONG_SHAPES, &tables);
            let q = rng.vec(n * n_heads * hd, 1.0);
            let scale = 1.0 / (hd as f32).sqrt();
            let mut want = vec![0f32; q.len()];
            let kv = PagedKv {
                k: &kc,
                v: &vc,
                block_size: bs,
                kv_dim,
            };
            reference::attention_windowed(&q, &mut want, &seqs, kv, n_heads, n_kv, hd, scale, opts);

            let mut input = Vec::new();
            let (mut table_at, mut pos, mut flat) = (Vec::new(), Vec::new(), Vec::new());
            for s in &seqs {
                for i in 0..s.q_len {
                    table_at.push(flat.len() as i32);
                    pos.push((s.first_pos + i) as i32);
                }
                flat.extend_from_slice(s.block_table);
            }
            input.extend(flat.iter().flat_map(|v| v.to_le_bytes()));
            input.extend(table_at.iter().flat_map(|v| v.to_le_bytes()));
            input.extend(pos.iter().flat_map(|v| v.to_le_bytes()));
            for x in [&q, &kc, &vc] {
                input.extend(x.iter().flat_map(|v| v.to_le_bytes()));
            }
            let args: Vec<String> = [
                "attention".to_string(),
                bs.to_string(),
                n_heads.to_string(),
                n_kv.to_string(),
                hd.to_string(),
                window.unwrap_or(0).to_string(),
                softcap.unwrap_or(0.0).to_string(),
                n.to_string(),
                flat.len().to_string(),
                n_blocks.to_string(),
                format!("{scale:e}"),
            ]
            .into();
            let got: Vec<f32> = twin(&args, &input)
                .chunks(4)
                .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
                .collect();
            assert_eq!(got.len(), want.len());
            // A convex mix of V rows (|v| ≤ 1), f32 sums in another order: the GPU test's bound.
            for (i, (a, b)) in got.iter().zip(&want).enumerate() {
                assert!(
                    (a - b).abs() <= 2e-5,
                    "bs {bs}, {n_heads}/{n_kv}×{hd}, {opts:?}: value {i} (token {}, head {}): \
                     {a} against the reference's {b}",
                    i / (n_heads * hd),
                    i / hd % n_heads
                );
            }
        }
    }
}
