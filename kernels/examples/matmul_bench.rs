//! Matmul throughput at decode batch sizes, single-threaded, one shape per line: GFLOP/s of
//! each format next to F32 weights (no decoding: the arithmetic alone) in the same invocation.
//! With `backward`, the training backward's dx = dy·W (`linear_backward`) next to the forward
//! product of the same shape and format.
//! `[THREADS=2] [PRECISION=int8] [FORMATS=q4_k,q6_k] [SHAPES=2048x8192,8192x2048]
//! [ISAS=avx2,avx512] cargo run --release -p flywheel-kernels --example matmul_bench [-- N
//! [backward]]` (formats by their GGUF names, shapes as rows x cols, ISAs alternating with the
//! first's time over each other's; the defaults are SmolLM2-135M's shapes, F32, Q4_1, Q8_0, and
//! the best ISA).

use flywheel_kernels::quant::quantize::quantize;
use flywheel_kernels::{Cpu, Precision, QuantType, ThreadPool};
use std::time::{Duration, Instant};

fn main() {
    let n: usize = std::env::args()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(16);
    let threads: usize = std::env::var("THREADS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(1);
    let precision: Precision = std::env::var("PRECISION")
        .map(|p| p.parse().expect("PRECISION: exact, bf16 or int8"))
        .unwrap_or_default();
    // ISAS=avx2,avx512: each product on each ISA's kernels, alternating, medians side by side.
    let isas: Vec<flywheel_kernels::Isa> = match std::env::var("ISAS") {
        Ok(list) => list
            .split(',')
            .map(|name| {
                flywheel_kernels::Isa::available()
                    .into_iter()
                    .find(|i| format!("{i:?}").eq_ignore_ascii_case(name))
                    .unwrap_or_else(|| panic!("ISAS: {name} is not a kernel ISA this CPU runs"))
            })
            .collect(),
        Err(_) => vec![flywheel_kernels::Isa::detect()],
    };
    let cpus: Vec<Cpu> = isas
        .iter()
        .map(|&isa| {
            Cpu::new(isa, ThreadPool::new(threads, Duration::from_micros(50)))
                .with_precision(precision)
                .expect("a precision this CPU has")
        })
        .collect();
    let formats: Option<Vec<QuantType>> = std::env::var("FORMATS").ok().map(|f| {
        f.split(',')
            .map(|name| {
                *QuantType::ALL
                    .iter()
                    .find(|t| t.name().eq_ignore_ascii_case(name))
                    .unwrap_or_else(|| panic!("FORMATS: unknown format {name}"))
            })
            .collect()
    });
    let shapes: Vec<(usize, usize)> = std::env::var("SHAPES")
        .map(|s| {
            s.split(',')
                .map(|d| {
                    let (r, c) = d.split_once('x').expect("SHAPES: ROWSxCOLS,...");
                    (r.parse().expect("rows"), c.parse().expect("cols"))
                })
                .collect()
        })
        .unwrap_or_else(|_| vec![(1536, 576), (576, 1536), (49152, 576)]);
    let backward = std::env::args().nth(2).as_deref() == Some("backward");
    println!(
        "isa {isas:?} (ISAS=), precision {}, batch {n}, {threads} thread(s) (THREADS=)",
        precision.name()
    );
    for (rows, cols) in shapes {
        let w: Vec<f32> = (0..rows * cols)
            .map(|i| ((i * 7919 % 1000) as f32 - 500.0) / 5000.0)
            .collect();
        let x: Vec<f32> = (0..n * cols).map(|i| (i % 13) as f32 / 13.0).collect();
        let mut y = vec![0.0f32; n * rows];
        let mut dx = vec![0.0f32; n * cols];
        let mut line = format!("{rows:>6}x{cols:<5}");
        let kinds: Vec<(QuantType, bool)> = match (&formats, backward) {
            (Some(f), false) => f.iter().map(|&t| (t, false)).collect(),
            (Some(f), true) => f.iter().flat_map(|&t| [(t, false), (t, true)]).collect(),
            (None, true) => vec![
                (QuantType::Q4_1, false),
                (QuantType::Q4_1, true),
                (QuantType::Q8_0, true),
            ],
            (None, false) => vec![
                (QuantType::F32, false),
                (QuantType::Q4_1, false),
                (QuantType::Q8_0, false),
            ],
        };
        for (ty, bwd) in kinds {
            let wq = quantize(ty, &w);
            let mut times = vec![Vec::new(); cpus.len()];
            for _ in 0..7 {
                for (c, cpu) in cpus.iter().enumerate() {
                    let t = Instant::now();
                    let reps = (2e8 / (rows * cols * n) as f64).ceil() as usize;
                    for _ in 0..reps {
                        if bwd {
                            cpu.linear_backward(ty, &wq, rows, cols, &y, &mut dx);
                        } else {
                            cpu.matmul(ty, &wq, rows, cols, &x, &mut y);
                        }
                    }
                    times[c].push(t.elapsed().as_secs_f64() / reps as f64);
                }
            }
            let what = if bwd { " dx" } else { "" };
            let mut first = None;
            for (c, mut t) in times.into_iter().enumerate() {
                t.sort_by(f64::total_cmp);
                let gflops = 2.0 * (rows * cols * n) as f64 / t[3] / 1e9;
                let gbps = wq.len() as f64 / t[3] / 1e9;
                let isa = if cpus.len() > 1 {
                    format!(" {:?}", cpus[c].isa)
                } else {
                    String::new()
                };
                let ratio = match first {
                    None => {
                        first = Some(t[3]);
                        String::new()
                    }
                    Some(t0) => format!(" ({:.2}x)", t0 / t[3]),
                };
                line.push_str(&format!(
                    "  {ty:?}{what}{isa} {gflops:6.1} GFLOP/s {gbps:5.1} GB/s{ratio}"
                ));
            }
        }
        println!("{line}");
    }
}
