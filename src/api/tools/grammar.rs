//! Tool calls under a grammar. `tool_choice: "required"` or a named function constrains the
//! answer to calls in the template's format whose arguments follow each function's JSON Schema
//! (so any model yields a valid call); templates that render no tools get the generic format (a
//! system message describing the tools, and an answer constrained to one JSON object that is a
//! call or a response, as llama.cpp's server does), with the conversation's earlier calls and
//! tool results written back in that format.

use super::ToolFormat;
use crate::engine::constraint::{compact_schema, GrammarError, GrammarSpec};
use crate::model::conversation::{Message, Role, ToolDef};
use serde_json::{json, Value};
use std::collections::HashMap;

/// What `tool_choice` asks for (with tools and a mode other than "none").
#[derive(Clone, Debug, PartialEq)]
pub enum Forced {
    /// The model decides (the generic format still constrains the answer to a call or a
    /// response).
    Auto,
    /// At least one call.
    Required,
    /// Exactly one call of this function.
    Named(String),
    /// No call (`tool_choice: "none"`): in the generic format the answer is a response object,
    /// the conversation rendered as in the turns that could call (so an episode's prompts still
    /// extend each other); templates with tool support render the tools and nothing is parsed.
    None,
}

/// The functions of `defs`: (name, parameters schema).
fn functions(defs: &[ToolDef]) -> Vec<(String, Value)> {
    defs.iter()
        .map(|t| (t.function.name.clone(), t.parameters()))
        .collect()
}

/// The schema of one call object `{"name": <one of the functions>, <args_key>: <its params>}`.
fn call_schema(funcs: &[(String, Value)], forced: &Forced, args_key: &str) -> Value {
    let alts: Vec<Value> = funcs
        .iter()
        .filter(|(n, _)| !matches!(forced, Forced::Named(x) if x != n))
        .map(|(name, params)| {
            json!({
                "type": "object",
                "properties": {"name": {"const": name}, args_key: params},
                "required": ["name", args_key],
                "additionalProperties": false,
            })
        })
        .collect();
    match alts.len() {
        1 => alts.into_iter().next().unwrap_or_default(),
        _ => json!({"anyOf": alts}),
    }
}

/// The grammar a chat answer with tools follows, if any: forced calls in the template's format,
/// or the generic format's call-or-response object (always).
pub fn tool_grammar(
    format: ToolFormat,
    defs: &[ToolDef],
    forced: &Forced,
    parallel: bool,
) -> Result<Option<GrammarSpec>, GrammarError> {
    let funcs = functions(defs);
    let several = parallel && !matches!(forced, Forced::Named(_));
    Ok(match (format, forced) {
        (ToolFormat::Generic, _) => {
            let call = call_schema(&funcs, forced, "arguments");
            let calls = if several {
                json!({
                    "type": "object",
                    "properties": {"tool_calls": {"type": "array", "items": call, "minItems": 1}},
                    "required": ["tool_calls"],
                    "additionalProperties": false,
                })
            } else {
                json!({
                    "type": "object",
                    "properties": {"tool_call": call},
                    "required": ["tool_call"],
                    "additionalProperties": false,
                })
            };
            let response = json!({
                "type": "object",
                "properties": {"response": {"type": "string"}},
                "required": ["response"],
                "additionalProperties": false,
            });
            let schema = match forced {
                Forced::Auto => json!({"anyOf": [calls, response]}),
                Forced::None => response,
                _ => calls,
            };
            Some(GrammarSpec::Json(schema))
        }
        (_, Forced::Auto | Forced::None) => None,
        (ToolFormat::Hermes, _) => {
            let call = compact_schema(&call_schema(&funcs, forced, "arguments"))?;
            let body = if several {
                "call (\"\\n\" call)*"
            } else {
                "call"
            };
            Some(GrammarSpec::Lark(format!(
                "start: {body}\ncall: \"<tool_call>\\n\" %json {call} \"\\n</tool_call>\"\n"
            )))
        }
        // Llama 3's JSON format: one call (the answer is the call).
        (ToolFormat::Llama3Json, _) => {
            Some(GrammarSpec::Json(call_schema(&funcs, forced, "parameters")))
        }
    })
}

/// JSON as the grammar writes it (and as Python's `json.dumps` does): `", "` between items,
/// `": "` after keys, no newlines; so a conversation's earlier answers re-render to the very
/// text that was generated.
pub fn spaced_json(v: &Value) -> String {
    struct Spaced;
    fn item<W: ?Sized + std::io::Write>(w: &mut W, first: bool) -> std::io::Result<()> {
        if first {
            Ok(())
        } else {
            w.write_all(b", ")
        }
    }
    impl serde_json::ser::Formatter for Spaced {
        fn begin_array_value<W: ?Sized + std::io::Write>(
            &mut self,
            w: &mut W,
            first: bool,
        ) -> std::io::Result<()> {
            item(w, first)
        }
        fn begin_object_key<W: ?Sized + std::io::Write>(
            &mut self,
            w: &mut W,
            first: bool,
        ) -> std::io::Result<()> {
            item(w, first)
        }
        fn begin_object_value<W: ?Sized + std::io::Write>(
            &mut self,
            w: &mut W,
        ) -> std::io::Result<()> {
            w.write_all(b": ")
        }
    }
    let mut out = Vec::new();
    let mut ser = serde_json::Serializer::with_formatter(&mut out, Spaced);
    // Serializing a Value to memory cannot fail.
    let _ = serde::Serialize::serialize(v, &mut ser);
    String::from_utf8(out).unwrap_or_default()
}

/// The generic format's conversation: a system message describing the tools and the answer's
/// shape (added to the first system message, or new), assistant calls written as the call
/// object, earlier plain answers as `{"response": ...}`, tool results as user turns
/// `{"tool_response": {"tool": name, "content": ...}}` (templates without tool support know no
/// tool role).
pub fn generic_messages(messages: Vec<Message>, defs: &[ToolDef], parallel: bool) -> Vec<Message> {
    let tools: Vec<Value> = defs
        .iter()
        .map(|t| serde_json::to_value(&t.function).unwrap_or_default())
        .collect();
    let call_shape = if parallel {
        r#"{"tool_calls": [{"name": <tool name>, "arguments": {...}}, ...]}"#
    } else {
        r#"{"tool_call": {"name": <tool name>, "arguments": {...}}}"#
    };
    let guide = format!(
        "You can call these tools:\n{}\n\nRespond with one JSON object: {call_shape} to call \
         tools, or {{\"response\": <your answer>}} to answer the user.",
        spaced_json(&Value::Array(tools))
    );
    let mut out = generic_history(messages, parallel);
    match out.first_mut() {
        Some(first) if first.role == Role::System => {
            let c = first.content.as_deref().unwrap_or("");
            first.content = Some(format!("{c}\n\n{guide}"));
        }
        _ => out.insert(0, Message::text(Role::System, guide)),
    }
    out
}

/// A conversation's tool calls and results as the generic format writes them (calls as the
/// assistant's JSON, results as user turns), for a template that renders neither.
pub fn generic_history(list: Vec<Message>, parallel: bool) -> Vec<Message> {
    let mut names: HashMap<String, String> = HashMap::new();
    let mut out = Vec::with_capacity(list.len() + 1);
    for m in list {
        match m.role {
            Role::Assistant => {
                let answer = match &m.tool_calls {
                    Some(calls) => {
                        let calls: Vec<Value> = calls
                            .iter()
                            .map(|c| {
                                let f = &c.function;
                                if let Some(id) = &c.id {
                                    names.insert(id.clone(), f.name.clone());
                                }
                                json!({"name": f.name, "arguments": f.arguments})
                            })
                            .collect();
                        if parallel {
                            json!({"tool_calls": calls})
                        } else {
                            json!({"tool_call": calls.into_iter().next().unwrap_or_default()})
                        }
                    }
                    None => json!({"response": m.content.as_deref().unwrap_or("")}),
                };
                out.push(Message::text(Role::Assistant, spaced_json(&answer)));
            }
            Role::Tool => {
                let name = m
                    .name
                    .clone()
                    .or_else(|| names.get(m.tool_call_id.as_ref()?).cloned());
                let r = json!({"tool_response": {"tool": name, "content": m.content}});
                out.push(Message::text(Role::User, spaced_json(&r)));
            }
            _ => out.push(m),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn defs() -> Vec<ToolDef> {
        serde_json::from_value(json!([
            {"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}}},
            {"type": "function", "function": {"name": "now"}},
        ]))
        .unwrap()
    }

    #[test]
    fn json_is_written_as_python_writes_it() {
        let v = json!({"a": [1, 2], "b": {"c": "é"}});
        assert_eq!(spaced_json(&v), r#"{"a": [1, 2], "b": {"c": "é"}}"#);
    }

    #[test]
    fn forced_and_generic_grammars() {
        let d = defs();
        assert_eq!(
            tool_grammar(ToolFormat::Hermes, &d, &Forced::Auto, true).unwrap(),
            None
        );
        let Some(GrammarSpec::Lark(g)) =
            tool_grammar(ToolFormat::Hermes, &d, &Forced::Required, true).unwrap()
        else {
            panic!("a Lark grammar")
        };
        assert!(
            g.contains("call (\"\\n\" call)*") && g.contains("\"now\""),
            "{g}"
        );
        let Some(GrammarSpec::Json(s)) = tool_grammar(
            ToolFormat::Llama3Json,
            &d,
            &Forced::Named("add".into()),
            true,
        )
        .unwrap() else {
            panic!("a schema")
        };
        assert_eq!(s["properties"]["name"]["const"], "add");
        assert!(s["properties"]["parameters"].is_object());
        let Some(GrammarSpec::Json(s)) =
            tool_grammar(ToolFormat::Generic, &d, &Forced::Auto, false).unwrap()
        else {
            panic!("a schema")
        };
        assert_eq!(s["anyOf"][1]["required"][0], "response");
        assert!(s["anyOf"][0]["properties"]["tool_call"]["anyOf"].is_array());
    }

    #[test]
    fn generic_conversations_are_rewritten() {
        let msgs: Vec<Message> = serde_json::from_value(json!([
            {"role": "user", "content": "2+3?"},
            {"role": "assistant", "content": null, "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "add", "arguments": {"a": 2}}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "5"},
            {"role": "assistant", "content": "5"},
        ]))
        .unwrap();
        let out = serde_json::to_value(generic_messages(msgs, &defs(), false)).unwrap();
        let out = out.as_array().unwrap();
        assert_eq!(out.len(), 5);
        assert_eq!(out[0]["role"], "system");
        assert!(out[0]["content"]
            .as_str()
            .unwrap()
            .contains("\"name\": \"add\""));
        assert_eq!(
            out[2]["content"],
            r#"{"tool_call": {"name": "add", "arguments": {"a": 2}}}"#
        );
        assert_eq!(out[3]["role"], "user");
        assert_eq!(
            out[3]["content"],
            r#"{"tool_response": {"tool": "add", "content": "5"}}"#
        );
        assert_eq!(out[4]["content"], r#"{"response": "5"}"#);
    }
}
