//! Training: policy-gradient losses as pure functions (`loss`; per token as the Tinker API names
//! them: `token_loss`), the optimizer (`optim`), packing (`pack`), one step (`offline::step`, also
//! the online trainer's) and an offline job (`job`).

pub mod correction;
pub mod distill;
pub mod job;
pub mod loss;
pub mod offline;
pub mod optim;
pub mod pack;
pub mod token_loss;

use crate::adapter::AdapterWeights;
use crate::model::decoder::{Decoder, ModelError, TrainSeq};
use flywheel_kernels::Cpu;

/// The objective J = Σ over completion tokens of log π(token | prefix) (temperature 1, the adapter
/// on), the completion's log-probs, and dJ/dθ in the adapter's layout (`flywheel grad`).
pub fn objective_grad(
    model: &Decoder,
    cpu: &Cpu,
    adapter: &AdapterWeights,
    tokens: &[u32],
    prompt_len: usize,
) -> Result<(f64, Vec<f32>, Vec<f32>), ModelError> {
    let seqs = [TrainSeq::whole(tokens, prompt_len)];
    let (logps, st) = model.train_forward(
        cpu,
        &seqs,
        adapter,
        1.0,
        crate::model::decoder::ACTIVATION_BUDGET,
    )?;
    let ones: Vec<Vec<f32>> = logps.iter().map(|l| vec![1.0; l.len()]).collect();
    let mut grads = vec![0.0f32; adapter.layout.num_params];
    model.train_backward(cpu, &seqs, adapter, st, &ones, &mut grads)?;
    let j = logps[0].iter().map(|v| *v as f64).sum();
    Ok((j, logps.into_iter().next().unwrap_or_default(), grads))
}
