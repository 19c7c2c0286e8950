//! Generation without a server: one request through an engine (the same scheduler, forward,
//! sampler and adapter wiring as `serve`, built by `app::generate`), collected synchronously.
//! Used by `flywheel generate`.
//! `decode_batch` times the forward pass alone for `flywheel bench`.

use crate::adapter::registry::AdapterVersion;
use crate::engine::sampler::{SamplingParams, TopLogprob};
use crate::engine::{EngineEvent, EngineHandle, FinishReason, GenerateRequest, StopReason};
use crate::model::decoder::{BatchSeq, Decoder, ForwardBuffers, Logits};
use crate::model::kv_cache::{BlockAllocator, KvCache};
use flywheel_kernels::Cpu;
use std::sync::Arc;
use std::time::Instant;

pub const BLOCK_SIZE: usize = 16;

#[derive(Clone, Debug)]
pub struct GenerateOptions {
    pub max_tokens: usize,
    pub sampling: SamplingParams,
    pub seed: u64,
    /// The adapter version to run through (None: the base model).
    pub adapter: Option<Arc<AdapterVersion>>,
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
    /// Generated tokens; the end-of-sequence token that stopped generation is not included.
    pub token_ids: Vec<u32>,
    pub logprobs: Vec<TokenLogprob>,
    /// "stop" or "length".
    pub finish_reason: &'static str,
    pub timings: Timings,
}

/// Generate from `prompt` through `engine` (one request, collected synchronously), calling
/// `on_token` with each new token. `eos`: the token that ends a sequence (reported, not kept).
/// The caller builds the engine (`app::generate`).
pub fn generate(
    engine: EngineHandle,
    join: std::thread::JoinHandle<()>,
    eos: Option<u32>,
    prompt: &[u32],
    opts: &GenerateOptions,
    mut on_token: impl FnMut(u32),
) -> anyhow::Result<GenerateOutput> {
    let max_tokens = opts.max_tokens;
    let t0 = Instant::now();
    let mut stream = engine.submit(GenerateRequest {
        prompt: prompt.to_vec(),
        n: 1,
        max_tokens,
        sampling: opts.sampling.clone(),
        seed: Some(opts.seed),
        stop: Vec::new(),
        stop_token_ids: Vec::new(),
        ignore_eos: false,
        include_stop_str_in_output: false,
        adapter: opts.adapter.clone(),
        prompt_logprobs: None,
        constraint: None,
        embed: false,
        repetition: None,
        follow: None,
    })?;
    drop(engine);
    let mut out = Vec::new();
    let mut lps = Vec::new();
    let mut first_at = None;
    let finish = loop {
        match stream.rx.blocking_recv() {
            Some(EngineEvent::Token {
                token_id,
                logprob,
                top_logprobs,
                ..
            }) => {
                first_at.get_or_insert_with(Instant::now);
                if Some(token_id) != eos {
                    on_token(token_id);
                }
                out.push(token_id);
                lps.push(TokenLogprob {
                    token_id,
                    logprob,
                    top_logprobs,
                });
            }
            Some(EngineEvent::Finished {
                reason,
                stop_reason,
                ..
            }) => break (reason, stop_reason),
            Some(EngineEvent::PromptLogprobs(_) | EngineEvent::Embedding(_)) => {}
            Some(EngineEvent::Error(e)) => anyhow::bail!("generation failed: {e}"),
            Some(EngineEvent::GrammarFailed(e)) => anyhow::bail!("generation failed: {e}"),
            None => anyhow::bail!("the engine stopped"),
        }
    };
    let end = Instant::now();
    drop(stream);
    let _ = join.join();
    let finish_reason = match finish {
        (FinishReason::Stop, None) | (FinishReason::Stop, Some(StopReason::Token(_))) => {
            // The end-of-sequence token is reported, not kept.
            out.pop();
            lps.pop();
            "stop"
        }
        (FinishReason::Stop, Some(StopReason::Text(_))) => "stop",
        (FinishReason::Length, _) => "length",
        (FinishReason::Repetition, _) => "repetition",
    };
    let first = first_at.unwrap_or(end);
    let prompt_seconds = (first - t0).as_secs_f64();
    let decode_seconds = (end - first).as_secs_f64();
    let decoded = out.len().saturating_sub(1);
    let timings = Timings {
        prompt_tokens: prompt.len(),
        prompt_seconds,
        prompt_tokens_per_second: prompt.len() as f64 / prompt_seconds.max(1e-9),
        decode_tokens: out.len(),
        decode_seconds,
        decode_tokens_per_second: decoded as f64 / decode_seconds.max(1e-9),
    };
    Ok(GenerateOutput {
        token_ids: out,
        logprobs: lps,
        finish_reason,
        timings,
    })
}

/// Decode `steps` tokens for each of `batch` sequences (each after its own short prompt) as one
/// packed batch per step; returns seconds spent decoding. Greedy, for benchmarking the forward.
pub fn decode_batch(
    model: &Decoder,
    cpu: &Cpu,
    prompts: &[Vec<u32>],
    steps: usize,
    adapter: Option<&crate::adapter::AdapterWeights>,
) -> anyhow::Result<f64> {
    let bs = BLOCK_SIZE;
    let need: usize = prompts.iter().map(|p| (p.len() + steps).div_ceil(bs)).sum();
    let mut cache = KvCache::with_dtype(
        model.config.num_layers,
        model.config.kv_dim(),
        bs,
        need,
        model.kv_dtype,
    );
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
            window_table: &[],
            logits: Logits::Last,
            adapter,
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
                window_table: &[],
                logits: Logits::Last,
                adapter,
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
