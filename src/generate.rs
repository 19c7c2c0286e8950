//! Generation without a server: prefill a prompt, then decode one or several sequences as one
//! packed batch per step. Used by `flywheel generate` and `flywheel bench`.

use crate::engine::sampler::{sample, Rng, SamplingParams, TopLogprob};
use crate::model::kv_cache::{BlockAllocator, KvCache};
use crate::model::llama::{BatchSeq, ForwardBuffers, Llama, Logits};
use flywheel_kernels::Cpu;
use std::time::Instant;

pub const BLOCK_SIZE: usize = 16;

#[derive(Clone, Debug)]
pub struct GenerateOptions {
    pub max_tokens: usize,
    pub sampling: SamplingParams,
    pub seed: u64,
    /// Token ids that end generation (not included in the output).
    pub stop_ids: Vec<u32>,
}

#[derive(Clone, Debug, serde::Serialize)]
pub struct TokenLogprob {
    pub token_id: u32,
    pub logprob: f32,
    pub top_logprobs: Vec<TopLogprob>,
}

#[derive(Clone, Debug, serde::Serialize)]
pub struct Timings {
    pub prompt_tokens: usize,
    pub prompt_seconds: f64,
    pub prompt_tokens_per_second: f64,
    pub decode_tokens: usize,
    pub decode_seconds: f64,
    pub decode_tokens_per_second: f64,
}

#[derive(Clone, Debug)]
pub struct GenerateOutput {
    pub token_ids: Vec<u32>,
    pub logprobs: Vec<TokenLogprob>,
    /// "stop" or "length".
    pub finish_reason: &'static str,
    pub timings: Timings,
}

/// Generate from `prompt`, calling `on_token` with each new token as it is sampled.
pub fn generate(
    model: &Llama,
    cpu: &Cpu,
    prompt: &[u32],
    opts: &GenerateOptions,
    mut on_token: impl FnMut(u32),
) -> anyhow::Result<GenerateOutput> {
    anyhow::ensure!(!prompt.is_empty(), "the prompt is empty");
    let ctx = model.config.context_length;
    anyhow::ensure!(
        prompt.len() < ctx,
        "the prompt has {} tokens; the context holds {ctx}",
        prompt.len()
    );
    let max_tokens = opts.max_tokens.min(ctx - prompt.len());
    let total = prompt.len() + max_tokens;
    let num_blocks = total.div_ceil(BLOCK_SIZE);
    let mut cache = KvCache::new(
        model.config.num_layers,
        model.config.kv_dim(),
        BLOCK_SIZE,
        num_blocks,
    );
    let mut alloc = BlockAllocator::new(num_blocks);
    let mut table = Vec::new();
    let mut rng = Rng::new(opts.seed);

    let t0 = Instant::now();
    alloc.ensure(&mut table, prompt.len(), BLOCK_SIZE);
    let mut logits = model.forward(
        cpu,
        &mut cache,
        &[BatchSeq {
            tokens: prompt,
            first_pos: 0,
            block_table: &table,
            logits: Logits::Last,
        }],
    )?;
    let prompt_seconds = t0.elapsed().as_secs_f64();

    let t1 = Instant::now();
    let mut out = Vec::new();
    let mut lps = Vec::new();
    let mut finish_reason = "length";
    while out.len() < max_tokens {
        let s = sample(
            cpu,
            &mut logits,
            &opts.sampling,
            &Default::default(),
            &mut rng,
        );
        if opts.stop_ids.contains(&s.token) {
            finish_reason = "stop";
            break;
        }
        out.push(s.token);
        lps.push(TokenLogprob {
            token_id: s.token,
            logprob: s.logprob,
            top_logprobs: s.top,
        });
        on_token(s.token);
        if out.len() == max_tokens {
            break;
        }
        let pos = prompt.len() + out.len() - 1;
        alloc.ensure(&mut table, pos + 1, BLOCK_SIZE);
        logits = model.forward(
            cpu,
            &mut cache,
            &[BatchSeq {
                tokens: &[s.token],
                first_pos: pos,
                block_table: &table,
                logits: Logits::Last,
            }],
        )?;
    }
    let decode_seconds = t1.elapsed().as_secs_f64();
    let timings = Timings {
        prompt_tokens: prompt.len(),
        prompt_seconds,
        prompt_tokens_per_second: prompt.len() as f64 / prompt_seconds.max(1e-9),
        decode_tokens: out.len(),
        decode_seconds,
        decode_tokens_per_second: out.len() as f64 / decode_seconds.max(1e-9),
    };
    Ok(GenerateOutput {
        token_ids: out,
        logprobs: lps,
        finish_reason,
        timings,
    })
}

/// Decode `steps` tokens for each of `batch` sequences (each after its own short prompt) as one
/// packed batch per step; returns seconds spent decoding. Greedy, for benchmarking.
pub fn decode_batch(
    model: &Llama,
    cpu: &Cpu,
    prompts: &[Vec<u32>],
    steps: usize,
) -> anyhow::Result<f64> {
    let bs = BLOCK_SIZE;
    let need: usize = prompts.iter().map(|p| (p.len() + steps).div_ceil(bs)).sum();
    let mut cache = KvCache::new(model.config.num_layers, model.config.kv_dim(), bs, need);
    let mut alloc = BlockAllocator::new(need);
    let mut tables: Vec<Vec<u32>> = vec![Vec::new(); prompts.len()];
    let mut last = Vec::with_capacity(prompts.len());
    // Prefill all prompts in one packed batch.
    for (t, p) in tables.iter_mut().zip(prompts) {
        alloc.ensure(t, p.len(), bs);
    }
    let batch: Vec<BatchSeq> = prompts
        .iter()
        .zip(&tables)
        .map(|(p, t)| BatchSeq {
            tokens: p,
            first_pos: 0,
            block_table: t,
            logits: Logits::Last,
        })
        .collect();
    let logits = model.forward(cpu, &mut cache, &batch)?;
    let v = model.config.vocab_size;
    for i in 0..prompts.len() {
        last.push([crate::engine::sampler::argmax(&logits[i * v..(i + 1) * v])]);
    }
    let mut pos: Vec<usize> = prompts.iter().map(|p| p.len()).collect();
    let mut bufs = ForwardBuffers::default();
    let t0 = Instant::now();
    for _ in 0..steps {
        for (t, p) in tables.iter_mut().zip(&pos) {
            alloc.ensure(t, p + 1, bs);
        }
        let batch: Vec<BatchSeq> = (0..prompts.len())
            .map(|i| BatchSeq {
                tokens: &last[i],
                first_pos: pos[i],
                block_table: &tables[i],
                logits: Logits::Last,
            })
            .collect();
        model.forward_into(cpu, &mut cache, &batch, &mut bufs)?;
        for i in 0..prompts.len() {
            last[i] = [crate::engine::sampler::argmax(
                &bufs.logits[i * v..(i + 1) * v],
            )];
            pos[i] += 1;
        }
    }
    Ok(t0.elapsed().as_secs_f64())
}
