//! Offline training (`flywheel train`): samples with rewards and groups (or plain completions for
//! SFT) → group advantages → the loss → train forward/backward → AdamW, one step per batch of
//! groups, one JSON line of statistics per step. The online trainer will call the same `step`.

use super::distill::{teacher_advantages, Teacher};
use super::loss::{policy_loss, unit_advantages, LossConfig, LossName, SeqInput};
use super::optim::AdamW;
pub use super::pack::micro_batches;
use super::pack::Packed;
use crate::adapter::AdapterWeights;
use crate::model::decoder::{Decoder, TrainSeq};
use crate::model::tokenizer::{ChatMessage, Tokenizer};
use flywheel_kernels::Cpu;
use serde_json::Value;
use std::time::Instant;

/// One completion of a prompt, with its reward and group.
#[derive(Clone, Debug)]
pub struct Sample {
    pub prompt: Vec<u32>,
    pub completion: Vec<u32>,
    pub reward: f32,
    pub group: String,
    /// The sampler's log-probs of the completion (None: taken as the current policy's, i.e.
    /// on-policy).
    pub behavior: Option<Vec<f32>>,
    /// The log-probs of the distribution it was drawn from, where it differs from `behavior`
    /// (None: the same): μ for an off-policy correction.
    pub sampling: Option<Vec<f32>>,
    /// The completion positions sampled by the very weights being trained (there the training
    /// forward must reproduce `behavior` to the bit: the step reports the largest difference);
    /// all of them, none, or a partial rollout's spans of that version.
    pub sampled_by_current: Vec<std::ops::Range<usize>>,
    /// The episode the sample is a turn of: its turns share one reward and advantage and count
    /// once in their group (None: a sample of its own).
    pub episode: Option<String>,
    /// Completion positions a grammar forced (constrained decoding): left out of the loss (the
    /// model chose nothing there; its unconstrained log-prob would push on the scaffolding).
    pub forced: Vec<u32>,
}

/// A batch's samples with their advantages.
pub struct Batch<'a> {
    pub samples: Vec<&'a Sample>,
    pub advantages: Vec<f32>,
}

/// Group the samples (in order of first appearance) and give each usable group its advantages;
/// groups without reward variance are dropped (no signal), except for SFT where every sample
/// counts with advantage 1, and distillation where the teacher's token advantages are the signal.
pub fn grouped<'a>(samples: &'a [Sample], loss_name: LossName) -> Vec<Batch<'a>> {
    let mut order: Vec<&str> = Vec::new();
    for s in samples {
        if !order.contains(&s.group.as_str()) {
            order.push(&s.group);
        }
    }
    let kind = LossConfig::advantage_kind(loss_name);
    order
        .into_iter()
        .filter_map(|g| {
            let members: Vec<&Sample> = samples.iter().filter(|s| s.group == g).collect();
            let advantages = if loss_name == LossName::Sft {
                vec![1.0; members.len()]
            } else if loss_name == LossName::Distill {
                // Only the teacher's token advantages (`distill`).
                vec![0.0; members.len()]
            } else {
                let rewards: Vec<f32> = members.iter().map(|s| s.reward).collect();
                let units: Vec<Option<&str>> =
                    members.iter().map(|s| s.episode.as_deref()).collect();
                unit_advantages(&units, &rewards, kind)?
            };
            Some(Batch {
                samples: members,
                advantages,
            })
        })
        .collect()
}

/// What one step did (`flywheel train` prints it as a JSON line; the online trainer shows the last
/// one in `/v1/train/status` and in its metrics).
#[derive(Clone, Debug, Default, serde::Serialize, serde::Deserialize)]
#[serde(default)]
pub struct StepStats {
    /// The optimizer's step number after this step.
    pub step: u64,
    pub loss: f64,
    pub reward_mean: f64,
    pub reward_std: f64,
    pub clip_fraction: f64,
    pub masked_fraction: f64,
    pub kl: f64,
    pub entropy: f64,
    pub ratio_mean: f64,
    pub ratio_min: f64,
    pub ratio_max: f64,
    /// The global gradient norm before clipping.
    pub grad_norm: f64,
    pub lr: f32,
    pub sequences: usize,
    /// Completion tokens the loss covered.
    pub tokens: usize,
    pub seconds: f64,
    /// Rows the forward ran (a group's shared prompt once per micro-batch).
    pub forward_tokens: usize,
    /// Forward/backward passes the step took (over 1 when it held more than its token bound).
    pub micro_batches: usize,
    /// Tokens (prompt + completion) of the largest pass.
    pub max_micro_batch_tokens: usize,
    /// The largest |train − serve| log-prob over samples drawn from these very weights.
    pub logprob_diff_max: Option<f64>,
    pub tokens_per_second: f64,
    /// Distillation: the mean per-token reverse KL estimate log π − log π_teacher over the step's
    /// tokens, before the step.
    pub teacher_kl: Option<f64>,
}

/// Where a step's log-probs come from when not from the trainer's own forward: the device that
/// served the completions (`EngineHandle::logprobs` where the engine serves on a GPU: the
/// kernels that computed the served log-probs, so that train = serve there bit for bit). The
/// gradient stays the trainer's (its backward from its own forward).
pub trait Scorer: Send + Sync {
    /// `Decoder::logprobs`'s contract.
    fn logprobs(
        &self,
        seqs: &[TrainSeq],
        adapter: Option<&AdapterWeights>,
        temperature: f32,
    ) -> anyhow::Result<Vec<Vec<f32>>>;
}

/// One optimizer step on `groups`: returns the new adapter version's weights and the statistics.
/// `activation_budget`: bytes of activations the training forward keeps (`Llama::train_forward`).
/// `max_tokens`: the most tokens one forward/backward pass holds; a step over more runs in
/// micro-batches of whole samples (a sample longer than that alone) whose gradients add up to
/// the whole step's: first every micro-batch's log-probs (no activations kept), then the loss over
/// all of them, then per micro-batch the training forward and backward. The same loss and
/// gradient as one pass, at the cost of one more forward. `scorer`: the log-probs of the loss (of
/// the policy and the reference) from there instead of the trainer's forward.
#[allow(clippy::too_many_arguments)]
pub fn step(
    model: &Decoder,
    cpu: &Cpu,
    scorer: Option<&dyn Scorer>,
    weights: &AdapterWeights,
    opt: &mut AdamW,
    loss: &LossConfig,
    groups: &[&Batch],
    temperature: f32,
    activation_budget: usize,
    max_tokens: usize,
    teacher: Option<&Teacher>,
) -> anyhow::Result<(AdapterWeights, StepStats)> {
    let t0 = Instant::now();
    let samples: Vec<&Sample> = groups
        .iter()
        .flat_map(|g| g.samples.iter().copied())
        .collect();
    let advantages: Vec<f32> = groups
        .iter()
        .flat_map(|g| g.advantages.iter().copied())
        .collect();
    let pairs: Vec<(&[u32], &[u32])> = samples
        .iter()
        .map(|s| (s.prompt.as_slice(), s.completion.as_slice()))
        .collect();
    let micro = micro_batches(&pairs, max_tokens);
    // Each group's prompt runs once per micro-batch (exact: the same rows, their gradients summed).
    let packs: Vec<Packed> = micro
        .iter()
        .map(|r| Packed::new(&pairs[r.clone()], true))
        .collect();
    let logprobs = |seqs: &[TrainSeq], adapter| -> anyhow::Result<Vec<Vec<f32>>> {
        match scorer {
            Some(s) => s.logprobs(seqs, adapter, temperature),
            None => Ok(model.logprobs(cpu, seqs, adapter, temperature)?),
        }
    };
    let (logps, mut one_pass) = if let [packed] = packs.as_slice() {
        let seqs = packed.seqs();
        let (mut l, st) =
            model.train_forward(cpu, &seqs, weights, temperature, activation_budget)?;
        if let Some(s) = scorer {
            l = s.logprobs(&seqs, Some(weights), temperature)?;
        }
        let per_sample = packed.of_sample.iter().map(|&q| l[q].clone()).collect();
        (per_sample, Some(st))
    } else {
        let mut per_sample = Vec::with_capacity(samples.len());
        for packed in &packs {
            let l = logprobs(&packed.seqs(), Some(weights))?;
            per_sample.extend(packed.of_sample.iter().map(|&q| l[q].clone()));
        }
        (per_sample, None)
    };
    let refs = if loss.kl_coef != 0.0 {
        let mut r = Vec::with_capacity(samples.len());
        for packed in &packs {
            let l = logprobs(&packed.seqs(), None)?;
            r.extend(packed.of_sample.iter().map(|&q| l[q].clone()));
        }
        Some(r)
    } else {
        None
    };
    let taught = teacher
        .map(|t| teacher_advantages(model, cpu, &pairs, &logps, t, temperature, max_tokens))
        .transpose()?;
    let inputs: Vec<SeqInput> = samples
        .iter()
        .enumerate()
        .map(|(i, s)| SeqInput {
            logp: &logps[i],
            behavior: s.behavior.as_deref().unwrap_or(&logps[i]),
            ref_logp: refs.as_ref().map(|r: &Vec<Vec<f32>>| r[i].as_slice()),
            // A correction's π_old is this forward's log-probs, detached.
            old_logp: loss.correction.map(|_| logps[i].as_slice()),
            mu: s.sampling.as_deref(),
            token_advantage: taught.as_ref().map(|(a, _)| a[i].as_slice()),
            advantage: advantages[i],
        })
        .collect();
    let (stats, per_sample) = policy_loss(loss, &inputs);
    // Train/serve log-prob difference over the samples drawn from these very weights.
    let mut diff: Option<f64> = None;
    for (i, s) in samples.iter().enumerate() {
        let Some(b) = &s.behavior else { continue };
        for r in &s.sampled_by_current {
            let d = logps[i][r.clone()]
                .iter()
                .zip(&b[r.clone()])
                .map(|(a, b)| (a - b).abs() as f64)
                .fold(0.0f64, f64::max);
            diff = Some(diff.unwrap_or(0.0).max(d));
        }
    }
    let mut grad_logp: Vec<Vec<f32>> = per_sample;
    for (g, s) in grad_logp.iter_mut().zip(&samples) {
        // Tokens a grammar forced carry no choice of the model's: no gradient through them.
        for &t in &s.forced {
            if let Some(x) = g.get_mut(t as usize) {
                *x = 0.0;
            }
        }
    }
    let mut entropy = 0.0;
    let mut grads = vec![0.0f32; weights.layout.num_params];
    for (range, packed) in micro.iter().zip(&packs) {
        let seqs = packed.seqs();
        let st = match one_pass.take() {
            Some(st) => st,
            None => {
                let (_, st) =
                    model.train_forward(cpu, &seqs, weights, temperature, activation_budget)?;
                st
            }
        };
        // Weighted by completion tokens: the mean over micro-batches is the whole step's mean.
        let scored: usize = pairs[range.clone()].iter().map(|(_, c)| c.len()).sum();
        entropy += st.mean_entropy * scored as f64;
        let mut g = vec![Vec::new(); seqs.len()];
        for (k, &q) in packed.of_sample.iter().enumerate() {
            g[q] = std::mem::take(&mut grad_logp[range.start + k]);
        }
        model.train_backward(cpu, &seqs, weights, st, &g, &mut grads)?;
    }
    let forward_tokens: usize = packs.iter().map(Packed::num_tokens).sum();
    let scored: usize = pairs.iter().map(|(_, c)| c.len()).sum();
    entropy /= scored.max(1) as f64;
    let mut params = weights.params.clone();
    let s = opt.step(&mut params, &mut grads);
    let next = AdapterWeights::new(weights.layout.clone(), params)?;
    let rewards: Vec<f64> = samples.iter().map(|s| s.reward as f64).collect();
    let secs = t0.elapsed().as_secs_f64();
    let num_tokens: usize = pairs.iter().map(|(p, c)| p.len() + c.len()).sum();
    Ok((
        next,
        StepStats {
            step: opt.step,
            loss: stats.loss,
            reward_mean: rewards.iter().sum::<f64>() / rewards.len().max(1) as f64,
            reward_std: std_dev(&rewards),
            clip_fraction: stats.clip_fraction,
            masked_fraction: stats.masked_fraction,
            kl: stats.kl,
            entropy,
            ratio_mean: stats.ratio_mean,
            ratio_min: stats.ratio_min,
            ratio_max: stats.ratio_max,
            grad_norm: s.grad_norm,
            lr: s.lr,
            sequences: samples.len(),
            tokens: stats.tokens,
            seconds: secs,
            forward_tokens,
            micro_batches: micro.len(),
            max_micro_batch_tokens: micro
                .iter()
                .map(|r| {
                    pairs[r.clone()]
                        .iter()
                        .map(|(p, c)| p.len() + c.len())
                        .sum()
                })
                .max()
                .unwrap_or(0),
            logprob_diff_max: diff,
            tokens_per_second: num_tokens as f64 / secs,
            teacher_kl: taught.map(|(_, kl)| kl),
        },
    ))
}

/// The population standard deviation of `x` (0 when empty).
fn std_dev(x: &[f64]) -> f64 {
    let n = x.len().max(1) as f64;
    let mean = x.iter().sum::<f64>() / n;
    (x.iter().map(|r| (r - mean).powi(2)).sum::<f64>() / n).sqrt()
}

/// Read a JSONL data file: per line `{"prompt_token_ids", "completion_token_ids", "reward"?,
/// "group"?, "behavior_logprobs"?}`, or text for SFT, tokenized with `tok`: `{"prompt",
/// "completion"}` (the completion tokenized on its own, no BOS), or `{"messages": [...]}` whose
/// last message is the assistant's answer (prompt = the chat template of the others with the
/// generation prompt; completion = the rest of the whole conversation's rendering, its
/// end-of-turn token included). A line without a group is its own group.
pub fn parse_jsonl(text: &str, tok: Option<&Tokenizer>) -> anyhow::Result<Vec<Sample>> {
    let mut out = Vec::new();
    for (n, line) in text
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
    {
        let v: Value = serde_json::from_str(line)
            .map_err(|e| anyhow::anyhow!("line {}: not JSON: {e}", n + 1))?;
        let ids = |k: &str| -> anyhow::Result<Vec<u32>> {
            v[k].as_array()
                .ok_or_else(|| {
                    anyhow::anyhow!("line {}: '{k}' must be a list of token ids", n + 1)
                })?
                .iter()
                .map(|x| {
                    x.as_u64()
                        .map(|t| t as u32)
                        .ok_or_else(|| anyhow::anyhow!("line {}: '{k}' holds a non-id", n + 1))
                })
                .collect()
        };
        let (prompt, completion) = if v.get("prompt_token_ids").is_some() {
            (ids("prompt_token_ids")?, ids("completion_token_ids")?)
        } else {
            let tok =
                tok.ok_or_else(|| anyhow::anyhow!("line {}: text needs a tokenizer", n + 1))?;
            text_sample(&v, tok).map_err(|e| anyhow::anyhow!("line {}: {e}", n + 1))?
        };
        anyhow::ensure!(
            !prompt.is_empty() && !completion.is_empty(),
            "line {}: empty prompt or completion",
            n + 1
        );
        let behavior = match v.get("behavior_logprobs") {
            None | Some(Value::Null) => None,
            Some(b) => {
                let b: Vec<f32> = serde_json::from_value(b.clone())
                    .map_err(|e| anyhow::anyhow!("line {}: behavior_logprobs: {e}", n + 1))?;
                anyhow::ensure!(
                    b.len() == completion.len(),
                    "line {}: behavior_logprobs must have one value per completion token",
                    n + 1
                );
                Some(b)
            }
        };
        let reward = v.get("reward").and_then(Value::as_f64).unwrap_or(0.0) as f32;
        anyhow::ensure!(reward.is_finite(), "line {}: reward is not finite", n + 1);
        let group = match v.get("group") {
            Some(Value::String(s)) => s.clone(),
            Some(Value::Number(x)) => x.to_string(),
            _ => format!("line-{}", n + 1),
        };
        out.push(Sample {
            prompt,
            completion,
            reward,
            group,
            behavior,
            sampling: None,
            sampled_by_current: Vec::new(),
            // The turns of one episode (a multi-turn task) share its reward and advantage.
            episode: v.get("episode").and_then(Value::as_str).map(str::to_string),
            forced: Vec::new(),
        });
    }
    Ok(out)
}

/// Prompt and completion token ids of a text line (`prompt` + `completion`, or `messages`).
fn text_sample(v: &Value, tok: &Tokenizer) -> anyhow::Result<(Vec<u32>, Vec<u32>)> {
    let continuation = |text: &str| -> anyhow::Result<Vec<u32>> {
        let mut ids = tok.encode(text)?;
        if tok.add_bos && ids.first() == tok.bos_id.as_ref() {
            ids.remove(0);
        }
        Ok(ids)
    };
    if let Some(m) = v.get("messages") {
        let msgs: Vec<ChatMessage> =
            serde_json::from_value(m.clone()).map_err(|e| anyhow::anyhow!("messages: {e}"))?;
        let last = msgs.last().map(|m| m.role.as_str());
        anyhow::ensure!(
            msgs.len() >= 2 && last == Some("assistant"),
            "messages: need at least two, the last the assistant's"
        );
        let prompt = tok.apply_chat_template(&msgs[..msgs.len() - 1], true)?;
        let whole = tok.apply_chat_template(&msgs, false)?;
        let rest = whole.strip_prefix(prompt.as_str()).ok_or_else(|| {
            anyhow::anyhow!("messages: the chat template does not extend the prompt")
        })?;
        return Ok((tok.encode(&prompt)?, continuation(rest)?));
    }
    match (v.get("prompt"), v.get("completion")) {
        (Some(Value::String(p)), Some(Value::String(c))) => Ok((tok.encode(p)?, continuation(c)?)),
        _ => anyhow::bail!(
            "give prompt_token_ids + completion_token_ids, prompt + completion (text), or messages"
        ),
    }
}
