//! `flywheel bench --device cuda`: the CUDA engine's prefill (ppN) and batched decode (tgN)
//! throughput, decode through CUDA graphs and launched eagerly alternating run by run (medians),
//! and the weight bandwidth batch-1 decode achieves. With `--adapter`, decode again with every
//! sequence through it (tgN+a), and the cost of a publish: the first decode step through a new
//! version (its upload and directory slot) against a step through a version already there, and
//! whether it captured a graph.

use crate::adapter::AdapterWeights;
use crate::bench::{median, BenchOptions};
use crate::generate::BLOCK_SIZE;
use crate::model::decoder::{
    BatchSeq, Decoder, ForwardBuffers, GpuDecoder, GpuShape, Logits, RowOut, RowsBack,
};
use flywheel_kernels::cuda::{DrawSpec, Gpu, Truncate};
use std::time::Instant;

/// One engine (graphs on or off) and the cache blocks each decode sequence owns.
struct Bench {
    gpu: GpuDecoder,
    /// Each decode sequence's prompt (`--decode-context`), and the most tokens a step runs.
    ctx: usize,
    max_tokens: usize,
    bufs: ForwardBuffers,
    drawn: RowsBack,
}

impl Bench {
    fn new(model: &Decoder, o: &BenchOptions, graphs: bool, int8: bool) -> anyhow::Result<Bench> {
        let max_b = o.batches.iter().copied().max().unwrap_or(1);
        let ctx = o.decode_context;
        let per_seq = (ctx + o.decode_tokens).div_ceil(BLOCK_SIZE);
        let blocks = (o.prompt_tokens.div_ceil(BLOCK_SIZE)).max(max_b * per_seq);
        let shape = GpuShape {
            num_kv_blocks: blocks,
            block_size: BLOCK_SIZE,
            max_tokens: o.prompt_tokens.max(max_b * 8).max(ctx),
            max_seqs: max_b,
            max_model_len: o.prompt_tokens.max(ctx + o.decode_tokens),
            graphs,
            int8,
            draws: std::env::var("FLYWHEEL_CUDA_SAMPLING").as_deref() != Ok("0"),
        };
        let gpu = GpuDecoder::new(Gpu::open(0)?, model, shape)?;
        Ok(Bench {
            gpu,
            ctx,
            max_tokens: shape.max_tokens,
            bufs: ForwardBuffers::default(),
            drawn: RowsBack::default(),
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

    /// Seconds for `steps` decode steps of `b` sequences (prompts of `--decode-context` tokens,
    /// 8 unless told; greedy), each token
    /// drawn as the engine has it (on the GPU; with FLYWHEEL_CUDA_SAMPLING=0 the logits back
    /// on the host and the argmax there); every sequence through
    /// `adapter` where given.
    fn decode(
        &mut self,
        model: &Decoder,
        b: usize,
        steps: usize,
        adapter: Option<&AdapterWeights>,
    ) -> anyhow::Result<f64> {
        Ok(self.decode_timed(model, b, steps, adapter)?.1)
    }

    /// `decode`, also returning the seconds of the prompts' step before it.
    fn decode_timed(
        &mut self,
        model: &Decoder,
        b: usize,
        steps: usize,
        adapter: Option<&AdapterWeights>,
    ) -> anyhow::Result<(f64, f64)> {
        let ctx = self.ctx;
        let per_seq = (ctx + steps).div_ceil(BLOCK_SIZE);
        let tables: Vec<Vec<u32>> = (0..b)
            .map(|i| ((i * per_seq) as u32..((i + 1) * per_seq) as u32).collect())
            .collect();
        let vocab = model.config.vocab_size;
        let mut seqs: Vec<Vec<u32>> = (0..b)
            .map(|i| (0..ctx).map(|j| (i + j) as u32 % 256).collect())
            .collect();
        let run = |g: &mut Bench, seqs: &[Vec<u32>], tables: &[Vec<u32>], new: usize| {
            let batch: Vec<BatchSeq> = seqs
                .iter()
                .zip(tables)
                .map(|(s, t)| BatchSeq {
                    tokens: &s[s.len() - new..],
                    first_pos: s.len() - new,
                    block_table: t,
                    window_table: &[],
                    logits: Logits::Last,
                    adapter,
                })
                .collect();
            if g.gpu.draws() {
                // As the engine serves greedy rows: the tokens drawn on the GPU.
                let specs: Vec<RowOut> = (0..batch.len() as u32)
                    .map(|row| {
                        RowOut::Drawn(DrawSpec {
                            row,
                            sample: None,
                            top: 0,
                            truncate: Truncate::NONE,
                        })
                    })
                    .collect();
                g.gpu
                    .forward_drawing(model, &batch, &specs, &mut g.bufs, &mut g.drawn)?;
                return Ok(g.drawn.drawn.iter().map(|d| d.token).collect());
            }
            g.gpu.forward_into(model, &batch, &mut g.bufs)?;
            anyhow::Ok(
                g.bufs
                    .logits
                    .chunks(vocab)
                    .map(crate::engine::sampler::argmax)
                    .collect::<Vec<u32>>(),
            )
        };
        // The prompts, as many a step as the buffers hold.
        let t = Instant::now();
        let group = (self.max_tokens / ctx).max(1);
        let mut next = Vec::with_capacity(b);
        for (s, tb) in seqs.chunks(group).zip(tables.chunks(group)) {
            next.extend(run(self, s, tb, ctx)?);
        }
        let prompts = t.elapsed().as_secs_f64();
        seqs.iter_mut().zip(next).for_each(|(s, t)| s.push(t));
        let t = Instant::now();
        for _ in 0..steps {
            let next = run(self, &seqs, &tables, 1)?;
            seqs.iter_mut().zip(next).for_each(|(s, t)| s.push(t));
        }
        Ok((prompts, t.elapsed().as_secs_f64()))
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
/// `int8`: the base's products in int8 (`--precision int8`), else in f32.
pub fn run(model: &Decoder, o: &BenchOptions, int8: bool) -> anyhow::Result<()> {
    let mut graphs = Bench::new(model, o, true, int8)?;
    let mut eager = Bench::new(model, o, false, int8)?;
    let device = graphs.gpu.describe();
    let pp = o.prompt_tokens;
    let prompt: Vec<u32> = (0..pp).map(|i| (i * 7 % 256) as u32).collect();
    // Warm-up: every kernel once, and the graphs of the measured buckets captured.
    graphs.prefill(model, &prompt)?;
    let adapter = o.adapter.as_ref();
    // The base, then the adapter where one is given.
    let variants: Vec<Option<&AdapterWeights>> =
        std::iter::once(None).chain(adapter.map(Some)).collect();
    for &b in &o.batches {
        for &a in &variants {
            graphs.decode(model, b, 2, a)?;
            eager.decode(model, b, 2, a)?;
        }
    }
    let mut rows: Vec<(String, usize, f64, f64)> = Vec::new();
    let pp_rate = median(
        (0..o.runs)
            .map(|_| graphs.prefill(model, &prompt).map(|s| pp as f64 / s))
            .collect::<anyhow::Result<_>>()?,
    );
    rows.push((format!("pp{pp}"), 1, pp_rate, pp_rate));
    let tg = o.decode_tokens;
    for &a in &variants {
        for &b in &o.batches {
            let (mut with, mut without) = (Vec::new(), Vec::new());
            for r in 0..o.runs {
                // Alternating which goes first, run by run.
                for first in [r % 2 == 0, r % 2 == 1] {
                    if first {
                        with.push((b * tg) as f64 / graphs.decode(model, b, tg, a)?);
                    } else {
                        without.push((b * tg) as f64 / eager.decode(model, b, tg, a)?);
                    }
                }
            }
            let name = format!("tg{tg}{}", if a.is_some() { "+a" } else { "" });
            rows.push((name, b, median(with), median(without)));
        }
    }
    let publish = match adapter {
        Some(a) => Some(publish_cost(model, &mut graphs, a, &o.batches)?),
        None => None,
    };
    let per_token = model.weight_bytes_per_token() as f64;
    let bandwidth = copy_bandwidth()?;
    println!(
        "model: {}  device: {device}  weights read per decode step: {:.1} MB  \
         copy bandwidth: {bandwidth:.0} GB/s  tokens drawn on the {}  decode context: {}",
        o.model_path,
        per_token / 1e6,
        if graphs.gpu.draws() { "GPU" } else { "host" },
        o.decode_context
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
    if let Some(p) = &publish {
        println!(
            "publish (batch {}, graphs): the prompts' step through a new version {:.2} ms (its \
             upload and directory slot) against {:.2} ms through one already there; the next \
             decode step {:.2} ms against {:.2} ms; graphs captured {} -> {}",
            p.batch,
            p.first_prompt_ms,
            p.steady_prompt_ms,
            p.first_ms,
            p.steady_ms,
            p.graphs_before,
            p.graphs_after
        );
    }
    let json = serde_json::json!({
        "model": o.model_path,
        "adapter": adapter.map(|a| format!("{:?}", a.layout.config.method)),
        "publish": publish.as_ref().map(|p| serde_json::json!({
            "batch": p.batch, "first_step_ms": p.first_ms, "steady_step_ms": p.steady_ms,
            "first_prompt_step_ms": p.first_prompt_ms, "steady_prompt_step_ms": p.steady_prompt_ms,
            "graphs_before": p.graphs_before, "graphs_after": p.graphs_after,
        })),
        "device": device,
        "tokens_drawn_on_gpu": graphs.gpu.draws(),
        "decode_context": o.decode_context,
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

struct Publish {
    batch: usize,
    first_prompt_ms: f64,
    steady_prompt_ms: f64,
    first_ms: f64,
    steady_ms: f64,
    graphs_before: usize,
    graphs_after: usize,
}

/// A publish during decode at the smallest measured batch: the prompts' step and one decode step
/// through `a` (steady: medians of 5), then through each of 5 new versions (the same layout,
/// other values: the trainer's next; medians); and the graphs captured around them.
fn publish_cost(
    model: &Decoder,
    graphs: &mut Bench,
    a: &AdapterWeights,
    batches: &[usize],
) -> anyhow::Result<Publish> {
    let b = batches.iter().copied().min().unwrap_or(1);
    let steady: Vec<(f64, f64)> = (0..5)
        .map(|_| graphs.decode_timed(model, b, 1, Some(a)))
        .collect::<anyhow::Result<_>>()?;
    let before = graphs.gpu.graphs_captured();
    let mut firsts = Vec::new();
    for k in 1..=5 {
        let params: Vec<f32> = a
            .params
            .iter()
            .map(|p| p * (1.0 + 0.01 * k as f32))
            .collect();
        let next = AdapterWeights::new(a.layout.clone(), params)?;
        firsts.push(graphs.decode_timed(model, b, 1, Some(&next))?);
    }
    let ms = |v: &[(f64, f64)], second: bool| {
        median(
            v.iter()
                .map(|p| if second { p.1 } else { p.0 } * 1e3)
                .collect(),
        )
    };
    Ok(Publish {
        batch: b,
        first_prompt_ms: ms(&firsts, false),
        steady_prompt_ms: ms(&steady, false),
        first_ms: ms(&firsts, true),
        steady_ms: ms(&steady, true),
        graphs_before: before,
        graphs_after: graphs.gpu.graphs_captured(),
    })
}
