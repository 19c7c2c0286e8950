//! An offline training job (`flywheel train`): where the adapter and optimizer start (a PEFT
//! folder, its optimizer state when present, or a new identity adapter), the data, and the loop
//! of steps over its groups in turn.

use super::loss::{LossConfig, LossName};
use super::offline::{grouped, parse_jsonl, step, Batch, StepStats};
use super::optim::{self, AdamW, AdamWConfig};
use crate::adapter::{
    peft, AdapterBase, AdapterConfig, AdapterLayout, AdapterWeights, LoraConfig, Method,
};
use crate::model::decoder::Decoder;
use crate::model::tokenizer::Tokenizer;
use anyhow::Context;
use flywheel_kernels::Cpu;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Where an offline run starts.
#[derive(Clone, Debug)]
pub enum Start {
    /// A PEFT folder (and its optimizer state, when it has one).
    Folder(PathBuf),
    /// A new identity adapter: "oft" (b=32) or "lora" (r=16) on all seven projections.
    New(String),
}

/// What `flywheel train` runs.
#[derive(Clone, Debug)]
pub struct OfflineJob {
    pub start: Start,
    /// JSONL (see `offline::parse_jsonl`).
    pub data: PathBuf,
    pub loss: String,
    pub lr: f32,
    pub steps: usize,
    pub groups_per_step: usize,
    pub kl_coef: f32,
    pub temperature: f32,
    pub activation_budget: usize,
    /// Recorded as the adapter's base model.
    pub base_model: String,
}

/// The adapter and optimizer a run starts from. A folder without optimizer files starts a new
/// optimizer; one with them resumes it, and refuses to go on when they are unreadable or made
/// for another adapter.
pub fn start_state(
    start: &Start,
    model: &impl AdapterBase,
    base_model: &str,
) -> anyhow::Result<(AdapterWeights, AdamW)> {
    match start {
        Start::Folder(dir) => {
            let w = peft::load(dir, model)?;
            let has_state = [optim::STATE_FILE, optim::CONFIG_FILE]
                .iter()
                .any(|f| dir.join(f).exists());
            if !has_state {
                let n = w.layout.num_params;
                return Ok((w, AdamW::new(AdamWConfig::default(), n)));
            }
            let opt = AdamW::load(dir)
                .with_context(|| format!("the optimizer state in {}", dir.display()))?;
            anyhow::ensure!(
                opt.m.len() == w.layout.num_params,
                "the optimizer state in {} is for {} parameters, the adapter has {}",
                dir.display(),
                opt.m.len(),
                w.layout.num_params
            );
            Ok((w, opt))
        }
        Start::New(kind) => {
            let method = match kind.as_str() {
                "oft" => Method::Oft(Default::default()),
                "lora" => Method::Lora(LoraConfig {
                    r: 16,
                    alpha: 32.0,
                    use_rslora: false,
                }),
                other => anyhow::bail!("--new {other}: oft or lora"),
            };
            let c = AdapterConfig {
                method,
                targets: model.adapter_shape().default_targets(),
                base_model: base_model.to_string(),
            };
            let layout = Arc::new(AdapterLayout::new(c, model)?);
            let n = layout.num_params;
            Ok((
                AdapterWeights::identity(layout, 0),
                AdamW::new(AdamWConfig::default(), n),
            ))
        }
    }
}

/// Run `job`: `job.steps` steps over the data's groups in turn, `on_step` after each. Returns
/// the adapter and optimizer at the end.
pub fn run(
    model: &Decoder,
    cpu: &Cpu,
    tok: &Tokenizer,
    job: &OfflineJob,
    mut on_step: impl FnMut(&StepStats) -> anyhow::Result<()>,
) -> anyhow::Result<(AdapterWeights, AdamW)> {
    anyhow::ensure!(job.temperature > 0.0, "--temperature must be > 0");
    let data: &Path = &job.data;
    let text =
        std::fs::read_to_string(data).with_context(|| format!("reading {}", data.display()))?;
    let samples = parse_jsonl(&text, Some(tok))?;
    let max_len = samples
        .iter()
        .map(|s| s.completion.len())
        .max()
        .unwrap_or(1);
    let loss: LossName = job
        .loss
        .parse()
        .map_err(|e| anyhow::anyhow!("--loss {e}"))?;
    anyhow::ensure!(
        loss != LossName::Distill,
        "--loss distill needs a teacher: a learning adapter's teacher_prompt (serve --learn)"
    );
    let mut cfg = LossConfig::named(loss, max_len, samples.len().max(1));
    cfg.kl_coef = job.kl_coef;
    let (mut w, mut opt) = start_state(&job.start, &model.config, &job.base_model)?;
    opt.config.lr = job.lr;
    let batches = grouped(&samples, loss);
    anyhow::ensure!(
        !batches.is_empty(),
        "no group with a reward signal in {}",
        data.display()
    );
    let mut next = 0;
    for _ in 0..job.steps {
        let take: Vec<&Batch> = (0..job.groups_per_step.max(1))
            .map(|k| &batches[(next + k) % batches.len()])
            .collect();
        next += take.len();
        let (nw, stats) = step(
            model,
            cpu,
            None,
            &w,
            &mut opt,
            &cfg,
            &take,
            job.temperature,
            job.activation_budget,
            usize::MAX,
            None,
        )?;
        w = nw;
        on_step(&stats)?;
    }
    Ok((w, opt))
}
