//! The engine's way in and out: a validated request (`GenerateRequest`), the events a request's
//! stream carries, and `EngineHandle`, the cloneable way to submit (admission counted by
//! `Permit`s). The engine thread itself is in `mod.rs`.

use super::constraint::Constraint;
use super::sampler::{PromptLogprob, SamplingParams, TopLogprob};
use crate::adapter::registry::{AdapterVersion, Slot};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, Mutex};
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
    /// vLLM's `include_stop_str_in_output`: the stop string that ended a choice ends its text.
    pub include_stop_str_in_output: bool,
    /// The adapter version pinned for this request (None: the base model).
    pub adapter: Option<Arc<AdapterVersion>>,
    /// Score the prompt: every prompt token after the first with its log-prob, rank and this many
    /// alternatives (one `PromptLogprobs` event before the first token). `max_tokens` may then
    /// be 0 (the prompt scored, nothing generated).
    pub prompt_logprobs: Option<usize>,
    /// Constrained decoding: each choice follows its own copy of this grammar (fresh).
    pub constraint: Option<Constraint>,
    /// Embed the prompt instead (`max_tokens` 0, `n` 1): one `Embedding` event, the mean of its
    /// tokens' final hidden states, L2-normalised.
    pub embed: bool,
    /// End a choice stuck in a loop (`FinishReason::Repetition`); None: never.
    pub repetition: Option<super::repetition::RepetitionRule>,
    /// Move to the adapter's newly published versions while generating (a learning adapter's
    /// `version_policy = "latest"`: partial rollouts); None: the pinned version to the end.
    pub follow: Option<Follow>,
}

/// A request that follows its adapter's slot: at each step boundary, a sequence whose slot serves
/// another version than the one it last saw moves to it (its K/V recomputed under it).
#[derive(Clone)]
pub struct Follow {
    pub slot: Arc<Slot>,
    /// The uid of the version the slot served when the request was made (a canary's candidate
    /// moves only when the slot's own version changes, not at once to the incumbent).
    pub seen: u64,
    /// Keep the K/V computed so far at a switch (cheap; the tokens after it are then computed
    /// by no single version) instead of recomputing them under the new version.
    pub keep_kv: bool,
}

impl Follow {
    /// Follow `slot` from `pinned`, the version the request was admitted with: a canary's
    /// candidate stays until the slot's own version changes; any other version not the slot's
    /// (a publish came between admission and now) moves at the first step.
    pub fn new(slot: Arc<Slot>, pinned: &AdapterVersion, keep_kv: bool) -> Follow {
        let seen = match slot.canary() {
            Some((v, _)) if v == pinned.version => slot.current_uid(),
            _ => pinned.uid,
        };
        Follow {
            slot,
            seen,
            keep_kv,
        }
    }
}

impl std::fmt::Debug for Follow {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Follow({}, seen {}, keep {})",
            self.slot.name, self.seen, self.keep_kv
        )
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    /// EOS, a stop token or a stop string.
    Stop,
    /// `max_tokens` or the context length.
    Length,
    /// Stuck in a loop (`repetition`).
    Repetition,
}

impl FinishReason {
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::Repetition => "repetition",
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
        /// The token's log-prob under the distribution it was drawn from (`Sampled`).
        sampling_logprob: f32,
        top_logprobs: Vec<TopLogprob>,
        text: String,
        /// The adapter version whose forward computed it (0: the base); it changes within a
        /// choice only for requests that follow their adapter (`GenerateRequest::follow`).
        version: u64,
        /// The K/V it attended to are all `version`'s (false after a switch that kept older
        /// versions' K/V).
        exact: bool,
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
    /// The prompt's embedding (requests with `embed`), before `Finished`.
    Embedding(Vec<f32>),
    /// The request failed inside the engine; no more events follow.
    Error(String),
    /// A choice's grammar cannot go on (the vocabulary cannot spell what it requires, or the
    /// grammar library failed): the request ends; no more events follow.
    GrammarFailed(super::constraint::GrammarError),
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
    #[error(
        "this client has {0} requests in progress, the most one client may have (the rest of \
         the server's capacity is kept for other clients); retry later"
    )]
    ClientFull(usize),
    #[error("the engine is not running")]
    NotRunning,
}

/// Who a request is for admission and scheduling: the same for every request of one bearer key;
/// each request its own where it sends none. Fairness is between clients first, then between
/// the requests of one client.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct ClientId(pub u64);

impl ClientId {
    /// The client of a bearer key; a new one per request for "" (no key).
    pub fn of_key(key: &str) -> ClientId {
        if key.is_empty() {
            return ClientId(crate::util::random_u64());
        }
        // FNV-1a: an identity for scheduling within this process, not a secret.
        let mut h = 0xcbf2_9ce4_8422_2325u64;
        for b in key.bytes() {
            h = (h ^ b as u64).wrapping_mul(0x0100_0000_01b3);
        }
        ClientId(h)
    }
}

pub(super) enum Command {
    Submit(Box<Submission>),
    Score(Box<super::scoring::ScoreJob>),
}

pub(super) struct Submission {
    pub req: GenerateRequest,
    pub client: ClientId,
    pub request: u64,
    pub tx: tmpsc::UnboundedSender<EngineEvent>,
    pub arrival: Instant,
}

/// Requests in progress, in all and per client.
#[derive(Default)]
pub(super) struct Pending {
    total: usize,
    by_client: HashMap<ClientId, usize>,
}

/// One admitted request (all its prompts and choices): held by each of its event streams; frees
/// its admission slot when the last is dropped.
pub struct Admission {
    pending: Arc<Mutex<Pending>>,
    pub client: ClientId,
    /// This request's own id (its prompts share it), for fairness within a client.
    pub request: u64,
}

impl Drop for Admission {
    fn drop(&mut self) {
        let mut p = self.pending.lock().unwrap_or_else(|e| e.into_inner());
        p.total -= 1;
        if let Some(n) = p.by_client.get_mut(&self.client) {
            *n -= 1;
            if *n == 0 {
                p.by_client.remove(&self.client);
            }
        }
    }
}

/// A request's events. Dropping it cancels the request: the engine frees its blocks next step.
pub struct RequestStream {
    pub rx: tmpsc::UnboundedReceiver<EngineEvent>,
    _admission: Arc<Admission>,
}

#[derive(Clone)]
pub struct EngineHandle {
    pub(super) tx: mpsc::Sender<Command>,
    pub(super) pending: Arc<Mutex<Pending>>,
    pub(super) max_pending: usize,
    /// The most requests one client may have in progress.
    pub(super) max_pending_per_client: usize,
    pub(super) alive: Arc<AtomicBool>,
}

impl EngineHandle {
    /// Admit one request of `client`: refused when the server holds `max_pending_requests`, or
    /// this client `max_pending_per_client` (the rest stays open to other clients).
    pub fn admit(&self, client: ClientId) -> Result<Arc<Admission>, SubmitError> {
        if !self.is_alive() {
            return Err(SubmitError::NotRunning);
        }
        let mut p = self.pending.lock().unwrap_or_else(|e| e.into_inner());
        if p.total >= self.max_pending {
            return Err(SubmitError::QueueFull(p.total));
        }
        let mine = p.by_client.get(&client).copied().unwrap_or(0);
        if mine >= self.max_pending_per_client {
            return Err(SubmitError::ClientFull(mine));
        }
        p.total += 1;
        *p.by_client.entry(client).or_default() += 1;
        Ok(Arc::new(Admission {
            pending: self.pending.clone(),
            client,
            request: crate::util::random_u64(),
        }))
    }

    /// Submit one prompt of an admitted request.
    pub fn submit_admitted(
        &self,
        req: GenerateRequest,
        admission: &Arc<Admission>,
    ) -> Result<RequestStream, SubmitError> {
        let (tx, rx) = tmpsc::unbounded_channel();
        let sub = Submission {
            req,
            client: admission.client,
            request: admission.request,
            tx,
            arrival: Instant::now(),
        };
        self.tx
            .send(Command::Submit(Box::new(sub)))
            .map_err(|_| SubmitError::NotRunning)?;
        Ok(RequestStream {
            rx,
            _admission: admission.clone(),
        })
    }

    /// Admit and submit a request of one prompt as a client of its own.
    pub fn submit(&self, req: GenerateRequest) -> Result<RequestStream, SubmitError> {
        let a = self.admit(ClientId::of_key(""))?;
        self.submit_admitted(req, &a)
    }

    /// The log-probs (of logits / `temperature`) of every completion token of `seqs` through
    /// `adapter`, computed by the engine between its serving steps on the device it serves on
    /// (`engine::scoring`): a trainer's forward from the kernels that served the completions.
    /// Blocks until they are ready; an error says why not (a sequence longer than a step holds,
    /// the engine stopped).
    pub fn logprobs(
        &self,
        seqs: &[crate::model::decoder::TrainSeq],
        adapter: Option<Arc<crate::adapter::AdapterWeights>>,
        temperature: f32,
    ) -> Result<Vec<Vec<f32>>, String> {
        let (tx, rx) = mpsc::sync_channel(1);
        let job = super::scoring::ScoreJob {
            seqs: seqs
                .iter()
                .map(|s| super::scoring::ScoreSeq {
                    tokens: s.tokens.to_vec(),
                    prompt_len: s.prompt_len,
                    prefix: s.prefix,
                })
                .collect(),
            adapter,
            temperature,
            tx,
        };
        let stopped = || "the engine has stopped".to_string();
        self.tx
            .send(Command::Score(Box::new(job)))
            .map_err(|_| stopped())?;
        rx.recv().map_err(|_| stopped())?
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
