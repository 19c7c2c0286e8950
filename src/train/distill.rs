//! On-policy distillation: a teacher scores the student's sampled tokens and each token's
//! advantage is `weight` · (log π_teacher(o_t) − log π_student(o_t)), the negative of the
//! per-token reverse KL estimate (Tinker's, NeMo-RL's, prime-rl's). The teacher here is the base
//! model (the adapter off) reading `prefix` before the prompt: prompt distillation, the adapter
//! learning to answer without the prompt as the base does with it. Its log-probs come from the
//! trainer's own forward (`Decoder::logprobs`, the arithmetic prompt scoring uses).

use super::pack::{micro_batches, Packed};
use crate::model::decoder::Decoder;
use flywheel_kernels::Cpu;

/// A teacher: the tokens it reads before each prompt, and the weight of its advantage.
#[derive(Clone, Debug, PartialEq)]
pub struct Teacher {
    pub prefix: Vec<u32>,
    pub weight: f32,
}

/// Each sample's (prompt, completion) per-token teacher advantage and the mean reverse-KL estimate
/// (1/N) Σ_t (log π_student − log π_teacher) over every token, given the student's log-probs
/// `student` (the step's forward).
pub fn teacher_advantages(
    model: &Decoder,
    cpu: &Cpu,
    samples: &[(&[u32], &[u32])],
    student: &[Vec<f32>],
    teacher: &Teacher,
    temperature: f32,
    max_tokens: usize,
) -> anyhow::Result<(Vec<Vec<f32>>, f64)> {
    let prompts: Vec<Vec<u32>> = samples
        .iter()
        .map(|(p, _)| [teacher.prefix.as_slice(), p].concat())
        .collect();
    let pairs: Vec<(&[u32], &[u32])> = samples
        .iter()
        .zip(&prompts)
        .map(|((_, c), p)| (p.as_slice(), *c))
        .collect();
    let mut lp: Vec<Vec<f32>> = Vec::with_capacity(samples.len());
    for r in micro_batches(&pairs, max_tokens) {
        let packed = Packed::new(&pairs[r], true);
        let l = model.logprobs(cpu, &packed.seqs(), None, temperature)?;
        lp.extend(packed.of_sample.iter().map(|&q| l[q].clone()));
    }
    let (mut kl, mut n) = (0.0f64, 0usize);
    let adv = lp
        .iter()
        .zip(student)
        .map(|(t, s)| {
            t.iter()
                .zip(s)
                .map(|(&t, &s)| {
                    kl += s as f64 - t as f64;
                    n += 1;
                    teacher.weight * (t - s)
                })
                .collect()
        })
        .collect();
    Ok((adv, kl / n.max(1) as f64))
}
