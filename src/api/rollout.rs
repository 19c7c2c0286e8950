//! A finished request through a learning adapter, written to the rollout log: one record per
//! choice with the prompt and completion token ids, the sampler's log-probs, the pinned version,
//! the group (the request's choices, or the client's `group` scoped to its key) and whether the
//! completion was drawn from the policy's own distribution.

use super::error::ApiError;
use super::job::Job;
use crate::online::start::Learning;
use crate::online::store::records::{CompletionRecord, GroupKey, LoggedParams, VersionSpan};
use crate::policy::is_greedy;

/// One choice as served.
pub struct Served<'a> {
    pub tokens: &'a [u32],
    /// The sampler's log-prob of each token.
    pub behavior: &'a [f32],
    /// Each token's log-prob under the distribution it was drawn from.
    pub sampling: &'a [f32],
    /// Positions of the tokens a grammar forced: not trained (the model chose nothing there).
    pub forced: &'a [u32],
    /// The adapter versions that computed its tokens (one span unless the generation moved to a
    /// newer version: partial rollouts).
    pub versions: &'a [VersionSpan],
    pub finish_reason: &'static str,
}

/// Log the choices of request `id` (one transaction, committed before this returns).
///
/// `first_choice` numbers the choices as the response does (a request of several prompts: prompt
/// × n + i); each such prompt's choices are a group of their own (`part`).
pub async fn log_choices(
    online: &Learning,
    job: &Job,
    id: &str,
    choices: &[Served<'_>],
    first_choice: usize,
    part: Option<usize>,
) -> Result<(), ApiError> {
    let Some(a) = &job.adapter else {
        return Ok(());
    };
    let p = &job.params;
    let key_hash = online.store.key_hash(&job.key);
    let (group, group_size) = match (&p.group, &p.episode) {
        (Some(group), _) => (
            GroupKey::Client {
                key_hash: job.group_owner.as_deref().unwrap_or(&key_hash),
                group,
            },
            0,
        ),
        // An episode without a group is a group of its own (no baseline: it waits for one).
        (None, Some(episode)) => (
            GroupKey::Episode {
                key_hash: &key_hash,
                episode,
            },
            0,
        ),
        (None, None) => (GroupKey::Request { id, part }, p.n as u32),
    };
    let group_id = group.to_string();
    let sp = &p.sampling;
    let params = LoggedParams {
        temperature: sp.temperature,
        top_p: sp.top_p,
        top_k: sp.top_k,
        min_p: sp.min_p,
        presence_penalty: sp.presence_penalty,
        frequency_penalty: sp.frequency_penalty,
        repetition_penalty: sp.repetition_penalty,
        logit_bias: sp.logit_bias.len(),
        constrained: sp.constrained,
        seed: p.seed,
        max_tokens: p.max_tokens,
        n: p.n,
    }
    .encode();
    // Greedy answers are not draws from the policy either.
    let policy_sampled = sp.samples_the_policy() && !is_greedy(sp.temperature);
    // A distilling adapter learns from its teacher: its completions (outside episodes, which
    // their clients reward) are recorded rewarded with 0, in the same transaction.
    let distilled = online.trainer.distills(&a.name) && p.episode.is_none();
    let recs: Vec<CompletionRecord> = choices
        .iter()
        .enumerate()
        .map(|(i, c)| CompletionRecord {
            id: id.to_string(),
            choice: (first_choice + i) as u32,
            adapter: a.name.to_string(),
            // The first (oldest) version that computed it: staleness counts from there.
            version: c.versions.first().map_or(a.version, |v| v.version),
            switches: c.versions.get(1..).unwrap_or_default().to_vec(),
            group_id: group_id.clone(),
            group_size,
            prompt: job.prompt_ids.clone(),
            completion: c.tokens.to_vec(),
            logprobs: c.behavior.to_vec(),
            // Kept only where it differs from the model's (edited, truncated or greedy).
            sampling: if c.sampling == c.behavior {
                Vec::new()
            } else {
                c.sampling.to_vec()
            },
            forced: c.forced.to_vec(),
            temperature: sp.temperature,
            policy_sampled,
            params: params.clone(),
            finish_reason: c.finish_reason.into(),
            key: job.key.clone(),
            episode: p.episode.clone(),
            reward: distilled.then_some(0.0),
        })
        .collect();
    let (log, n, name) = (online.store.clone(), recs.len(), a.name.to_string());
    super::state::blocking(move || log.log_completions(&recs).map_err(ApiError::from)).await?;
    if distilled {
        online.trainer.notify();
    }
    online
        .trainer
        .metrics
        .rollouts_logged
        .with_label_values(&[&name])
        .inc_by(n as u64);
    Ok(())
}
