//! The engine's way in and out: a validated request (`GenerateRequest`), the events a request's
//! stream carries, and `EngineHandle`, the cloneable way to submit (admission counted by
//! `Permit`s). The engine thread itself is in `mod.rs`.

use super::constraint::Constraint;
use super::sampler::{PromptLogprob, SamplingParams, TopLogprob};
use crate::adapter::registry::AdapterVersion;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc};
use std::time::Instant;
use tokio::sync::mpsc as tmpsc;

/// A validated generation request: the API layer's output, the engine's input.
#[derive(Clone, Debug)]
pub struct GenerateRequest {
    pub prompt: Vec<u32>,
    /// Choices, sharing one prefill.
    pub n: usize,
    /// Generated tokens per choice, at most (already capped by the context length).
    pub max_tokens: usize,
    pub sampling: SamplingParams,
    /// Choice `i` draws from `Rng::new(seed ^ i * golden)`: the same seed and request give the
    /// same tokens whatever else runs. None: a random seed.
    pub seed: Option<u64>,
    pub stop: Vec<String>,
    pub stop_token_ids: Vec<u32>,
    pub ignore_eos: bool,
    /// The adapter version pinned for this request (None: the base model).
    pub adapter: Option<Arc<AdapterVersion>>,
    /// Score the prompt: every prompt token after the first with its log-prob, rank and this many
    /// alternatives (one `PromptLogprobs` event before the first token). `max_tokens` may then
    /// be 0 (the prompt scored, nothing generated).
    pub prompt_logprobs: Option<usize>,
    /// Constrained decoding: each choice follows its own copy of this grammar (fresh).
    pub constraint: Option<Constraint>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    /// EOS, a stop token or a stop string.
    Stop,
    /// `max_tokens` or the context length.
    Length,
}

impl FinishReason {
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
        }
    }
}

#[derive(Clone, Debug)]
pub enum EngineEvent {
    /// One generated token of choice `choice`; `text` is the new text it completes (empty when it
    /// is a control token, an incomplete UTF-8 character, or held back as a possible stop string).
    Token {
        choice: usize,
        token_id: u32,
        /// The grammar allowed only this token (constrained decoding).
        forced: bool,
        logprob: f32,
        top_logprobs: Vec<TopLogprob>,
        text: String,
    },
    Finished {
        choice: usize,
        reason: FinishReason,
        /// The stop string or stop token that ended the choice, if any.
        stop_reason: Option<StopReason>,
        /// Prompt tokens found in the prefix cache.
        num_cached_tokens: usize,
    },
    /// The prompt's scores (requests with `prompt_logprobs`): one entry per prompt token after
    /// the first, sent once, before any token.
    PromptLogprobs(Vec<PromptLogprob>),
    /// The request failed inside the engine; no more events follow.
    Error(String),
    /// A choice's grammar cannot go on (the vocabulary cannot spell what it requires, or the
    /// grammar library failed): the request ends; no more events follow.
    GrammarFailed(String),
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StopReason {
    Text(String),
    Token(u32),
}

#[derive(Debug, thiserror::Error)]
pub enum SubmitError {
    #[error("the server is at capacity ({0} requests in progress); retry later")]
    QueueFull(usize),
    #[error("the engine is not running")]
    NotRunning,
}

pub(super) enum Command {
    Submit(Box<Submission>),
}

pub(super) struct Submission {
    pub req: GenerateRequest,
    pub tx: tmpsc::UnboundedSender<EngineEvent>,
    pub arrival: Instant,
}

/// Held by a request's event stream; frees its admission slot when dropped.
pub struct Permit(Arc<AtomicUsize>);

impl Drop for Permit {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// A request's events. Dropping it cancels the request: the engine frees its blocks next step.
pub struct RequestStream {
    pub rx: tmpsc::UnboundedReceiver<EngineEvent>,
    _permit: Permit,
}

#[derive(Clone)]
pub struct EngineHandle {
    pub(super) tx: mpsc::Sender<Command>,
    pub(super) num_pending: Arc<AtomicUsize>,
    pub(super) max_pending: usize,
    pub(super) alive: Arc<AtomicBool>,
}

impl EngineHandle {
    pub fn submit(&self, req: GenerateRequest) -> Result<RequestStream, SubmitError> {
        if !self.is_alive() {
            return Err(SubmitError::NotRunning);
        }
        let prev = self.num_pending.fetch_add(1, Ordering::AcqRel);
        let permit = Permit(self.num_pending.clone());
        if prev >= self.max_pending {
            return Err(SubmitError::QueueFull(prev));
        }
        let (tx, rx) = tmpsc::unbounded_channel();
        let sub = Submission {
            req,
            tx,
            arrival: Instant::now(),
        };
        self.tx
            .send(Command::Submit(Box::new(sub)))
            .map_err(|_| SubmitError::NotRunning)?;
        Ok(RequestStream {
            rx,
            _permit: permit,
        })
    }

    pub fn is_alive(&self) -> bool {
        self.alive.load(Ordering::Acquire)
    }
}

/// Clears the alive flag when the engine thread ends, however it ends.
pub(super) struct AliveGuard(pub Arc<AtomicBool>);

impl Drop for AliveGuard {
    fn drop(&mut self) {
        self.0.store(false, Ordering::Release);
    }
}
