//! Learning configuration: `[online]` (the rollout log and the trainer's rules) and one `[[learn]]`
//! table per learning adapter (also `serve --learn NAME` and `POST /v1/adapters/{name}/train`).

use super::eval::{EvalSet, RawEvalItem, EVAL_MAX_TOKENS};
use super::guard::{AfterRollback, GuardConfig};
use super::promotion::{Policy, PromotionConfig, RawPromotion};
use super::share_policy::SharePolicy;
use crate::engine::repetition::RepetitionRule;
use crate::train::correction::Correction;
use crate::train::loss::LossName;
use serde::Deserialize;
use std::path::PathBuf;

mod serving;
pub use serving::{RawRepetition, VersionPolicy, VersionSwitch};

/// `[online]` as written.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawOnline {
    pub data_dir: Option<PathBuf>,
    pub rollout_store: Option<String>,
    pub adapter_store: Option<String>,
    #[serde(default)]
    pub adapter_store_options: std::collections::BTreeMap<String, String>,
    pub role: Option<String>,
    pub reward_min: Option<f64>,
    pub reward_max: Option<f64>,
    pub max_off_policy_steps: Option<u64>,
    pub group_timeout_secs: Option<f64>,
    pub train_off_policy_samples: Option<bool>,
    pub retention_days: Option<f64>,
    pub retention_max_rows: Option<usize>,
    pub max_step_tokens: Option<usize>,
    pub train_share: Option<f64>,
    pub train_target_steps_per_minute: Option<f64>,
    pub train_max_stale_fraction: Option<f64>,
    pub train_itl_budget: Option<f64>,
    pub activation_mb: Option<usize>,
}

/// One `[[learn]]` table as written (also the body of `POST /v1/adapters/{name}/train`).
#[derive(Clone, Debug, Default, Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields)]
pub struct RawLearn {
    /// Required in `[[learn]]`; taken from the path in `POST /v1/adapters/{name}/train`.
    #[serde(default)]
    pub name: String,
    /// "oft" (default) or "lora".
    pub method: Option<String>,
    pub loss: Option<String>,
    pub lr: Option<f32>,
    pub groups_per_step: Option<usize>,
    pub kl_coef: Option<f32>,
    pub clip_low: Option<f32>,
    pub clip_high: Option<f32>,
    pub oft_block_size: Option<usize>,
    pub lora_r: Option<usize>,
    /// The reward guard's window in steps (0: off); see `online::guard`.
    pub guard_window: Option<usize>,
    pub guard_reward_z: Option<f64>,
    pub guard_reward_min_drop: Option<f64>,
    pub guard_max_kl: Option<f64>,
    pub guard_min_entropy: Option<f64>,
    /// "pause" (default) or "continue": what training does after a guard rolls back.
    pub after_rollback: Option<String>,
    /// "immediate" (default), "gated" or "canary"; see `online::promotion`.
    pub promotion: Option<String>,
    pub promotion_margin: Option<f64>,
    pub canary_fraction: Option<f64>,
    pub canary_window: Option<usize>,
    pub canary_z: Option<f64>,
    pub canary_max_secs: Option<f64>,
    /// "incumbent" (default) or "candidate": where a gated trainer goes on from after a hold.
    pub on_hold: Option<String>,
    /// The evaluation set (`[[learn.eval]]`); see `online::eval`.
    pub eval: Option<Vec<RawEvalItem>>,
    pub eval_max_tokens: Option<usize>,
    /// End its choices stuck in a loop (`finish_reason: "repetition"`): true (the default rule),
    /// false, or a rule; a request's `stop_on_repetition` overrides it.
    pub stop_on_repetition: Option<RawRepetition>,
    /// The reward samples that ended in a loop train with, whatever was posted (Kimi k1.5's
    /// repetition penalty).
    pub repetition_reward: Option<f64>,
    /// An off-policy correction (`train::correction`): "none" (default), "tis", "mis" or
    /// "icepop"; with one, samples not drawn from the policy (stale, constrained, penalized,
    /// truncated) train weighted by it instead of being dropped.
    pub correction: Option<String>,
    /// "token" (default), "sequence" or "geometric".
    pub correction_level: Option<String>,
    /// tis: the truncation cap (default 2).
    pub correction_cap: Option<f32>,
    /// mis, icepop: the band kept (default [0.5, 2]).
    pub correction_low: Option<f32>,
    pub correction_high: Option<f32>,
    /// On-policy distillation's teacher: the base model reading this text before each prompt
    /// (its tokens as the model's tokenizer reads them, special tokens included: write it in the
    /// chat template's form, e.g. a system turn). With `loss = "distill"`, or a `distill_weight`.
    pub teacher_prompt: Option<String>,
    /// The teacher's per-token advantage weight (default 1 with loss "distill"; with a reward
    /// loss, the teacher's advantage is added to the reward's with this weight).
    pub distill_weight: Option<f32>,
    /// "pinned" (default): a request runs on the version it was admitted with to its end;
    /// "latest": a generation moves to each newly published version at a step boundary (partial
    /// rollouts; `VersionPolicy`).
    pub version_policy: Option<String>,
    /// "recompute" (default) or "keep": what a switch to a newer version does with the K/V
    /// computed so far (`VersionSwitch`); with `version_policy = "latest"` only.
    pub version_switch: Option<String>,
}

/// The validated `[online]` settings.
#[derive(Clone, Debug)]
pub struct OnlineConfig {
    /// Holds `flywheel.db` (the rollout log, unless `rollout_store` names another) and
    /// `adapters/NAME/step-N` checkpoints.
    pub data_dir: PathBuf,
    /// Where the rollout log lives: None, SQLite in `data_dir`; `postgres://...`, PostgreSQL
    /// (shared by several serving replicas and a trainer).
    pub rollout_store: Option<String>,
    /// Where adapter versions are published: None, the data directory only (a serving replica
    /// reads them there, shared); `file:///dir` or `s3://bucket/prefix`, an object store the
    /// trainer uploads each version to and replicas fetch it from (`online::adapter_store`).
    pub adapter_store: Option<String>,
    /// object_store's settings for an `s3://` adapter store (`aws_endpoint`, `aws_region`, ...).
    pub adapter_store_options: std::collections::BTreeMap<String, String>,
    /// What this process does for its learning adapters.
    pub role: Role,
    pub reward_min: f64,
    pub reward_max: f64,
    /// Groups sampled more than this many versions before the current one are dropped.
    pub max_off_policy_steps: u64,
    /// A group with at least two rewards trains after this long even if incomplete.
    pub group_timeout_secs: f64,
    /// Train on completions sampled with truncation, penalties or biases (default: no; their
    /// behaviour log-probs are not the distribution they were drawn from).
    pub train_off_policy_samples: bool,
    pub retention_days: f64,
    pub retention_max_rows: usize,
    /// Tokens (prompt + completion, summed over a step's sequences) one step takes at most.
    pub max_step_tokens: usize,
    /// The split of the cores while serving is busy: the trainer's share of compute time per unit
    /// of serving time (between engine steps), fixed or steered (`share_policy`); all of it when
    /// serving is idle.
    pub share: SharePolicy,
    /// Memory a step's kept activations may take (beyond it, layers are recomputed).
    pub activation_mb: usize,
}

/// What a process does for its learning adapters (`--role`, `online.role`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    /// Serve, log, take rewards and train: one process (the default).
    All,
    /// Train and publish (it serves too; a deployment sends its clients to the replicas).
    Train,
    /// Serve, log and take rewards; follow the trainer's versions (published in the shared
    /// rollout store, their files in the adapter store or else the shared data directory);
    /// never train.
    Serve,
}

impl Role {
    pub fn parse(s: &str) -> Result<Role, InvalidSetting> {
        match s {
            "all" => Ok(Role::All),
            "train" => Ok(Role::Train),
            "serve" => Ok(Role::Serve),
            other => Err(InvalidSetting::new(
                "role",
                format!("must be \"all\", \"train\" or \"serve\", not \"{other}\""),
            )),
        }
    }

    /// Whether this process trains (else it follows a trainer).
    pub fn trains(self) -> bool {
        self != Role::Serve
    }
}

/// What a learning adapter trains: OFT's orthogonal blocks or LoRA's low-rank updates.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum LearnMethod {
    Oft,
    Lora,
}

impl LearnMethod {
    pub fn name(self) -> &'static str {
        match self {
            LearnMethod::Oft => "oft",
            LearnMethod::Lora => "lora",
        }
    }

    /// The setting that sizes it (`oft_block_size`, `lora_r`).
    pub fn size_setting(self) -> &'static str {
        match self {
            LearnMethod::Oft => "oft_block_size",
            LearnMethod::Lora => "lora_r",
        }
    }
}

impl std::fmt::Display for LearnMethod {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// A learning adapter's validated settings.
#[derive(Clone, Debug, serde::Serialize)]
pub struct LearnConfig {
    pub name: String,
    pub method: LearnMethod,
    pub loss: LossName,
    pub lr: f32,
    pub groups_per_step: usize,
    pub kl_coef: f32,
    pub clip_low: Option<f32>,
    pub clip_high: Option<f32>,
    pub oft_block_size: usize,
    pub lora_r: usize,
    /// Shown and taken back under `[[learn]]`'s own keys (`guard_window`, ...).
    #[serde(flatten)]
    pub guards: GuardConfig,
    /// Shown under `promotion`, `promotion_margin` and `on_hold`.
    #[serde(flatten)]
    pub promotion: PromotionConfig,
    /// Shown as the items written.
    pub eval: std::sync::Arc<EvalSet>,
    pub eval_max_tokens: usize,
    /// The repetition rule its requests run with unless they say (None: off).
    pub stop_on_repetition: Option<RepetitionRule>,
    pub repetition_reward: Option<f64>,
    /// The off-policy correction its loss applies (None: none).
    pub correction: Option<Correction>,
    /// On-policy distillation's teacher prompt, and its advantage's weight (None: no teacher).
    pub teacher_prompt: Option<String>,
    pub distill_weight: Option<f32>,
    pub version_policy: VersionPolicy,
    pub version_switch: VersionSwitch,
}

/// A setting of `[online]` that cannot be honoured: its key (under `online.`) and why.
#[derive(Debug, thiserror::Error)]
#[error("online.{key} {why}")]
pub struct InvalidSetting {
    pub key: String,
    pub why: String,
}

impl InvalidSetting {
    pub fn new(key: impl Into<String>, why: impl Into<String>) -> InvalidSetting {
        InvalidSetting {
            key: key.into(),
            why: why.into(),
        }
    }
}

impl RawOnline {
    pub fn validate(self) -> Result<OnlineConfig, InvalidSetting> {
        let c = OnlineConfig {
            data_dir: self.data_dir.unwrap_or_else(|| PathBuf::from("data")),
            rollout_store: self.rollout_store.filter(|s| !s.is_empty()),
            adapter_store: self.adapter_store.filter(|s| !s.is_empty()),
            adapter_store_options: self.adapter_store_options,
            role: Role::parse(self.role.as_deref().unwrap_or("all"))?,
            reward_min: self.reward_min.unwrap_or(-1e6),
            reward_max: self.reward_max.unwrap_or(1e6),
            max_off_policy_steps: self.max_off_policy_steps.unwrap_or(4),
            group_timeout_secs: self.group_timeout_secs.unwrap_or(300.0),
            train_off_policy_samples: self.train_off_policy_samples.unwrap_or(false),
            retention_days: self.retention_days.unwrap_or(30.0),
            retention_max_rows: self.retention_max_rows.unwrap_or(1_000_000),
            max_step_tokens: self.max_step_tokens.unwrap_or(8192),
            share: SharePolicy {
                train_share: self
                    .train_share
                    .unwrap_or(SharePolicy::default().train_share),
                target_steps_per_minute: self.train_target_steps_per_minute,
                max_stale_fraction: self.train_max_stale_fraction,
                itl_budget: self.train_itl_budget,
            },
            activation_mb: self
                .activation_mb
                .unwrap_or(crate::model::decoder::ACTIVATION_BUDGET >> 20),
        };
        if let Err((field, why)) = c.share.validate() {
            let key = if field == "train_share" {
                field.to_string()
            } else {
                format!("train_{field}")
            };
            return Err(InvalidSetting::new(key, why));
        }
        if !(c.reward_min.is_finite() && c.reward_max.is_finite() && c.reward_min < c.reward_max) {
            return Err(InvalidSetting::new(
                "reward_min",
                "must be below online.reward_max, both finite",
            ));
        }
        if !(c.group_timeout_secs > 0.0 && c.retention_days > 0.0) {
            return Err(InvalidSetting::new(
                "group_timeout_secs",
                "and online.retention_days must be > 0",
            ));
        }
        if c.role == Role::Serve && c.rollout_store.is_none() {
            return Err(InvalidSetting::new(
                "role",
                "\"serve\" follows a trainer through a shared rollout store: give \
                 online.rollout_store (postgres://...)",
            ));
        }
        if let Some(url) = &c.adapter_store {
            check_url(url, &c.adapter_store_options)?;
        } else if let Some(k) = c.adapter_store_options.keys().next() {
            return Err(InvalidSetting::new(
                format!("adapter_store_options.{k}"),
                "is set but online.adapter_store is not",
            ));
        }
        if c.max_step_tokens < 64 {
            return Err(InvalidSetting::new(
                "max_step_tokens",
                "must be at least 64",
            ));
        }
        Ok(c)
    }
}

/// Check `url`'s scheme and `options`' keys (what `[online]` validation can know).
pub fn check_url(
    url: &str,
    options: &std::collections::BTreeMap<String, String>,
) -> Result<(), InvalidSetting> {
    let url_error = |why: &str| InvalidSetting::new("adapter_store", format!("'{url}': {why}"));
    let option_error = |k: &str, why: &str| {
        InvalidSetting::new(format!("adapter_store_options.{k}"), why.to_string())
    };
    if let Some(dir) = url.strip_prefix("file://") {
        if !dir.starts_with('/') {
            return Err(url_error(
                "a file:// URL names an absolute folder (file:///shared/adapters)",
            ));
        }
        if let Some(k) = options.keys().next() {
            return Err(option_error(
                k,
                "is set, and a file:// store takes no options",
            ));
        }
        return Ok(());
    }
    let Some(rest) = url.strip_prefix("s3://") else {
        return Err(url_error("file:///dir or s3://bucket/prefix"));
    };
    if rest.split('/').next().unwrap_or("").is_empty() {
        return Err(url_error("name the bucket (s3://bucket/prefix)"));
    }
    for k in options.keys() {
        if k.to_ascii_lowercase()
            .parse::<object_store::aws::AmazonS3ConfigKey>()
            .is_err()
        {
            return Err(option_error(
                k,
                "is not an S3 setting of object_store (aws_endpoint, aws_region, \
                 aws_allow_http, aws_access_key_id, ...)",
            ));
        }
    }
    Ok(())
}

impl RawLearn {
    pub fn named(name: &str) -> RawLearn {
        RawLearn {
            name: name.to_string(),
            ..RawLearn::default()
        }
    }

    pub fn validate(self) -> Result<LearnConfig, (&'static str, String)> {
        // The adapter's rules (its files live under one encoded component, never a raw path).
        if let Err(why) = crate::adapter::registry::check_adapter_name(&self.name) {
            return Err(("name", format!("'{}' {why}", self.name)));
        }
        let method = match self.method.as_deref() {
            None | Some("oft") => LearnMethod::Oft,
            Some("lora") => LearnMethod::Lora,
            Some(other) => return Err(("method", format!("'{other}': oft or lora"))),
        };
        // SFT needs no reward: not a loss to learn from rewards with.
        let loss = match self.loss.as_deref().unwrap_or("grpo").parse() {
            Ok(l) if l != LossName::Sft => l,
            _ => {
                let loss = self.loss.unwrap_or_default();
                return Err((
                    "loss",
                    format!("'{loss}': grpo, dapo, dr_grpo, gspo, masked_is or distill"),
                ));
            }
        };
        let d = GuardConfig::default();
        let guards = GuardConfig {
            window: self.guard_window.unwrap_or(d.window),
            reward_z: self.guard_reward_z.unwrap_or(d.reward_z),
            reward_min_drop: self.guard_reward_min_drop.unwrap_or(d.reward_min_drop),
            max_kl: self.guard_max_kl,
            min_entropy: self.guard_min_entropy,
            after_rollback: match self.after_rollback.as_deref() {
                None | Some("pause") => AfterRollback::Pause,
                Some("continue") => AfterRollback::Continue,
                Some(other) => {
                    return Err(("after_rollback", format!("'{other}': pause or continue")))
                }
            },
        };
        if guards.window > 64 {
            return Err(("guard_window", "must be in 0..=64".into()));
        }
        for (k, v) in [
            ("guard_reward_z", Some(guards.reward_z)),
            ("guard_reward_min_drop", Some(guards.reward_min_drop)),
            ("guard_max_kl", guards.max_kl),
            ("guard_min_entropy", guards.min_entropy),
        ] {
            if v.is_some_and(|v| !(v >= 0.0 && v.is_finite())) {
                return Err((k, "must be a finite number >= 0".into()));
            }
        }
        let promotion = PromotionConfig::parse(RawPromotion {
            policy: self.promotion.as_deref(),
            margin: self.promotion_margin,
            on_hold: self.on_hold.as_deref(),
            canary_fraction: self.canary_fraction,
            canary_window: self.canary_window,
            canary_z: self.canary_z,
            canary_max_secs: self.canary_max_secs,
        })?;
        let eval_max_tokens = self.eval_max_tokens.unwrap_or(EVAL_MAX_TOKENS);
        let eval =
            EvalSet::new(self.eval.unwrap_or_default(), eval_max_tokens).map_err(|e| {
                match e.strip_prefix("eval_max_tokens ") {
                    Some(why) => ("eval_max_tokens", why.to_string()),
                    None => ("eval", format!("eval{e}")),
                }
            })?;
        if promotion.policy == Policy::Gated && eval.is_empty() {
            return Err((
                "promotion",
                "\"gated\" promotes by evaluation score: give an evaluation set (eval)".into(),
            ));
        }
        let c = LearnConfig {
            name: self.name,
            method,
            loss,
            lr: self.lr.unwrap_or(2e-4),
            groups_per_step: self.groups_per_step.unwrap_or(1),
            kl_coef: self.kl_coef.unwrap_or(0.0),
            clip_low: self.clip_low,
            clip_high: self.clip_high,
            oft_block_size: self.oft_block_size.unwrap_or(32),
            lora_r: self.lora_r.unwrap_or(16),
            guards,
            promotion,
            eval: std::sync::Arc::new(eval),
            eval_max_tokens,
            stop_on_repetition: self
                .stop_on_repetition
                .map(RawRepetition::rule)
                .transpose()
                .map_err(|e| ("stop_on_repetition", e))?
                .flatten(),
            repetition_reward: self.repetition_reward,
            teacher_prompt: self.teacher_prompt,
            distill_weight: self.distill_weight,
            version_policy: match self.version_policy.as_deref() {
                None | Some("pinned") => VersionPolicy::Pinned,
                Some("latest") => VersionPolicy::Latest,
                Some(other) => {
                    return Err(("version_policy", format!("'{other}': pinned or latest")))
                }
            },
            version_switch: match (self.version_switch.as_deref(), &self.version_policy) {
                (None | Some("recompute"), _) => VersionSwitch::Recompute,
                (Some("keep"), Some(p)) if p == "latest" => VersionSwitch::Keep,
                (Some("keep"), _) => {
                    return Err((
                        "version_switch",
                        "is set, and version_policy is not \"latest\"".into(),
                    ))
                }
                (Some(other), _) => {
                    return Err(("version_switch", format!("'{other}': recompute or keep")))
                }
            },
            correction: match self.correction.as_deref() {
                None | Some("none") => {
                    for (k, given) in [
                        ("correction_level", self.correction_level.is_some()),
                        ("correction_cap", self.correction_cap.is_some()),
                        ("correction_low", self.correction_low.is_some()),
                        ("correction_high", self.correction_high.is_some()),
                    ] {
                        if given {
                            return Err((k, "is set, and there is no correction".into()));
                        }
                    }
                    None
                }
                Some(name) => {
                    if loss == LossName::MaskedIs {
                        return Err((
                            "correction",
                            "masked_is weighs its tokens already: use grpo, dapo, dr_grpo or \
                             gspo with a correction"
                                .into(),
                        ));
                    }
                    let level = self
                        .correction_level
                        .as_deref()
                        .map(str::parse)
                        .transpose()
                        .map_err(|e| ("correction_level", e))?;
                    Some(Correction::named(
                        name,
                        level,
                        self.correction_cap,
                        (self.correction_low, self.correction_high),
                    )?)
                }
            },
        };
        match (&c.teacher_prompt, c.distill_weight, c.loss) {
            (None, _, LossName::Distill) => {
                return Err((
                    "teacher_prompt",
                    "loss \"distill\" learns from a teacher: give its teacher_prompt".into(),
                ))
            }
            (None, Some(_), _) => {
                return Err((
                    "distill_weight",
                    "is set, and there is no teacher_prompt".into(),
                ))
            }
            (Some(_), None, l) if l != LossName::Distill => {
                return Err((
                    "teacher_prompt",
                    "is set: use loss \"distill\", or mix the teacher in with distill_weight"
                        .into(),
                ))
            }
            (Some(p), _, _) if p.is_empty() => return Err(("teacher_prompt", "is empty".into())),
            (Some(_), _, LossName::Gspo) => {
                return Err((
                    "teacher_prompt",
                    "gspo's ratio is per sequence; a teacher's advantages are per token".into(),
                ))
            }
            (_, Some(w), _) if !(w > 0.0 && w.is_finite()) => {
                return Err(("distill_weight", "must be a finite number > 0".into()))
            }
            _ => {}
        }
        if c.repetition_reward.is_some_and(|r| !r.is_finite()) {
            return Err(("repetition_reward", "must be a finite number".into()));
        }
        if !(c.lr > 0.0 && c.lr < 1.0) {
            return Err(("lr", "must be in (0, 1)".into()));
        }
        if !(1..=64).contains(&c.groups_per_step) {
            return Err(("groups_per_step", "must be in 1..=64".into()));
        }
        if !(c.kl_coef >= 0.0 && c.kl_coef.is_finite()) {
            return Err(("kl_coef", "must be >= 0".into()));
        }
        for (k, v) in [("clip_low", c.clip_low), ("clip_high", c.clip_high)] {
            if v.is_some_and(|v| !(v > 0.0 && v < 10.0)) {
                return Err((k, "must be in (0, 10)".into()));
            }
        }
        Ok(c)
    }
}

#[cfg(test)]
mod tests;
