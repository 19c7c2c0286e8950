//! Adapter work per projection against the base product it rides on, same run, medians:
//! `cargo run --release --example adapter_bench` (rows 1, 16, 512; SmolLM2's q (576×576) and down
//! (1536→576) shapes, Q4_1 base; OFT b=32 rotation, LoRA r=16 delta).

use flywheel::adapter::{lora, oft, OftConfig};
use flywheel::kernels::quant::quantize::quantize;
use flywheel::kernels::{Cpu, QuantType};
use std::time::Instant;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn time(mut f: impl FnMut()) -> f64 {
    f();
    let mut v = Vec::new();
    for _ in 0..15 {
        let t = Instant::now();
        f();
        v.push(t.elapsed().as_secs_f64() * 1e6);
    }
    median(v)
}

fn main() {
    let cpu = Cpu::detect();
    let vals = |n: usize| -> Vec<f32> {
        (0..n)
            .map(|i| ((i * 7919 % 1000) as f32 / 1000.0 - 0.5) * 0.1)
            .collect()
    };
    println!(
        "isa {:?}, {} threads; microseconds (median of 15)",
        cpu.isa,
        cpu.pool.num_threads()
    );
    println!(
        "{:>6} {:>6} {:>6} {:>10} {:>10} {:>10} {:>8} {:>8}",
        "rows", "in", "out", "base", "oft", "lora", "oft/b", "lora/b"
    );
    for (inp, out) in [(576usize, 576usize), (1536, 576), (576, 1536)] {
        let w = quantize(QuantType::Q4_1, &vals(inp * out));
        let b = 32;
        let theta = vals(inp / b * b * (b - 1) / 2);
        let mut rot = vec![0.0; inp * b];
        oft::rotations(&OftConfig::default(), &theta, &mut rot);
        let (r, a, bt) = (16, vals(16 * inp), vals(16 * out));
        for n in [1usize, 16, 512] {
            let x = vals(n * inp);
            let mut y = vec![0.0; n * out];
            let mut xr = vec![0.0; n * inp];
            let (mut h, mut d) = (Vec::new(), Vec::new());
            let tb = time(|| cpu.matmul(QuantType::Q4_1, &w, out, inp, &x, &mut y));
            let to = time(|| cpu.oft_rotate(&x, &rot, b, &mut xr));
            let tl = time(|| lora::delta(&cpu, &a, &bt, r, 2.0, &x, &mut h, &mut d));
            println!(
                "{n:>6} {inp:>6} {out:>6} {tb:>10.1} {to:>10.1} {tl:>10.1} {:>8.3} {:>8.3}",
                to / tb,
                tl / tb
            );
        }
    }
}
