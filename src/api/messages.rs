//! A chat request's conversation as its template reads it: `messages` (with tool calls and tool
//! results) and the tool definitions, checked field by field; and how the answer's tool calls
//! are to be read (`tool_choice`, `parallel_tool_calls`, the template's call format); how the
//! template renders them (the request's template, its variables, `continue_final_message`).

use super::error::ApiError;
use super::openai::{type_error, Fields};
use super::reasoning;
use super::structured::Structured;
use super::tools::grammar::{generic_history, generic_messages, tool_grammar, Forced};
use super::tools::{ToolFormat, ToolMode};
use crate::model::conversation::{
    Call, CallFunction, FunctionDef, FunctionKind, Message, Role, ToolDef,
};
use crate::model::tokenizer::{ChatRender, Tokenizer};
use serde_json::{Map, Value};

/// A chat request's conversation, validated: its messages, its tools and how they are rendered,
/// and what its template does with them. Chat (and so the Responses API) and `/tokenize` read
/// messages through it, so both render the same prompt.
pub struct Conversation {
    pub messages: Vec<Message>,
    pub tools: Option<RequestTools>,
    pub render: ChatRender,
    /// Whether the template renders tools itself (else earlier calls and results are written in
    /// the generic format).
    renders_tools: bool,
    /// Whether the template writes a reasoning block.
    pub reasons: bool,
}

impl Conversation {
    /// The request's conversation on a model whose own chat template is `model_template` (the
    /// request's `chat_template` wins): `chat_template*`, `messages`, `tools`, `tool_choice`.
    pub fn parse(f: &Fields, model_template: Option<&str>) -> Result<Conversation, ApiError> {
        let render = parse_chat_render(f)?;
        let messages = parse_messages(f)?;
        // The template (the request's, else the model's) renders the tools and teaches the
        // calls' format (else the generic format).
        let template = render.template.as_deref().or(model_template);
        let tools = request_tools(f, template)?;
        Ok(Conversation {
            renders_tools: template.and_then(ToolFormat::of_template).is_some(),
            reasons: template.is_some_and(reasoning::template_reasons),
            messages,
            tools,
            render,
        })
    }

    /// How the answer's tool calls are read (None: not at all).
    pub fn tool_mode(&self) -> Option<ToolMode> {
        self.tools.as_ref().and_then(|t| t.mode)
    }

    /// The grammar the tools impose on the answer (forced calls, the generic format).
    pub fn tool_grammar(&self) -> Result<Option<Structured>, ApiError> {
        match &self.tools {
            Some(t) => t.grammar(),
            None => Ok(None),
        }
    }

    /// What the template is handed: the generic format rewrites the conversation (and hands the
    /// template no tools); a conversation with tool traffic but no tools is written in it when
    /// the template renders no tools.
    pub fn into_inputs(self) -> ChatInputs {
        let (messages, tools) = match self.tools {
            Some(t) => t.render_inputs(self.messages),
            None if self.renders_tools => (self.messages, None),
            None => (history_without_tools(self.messages), None),
        };
        ChatInputs {
            messages,
            tools,
            render: self.render,
        }
    }
}

/// A conversation as its template renders it.
pub struct ChatInputs {
    pub messages: Vec<Message>,
    pub tools: Option<Vec<ToolDef>>,
    pub render: ChatRender,
}

impl ChatInputs {
    /// The prompt's text; a template's error is a 400 naming the request's template when it sent
    /// one, else `messages`.
    pub fn render(&self, tok: &Tokenizer) -> Result<String, ApiError> {
        tok.render_chat_with(&self.messages, self.tools.as_deref(), &self.render)
            .map_err(|e| {
                let param = if self.render.template.is_some() {
                    "chat_template"
                } else {
                    "messages"
                };
                ApiError::invalid(param, e.to_string())
            })
    }
}

/// `messages` as the chat template reads them: roles system (developer is read as system), user,
/// assistant, tool; content a string, a list of text parts (joined) or, for an assistant turn
/// with tool calls, null; assistant `tool_calls` (each `{id?, type: "function", function: {name,
/// arguments}}`, string arguments parsed as JSON as vLLM does, since templates print them with
/// `tojson`); a tool result's `tool_call_id` and `name`; an assistant turn's `reasoning_content`
/// (reasoning models' templates read it). Other fields are dropped.
fn parse_messages(f: &Fields) -> Result<Vec<Message>, ApiError> {
    let list = f
        .get("messages")
        .ok_or_else(|| ApiError::invalid("messages", "'messages' is required"))?
        .as_array()
        .ok_or_else(|| type_error("messages", "a list of messages"))?;
    if list.is_empty() {
        return Err(ApiError::invalid("messages", "'messages' is empty"));
    }
    list.iter()
        .enumerate()
        .map(|(i, m)| parse_message(i, m))
        .collect()
}

fn parse_message(i: usize, m: &Value) -> Result<Message, ApiError> {
    let bad = |what: &str| ApiError::invalid(&format!("messages[{i}]"), what.to_string());
    let o = m
        .as_object()
        .ok_or_else(|| bad("a message must be an object"))?;
    let role_name = o
        .get("role")
        .and_then(Value::as_str)
        .ok_or_else(|| bad("'role' must be a string"))?;
    let role = Role::parse(role_name).ok_or_else(|| bad(&format!("unknown role '{role_name}'")))?;
    let content = match o.get("content") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) => Some(s.clone()),
        Some(Value::Array(parts)) => {
            let mut text = String::new();
            for p in parts {
                match (
                    p.get("type").and_then(Value::as_str),
                    p.get("text").and_then(Value::as_str),
                ) {
                    (Some("text"), Some(t)) => text.push_str(t),
                    _ => return Err(bad("only text content parts are supported")),
                }
            }
            Some(text)
        }
        Some(_) => return Err(bad("'content' must be a string or a list of parts")),
    };
    let calls = o.get("tool_calls").filter(|v| !v.is_null());
    let tool_calls = match calls {
        None => None,
        Some(_) if role != Role::Assistant => {
            return Err(bad("only assistant messages carry 'tool_calls'"))
        }
        Some(calls) => {
            let list = calls
                .as_array()
                .ok_or_else(|| bad("'tool_calls' must be a list"))?;
            let mut parsed = Vec::with_capacity(list.len());
            for c in list {
                parsed.push(parse_call(c).map_err(bad)?);
            }
            Some(parsed)
        }
    };
    let text_field = |k: &str| match o.get(k) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(_) => Err(bad(&format!("'{k}' must be a string"))),
    };
    Ok(Message {
        role,
        // A missing content is an empty string, except beside tool calls (templates test for
        // it).
        content: match (content, &tool_calls) {
            (None, None) => Some(String::new()),
            (c, _) => c,
        },
        tool_calls,
        tool_call_id: text_field("tool_call_id")?,
        name: text_field("name")?,
        reasoning_content: text_field("reasoning_content")?,
    })
}

/// One of an assistant message's `tool_calls`; the error says what is wrong with it.
fn parse_call(c: &Value) -> Result<Call, &'static str> {
    let func = c
        .get("function")
        .and_then(Value::as_object)
        .ok_or("each tool call needs a 'function' object")?;
    let name = func
        .get("name")
        .and_then(Value::as_str)
        .ok_or("each tool call needs 'function.name'")?;
    let arguments = match func.get("arguments") {
        None | Some(Value::Null) => Value::Object(Map::new()),
        Some(Value::String(s)) => serde_json::from_str::<Value>(s)
            .ok()
            .filter(Value::is_object)
            .unwrap_or_else(|| Value::String(s.clone())),
        Some(v @ Value::Object(_)) => v.clone(),
        Some(_) => return Err("'function.arguments' must be a JSON string"),
    };
    Ok(Call {
        id: c.get("id").and_then(Value::as_str).map(str::to_string),
        kind: FunctionKind::Function,
        function: CallFunction {
            name: name.to_string(),
            arguments,
        },
    })
}

/// The tool definitions (`tools`, or the legacy `functions`) as the chat template reads them:
/// `[{"type": "function", "function": {"name", "description"?, "parameters"?}}]`.
fn parse_tools(f: &Fields) -> Result<Option<Vec<ToolDef>>, ApiError> {
    let (name, list, legacy) = match (f.get("tools"), f.get("functions")) {
        (Some(_), Some(_)) => {
            return Err(ApiError::invalid(
                "functions",
                "give 'tools' or the legacy 'functions', not both",
            ))
        }
        (Some(t), None) => ("tools", t, false),
        (None, Some(t)) => ("functions", t, true),
        (None, None) => return Ok(None),
    };
    let list = list
        .as_array()
        .ok_or_else(|| type_error(name, "a list of tools"))?;
    let mut out = Vec::with_capacity(list.len());
    for (i, t) in list.iter().enumerate() {
        let bad = |what: &str| ApiError::invalid(&format!("{name}[{i}]"), what.to_string());
        let func = if legacy {
            t
        } else {
            match t.get("type").and_then(Value::as_str) {
                Some("function") => {}
                _ => return Err(bad("only tools of type 'function' are supported")),
            }
            t.get("function")
                .ok_or_else(|| bad("a tool needs a 'function' object"))?
        };
        let o = func
            .as_object()
            .ok_or_else(|| bad("a function must be an object"))?;
        let fname = o
            .get("name")
            .and_then(Value::as_str)
            .filter(|n| !n.is_empty() && n.len() <= 64)
            .ok_or_else(|| bad("a function needs a 'name' of 1 to 64 characters"))?;
        let description = match o.get("description") {
            None | Some(Value::Null) => None,
            Some(Value::String(d)) => Some(d.clone()),
            Some(_) => return Err(bad("'description' must be a string")),
        };
        let parameters = match o.get("parameters") {
            None | Some(Value::Null) => None,
            Some(p @ Value::Object(_)) => Some(p.clone()),
            Some(_) => return Err(bad("'parameters' must be a JSON Schema object")),
        };
        out.push(ToolDef {
            kind: FunctionKind::Function,
            function: FunctionDef {
                name: fname.to_string(),
                description,
                parameters,
                strict: o.get("strict").filter(|v| !v.is_null()).cloned(),
            },
        });
    }
    Ok(Some(out))
}

/// A request's tools: their definitions, how the answer's calls are read (None with
/// `tool_choice: "none"`), and what `tool_choice` forces.
pub struct RequestTools {
    pub defs: Vec<ToolDef>,
    pub mode: Option<ToolMode>,
    pub forced: Forced,
}

impl RequestTools {
    /// The conversation and tool definitions the template renders: the generic format rewrites
    /// the conversation (with "none" too) and hands the template no tools.
    fn render_inputs(&self, messages: Vec<Message>) -> (Vec<Message>, Option<Vec<ToolDef>>) {
        match self.mode {
            Some(m) if m.format == ToolFormat::Generic => {
                (generic_messages(messages, &self.defs, m.parallel), None)
            }
            _ => (messages, Some(self.defs.clone())),
        }
    }

    /// The grammar the answer follows (forced calls, or the generic format).
    pub fn grammar(&self) -> Result<Option<Structured>, ApiError> {
        let Some(m) = self.mode else { return Ok(None) };
        let field = if m.legacy { "functions" } else { "tools" };
        let spec = tool_grammar(m.format, &self.defs, &self.forced, m.parallel)
            .map_err(|e| ApiError::invalid(field, e.to_string()))?;
        Ok(spec.map(|spec| Structured {
            field: field.into(),
            spec,
        }))
    }
}

/// A conversation with tool calls or results but no `tools` in the request (a follow-up turn
/// that does not resend them) for a template that renders no tools: the history written as the
/// generic format writes it, so the template sees only text.
fn history_without_tools(messages: Vec<Message>) -> Vec<Message> {
    if !messages.iter().any(Message::is_tool_traffic) {
        return messages;
    }
    // Parallel calls are written as a list (the generic format's answer when it allows several).
    generic_history(messages, true)
}

/// The request's `tools` (or legacy `functions`) on a model with chat template `template`: calls
/// in the template's own format, or the generic format when it renders no tools.
fn request_tools(f: &Fields, template: Option<&str>) -> Result<Option<RequestTools>, ApiError> {
    let defs = parse_tools(f)?;
    let forced = parse_tool_choice(f, defs.as_deref())?;
    let Some(defs) = defs else {
        return Ok(None);
    };
    let legacy = f.get("functions").is_some();
    let format = template
        .and_then(ToolFormat::of_template)
        .unwrap_or(ToolFormat::Generic);
    // "none" leaves a template with tool support to render the tools and parses nothing; the
    // generic format keeps its conversation and constrains the answer to a response.
    let mode = (forced.is_some() || format == ToolFormat::Generic).then_some(ToolMode {
        format,
        // Several calls by default (OpenAI's default), except in the generic format: there
        // (SmolLM2 at temperature 0 repeated one call in the list until max_tokens), as in
        // llama.cpp's server, only when asked.
        parallel: f
            .bool("parallel_tool_calls")
            .ok()
            .flatten()
            .unwrap_or(format != ToolFormat::Generic),
        legacy,
    });
    Ok(Some(RequestTools {
        defs,
        mode,
        forced: forced.unwrap_or(Forced::None),
    }))
}

/// `tool_choice` (`function_call`, legacy): "none" (None), "auto" (the default), "required", or
/// a named function (`{"type": "function", "function": {"name"}}`; legacy `{"name"}`) that must
/// be one of the tools. `parallel_tool_calls` must be a boolean.
fn parse_tool_choice(f: &Fields, defs: Option<&[ToolDef]>) -> Result<Option<Forced>, ApiError> {
    f.bool("parallel_tool_calls")?;
    let mut forced = Some(Forced::Auto);
    for name in ["tool_choice", "function_call"] {
        let Some(v) = f.get(name) else { continue };
        let bad = || {
            ApiError::invalid(
                name,
                format!("'{name}' must be \"none\", \"auto\", \"required\" or a named function"),
            )
        };
        forced = match v {
            Value::String(s) => match s.as_str() {
                "none" => None,
                "auto" => Some(Forced::Auto),
                "required" if name == "tool_choice" => Some(Forced::Required),
                _ => return Err(bad()),
            },
            Value::Object(o) => {
                let fname = o
                    .get("function")
                    .and_then(|x| x.get("name"))
                    .or_else(|| o.get("name"))
                    .and_then(Value::as_str)
                    .ok_or_else(bad)?;
                let known = defs.into_iter().flatten().any(|t| t.function.name == fname);
                if !known {
                    return Err(ApiError::invalid(
                        name,
                        format!("'{name}' names function '{fname}', which is not among the tools"),
                    ));
                }
                Some(Forced::Named(fname.to_string()))
            }
            _ => return Err(bad()),
        };
        if defs.is_none() && forced.is_some() {
            return Err(ApiError::invalid(name, format!("'{name}' needs 'tools'")));
        }
    }
    Ok(forced)
}

/// Variables the template is always given; `chat_template_kwargs` may not replace them.
const TEMPLATE_VARIABLES: [&str; 5] = [
    "messages",
    "tools",
    "add_generation_prompt",
    "bos_token",
    "eos_token",
];

/// How a chat request (or a `/tokenize` of messages) renders its conversation: vLLM's
/// `chat_template` (the template's text), `chat_template_kwargs` (extra variables, e.g.
/// `enable_thinking`), `add_generation_prompt` (default true) and `continue_final_message`
/// (default false; not with `add_generation_prompt`, as in vLLM). Chat's `echo` is refused.
fn parse_chat_render(f: &Fields) -> Result<ChatRender, ApiError> {
    if let Some(v) = f.get("echo").filter(|v| **v != Value::Bool(false)) {
        return Err(ApiError::invalid(
            "echo",
            format!("'echo' = {v} is not supported on chat by this server"),
        ));
    }
    let template = match f.str("chat_template")? {
        Some("") => {
            return Err(ApiError::invalid(
                "chat_template",
                "'chat_template' is empty",
            ))
        }
        t => t.map(str::to_string),
    };
    let kwargs = match f.get("chat_template_kwargs") {
        None => None,
        Some(Value::Object(o)) => {
            if let Some(k) = o.keys().find(|k| TEMPLATE_VARIABLES.contains(&k.as_str())) {
                return Err(ApiError::invalid(
                    "chat_template_kwargs",
                    format!("'chat_template_kwargs' may not set '{k}'"),
                ));
            }
            Some(o.clone())
        }
        Some(_) => return Err(type_error("chat_template_kwargs", "an object")),
    };
    let continue_final_message = f.bool("continue_final_message")?.unwrap_or(false);
    let add_generation_prompt = f.bool("add_generation_prompt")?.unwrap_or(true);
    if continue_final_message && add_generation_prompt {
        return Err(ApiError::invalid(
            "continue_final_message",
            "'continue_final_message' and 'add_generation_prompt' cannot both be true (set \
             add_generation_prompt: false to continue the final message)",
        ));
    }
    Ok(ChatRender {
        template,
        add_generation_prompt,
        continue_final_message,
        kwargs,
    })
}
