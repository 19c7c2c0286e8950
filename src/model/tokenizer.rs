//! The tokenizer and chat template, both built from GGUF metadata: SentencePiece vocabularies
//! (`model::spm`) or a `tokenizers::Tokenizer` for
//! byte-level BPE (vocab, merges, pre-tokenizer by `tokenizer.ggml.pre`, control tokens as special),
//! a byte table for exact incremental detokenization, and `tokenizer.chat_template` via minijinja.

use super::conversation::ToolDef;
use super::gguf::{Gguf, GgufError, Value};
use super::spm::{Spm, TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED};
use serde::Serialize;
use std::collections::HashMap;
use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::BPE;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::AddedToken;

#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    #[error(transparent)]
    Gguf(#[from] GgufError),
    #[error("unsupported tokenizer: {0}")]
    Unsupported(String),
    #[error("tokenizer: {0}")]
    Build(String),
    #[error("chat template: {0}")]
    Template(String),
}

/// Qwen2's (and Qwen3's) pre-tokenizer: single digits, letters with one leading non-letter.
const QWEN2_PATTERN: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// Llama 3's (`llama-bpe`): as Qwen2's, but digits in runs of up to three.
const LLAMA3_PATTERN: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// Split on `pattern` (each match its own piece), then byte-level characters (no added space,
/// no second regex): Hugging Face's pre-tokenizer for these models.
fn split_then_bytes(pattern: &str) -> Result<PreTokenizerWrapper, TokenizerError> {
    let split = Split::new(
        SplitPattern::Regex(pattern.to_string()),
        tokenizers::SplitDelimiterBehavior::Isolated,
        false,
    )
    .map_err(|e| TokenizerError::Build(e.to_string()))?;
    Ok(Sequence::new(vec![
        split.into(),
        ByteLevel::new(false, false, false).into(),
    ])
    .into())
}

/// The vocabulary's kind: byte-level BPE (`gpt2`) or SentencePiece (`llama`).
enum Model {
    Bpe(Box<tokenizers::Tokenizer>),
    Spm(Box<Spm>),
}

/// Byte-level BPE from the GGUF's vocab and merges, its pre-tokenizer named by
/// `tokenizer.ggml.pre`, control tokens as special and user-defined ones as added.
fn bpe(
    g: &Gguf,
    tokens: &[String],
    types: &[i64],
) -> Result<tokenizers::Tokenizer, TokenizerError> {
    let pre = g
        .get("tokenizer.ggml.pre")
        .and_then(Value::as_str)
        .unwrap_or("default");
    let pre_tok: PreTokenizerWrapper = match pre {
        "default" | "gpt2" => ByteLevel::new(false, true, true).into(),
        "smollm" => Sequence::new(vec![
            Digits::new(true).into(),
            ByteLevel::new(false, true, true).into(),
        ])
        .into(),
        // The regexes of the models' own tokenizer.json (llama.cpp rewrites them by hand for its
        // engine; onig reads them as written), then bytes to characters.
        "qwen2" => split_then_bytes(QWEN2_PATTERN)?,
        "llama-bpe" => split_then_bytes(LLAMA3_PATTERN)?,
        other => {
            return Err(TokenizerError::Unsupported(format!(
                "tokenizer.ggml.pre = '{other}'"
            )))
        }
    };
    let merges = string_array(g, "tokenizer.ggml.merges")?;
    let vocab: HashMap<String, u32> = tokens
        .iter()
        .enumerate()
        .map(|(i, t)| (t.clone(), i as u32))
        .collect();
    let merges: Vec<(String, String)> = merges
        .iter()
        .enumerate()
        .map(|(i, m)| {
            m.split_once(' ')
                .map(|(a, b)| (a.to_string(), b.to_string()))
                .ok_or_else(|| TokenizerError::Build(format!("merge {i} '{m}' has no space")))
        })
        .collect::<Result<_, _>>()?;
    let model = BPE::builder()
        .vocab_and_merges(
            vocab
                .into_iter()
                .collect::<tokenizers::models::bpe::Vocab>(),
            merges,
        )
        .build()
        .map_err(|e| TokenizerError::Build(e.to_string()))?;
    let mut inner = tokenizers::Tokenizer::new(model);
    inner.with_pre_tokenizer(Some(pre_tok));
    inner.with_decoder(Some(ByteLevelDecoder::default()));
    let mut special = Vec::new();
    let mut added = Vec::new();
    for (t, &ty) in tokens.iter().zip(types) {
        match ty {
            TOKEN_TYPE_CONTROL => special.push(AddedToken::from(t.clone(), true)),
            TOKEN_TYPE_USER_DEFINED => added.push(AddedToken::from(t.clone(), false)),
            _ => {}
        }
    }
    inner.add_special_tokens(&special);
    inner.add_tokens(&added);
    Ok(inner)
}

pub struct Tokenizer {
    inner: Model,
    /// The bytes each token stands for (control tokens: their text).
    token_bytes: Vec<Vec<u8>>,
    is_control: Vec<bool>,
    pub bos_id: Option<u32>,
    pub eos_id: Option<u32>,
    pub add_bos: bool,
    chat_template: Option<String>,
    bos_text: String,
    eos_text: String,
}

/// One chat message.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
}

/// GPT-2's byte <-> printable-char mapping used by byte-level BPE vocabularies.
fn bytes_to_unicode() -> [char; 256] {
    let mut table = ['\0'; 256];
    let mut n = 0u32;
    for b in 0..256u32 {
        let printable =
            (33..=126).contains(&b) || (161..=172).contains(&b) || (174..=255).contains(&b);
        table[b as usize] = if printable {
            char::from_u32(b).unwrap_or('\0')
        } else {
            n += 1;
            char::from_u32(255 + n).unwrap_or('\0')
        };
    }
    table
}

impl Tokenizer {
    pub fn from_gguf(g: &Gguf) -> Result<Tokenizer, TokenizerError> {
        let model = g.get_str("tokenizer.ggml.model")?;
        let tokens = string_array(g, "tokenizer.ggml.tokens")?;
        let types: Vec<i64> = match g.get("tokenizer.ggml.token_type").and_then(Value::as_array) {
            Some(a) => a.iter().map(|v| v.as_i64().unwrap_or(1)).collect(),
            None => vec![1; tokens.len()],
        };
        if types.len() != tokens.len() {
            return Err(TokenizerError::Build(format!(
                "{} token types for {} tokens",
                types.len(),
                tokens.len()
            )));
        }
        let id = |k: &str| {
            g.get(k)
                .and_then(Value::as_i64)
                .map(|v| v as u32)
                .filter(|&v| (v as usize) < tokens.len())
        };
        let (inner, token_bytes) = match model {
            "gpt2" => {
                let rev: HashMap<char, u8> = bytes_to_unicode()
                    .iter()
                    .enumerate()
                    .map(|(b, c)| (*c, b as u8))
                    .collect();
                let bytes = tokens
                    .iter()
                    .zip(&types)
                    .map(|(t, &ty)| {
                        if ty == TOKEN_TYPE_CONTROL || ty == TOKEN_TYPE_USER_DEFINED {
                            t.as_bytes().to_vec()
                        } else {
                            t.chars()
                                .map(|c| rev.get(&c).copied().unwrap_or(b'?'))
                                .collect()
                        }
                    })
                    .collect();
                (Model::Bpe(Box::new(bpe(g, &tokens, &types)?)), bytes)
            }
            "llama" => {
                let scores: Vec<f32> =
                    match g.get("tokenizer.ggml.scores").and_then(Value::as_array) {
                        Some(a) => a.iter().map(|v| v.as_f64().unwrap_or(0.0) as f32).collect(),
                        None => vec![0.0; tokens.len()],
                    };
                if scores.len() != tokens.len() {
                    return Err(TokenizerError::Build(format!(
                        "{} scores for {} tokens",
                        scores.len(),
                        tokens.len()
                    )));
                }
                let add_space_prefix = g
                    .get("tokenizer.ggml.add_space_prefix")
                    .and_then(Value::as_i64)
                    .is_none_or(|v| v != 0);
                let spm = Spm::new(
                    &tokens,
                    &scores,
                    &types,
                    add_space_prefix,
                    id("tokenizer.ggml.unknown_token_id"),
                );
                let bytes = tokens
                    .iter()
                    .zip(&types)
                    .map(|(t, &ty)| Spm::token_bytes(t, ty))
                    .collect();
                (Model::Spm(Box::new(spm)), bytes)
            }
            other => {
                return Err(TokenizerError::Unsupported(format!(
                    "tokenizer.ggml.model = '{other}' (supported: 'gpt2', byte-level BPE; \
                     'llama', SentencePiece)"
                )))
            }
        };
        let bos_id = id("tokenizer.ggml.bos_token_id");
        let eos_id = id("tokenizer.ggml.eos_token_id");
        let text = |i: Option<u32>| i.map(|i| tokens[i as usize].clone()).unwrap_or_default();
        Ok(Tokenizer {
            inner,
            token_bytes,
            is_control: types.iter().map(|&t| t == TOKEN_TYPE_CONTROL).collect(),
            bos_id,
            eos_id,
            add_bos: g
                .get("tokenizer.ggml.add_bos_token")
                .and_then(Value::as_i64)
                .unwrap_or(0)
                != 0,
            chat_template: g
                .get("tokenizer.chat_template")
                .and_then(Value::as_str)
                .map(str::to_string),
            bos_text: text(bos_id),
            eos_text: text(eos_id),
        })
    }

    pub fn vocab_size(&self) -> usize {
        self.token_bytes.len()
    }

    /// Token ids of `text`; control tokens written in the text are recognised (as llama.cpp's
    /// server does for prompts). Adds BOS when the model asks for it.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, TokenizerError> {
        self.encode_with(text, true)
    }

    /// The vocabulary's kind, as `/tokenizer_info` names it.
    pub fn kind_name(&self) -> &'static str {
        match self.inner {
            Model::Bpe(_) => "gguf-bpe",
            Model::Spm(_) => "gguf-sentencepiece",
        }
    }

    /// The chat template: the one set with [`Tokenizer::set_chat_template`], else the GGUF's.
    pub fn chat_template(&self) -> Option<&str> {
        self.chat_template.as_deref()
    }

    /// Replace the GGUF's chat template (`--chat-template`), or give a file without one its
    /// template.
    pub fn set_chat_template(&mut self, template: String) {
        self.chat_template = Some(template);
    }

    /// `encode`, adding BOS (when the model asks for it) only with `add_special`.
    pub fn encode_with(&self, text: &str, add_special: bool) -> Result<Vec<u32>, TokenizerError> {
        let mut ids = Vec::with_capacity(text.len() / 3 + 2);
        if self.add_bos && add_special {
            ids.extend(self.bos_id);
        }
        match &self.inner {
            Model::Bpe(t) => {
                let enc = t
                    .encode_fast(text, false)
                    .map_err(|e| TokenizerError::Build(e.to_string()))?;
                ids.extend_from_slice(enc.get_ids());
            }
            Model::Spm(s) => s.encode(text, &mut ids),
        }
        Ok(ids)
    }

    /// The tokenizer as Hugging Face files (`tokenizer.json`, `tokenizer_config.json`), for
    /// clients that tokenize themselves (the `verifiers` renderers, TRL) and cannot fetch the
    /// model's own from a hub: the same vocabulary, merges and pre-tokenizer this server encodes
    /// with, BOS added by a post-processor when the model asks for it, and the GGUF's chat
    /// template. Byte-level BPE only (SentencePiece vocabularies are encoded by `model::spm`,
    /// which has no `tokenizers` form).
    pub fn hf_files(&self) -> Result<(String, serde_json::Value), TokenizerError> {
        let Model::Bpe(t) = &self.inner else {
            return Err(TokenizerError::Unsupported(
                "exporting a SentencePiece tokenizer (only byte-level BPE has a tokenizer.json)"
                    .into(),
            ));
        };
        let mut t = (**t).clone();
        if let (true, Some(bos)) = (self.add_bos, self.bos_id) {
            let post = tokenizers::processors::template::TemplateProcessing::builder()
                .try_single(format!("{} $A", self.bos_text))
                .and_then(|b| b.try_pair(format!("{} $A {} $B", self.bos_text, self.bos_text)))
                .map_err(|e| TokenizerError::Build(e.to_string()))?
                .special_tokens(vec![(self.bos_text.clone(), bos)])
                .build()
                .map_err(|e| TokenizerError::Build(e.to_string()))?;
            t.with_post_processor(Some(post));
        }
        let json = t
            .to_string(true)
            .map_err(|e| TokenizerError::Build(e.to_string()))?;
        let config = serde_json::json!({
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": self.bos_id.map(|_| self.bos_text.clone()),
            "eos_token": self.eos_id.map(|_| self.eos_text.clone()),
            "pad_token": self.eos_id.map(|_| self.eos_text.clone()),
            "add_bos_token": self.add_bos,
            "add_eos_token": false,
            "clean_up_tokenization_spaces": false,
            "chat_template": self.chat_template,
        });
        Ok((json, config))
    }

    /// The bytes a token stands for.
    pub fn token_bytes(&self, id: u32) -> &[u8] {
        self.token_bytes
            .get(id as usize)
            .map(Vec::as_slice)
            .unwrap_or(&[])
    }

    /// Control tokens (`<|im_end|>`, BOS, EOS) are left out of generated text.
    pub fn is_control(&self, id: u32) -> bool {
        self.is_control.get(id as usize).copied().unwrap_or(false)
    }

    /// Text of a token sequence (invalid UTF-8 replaced by U+FFFD).
    pub fn decode(&self, ids: &[u32]) -> String {
        let bytes: Vec<u8> = ids
            .iter()
            .flat_map(|&i| self.token_bytes(i).iter().copied())
            .collect();
        String::from_utf8_lossy(&bytes).into_owned()
    }

    /// Render the chat template with `messages`, ending with the assistant's generation prompt
    /// when `add_generation_prompt`.
    pub fn apply_chat_template(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String, TokenizerError> {
        self.render_chat(messages, None::<&[ToolDef]>, add_generation_prompt)
    }

    /// Render the chat template with messages as OpenAI's API gives them (any fields: tool calls,
    /// tool results, names; typed as [`Message`](super::conversation::Message) or raw JSON) and
    /// the tool definitions, as transformers' `apply_chat_template` renders them.
    pub fn render_chat<M: Serialize, T: Serialize>(
        &self,
        messages: &[M],
        tools: Option<&[T]>,
        add_generation_prompt: bool,
    ) -> Result<String, TokenizerError> {
        let how = ChatRender {
            add_generation_prompt,
            ..ChatRender::default()
        };
        self.render_chat_with(messages, tools, &how)
    }

    /// [`Tokenizer::render_chat`] with a request's choices: its own template, the template's
    /// extra variables (`chat_template_kwargs`), and `continue_final_message` (the last message
    /// left open, cut where its content ends, as transformers cuts it).
    pub fn render_chat_with<M: Serialize, T: Serialize>(
        &self,
        messages: &[M],
        tools: Option<&[T]>,
        how: &ChatRender,
    ) -> Result<String, TokenizerError> {
        let tmpl = how
            .template
            .as_deref()
            .or(self.chat_template.as_deref())
            .ok_or_else(|| {
                TokenizerError::Template(
                    "the model has no chat template (tokenizer.chat_template): start the server \
                     with --chat-template NAME|FILE (names: chatml, llama3, gemma, phi3, zephyr, \
                     mistral) or send 'chat_template'"
                        .into(),
                )
            })?;
        // As JSON, in the order the fields were written: the final message may be edited below.
        let mut messages =
            serde_json::to_value(messages).map_err(|e| TokenizerError::Template(e.to_string()))?;
        let mut cont = None;
        if how.continue_final_message {
            let last = messages
                .as_array_mut()
                .and_then(|m| m.last_mut())
                .and_then(|m| m.get_mut("content"))
                .and_then(|c| match c {
                    serde_json::Value::String(s) => Some(s),
                    _ => None,
                })
                .ok_or_else(|| {
                    TokenizerError::Template(
                        "continue_final_message: the final message has no content to continue"
                            .into(),
                    )
                })?;
            cont = Some(last.trim().to_string());
            last.push_str(CONTINUE_TAG);
        }
        let extra = how
            .kwargs
            .as_ref()
            .map(minijinja::Value::from_serialize)
            .unwrap_or_else(|| minijinja::Value::from(()));
        let ctx = minijinja::context! {
            messages => minijinja::Value::from_serialize(&messages),
            tools => tools.map(minijinja::Value::from_serialize),
            add_generation_prompt => how.add_generation_prompt,
            bos_token => self.bos_text,
            eos_token => self.eos_text,
            ..extra
        };
        let text = super::chat_template::render(tmpl, ctx)
            .map_err(|e| TokenizerError::Template(template_error(&e)))?;
        let Some(final_message) = cont else {
            return Ok(text);
        };
        // transformers' cut: at the tag, or before the whitespace the template trimmed with it.
        let tag = CONTINUE_TAG.trim();
        match text.rfind(tag) {
            Some(at) if text.contains(final_message.as_str()) => {
                if text[at..].starts_with(CONTINUE_TAG) {
                    Ok(text[..at].to_string())
                } else {
                    Ok(text[..at].trim_end().to_string())
                }
            }
            _ => Err(TokenizerError::Template(
                "continue_final_message: the template does not write the final message's content \
                 as it was sent"
                    .into(),
            )),
        }
    }
}

/// The marker transformers appends to the final message's content to find where it ends.
const CONTINUE_TAG: &str = "CONTINUE_FINAL_MESSAGE_TAG ";

/// A template's error with its cause (`raise_exception`'s message, the line of a syntax error).
fn template_error(e: &minijinja::Error) -> String {
    let mut msg = e.to_string();
    let mut src = std::error::Error::source(e);
    while let Some(s) = src {
        msg.push_str(&format!(": {s}"));
        src = s.source();
    }
    msg
}

/// How a request renders its conversation (the defaults: the model's template, a generation
/// prompt, nothing continued, no extra variables).
#[derive(Clone, Debug, Default)]
pub struct ChatRender {
    /// The request's own template (vLLM's per-request `chat_template`).
    pub template: Option<String>,
    pub add_generation_prompt: bool,
    pub continue_final_message: bool,
    /// Extra template variables (`chat_template_kwargs`, e.g. Qwen3's `enable_thinking`).
    pub kwargs: Option<serde_json::Map<String, serde_json::Value>>,
}

fn string_array(g: &Gguf, key: &str) -> Result<Vec<String>, TokenizerError> {
    let a = g
        .get(key)
        .and_then(Value::as_array)
        .ok_or_else(|| GgufError::BadMetadata {
            key: key.into(),
            msg: "missing or not an array".into(),
        })?;
    a.iter()
        .map(|v| {
            v.as_str().map(str::to_string).ok_or_else(|| {
                GgufError::BadMetadata {
                    key: key.into(),
                    msg: "contains a non-string".into(),
                }
                .into()
            })
        })
        .collect()
}

/// Incremental detokenizer: feed token ids, get back the text that is complete UTF-8 so far.
#[derive(Default)]
pub struct Detokenizer {
    pending: Vec<u8>,
}

impl Detokenizer {
    pub fn push(&mut self, tok: &Tokenizer, id: u32) -> String {
        self.pending.extend_from_slice(tok.token_bytes(id));
        // As `String::from_utf8_lossy` on the whole text would: one U+FFFD per maximal invalid
        // sequence; an incomplete character at the end waits for the next token.
        let mut out = String::new();
        loop {
            match std::str::from_utf8(&self.pending) {
                Ok(s) => {
                    out.push_str(s);
                    self.pending.clear();
                    return out;
                }
                Err(e) => {
                    let v = e.valid_up_to();
                    out.push_str(std::str::from_utf8(&self.pending[..v]).expect("valid prefix"));
                    match e.error_len() {
                        Some(n) => {
                            out.push(char::REPLACEMENT_CHARACTER);
                            self.pending.drain(..v + n);
                        }
                        None => {
                            self.pending.drain(..v);
                            return out;
                        }
                    }
                }
            }
        }
    }

    /// Whatever is left (an incomplete character at the end), lossily.
    pub fn finish(&mut self) -> String {
        let out = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        out
    }
}
