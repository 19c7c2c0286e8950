//! From a validated job to an HTTP response: submit to the engine, then either collect every
//! choice into one JSON body or stream OpenAI chunks as server-sent events. Chat and legacy
//! completions differ only in how a choice and a chunk are shaped (`Flavor`).

use super::admission::{admit, submit};
use super::error::ApiError;
use super::job::{Flavor, Job};
use super::reasoning::{self, ReasoningStream};
use super::request::{engine_request, truncate_prompt};
use super::rollout::{log_choices, Served};
use super::scoring::{legacy_prompt, vllm_prompt_logprobs};
use super::state::AppState;
use super::tools::{self, ToolCall, ToolCallDelta, ToolMode, ToolStream};
use super::wire;
use super::wire::{
    AssistantMessage, ChatChoice, ChatChunkChoice, ChatLogprobs, Completion, Delta,
    PromptTokensDetails, TextChoice, TextLogprobs, TokenLogprob, Usage, VersionSpan,
};
use crate::engine::constraint::GrammarError;
use crate::engine::sampler::{PromptLogprob, TopLogprob};
use crate::engine::{EngineEvent, FinishReason, RequestStream, StopReason};
use crate::model::tokenizer::Tokenizer;
use crate::online::start::Learning;
use crate::util::{random_id, unix_now};
use axum::body::{Body, Bytes};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::{json, Map, Value};
use std::sync::Arc;
pub(super) use stream::sse_response;
use stream::stream_response;

/// A 400 for a constraint the model's vocabulary cannot follow to its end (found while
/// generating): the request asked for what this model cannot write.
pub(super) fn grammar_failed(job: &Job, e: &GrammarError) -> ApiError {
    let field = job.constraint.as_ref().map_or("", |c| c.field.as_str());
    ApiError::invalid(
        field,
        format!(
            "'{field}': the output cannot follow this constraint with this model's vocabulary: {e}"
        ),
    )
}

/// Admit and submit one job: its responder and its stream (which holds the admission).
fn start(state: &AppState, mut job: Job) -> Result<(Responder, RequestStream), ApiError> {
    let ready = state.ready()?;
    truncate_prompt(&mut job, ready.max_model_len);
    let req = engine_request(&job, ready)?;
    let admission = admit(state, &job, 1)?;
    let stream = submit(state, &job, req, &admission)?;
    Ok((responder(ready, job), stream))
}

pub async fn respond(state: &AppState, job: Job) -> Result<Response, ApiError> {
    let (r, stream) = start(state, job)?;
    if r.job.params.stream {
        Ok(stream_response(r, stream))
    } else {
        collect_response(r, stream).await
    }
}

/// Several prompts of one completions request: all submitted first, so the engine batches them,
/// then collected into one response (or one stream of their chunks as they come) whose choice
/// `index` is prompt × n + i (as OpenAI and vLLM number them) under one id; through a learning
/// adapter each prompt's choices are their own group.
pub async fn respond_many(state: &AppState, mut jobs: Vec<Job>) -> Result<Response, ApiError> {
    let ready = state.ready()?;
    for j in &mut jobs {
        truncate_prompt(j, ready.max_model_len);
    }
    let reqs = jobs
        .iter()
        .map(|j| engine_request(j, ready))
        .collect::<Result<Vec<_>, _>>()?;
    let mut running = Vec::with_capacity(jobs.len());
    let mut id = None;
    let admission = match jobs.first() {
        Some(j) => admit(state, j, jobs.len())?,
        None => return Err(ApiError::invalid("prompt", "no prompt")),
    };
    for (p, (job, req)) in jobs.into_iter().zip(reqs).enumerate() {
        let stream = submit(state, &job, req, &admission)?;
        let mut r = responder(ready, job);
        let shared = id.get_or_insert_with(|| r.id.clone());
        r.id = shared.clone();
        r.first_choice = p * r.job.params.n;
        r.part = Some(p);
        running.push((r, stream));
    }
    if running.first().is_some_and(|(r, _)| r.job.params.stream) {
        return Ok(stream::stream_many(running));
    }
    let mut merged: Option<Completion> = None;
    for (r, stream) in running {
        let r = collect(r, stream).await?;
        let body = r.final_body();
        match &mut merged {
            None => merged = Some(body),
            Some(m) => {
                m.choices.extend(body.choices);
                if let (Some(a), Some(b)) = (&mut m.usage, body.usage) {
                    a.prompt_tokens += b.prompt_tokens;
                    a.completion_tokens += b.completion_tokens;
                    a.total_tokens += b.total_tokens;
                    a.prompt_tokens_details.cached_tokens += b.prompt_tokens_details.cached_tokens;
                }
            }
        }
    }
    let mut body = merged.ok_or_else(|| ApiError::invalid("prompt", "no prompt"))?;
    // Each choice carries its own prompt's ids; there is no one prompt.
    body.prompt_token_ids = None;
    Ok((StatusCode::OK, axum::Json(body)).into_response())
}

fn responder(ready: &super::Ready, job: Job) -> Responder {
    Responder {
        id: job.id.clone().unwrap_or_else(|| {
            random_id(match job.flavor {
                Flavor::Chat => "chatcmpl-",
                Flavor::Completion => "cmpl-",
                Flavor::Generate => "gen-",
            })
        }),
        created: unix_now(),
        model: job
            .adapter
            .as_ref()
            .map_or_else(|| ready.model_name.clone(), |a| a.name.to_string()),
        fingerprint: job
            .adapter
            .as_ref()
            .map_or_else(|| format!("{}@0", ready.model_name), |a| a.fingerprint()),
        tok: ready.tokenizer.clone(),
        choices: (0..job.params.n)
            .map(|_| Choice {
                reasoning: job.reasoning.map(ReasoningStream::new),
                ..Choice::default()
            })
            .collect(),
        prompt_scores: None,
        online: job
            .adapter
            .as_ref()
            .filter(|_| !job.unlogged)
            .and_then(|a| ready.learning(&a.name))
            .cloned(),
        first_choice: 0,
        part: None,
        job,
    }
}

#[derive(Default)]
struct Choice {
    text: String,
    token_ids: Vec<u32>,
    logprobs: Vec<TokenLogprob>,
    /// Completions logprobs, column-wise.
    tokens: Vec<String>,
    top: Vec<Map<String, Value>>,
    text_offset: Vec<usize>,
    /// The sampler's log-prob of each token, always kept (the behaviour policy's, for the
    /// rollout log; also the completions `token_logprobs` column).
    behavior: Vec<f32>,
    /// Each token's log-prob under the distribution it was drawn from (`Sampled`).
    sampling: Vec<f32>,
    /// Positions of the tokens a grammar forced (constrained decoding).
    forced: Vec<u32>,
    /// (first token, adapter version) of each run of its tokens one version computed.
    versions: Vec<VersionSpan>,
    finish: Option<(FinishReason, Option<StopReason>)>,
    num_cached_tokens: usize,
    started: bool,
    /// Chat with tools, streamed: the text held while a call may be starting.
    tool_stream: ToolStream,
    /// Chat on a reasoning model, streamed: where the thinking stands.
    reasoning: Option<ReasoningStream>,
}

/// OpenAI's finish reason: "tool_calls" ("function_call" for the legacy API) when a finished
/// answer is calls.
fn finish_with_calls(reason: FinishReason, calls: bool, mode: Option<ToolMode>) -> &'static str {
    match (reason, calls, mode) {
        (FinishReason::Stop, true, Some(m)) => m.finish_reason(),
        (r, _, _) => r.as_str(),
    }
}

struct Responder {
    id: String,
    created: u64,
    model: String,
    fingerprint: String,
    tok: Arc<Tokenizer>,
    job: Job,
    choices: Vec<Choice>,
    /// The prompt's scores, once the engine sent them (requests with prompt log-probs).
    prompt_scores: Option<Vec<PromptLogprob>>,
    /// Set when the adapter is learning: the choices go to the rollout log.
    online: Option<Learning>,
    /// The index of this prompt's first choice in the response (several prompts: prompt × n).
    first_choice: usize,
    /// Which prompt of a several-prompt request this is (its choices are their own group).
    part: Option<usize>,
}

fn stop_reason_json(s: &Option<StopReason>) -> Value {
    match s {
        None => Value::Null,
        Some(StopReason::Text(t)) => json!(t),
        Some(StopReason::Token(t)) => json!(t),
    }
}

impl Responder {
    fn token_text(&self, id: u32) -> String {
        if self.job.params.return_tokens_as_token_ids {
            format!("token_id:{id}")
        } else {
            String::from_utf8_lossy(self.tok.token_bytes(id)).into_owned()
        }
    }

    fn chat_logprob(&self, id: u32, logprob: f32, top: &[TopLogprob]) -> TokenLogprob {
        let bytes = |id: u32| self.tok.token_bytes(id).to_vec();
        TokenLogprob {
            token: self.token_text(id),
            logprob: logprob as f64,
            bytes: bytes(id),
            top_logprobs: top
                .iter()
                .map(|t| wire::TopLogprob {
                    token: self.token_text(t.token_id),
                    logprob: t.logprob as f64,
                    bytes: bytes(t.token_id),
                })
                .collect(),
        }
    }

    fn completion_top(&self, top: &[TopLogprob]) -> Map<String, Value> {
        let mut m = Map::new();
        for t in top {
            m.entry(self.token_text(t.token_id))
                .or_insert(json!(t.logprob));
        }
        m
    }

    /// Fold one event into the choice state; return the new text of the token and its
    /// logprobs entry (chat) for streaming.
    fn apply(&mut self, ev: &EngineEvent) -> Option<usize> {
        match ev {
            EngineEvent::Token {
                choice,
                token_id,
                logprob,
                top_logprobs,
                text,
                forced,
                sampling_logprob,
                version,
                exact,
            } => {
                let lp_chat = (self.job.params.logprobs && self.job.flavor != Flavor::Completion)
                    .then(|| self.chat_logprob(*token_id, *logprob, top_logprobs));
                let lp_cmpl = (self.job.params.logprobs && self.job.flavor == Flavor::Completion)
                    .then(|| {
                        (
                            self.token_text(*token_id),
                            self.completion_top(top_logprobs),
                        )
                    });
                let echo_len = self.job.echo.as_ref().map_or(0, String::len);
                let c = &mut self.choices[*choice];
                if c.versions
                    .last()
                    .is_none_or(|v| (v.version, v.exact) != (*version, *exact))
                {
                    c.versions.push(VersionSpan {
                        from_token: c.token_ids.len() as u32,
                        version: *version,
                        exact: *exact,
                    });
                }
                c.token_ids.push(*token_id);
                if *forced {
                    c.forced.push(c.behavior.len() as u32);
                }
                c.behavior.push(*logprob);
                c.sampling.push(*sampling_logprob);
                if let Some(v) = lp_chat {
                    c.logprobs.push(v);
                }
                if let Some((t, top)) = lp_cmpl {
                    c.text_offset.push(echo_len + c.text.len());
                    c.tokens.push(t);
                    c.top.push(top);
                }
                c.text.push_str(text);
                Some(*choice)
            }
            EngineEvent::Finished {
                choice,
                reason,
                stop_reason,
                num_cached_tokens,
            } => {
                let c = &mut self.choices[*choice];
                c.finish = Some((*reason, stop_reason.clone()));
                c.num_cached_tokens = *num_cached_tokens;
                Some(*choice)
            }
            EngineEvent::PromptLogprobs(v) => {
                self.prompt_scores = Some(v.clone());
                None
            }
            EngineEvent::Error(_) | EngineEvent::GrammarFailed(_) | EngineEvent::Embedding(_) => {
                None
            }
        }
    }

    /// The echoed prompt's legacy logprobs (completions with `echo` and `logprobs`).
    fn echo_logprobs(&self) -> Option<TextLogprobs> {
        let scores = self.prompt_scores.as_ref()?;
        (self.job.echo.is_some() && self.job.params.logprobs)
            .then(|| legacy_prompt(&self.job.prompt_ids, scores, |id| self.token_text(id)))
    }

    /// vLLM's `prompt_logprobs` value, when asked for.
    fn prompt_logprobs_value(&self) -> Option<Value> {
        self.job.params.prompt_logprobs?;
        let scores = self.prompt_scores.as_deref().unwrap_or(&[]);
        Some(vllm_prompt_logprobs(
            &self.tok,
            &self.job.prompt_ids,
            scores,
        ))
    }

    fn usage(&self) -> Usage {
        let completion: usize = self.choices.iter().map(|c| c.token_ids.len()).sum();
        let prompt = self.job.prompt_ids.len();
        let cached = self.choices.first().map_or(0, |c| c.num_cached_tokens);
        Usage {
            prompt_tokens: prompt,
            completion_tokens: completion,
            total_tokens: prompt + completion,
            prompt_tokens_details: PromptTokensDetails {
                cached_tokens: cached,
            },
        }
    }

    /// A choice's version spans, when they are not just the response's `adapter_version`.
    fn versions_of(&self, c: &Choice) -> Option<Vec<VersionSpan>> {
        let pinned = self.job.adapter.as_ref().map_or(0, |a| a.version);
        let one =
            c.versions.len() <= 1 && c.versions.iter().all(|v| v.version == pinned && v.exact);
        (!one).then(|| c.versions.clone())
    }

    fn object(&self, chunk: bool) -> &'static str {
        match (self.job.flavor, chunk) {
            (Flavor::Chat, false) => "chat.completion",
            (Flavor::Chat | Flavor::Generate, true) => "chat.completion.chunk",
            (Flavor::Completion, _) => "text_completion",
            (Flavor::Generate, false) => "generate",
        }
    }

    /// The fields every response and chunk carries: which policy answered (`adapter`,
    /// `adapter_version`, 0 for the base; `system_fingerprint` is "NAME@VERSION").
    fn envelope(&self, chunk: bool, choices: Vec<wire::Choice>) -> Completion {
        let a = self.job.adapter.as_ref();
        Completion {
            id: self.id.clone(),
            object: self.object(chunk),
            created: self.created,
            model: self.model.clone(),
            system_fingerprint: self.fingerprint.clone(),
            adapter: a.map(|a| a.name.to_string()),
            adapter_version: a.map_or(0, |a| a.version),
            choices,
            usage: None,
            prompt_logprobs: None,
            prompt_token_ids: None,
        }
    }

    fn final_body(&self) -> Completion {
        let p = &self.job.params;
        let prompt_logprobs = self.prompt_logprobs_value();
        let token_ids = |c: &Choice| p.return_token_ids.then(|| c.token_ids.clone());
        let choices = self
            .choices
            .iter()
            .enumerate()
            .map(|(i, c)| {
                let (reason, stop) = c.finish.clone().unwrap_or((FinishReason::Length, None));
                match self.job.flavor {
                    Flavor::Generate => unreachable!("generate_body"),
                    Flavor::Chat => {
                        let (thinking, answer) = match self.job.reasoning {
                            Some(at_start) => reasoning::split(&c.text, at_start),
                            None => (None, c.text.clone()),
                        };
                        let (content, calls) = self.split_tool_calls(&answer);
                        let finish = finish_with_calls(reason, calls.is_some(), self.job.tools);
                        let legacy = self.job.tools.is_some_and(|t| t.legacy);
                        let (calls, function_call) = match calls {
                            Some(mut c) if legacy => (None, c.pop().map(|c| c.function)),
                            calls => (calls, None),
                        };
                        wire::Choice::Chat(ChatChoice {
                            index: self.first_choice + i,
                            message: AssistantMessage {
                                role: "assistant",
                                content,
                                reasoning_content: thinking,
                                refusal: None,
                                tool_calls: calls,
                                function_call,
                            },
                            logprobs: p.logprobs.then(|| ChatLogprobs {
                                content: c.logprobs.clone(),
                                refusal: None,
                            }),
                            finish_reason: finish,
                            stop_reason: stop_reason_json(&stop),
                            token_ids: token_ids(c),
                            adapter_versions: self.versions_of(c),
                        })
                    }
                    Flavor::Completion => wire::Choice::Text(TextChoice {
                        index: self.first_choice + i,
                        text: format!("{}{}", self.job.echo.as_deref().unwrap_or(""), c.text),
                        logprobs: self.completion_logprobs(c),
                        finish_reason: Some(reason.as_str()),
                        stop_reason: Some(stop_reason_json(&stop)),
                        token_ids: token_ids(c),
                        prompt_logprobs: prompt_logprobs.clone(),
                        prompt_token_ids: p.return_token_ids.then(|| self.job.prompt_ids.clone()),
                        adapter_versions: self.versions_of(c),
                    }),
                }
            })
            .collect();
        let mut body = self.envelope(false, choices);
        if self.job.flavor == Flavor::Chat {
            body.prompt_logprobs = prompt_logprobs;
        }
        body.usage = Some(self.usage());
        if p.return_token_ids {
            body.prompt_token_ids = Some(self.job.prompt_ids.clone());
        }
        body
    }

    /// A chat answer's content and tool calls (when the request has tools and the text holds
    /// well-formed calls in the model's format).
    fn split_tool_calls(&self, text: &str) -> (Option<String>, Option<Vec<ToolCall>>) {
        let Some(mode) = self.job.tools else {
            return (Some(text.to_string()), None);
        };
        match tools::parse(mode.format, text, || random_id("call_")) {
            Some((content, mut calls)) => {
                mode.keep(&mut calls);
                let calls = (!calls.is_empty()).then_some(calls);
                (
                    (!content.is_empty() || calls.is_none()).then_some(content),
                    calls,
                )
            }
            None => (Some(text.to_string()), None),
        }
    }

    /// vLLM's `/inference/v1/generate` response: token ids and per-token log-probs, no text.
    fn generate_body(&self) -> Value {
        let p = &self.job.params;
        let a = self.job.adapter.as_ref();
        let choices: Vec<Value> = self
            .choices
            .iter()
            .enumerate()
            .map(|(i, c)| {
                let (reason, stop) = c.finish.clone().unwrap_or((FinishReason::Length, None));
                let mut v = json!({
                    "index": i,
                    "token_ids": c.token_ids,
                    "logprobs": p.logprobs.then(|| json!({"content": c.logprobs})),
                    "finish_reason": reason.as_str(),
                    "stop_reason": stop_reason_json(&stop),
                });
                if let Some(spans) = self.versions_of(c) {
                    v["adapter_versions"] = json!(spans);
                }
                v
            })
            .collect();
        let mut body = json!({
            "request_id": self.id,
            "id": self.id,
            "object": "generate",
            "created": self.created,
            "model": self.model,
            "adapter": a.map(|a| a.name.to_string()),
            "adapter_version": a.map_or(0, |a| a.version),
            "system_fingerprint": self.fingerprint,
            "choices": choices,
            "usage": self.usage(),
            "prompt_logprobs": self.prompt_logprobs_value(),
        });
        if p.return_token_ids {
            body["prompt_token_ids"] = json!(self.job.prompt_ids);
        }
        body
    }

    fn completion_logprobs(&self, c: &Choice) -> Option<TextLogprobs> {
        if !self.job.params.logprobs {
            return None;
        }
        let mut lp = self.echo_logprobs().unwrap_or_default();
        lp.tokens.extend(c.tokens.iter().cloned());
        lp.token_logprobs
            .extend(c.behavior.iter().map(|v| Some(*v as f64)));
        lp.top_logprobs.extend(c.top.iter().cloned().map(Some));
        lp.text_offset.extend(&c.text_offset);
        Some(lp)
    }

    fn is_done(&self) -> bool {
        self.choices.iter().all(|c| c.finish.is_some())
    }

    /// Write the finished choices to the rollout log when the adapter is learning: before the
    /// response (non-streaming), or before the chunk that finishes the last choice (streaming),
    /// so that a reward always finds them.
    async fn log_rollouts(&self) -> Result<(), ApiError> {
        let Some(online) = &self.online else {
            return Ok(());
        };
        let served: Vec<Served> = self
            .choices
            .iter()
            .map(|c| Served {
                tokens: &c.token_ids,
                behavior: &c.behavior,
                sampling: &c.sampling,
                forced: &c.forced,
                versions: &c.versions,
                finish_reason: c.finish.as_ref().map_or("length", |f| f.0.as_str()),
            })
            .collect();
        log_choices(
            online,
            &self.job,
            &self.id,
            &served,
            self.first_choice,
            self.part,
        )
        .await
    }
}

/// Every event of the request folded in, and the choices logged (learning adapters).
async fn collect(mut r: Responder, mut stream: RequestStream) -> Result<Responder, ApiError> {
    while !r.is_done() {
        match stream.rx.recv().await {
            Some(EngineEvent::Error(e)) => return Err(ApiError::internal(e)),
            Some(EngineEvent::GrammarFailed(e)) => return Err(grammar_failed(&r.job, &e)),
            Some(ev) => {
                r.apply(&ev);
            }
            None => return Err(ApiError::internal("the engine stopped")),
        }
    }
    r.log_rollouts().await?;
    Ok(r)
}

async fn collect_response(r: Responder, stream: RequestStream) -> Result<Response, ApiError> {
    let r = collect(r, stream).await?;
    if r.job.flavor == Flavor::Generate {
        return Ok((StatusCode::OK, axum::Json(r.generate_body())).into_response());
    }
    Ok((StatusCode::OK, axum::Json(r.final_body())).into_response())
}

mod sample;
mod stream;
pub use sample::{sample, Sampled, SampledChoice};
