//! The engine's training forward (`EngineHandle::logprobs`, run between serving steps on the
//! device the engine serves on): the log-probs of completions it served, as served, bit for bit
//! (greedy, at temperatures, through an adapter, several sequences a job, the choices of an
//! `n` > 1 request, a request with a penalty) while other requests
//! go on; a job the forward refuses is answered with the reason. On the CPU always; built with
//! `cuda` on a machine with a GPU, on the GPU too (there in parts of at most a step's tokens, in
//! blocks of the engine's own cache).

mod common;

use common::{write_tiny, Rng, TinySpec};
use flywheel::adapter::registry::Registry;
use flywheel::adapter::{AdapterConfig, AdapterLayout, AdapterWeights, LoraConfig, Method, Target};
use flywheel::engine::device::Device;
use flywheel::engine::sampler::SamplingParams;
use flywheel::engine::{Engine, EngineConfig, EngineEvent, GenerateRequest, RequestStream};
use flywheel::kernels::{Cpu, Isa, ThreadPool};
use flywheel::metrics::Metrics;
use flywheel::model::decoder::{Decoder, TrainSeq};
use flywheel::model::tokenizer::Tokenizer;
use std::sync::Arc;
use std::time::Duration;

fn request(prompt: &[u32], temperature: f32, seed: u64, max_tokens: usize) -> GenerateRequest {
    GenerateRequest {
        prompt: prompt.to_vec(),
        n: 1,
        max_tokens,
        sampling: SamplingParams {
            temperature,
            ..SamplingParams::default()
        },
        seed: Some(seed),
        stop: Vec::new(),
        stop_token_ids: Vec::new(),
        ignore_eos: true,
        include_stop_str_in_output: false,
        adapter: None,
        prompt_logprobs: None,
        constraint: None,
        embed: false,
        repetition: None,
        follow: None,
    }
}

/// The tokens and log-probs a stream served, to its end.
fn collect(s: RequestStream) -> (Vec<u32>, Vec<f32>) {
    collect_choices(s, 1).remove(0)
}

/// Each of a stream's `n` choices' tokens and log-probs, to the end of every one.
fn collect_choices(mut s: RequestStream, n: usize) -> Vec<(Vec<u32>, Vec<f32>)> {
    let mut out = vec![(Vec::new(), Vec::new()); n];
    let mut left = n;
    while left > 0 {
        match s.rx.blocking_recv() {
            Some(EngineEvent::Token {
                choice,
                token_id,
                logprob,
                ..
            }) => {
                out[choice].0.push(token_id);
                out[choice].1.push(logprob);
            }
            Some(EngineEvent::Finished { .. }) => left -= 1,
            Some(EngineEvent::PromptLogprobs(_)) => {}
            other => panic!("unexpected {other:?}"),
        }
    }
    out
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

fn served_then_scored(device: Device, block_size: usize, what: &str) {
    let (_dir, path) = write_tiny(&TinySpec::llama3());
    let model = Arc::new(Decoder::open(&path).unwrap());
    let tokenizer = Arc::new(Tokenizer::from_gguf(&model.gguf).unwrap());
    let cpu = Arc::new(Cpu::new(
        Isa::detect(),
        ThreadPool::new(2, Duration::from_micros(50)),
    ));
    let metrics = Arc::new(Metrics::new());
    let config = AdapterConfig {
        method: Method::Lora(LoraConfig {
            r: 4,
            alpha: 8.0,
            use_rslora: false,
        }),
        targets: Target::ALL.to_vec(),
        base_model: "tiny".into(),
    };
    let layout = Arc::new(AdapterLayout::new(config, &model.config).unwrap());
    let params = Rng(21).vec(layout.num_params, 0.05);
    let registry = Registry::new(&model.config, vec!["tiny".into()], metrics.clone());
    let (version, _) = registry
        .publish("a", AdapterWeights::new(layout, params).unwrap())
        .unwrap();
    // Serving steps of 32 tokens (a GPU's buffers hold at least 256 a step).
    let cfg = EngineConfig {
        max_num_seqs: 8,
        max_num_batched_tokens: 32,
        num_kv_blocks: 64,
        num_window_blocks: None,
        block_size,
        enable_prefix_caching: false,
        max_pending_requests: 16,
        max_pending_per_client: 16,
    };
    let (engine, join) =
        Engine::start_on(model.clone(), tokenizer, cpu, cfg, metrics, device).unwrap();
    let vocab = model.config.vocab_size as u64;
    let mut rng = Rng(5);
    let prompts: Vec<Vec<u32>> = (0..3)
        .map(|i| {
            (0..[5, 8, 20][i])
                .map(|_| (rng.next() % vocab) as u32)
                .collect()
        })
        .collect();
    // 0: greedy; 1: T 1 through the adapter; 2: T 0.8.
    let temps = [0.0f32, 1.0, 0.8];
    let streams: Vec<RequestStream> = (0..3)
        .map(|i| {
            let mut r = request(&prompts[i], temps[i], 7 + i as u64, 14);
            if i == 1 {
                r.adapter = Some(version.clone());
            }
            engine.submit(r).unwrap()
        })
        .collect();
    let served: Vec<(Vec<u32>, Vec<f32>)> = streams.into_iter().map(collect).collect();
    let whole: Vec<Vec<u32>> = (0..3)
        .map(|i| [prompts[i].clone(), served[i].0.clone()].concat())
        .collect();
    let seq = |i: usize| TrainSeq::whole(&whole[i], prompts[i].len());
    let adapter = Arc::new(version.weights.clone());
    // A long request goes on while the jobs run.
    let long = engine.submit(request(&prompts[2], 1.0, 99, 40)).unwrap();
    // Greedy's log-probs are at T 1, as the sampler reports them.
    let got = engine.logprobs(&[seq(0)], None, 1.0).unwrap();
    assert_eq!(bits(&got[0]), bits(&served[0].1), "{what}: greedy");
    let got = engine
        .logprobs(&[seq(1)], Some(adapter.clone()), 1.0)
        .unwrap();
    assert_eq!(bits(&got[0]), bits(&served[1].1), "{what}: the adapter");
    // Two sequences, the sequence served at T 0.8 among them.
    let got = engine.logprobs(&[seq(2), seq(0)], None, 0.8).unwrap();
    assert_eq!(bits(&got[0]), bits(&served[2].1), "{what}: T 0.8");
    // More than a GPU's step holds (9 × 34 tokens: two parts there).
    let many = engine.logprobs(&[seq(2); 9], None, 0.8).unwrap();
    assert!(
        many.iter().all(|m| bits(m) == bits(&served[2].1)),
        "{what}: in parts"
    );
    assert_eq!(got[1].len(), served[0].1.len());
    // Its first 16 tokens a shared prefix (whole blocks of the CPU trainer's 16; a cache of
    // blocks of 32 computes it with the sequence instead): the same bits.
    let shared = [
        TrainSeq::whole(&whole[2][..16], 16),
        TrainSeq {
            tokens: &whole[2][16..],
            prompt_len: prompts[2].len() - 16,
            prefix: Some(0),
        },
    ];
    let got_shared = engine.logprobs(&shared, None, 0.8).unwrap();
    assert!(got_shared[0].is_empty());
    assert_eq!(bits(&got_shared[1]), bits(&served[2].1), "{what}: a prefix");
    let on_cpu = model
        .logprobs(
            &Cpu::new(Isa::detect(), ThreadPool::new(1, Duration::from_micros(50))),
            &[seq(2)],
            None,
            0.8,
        )
        .unwrap();
    let near = on_cpu[0]
        .iter()
        .zip(&got[0])
        .all(|(a, b)| (a - b).abs() <= 2e-3);
    assert!(near, "{what}: the CPU's {:?}, {:?}", on_cpu[0], got[0]);
    // Rows the host samples (beside a GPU with the log-sum-exp the GPU's log-softmax took
    // there): each choice's first token of an n = 3 request (the prompt's row forks), every token
    // of a request with a presence penalty. Their log-probs are the model's, as served.
    let mut forked = request(&prompts[1], 0.9, 31, 10);
    forked.n = 3;
    let mut penalized = request(&prompts[0], 0.7, 32, 10);
    penalized.sampling.presence_penalty = 0.5;
    for (r, n, kind) in [(forked, 3, "forked"), (penalized, 1, "penalized")] {
        let (prompt, t) = (r.prompt.clone(), r.sampling.temperature);
        let choices = collect_choices(engine.submit(r).unwrap(), n);
        for (c, (tokens, lps)) in choices.iter().enumerate() {
            let w = [prompt.clone(), tokens.clone()].concat();
            let got = engine
                .logprobs(&[TrainSeq::whole(&w, prompt.len())], None, t)
                .unwrap();
            assert_eq!(bits(&got[0]), bits(lps), "{what}: {kind}, choice {c}");
        }
    }
    // A job the forward refuses, with its reason.
    let err = engine
        .logprobs(&[TrainSeq::whole(&whole[0], 0)], None, 1.0)
        .unwrap_err();
    assert!(
        err.contains("prompt of at least one token"),
        "{what}: {err}"
    );
    let past = [vocab as u32, 1, 2];
    let err = engine
        .logprobs(&[TrainSeq::whole(&past, 1)], None, 1.0)
        .unwrap_err();
    assert!(err.contains("vocabulary"), "{what}: {err}");
    assert!(engine.logprobs(&[], None, 1.0).unwrap().is_empty());
    let (tokens, _) = collect(long);
    assert_eq!(tokens.len(), 40, "{what}: the long request ran to its end");
    drop(engine);
    join.join().unwrap();
}

#[test]
fn the_engine_scores_completions_as_it_served_them() {
    // The block sizes `serve` takes (the CPU trainer's cache has blocks of 16).
    for block_size in [16, 32, 64] {
        served_then_scored(
            Device::Cpu,
            block_size,
            &format!("cpu, blocks of {block_size}"),
        );
    }
    #[cfg(feature = "cuda")]
    match flywheel::kernels::cuda::Gpu::open(0) {
        Ok(g) => {
            served_then_scored(Device::Cuda(g), 16, "cuda, blocks of 16");
            let g = flywheel::kernels::cuda::Gpu::open(0).unwrap();
            served_then_scored(Device::Cuda(g), 32, "cuda, blocks of 32");
        }
        Err(e) if std::env::var("FLYWHEEL_REQUIRE_GPU").as_deref() == Ok("1") => {
            panic!("FLYWHEEL_REQUIRE_GPU=1 and no GPU: {e}")
        }
        Err(e) => eprintln!("the GPU part skipped: no GPU here ({e})"),
    }
}
