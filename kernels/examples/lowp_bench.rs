//! The arithmetic ceiling of each precision for the batched product's inner tile, one thread,
//! in one invocation: 6 weight rows x 4 activation rows, 24 vector accumulators, operands
//! already in the tile's format (no dequantization: that cost comes on top):
//! - f32: `vfmadd231ps` (16 MACs per instruction), today's `dot_panel` tile;
//! - bf16: `vdpbf16ps` (AVX512_BF16, 32 MACs), BF16 weights and activations, f32 sums;
//! - int8: `vpdpbusd` (AVX512_VNNI, 64 MACs), u8 weights x i8 activations, i32 sums.
//!
//! Then end to end from Q4_1 weights: today's product next to a first BF16 one (rows dequantized
//! into a BF16 panel, activations rounded once), with the largest difference between them.
//!
//! Paths the CPU lacks are skipped with a message. Issue 17's measurement before writing the
//! low-precision paths. `cargo run --release -p flywheel-kernels --example lowp_bench [-- N]`

use std::time::Instant;

const WR: usize = 6;
const XR: usize = 4;

fn main() {
    let n: usize = std::env::args()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(16);
    #[cfg(target_arch = "x86_64")]
    x86::run(n);
    #[cfg(not(target_arch = "x86_64"))]
    println!("skipped: not x86_64 ({n} rows)");
}

/// Median seconds of `f` over 7 timings of enough repetitions for ~0.1 s.
fn time(macs: usize, mut f: impl FnMut()) -> f64 {
    let reps = (2e8 / macs as f64).ceil() as usize;
    let mut t: Vec<f64> = (0..7)
        .map(|_| {
            let t0 = Instant::now();
            for _ in 0..reps {
                f();
            }
            t0.elapsed().as_secs_f64() / reps as f64
        })
        .collect();
    t.sort_by(f64::total_cmp);
    t[3]
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::*;
    use std::arch::x86_64::*;

    pub fn run(n: usize) {
        let f = flywheel_kernels::cpu::Features::get();
        println!("batch {n}, one thread, GFLOP/s of the inner tile (2 flop per MAC)");
        for (rows, k) in [(1536usize, 576usize), (576, 1536), (49152, 576)] {
            let mut line = format!("{rows:>6}x{k:<5}");
            // One tile kind: its name, whether the CPU has it, what it lacks otherwise, and a
            // run over operands of the tile's types (w: rows x k, x: n x k, y: n x rows).
            fn measure<W: Copy, X: Copy, Y: Copy + Default>(
                line: &mut String,
                (name, has, lacks): (&str, bool, &str),
                (w0, x0): (W, X),
                (rows, k, n): (usize, usize, usize),
                tiles: unsafe fn(&[W], &[X], &mut [Y], usize, usize, usize),
            ) {
                if !has {
                    *line += &format!("  {name} skipped (no {lacks})");
                    return;
                }
                let (w, x) = (vec![w0; rows * k], vec![x0; n * k]);
                let mut y = vec![Y::default(); n * rows];
                let macs = rows * k * n;
                // SAFETY: the feature was checked; shapes as allocated.
                let s = time(macs, || unsafe { tiles(&w, &x, &mut y, rows, k, n) });
                *line += &format!("  {name} {:7.1}", 2.0 * macs as f64 / s / 1e9);
            }
            let shape = (rows, k, n);
            let f32_tile = ("f32", f.avx512f, "AVX-512F");
            measure(&mut line, f32_tile, (0.01f32, 0.02f32), shape, f32_tiles);
            let bf16_tile = ("bf16", f.avx512_bf16, "AVX512_BF16");
            measure(
                &mut line,
                bf16_tile,
                (0x3c23u16, 0x3ca3u16),
                shape,
                bf16_tiles,
            );
            let int8_tile = ("int8", f.avx512_vnni, "AVX512_VNNI");
            measure(&mut line, int8_tile, (7u8, -3i8), shape, int8_tiles_i8);
            println!("{line}");
        }
        if !f.avx512_bf16 {
            println!("end to end: skipped (no AVX512_BF16)");
            return;
        }
        // End to end from Q4_1 weights: today's product vs a BF16 one (rows dequantized into a
        // BF16 panel 24 at a time, activations rounded to BF16 once), one thread.
        use flywheel_kernels::quant::quantize::quantize;
        use flywheel_kernels::{Cpu, Isa, QuantType, ThreadPool};
        let cpu = Cpu::new(
            Isa::detect(),
            ThreadPool::new(1, std::time::Duration::from_micros(50)),
        );
        println!("end to end from Q4_1 weights, batch {n}, one thread (GFLOP/s):");
        for (rows, k) in [(1536usize, 576usize), (576, 1536)] {
            let wf: Vec<f32> = (0..rows * k)
                .map(|i| ((i * 7919 % 1000) as f32 - 500.0) / 5000.0)
                .collect();
            let wq = quantize(QuantType::Q4_1, &wf);
            let x: Vec<f32> = (0..n * k).map(|i| (i % 13) as f32 / 13.0).collect();
            let mut y = vec![0f32; n * rows];
            let macs = rows * k * n;
            let t_f32 = time(macs, || {
                cpu.matmul(QuantType::Q4_1, &wq, rows, k, &x, &mut y)
            });
            let want = y.clone();
            let mut yb = vec![0f32; n * rows];
            let mut yf = vec![0f32; n * rows];
            // SAFETY: AVX512_BF16 (and so F16C, AVX512BW) checked above.
            let t_bf16 = time(macs, || unsafe {
                q4_1_bf16(&cpu, false, &wq, rows, k, &x, &mut yb)
            });
            let t_fused = time(macs, || unsafe {
                q4_1_bf16(&cpu, true, &wq, rows, k, &x, &mut yf)
            });
            assert_eq!(yb, yf, "the fused decoder must round the same values");
            // The largest difference relative to the largest output.
            let scale = want.iter().fold(0f32, |m, a| m.max(a.abs()));
            let err = want
                .iter()
                .zip(&yb)
                .map(|(a, b)| (a - b).abs() / scale)
                .fold(0f32, f32::max);
            let gf = |t: f64| 2.0 * macs as f64 / t / 1e9;
            println!(
                "{rows:>6}x{k:<5}  f32 (today) {:6.1}  bf16 {:6.1} ({:.2}x)  bf16 decoded \
                 straight from 4 bits {:6.1} ({:.2}x)  max diff / max |y| {err:.1e}",
                gf(t_f32),
                gf(t_bf16),
                t_f32 / t_bf16,
                gf(t_fused),
                t_f32 / t_fused
            );
        }
    }

    #[target_feature(enable = "f16c")]
    unsafe fn h2f(h: u16) -> f32 {
        _mm_cvtss_f32(_mm_cvtph_ps(_mm_set1_epi16(h as i16)))
    }

    /// A Q4_1 row (20-byte blocks: f16 d, f16 m, 16 bytes of nibbles) decoded straight into
    /// BF16: x[j] = (qs[j] & 15)·d + m, x[j+16] = (qs[j] >> 4)·d + m, rounded once.
    #[target_feature(enable = "avx512f,avx512bf16,avx512bw,f16c")]
    unsafe fn q4_1_row_to_bf16(src: *const u8, dst: *mut u16, k: usize) {
        let low = _mm_set1_epi8(0x0f);
        for b in 0..k / 32 {
            let blk = src.add(b * 20);
            let d = _mm512_set1_ps(h2f((blk as *const u16).read_unaligned()));
            let m = _mm512_set1_ps(h2f((blk.add(2) as *const u16).read_unaligned()));
            let qs = _mm_loadu_si128(blk.add(4) as *const __m128i);
            let lo = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(qs, low)));
            let hi = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(
                _mm_srli_epi16(qs, 4),
                low,
            )));
            // cvtne2ps: the second operand fills the low half.
            let both = _mm512_cvtne2ps_pbh(_mm512_fmadd_ps(hi, d, m), _mm512_fmadd_ps(lo, d, m));
            _mm512_storeu_si512(
                dst.add(b * 32) as *mut _,
                std::mem::transmute::<__m512bh, __m512i>(both),
            );
        }
    }

    /// f32 values to BF16 (round to nearest even), 16 at a time; `n` a multiple of 16.
    #[target_feature(enable = "avx512f,avx512bf16")]
    unsafe fn to_bf16(src: *const f32, dst: *mut u16, n: usize) {
        let mut c = 0;
        while c < n {
            let v = _mm512_cvtneps_pbh(_mm512_loadu_ps(src.add(c)));
            _mm256_storeu_si256(
                dst.add(c) as *mut __m256i,
                std::mem::transmute::<__m256bh, __m256i>(v),
            );
            c += 16;
        }
    }

    #[target_feature(enable = "avx512f,avx512bf16")]
    unsafe fn q4_1_bf16(
        cpu: &flywheel_kernels::Cpu,
        fused: bool,
        wq: &[u8],
        rows: usize,
        k: usize,
        x: &[f32],
        y: &mut [f32],
    ) {
        use flywheel_kernels::QuantType;
        const CHUNK: usize = 24;
        let n = x.len() / k;
        let mut xb = vec![0u16; n * k];
        to_bf16(x.as_ptr(), xb.as_mut_ptr(), n * k);
        let rb = QuantType::Q4_1.row_bytes(k).unwrap();
        let mut row = vec![0f32; k];
        let mut panel = vec![0u16; CHUNK * k];
        let mut part = vec![0f32; n * CHUNK];
        for r0 in (0..rows).step_by(CHUNK) {
            for r in 0..CHUNK {
                let src = &wq[(r0 + r) * rb..(r0 + r + 1) * rb];
                if fused {
                    q4_1_row_to_bf16(src.as_ptr(), panel.as_mut_ptr().add(r * k), k);
                } else {
                    flywheel_kernels::cpu::matmul::dequantize_row(
                        cpu.isa,
                        QuantType::Q4_1,
                        src,
                        &mut row,
                    );
                    to_bf16(row.as_ptr(), panel.as_mut_ptr().add(r * k), k);
                }
            }
            bf16_tiles(&panel, &xb, &mut part, CHUNK, k, n);
            for i in 0..n {
                y[i * rows + r0..i * rows + r0 + CHUNK]
                    .copy_from_slice(&part[i * CHUNK..(i + 1) * CHUNK]);
            }
        }
    }

    /// One generic tile sweep: `step` values of K per vector, `mac` the tile's instruction.
    macro_rules! tiles {
        ($name:ident, $feat:literal, $t:ty, $acc:ty, $zero:expr, $load:expr, $mac:expr, $reduce:expr, $out:ty, $step:expr) => {
            #[target_feature(enable = $feat)]
            unsafe fn $name(w: &[$t], x: &[$t], y: &mut [$out], rows: usize, k: usize, n: usize) {
                let mut r = 0;
                while r + WR <= rows {
                    let mut i = 0;
                    while i + XR <= n {
                        let mut acc: [[$acc; XR]; WR] = [[$zero; XR]; WR];
                        let mut c = 0;
                        while c + $step <= k {
                            let wv: [_; WR] =
                                std::array::from_fn(|a| $load(w.as_ptr().add((r + a) * k + c)));
                            for (b, xrow) in (i..i + XR).enumerate() {
                                let xv = $load(x.as_ptr().add(xrow * k + c));
                                for a in 0..WR {
                                    acc[a][b] = $mac(acc[a][b], wv[a], xv);
                                }
                            }
                            c += $step;
                        }
                        for a in 0..WR {
                            for b in 0..XR {
                                y[(i + b) * rows + r + a] = $reduce(acc[a][b]);
                            }
                        }
                        i += XR;
                    }
                    r += WR;
                }
            }
        };
    }

    tiles!(
        f32_tiles,
        "avx512f",
        f32,
        __m512,
        _mm512_setzero_ps(),
        |p: *const f32| _mm512_loadu_ps(p),
        |acc, a, b| _mm512_fmadd_ps(a, b, acc),
        |v| _mm512_reduce_add_ps(v),
        f32,
        16
    );
    tiles!(
        bf16_tiles,
        "avx512f,avx512bf16",
        u16,
        __m512,
        _mm512_setzero_ps(),
        |p: *const u16| _mm512_loadu_si512(p as *const _),
        |acc, a: __m512i, b: __m512i| _mm512_dpbf16_ps(
            acc,
            std::mem::transmute::<__m512i, __m512bh>(a),
            std::mem::transmute::<__m512i, __m512bh>(b)
        ),
        |v| _mm512_reduce_add_ps(v),
        f32,
        32
    );
    tiles!(
        int8_tiles,
        "avx512f,avx512vnni",
        u8,
        __m512i,
        _mm512_setzero_si512(),
        |p: *const u8| _mm512_loadu_si512(p as *const _),
        |acc, a, b| _mm512_dpbusd_epi32(acc, a, b),
        |v| _mm512_reduce_add_epi32(v),
        i32,
        64
    );

    /// The int8 tile on i8 activations (read through the same byte loader).
    #[target_feature(enable = "avx512f,avx512vnni")]
    unsafe fn int8_tiles_i8(w: &[u8], x: &[i8], y: &mut [i32], rows: usize, k: usize, n: usize) {
        let x = std::slice::from_raw_parts(x.as_ptr() as *const u8, x.len());
        int8_tiles(w, x, y, rows, k, n)
    }
}
