//! The CUDA engine's forward against the CPU's (feature `cuda`, on a GPU): every family (the
//! mixture of experts too, its decode routed on the device),
//! K-quants, both KV cache types, prefill with every kind of logits asked for, decode steps
//! through CUDA graphs (padded buckets) equal to the same steps launched eagerly, and OFT/LoRA
//! adapters in mixed batches (LoRA on the LM head too). Without a GPU the tests say so and pass
//! (FLYWHEEL_REQUIRE_GPU=1: fail).
#![cfg(feature = "cuda")]

mod common;

use common::gpu::{adapter, batch, gpu, max_diff, methods, shape, Seq, BLOCKS, BS};
use common::{write_tiny, Rng, TinySpec};
use flywheel::adapter::{LoraConfig, Method, OftConfig};
use flywheel::kernels::cpu::Precision;
use flywheel::kernels::cuda::{DrawSpec, Gpu, Truncate};
use flywheel::kernels::reference;
use flywheel::kernels::{Cpu, Isa, ThreadPool};
use flywheel::model::decoder::{
    Decoder, ForwardBuffers, GpuDecoder, GpuShape, Logits, RowOut, RowsBack,
};
use flywheel::model::kv_cache::{KvCache, KvDtype};
use std::time::Duration;

/// Prefill (logits of the last token, of every token, hidden states), then decode steps of 2, 3
/// and 5 sequences (buckets 2, 4 and 8, two of them padded), on the CPU and the GPU.
/// `int8`: the products in int8 on both (`Precision::Int8`; each product equal to the CPU's bit
/// for bit, kernels/tests/cuda/int8.rs). The forwards then differ where another op's rounding
/// moves an activation across a code's rounding boundary, one code step (of 254 a block) in one
/// term: within 2e-2 rather than 2e-3, and nearer the CPU's int8 logits than the CPU's exact ones
/// are (so the int8 path ran).
fn compare(spec: &TinySpec, dtype: KvDtype, adapters: bool, int8: bool, g: Gpu) {
    let (_dir, path) = write_tiny(spec);
    let mut model = Decoder::open(&path).unwrap();
    model.kv_dtype = dtype;
    let c = model.config.clone();
    let pool = || ThreadPool::new(2, Duration::from_micros(50));
    let exact = Cpu::new(Isa::detect(), pool());
    let cpu = if int8 {
        Cpu::new(Isa::detect(), pool())
            .with_precision(Precision::Int8)
            .unwrap()
    } else {
        Cpu::new(Isa::detect(), pool())
    };
    let mut cache = KvCache::with_dtype(c.num_layers, c.kv_dim(), BS, BLOCKS, dtype);
    let mut exact_cache = KvCache::with_dtype(c.num_layers, c.kv_dim(), BS, BLOCKS, dtype);
    let mut gl = GpuDecoder::new(
        g,
        &model,
        GpuShape {
            int8,
            ..shape(true)
        },
    )
    .unwrap();
    let (mut to_cpu, mut to_exact) = (0f32, 0f32);
    let mut rng = Rng(spec.seed);
    let mut seqs: Vec<Seq> = (0..5)
        .map(|i| Seq {
            tokens: (0..3 + 2 * i)
                .map(|_| (rng.next() % c.vocab_size as u64) as u32)
                .collect(),
            table: (0..8).map(|b| (i * 8 + b) as u32).rev().collect(),
            adapter: None,
        })
        .collect();
    if adapters {
        let oft = Method::Oft(OftConfig {
            block_size: 16,
            ..OftConfig::default()
        });
        let lora = Method::Lora(LoraConfig {
            r: 4,
            alpha: 8.0,
            use_rslora: false,
        });
        seqs[1].adapter = Some(adapter(&model, oft, 5, false));
        seqs[3].adapter = Some(adapter(&model, lora.clone(), 6, false));
        // LoRA on the LM head too (Tinker's train_unembed): sequences 2 and 4, one version.
        let with_head = adapter(&model, lora, 7, true);
        seqs[2].adapter = Some(with_head.clone());
        seqs[4].adapter = Some(with_head);
    }
    let what = format!(
        "{} ({dtype:?}, adapters {adapters}, int8 {int8})",
        spec.arch
    );
    let mut steps: Vec<Vec<(usize, usize, Logits)>> = vec![vec![
        (0, 3, Logits::Last),
        (1, 5, Logits::All),
        (2, 7, Logits::Hidden),
        (3, 9, Logits::Last),
        (4, 11, Logits::None),
    ]];
    for k in [2usize, 3, 5] {
        steps.push((0..k).map(|i| (i, 1, Logits::Last)).collect());
    }
    for (n, step) in steps.iter().enumerate() {
        if n > 0 {
            for &(i, _, _) in step {
                let t = (rng.next() % c.vocab_size as u64) as u32;
                seqs[i].tokens.push(t);
            }
        }
        let b = batch(&seqs, step);
        let (mut on_cpu, mut on_gpu) = (ForwardBuffers::default(), ForwardBuffers::default());
        model
            .forward_into(&cpu, &mut cache, &b, &mut on_cpu)
            .unwrap();
        gl.forward_into(&model, &b, &mut on_gpu).unwrap();
        // f32 sums in another order through a few layers: logits of magnitude ~10. In int8, an
        // activation within that difference of a rounding boundary takes the other code on one
        // side, every row of its product moves by a code's worth, and later quantizations round
        // differently in turn: on an H200 the k_and_iq model's final hidden states came 0.063
        // apart where int8 and exact ones were 0.090 apart (its logits 0.038 and 0.271; most
        // steps of the other models within 3e-5). So each step is held within the distance
        // between the CPU's int8 and exact forwards, and over all steps the GPU's int8 logits
        // must lie nearer the CPU's int8 ones than exact ones (which a GPU in other arithmetic,
        // exact products for one, would not); the kernels test holds each product to the CPU's
        // bits.
        let (mut tol, mut tol_hidden) = (2e-3f32, 2e-3f32);
        let d = max_diff(&on_gpu.logits, &on_cpu.logits);
        let dh = max_diff(&on_gpu.hidden, &on_cpu.hidden);
        if int8 {
            let mut e = ForwardBuffers::default();
            model
                .forward_into(&exact, &mut exact_cache, &b, &mut e)
                .unwrap();
            let (int8_err, int8_err_hidden, gpu_exact) = (
                max_diff(&on_cpu.logits, &e.logits),
                max_diff(&on_cpu.hidden, &e.hidden),
                max_diff(&on_gpu.logits, &e.logits),
            );
            eprintln!(
                "{what}, step {n}: logits GPU-CPU {d}, CPU int8-exact {int8_err}, GPU-exact \
                 {gpu_exact}; hidden GPU-CPU {dh}, CPU int8-exact {int8_err_hidden}"
            );
            tol = tol.max(int8_err);
            tol_hidden = tol_hidden.max(int8_err_hidden);
            to_cpu += d;
            to_exact += gpu_exact;
        }
        assert!(
            d < tol,
            "{what}, step {n}: logits differ by {d} (bound {tol})"
        );
        assert!(
            dh < tol_hidden,
            "{what}, step {n}: hidden states differ by {dh} (bound {tol_hidden})"
        );
    }
    assert!(
        to_cpu <= to_exact,
        "{what}: the GPU's int8 logits are nearer exact math ({to_exact}) than the CPU's int8 \
         ones ({to_cpu})"
    );
    // Buckets 2, 4 and 8 (a mixture of experts routing on the device), each with the step's
    // adapter signature where it has adapters.
    assert_eq!(gl.graphs_captured(), 3, "{what}");
}

#[test]
fn every_family_forwards_on_the_gpu_as_on_the_cpu() {
    if gpu().is_none() {
        return;
    }
    let mut specs: Vec<TinySpec> = TinySpec::families().into_iter().collect();
    specs.push(TinySpec::k_quants());
    specs.push(TinySpec::k_and_iq());
    specs.push(TinySpec::q5());
    for spec in &specs {
        for dtype in [KvDtype::F16, KvDtype::F32] {
            compare(spec, dtype, false, false, gpu().unwrap());
        }
    }
    for (spec, dtype) in [
        (TinySpec::small(), KvDtype::F16),
        (TinySpec::qwen3(), KvDtype::F32),
    ] {
        compare(&spec, dtype, true, false, gpu().unwrap());
    }
}

/// Int8 products (`--precision int8`) on the GPU against the CPU's int8 forward: every format
/// with an int8 kernel (small's Q4_0, Q4_1, Q8_0 beside f16 and bf16 ones, which stay f32;
/// the K-quants; IQ4), with adapters (OFT rotates a projection's input before it is quantized),
/// and a mixture of experts whose gate, up and down all run in int8.
#[test]
fn int8_forwards_on_the_gpu_as_on_the_cpu() {
    if gpu().is_none() {
        return;
    }
    let cases = [
        (TinySpec::small(), KvDtype::F16, true),
        (TinySpec::k_quants(), KvDtype::F32, false),
        (TinySpec::k_and_iq(), KvDtype::F16, false),
        (moe_int8(), KvDtype::F16, false),
    ];
    for (spec, dtype, adapters) in &cases {
        compare(spec, *dtype, *adapters, true, gpu().unwrap());
    }
}

/// Qwen3-MoE with every expert projection in a format the int8 products take.
fn moe_int8() -> TinySpec {
    use flywheel::kernels::QuantType::*;
    TinySpec {
        formats: [Q4_1, Q4_0, Q8_0, F16, Q4_1, Q4_0, Q8_0, Q8_0],
        ..TinySpec::qwen3moe()
    }
}

/// A decoder through graphs and one launching eagerly, of one model (int8 products or f32).
fn graphs_and_eager(model: &Decoder, int8: bool) -> (GpuDecoder, GpuDecoder) {
    let shape = |graphs| GpuShape {
        int8,
        ..shape(graphs)
    };
    let graphs = GpuDecoder::new(gpu().unwrap(), model, shape(true)).unwrap();
    (
        graphs,
        GpuDecoder::new(gpu().unwrap(), model, shape(false)).unwrap(),
    )
}

/// `count` sequences of 4 random tokens, 8 blocks each.
fn prompts(count: usize, vocab: u64, rng: &mut Rng) -> Vec<Seq> {
    (0..count)
        .map(|i| Seq {
            tokens: (0..4).map(|_| (rng.next() % vocab) as u32).collect(),
            table: (0..8).map(|b| (i * 8 + b) as u32).collect(),
            adapter: None,
        })
        .collect()
}

/// Step `n` (the prompts at 0, then one new token for each of the first `k` sequences) on both
/// decoders: the same logits bit for bit, and `captured` graphs after it.
fn step_both(
    model: &Decoder,
    (graphs, eager): (&mut GpuDecoder, &mut GpuDecoder),
    seqs: &mut [Seq],
    rng: &mut Rng,
    n: usize,
    k: usize,
    captured: usize,
) {
    let vocab = model.config.vocab_size as u64;
    let new = if n == 0 { 4 } else { 1 };
    if n > 0 {
        for s in &mut seqs[..k] {
            s.tokens.push((rng.next() % vocab) as u32);
        }
    }
    let step: Vec<(usize, usize, Logits)> = (0..k).map(|i| (i, new, Logits::Last)).collect();
    let b = batch(seqs, &step);
    let (mut a, mut e) = (ForwardBuffers::default(), ForwardBuffers::default());
    graphs.forward_into(model, &b, &mut a).unwrap();
    eager.forward_into(model, &b, &mut e).unwrap();
    assert_eq!(a.logits, e.logits, "step {n}");
    assert_eq!(graphs.graphs_captured(), captured, "graphs after step {n}");
    assert_eq!(eager.graphs_captured(), 0);
}

/// Decode through graphs equals the same steps launched eagerly, bit for bit (the kernels are
/// batch-invariant, so padding rows change nothing), also after a graph has been replayed, and
/// with adapters: a decode step with adapters replays the graph of its bucket and signature (which
/// modules some version rotates or adds LoRA to), reading each row's version from the directory,
/// against the eager steps' group-by-group ops. A version published mid-decode (the same
/// adapter's next) replays the graph captured for the one before: no new capture.
#[test]
fn graph_replays_equal_eager_launches_bit_for_bit() {
    if gpu().is_none() {
        return;
    }
    for int8 in [false, true] {
        graph_replays_equal_eager_launches(int8);
    }
}

fn graph_replays_equal_eager_launches(int8: bool) {
    let (_dir, path) = write_tiny(&TinySpec::llama3());
    let model = Decoder::open(&path).unwrap();
    let (mut graphs, mut eager) = graphs_and_eager(&model, int8);
    let (lora, oft) = methods();
    let versions = [
        adapter(&model, lora.clone(), 1, false),
        adapter(&model, lora.clone(), 2, false),
    ];
    // Sequence 1 through OFT, sequence 2 through LoRA with the LM head, where a step says so.
    let (rotating, with_head) = (
        adapter(&model, oft, 3, false),
        adapter(&model, lora, 4, true),
    );
    let mut rng = Rng(3);
    let mut seqs = prompts(6, model.config.vocab_size as u64, &mut rng);
    // (sequences decoding, sequence 0's adapter version, sequences 1 and 2 adapted, graphs
    // captured after the step)
    let plan: [(usize, Option<usize>, bool, usize); 12] = [
        (6, None, false, 0), // prefill: eager
        (1, None, false, 1),
        (3, None, false, 2),
        (6, None, false, 3),
        (6, Some(0), false, 4), // bucket 8 with LoRA
        (6, Some(1), false, 4), // the next version: the same graph
        (6, None, false, 4),
        (3, Some(1), true, 5), // bucket 4 with LoRA, OFT and the head's LoRA
        (3, Some(0), true, 5),
        (6, None, true, 6), // bucket 8 with OFT and the head's LoRA
        (1, Some(0), false, 7),
        (1, None, false, 7),
    ];
    for (n, &(k, version, extras, captured)) in plan.iter().enumerate() {
        seqs[0].adapter = version.map(|v| versions[v].clone());
        seqs[1].adapter = extras.then(|| rotating.clone());
        seqs[2].adapter = extras.then(|| with_head.clone());
        let both = (&mut graphs, &mut eager);
        step_both(&model, both, &mut seqs, &mut rng, n, k, captured);
    }
}

/// A mixture of experts decodes through graphs (routed on the device, each (token, choice) row its
/// expert's product) equal to the same steps launched eagerly, bit for bit, padded buckets too.
#[test]
fn moe_decode_graphs_equal_eager_launches_bit_for_bit() {
    if gpu().is_none() {
        return;
    }
    for (spec, int8) in [(TinySpec::qwen3moe(), false), (moe_int8(), true)] {
        moe_graphs_equal_eager_launches(&spec, int8);
    }
}

fn moe_graphs_equal_eager_launches(spec: &TinySpec, int8: bool) {
    let (_dir, path) = write_tiny(spec);
    let model = Decoder::open(&path).unwrap();
    let (mut graphs, mut eager) = graphs_and_eager(&model, int8);
    let mut rng = Rng(5);
    let mut seqs = prompts(5, model.config.vocab_size as u64, &mut rng);
    // (sequences, graphs captured after the step): the prompts eagerly, then buckets 8, 1, 4.
    for (n, &(k, captured)) in [(5, 0), (5, 1), (1, 2), (3, 3), (5, 3), (3, 3)]
        .iter()
        .enumerate()
    {
        step_both(
            &model,
            (&mut graphs, &mut eager),
            &mut seqs,
            &mut rng,
            n,
            k,
            captured,
        );
    }
}

/// Tokens drawn on the GPU (`forward_drawing`) are the host sampler's for the same logits: greedy
/// and at temperatures, with alternatives, mixed in one step with rows whose logits come back
/// (prompt scoring's rows, a row left to the host with its log-sum-exp at T 0.7 or 1), in prefill
/// (eager) and decode (graphs) steps; the logits that come back are `forward_into`'s bit for bit,
/// and a normalized row's log-sum-exp is its log-softmax's.
#[test]
fn tokens_drawn_on_the_gpu_are_the_host_samplers() {
    if gpu().is_none() {
        return;
    }
    let (_dir, path) = write_tiny(&TinySpec::llama3());
    let model = Decoder::open(&path).unwrap();
    let vocab = model.config.vocab_size;
    let mut drawing = GpuDecoder::new(gpu().unwrap(), &model, shape(true)).unwrap();
    assert!(drawing.draws());
    let host_shape = GpuShape {
        draws: false,
        ..shape(true)
    };
    let mut host = GpuDecoder::new(gpu().unwrap(), &model, host_shape).unwrap();
    assert!(!host.draws());
    let mut rng = Rng(8);
    let mut seqs = prompts(5, vocab as u64, &mut rng);
    let uniform = |rng: &mut Rng| (rng.next() >> 11) as f64 / (1u64 << 53) as f64;
    for n in 0..6 {
        // The prompts (sequence 0's scored: every row's logits), then decode steps.
        let steps: Vec<(usize, usize, Logits)> = (0..5)
            .map(|i| match (n, i) {
                (0, 0) => (i, 4, Logits::All),
                (0, _) => (i, 4, Logits::Last),
                _ => (i, 1, Logits::Last),
            })
            .collect();
        let b = batch(&seqs, &steps);
        let mut want = ForwardBuffers::default();
        host.forward_into(&model, &b, &mut want).unwrap();
        let rows = want.logits.len() / vocab;
        // Per logit row: greedy, T 0.8 among llama.cpp's default cut (top-k 40, top-p 0.95,
        // min-p 0.05), the host's, T 1 with 20 alternatives, greedy with 3, T 1.2 in a nucleus
        // (top-p 0.9, min-p 0.05, no top-k: on the device where its cut is among the 128 best,
        // else drawn from the row's log-probs by the host).
        let specs: Vec<RowOut> = (0..rows)
            .map(|r| {
                let last = if n == 0 { r.checked_sub(3) } else { Some(r) };
                // The kinds turn with the step, so that each row of a step takes each in turn.
                let Some(kind) = last.map(|l| (l + n) % 6) else {
                    return RowOut::Logits;
                };
                let sample = match kind {
                    0 | 4 => None,
                    1 => Some((0.8, uniform(&mut rng))),
                    2 => return RowOut::Normalized((r % 2 == 0).then_some(0.7)),
                    3 => Some((1.0, uniform(&mut rng))),
                    _ => Some((1.2, uniform(&mut rng))),
                };
                let top = [0, 0, 0, 20, 3, 2][kind];
                let truncate = match kind {
                    1 => Truncate {
                        top_k: 40,
                        top_p: 0.95,
                        min_p: 0.05,
                    },
                    5 => Truncate {
                        top_k: 0,
                        top_p: 0.9,
                        min_p: 0.05,
                    },
                    _ => Truncate::NONE,
                };
                RowOut::Drawn(DrawSpec {
                    row: r as u32,
                    sample,
                    top,
                    truncate,
                })
            })
            .collect();
        let mut got = ForwardBuffers::default();
        let mut back = RowsBack::default();
        drawing
            .forward_drawing(&model, &b, &specs, &mut got, &mut back)
            .unwrap();
        let count = |f: fn(&RowOut) -> bool| specs.iter().filter(|s| f(s)).count();
        assert_eq!(back.drawn.len(), count(|s| matches!(s, RowOut::Drawn(_))));
        assert_eq!(
            back.lse.len(),
            count(|s| matches!(s, RowOut::Normalized(_)))
        );
        let (mut drawn, mut lse) = (back.drawn.into_iter(), back.lse.into_iter());
        let mut next = Vec::new();
        for (r, spec) in specs.iter().enumerate() {
            let row = &want.logits[r * vocab..(r + 1) * vocab];
            let s = match spec {
                RowOut::Drawn(s) => s,
                _ => {
                    assert_eq!(
                        &got.logits[r * vocab..(r + 1) * vocab],
                        row,
                        "step {n} row {r}"
                    );
                    if let RowOut::Normalized(t) = *spec {
                        // The log-sum-exp of the row at T, in f64 here.
                        let inv = 1.0 / t.unwrap_or(1.0) as f64;
                        let max = row.iter().fold(f64::MIN, |m, &v| m.max(v as f64 * inv));
                        let sum: f64 = row.iter().map(|&v| (v as f64 * inv - max).exp()).sum();
                        let want_lse = max + sum.ln();
                        let got_lse = lse.next().unwrap() as f64;
                        assert!(
                            (got_lse - want_lse).abs() <= 1e-5 * want_lse.abs().max(1.0),
                            "step {n} row {r}: {got_lse} vs {want_lse}"
                        );
                    }
                    next.push(reference::argmax(row));
                    continue;
                }
            };
            let d = drawn.next().unwrap();
            let mut lp = row.to_vec();
            if let Some((t, _)) = s.sample.filter(|(t, _)| *t != 1.0) {
                let inv = 1.0 / t;
                lp.iter_mut().for_each(|v| *v *= inv);
            }
            reference::log_softmax(&mut lp);
            let (token, kept) = match s.sample {
                None => (reference::argmax(&lp), 1.0),
                Some((_, u)) => reference::draw_cut(&lp, s.truncate, u),
            };
            assert_eq!(d.token, token, "step {n} row {r}: {s:?}");
            assert!(
                (d.kept - kept).abs() <= 1e-6 * kept,
                "step {n} row {r}: mass kept"
            );
            let near = |a: f32, b: f32| (a - b).abs() <= 4e-7 * b.abs().max(1.0);
            assert!(near(d.logprob, lp[token as usize]), "step {n} row {r}");
            let top = reference::top_indices(&lp, s.top);
            assert_eq!(d.top.iter().map(|t| t.0).collect::<Vec<_>>(), top);
            assert!(d.top.iter().all(|&(i, v)| near(v, lp[i as usize])));
            next.push(d.token);
        }
        // The sampled rows' tokens feed the next step (the scored prompt's last row is its own).
        let firsts = if n == 0 { 3 } else { 0 };
        for (s, &t) in seqs.iter_mut().zip(&next[firsts..]) {
            s.tokens.push(t);
        }
        assert_eq!(drawing.graphs_captured(), host.graphs_captured());
    }
    assert!(
        drawing.graphs_captured() > 0,
        "the decode steps replayed graphs"
    );
}
