//! Tool calls out of generated text, in the format the model's chat template taught it (as
//! vLLM's and llama.cpp's parsers read them):
//! - **Hermes** (Qwen2.5, Qwen3, Hermes, SmolLM3): `<tool_call>{"name": ..., "arguments": {...}}
//!   </tool_call>` blocks after optional text;
//! - **Llama 3.x JSON**: the whole answer is `{"name": ..., "parameters": {...}}` (optionally
//!   after `<|python_tag|>`; several separated by `;`);
//! - **generic** (templates that render no tools, as llama.cpp's server does for them): the
//!   answer is one JSON object, `{"tool_call": {"name", "arguments"}}` (or `{"tool_calls":
//!   [...]}` when several are allowed) or `{"response": "..."}`; constrained decoding keeps it
//!   so (see `grammar`).
//!
//! Non-streaming, the final text is split into content and calls. Streaming, `ToolStream` passes
//! text through until a call could be starting, holds it from there, and hands the calls over at
//! the end: the openai SDK assembles `delta.tool_calls` whatever their split.

pub mod grammar;

use serde::Serialize;
use serde_json::Value;

/// How a family writes its tool calls.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ToolFormat {
    Hermes,
    Llama3Json,
    Generic,
}

const HERMES_OPEN: &str = "<tool_call>";
const HERMES_CLOSE: &str = "</tool_call>";
const PYTHON_TAG: &str = "<|python_tag|>";

impl ToolFormat {
    /// The format a chat template teaches, when it renders tools at all (None: it does not).
    pub fn of_template(template: &str) -> Option<ToolFormat> {
        if !template.contains("tools") {
            return None;
        }
        if template.contains(HERMES_OPEN) {
            Some(ToolFormat::Hermes)
        } else if template.contains("\"parameters\"") || template.contains(PYTHON_TAG) {
            Some(ToolFormat::Llama3Json)
        } else {
            None
        }
    }
}

/// A chat request's tools: the format its answer's calls are parsed in, whether several may be
/// returned (`parallel_tool_calls`, default true), and whether they came as the legacy
/// `functions` (then the answer is OpenAI's legacy `function_call`, one call).
#[derive(Clone, Copy, Debug)]
pub struct ToolMode {
    pub format: ToolFormat,
    pub parallel: bool,
    pub legacy: bool,
}

impl ToolMode {
    /// The calls this mode returns: one unless parallel (and legacy `function_call` is one).
    pub fn keep(&self, calls: &mut Vec<ToolCall>) {
        if !self.parallel || self.legacy {
            calls.truncate(1);
        }
    }

    /// The finish reason of an answer that is calls.
    pub fn finish_reason(&self) -> &'static str {
        if self.legacy {
            "function_call"
        } else {
            "tool_calls"
        }
    }
}

/// One parsed call, as OpenAI's `tool_calls` entries.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ToolCall {
    pub id: String,
    #[serde(rename = "type")]
    pub kind: &'static str,
    pub function: FunctionCall,
}

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct FunctionCall {
    pub name: String,
    /// The arguments as a JSON string (OpenAI's shape).
    pub arguments: String,
}

/// A call's delta in a stream chunk (`index` numbers the calls of a choice).
#[derive(Clone, Debug, Serialize)]
pub struct ToolCallDelta {
    pub index: usize,
    pub id: String,
    #[serde(rename = "type")]
    pub kind: &'static str,
    pub function: FunctionCall,
}

/// Split `text` into content and calls; `None` when it holds no well-formed call (then it is
/// all content; a generic answer's `response` is its content, with no calls). `new_id` names
/// each call.
pub fn parse(
    format: ToolFormat,
    text: &str,
    mut new_id: impl FnMut() -> String,
) -> Option<(String, Vec<ToolCall>)> {
    let (content, calls) = match format {
        ToolFormat::Hermes => {
            let start = text.find(HERMES_OPEN)?;
            let mut calls = Vec::new();
            let mut rest = &text[start..];
            while let Some(open) = rest.find(HERMES_OPEN) {
                let body_start = open + HERMES_OPEN.len();
                let (body, next) = match rest[body_start..].find(HERMES_CLOSE) {
                    Some(end) => (
                        &rest[body_start..body_start + end],
                        &rest[body_start + end + HERMES_CLOSE.len()..],
                    ),
                    // The last call may end the answer unclosed (a stop string, EOS): it counts
                    // when its JSON is whole; a call cut off mid-JSON is no call.
                    None => (&rest[body_start..], ""),
                };
                calls.push(call_of(body, "arguments")?);
                rest = next;
            }
            (text[..start].trim().to_string(), calls)
        }
        ToolFormat::Llama3Json => {
            let t = text.trim_start();
            let mut rest = t.strip_prefix(PYTHON_TAG).unwrap_or(t).trim();
            if !rest.starts_with('{') {
                return None;
            }
            let mut calls = Vec::new();
            // JSON objects separated by ';' (a ';' inside a string is the string's).
            while !rest.is_empty() {
                let mut de = serde_json::Deserializer::from_str(rest).into_iter::<Value>();
                let v = de.next()?.ok()?;
                calls.push(call_of_value(&v, "parameters")?);
                rest = rest[de.byte_offset()..].trim_start();
                if let Some(r) = rest.strip_prefix(';') {
                    rest = r.trim_start();
                } else if !rest.is_empty() {
                    return None;
                }
            }
            (String::new(), calls)
        }
        ToolFormat::Generic => {
            let v: Value = serde_json::from_str(text.trim()).ok()?;
            if let Some(r) = v.get("response").and_then(Value::as_str) {
                return Some((r.to_string(), Vec::new()));
            }
            let list = match (v.get("tool_call"), v.get("tool_calls")) {
                (Some(c), None) => vec![c.clone()],
                (None, Some(Value::Array(l))) => l.clone(),
                _ => return None,
            };
            let calls = list
                .iter()
                .map(|c| call_of_value(c, "arguments"))
                .collect::<Option<Vec<_>>>()?;
            (String::new(), calls)
        }
    };
    if calls.is_empty() {
        return None;
    }
    Some((content, name_calls(calls, &mut new_id)))
}

fn name_calls(calls: Vec<(String, String)>, new_id: &mut impl FnMut() -> String) -> Vec<ToolCall> {
    calls
        .into_iter()
        .map(|(name, arguments)| ToolCall {
            id: new_id(),
            kind: "function",
            function: FunctionCall { name, arguments },
        })
        .collect()
}

fn call_of(body: &str, args_key: &str) -> Option<(String, String)> {
    let v: Value = serde_json::from_str(body.trim()).ok()?;
    call_of_value(&v, args_key)
}

/// (name, arguments as a JSON string) of `{"name": ..., "<args_key>": {...}}` (either key
/// accepted for the arguments).
fn call_of_value(v: &Value, args_key: &str) -> Option<(String, String)> {
    let name = v.get("name")?.as_str()?.to_string();
    let args = v
        .get(args_key)
        .or_else(|| v.get("arguments"))
        .or_else(|| v.get("parameters"))
        .cloned()
        .unwrap_or(Value::Object(Default::default()));
    let args = match args {
        Value::String(s) => s,
        other => other.to_string(),
    };
    Some((name, args))
}

/// A choice's text as it streams: content passes through until a call may be starting, which
/// is held (with the rest of the answer) for `finish`.
#[derive(Default)]
pub struct ToolStream {
    /// Text not yet passed on.
    held: String,
    /// A call has (possibly) started: everything from there is held.
    in_call: bool,
    /// Some text was passed on already (a Llama 3 JSON call must start the answer).
    started: bool,
}

impl ToolStream {
    /// Take new text; return what can be passed on as content now.
    pub fn push(&mut self, format: ToolFormat, text: &str) -> String {
        self.held.push_str(text);
        if self.in_call {
            return String::new();
        }
        match format {
            ToolFormat::Hermes => match self.held.find(HERMES_OPEN) {
                Some(i) => {
                    self.in_call = true;
                    let out: String = self.held.drain(..i).collect();
                    self.started |= !out.is_empty();
                    out
                }
                None => {
                    // Hold a suffix that could begin the marker.
                    let keep = (1..HERMES_OPEN.len())
                        .rev()
                        .find(|&k| {
                            self.held.len() >= k
                                && self.held.is_char_boundary(self.held.len() - k)
                                && HERMES_OPEN.starts_with(&self.held[self.held.len() - k..])
                        })
                        .unwrap_or(0);
                    let cut = self.held.len() - keep;
                    let out: String = self.held.drain(..cut).collect();
                    self.started |= !out.is_empty();
                    out
                }
            },
            // The whole answer is one JSON object: held to the end.
            ToolFormat::Generic => {
                self.in_call = true;
                String::new()
            }
            ToolFormat::Llama3Json => {
                if self.started {
                    return std::mem::take(&mut self.held);
                }
                let t = self.held.trim_start();
                if t.is_empty() {
                    return String::new();
                }
                let could_be_call =
                    t.starts_with('{') || PYTHON_TAG.starts_with(t) || t.starts_with(PYTHON_TAG);
                if could_be_call {
                    self.in_call = true;
                    String::new()
                } else {
                    self.started = true;
                    std::mem::take(&mut self.held)
                }
            }
        }
    }

    /// At the end: the calls (if what was held holds well-formed ones) and the rest of the
    /// content.
    pub fn finish(
        &mut self,
        format: ToolFormat,
        new_id: impl FnMut() -> String,
    ) -> (String, Vec<ToolCall>) {
        let held = std::mem::take(&mut self.held);
        match parse(format, &held, new_id) {
            Some((content, calls)) => (content, calls),
            None => (held, Vec::new()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ids() -> impl FnMut() -> String {
        let mut n = 0;
        move || {
            n += 1;
            format!("call_{n}")
        }
    }

    #[test]
    fn hermes_calls_are_split_from_their_text() {
        let text = "Let me add.\n<tool_call>\n{\"name\": \"add\", \"arguments\": {\"a\": 2, \"b\": 3}}\n</tool_call>\n<tool_call>\n{\"name\": \"now\", \"arguments\": {}}\n</tool_call>";
        let (content, calls) = parse(ToolFormat::Hermes, text, ids()).unwrap();
        assert_eq!(content, "Let me add.");
        assert_eq!(calls.len(), 2);
        assert_eq!(calls[0].function.name, "add");
        assert_eq!(calls[0].function.arguments, r#"{"a":2,"b":3}"#);
        assert_eq!(calls[0].id, "call_1");
        assert_eq!(calls[1].function.arguments, "{}");
        // Unclosed at the end (stopped by a stop string or EOS), but whole: a call.
        let (_, calls) = parse(
            ToolFormat::Hermes,
            "<tool_call>\n{\"name\": \"add\", \"arguments\": {\"a\": 1}}\n",
            ids(),
        )
        .unwrap();
        assert_eq!(calls[0].function.arguments, r#"{"a":1}"#);
        // Cut off, malformed or absent: no calls.
        for t in [
            "plain answer",
            "<tool_call>\n{\"name\": \"add\", \"argu",
            "<tool_call>\n{\"name\": \"add\"}\n</tool_call> and <tool_call>{\"na",
            "<tool_call>not json</tool_call>",
            "<tool_call>{\"arguments\": {}}</tool_call>",
        ] {
            assert!(parse(ToolFormat::Hermes, t, ids()).is_none(), "{t}");
        }
    }

    #[test]
    fn llama3_json_calls_are_the_whole_answer() {
        let (c, calls) = parse(
            ToolFormat::Llama3Json,
            " {\"name\": \"add\", \"parameters\": {\"a\": 1}}",
            ids(),
        )
        .unwrap();
        assert_eq!(c, "");
        assert_eq!(calls[0].function.arguments, r#"{"a":1}"#);
        let (_, calls) = parse(
            ToolFormat::Llama3Json,
            "<|python_tag|>{\"name\": \"a\", \"parameters\": {}}; {\"name\": \"b\", \"parameters\": {\"x\": \"y\"}}",
            ids(),
        )
        .unwrap();
        assert_eq!(
            calls
                .iter()
                .map(|c| c.function.name.as_str())
                .collect::<Vec<_>>(),
            ["a", "b"]
        );
        for t in [
            "The answer is {x}",
            "{\"name\": 3}",
            "{\"name\": \"a\"} trailing",
        ] {
            assert!(parse(ToolFormat::Llama3Json, t, ids()).is_none(), "{t}");
        }
    }

    #[test]
    fn generic_answers_are_a_call_or_a_response() {
        let (c, calls) = parse(
            ToolFormat::Generic,
            r#"{"tool_call": {"name": "add", "arguments": {"a": 1}}}"#,
            ids(),
        )
        .unwrap();
        assert_eq!((c.as_str(), calls.len()), ("", 1));
        assert_eq!(calls[0].function.arguments, r#"{"a":1}"#);
        let (_, calls) = parse(
            ToolFormat::Generic,
            r#"{"tool_calls": [{"name": "a", "arguments": {}}, {"name": "b", "arguments": {}}]}"#,
            ids(),
        )
        .unwrap();
        assert_eq!(calls.len(), 2);
        let (c, calls) = parse(ToolFormat::Generic, r#"{"response": "It is 4."}"#, ids()).unwrap();
        assert_eq!((c.as_str(), calls.len()), ("It is 4.", 0));
        for t in [
            "4",
            r#"{"tool_call": {"arguments": {}}}"#,
            r#"{"other": 1}"#,
            "{\"response\"",
        ] {
            assert!(parse(ToolFormat::Generic, t, ids()).is_none(), "{t}");
        }
    }

    #[test]
    fn streamed_text_is_passed_on_until_a_call_may_start() {
        let text =
            "Sure. <tool_call>\n{\"name\": \"add\", \"arguments\": {\"a\": 1}}\n</tool_call>";
        // Any split of the text gives the same content and call.
        for step in [1, 2, 3, 5, 7, 64] {
            let mut s = ToolStream::default();
            let mut passed = String::new();
            let chars: Vec<char> = text.chars().collect();
            for piece in chars.chunks(step) {
                let piece: String = piece.iter().collect();
                passed.push_str(&s.push(ToolFormat::Hermes, &piece));
                assert!(!passed.contains('<'), "{step}: {passed}");
            }
            let (rest, calls) = s.finish(ToolFormat::Hermes, ids());
            assert_eq!(passed, "Sure. ", "{step}");
            assert_eq!(rest, "");
            assert_eq!(calls.len(), 1, "{step}");
        }
        // Text that only looks like the start of a marker is passed on in the end.
        let mut s = ToolStream::default();
        let mut passed = s.push(ToolFormat::Hermes, "a <tool");
        passed.push_str(&s.push(ToolFormat::Hermes, "box> b"));
        let (rest, calls) = s.finish(ToolFormat::Hermes, ids());
        assert!(calls.is_empty());
        assert_eq!(passed + &rest, "a <toolbox> b");
        // Llama 3: prose streams at once; a leading brace is held.
        let mut s = ToolStream::default();
        assert_eq!(s.push(ToolFormat::Llama3Json, "Hello"), "Hello");
        let mut s = ToolStream::default();
        assert_eq!(s.push(ToolFormat::Llama3Json, " {\"name\""), "");
        s.push(ToolFormat::Llama3Json, ": \"f\", \"parameters\": {}}");
        let (_, calls) = s.finish(ToolFormat::Llama3Json, ids());
        assert_eq!(calls[0].function.name, "f");
    }
}
