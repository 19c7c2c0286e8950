//! Training steps end to end on tiny generated models (`train::offline::step`): SFT steps raise
//! the log-prob of their data, GRPO steps the probability of the rewarded completion, and SFT
//! lines (text or messages) tokenize into prompt and completion. (The forward and backward
//! themselves: tests/train.rs.)

mod common;

use common::adapters::{lora, oft};
use common::{write_tiny, TinySpec};
use flywheel::adapter::{AdapterConfig, AdapterLayout, AdapterWeights, Method, Target};
use flywheel::kernels::Cpu;
use flywheel::model::decoder::{Decoder, TrainSeq, ACTIVATION_BUDGET};
use flywheel::model::tokenizer::Tokenizer;
use std::sync::Arc;

fn mean_logp(
    model: &Decoder,
    w: &AdapterWeights,
    samples: &[flywheel::train::offline::Sample],
) -> Vec<f64> {
    let toks: Vec<Vec<u32>> = samples
        .iter()
        .map(|s| [s.prompt.clone(), s.completion.clone()].concat())
        .collect();
    let seqs: Vec<TrainSeq> = samples
        .iter()
        .zip(&toks)
        .map(|(s, t)| TrainSeq::whole(t, s.prompt.len()))
        .collect();
    let lp = model.logprobs(&Cpu::detect(), &seqs, Some(w), 1.0).unwrap();
    lp.iter()
        .map(|l| l.iter().map(|v| *v as f64).sum::<f64>() / l.len() as f64)
        .collect()
}

fn identity(model: &Decoder, method: Method) -> AdapterWeights {
    let cfg = AdapterConfig {
        method,
        targets: Target::ALL.to_vec(),
        base_model: String::new(),
    };
    AdapterWeights::identity(Arc::new(AdapterLayout::new(cfg, &model.config).unwrap()), 1)
}

#[test]
fn sft_steps_raise_the_log_prob_of_their_data() {
    use flywheel::train::loss::LossConfig;
    use flywheel::train::offline::{grouped, parse_jsonl, step};
    use flywheel::train::optim::{AdamW, AdamWConfig};
    let (_dir, path) = write_tiny(&TinySpec::small());
    let model = Decoder::open(&path).unwrap();
    let data = "{\"prompt_token_ids\": [5, 6, 7], \"completion_token_ids\": [40, 41, 42, 43]}\n\
                {\"prompt_token_ids\": [9, 8], \"completion_token_ids\": [100, 101, 102]}\n";
    let samples = parse_jsonl(data, None).unwrap();
    let mut w = identity(&model, oft());
    let before = mean_logp(&model, &w, &samples);
    let loss = LossConfig::named("sft".parse().unwrap(), 8, 1);
    let mut opt = AdamW::new(
        AdamWConfig {
            lr: 1e-2,
            ..Default::default()
        },
        w.layout.num_params,
    );
    let batches = grouped(&samples, "sft".parse().unwrap());
    assert_eq!(batches.len(), 2);
    for _ in 0..6 {
        let refs: Vec<_> = batches.iter().collect();
        let (next, stats) = step(
            &model,
            &Cpu::detect(),
            None,
            &w,
            &mut opt,
            &loss,
            &refs,
            1.0,
            ACTIVATION_BUDGET,
            usize::MAX,
            None,
        )
        .unwrap();
        assert!(stats.loss.is_finite());
        // Entropy of a distribution over the tiny vocabulary: in (0, ln V].
        let h = stats.entropy;
        assert!(
            h > 0.0 && h <= (model.config.vocab_size as f64).ln() + 1e-6,
            "{h}"
        );
        w = next;
    }
    let after = mean_logp(&model, &w, &samples);
    eprintln!("SFT mean log-prob per sample: {before:?} -> {after:?}");
    for (b, a) in before.iter().zip(&after) {
        assert!(
            a > &(b + 0.1),
            "SFT did not raise the data's log-prob: {b} -> {a}"
        );
    }
}

/// One GRPO step of `batch` from `w`.
fn grpo_step(
    model: &Decoder,
    w: &AdapterWeights,
    opt: &mut flywheel::train::optim::AdamW,
    batch: &flywheel::train::offline::Batch,
) -> AdapterWeights {
    let loss = flywheel::train::loss::LossConfig::named("grpo".parse().unwrap(), 3, 4);
    let cpu = Cpu::detect();
    let (next, _) = flywheel::train::offline::step(
        model,
        &cpu,
        None,
        w,
        opt,
        &loss,
        &[batch],
        1.0,
        ACTIVATION_BUDGET,
        usize::MAX,
        None,
    )
    .unwrap();
    next
}

/// A step over more tokens than its bound runs in micro-batches (each within the bound, a longer
/// sample alone) and takes the step one pass would: the same loss, log-prob statistics and
/// entropy, and the same update up to the order of the gradients' sums.
#[test]
fn a_step_over_its_token_bound_runs_in_micro_batches_with_the_same_update() {
    use flywheel::train::loss::LossConfig;
    use flywheel::train::offline::{grouped, parse_jsonl, step, Scorer};
    use flywheel::train::optim::{AdamW, AdamWConfig};
    let (_dir, path) = write_tiny(&TinySpec::small());
    let model = Decoder::open(&path).unwrap();
    let cpu = Cpu::detect();
    let mut data = String::new();
    for g in 0..3 {
        for i in 0..6u32 {
            let len = 3 + ((g * 7 + i as usize * 5) % 9);
            let completion: Vec<u32> = (0..len as u32)
                .map(|k| 20 + 13 * i + k + g as u32)
                .collect();
            data += &format!(
                "{{\"prompt_token_ids\": [3, 4, 5, {}], \"completion_token_ids\": {completion:?}, \"reward\": {}, \"group\": \"g{g}\"}}\n",
                6 + g,
                (i % 3) as f32 * 0.5
            );
        }
    }
    // One sample longer than the bound, in a group of its own kind.
    let long: Vec<u32> = (0..40).map(|k| 50 + k).collect();
    data += &format!("{{\"prompt_token_ids\": [9, 9], \"completion_token_ids\": {long:?}, \"reward\": 1, \"group\": \"g3\"}}\n");
    data += "{\"prompt_token_ids\": [9, 9], \"completion_token_ids\": [7, 8], \"reward\": 0, \"group\": \"g3\"}\n";
    let samples = parse_jsonl(&data, None).unwrap();
    let batches = grouped(&samples, "grpo".parse().unwrap());
    let refs: Vec<_> = batches.iter().collect();
    for (name, method, kl) in [("oft", oft(), 0.0), ("lora", lora(), 0.05)] {
        let id = identity(&model, method);
        // Not the identity: an adapter that changes the log-probs.
        let mut params = id.params.clone();
        for (i, p) in params.iter_mut().enumerate() {
            *p += 1e-3 * ((i % 7) as f32 - 3.0);
        }
        let w = AdapterWeights::new(id.layout.clone(), params).unwrap();
        let mut loss = LossConfig::named("grpo".parse().unwrap(), 40, 6);
        loss.kl_coef = kl;
        let run_with = |max_tokens: usize, scorer: Option<&dyn Scorer>| {
            let mut opt = AdamW::new(
                AdamWConfig {
                    lr: 1e-2,
                    ..Default::default()
                },
                w.layout.num_params,
            );
            step(
                &model,
                &cpu,
                scorer,
                &w,
                &mut opt,
                &loss,
                &refs,
                1.0,
                ACTIVATION_BUDGET,
                max_tokens,
                None,
            )
            .unwrap()
        };
        let run = |max_tokens: usize| run_with(max_tokens, None);
        let (one, s1) = run(usize::MAX);
        let (many, sm) = run(32);
        // The loss's log-probs from a scorer (the serving device's, `EngineHandle::logprobs`):
        // the policy's and the reference's, every pass; where they are the trainer's own, the
        // same step to the bit.
        for max_tokens in [usize::MAX, 32] {
            let own = TheTrainers {
                model: &model,
                shift: 0.0,
                calls: Default::default(),
            };
            let (w1, st) = run_with(max_tokens, Some(&own));
            let (w0, s0) = run_with(max_tokens, None);
            assert_eq!(w1.params, w0.params, "{name}");
            assert_eq!((st.loss, st.kl), (s0.loss, s0.kl), "{name}");
            let (policy, reference) = *own.calls.lock().unwrap();
            let passes = if max_tokens == 32 {
                s0.micro_batches
            } else {
                1
            };
            assert_eq!(policy, passes, "{name}: the policy's log-probs a pass");
            assert_eq!(reference, if kl > 0.0 { passes } else { 0 }, "{name}");
            if kl > 0.0 {
                // The policy's log-probs moved: the KL to the reference moves with them.
                let moved = TheTrainers { shift: 0.05, ..own };
                let (_, sx) = run_with(max_tokens, Some(&moved));
                assert!(sx.kl != s0.kl, "{name}: kl {} and {}", sx.kl, s0.kl);
            }
        }
        assert_eq!(s1.micro_batches, 1);
        assert!(
            sm.micro_batches >= 6,
            "{name}: {} micro-batches",
            sm.micro_batches
        );
        // Within the bound, except the long sample alone (2 + 40 tokens).
        assert_eq!(sm.max_micro_batch_tokens, 42, "{name}");
        assert_eq!(s1.loss, sm.loss, "{name}: loss");
        assert_eq!(s1.kl, sm.kl, "{name}: kl");
        assert_eq!(s1.sequences, sm.sequences);
        assert!(
            (s1.entropy - sm.entropy).abs() < 1e-9 * s1.entropy.abs().max(1.0),
            "{name}"
        );
        assert!(
            (s1.grad_norm - sm.grad_norm).abs() < 1e-4 * s1.grad_norm,
            "{name}: grad norm {} vs {}",
            s1.grad_norm,
            sm.grad_norm
        );
        let moved: f32 = one
            .params
            .iter()
            .zip(&w.params)
            .map(|(a, b)| (a - b).abs())
            .sum();
        let apart: f32 = one
            .params
            .iter()
            .zip(&many.params)
            .map(|(a, b)| (a - b).abs())
            .sum();
        assert!(
            moved > 0.0 && apart < 1e-3 * moved,
            "{name}: moved {moved}, apart {apart}"
        );
    }
}

#[test]
fn grpo_steps_raise_the_probability_of_the_rewarded_completion() {
    use flywheel::train::offline::{grouped, parse_jsonl};
    use flywheel::train::optim::{AdamW, AdamWConfig};
    let (_dir, path) = write_tiny(&TinySpec::small());
    let model = Decoder::open(&path).unwrap();
    let completions = [[30u32, 31, 32], [60, 61, 62], [90, 91, 92], [120, 121, 122]];
    let data: String = completions
        .iter()
        .enumerate()
        .map(|(i, c)| {
            format!(
                "{{\"prompt_token_ids\": [3, 4, 5, 6], \"completion_token_ids\": {c:?}, \"reward\": {}, \"group\": \"g\"}}\n",
                if i == 0 { 1.0 } else { 0.0 }
            )
        })
        .collect();
    let samples = parse_jsonl(&data, None).unwrap();
    for (name, method) in [("oft", oft()), ("lora", lora())] {
        let mut w = identity(&model, method);
        let gap = |w: &AdapterWeights| {
            let m = mean_logp(&model, w, &samples);
            m[0] - (m[1] + m[2] + m[3]) / 3.0
        };
        let before = gap(&w);
        let mut opt = AdamW::new(
            AdamWConfig {
                lr: 1e-2,
                ..Default::default()
            },
            w.layout.num_params,
        );
        let batches = grouped(&samples, "grpo".parse().unwrap());
        assert_eq!(batches.len(), 1);
        for _ in 0..6 {
            w = grpo_step(&model, &w, &mut opt, &batches[0]);
        }
        let after = gap(&w);
        eprintln!("{name}: log-prob gap of the rewarded completion {before:.3} -> {after:.3}");
        assert!(
            after > before + 0.2,
            "{name}: GRPO did not favour the rewarded completion"
        );
    }
    // Tokens a grammar forced carry no choice: a batch of only those leaves the adapter as it is.
    let mut forced = samples.clone();
    for s in &mut forced {
        s.forced = (0..s.completion.len() as u32).collect();
    }
    let batches = grouped(&forced, "grpo".parse().unwrap());
    let w = identity(&model, oft());
    let mut opt = AdamW::new(
        AdamWConfig {
            lr: 1e-2,
            weight_decay: 0.0,
            ..Default::default()
        },
        w.layout.num_params,
    );
    let next = grpo_step(&model, &w, &mut opt, &batches[0]);
    assert_eq!(next.params, w.params, "forced tokens trained");
    // A group whose rewards are all equal carries no signal.
    let flat = parse_jsonl(&data.replace("\"reward\": 1", "\"reward\": 0"), None).unwrap();
    assert!(grouped(&flat, "grpo".parse().unwrap()).is_empty());
}

/// SFT data as text: `messages` split at the assistant's answer by the chat template (the answer
/// with its end-of-turn token is the completion), and `prompt` + `completion`.
#[test]
fn text_and_messages_lines_tokenize_into_prompt_and_completion() {
    use flywheel::train::offline::parse_jsonl;
    let (_dir, path) = write_tiny(&TinySpec::small());
    let model = Decoder::open(&path).unwrap();
    let tok = Tokenizer::from_gguf(&model.gguf).unwrap();
    let data = r#"{"messages": [{"role": "user", "content": "hi there"}, {"role": "assistant", "content": "hello"}]}
{"prompt": "abc", "completion": " def", "group": "g"}
{"messages": [{"role": "user", "content": "only a question"}]}"#;
    let err = parse_jsonl(data, Some(&tok)).err().unwrap().to_string();
    assert!(err.contains("line 3") && err.contains("assistant"), "{err}");
    let two: String = data.lines().take(2).collect::<Vec<_>>().join("\n");
    assert!(parse_jsonl(&two, None).is_err(), "text needs the tokenizer");
    let s = parse_jsonl(&two, Some(&tok)).unwrap();
    assert_eq!(
        tok.decode(&s[0].prompt),
        "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n"
    );
    assert_eq!(tok.decode(&s[0].completion), "hello<|im_end|>\n");
    assert_eq!(tok.decode(&s[1].prompt), "abc");
    assert_eq!(tok.decode(&s[1].completion), " def");
    assert_eq!(s[1].group, "g");
}

/// A scorer with the trainer's own log-probs (`Decoder::logprobs`), the policy's moved by `shift`:
/// it counts the policy's calls and the reference's.
struct TheTrainers<'a> {
    model: &'a Decoder,
    shift: f32,
    calls: std::sync::Mutex<(usize, usize)>,
}

impl flywheel::train::offline::Scorer for TheTrainers<'_> {
    fn logprobs(
        &self,
        seqs: &[TrainSeq],
        adapter: Option<&AdapterWeights>,
        temperature: f32,
    ) -> anyhow::Result<Vec<Vec<f32>>> {
        let mut c = self.calls.lock().unwrap();
        let shift = match adapter {
            Some(_) => {
                c.0 += 1;
                self.shift
            }
            None => {
                c.1 += 1;
                0.0
            }
        };
        let mut l = self
            .model
            .logprobs(&Cpu::detect(), seqs, adapter, temperature)?;
        l.iter_mut().flatten().for_each(|v| *v += shift);
        Ok(l)
    }
}
