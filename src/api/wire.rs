//! The OpenAI response shapes, as types: a completion or a chunk (`Completion`), the choices of
//! chat and legacy completions, their log-probs and the usage. Serialized with serde, so a shape
//! is found by its name and checked by the compiler. Extensions (vLLM's and ours) are fields that
//! appear only when asked for: `token_ids`, `prompt_token_ids`, `prompt_logprobs`, `stop_reason`,
//! and which adapter version answered (`adapter`, `adapter_version`). Log-probs are computed in
//! f32 and written as the f64 of that value (exact: a client reading f64 gets the f32 back).

use serde::Serialize;
use serde_json::{Map, Value};

/// A response (`chat.completion`, `text_completion`) or a stream chunk
/// (`chat.completion.chunk`, `text_completion`).
#[derive(Clone, Debug, Serialize)]
pub struct Completion {
    pub id: String,
    pub object: &'static str,
    pub created: u64,
    pub model: String,
    /// "NAME@VERSION" of the policy that answered ("MODEL@0" for the base).
    pub system_fingerprint: String,
    /// The adapter that answered (null: the base model).
    pub adapter: Option<String>,
    /// Its version (0: the base model).
    pub adapter_version: u64,
    pub choices: Vec<Choice>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
    /// vLLM's prompt scores (chat; legacy completions carry them per choice).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prompt_logprobs: Option<Value>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prompt_token_ids: Option<Vec<u32>>,
}

/// One choice of a response or chunk, in the shape of its endpoint.
#[derive(Clone, Debug, Serialize)]
#[serde(untagged)]
pub enum Choice {
    Chat(ChatChoice),
    ChatChunk(ChatChunkChoice),
    Text(TextChoice),
}

/// A chat completion's choice.
#[derive(Clone, Debug, Serialize)]
pub struct ChatChoice {
    pub index: usize,
    pub message: AssistantMessage,
    pub logprobs: Option<ChatLogprobs>,
    pub finish_reason: &'static str,
    /// vLLM's: the stop string or token id that ended it (null otherwise).
    pub stop_reason: Value,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub token_ids: Option<Vec<u32>>,
    /// Flywheel's: the adapter versions that computed its tokens, when a generation moved to a
    /// newer version while it ran (`version_policy = "latest"`); absent when one version
    /// (`adapter_version`) computed them all.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub adapter_versions: Option<Vec<VersionSpan>>,
}

pub use crate::online::store::records::VersionSpan;

#[derive(Clone, Debug, Serialize)]
pub struct AssistantMessage {
    pub role: &'static str,
    /// Null when the answer is tool calls only.
    pub content: Option<String>,
    /// A reasoning model's thinking (vLLM's field), apart from the answer.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<String>,
    pub refusal: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<super::tools::ToolCall>>,
    /// The legacy `functions` API's one call.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub function_call: Option<super::tools::FunctionCall>,
}

/// A chat chunk's choice: a delta, and on the last one the finish reason.
#[derive(Clone, Debug, Serialize)]
pub struct ChatChunkChoice {
    pub index: usize,
    pub delta: Delta,
    pub logprobs: Option<ChatLogprobs>,
    pub finish_reason: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stop_reason: Option<Value>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub token_ids: Option<Vec<u32>>,
    /// As `ChatChoice`'s, on the chunk that finishes the choice.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub adapter_versions: Option<Vec<VersionSpan>>,
}

/// What a chat chunk adds to the message (the first one carries the role).
#[derive(Clone, Debug, Default, Serialize)]
pub struct Delta {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub role: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub content: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<super::tools::ToolCallDelta>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub function_call: Option<super::tools::FunctionCall>,
}

/// Chat log-probs: one entry per token.
#[derive(Clone, Debug, Serialize)]
pub struct ChatLogprobs {
    pub content: Vec<TokenLogprob>,
    pub refusal: Option<String>,
}

/// A token's log-prob (chat), with its most likely alternatives.
#[derive(Clone, Debug, Serialize)]
pub struct TokenLogprob {
    pub token: String,
    pub logprob: f64,
    pub bytes: Vec<u8>,
    pub top_logprobs: Vec<TopLogprob>,
}

/// An alternative token (chat).
#[derive(Clone, Debug, Serialize)]
pub struct TopLogprob {
    pub token: String,
    pub logprob: f64,
    pub bytes: Vec<u8>,
}

/// A legacy completion's choice (also its chunks: `text` is then the new text).
#[derive(Clone, Debug, Serialize)]
pub struct TextChoice {
    pub index: usize,
    pub text: String,
    pub logprobs: Option<TextLogprobs>,
    pub finish_reason: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stop_reason: Option<Value>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub token_ids: Option<Vec<u32>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prompt_logprobs: Option<Value>,
    /// The choice's prompt as token ids (`return_token_ids`; vLLM's, one per prompt of a batch).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prompt_token_ids: Option<Vec<u32>>,
    /// Flywheel's: the adapter versions that computed its tokens, when a generation moved to a
    /// newer version while it ran (`version_policy = "latest"`); absent when one version
    /// (`adapter_version`) computed them all.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub adapter_versions: Option<Vec<VersionSpan>>,
}

/// Legacy completions log-probs, column by column (an echoed prompt's first token has null).
#[derive(Clone, Debug, Default, Serialize)]
pub struct TextLogprobs {
    pub tokens: Vec<String>,
    pub token_logprobs: Vec<Option<f64>>,
    /// Token text → log-prob of the most likely alternatives.
    pub top_logprobs: Vec<Option<Map<String, Value>>>,
    pub text_offset: Vec<usize>,
}

#[derive(Clone, Debug, Serialize)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub total_tokens: usize,
    pub prompt_tokens_details: PromptTokensDetails,
}

#[derive(Clone, Debug, Serialize)]
pub struct PromptTokensDetails {
    /// Prompt tokens whose K/V came from the prefix cache.
    pub cached_tokens: usize,
}
