//! Every model family against transformers and PEFT: tiny random models built with transformers
//! and converted by llama.cpp's own converter (so its tensor names, Q/K permutation, Gemma's
//! 1 + w norms and stacked experts are what this build reads), with transformers' log-probs (f64)
//! at every position, PEFT LoRA and OFT adapters saved by PEFT, their log-probs and autograd's
//! gradients of the completion's log-probs. Written by scripts/hf_families_fixture.py (torch is
//! not needed here).

mod common;

use common::logprobs_all;
use flywheel::adapter::peft;
use flywheel::kernels::{Cpu, Isa, ThreadPool};
use flywheel::model::decoder::{Decoder, TrainSeq, ACTIVATION_BUDGET};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

const FAMILIES: [&str; 6] = ["qwen2", "qwen3", "qwen3moe", "llama3", "gemma3", "gemma2"];

#[derive(serde::Deserialize)]
struct Expected {
    family: String,
    tokens: Vec<u32>,
    prompt_len: usize,
    /// log-softmax at every position (f64).
    base: Vec<Vec<f64>>,
    /// Each adapter's log-probs of the completion tokens.
    adapters: HashMap<String, Vec<f64>>,
}

fn dir(family: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/hf")
        .join(family)
}

fn cpus() -> Vec<Cpu> {
    let mut v = vec![Cpu::new(
        Isa::Reference,
        ThreadPool::new(1, Duration::from_micros(50)),
    )];
    v.push(Cpu::detect());
    v
}

fn expected(family: &str) -> Expected {
    let text = std::fs::read_to_string(dir(family).join("expected.json")).unwrap();
    let e: Expected = serde_json::from_str(&text).unwrap();
    assert_eq!(e.family, family);
    e
}

#[test]
fn every_family_gives_transformers_log_probs() {
    for family in FAMILIES {
        let e = expected(family);
        let model = Decoder::open(dir(family).join("model.gguf")).unwrap();
        for cpu in cpus() {
            let got = logprobs_all(&model, &cpu, &e.tokens, None);
            let d = got
                .iter()
                .zip(&e.base)
                .flat_map(|(a, b)| a.iter().zip(b).map(|(x, y)| (*x as f64 - y).abs()))
                .fold(0.0, f64::max);
            eprintln!(
                "{family} {:?}: max |Δ log-prob| vs transformers {d:.2e} ({} positions × {})",
                cpu.isa,
                got.len(),
                got[0].len()
            );
            assert_eq!(got.len(), e.base.len());
            assert!(d < 5e-5, "{family} {:?}: {d}", cpu.isa);
        }
    }
}

#[test]
fn every_family_gives_pefts_adapter_log_probs_and_gradients() {
    for family in FAMILIES {
        let e = expected(family);
        let model = Decoder::open(dir(family).join("model.gguf")).unwrap();
        let seqs = [TrainSeq::whole(&e.tokens, e.prompt_len)];
        for kind in ["lora", "oft"] {
            let w = peft::load(&dir(family).join(kind), &model.config).unwrap();
            let bytes =
                std::fs::read(dir(family).join(format!("grads_{kind}.safetensors"))).unwrap();
            // PEFT's gradients in this build's layout (the same row permutation as the weights).
            let want = peft::from_safetensors(w.layout.config.clone(), &bytes, &model.config)
                .unwrap()
                .params;
            let scale = want.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            for cpu in cpus() {
                let lp = model.logprobs(&cpu, &seqs, Some(&w), 1.0).unwrap();
                let d = lp[0]
                    .iter()
                    .zip(&e.adapters[kind])
                    .map(|(a, b)| (*a as f64 - b).abs())
                    .fold(0.0, f64::max);
                let (lp2, st) = model
                    .train_forward(&cpu, &seqs, &w, 1.0, ACTIVATION_BUDGET)
                    .unwrap();
                let mut g = vec![0.0f32; w.layout.num_params];
                let ones = vec![vec![1.0f32; lp2[0].len()]];
                model
                    .train_backward(&cpu, &seqs, &w, st, &ones, &mut g)
                    .unwrap();
                let dg = g
                    .iter()
                    .zip(&want)
                    .map(|(a, b)| (a - b).abs())
                    .fold(0.0f32, f32::max);
                eprintln!(
                    "{family} {kind} {:?}: log-probs within {d:.2e} of PEFT's, {} gradients \
                     within {:.2e} of autograd's (largest {scale:.2e})",
                    cpu.isa,
                    g.len(),
                    dg / scale
                );
                assert_eq!(lp[0].len(), e.adapters[kind].len());
                assert!(d < 5e-5, "{family} {kind} {:?}: log-probs {d}", cpu.isa);
                assert!(
                    dg <= 1e-4 * scale,
                    "{family} {kind} {:?}: gradients differ by {dg} (scale {scale})",
                    cpu.isa
                );
            }
        }
    }
}
