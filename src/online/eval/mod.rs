//! Evaluation sets: a learning adapter's fixed prompts (chat messages, tools) each with a scorer,
//! run greedily on a version so that scores compare across versions. A version's score is the
//! mean of its items' scores, each in [0, 1]. Scorers: `exact`, `contains` and `regex` against a
//! reference; `json_schema` (the answer is JSON valid under a schema, `schema`); `length` (the
//! answer's tokens within a window); `tool_call` (a call of the given name, with the given
//! arguments among its own); `judge` (a rubric prompt answered by the base model or a named
//! adapter on the same weights: its first number over `judge_max`).
//!
//! The requests run through a `Runner` the server provides (`api::eval`: the chat route's own
//! path, not logged for training); this module builds them and scores the answers (pure).

pub mod schema;

use crate::adapter::registry::AdapterVersion;
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
use std::sync::Arc;

/// One item of an evaluation set as written (`[[learn.eval]]`, or the `eval` list of
/// `POST /v1/adapters/{name}/train`).
#[derive(Clone, Debug, Default, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct RawEvalItem {
    /// The chat messages (OpenAI's shape).
    pub messages: Vec<Value>,
    /// Tools offered (OpenAI's shape), for `tool_call` items.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tools: Option<Vec<Value>>,
    /// OpenAI's `tool_choice` for the request ("auto", "required", a named function).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_choice: Option<Value>,
    pub scorer: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reference: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ignore_case: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pattern: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub schema: Option<Value>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub min_tokens: Option<usize>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_tokens: Option<usize>,
    /// The tool a `tool_call` item expects.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub arguments: Option<Map<String, Value>>,
    /// A `judge` item's prompt: `{prompt}` is replaced by the item's last user message and
    /// `{answer}` by the version's answer.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rubric: Option<String>,
    /// The judge's top mark (default 10): its first number over this is the score.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub judge_max: Option<f64>,
    /// The adapter that judges (default: the base model).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub judge_adapter: Option<String>,
}

/// How an item's answer is scored.
#[derive(Clone, Debug)]
pub enum Scorer {
    Exact(String),
    Contains {
        reference: String,
        ignore_case: bool,
    },
    Regex(regex::Regex),
    JsonSchema(Value),
    Length {
        min: usize,
        max: usize,
    },
    ToolCall {
        name: String,
        arguments: Map<String, Value>,
    },
    Judge {
        rubric: String,
        max: f64,
        adapter: Option<String>,
    },
}

impl Scorer {
    pub fn name(&self) -> &'static str {
        match self {
            Scorer::Exact(_) => "exact",
            Scorer::Contains { .. } => "contains",
            Scorer::Regex(_) => "regex",
            Scorer::JsonSchema(_) => "json_schema",
            Scorer::Length { .. } => "length",
            Scorer::ToolCall { .. } => "tool_call",
            Scorer::Judge { .. } => "judge",
        }
    }
}

/// A validated item.
#[derive(Clone, Debug)]
pub struct EvalItem {
    pub messages: Vec<Value>,
    pub tools: Option<Vec<Value>>,
    pub tool_choice: Option<Value>,
    pub scorer: Scorer,
}

/// A learning adapter's evaluation set: the items as written (shown) and validated.
#[derive(Clone, Debug, Default)]
pub struct EvalSet {
    pub raw: Vec<RawEvalItem>,
    pub items: Vec<EvalItem>,
    /// Tokens each answer may take (`eval_max_tokens`).
    pub max_tokens: usize,
}

/// Default `eval_max_tokens`.
pub const EVAL_MAX_TOKENS: usize = 64;
/// Items a set may have.
pub const MAX_ITEMS: usize = 256;

impl EvalSet {
    /// Validate `raw`; an error names the item and its field (`eval[2].pattern`).
    pub fn new(raw: Vec<RawEvalItem>, max_tokens: usize) -> Result<EvalSet, String> {
        if raw.len() > MAX_ITEMS {
            return Err(format!(": {} items; at most {MAX_ITEMS}", raw.len()));
        }
        if !(1..=4096).contains(&max_tokens) {
            return Err("eval_max_tokens must be in 1..=4096".into());
        }
        let items = raw
            .iter()
            .enumerate()
            .map(|(i, r)| item(r).map_err(|e| format!("[{i}].{e}")))
            .collect::<Result<_, _>>()?;
        Ok(EvalSet {
            raw,
            items,
            max_tokens,
        })
    }

    pub fn is_empty(&self) -> bool {
        self.items.is_empty()
    }
}

impl Serialize for EvalSet {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        self.raw.serialize(s)
    }
}

/// Validate one item: its scorer's fields present, no field of another scorer.
fn item(r: &RawEvalItem) -> Result<EvalItem, String> {
    if r.messages.is_empty() || !r.messages.iter().all(Value::is_object) {
        return Err("messages: a non-empty list of chat messages".into());
    }
    let given: Vec<(&str, bool)> = vec![
        ("reference", r.reference.is_some()),
        ("ignore_case", r.ignore_case.is_some()),
        ("pattern", r.pattern.is_some()),
        ("schema", r.schema.is_some()),
        ("min_tokens", r.min_tokens.is_some()),
        ("max_tokens", r.max_tokens.is_some()),
        ("name", r.name.is_some()),
        ("arguments", r.arguments.is_some()),
        ("rubric", r.rubric.is_some()),
        ("judge_max", r.judge_max.is_some()),
        ("judge_adapter", r.judge_adapter.is_some()),
    ];
    let (uses, needs): (&[&str], &[&str]) = match r.scorer.as_str() {
        "exact" => (&["reference"], &["reference"]),
        "contains" => (&["reference", "ignore_case"], &["reference"]),
        "regex" => (&["pattern"], &["pattern"]),
        "json_schema" => (&["schema"], &["schema"]),
        "length" => (&["min_tokens", "max_tokens"], &[]),
        "tool_call" => (&["name", "arguments"], &["name"]),
        "judge" => (&["rubric", "judge_max", "judge_adapter"], &["rubric"]),
        other => {
            return Err(format!(
                "scorer: '{other}': exact, contains, regex, json_schema, length, tool_call or judge"
            ))
        }
    };
    for (k, set) in &given {
        if *set && !uses.contains(k) {
            return Err(format!("{k}: does not apply to the {} scorer", r.scorer));
        }
    }
    if let Some(k) = needs
        .iter()
        .find(|k| !given.iter().any(|(g, s)| g == *k && *s))
    {
        return Err(format!("{k}: the {} scorer needs it", r.scorer));
    }
    if r.scorer == "tool_call" && r.tools.as_ref().is_none_or(Vec::is_empty) {
        return Err("tools: a tool_call item offers its tools".into());
    }
    let s = |o: &Option<String>| o.clone().unwrap_or_default();
    let scorer = match r.scorer.as_str() {
        "exact" => Scorer::Exact(s(&r.reference)),
        "contains" => Scorer::Contains {
            reference: s(&r.reference),
            ignore_case: r.ignore_case.unwrap_or(false),
        },
        "regex" => {
            Scorer::Regex(regex::Regex::new(&s(&r.pattern)).map_err(|e| format!("pattern: {e}"))?)
        }
        "json_schema" => {
            let sc = r.schema.clone().unwrap_or_default();
            schema::check(&sc).map_err(|e| format!("schema: {e}"))?;
            Scorer::JsonSchema(sc)
        }
        "length" => {
            let (min, max) = (
                r.min_tokens.unwrap_or(0),
                r.max_tokens.unwrap_or(usize::MAX),
            );
            if min > max || (r.min_tokens.is_none() && r.max_tokens.is_none()) {
                return Err("min_tokens: give min_tokens, max_tokens or both, min <= max".into());
            }
            Scorer::Length { min, max }
        }
        "tool_call" => Scorer::ToolCall {
            name: s(&r.name),
            arguments: r.arguments.clone().unwrap_or_default(),
        },
        _ => {
            let max = r.judge_max.unwrap_or(10.0);
            if !(max > 0.0 && max.is_finite()) {
                return Err("judge_max: must be > 0".into());
            }
            let rubric = s(&r.rubric);
            if !rubric.contains("{answer}") {
                return Err("rubric: must contain {answer} (where the answer goes)".into());
            }
            Scorer::Judge {
                rubric,
                max,
                adapter: r.judge_adapter.clone(),
            }
        }
    };
    Ok(EvalItem {
        messages: r.messages.clone(),
        tools: r.tools.clone(),
        tool_choice: r.tool_choice.clone(),
        scorer,
    })
}

/// What a request runs through.
#[derive(Clone)]
pub enum Through {
    /// The base model.
    Base,
    /// This version (published or a candidate).
    Version(Arc<AdapterVersion>),
    /// The adapter of this name, as it serves now.
    Adapter(String),
}

/// A chat request the runner makes, greedy.
#[derive(Clone, Debug)]
pub struct ChatCall {
    pub messages: Vec<Value>,
    pub tools: Option<Vec<Value>>,
    pub tool_choice: Option<Value>,
    pub max_tokens: usize,
}

/// An answer: its text, its tool calls (name, parsed arguments) and its length in tokens.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Answer {
    pub text: String,
    pub tool_calls: Vec<(String, Value)>,
    pub completion_tokens: usize,
}

/// Runs chat requests for evaluations (the server's chat path; nothing logged for training).
pub trait Runner: Send + Sync {
    /// Each call, greedy, through `through`: the answers in order (all run at once).
    fn run(&self, through: &Through, calls: Vec<ChatCall>) -> Result<Vec<Answer>, String>;
}

/// Where the server puts its runner once it serves (the learners start before the engine).
pub type RunnerCell = Arc<std::sync::OnceLock<Arc<dyn Runner>>>;

/// A version's evaluation: the mean score, each item's, and how long it took.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct EvalScore {
    pub version: u64,
    pub score: f64,
    pub items: Vec<f64>,
    pub seconds: f64,
}

/// Evaluate `subject` (version `number`) on `set` through `runner` (judge items in a second
/// round).
pub fn evaluate(
    runner: &dyn Runner,
    set: &EvalSet,
    subject: Through,
    number: u64,
) -> Result<EvalScore, String> {
    let t0 = std::time::Instant::now();
    let calls = set
        .items
        .iter()
        .map(|it| ChatCall {
            messages: it.messages.clone(),
            tools: it.tools.clone(),
            tool_choice: it.tool_choice.clone(),
            max_tokens: set.max_tokens,
        })
        .collect();
    let answers = runner.run(&subject, calls)?;
    let mut items: Vec<f64> = set
        .items
        .iter()
        .zip(&answers)
        .map(|(it, a)| score(&it.scorer, a))
        .collect();
    // Judges, grouped by who judges.
    let mut judges: Vec<(Option<String>, Vec<usize>)> = Vec::new();
    for (i, it) in set.items.iter().enumerate() {
        if let Scorer::Judge { adapter, .. } = &it.scorer {
            match judges.iter_mut().find(|(a, _)| a == adapter) {
                Some((_, v)) => v.push(i),
                None => judges.push((adapter.clone(), vec![i])),
            }
        }
    }
    for (adapter, idx) in judges {
        let calls = idx
            .iter()
            .map(|&i| judge_call(&set.items[i], &answers[i].text, set.max_tokens))
            .collect();
        let through = adapter.map_or(Through::Base, Through::Adapter);
        let verdicts = runner.run(&through, calls)?;
        for (&i, v) in idx.iter().zip(&verdicts) {
            if let Scorer::Judge { max, .. } = &set.items[i].scorer {
                items[i] = judge_mark(&v.text, *max);
            }
        }
    }
    let score = if items.is_empty() {
        0.0
    } else {
        items.iter().sum::<f64>() / items.len() as f64
    };
    Ok(EvalScore {
        version: number,
        score,
        items,
        seconds: t0.elapsed().as_secs_f64(),
    })
}

/// The score of `answer` under `scorer` (a judge's is set from its verdict later: 0 here).
pub fn score(scorer: &Scorer, a: &Answer) -> f64 {
    let text = a.text.trim();
    let yes = |b: bool| if b { 1.0 } else { 0.0 };
    match scorer {
        Scorer::Exact(r) => yes(text == r.trim()),
        Scorer::Contains {
            reference,
            ignore_case: true,
        } => yes(text.to_lowercase().contains(&reference.to_lowercase())),
        Scorer::Contains { reference, .. } => yes(text.contains(reference.as_str())),
        Scorer::Regex(r) => yes(r.is_match(text)),
        Scorer::JsonSchema(s) => yes(json_of(text).is_some_and(|v| schema::valid(s, &v))),
        Scorer::Length { min, max } => yes((*min..=*max).contains(&a.completion_tokens)),
        Scorer::ToolCall { name, arguments } => yes(a.tool_calls.iter().any(|(n, args)| {
            n == name
                && arguments
                    .iter()
                    .all(|(k, v)| args.get(k).is_some_and(|x| x == v))
        })),
        Scorer::Judge { .. } => 0.0,
    }
}

/// The JSON in an answer: all of it, or the first fenced block (```json ... ```).
fn json_of(text: &str) -> Option<Value> {
    if let Ok(v) = serde_json::from_str(text) {
        return Some(v);
    }
    let start = text.find("```")?;
    let rest = &text[start + 3..];
    let rest = rest.strip_prefix("json").unwrap_or(rest);
    let end = rest.find("```")?;
    serde_json::from_str(rest[..end].trim()).ok()
}

/// The judge's request for `item`'s answer `answer`.
fn judge_call(item: &EvalItem, answer: &str, max_tokens: usize) -> ChatCall {
    let Scorer::Judge { rubric, .. } = &item.scorer else {
        unreachable!("only judge items are judged")
    };
    let prompt = item
        .messages
        .iter()
        .rev()
        .find(|m| m["role"] == "user")
        .map(|m| match &m["content"] {
            Value::String(s) => s.clone(),
            other => other.to_string(),
        })
        .unwrap_or_default();
    let text = rubric
        .replace("{prompt}", &prompt)
        .replace("{answer}", answer);
    ChatCall {
        messages: vec![serde_json::json!({"role": "user", "content": text})],
        tools: None,
        tool_choice: None,
        max_tokens: max_tokens.min(16),
    }
}

/// A judge's verdict as a score: its first number over `max`, within [0, 1] (0 without one).
pub fn judge_mark(verdict: &str, max: f64) -> f64 {
    let mut num = String::new();
    for c in verdict.chars() {
        if c.is_ascii_digit() || (c == '.' && !num.is_empty() && !num.contains('.')) {
            num.push(c);
        } else if !num.is_empty() {
            break;
        }
    }
    let n: f64 = num.trim_end_matches('.').parse().unwrap_or(0.0);
    (n / max).clamp(0.0, 1.0)
}

#[cfg(test)]
mod tests;
