//! Training runs driven by their client (the Tinker API's `forward_backward` and `optim_step`):
//! each holds its adapter, the gradient summed since its last optimizer step, and its AdamW. The
//! trainer thread owns them (`trainer::Command::Run`), so their passes run where learners' steps
//! run, in the trainer's share of the cores, one call at a time in the order they arrived (a
//! run's calls arrive in its client's order: the SDK sends one after the other's answer).
//! `kept` keeps them across restarts.

pub mod kept;

use super::checkpoint::write_checkpoint;
use crate::adapter::AdapterWeights;
use crate::model::decoder::{Decoder, ModelError, TrainSeq, ACTIVATION_BUDGET};
use crate::train::offline::{micro_batches, Scorer};
use crate::train::optim::{AdamW, AdamWConfig, Schedule};
use crate::train::token_loss::{sequence_loss, TokenInputs, TokenLoss};
use flywheel_kernels::Cpu;
use kept::Kept;
use std::path::PathBuf;

/// Tokens one training pass holds at most (a call with more runs in passes of whole datums,
/// whose gradients add up).
pub const MAX_PASS_TOKENS: usize = 4096;

/// One sequence to score: its tokens (the model input and the last target: the targets are the
/// input shifted by one, checked by the caller), scored from position 1, and per scored token
/// what its loss reads.
#[derive(Clone, Debug)]
pub struct RunDatum {
    pub tokens: Vec<u32>,
    pub inputs: Vec<TokenInputs>,
}

/// AdamW's settings for one step (the SDK's `AdamParams`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StepParams {
    pub lr: f32,
    pub beta1: f32,
    pub beta2: f32,
    pub eps: f32,
    pub weight_decay: f32,
    /// 0: no clipping.
    pub grad_clip_norm: f32,
}

/// A call on a run.
pub enum RunWork {
    ForwardBackward {
        data: Vec<RunDatum>,
        loss: TokenLoss,
        /// Log-probs and losses only (`forward`): no gradient is added.
        forward_only: bool,
    },
    OptimStep(StepParams),
    /// The adapter as it stands (after the calls before), to publish for sampling.
    Snapshot,
    /// Write the adapter and the optimizer as checkpoint folder `data_dir/rel` (atomically).
    Save {
        data_dir: PathBuf,
        rel: String,
    },
    /// Replace the adapter (of the same shape) and, when given, the optimizer with a saved
    /// state's; the summed gradient is cleared.
    Load {
        weights: AdapterWeights,
        opt: Option<AdamW>,
    },
}

/// What a call answers.
pub enum RunOutput {
    ForwardBackward {
        /// Per datum, the log-prob of each target token.
        logprobs: Vec<Vec<f32>>,
        /// Per datum, each token's loss.
        losses: Vec<Vec<f32>>,
        loss_sum: f64,
    },
    OptimStep {
        /// Optimizer steps taken, this one included.
        step: u64,
        /// The gradient's global norm before clipping.
        grad_norm: f64,
        /// Datums whose gradients this step applied.
        datums: usize,
    },
    Weights(AdapterWeights),
    Saved,
    Loaded,
}

/// A run's state.
pub struct RunState {
    weights: AdapterWeights,
    grads: Vec<f32>,
    /// Datums whose gradients are in `grads`.
    accumulated: usize,
    opt: AdamW,
    /// Datums whose summed gradients a restart lost (the next optimizer step is refused).
    pub(crate) lost: usize,
}

impl RunState {
    /// A run from `weights` and `opt` (a new AdamW when None).
    pub fn new(weights: AdapterWeights, opt: Option<AdamW>) -> RunState {
        let n = weights.layout.num_params;
        RunState {
            weights,
            grads: vec![0.0; n],
            accumulated: 0,
            opt: opt.unwrap_or_else(|| AdamW::new(AdamWConfig::default(), n)),
            lost: 0,
        }
    }

    /// The adapter as it stands.
    pub fn weights(&self) -> &AdapterWeights {
        &self.weights
    }

    /// The optimizer as it stands.
    pub fn optimizer(&self) -> &AdamW {
        &self.opt
    }

    /// Carry out `work` (the model at temperature 1, the run's adapter on), keeping each change
    /// of the state with `keep` before it is made. `scorer`: the log-probs of a forward from
    /// there (the serving GPU's) rather than the trainer's forward.
    pub fn work(
        &mut self,
        model: &Decoder,
        cpu: &Cpu,
        scorer: Option<&dyn Scorer>,
        work: RunWork,
        keep: &Kept,
    ) -> Result<RunOutput, RunError> {
        match work {
            RunWork::ForwardBackward {
                data,
                loss,
                forward_only,
            } => {
                let fw = Forwards { model, cpu, scorer };
                self.forward_backward(fw, &data, loss, forward_only, keep)
            }
            RunWork::OptimStep(p) => self.optim_step(p, keep),
            RunWork::Save { data_dir, rel } => {
                let at = (self.opt.step, 0);
                write_checkpoint(&data_dir, &rel, at, &self.weights, &self.opt, true)
                    .map_err(|e| RunError::Write(e.to_string()))?;
                Ok(RunOutput::Saved)
            }
            RunWork::Load { weights, opt } => {
                let (have, got) = (&self.weights.layout, &weights.layout);
                if have.config != got.config || have.num_params != got.num_params {
                    return Err(RunError::Shape(format!(
                        "the saved state's adapter ({:?} on {:?}) is not this run's ({:?} on {:?})",
                        got.config.method,
                        got.config.targets,
                        have.config.method,
                        have.config.targets
                    )));
                }
                let opt = opt.unwrap_or_else(|| self.opt.clone());
                keep.state(&weights, &opt)?;
                (self.weights, self.opt) = (weights, opt);
                self.grads.iter_mut().for_each(|g| *g = 0.0);
                (self.accumulated, self.lost) = (0, 0);
                Ok(RunOutput::Loaded)
            }
            RunWork::Snapshot => {
                // A copy of its own (a version's weights are never shared with training).
                let w = &self.weights;
                AdapterWeights::new(w.layout.clone(), w.params.clone())
                    .map(RunOutput::Weights)
                    .map_err(|e| RunError::NotFinite(e.to_string()))
            }
        }
    }

    fn forward_backward(
        &mut self,
        Forwards { model, cpu, scorer }: Forwards,
        data: &[RunDatum],
        loss: TokenLoss,
        forward_only: bool,
        keep: &Kept,
    ) -> Result<RunOutput, RunError> {
        let pairs: Vec<(&[u32], &[u32])> = data
            .iter()
            .map(|d| (&d.tokens[..1], &d.tokens[1..]))
            .collect();
        let (mut logprobs, mut losses, mut loss_sum) = (Vec::new(), Vec::new(), 0.0);
        // A new gradient buffer: nothing is added to the run's unless every pass succeeded.
        let mut grads = if forward_only {
            Vec::new()
        } else {
            vec![0.0f32; self.grads.len()]
        };
        for range in micro_batches(&pairs, MAX_PASS_TOKENS) {
            let seqs: Vec<TrainSeq> = data[range.clone()]
                .iter()
                .map(|d| TrainSeq::whole(&d.tokens, 1))
                .collect();
            let (mut lps, state) = if forward_only && scorer.is_none() {
                (model.logprobs(cpu, &seqs, Some(&self.weights), 1.0)?, None)
            } else if forward_only {
                (Vec::new(), None)
            } else {
                let (l, st) =
                    model.train_forward(cpu, &seqs, &self.weights, 1.0, ACTIVATION_BUDGET)?;
                (l, Some(st))
            };
            if let Some(s) = scorer {
                lps = s
                    .logprobs(&seqs, Some(&self.weights), 1.0)
                    .map_err(|e| RunError::Device(e.to_string()))?;
            }
            let mut grad_logp = Vec::with_capacity(seqs.len());
            for (lp, d) in lps.iter().zip(&data[range]) {
                let (l, g, sum) = sequence_loss(loss, lp, &d.inputs);
                loss_sum += sum;
                losses.push(l);
                grad_logp.push(g);
            }
            if let Some(st) = state {
                model.train_backward(cpu, &seqs, &self.weights, st, &grad_logp, &mut grads)?;
            }
            logprobs.extend(lps);
        }
        if !forward_only {
            keep.pending(self.accumulated + data.len())?;
            self.grads.iter_mut().zip(&grads).for_each(|(a, g)| *a += g);
            self.accumulated += data.len();
        }
        Ok(RunOutput::ForwardBackward {
            logprobs,
            losses,
            loss_sum,
        })
    }

    /// One AdamW step with the gradient summed since the last (zero if none), which is then
    /// cleared. A step that would leave a weight not finite changes nothing. After a restart
    /// that lost summed gradients, the first step is refused, and clears the gradient.
    fn optim_step(&mut self, p: StepParams, keep: &Kept) -> Result<RunOutput, RunError> {
        if self.lost > 0 {
            keep.pending(0)?;
            let lost = std::mem::take(&mut self.lost);
            self.grads.iter_mut().for_each(|g| *g = 0.0);
            self.accumulated = 0;
            return Err(RunError::Lost(lost, self.opt.step));
        }
        let mut opt = self.opt.clone();
        opt.config = AdamWConfig {
            lr: p.lr,
            beta1: p.beta1,
            beta2: p.beta2,
            eps: p.eps,
            weight_decay: p.weight_decay,
            max_grad_norm: (p.grad_clip_norm > 0.0).then_some(p.grad_clip_norm),
            schedule: Schedule::Constant,
        };
        let mut params = self.weights.params.clone();
        let mut grads = self.grads.clone();
        let stats = opt.step(&mut params, &mut grads);
        let w = AdapterWeights::new(self.weights.layout.clone(), params)
            .map_err(|e| RunError::NotFinite(e.to_string()))?;
        keep.state(&w, &opt)?;
        (self.weights, self.opt) = (w, opt);
        self.grads.iter_mut().for_each(|g| *g = 0.0);
        let datums = std::mem::take(&mut self.accumulated);
        Ok(RunOutput::OptimStep {
            step: self.opt.step,
            grad_norm: stats.grad_norm,
            datums,
        })
    }
}

/// What a run's forwards run on: the trainer's model and CPU, and where a forward's log-probs
/// come from instead (the serving GPU's, `Scorer`).
#[derive(Clone, Copy)]
struct Forwards<'a> {
    model: &'a Decoder,
    cpu: &'a Cpu,
    scorer: Option<&'a dyn Scorer>,
}

/// Why a call on a run failed (nothing of it was applied).
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    #[error(transparent)]
    Model(#[from] ModelError),
    #[error("the optimizer step would make the adapter's weights not finite ({0}): not applied")]
    NotFinite(String),
    #[error("saving the state: {0}")]
    Write(String),
    /// The request's fault: a saved state of another shape.
    #[error("{0}")]
    Shape(String),
    /// A restart lost the gradients summed for this step.
    #[error(
        "the server restarted after the gradients of {0} datums were summed for this step and \
         before it: they were lost (the run is back at optimizer step {1}). Nothing was applied \
         and the run's gradient is now empty: send this step's forward_backward calls again, \
         then optim_step"
    )]
    Lost(usize, u64),
    /// The serving device's forward failed (`Scorer`).
    #[error("the serving device's forward: {0}")]
    Device(String),
}

impl RunError {
    /// Whether the request caused it (the Tinker API's "user" category).
    pub fn is_user(&self) -> bool {
        matches!(self, RunError::Shape(_) | RunError::Lost(..))
    }
}
