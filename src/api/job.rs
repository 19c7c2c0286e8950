//! A validated generation request, as the chat and completions routes hand it to `respond`.

use super::openai::CommonParams;
use crate::adapter::registry::Pinned;

/// Which OpenAI shape the response takes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Flavor {
    Chat,
    Completion,
    /// vLLM's token-in, token-out `/inference/v1/generate` (never streamed).
    Generate,
}

/// One request: its parameters, prompt tokens, pinned adapter version and caller.
pub struct Job {
    pub flavor: Flavor,
    pub params: CommonParams,
    pub prompt_ids: Vec<u32>,
    /// Completions with `echo`: the prompt text, put before each choice's text.
    pub echo: Option<String>,
    /// The field the prompt came from, for length errors.
    pub prompt_param: &'static str,
    /// The adapter version pinned for this request (None: the base model); held until the
    /// response ends.
    pub adapter: Option<Pinned>,
    /// The caller's bearer key ("" without one): who may reward the completion (an agent
    /// session's turn: the session's principal, `online::sessions::principal`).
    pub key: String,
    /// The key hash a client `group` is scoped to when not `key`'s (an agent session's owner).
    pub group_owner: Option<String>,
    /// Chat with tools: how the answer's calls are parsed and returned.
    pub tools: Option<super::tools::ToolMode>,
    /// Constrained decoding (structured outputs, forced or generic tool calls): the compiled
    /// grammar each choice starts from.
    pub constraint: Option<OutputConstraint>,
    /// Chat on a reasoning model's template: whether the completion starts inside the thinking
    /// (the prompt opened it); its thinking is returned as `reasoning_content`. None: no
    /// reasoning parser.
    pub reasoning: Option<bool>,
    /// The response's id when the route chooses it (None: a fresh one of the flavor's kind).
    pub id: Option<String>,
    /// Not logged for training even through a learning adapter (an evaluation's request).
    pub unlogged: bool,
}

/// A compiled output constraint and the request field it came from (named if it fails).
#[derive(Clone)]
pub struct OutputConstraint {
    pub field: String,
    pub grammar: crate::engine::constraint::Constraint,
}
