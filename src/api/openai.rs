//! OpenAI wire requests, read field by field from JSON so that every bad field is a 400 naming it
//! (`param`), unknown fields are ignored, and the result is a typed, validated value.

use super::error::ApiError;
use crate::engine::repetition::RepetitionRule;
use crate::engine::sampler::SamplingParams;
use crate::policy::is_greedy;
use serde_json::{Map, Value};

/// A JSON object's fields, with typed getters that name the field in their errors.
pub struct Fields<'a>(pub &'a Map<String, Value>);

pub(super) fn type_error(name: &str, want: &str) -> ApiError {
    ApiError::invalid(name, format!("'{name}' must be {want}"))
}

impl<'a> Fields<'a> {
    pub fn parse(body: &'a Value) -> Result<Fields<'a>, ApiError> {
        body.as_object()
            .map(Fields)
            .ok_or_else(|| ApiError::bad_body("the request body must be a JSON object"))
    }

    /// Every key is one of `allowed`; else a 400 naming the first other ("'k' is not a field of
    /// `of`").
    pub fn only(&self, allowed: &[&str], of: &str) -> Result<(), ApiError> {
        match self.0.keys().find(|k| !allowed.contains(&k.as_str())) {
            None => Ok(()),
            Some(k) => Err(ApiError::invalid(
                k,
                format!("'{k}' is not a field of {of}"),
            )),
        }
    }

    /// The value, treating JSON null as absent.
    pub fn get(&self, name: &str) -> Option<&'a Value> {
        self.0.get(name).filter(|v| !v.is_null())
    }

    pub fn f64(&self, name: &str) -> Result<Option<f64>, ApiError> {
        self.get(name)
            .map(|v| v.as_f64().ok_or_else(|| type_error(name, "a number")))
            .transpose()
    }

    /// A number in `lo..=hi` (open ends when `open`), as f32.
    pub fn f32_in(
        &self,
        name: &str,
        lo: f64,
        hi: f64,
        lo_open: bool,
    ) -> Result<Option<f32>, ApiError> {
        Ok(self.f64_in(name, lo, hi, lo_open)?.map(|x| x as f32))
    }

    /// A number in `lo..=hi` (open ends when `open`).
    pub fn f64_in(
        &self,
        name: &str,
        lo: f64,
        hi: f64,
        lo_open: bool,
    ) -> Result<Option<f64>, ApiError> {
        let Some(x) = self.f64(name)? else {
            return Ok(None);
        };
        let ok = x.is_finite() && if lo_open { x > lo } else { x >= lo } && x <= hi;
        if !ok {
            let lb = if lo_open { "(" } else { "[" };
            let hi = if hi.is_finite() {
                format!("{hi}]")
            } else {
                "inf)".into()
            };
            return Err(ApiError::invalid(
                name,
                format!("'{name}' is {x}; it must be in {lb}{lo}, {hi}"),
            ));
        }
        Ok(Some(x))
    }

    /// An integer as JSON Schema's `integer` reads it: integral numbers, also written as floats
    /// (`4.0`); any size (checked by the caller's range, never wrapped).
    pub fn int(&self, name: &str) -> Result<Option<i128>, ApiError> {
        let Some(v) = self.get(name) else {
            return Ok(None);
        };
        let n = v
            .as_number()
            .ok_or_else(|| type_error(name, "an integer"))?;
        if let Some(i) = n.as_i64() {
            return Ok(Some(i as i128));
        }
        if let Some(u) = n.as_u64() {
            return Ok(Some(u as i128));
        }
        match n.as_f64() {
            Some(x) if x.fract() == 0.0 && x.abs() < 1e30 => Ok(Some(x as i128)),
            Some(x) if x.is_finite() && x.fract() == 0.0 => Err(ApiError::invalid(
                name,
                format!("'{name}' is {v}; it is out of range"),
            )),
            _ => Err(ApiError::invalid(
                name,
                format!("'{name}' is {v}; it must be an integer"),
            )),
        }
    }

    /// An integer in `lo..=hi`; the error quotes the value as sent.
    pub fn int_in(&self, name: &str, lo: i128, hi: i128) -> Result<Option<i64>, ApiError> {
        match self.int(name)? {
            Some(x) if x < lo || x > hi => Err(ApiError::invalid(
                name,
                format!(
                    "'{name}' is {}; it must be in [{lo}, {hi}]",
                    self.get(name).map(Value::to_string).unwrap_or_default()
                ),
            )),
            x => Ok(x.map(|x| x as i64)),
        }
    }

    pub fn bool(&self, name: &str) -> Result<Option<bool>, ApiError> {
        self.get(name)
            .map(|v| v.as_bool().ok_or_else(|| type_error(name, "a boolean")))
            .transpose()
    }

    pub fn str(&self, name: &str) -> Result<Option<&'a str>, ApiError> {
        self.get(name)
            .map(|v| v.as_str().ok_or_else(|| type_error(name, "a string")))
            .transpose()
    }

    /// A list of token ids below `vocab`.
    pub fn token_ids(&self, name: &str, vocab: usize) -> Result<Option<Vec<u32>>, ApiError> {
        let Some(v) = self.get(name) else {
            return Ok(None);
        };
        token_id_list(v, vocab)
            .map(Some)
            .ok_or_else(|| type_error(name, &format!("a list of token ids below {vocab}")))
    }
}

/// A JSON list of token ids below `vocab` (None: anything else).
pub(super) fn token_id_list(v: &Value, vocab: usize) -> Option<Vec<u32>> {
    v.as_array()?
        .iter()
        .map(|t| {
            t.as_u64()
                .filter(|&t| (t as usize) < vocab)
                .map(|t| t as u32)
        })
        .collect()
}

/// What chat and completions requests share, validated.
#[derive(Clone, Debug)]
pub struct CommonParams {
    pub model: String,
    pub max_tokens: Option<usize>,
    pub n: usize,
    pub sampling: SamplingParams,
    pub seed: Option<u64>,
    pub stop: Vec<String>,
    pub stop_token_ids: Vec<u32>,
    pub ignore_eos: bool,
    /// vLLM's: the stop string that ended a choice is kept at the end of its text.
    pub include_stop_str_in_output: bool,
    /// vLLM's: words never to write (tokenized as written and after a space).
    pub bad_words: Vec<String>,
    /// vLLM's: keep only the last k prompt tokens (-1: the context length).
    pub truncate_prompt_tokens: Option<i64>,
    pub stream: bool,
    pub include_usage: bool,
    pub return_token_ids: bool,
    pub return_tokens_as_token_ids: bool,
    /// Per-token log-probs in the response.
    pub logprobs: bool,
    /// vLLM's `prompt_logprobs`: score the prompt, with this many alternatives per token.
    pub prompt_logprobs: Option<usize>,
    /// Extension: the training group of a completion served through a learning adapter (its
    /// choices are otherwise the group).
    pub group: Option<String>,
    /// Extension: the episode (a multi-turn task, rewarded once) the completion is a turn of.
    pub episode: Option<String>,
    /// Extension: `stop_on_repetition` (None: as the adapter says; Some(None): off).
    pub stop_on_repetition: Option<Option<RepetitionRule>>,
}

pub const MAX_N: i64 = 128;
pub const MAX_TOP_LOGPROBS: i64 = 20;
pub const MAX_STOP_STRINGS: usize = 16;

/// Request parameters that OpenAI's or vLLM's API defines and this server does not implement
/// (yet): a 400 naming the field whenever one is set to anything but its neutral value, never a
/// silent 200. (Fields no API defines stay ignored, as OpenAI's are.)
pub fn refuse_unimplemented(f: &Fields) -> Result<(), ApiError> {
    let neutral = |name: &str, ok: &dyn Fn(&Value) -> bool| -> Result<(), ApiError> {
        match f.get(name) {
            Some(v) if !ok(v) => Err(ApiError::invalid(
                name,
                format!("'{name}' = {v} is not supported by this server"),
            )),
            _ => Ok(()),
        }
    };
    let number = |x: f64| move |v: &Value| v.as_f64() == Some(x);
    let is_false = |v: &Value| *v == Value::Bool(false);
    let never = |_: &Value| false;
    neutral("length_penalty", &number(1.0))?;
    neutral("best_of", &number(1.0))?;
    neutral("use_beam_search", &is_false)?;
    neutral("suffix", &|v: &Value| v.as_str() == Some(""))?;
    neutral("modalities", &|v: &Value| *v == serde_json::json!(["text"]))?;
    for name in ["audio", "prediction"] {
        neutral(name, &never)?;
    }
    Ok(())
}

pub fn parse_common(f: &Fields, vocab: usize) -> Result<CommonParams, ApiError> {
    refuse_unimplemented(f)?;
    let model = f
        .str("model")?
        .ok_or_else(|| ApiError::invalid("model", "'model' is required"))?
        .to_string();
    // Both are read (and so validated) when both are sent; max_completion_tokens wins.
    // 0 only when the prompt is scored (checked by `check_scoring`).
    let legacy_max = f.int_in("max_tokens", 0, i64::MAX as i128)?;
    let max_tokens = f
        .int_in("max_completion_tokens", 0, i64::MAX as i128)?
        .or(legacy_max);
    let temperature = f.f32_in("temperature", 0.0, f64::INFINITY, false)?;
    let top_k = f.int_in("top_k", -1, vocab as i128)?.unwrap_or(0);
    let sampling = SamplingParams {
        // Below MIN_TEMPERATURE is greedy: said as 0 everywhere after this (the rollout log too).
        temperature: temperature.map_or(1.0, |t| if is_greedy(t) { 0.0 } else { t }),
        top_p: f.f32_in("top_p", 0.0, 1.0, true)?.unwrap_or(1.0),
        top_k: top_k.max(0) as usize,
        min_p: f.f32_in("min_p", 0.0, 1.0, false)?.unwrap_or(0.0),
        presence_penalty: f
            .f32_in("presence_penalty", -2.0, 2.0, false)?
            .unwrap_or(0.0),
        frequency_penalty: f
            .f32_in("frequency_penalty", -2.0, 2.0, false)?
            .unwrap_or(0.0),
        repetition_penalty: f
            .f32_in("repetition_penalty", 0.0, 10.0, true)?
            .unwrap_or(1.0),
        top_logprobs: 0,
        logit_bias: parse_logit_bias(f, vocab)?,
        constrained: false,
        min_tokens: f.int_in("min_tokens", 0, i64::MAX as i128)?.unwrap_or(0) as usize,
        allowed_tokens: match f.token_ids("allowed_token_ids", vocab)? {
            Some(ids) if ids.is_empty() => {
                return Err(ApiError::invalid(
                    "allowed_token_ids",
                    "'allowed_token_ids' is empty",
                ))
            }
            Some(mut ids) => {
                ids.sort_unstable();
                ids.dedup();
                Some(ids.into())
            }
            None => None,
        },
        // Tokenized with the model's tokenizer when the request is built (`bad_word_tokens`).
        bad_words: Default::default(),
    };
    if let Some(m) = max_tokens.filter(|&m| (sampling.min_tokens as i64) > m) {
        return Err(ApiError::invalid(
            "min_tokens",
            format!(
                "'min_tokens' ({}) is more than max_tokens ({m})",
                sampling.min_tokens
            ),
        ));
    }
    let stop = match f.get("stop") {
        None => Vec::new(),
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(a)) => a
            .iter()
            .map(|v| v.as_str().map(str::to_string))
            .collect::<Option<Vec<_>>>()
            .ok_or_else(|| type_error("stop", "a string or a list of strings"))?,
        Some(_) => return Err(type_error("stop", "a string or a list of strings")),
    };
    if stop.len() > MAX_STOP_STRINGS || stop.iter().any(String::is_empty) {
        return Err(ApiError::invalid(
            "stop",
            format!("'stop' takes at most {MAX_STOP_STRINGS} non-empty strings"),
        ));
    }
    let stream = f.bool("stream")?.unwrap_or(false);
    let include_usage = match f.get("stream_options") {
        None | Some(Value::Null) => false,
        Some(Value::Object(o)) => {
            // vLLM's usage on every chunk: not implemented, refused rather than ignored.
            if let Some(v) = o
                .get("continuous_usage_stats")
                .filter(|v| !matches!(v, Value::Null | Value::Bool(false)))
            {
                return Err(ApiError::invalid(
                    "stream_options.continuous_usage_stats",
                    format!(
                        "'stream_options.continuous_usage_stats' = {v} is not supported by this \
                         server (usage comes in the last chunk with include_usage)"
                    ),
                ));
            }
            Fields(o)
                .bool("include_usage")
                .map_err(|_| type_error("stream_options.include_usage", "a boolean"))?
                .unwrap_or(false)
        }
        Some(_) => return Err(type_error("stream_options", "an object")),
    };
    let params = CommonParams {
        model,
        max_tokens: max_tokens.map(|m| m as usize),
        n: f.int_in("n", 1, MAX_N as i128)?.unwrap_or(1) as usize,
        sampling,
        // Any 64-bit seed, signed or not (negative ones wrap, as two's complement).
        seed: f
            .int_in("seed", i64::MIN as i128, u64::MAX as i128)?
            .map(|s| s as u64),
        stop,
        stop_token_ids: f.token_ids("stop_token_ids", vocab)?.unwrap_or_default(),
        ignore_eos: f.bool("ignore_eos")?.unwrap_or(false),
        include_stop_str_in_output: f.bool("include_stop_str_in_output")?.unwrap_or(false),
        bad_words: parse_bad_words(f)?,
        truncate_prompt_tokens: match f.int_in("truncate_prompt_tokens", -1, i64::MAX as i128)? {
            Some(0) => {
                return Err(ApiError::invalid(
                    "truncate_prompt_tokens",
                    "'truncate_prompt_tokens' is 0; it must be -1 (the context length) or at \
                     least 1",
                ))
            }
            k => k,
        },
        stream,
        include_usage,
        return_token_ids: f.bool("return_token_ids")?.unwrap_or(false),
        return_tokens_as_token_ids: f.bool("return_tokens_as_token_ids")?.unwrap_or(false),
        logprobs: false,
        prompt_logprobs: f
            .int_in("prompt_logprobs", 0, MAX_TOP_LOGPROBS as i128)?
            .map(|k| k as usize),
        group: match f.str("group")? {
            Some(g) if g.is_empty() || g.len() > 256 => {
                return Err(ApiError::invalid(
                    "group",
                    "'group' must have 1 to 256 characters",
                ))
            }
            g => g.map(str::to_string),
        },
        episode: match f.str("episode")? {
            Some(e) if e.is_empty() || e.len() > 256 => {
                return Err(ApiError::invalid(
                    "episode",
                    "'episode' must have 1 to 256 characters",
                ))
            }
            e => e.map(str::to_string),
        },
        stop_on_repetition: parse_repetition(f)?,
    };
    // An episode's turns are one completion each: its reward is the one answer's.
    if params.episode.is_some() && params.n > 1 {
        return Err(ApiError::invalid(
            "episode",
            "an episode's turn is one completion: 'n' must be 1 with 'episode'",
        ));
    }
    Ok(params)
}

/// `stop_on_repetition`: true (the default rule), false, or a rule `{max_period, min_repeats,
/// min_tokens}`.
fn parse_repetition(f: &Fields) -> Result<Option<Option<RepetitionRule>>, ApiError> {
    const P: &str = "stop_on_repetition";
    let Some(v) = f.get(P).filter(|v| !v.is_null()) else {
        return Ok(None);
    };
    let raw: crate::online::config::RawRepetition =
        serde_json::from_value(v.clone()).map_err(|e| {
            ApiError::invalid(
                P,
                format!("'{P}' is true, false or {{max_period, min_repeats, min_tokens}}: {e}"),
            )
        })?;
    raw.rule()
        .map(Some)
        .map_err(|e| ApiError::invalid(P, format!("'{P}': {e}")))
}

/// Prompt scoring rules, after the logprobs fields are read: `echo` with legacy `logprobs: k`
/// scores the prompt with k alternatives (vLLM: prompt_logprobs defaults to logprobs); scores
/// are not streamed; `max_tokens: 0` only with `echo` or `prompt_logprobs`.
pub fn check_scoring(f: &Fields, p: &mut CommonParams, echo: bool) -> Result<(), ApiError> {
    if echo && p.logprobs && p.prompt_logprobs.is_none() {
        p.prompt_logprobs = Some(p.sampling.top_logprobs);
    }
    if p.stream && f.get("prompt_logprobs").is_some() {
        return Err(ApiError::invalid(
            "prompt_logprobs",
            "'prompt_logprobs' is not available with 'stream'",
        ));
    }
    if p.max_tokens == Some(0) && !echo && p.prompt_logprobs.is_none() {
        let name = if f.get("max_completion_tokens").is_some() {
            "max_completion_tokens"
        } else {
            "max_tokens"
        };
        return Err(ApiError::invalid(
            name,
            format!("'{name}' is 0; it must be at least 1 (0 only with echo or prompt_logprobs)"),
        ));
    }
    Ok(())
}

/// Bad words of one request at most, and the longest.
pub const MAX_BAD_WORDS: usize = 128;
const MAX_BAD_WORD_BYTES: usize = 256;

/// vLLM's `bad_words`: a list of non-empty strings.
fn parse_bad_words(f: &Fields) -> Result<Vec<String>, ApiError> {
    let Some(v) = f.get("bad_words") else {
        return Ok(Vec::new());
    };
    let words = v
        .as_array()
        .and_then(|a| {
            a.iter()
                .map(|w| w.as_str().map(str::to_string))
                .collect::<Option<Vec<_>>>()
        })
        .ok_or_else(|| type_error("bad_words", "a list of strings"))?;
    if words.len() > MAX_BAD_WORDS
        || words
            .iter()
            .any(|w| w.trim().is_empty() || w.len() > MAX_BAD_WORD_BYTES)
    {
        return Err(ApiError::invalid(
            "bad_words",
            format!(
                "'bad_words' takes at most {MAX_BAD_WORDS} words of 1 to {MAX_BAD_WORD_BYTES} bytes"
            ),
        ));
    }
    Ok(words)
}

pub const MAX_LOGIT_BIAS: usize = 300;

/// OpenAI's `logit_bias`: an object mapping token ids (as strings) to a bias in [-100, 100], at
/// most 300 entries.
fn parse_logit_bias(f: &Fields, vocab: usize) -> Result<Vec<(u32, f32)>, ApiError> {
    let Some(v) = f.get("logit_bias") else {
        return Ok(Vec::new());
    };
    let o = v
        .as_object()
        .ok_or_else(|| type_error("logit_bias", "an object mapping token ids to numbers"))?;
    if o.len() > MAX_LOGIT_BIAS {
        return Err(ApiError::invalid(
            "logit_bias",
            format!(
                "'logit_bias' has {} entries; at most {MAX_LOGIT_BIAS}",
                o.len()
            ),
        ));
    }
    let mut out = Vec::with_capacity(o.len());
    for (k, b) in o {
        let tok = k
            .parse::<u32>()
            .ok()
            .filter(|&t| (t as usize) < vocab)
            .ok_or_else(|| {
                ApiError::invalid(
                    "logit_bias",
                    format!("'logit_bias' key '{k}' is not a token id below {vocab}"),
                )
            })?;
        let bias = b
            .as_f64()
            .filter(|x| (-100.0..=100.0).contains(x))
            .ok_or_else(|| {
                ApiError::invalid(
                    "logit_bias",
                    format!("'logit_bias' value {b} for token {k} must be a number in [-100, 100]"),
                )
            })?;
        out.push((tok, bias as f32));
    }
    Ok(out)
}

/// Chat logprobs: `logprobs` (bool) and `top_logprobs` (0..=20, needs `logprobs`).
pub fn parse_chat_logprobs(f: &Fields, p: &mut CommonParams) -> Result<(), ApiError> {
    p.logprobs = f.bool("logprobs")?.unwrap_or(false);
    let top = f.int_in("top_logprobs", 0, MAX_TOP_LOGPROBS as i128)?;
    if top.is_some_and(|t| t > 0) && !p.logprobs {
        return Err(ApiError::invalid(
            "top_logprobs",
            "'top_logprobs' needs 'logprobs': true",
        ));
    }
    p.sampling.top_logprobs = top.unwrap_or(0) as usize;
    Ok(())
}

/// Legacy completions logprobs: an integer 0..=20, the number of alternatives per token.
pub fn parse_completion_logprobs(f: &Fields, p: &mut CommonParams) -> Result<(), ApiError> {
    if let Some(k) = f.int_in("logprobs", 0, MAX_TOP_LOGPROBS as i128)? {
        p.logprobs = true;
        p.sampling.top_logprobs = k as usize;
    }
    Ok(())
}

/// One completions prompt: text or token ids.
pub enum Prompt {
    Text(String),
    Ids(Vec<u32>),
}

/// Prompts of one completions request at most.
pub const MAX_PROMPTS: usize = 256;

/// The completions `prompt`: a string, a list of token ids, or a list of either (a batch).
pub fn parse_prompts(f: &Fields, vocab: usize) -> Result<Vec<Prompt>, ApiError> {
    let v = f
        .get("prompt")
        .ok_or_else(|| ApiError::invalid("prompt", "'prompt' is required"))?;
    let items: Vec<&Value> = match v {
        Value::Array(a) if a.iter().any(|x| x.is_string() || x.is_array()) => a.iter().collect(),
        v => vec![v],
    };
    if items.is_empty() {
        return Err(ApiError::invalid("prompt", "the prompt is empty"));
    }
    if items.len() > MAX_PROMPTS {
        return Err(ApiError::invalid(
            "prompt",
            format!("{} prompts; at most {MAX_PROMPTS} per request", items.len()),
        ));
    }
    items
        .into_iter()
        .map(|one| {
            let p = match one {
                Value::String(s) => Prompt::Text(s.clone()),
                v => Prompt::Ids(token_id_list(v, vocab).ok_or_else(|| {
                    type_error(
                        "prompt",
                        &format!(
                            "a string, a list of token ids below {vocab}, or a list of either"
                        ),
                    )
                })?),
            };
            match &p {
                Prompt::Ids(ids) if ids.is_empty() => {
                    Err(ApiError::invalid("prompt", "the prompt is empty"))
                }
                _ => Ok(p),
            }
        })
        .collect()
}
