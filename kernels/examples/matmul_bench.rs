//! Matmul throughput at decode batch sizes, single-threaded, one shape per line: GFLOP/s of
//! each format next to F32 weights (no decoding: the arithmetic alone) in the same invocation.
//! With `backward`, the training backward's dx = dy·W (`linear_backward`) next to the forward
//! product of the same shape and format.
//! `[THREADS=2] [PRECISION=int8] [FORMATS=q4_k,q6_k] [SHAPES=2048x8192,8192x2048] cargo run
//! --release -p flywheel-kernels --example matmul_bench [-- N [backward]]` (formats by their GGUF
//! names, shapes as rows x cols; the defaults are SmolLM2-135M's shapes and F32, Q4_1, Q8_0).

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
    let cpu = Cpu::new(
        flywheel_kernels::Isa::detect(),
        ThreadPool::new(threads, Duration::from_micros(50)),
    )
    .with_precision(precision)
    .expect("a precision this CPU has");
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
        "isa {:?}, precision {}, batch {n}, {threads} thread(s) (THREADS=)",
        cpu.isa,
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
            let mut times = Vec::new();
            for _ in 0..7 {
                let t = Instant::now();
                let reps = (2e8 / (rows * cols * n) as f64).ceil() as usize;
                for _ in 0..reps {
                    if bwd {
                        cpu.linear_backward(ty, &wq, rows, cols, &y, &mut dx);
                    } else {
                        cpu.matmul(ty, &wq, rows, cols, &x, &mut y);
                    }
                }
                times.push(t.elapsed().as_secs_f64() / reps as f64);
            }
            times.sort_by(f64::total_cmp);
            let gflops = 2.0 * (rows * cols * n) as f64 / times[3] / 1e9;
            let gbps = wq.len() as f64 / times[3] / 1e9;
            let what = if bwd { " dx" } else { "" };
            line.push_str(&format!(
                "  {ty:?}{what} {gflops:6.1} GFLOP/s {gbps:5.1} GB/s"
            ));
        }
        println!("{line}");
    }
}
