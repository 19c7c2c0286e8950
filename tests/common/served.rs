//! Serving then training on one file: three completions per adapter kind (OFT, LoRA, LoRA with
//! the LM head) at three temperatures, and the training forward's log-probs of them against the
//! served ones, to the bit (tests/train.rs on every family, precision and KV type;
//! tests/llamacpp_families.rs on llama-quantize's presets).

use super::adapters::{lora, oft};
use super::Rng;
use flywheel::adapter::registry::Registry;
use flywheel::adapter::{
    AdapterBase, AdapterConfig, AdapterLayout, AdapterWeights, Method, Target,
};
use flywheel::app::Base;
use flywheel::engine::sampler::SamplingParams;
use flywheel::generate::GenerateOptions;
use flywheel::kernels::cpu::Precision;
use flywheel::kernels::Cpu;
use flywheel::metrics::Metrics;
use flywheel::model::decoder::{Decoder, TrainSeq, ACTIVATION_BUDGET};
use flywheel::model::kv_cache::KvDtype;
use flywheel::model::tokenizer::Tokenizer;
use std::path::Path;
use std::sync::Arc;

/// Random adapter weights (`scale` times uniform noise) of `method` on `targets`.
pub fn adapter(
    model: &Decoder,
    method: Method,
    targets: &[Target],
    seed: u64,
    scale: f32,
) -> AdapterWeights {
    let cfg = AdapterConfig {
        method,
        targets: targets.to_vec(),
        base_model: String::new(),
    };
    let layout = Arc::new(AdapterLayout::new(cfg, &model.config).unwrap());
    let params = Rng(seed).vec(layout.num_params, scale);
    AdapterWeights::new(layout, params).unwrap()
}

/// Serves three completions per adapter kind from the model at `path` and checks the training
/// forward's log-probs equal the served ones to the bit; returns the served log-probs (three
/// sequences per kind, in order: OFT, LoRA, LoRA with the head).
pub fn served_equals_trained(path: &Path, precision: Precision, kv: KvDtype) -> Vec<Vec<f32>> {
    let detect = || Cpu::detect().with_precision(precision).unwrap();
    let mut served_all = Vec::new();
    let mut model = Decoder::open(path).unwrap();
    model.kv_dtype = kv;
    let model = Arc::new(model);
    let tok = Arc::new(Tokenizer::from_gguf(&model.gguf).unwrap());
    let base = Base {
        model: model.clone(),
        tokenizer: tok,
        cpu: Arc::new(detect()),
    };
    let reg = Registry::new(&model.config, Vec::new(), Arc::new(Metrics::new()));
    let layers = model.config.adapter_shape().default_targets();
    let with_head: Vec<Target> = layers.iter().copied().chain([Target::Head]).collect();
    for (kind, method, targets) in [
        ("oft", oft(), &layers),
        ("lora", lora(), &layers),
        ("lora-head", lora(), &with_head),
    ] {
        let w = adapter(&model, method, targets, 9, 0.1);
        let v = reg.publish(kind, w).unwrap().0;
        let mut seqs = Vec::new();
        for (i, temperature) in [0.7f32, 1.0, 1.3].into_iter().enumerate() {
            let prompt: Vec<u32> = (0..5 + 3 * i as u32)
                .map(|t| (t * 17 + i as u32) % 250 + 3)
                .collect();
            let opts = GenerateOptions {
                // Enough tokens for the LM head's chunks to split the batch (tests/train.rs
                // asserts it on its models).
                max_tokens: 80,
                sampling: SamplingParams {
                    temperature,
                    ..Default::default()
                },
                seed: 40 + i as u64,
                adapter: Some(v.clone()),
            };
            let out = flywheel::app::generate(&base, &prompt, &opts, None, |_| {}).unwrap();
            served_all.push(out.logprobs.iter().map(|l| l.logprob).collect());
            seqs.push((prompt, out.token_ids, out.logprobs, temperature));
        }
        // Each temperature is its own training batch of all three sequences (packed together).
        for &(_, _, _, temperature) in &seqs {
            let toks: Vec<Vec<u32>> = seqs
                .iter()
                .map(|(p, c, _, _)| [p.clone(), c.clone()].concat())
                .collect();
            let batch: Vec<TrainSeq> = seqs
                .iter()
                .zip(&toks)
                .map(|((p, _, _, _), t)| TrainSeq::whole(t, p.len()))
                .collect();
            let c = detect().background();
            let (logps, _) = model
                .train_forward(&c, &batch, &v.weights, temperature, ACTIVATION_BUDGET)
                .unwrap();
            let plain = model
                .logprobs(&c, &batch, Some(&v.weights), temperature)
                .unwrap();
            assert_eq!(
                logps, plain,
                "the training forward's log-probs are the plain forward's"
            );
            for ((_, c, served, t), lp) in seqs.iter().zip(&logps) {
                if *t != temperature {
                    continue;
                }
                assert_eq!(lp.len(), c.len());
                for (s, l) in served.iter().zip(lp) {
                    assert_eq!(
                        s.logprob.to_bits(),
                        l.to_bits(),
                        "{kind} T={t}: served {} vs trained {l}",
                        s.logprob
                    );
                }
            }
        }
    }
    served_all
}
