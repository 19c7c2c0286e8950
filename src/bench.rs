//! `flywheel bench`: prompt processing (ppN) and batched decode (tgN) throughput of the forward pass,
//! medians of several runs; with an adapter, every test runs alternately through the base and the
//! adapter in the same invocation and the ratio is printed (the cost of serving through it).

use crate::adapter::{
    peft, AdapterBase, AdapterConfig, AdapterLayout, AdapterWeights, LoraConfig, Method, OftConfig,
};
use crate::generate::{decode_batch, BLOCK_SIZE};
use crate::model::decoder::{BatchSeq, Decoder, Logits};
use crate::model::kv_cache::KvCache;
use crate::model::tokenizer::Tokenizer;
use flywheel_kernels::Cpu;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

pub struct BenchOptions {
    pub model_path: String,
    pub prompt_tokens: usize,
    pub decode_tokens: usize,
    /// Each decode sequence's prompt: the context its decode steps attend to (8 by default).
    pub decode_context: usize,
    pub batches: Vec<usize>,
    pub runs: usize,
    pub busy_peer: bool,
    pub adapter: Option<AdapterWeights>,
    /// What the KV cache stores (the server's default is f16).
    pub kv_dtype: crate::model::kv_cache::KvDtype,
}

/// `oft` (b=32) or `lora` (r=16, α=32) on every projection the model adapts (all seven, or a
/// MoE's attention) with random values, or a PEFT folder.
pub fn adapter_for(model: &Decoder, spec: &str) -> anyhow::Result<AdapterWeights> {
    let method = match spec {
        "oft" => Method::Oft(OftConfig::default()),
        "lora" => Method::Lora(LoraConfig {
            r: 16,
            alpha: 32.0,
            use_rslora: false,
        }),
        path => return Ok(peft::load(std::path::Path::new(path), &model.config)?),
    };
    let cfg = AdapterConfig {
        method,
        targets: model.config.adapter_shape().default_targets(),
        base_model: String::new(),
    };
    let layout = Arc::new(AdapterLayout::new(cfg, &model.config)?);
    let mut rng = crate::util::Rng::new(1);
    let params = (0..layout.num_params)
        .map(|_| ((rng.next_f64() * 2.0 - 1.0) * 0.01) as f32)
        .collect();
    // Building a version (OFT: every R from its parameters; LoRA: Bᵀ) is the publisher's cost.
    let t = Instant::now();
    let w = AdapterWeights::new(layout, params)?;
    eprintln!(
        "adapter version built in {:.1} ms",
        t.elapsed().as_secs_f64() * 1e3
    );
    Ok(w)
}

pub fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// `runs` measurements of `f` for each variant, their order alternating from run to run (A B,
/// B A, ...); the median of each.
fn alternate<'a>(
    runs: usize,
    variants: &[Option<&'a AdapterWeights>],
    mut f: impl FnMut(Option<&'a AdapterWeights>) -> anyhow::Result<f64>,
) -> anyhow::Result<Vec<f64>> {
    let n = variants.len();
    let mut out = vec![Vec::new(); n];
    for r in 0..runs {
        for k in 0..n {
            let v = if r % 2 == 0 { k } else { n - 1 - k };
            out[v].push(f(variants[v])?);
        }
    }
    Ok(out.into_iter().map(median).collect())
}

/// The memory's limit for batch-1 decode, measured now: 256 MB (more than any cache holds, in
/// the pages the weights are in) read by the compute pool; the best of 5 passes.
fn read_bandwidth(cpu: &Cpu, huge_pages: bool) -> anyhow::Result<f64> {
    let mut buf = memmap2::MmapMut::map_anon(256 << 20)?;
    if huge_pages {
        buf.advise(memmap2::Advice::HugePage)?;
    }
    Ok(cpu.pool.read_bandwidth(&mut buf, 5))
}

/// Run the tests and print a table and one JSON line.
pub fn run(model: &Decoder, tok: &Tokenizer, cpu: &Cpu, o: &BenchOptions) -> anyhow::Result<()> {
    let huge = model.gguf.huge_pages();
    let stop = Arc::new(AtomicBool::new(false));
    let peer = o.busy_peer.then(|| {
        let stop = stop.clone();
        std::thread::spawn(move || {
            let mut x = 0u64;
            while !stop.load(Ordering::Relaxed) {
                x = std::hint::black_box(x.wrapping_mul(6364136223846793005).wrapping_add(1));
            }
        })
    });
    let pp = o.prompt_tokens;
    // A prompt of `pp` real tokens: a text repeated and cut.
    let text = tok.encode(
        "The quick brown fox jumps over the lazy dog. Flywheel serves and learns; 12345 tokens of text. ",
    )?;
    let prompt: Vec<u32> = text.iter().cycle().take(pp).copied().collect();
    let table: Vec<u32> = (0..pp.div_ceil(BLOCK_SIZE) as u32).collect();
    let mut cache = KvCache::with_dtype(
        model.config.num_layers,
        model.config.kv_dim(),
        BLOCK_SIZE,
        table.len(),
        o.kv_dtype,
    );
    let variants: Vec<Option<&AdapterWeights>> = match &o.adapter {
        Some(a) => vec![None, Some(a)],
        None => vec![None],
    };
    let mut prefill = |tokens: &[u32], adapter| {
        model.forward(
            cpu,
            &mut cache,
            &[BatchSeq {
                tokens,
                first_pos: 0,
                block_table: &table,
                window_table: &[],
                logits: Logits::Last,
                adapter,
            }],
        )
    };
    // Warm-up: touches the weights and the buffers once.
    for &a in &variants {
        prefill(&prompt[..pp.min(64)], a)?;
    }
    // rows: (test, batch, tokens/s per variant)
    let mut rows: Vec<(String, usize, Vec<f64>)> = Vec::new();
    let pp_rates = alternate(o.runs, &variants, |a| {
        let t = Instant::now();
        prefill(&prompt, a)?;
        Ok(pp as f64 / t.elapsed().as_secs_f64())
    })?;
    rows.push((format!("pp{pp}"), 1, pp_rates));
    let tg = o.decode_tokens;
    for &b in &o.batches {
        // Prompts of --decode-context tokens (8 unless told) at different offsets of the text's,
        // taken round it where longer.
        let len = o.decode_context;
        let prompts: Vec<Vec<u32>> = (0..b)
            .map(|i| (0..len).map(|j| prompt[(i % 7 + j) % pp]).collect())
            .collect();
        let rates = alternate(o.runs, &variants, |a| {
            let secs = decode_batch(model, cpu, &prompts, tg, a)?;
            Ok((b * tg) as f64 / secs)
        })?;
        rows.push((format!("tg{tg}"), b, rates));
    }
    // The memory's limit, after the tests (the same conditions as their last runs).
    let bandwidth = read_bandwidth(cpu, huge)?;
    stop.store(true, Ordering::Relaxed);
    if let Some(p) = peer {
        let _ = p.join();
    }
    let adapter_desc = o.adapter.as_ref().map(|a| {
        let c = &a.layout.config;
        let detail = match &c.method {
            Method::Oft(x) => format!("oft b={}", x.block_size),
            Method::Lora(x) => format!("lora r={}", x.r),
        };
        format!(
            "{detail} on {} projections, {} parameters",
            c.targets.len(),
            a.layout.num_params
        )
    });
    println!(
        "model: {} ({})  kernels: {}  threads: {}  busy peer: {}  adapter: {}  decode context: {}",
        o.model_path,
        if huge { "in 2 MB pages" } else { "mapped" },
        cpu.isa.name(),
        cpu.pool.num_threads(),
        o.busy_peer,
        adapter_desc.as_deref().unwrap_or("none"),
        o.decode_context
    );
    let paths = cpu.paths();
    println!("cpu paths: {paths}");
    let per_token = model.weight_bytes_per_token() as f64;
    let tg1 = rows.iter().find(|(n, b, _)| n.starts_with("tg") && *b == 1);
    let share = tg1.map(|(_, _, t)| t[0] * per_token / 1e9 / bandwidth);
    println!(
        "read bandwidth: {bandwidth:.1} GB/s ({} threads, 256 MB in {} pages, best of 5){}",
        cpu.pool.num_threads(),
        if huge { "2 MB" } else { "4 KB" },
        match (tg1, share) {
            (Some((_, _, t)), Some(s)) => format!(
                "; decode at batch 1 reads {:.1} GB/s of weights: {:.0}% of it",
                t[0] * per_token / 1e9,
                100.0 * s
            ),
            _ => String::new(),
        }
    );
    if o.adapter.is_some() {
        println!(
            "{:<8} {:>6} {:>12} {:>12} {:>8}",
            "test", "batch", "base tok/s", "adapter", "ratio"
        );
        for (name, b, t) in &rows {
            println!(
                "{name:<8} {b:>6} {:>12.1} {:>12.1} {:>8.3}",
                t[0],
                t[1],
                t[1] / t[0]
            );
        }
    } else {
        println!("{:<8} {:>6} {:>12}", "test", "batch", "tokens/s");
        for (name, b, t) in &rows {
            println!("{name:<8} {b:>6} {:>12.1}", t[0]);
        }
    }
    let json = serde_json::json!({
        "model": o.model_path,
        "weights": if huge { "huge_pages" } else { "mmap" },
        "kernels": cpu.isa.name(),
        "cpu_paths": paths,
        "threads": cpu.pool.num_threads(),
        "busy_peer": o.busy_peer,
        "decode_context": o.decode_context,
        "runs": o.runs,
        "adapter": adapter_desc,
        "weight_bytes_per_token": model.weight_bytes_per_token(),
        "read_bandwidth_gbps": bandwidth,
        "decode_batch1_bandwidth_share": share,
        "results": rows.iter().map(|(n, b, t)| {
            let mut r = serde_json::json!({"test": n, "batch": b, "tokens_per_second": t[0]});
            if let Some(a) = t.get(1) {
                r["adapter_tokens_per_second"] = serde_json::json!(a);
                r["adapter_ratio"] = serde_json::json!(a / t[0]);
            }
            r
        }).collect::<Vec<_>>(),
    });
    println!("{json}");
    Ok(())
}

/// Peak resident memory of this process (VmHWM), bytes.
pub fn peak_rss_bytes() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmHWM:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|v| v.parse::<u64>().ok())
        })
        .map_or(0, |kb| kb * 1024)
}

/// The batch `flywheel bench --train` times.
pub struct TrainShape {
    pub batch: usize,
    pub seq_len: usize,
    /// Leading tokens of each sequence that are prompt (not scored).
    pub prompt_len: usize,
    /// One prompt for all sequences, run once (a GRPO group).
    pub shared_prompt: bool,
    /// Bytes of kept activations (`Llama::train_forward`).
    pub activation_budget: usize,
}

/// `flywheel bench --train`: full training steps (forward, backward, AdamW) on `batch` sequences
/// of `seq_len` tokens whose last `seq_len − prompt_len` are scored; tokens/s (sequence tokens,
/// a shared prompt counted once per sequence) of the median step and the peak RSS, as a table
/// and one JSON line.
pub fn run_train(
    model: &Decoder,
    cpu: &Cpu,
    adapter: AdapterWeights,
    shape: &TrainShape,
    runs: usize,
) -> anyhow::Result<()> {
    use crate::train::optim::{AdamW, AdamWConfig};
    use crate::train::pack::Packed;
    let &TrainShape {
        batch,
        seq_len,
        prompt_len,
        shared_prompt,
        activation_budget,
    } = shape;
    anyhow::ensure!(
        prompt_len >= 1 && prompt_len < seq_len,
        "need 1 <= prompt length < sequence length"
    );
    let v = model.config.vocab_size as u64;
    let mut rng = crate::util::Rng::new(7);
    let mut toks: Vec<Vec<u32>> = (0..batch)
        .map(|_| (0..seq_len).map(|_| (rng.next_u64() % v) as u32).collect())
        .collect();
    if shared_prompt {
        let p = toks[0][..prompt_len].to_vec();
        for t in &mut toks {
            t[..prompt_len].copy_from_slice(&p);
        }
    }
    let pairs: Vec<(&[u32], &[u32])> = toks.iter().map(|t| t.split_at(prompt_len)).collect();
    let packed = Packed::new(&pairs, shared_prompt);
    let seqs = packed.seqs();
    let layout = adapter.layout.clone();
    let mut params = adapter.params.clone();
    let mut weights = adapter;
    let mut opt = AdamW::new(AdamWConfig::default(), layout.num_params);
    let mut times = Vec::new();
    for _ in 0..runs + 1 {
        let t0 = Instant::now();
        let (logps, st) = model.train_forward(cpu, &seqs, &weights, 1.0, activation_budget)?;
        let g: Vec<Vec<f32>> = logps
            .iter()
            .map(|l| vec![-1.0 / l.len().max(1) as f32; l.len()])
            .collect();
        let mut grads = vec![0.0f32; layout.num_params];
        model.train_backward(cpu, &seqs, &weights, st, &g, &mut grads)?;
        opt.step(&mut params, &mut grads);
        weights = AdapterWeights::new(layout.clone(), params.clone())?;
        times.push(t0.elapsed().as_secs_f64());
    }
    times.remove(0); // warm-up
    let step = median(times);
    let tps = (batch * seq_len) as f64 / step;
    let rss = peak_rss_bytes();
    println!(
        "kernels: {}  threads: {}  adapter: {} ({} parameters)",
        cpu.isa.name(),
        cpu.pool.num_threads(),
        layout.config.method.kind(),
        layout.num_params
    );
    let paths = cpu.paths();
    println!("cpu paths: {paths}");
    println!(
        "{:<10} {:>8} {:>8} {:>8} {:>12} {:>14} {:>14}",
        "batch", "seq_len", "scored", "shared", "step s", "tokens/s", "peak RSS MB"
    );
    println!(
        "{batch:<10} {seq_len:>8} {:>8} {:>8} {step:>12.2} {tps:>14.1} {:>14.0}",
        seq_len - prompt_len,
        if shared_prompt { prompt_len } else { 0 },
        rss as f64 / 1e6
    );
    println!(
        "{}",
        serde_json::json!({"tokens_per_second": tps, "peak_rss_bytes": rss, "step_seconds": step, "batch": batch, "seq_len": seq_len, "prompt_len": prompt_len, "shared_prompt": shared_prompt, "forward_tokens": packed.num_tokens(), "adapter": layout.config.method.kind(), "kernels": cpu.isa.name(), "cpu_paths": paths, "runs": runs})
    );
    Ok(())
}
