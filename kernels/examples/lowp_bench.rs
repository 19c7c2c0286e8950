//! The arithmetic ceiling of each precision for the batched product's inner tile, one thread,
//! in one invocation: 6 weight rows x 4 activation rows, 24 vector accumulators, operands
//! already in the tile's format (no dequantization: that cost comes on top):
//! - f32: `vfmadd231ps` (16 MACs per instruction), today's `dot_panel` tile;
//! - bf16: `vdpbf16ps` (AVX512_BF16, 32 MACs), BF16 weights and activations, f32 sums;
//! - int8: `vpdpbusd` (AVX512_VNNI, 64 MACs), u8 weights x i8 activations, i32 sums.
//!
//! Then end to end through the kernels: exact f32 vs `Precision::Bf16` and `Precision::Int8`
//! products on Q4_1 and Q8_0 weights, batch 1 and batch N, one and two threads.
//!
//! Paths the CPU lacks are skipped with a message. Issue 17's measurement before writing the
//! low-precision paths. `cargo run --release -p flywheel-kernels --example lowp_bench [-- N]`
//! (`FLYWHEEL_MAX_ISA=avx2` runs the end-to-end part on the AVX2 kernels).

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
            /// A tile kernel: (w, x, y, rows, k, n).
            type Tiles<W, X, Y> = unsafe fn(&[W], &[X], &mut [Y], usize, usize, usize);
            fn measure<W: Copy, X: Copy, Y: Copy + Default>(
                line: &mut String,
                (name, has, lacks): (&str, bool, &str),
                (w0, x0): (W, X),
                (rows, k, n): (usize, usize, usize),
                tiles: Tiles<W, X, Y>,
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
        read_bandwidth();
        // End to end: the kernels themselves, exact f32 vs `Precision::Bf16` and `Int8` (those
        // the CPU has), on Q4_1 and Q8_0 weights of the layers' shapes, at batch 1 (decode: GB/s
        // of weights read; all but the 49152-row head fit in L2) and batch n (GFLOP/s), one and
        // two threads, alternating, medians; the ratio is against exact.
        use flywheel_kernels::cpu::Precision;
        use flywheel_kernels::quant::quantize::quantize;
        use flywheel_kernels::{Cpu, Isa, QuantType, ThreadPool};
        // FLYWHEEL_MAX_ISA=avx2: the AVX2 kernels (what a CPU without AVX-512 runs).
        let isa = Isa::detect();
        println!("end to end on the {} kernels", isa.name());
        for threads in [1usize, 2] {
            let pool = || ThreadPool::new(threads, std::time::Duration::from_micros(50));
            let mut cpus = vec![(Precision::Exact, Cpu::new(isa, pool()))];
            for p in [Precision::Bf16, Precision::Int8] {
                match Cpu::new(isa, pool()).with_precision(p) {
                    Ok(c) => cpus.push((p, c)),
                    Err(e) => println!("{} skipped: {e}", p.name()),
                }
            }
            let names: Vec<&str> = cpus.iter().map(|(p, _)| p.name()).collect();
            println!("end to end, {threads} thread(s): {}", names.join(" vs "));
            for ty in [QuantType::Q4_1, QuantType::Q8_0] {
                for (rows, k) in [(1536usize, 576usize), (576, 1536), (49152, 576)] {
                    let wf: Vec<f32> = (0..rows * k)
                        .map(|i| ((i * 7919 % 1000) as f32 - 500.0) / 5000.0)
                        .collect();
                    let wq = quantize(ty, &wf);
                    let mut line = format!("{ty:?} {rows:>6}x{k:<5}");
                    for batch in [1, n] {
                        let x: Vec<f32> = (0..batch * k).map(|i| (i % 13) as f32 / 13.0).collect();
                        let mut y = vec![0f32; batch * rows];
                        let macs = rows * k * batch;
                        let mut t = vec![Vec::new(); cpus.len()];
                        for _ in 0..5 {
                            for (c, (_, cpu)) in cpus.iter().enumerate() {
                                t[c].push(time(macs, || cpu.matmul(ty, &wq, rows, k, &x, &mut y)));
                            }
                        }
                        let meds: Vec<f64> = t
                            .iter_mut()
                            .map(|v| {
                                v.sort_by(f64::total_cmp);
                                v[v.len() / 2]
                            })
                            .collect();
                        let rate = |s: f64| {
                            if batch == 1 {
                                wq.len() as f64 / s / 1e9
                            } else {
                                2.0 * macs as f64 / s / 1e9
                            }
                        };
                        let unit = if batch == 1 { "GB/s" } else { "GFLOP/s" };
                        let each: Vec<String> = meds
                            .iter()
                            .map(|&m| format!("{:.1} ({:.2}x)", rate(m), meds[0] / m))
                            .collect();
                        line += &format!("  batch {batch} {unit}: {}", each.join(" "));
                    }
                    println!("{line}");
                }
            }
        }
    }

    /// The memory's limit for decode: 256 MB (as no cache holds, 4 KB pages) read by the
    /// kernels' pool, one and two threads (`ThreadPool::read_bandwidth`); best of 5 passes.
    fn read_bandwidth() {
        use flywheel_kernels::ThreadPool;
        let mut buf = vec![0u8; 256 << 20];
        for threads in [1usize, 2] {
            let pool = ThreadPool::new(threads, std::time::Duration::from_micros(50));
            let best = pool.read_bandwidth(&mut buf, 5);
            println!("read bandwidth, {threads} thread(s): {best:.1} GB/s (256 MB, best of 5)");
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
