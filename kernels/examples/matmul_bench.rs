//! Matmul throughput at decode batch sizes, single-threaded, one shape per line: GFLOP/s of
//! each format next to F32 weights (no decoding: the arithmetic alone) in the same invocation.
//! With `backward`, the training backward's dx = dy·W (`linear_backward`) next to the forward
//! product of the same shape and format.
//! `[THREADS=2] cargo run --release -p flywheel-kernels --example matmul_bench [-- N [backward]]`

use flywheel_kernels::quant::quantize::quantize;
use flywheel_kernels::{Cpu, QuantType, ThreadPool};
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
    let cpu = Cpu::new(
        flywheel_kernels::Isa::detect(),
        ThreadPool::new(threads, Duration::from_micros(50)),
    );
    let backward = std::env::args().nth(2).as_deref() == Some("backward");
    println!(
        "isa {:?}, batch {n}, {threads} thread(s) (THREADS=)",
        cpu.isa
    );
    for (rows, cols) in [(1536usize, 576usize), (576, 1536), (49152, 576)] {
        let w: Vec<f32> = (0..rows * cols)
            .map(|i| ((i * 7919 % 1000) as f32 - 500.0) / 5000.0)
            .collect();
        let x: Vec<f32> = (0..n * cols).map(|i| (i % 13) as f32 / 13.0).collect();
        let mut y = vec![0.0f32; n * rows];
        let mut dx = vec![0.0f32; n * cols];
        let mut line = format!("{rows:>6}x{cols:<5}");
        let kinds: &[(QuantType, bool)] = if backward {
            &[
                (QuantType::Q4_1, false),
                (QuantType::Q4_1, true),
                (QuantType::Q8_0, true),
            ]
        } else {
            &[
                (QuantType::F32, false),
                (QuantType::Q4_1, false),
                (QuantType::Q8_0, false),
            ]
        };
        for &(ty, bwd) in kinds {
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
            let what = if bwd { " dx" } else { "" };
            line.push_str(&format!("  {ty:?}{what} {gflops:6.1} GFLOP/s"));
        }
        println!("{line}");
    }
}
