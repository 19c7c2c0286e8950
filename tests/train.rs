//! The training forward and backward on tiny generated models: the log-probs a completion was
//! served with equal the training forward's to the bit (same temperature arithmetic), and the
//! whole model's adapter gradient (OFT and LoRA, through every layer of the frozen quantized base)
//! equals finite differences of the objective.

mod common;

use common::adapters::{lora, oft};
use common::served::{adapter, served_equals_trained};
use common::{write_tiny, TinySpec};
use flywheel::adapter::{AdapterBase, AdapterWeights, Target};
use flywheel::kernels::cpu::Precision;
use flywheel::kernels::{Cpu, Isa, ThreadPool};
use flywheel::model::decoder::{Decoder, TrainSeq, ACTIVATION_BUDGET, HEAD_CHUNK};
use flywheel::model::kv_cache::KvDtype;
use flywheel::train::pack::Packed;
use std::time::Duration;

fn cpu(isa: Isa) -> Cpu {
    Cpu::new(isa, ThreadPool::new(2, Duration::from_micros(50)))
}

#[test]
fn served_log_probs_equal_the_training_forward_bitwise() {
    for spec in TinySpec::families() {
        served_equal_training(&spec, Precision::Exact);
    }
}

/// The same on the BF16 products (both sides take them), which really change the arithmetic.
#[test]
fn served_log_probs_equal_the_training_forward_bitwise_in_bf16() {
    if let Err(e) = Cpu::detect().with_precision(Precision::Bf16) {
        eprintln!("BF16 path skipped: {e}");
        return;
    }
    for spec in TinySpec::families() {
        let exact = served_equal_training(&spec, Precision::Exact);
        let bf16 = served_equal_training(&spec, Precision::Bf16);
        assert_ne!(exact, bf16, "{}: BF16 products changed nothing", spec.arch);
    }
}

/// The same on the int8 products (activations quantized per block of 32, as llama.cpp): both
/// sides take them, the head stays exact.
#[test]
fn served_log_probs_equal_the_training_forward_bitwise_in_int8() {
    if let Err(e) = Cpu::detect().with_precision(Precision::Int8) {
        eprintln!("int8 path skipped: {e}");
        return;
    }
    for spec in TinySpec::families() {
        let exact = served_equal_training(&spec, Precision::Exact);
        let int8 = served_equal_training(&spec, Precision::Int8);
        assert_ne!(exact, int8, "{}: int8 products changed nothing", spec.arch);
    }
}

/// The same on a model of every K-quant and IQ4 type (`TinySpec::k_and_iq`), exact and in int8
/// (Q3_K, Q4_K, Q5_K and Q6_K take it).
#[test]
fn served_log_probs_equal_the_training_forward_bitwise_on_the_k_and_iq_types() {
    let spec = TinySpec::k_and_iq();
    let exact = served_equal_training(&spec, Precision::Exact);
    if Cpu::detect().with_precision(Precision::Int8).is_ok() {
        let int8 = served_equal_training(&spec, Precision::Int8);
        assert_ne!(exact, int8, "int8 products changed nothing");
    }
}

/// The same with an f16 KV cache (the server's default): K and V rounded to halves on both
/// sides; the log-probs move a little from the f32 cache's, never apart between serving and
/// training.
#[test]
fn served_log_probs_equal_the_training_forward_bitwise_with_an_f16_kv_cache() {
    for spec in TinySpec::families() {
        let f32_kv = served_equal_training(&spec, Precision::Exact);
        let f16_kv = served_equal_training_kv(&spec, Precision::Exact, KvDtype::F16);
        assert_ne!(
            f32_kv, f16_kv,
            "{}: the f16 cache changed nothing",
            spec.arch
        );
        // The first token is drawn from the same context: its log-prob agrees closely.
        let (a, b) = (&f32_kv[0], &f16_kv[0]);
        let close = (a[0] - b[0]).abs() < 0.01;
        assert!(close, "{}: {a:?} vs {b:?}", spec.arch);
    }
}

/// Serves three completions per adapter kind and checks the training forward's log-probs equal
/// the served ones to the bit; returns the served log-probs.
fn served_equal_training(spec: &TinySpec, precision: Precision) -> Vec<Vec<f32>> {
    served_equal_training_kv(spec, precision, KvDtype::F32)
}

fn served_equal_training_kv(spec: &TinySpec, precision: Precision, kv: KvDtype) -> Vec<Vec<f32>> {
    let (_dir, path) = write_tiny(spec);
    let served = served_equals_trained(&path, precision, kv);
    // Enough tokens for the LM head's chunks to split each kind's training batch.
    for kind in served.chunks(3) {
        let scored: usize = kind.iter().map(Vec::len).sum();
        assert!(
            scored > HEAD_CHUNK,
            "{}: {scored} scored tokens: one head chunk only",
            spec.arch
        );
    }
    served
}

/// J = Σ completion log-probs; dJ/dθ from the backward against central differences of J (reference
/// kernels, f64 sums) on a sample of parameters from every layer and target.
#[test]
fn adapter_gradients_equal_finite_differences() {
    for spec in TinySpec::families() {
        gradients_equal_finite_differences(&spec);
    }
}

fn gradients_equal_finite_differences(spec: &TinySpec) {
    let (_dir, path) = write_tiny(spec);
    let model = Decoder::open(&path).unwrap();
    let c = cpu(Isa::Reference);
    let t1: Vec<u32> = (0..9).map(|t| (t * 29 + 4) % 250 + 3).collect();
    let t2: Vec<u32> = (0..7).map(|t| (t * 13 + 11) % 250 + 3).collect();
    let seqs = [TrainSeq::whole(&t1, 4), TrainSeq::whole(&t2, 2)];
    let layers = model.config.adapter_shape().default_targets();
    let with_head: Vec<Target> = layers.iter().copied().chain([Target::Head]).collect();
    for (name, method, scale, targets) in [
        ("oft", oft(), 0.2f32, &layers),
        ("lora", lora(), 0.3, &layers),
        ("lora-head", lora(), 0.3, &with_head),
    ] {
        let w = adapter(&model, method, targets, 5, scale);
        let temperature = 0.8;
        let j = |w: &AdapterWeights| -> f64 {
            let lp = model.logprobs(&c, &seqs, Some(w), temperature).unwrap();
            lp.iter().flatten().map(|v| *v as f64).sum()
        };
        let g = gradient(
            &model,
            &c,
            &seqs,
            &w,
            temperature,
            ACTIVATION_BUDGET,
            &|_, l| vec![1.0; l],
        );
        let j0 = j(&w);
        let mut checked = 0;
        let mut worst = 0.0f64;
        for m in w.layout.iter_modules() {
            for t in &m.tensors {
                for e in [
                    t.range.start,
                    t.range.start + t.range.len() / 2 + 1,
                    t.range.end - 1,
                ] {
                    // The objective is smooth except where a MoE router's top-k flips: a step
                    // whose one-sided differences disagree straddles a flip and is shortened.
                    let mut num = 0.0;
                    for h in [3e-3f32, 1e-3, 3e-4] {
                        let mut p = w.params.clone();
                        p[e] += h;
                        let up = j(&AdapterWeights::new(w.layout.clone(), p.clone()).unwrap());
                        p[e] -= 2.0 * h;
                        let down = j(&AdapterWeights::new(w.layout.clone(), p).unwrap());
                        num = (up - down) / (2.0 * h as f64);
                        let (fwd, bwd) = ((up - j0) / h as f64, (j0 - down) / h as f64);
                        if (fwd - bwd).abs() < 0.1 + 0.1 * num.abs() {
                            break;
                        }
                    }
                    let err = (num - g[e] as f64).abs();
                    worst = worst.max(err / (1e-2 + num.abs()));
                    assert!(
                        err < 3e-3 + 2e-2 * num.abs(),
                        "{name} {} [{e}]: backward {} vs numeric {num}",
                        t.name,
                        g[e]
                    );
                    checked += 1;
                }
            }
        }
        eprintln!(
            "{} {name}: {checked} parameters, worst relative error {worst:.2e}",
            spec.arch
        );
        assert!(
            g.iter().any(|v| v.abs() > 1e-3),
            "{name}: all gradients vanish"
        );
    }
}

/// dL/dθ for dL/dlog π of token j of sequence i = `gl(i, len)[j]`, keeping `budget` bytes of
/// activations.
fn gradient(
    model: &Decoder,
    c: &Cpu,
    seqs: &[TrainSeq],
    w: &AdapterWeights,
    temperature: f32,
    budget: usize,
    gl: &dyn Fn(usize, usize) -> Vec<f32>,
) -> Vec<f32> {
    let (lp, st) = model
        .train_forward(c, seqs, w, temperature, budget)
        .unwrap();
    let grads: Vec<Vec<f32>> = lp.iter().enumerate().map(|(i, l)| gl(i, l.len())).collect();
    let mut g = vec![0.0f32; w.layout.num_params];
    model
        .train_backward(c, seqs, w, st, &grads, &mut g)
        .unwrap();
    g
}

/// Keeping every layer's activations, some, or none (recomputing the rest from the layer
/// inputs) gives the same gradient to the bit, with the reference and the fast kernels.
#[test]
fn kept_and_recomputed_activations_give_the_same_gradient() {
    for spec in TinySpec::families() {
        kept_and_recomputed_case(&spec);
    }
}

fn kept_and_recomputed_case(spec: &TinySpec) {
    let (_dir, path) = write_tiny(spec);
    let model = Decoder::open(&path).unwrap();
    let t1: Vec<u32> = (0..21).map(|t| (t * 29 + 4) % 250 + 3).collect();
    let t2: Vec<u32> = (0..13).map(|t| (t * 13 + 11) % 250 + 3).collect();
    let seqs = [TrainSeq::whole(&t1, 6), TrainSeq::whole(&t2, 3)];
    let layers = model.config.num_layers;
    let weight = |i: usize, l: usize| (0..l).map(|j| 0.5 + (i + j) as f32 * 0.3).collect();
    for isa in [Isa::Reference, Isa::detect()] {
        let c = cpu(isa);
        for (name, method) in [("oft", oft()), ("lora", lora())] {
            let w = adapter(
                &model,
                method,
                &model.config.adapter_shape().default_targets(),
                7,
                0.2,
            );
            let (_, st) = model.train_forward(&c, &seqs, &w, 1.1, usize::MAX).unwrap();
            assert_eq!(st.layers_kept, layers);
            let all = gradient(&model, &c, &seqs, &w, 1.1, usize::MAX, &weight);
            assert!(all.iter().any(|v| *v != 0.0));
            // Budgets for none, one and all but one layer.
            let per_layer = model.layer_activation_bytes(t1.len() + t2.len());
            for (budget, want) in [
                (per_layer - 1, 0),
                (per_layer, 1),
                (per_layer * (layers - 1), layers - 1),
            ] {
                let kept = model
                    .train_forward(&c, &seqs, &w, 1.1, budget)
                    .unwrap()
                    .1
                    .layers_kept;
                assert_eq!(kept, want);
                let g = gradient(&model, &c, &seqs, &w, 1.1, budget, &weight);
                let same = g.iter().zip(&all).all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(
                    same,
                    "{name} {isa:?}: keeping {kept} layers changes the gradient"
                );
            }
        }
    }
}

/// A GRPO group's prompt packed once (a prefix sequence the completions continue) gives every
/// completion the log-probs of the unshared batch to the bit, and the same gradient up to the
/// order of the sums.
#[test]
fn a_shared_prompt_equals_the_unshared_batch() {
    let (_dir, path) = write_tiny(&TinySpec::small());
    let model = Decoder::open(&path).unwrap();
    let prompt: Vec<u32> = (0..37).map(|t| (t * 31 + 7) % 250 + 3).collect();
    let other: Vec<u32> = (0..20).map(|t| (t * 7 + 1) % 250 + 3).collect();
    let comps: Vec<Vec<u32>> = (0..3)
        .map(|i| {
            (0..5 + 2 * i)
                .map(|t| (t * 11 + 3 * i + 5) % 250 + 3)
                .collect()
        })
        .collect();
    let samples = [
        (&prompt[..], &comps[0][..]),
        (&other[..], &comps[1][..]),
        (&prompt[..], &comps[1][..]),
        (&prompt[..], &comps[2][..]),
    ];
    let shared = Packed::new(&samples, true);
    let flat = Packed::new(&samples, false);
    assert!(
        shared.num_tokens() < flat.num_tokens(),
        "nothing was shared"
    );
    for isa in [Isa::Reference, Isa::detect()] {
        let c = cpu(isa);
        for (name, method) in [("oft", oft()), ("lora", lora())] {
            let w = adapter(&model, method, &Target::ALL, 21, 0.2);
            let run = |k: &Packed| {
                let seqs = k.seqs();
                let (lp, st) = model
                    .train_forward(&c, &seqs, &w, 0.9, ACTIVATION_BUDGET)
                    .unwrap();
                // A different weight per token, so that a mixed-up sum would show.
                let mut gl: Vec<Vec<f32>> = vec![Vec::new(); seqs.len()];
                for (i, &q) in k.of_sample.iter().enumerate() {
                    gl[q] = (0..lp[q].len())
                        .map(|j| 1.0 + (i + j) as f32 * 0.25)
                        .collect();
                }
                let mut g = vec![0.0f32; w.layout.num_params];
                model
                    .train_backward(&c, &seqs, &w, st, &gl, &mut g)
                    .unwrap();
                let per_sample: Vec<Vec<f32>> =
                    k.of_sample.iter().map(|&q| lp[q].clone()).collect();
                (per_sample, g)
            };
            let (lp_s, g_s) = run(&shared);
            let (lp_f, g_f) = run(&flat);
            for (a, b) in lp_s.iter().zip(&lp_f) {
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(a), bits(b), "{name} {isa:?}: log-probs differ");
            }
            let norm = g_f.iter().map(|v| (*v as f64).powi(2)).sum::<f64>().sqrt();
            let diff = g_s
                .iter()
                .zip(&g_f)
                .map(|(a, b)| ((a - b) as f64).powi(2))
                .sum::<f64>()
                .sqrt();
            eprintln!("{name} {isa:?}: |g| {norm:.3e}, |shared − unshared| {diff:.3e}");
            assert!(norm > 1e-3, "{name}: the gradient vanishes");
            assert!(diff <= 3e-6 * norm, "{name} {isa:?}: {diff} vs {norm}");
        }
    }
}
