//! `flywheel bench --device cuda`: the CUDA engine's prefill (ppN) and batched decode (tgN)
//! throughput, decode through CUDA graphs and launched eagerly alternating run by run (medians),
//! and the weight bandwidth batch-1 decode achieves.

use crate::bench::{median, BenchOptions};
use crate::generate::BLOCK_SIZE;
use crate::model::decoder::{BatchSeq, Decoder, ForwardBuffers, GpuDecoder, GpuShape, Logits};
use flywheel_kernels::cuda::Gpu;
use std::time::Instant;

/// One engine (graphs on or off) and the cache blocks each decode sequence owns.
struct Bench {
    gpu: GpuDecoder,
    bufs: ForwardBuffers,
}

impl Bench {
    fn new(model: &Decoder, o: &BenchOptions, graphs: bool) -> anyhow::Result<Bench> {
        let max_b = o.batches.iter().copied().max().unwrap_or(1);
        let per_seq = (8 + o.decode_tokens).div_ceil(BLOCK_SIZE);
        let blocks = (o.prompt_tokens.div_ceil(BLOCK_SIZE)).max(max_b * per_seq);
        let shape = GpuShape {
            num_kv_blocks: blocks,
            block_size: BLOCK_SIZE,
            max_tokens: o.prompt_tokens.max(max_b * 8),
            max_seqs: max_b,
            max_model_len: o.prompt_tokens.max(8 + o.decode_tokens),
            graphs,
        };
        let gpu = GpuDecoder::new(Gpu::open(0)?, model, shape)?;
        Ok(Bench {
            gpu,
            bufs: ForwardBuffers::default(),
        })
    }

    /// Seconds to prefill `prompt` (one sequence from position 0).
    fn prefill(&mut self, model: &Decoder, prompt: &[u32]) -> anyhow::Result<f64> {
        let table: Vec<u32> = (0..prompt.len().div_ceil(BLOCK_SIZE) as u32).collect();
        let t = Instant::now();
        self.gpu.forward_into(
            model,
            &[BatchSeq {
                tokens: prompt,
                first_pos: 0,
                block_table: &table,
                window_table: &[],
                logits: Logits::Last,
                adapter: None,
            }],
            &mut self.bufs,
        )?;
        Ok(t.elapsed().as_secs_f64())
    }

    /// Seconds for `steps` decode steps of `b` sequences (8-token prompts, greedy), the
    /// logits back on the host each step as the engine has them.
    fn decode(&mut self, model: &Decoder, b: usize, steps: usize) -> anyhow::Result<f64> {
        let per_seq = (8 + steps).div_ceil(BLOCK_SIZE);
        let tables: Vec<Vec<u32>> = (0..b)
            .map(|i| ((i * per_seq) as u32..((i + 1) * per_seq) as u32).collect())
            .collect();
        let vocab = model.config.vocab_size;
        let mut seqs: Vec<Vec<u32>> = (0..b)
            .map(|i| (0..8).map(|j| (i + j) as u32 % 256).collect())
            .collect();
        let run = |g: &mut Bench, seqs: &[Vec<u32>], new: usize| -> anyhow::Result<Vec<u32>> {
            let batch: Vec<BatchSeq> = seqs
                .iter()
                .zip(&tables)
                .map(|(s, t)| BatchSeq {
                    tokens: &s[s.len() - new..],
                    first_pos: s.len() - new,
                    block_table: t,
                    window_table: &[],
                    logits: Logits::Last,
                    adapter: None,
                })
                .collect();
            g.gpu.forward_into(model, &batch, &mut g.bufs)?;
            Ok(g.bufs
                .logits
                .chunks(vocab)
                .map(crate::engine::sampler::argmax)
                .collect())
        };
        let next = run(self, &seqs, 8)?;
        seqs.iter_mut().zip(next).for_each(|(s, t)| s.push(t));
        let t = Instant::now();
        for _ in 0..steps {
            let next = run(self, &seqs, 1)?;
            seqs.iter_mut().zip(next).for_each(|(s, t)| s.push(t));
        }
        Ok(t.elapsed().as_secs_f64())
    }
}

/// The card's memory bandwidth, measured now: 1 GiB copied on the device (read and written),
/// the best of 5, in GB/s.
fn copy_bandwidth() -> anyhow::Result<f64> {
    let g = Gpu::open(0)?;
    let n = 1usize << 30;
    let src = g.zeros::<u8>(n)?;
    let mut dst = g.zeros::<u8>(n)?;
    let mut best = f64::INFINITY;
    for _ in 0..5 {
        g.synchronize()?;
        let t = Instant::now();
        g.copy(&src, &mut dst, n)?;
        g.synchronize()?;
        best = best.min(t.elapsed().as_secs_f64());
    }
    Ok(2.0 * n as f64 / best / 1e9)
}

/// Run the tests on GPU 0 and print a table and one JSON line.
pub fn run(model: &Decoder, o: &BenchOptions) -> anyhow::Result<()> {
    anyhow::ensure!(
        o.adapter.is_none(),
        "--adapter is not measured on the GPU yet"
    );
    let mut graphs = Bench::new(model, o, true)?;
    let mut eager = Bench::new(model, o, false)?;
    let device = Gpu::open(0)?.describe();
    let pp = o.prompt_tokens;
    let prompt: Vec<u32> = (0..pp).map(|i| (i * 7 % 256) as u32).collect();
    // Warm-up: every kernel once, and the graphs of the measured buckets captured.
    graphs.prefill(model, &prompt)?;
    for &b in &o.batches {
        graphs.decode(model, b, 2)?;
        eager.decode(model, b, 2)?;
    }
    let mut rows: Vec<(String, usize, f64, f64)> = Vec::new();
    let pp_rate = median(
        (0..o.runs)
            .map(|_| graphs.prefill(model, &prompt).map(|s| pp as f64 / s))
            .collect::<anyhow::Result<_>>()?,
    );
    rows.push((format!("pp{pp}"), 1, pp_rate, pp_rate));
    let tg = o.decode_tokens;
    for &b in &o.batches {
        let (mut with, mut without) = (Vec::new(), Vec::new());
        for r in 0..o.runs {
            // Alternating which goes first, run by run.
            for first in [r % 2 == 0, r % 2 == 1] {
                if first {
                    with.push((b * tg) as f64 / graphs.decode(model, b, tg)?);
                } else {
                    without.push((b * tg) as f64 / eager.decode(model, b, tg)?);
                }
            }
        }
        rows.push((format!("tg{tg}"), b, median(with), median(without)));
    }
    let per_token = model.weight_bytes_per_token() as f64;
    let bandwidth = copy_bandwidth()?;
    println!(
        "model: {}  device: {device}  weights read per decode step: {:.1} MB  \
         copy bandwidth: {bandwidth:.0} GB/s",
        o.model_path,
        per_token / 1e6
    );
    println!(
        "{:<8} {:>6} {:>14} {:>14} {:>8} {:>16}",
        "test", "batch", "graphs tok/s", "eager tok/s", "ratio", "weights GB/s"
    );
    for (name, b, g, e) in &rows {
        let steps = g / *b as f64;
        println!(
            "{name:<8} {b:>6} {g:>14.1} {e:>14.1} {:>8.2} {:>16.1}",
            g / e,
            if name.starts_with("tg") {
                steps * per_token / 1e9
            } else {
                f64::NAN
            }
        );
    }
    let json = serde_json::json!({
        "model": o.model_path,
        "device": device,
        "runs": o.runs,
        "weight_bytes_per_token": model.weight_bytes_per_token(),
        "copy_bandwidth_gbps": bandwidth,
        "results": rows.iter().map(|(n, b, g, e)| serde_json::json!({
            "test": n, "batch": b, "tokens_per_second": g, "eager_tokens_per_second": e,
        })).collect::<Vec<_>>(),
    });
    println!("{json}");
    Ok(())
}
