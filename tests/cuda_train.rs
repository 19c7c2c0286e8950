//! The training forward on the GPU (feature `cuda`, on a GPU): `GpuDecoder::logprobs` against
//! the log-probs the GPU served (drawn in prefill and decode graphs) and the CPU's training
//! log-probs. Without a GPU the test says so and passes (FLYWHEEL_REQUIRE_GPU=1: fail).
#![cfg(feature = "cuda")]

mod common;

use common::gpu::{adapter, batch, gpu, max_diff, methods, shape, Seq, BLOCKS, BS};
use common::{write_tiny, Rng, TinySpec};
use flywheel::kernels::cuda::{DrawSpec, Truncate};
use flywheel::kernels::{Cpu, Isa, ThreadPool};
use flywheel::model::decoder::{
    Decoder, ForwardBuffers, GpuDecoder, Logits, RowOut, RowsBack, TrainSeq,
};
use std::time::Duration;

/// The training forward on the GPU (`GpuDecoder::logprobs`) gives each completion the log-probs
/// it was served with on the GPU, bit for bit (every dense family; OFT, LoRA and LoRA on the LM
/// head; greedy and at temperatures): the served ones drawn on the device in a prefill (eager)
/// and decode steps (graphs, padded buckets), the trainer's from one eager step of the whole
/// sequence — alone, and packed after another sequence with its first block shared as a prefix
/// (the batch-invariant kernels: a row's log-prob is its own whatever the batch). The CPU's
/// training log-probs (`Decoder::logprobs`) are within f32 rounding of them. A mixture of experts
/// too (routed on the device in every step; grouped by expert in the training step, row by row in
/// decode); Gemma 2 (its logits' soft-cap is the host's) is refused by name.
#[test]
fn training_log_probs_on_the_gpu_are_the_served_ones() {
    if gpu().is_none() {
        return;
    }
    for spec in TinySpec::families() {
        train_equals_serve(&spec);
    }
}

fn train_equals_serve(spec: &TinySpec) {
    let (_dir, path) = write_tiny(spec);
    let model = Decoder::open(&path).unwrap();
    let c = model.config.clone();
    let what = spec.arch;
    let cpu = Cpu::new(Isa::detect(), ThreadPool::new(2, Duration::from_micros(50)));
    let mut g = GpuDecoder::new(gpu().unwrap(), &model, shape(true)).unwrap();
    let vocab = c.vocab_size;
    if c.final_softcap.is_some() {
        let seq = [TrainSeq::whole(&[1, 2, 3], 2)];
        let err = g.logprobs(&model, &seq, &[40, 41], None, 1.0);
        assert!(
            matches!(&err, Err(e) if e.to_string().contains("soft-capped")),
            "{what}: {err:?}"
        );
        return;
    }
    let (lora, oft) = methods();
    // Sequence 0 plain and greedy, 1 through OFT at T 0.7, 2 through LoRA (the head's too) at
    // T 1, 3 plain at T 1.3: prompts of 6 tokens, blocks 8 each (0..32).
    let adapters = [
        None,
        Some(adapter(&model, oft, 11, false)),
        Some(adapter(&model, lora, 12, true)),
        None,
    ];
    let temps = [None, Some(0.7f32), Some(1.0), Some(1.3)];
    let mut rng = Rng(spec.seed ^ 0x5eed);
    let mut seqs: Vec<Seq> = (0..4)
        .map(|i| Seq {
            tokens: (0..6).map(|_| (rng.next() % vocab as u64) as u32).collect(),
            table: (0..8).map(|b| (i * 8 + b) as u32).collect(),
            adapter: adapters[i].clone(),
        })
        .collect();
    let mut served: Vec<Vec<f32>> = vec![Vec::new(); 4];
    let uniform = |rng: &mut Rng| (rng.next() >> 11) as f64 / (1u64 << 53) as f64;
    for n in 0..7 {
        // The prompts, then decode steps of all four, then of the first three (bucket 4 padded).
        let k = if n < 4 { 4 } else { 3 };
        let new = if n == 0 { 6 } else { 1 };
        let steps: Vec<(usize, usize, Logits)> = (0..k).map(|i| (i, new, Logits::Last)).collect();
        let b = batch(&seqs, &steps);
        let specs: Vec<RowOut> = (0..k)
            .map(|i| {
                RowOut::Drawn(DrawSpec {
                    row: i as u32,
                    sample: temps[i].map(|t| (t, uniform(&mut rng))),
                    top: 0,
                    truncate: Truncate::NONE,
                })
            })
            .collect();
        let (mut bufs, mut back) = (ForwardBuffers::default(), RowsBack::default());
        g.forward_drawing(&model, &b, &specs, &mut bufs, &mut back)
            .unwrap();
        for (i, d) in back.drawn.iter().enumerate() {
            seqs[i].tokens.push(d.token);
            served[i].push(d.logprob);
        }
    }
    assert!(g.graphs_captured() > 0, "{what}: decode through graphs");
    // Bits: the kernels are batch-invariant.
    let same = |a: &[f32], b: &[f32], how: &str| {
        assert_eq!(a.len(), b.len(), "{what} {how}");
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(a), bits(b), "{what} {how}: {a:?} against {b:?}");
    };
    let free: Vec<u32> = (32..BLOCKS as u32).rev().collect();
    for i in 0..4 {
        let s = &seqs[i];
        let adapter = s.adapter.as_deref();
        let t = temps[i].unwrap_or(1.0);
        let alone = [TrainSeq::whole(&s.tokens, 6)];
        let lp = g.logprobs(&model, &alone, &free, adapter, t).unwrap();
        same(&lp[0], &served[i], &format!("sequence {i} alone"));
        // After another sequence, its first block (4 of its 6 prompt tokens) a shared prefix.
        let other = &seqs[(i + 1) % 4].tokens;
        let packed = [
            TrainSeq::whole(other, 3),
            TrainSeq {
                tokens: &s.tokens[..BS],
                prompt_len: BS,
                prefix: None,
            },
            TrainSeq {
                tokens: &s.tokens[BS..],
                prompt_len: 6 - BS,
                prefix: Some(1),
            },
        ];
        assert!(flywheel::model::decoder::blocks_of(&packed, BS) <= free.len());
        let lp = g.logprobs(&model, &packed, &free, adapter, t).unwrap();
        assert!(lp[1].is_empty(), "{what}: the prefix scores nothing");
        same(&lp[2], &served[i], &format!("sequence {i} packed"));
        let on_cpu = model.logprobs(&cpu, &alone, adapter, t).unwrap();
        assert!(
            max_diff(&on_cpu[0], &served[i]) <= 2e-3,
            "{what} sequence {i}: the CPU's {:?}, the GPU's {:?}",
            on_cpu[0],
            served[i]
        );
    }
    // Blocks it was not given, or too few, are refused.
    let alone = [TrainSeq::whole(&seqs[0].tokens, 6)];
    assert!(g.logprobs(&model, &alone, &free[..2], None, 1.0).is_err());
    assert!(g
        .logprobs(&model, &alone, &[BLOCKS as u32; 8], None, 1.0)
        .is_err());
}
