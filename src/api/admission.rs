//! Admission of a request to the engine: its size bounded (`max_sequences_per_request`), one
//! admission for its client (429 while the server or the client is full), then each prompt
//! submitted under it.

use super::error::ApiError;
use super::job::Job;
use super::state::AppState;
use crate::engine::{Admission, ClientId, GenerateRequest, RequestStream, SubmitError};
use std::sync::Arc;

/// Admit one request of `num_prompts` prompts (each with `job.params.n` choices) for its
/// caller's client: a 400 naming `n` past `max_sequences_per_request` (retrying cannot help), a
/// 429 while the server or this client is at its limit.
pub(super) fn admit(
    state: &AppState,
    job: &Job,
    num_prompts: usize,
) -> Result<Arc<Admission>, ApiError> {
    let ready = state.ready()?;
    let seqs = num_prompts * job.params.n;
    let max = state.limits.max_sequences_per_request;
    if seqs > max {
        return Err(ApiError::invalid(
            "n",
            format!(
                "{num_prompts} prompt(s) × n {} = {seqs} sequences; at most {max} per request \
                 (server.max_sequences_per_request): split it",
                job.params.n
            ),
        ));
    }
    ready
        .engine
        .admit(ClientId::of_key(&job.key))
        .map_err(|e| submit_error(state, e))
}

fn submit_error(state: &AppState, e: SubmitError) -> ApiError {
    match e {
        SubmitError::QueueFull(_) | SubmitError::ClientFull(_) => {
            ApiError::overloaded(e.to_string(), state.retry_after_secs)
        }
        SubmitError::NotRunning => ApiError::unavailable(e.to_string()),
    }
}

pub(super) fn submit(
    state: &AppState,
    job: &Job,
    req: GenerateRequest,
    admission: &Arc<Admission>,
) -> Result<RequestStream, ApiError> {
    let ready = state.ready()?;
    let label = job.adapter.as_ref().map_or("", |a| &a.name);
    state
        .metrics
        .adapter_requests
        .with_label_values(&[label])
        .inc();
    ready
        .engine
        .submit_admitted(req, admission)
        .map_err(|e| submit_error(state, e))
}
