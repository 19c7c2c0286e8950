//! `POST /v1/responses` (OpenAI's Responses API, the Agents SDK's default), `GET
//! /v1/responses/{id}`: a request's input items (text, messages, function calls and their
//! outputs, after `previous_response_id`'s stored conversation), `instructions`, function tools
//! and `text.format` become one chat request through the same pipeline (templates, grammars,
//! learning adapters: a turn through one is logged under the response's id and rewardable like
//! a chat turn); its answer becomes output items (reasoning, message, function calls), streamed
//! as the Responses events when asked. Stored responses live in memory (the newest
//! `response_store::STORE_CAPACITY`), readable only with the key that made them.

use super::body::JsonBody;
use super::error::ApiError;
use super::openai::{type_error, Fields};
use super::response_store::{Stored, STORE_CAPACITY};
use super::state::AppState;
use crate::util::{random_id, unix_now};
use axum::extract::{Path, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::{json, Map, Value};

/// Responses fields this server does not implement: a 400 naming them unless neutral.
fn refuse_unimplemented(f: &Fields) -> Result<(), ApiError> {
    let refuse = |name: &str, v: &Value| {
        Err(ApiError::invalid(
            name,
            format!("'{name}' = {v} is not supported by this server"),
        ))
    };
    for (name, ok) in [
        (
            "background",
            &(|v: &Value| *v == json!(false)) as &dyn Fn(&Value) -> bool,
        ),
        ("conversation", &|_: &Value| false),
        ("prompt", &|_: &Value| false),
        ("max_tool_calls", &|_: &Value| false),
        ("truncation", &|v: &Value| v == "disabled"),
        ("include", &|v: &Value| {
            v.as_array().is_some_and(Vec::is_empty)
        }),
        ("top_logprobs", &|v: &Value| *v == json!(0)),
        ("service_tier", &|v: &Value| v == "auto" || v == "default"),
        ("reasoning", &|v: &Value| {
            v.as_object()
                .is_some_and(|o| o.values().all(Value::is_null))
        }),
    ] {
        if let Some(v) = f.get(name).filter(|v| !ok(v)) {
            return refuse(name, v);
        }
    }
    Ok(())
}

/// A message item's content as chat's: a string, or the text of its `input_text` /
/// `output_text` parts.
fn message_text(i: usize, content: &Value) -> Result<String, ApiError> {
    let bad = |what: &str| ApiError::invalid(&format!("input[{i}]"), what.to_string());
    match content {
        Value::String(s) => Ok(s.clone()),
        Value::Array(parts) => {
            let mut text = String::new();
            for p in parts {
                match (
                    p.get("type").and_then(Value::as_str),
                    p.get("text").and_then(Value::as_str),
                ) {
                    (Some("input_text" | "output_text" | "text"), Some(t)) => text.push_str(t),
                    (Some("refusal"), _) => {}
                    _ => return Err(bad("only text content parts are supported")),
                }
            }
            Ok(text)
        }
        _ => Err(bad("'content' must be a string or a list of parts")),
    }
}

/// Conversation items as chat messages: messages, function calls (assistant tool calls, the
/// calls of one turn together) and their outputs (tool messages). Reasoning items are the
/// model's own past thinking: not shown to the template again (as OpenAI drops them).
fn items_to_messages(items: &[Value]) -> Result<Vec<Value>, ApiError> {
    let mut out: Vec<Value> = Vec::new();
    for (i, it) in items.iter().enumerate() {
        let bad = |what: &str| ApiError::invalid(&format!("input[{i}]"), what.to_string());
        let kind = it.get("type").and_then(Value::as_str).unwrap_or("message");
        match kind {
            "message" => {
                let role = it
                    .get("role")
                    .and_then(Value::as_str)
                    .ok_or_else(|| bad("a message needs a 'role'"))?;
                let text = message_text(i, it.get("content").unwrap_or(&Value::Null))?;
                out.push(json!({"role": role, "content": text}));
            }
            "function_call" => {
                let (Some(call_id), Some(name)) = (
                    it.get("call_id").and_then(Value::as_str),
                    it.get("name").and_then(Value::as_str),
                ) else {
                    return Err(bad("a function_call needs 'call_id' and 'name'"));
                };
                let args = it.get("arguments").and_then(Value::as_str).unwrap_or("{}");
                let call = json!({"id": call_id, "type": "function",
                                  "function": {"name": name, "arguments": args}});
                // Calls of one turn: one assistant message.
                match out.last_mut() {
                    Some(m) if m["role"] == "assistant" && m["tool_calls"].is_array() => {
                        m["tool_calls"].as_array_mut().expect("array").push(call)
                    }
                    _ => out.push(json!({"role": "assistant", "content": null,
                                         "tool_calls": [call]})),
                }
            }
            "function_call_output" => {
                let call_id = it
                    .get("call_id")
                    .and_then(Value::as_str)
                    .ok_or_else(|| bad("a function_call_output needs 'call_id'"))?;
                let output = match it.get("output") {
                    Some(Value::String(s)) => s.clone(),
                    Some(v @ Value::Array(_)) => message_text(i, v)?,
                    _ => return Err(bad("'output' must be a string")),
                };
                out.push(json!({"role": "tool", "tool_call_id": call_id, "content": output}));
            }
            "reasoning" => {}
            other => {
                return Err(bad(&format!(
                    "input items of type '{other}' are not supported"
                )))
            }
        }
    }
    Ok(out)
}

/// The request's `input`: a string (one user message) or a list of items.
fn input_items(f: &Fields) -> Result<Vec<Value>, ApiError> {
    match f.get("input") {
        None => Err(ApiError::invalid("input", "'input' is required")),
        Some(Value::String(s)) => Ok(vec![
            json!({"type": "message", "role": "user", "content": s}),
        ]),
        Some(Value::Array(a)) if !a.is_empty() => Ok(a.clone()),
        Some(Value::Array(_)) => Err(ApiError::invalid("input", "'input' is empty")),
        Some(_) => Err(type_error("input", "a string or a list of items")),
    }
}

/// Function tools (flat in the Responses API) as chat's; other tool types are refused.
fn chat_tools(f: &Fields) -> Result<Option<Value>, ApiError> {
    let Some(v) = f.get("tools") else {
        return Ok(None);
    };
    let list = v
        .as_array()
        .ok_or_else(|| type_error("tools", "a list of tools"))?;
    let mut out = Vec::with_capacity(list.len());
    for (i, t) in list.iter().enumerate() {
        if t.get("type").and_then(Value::as_str) != Some("function") {
            return Err(ApiError::invalid(
                &format!("tools[{i}]"),
                "only tools of type 'function' are supported",
            ));
        }
        let mut func = Map::new();
        for k in ["name", "description", "parameters", "strict"] {
            if let Some(x) = t.get(k).filter(|x| !x.is_null()) {
                func.insert(k.into(), x.clone());
            }
        }
        out.push(json!({"type": "function", "function": func}));
    }
    Ok((!out.is_empty()).then_some(Value::Array(out)))
}

/// `tool_choice` as chat's (`{"type": "function", "name"}` → `{"type", "function": {"name"}}`).
fn chat_tool_choice(v: &Value) -> Value {
    match v.get("name") {
        Some(n) if v.get("type").and_then(Value::as_str) == Some("function") => {
            json!({"type": "function", "function": {"name": n}})
        }
        _ => v.clone(),
    }
}

/// `text.format` as chat's `response_format`.
fn chat_response_format(f: &Fields) -> Result<Option<Value>, ApiError> {
    let Some(format) = f.get("text").and_then(|t| t.get("format")) else {
        return Ok(None);
    };
    match format.get("type").and_then(Value::as_str) {
        Some("text") => Ok(None),
        Some("json_object") => Ok(Some(json!({"type": "json_object"}))),
        Some("json_schema") => {
            let mut js = Map::new();
            for k in ["name", "schema", "strict", "description"] {
                if let Some(x) = format.get(k).filter(|x| !x.is_null()) {
                    js.insert(k.into(), x.clone());
                }
            }
            Ok(Some(json!({"type": "json_schema", "json_schema": js})))
        }
        _ => Err(ApiError::invalid(
            "text.format",
            "'text.format.type' must be \"text\", \"json_object\" or \"json_schema\"",
        )),
    }
}

/// Rename a chat field in an error to the Responses field it came from.
fn renamed(mut e: ApiError) -> ApiError {
    if let Some(p) = &e.param {
        let to = match p.as_str() {
            "max_tokens" | "max_completion_tokens" => Some("max_output_tokens".to_string()),
            "response_format" => Some("text.format".to_string()),
            p if p.starts_with("messages") => Some("input".to_string()),
            _ => None,
        };
        if let Some(to) = to {
            e.param = Some(to);
        }
    }
    e
}

/// What a request asked, echoed in its response.
struct Asked {
    model: String,
    instructions: Value,
    max_output_tokens: Value,
    temperature: Value,
    top_p: Value,
    tools: Value,
    tool_choice: Value,
    parallel_tool_calls: bool,
    text: Value,
    previous_response_id: Value,
    store: bool,
    metadata: Value,
    user: Value,
}

/// The response object around `output` (status, usage, and what was asked).
fn response_body(
    id: &str,
    created: u64,
    a: &Asked,
    status: &str,
    output: Vec<Value>,
    usage: Value,
) -> Value {
    json!({
        "id": id,
        "object": "response",
        "created_at": created,
        "status": status,
        "error": null,
        "incomplete_details": (status == "incomplete").then(|| json!({"reason": "max_output_tokens"})),
        "instructions": a.instructions,
        "max_output_tokens": a.max_output_tokens,
        "model": a.model,
        "output": output,
        "parallel_tool_calls": a.parallel_tool_calls,
        "previous_response_id": a.previous_response_id,
        "reasoning": {"effort": null, "summary": null},
        "store": a.store,
        "temperature": a.temperature,
        "text": a.text,
        "tool_choice": a.tool_choice,
        "tools": a.tools,
        "top_p": a.top_p,
        "truncation": "disabled",
        "usage": usage,
        "user": a.user,
        "metadata": a.metadata,
    })
}

/// Chat's usage as the Responses API counts it.
fn usage_of(chat: &Value) -> Value {
    let u = &chat["usage"];
    json!({
        "input_tokens": u["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": u["prompt_tokens_details"]["cached_tokens"]},
        "output_tokens": u["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": u["total_tokens"],
    })
}

/// One reasoning, message or function-call output item (ids made here).
fn reasoning_item(text: &str) -> Value {
    json!({"type": "reasoning", "id": random_id("rs_"), "summary": [],
           "content": [{"type": "reasoning_text", "text": text}], "status": "completed"})
}

fn message_item(id: &str, text: &str, status: &str) -> Value {
    json!({"type": "message", "id": id, "status": status, "role": "assistant",
           "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]})
}

fn call_item(call: &Value) -> Value {
    json!({"type": "function_call", "id": random_id("fc_"),
           "call_id": call["id"], "name": call["function"]["name"],
           "arguments": call["function"]["arguments"], "status": "completed"})
}

/// The output items of a whole chat answer, and whether it was cut by `max_output_tokens`.
fn output_of(chat: &Value) -> (Vec<Value>, bool) {
    let choice = &chat["choices"][0];
    let m = &choice["message"];
    let cut = choice["finish_reason"] == "length";
    let mut out = Vec::new();
    if let Some(t) = m["reasoning_content"].as_str() {
        out.push(reasoning_item(t));
    }
    if let Some(text) = m["content"].as_str().filter(|t| !t.is_empty()) {
        let status = if cut { "incomplete" } else { "completed" };
        out.push(message_item(&random_id("msg_"), text, status));
    }
    for c in m["tool_calls"].as_array().into_iter().flatten() {
        out.push(call_item(c));
    }
    (out, cut)
}

pub async fn create(
    State(state): State<AppState>,
    turn: Option<axum::Extension<super::sessions::SessionTurn>>,
    headers: HeaderMap,
    JsonBody(body): JsonBody,
) -> Result<Response, ApiError> {
    let f = Fields::parse(&body)?;
    refuse_unimplemented(&f)?;
    let key = super::state::bearer_of(&headers).to_string();
    let model = f
        .str("model")?
        .ok_or_else(|| ApiError::invalid("model", "'model' is required"))?
        .to_string();
    let store = f.bool("store")?.unwrap_or(true);
    let stream = f.bool("stream")?.unwrap_or(false);
    let instructions = f.str("instructions")?.map(str::to_string);
    let previous = f.str("previous_response_id")?.map(str::to_string);
    // The conversation: the previous response's (its input and output), then this input.
    let mut items = match &previous {
        Some(p) => {
            state
                .responses
                .get(p, &key)
                .ok_or_else(|| {
                    ApiError::invalid(
                        "previous_response_id",
                        format!("no stored response '{p}' (responses are kept in memory, the newest {STORE_CAPACITY}, for the key that made them)"),
                    )
                })?
                .items
        }
        None => Vec::new(),
    };
    let new_input = input_items(&f)?;
    items.extend(new_input);
    let mut messages = Vec::new();
    if let Some(i) = &instructions {
        messages.push(json!({"role": "system", "content": i}));
    }
    messages.extend(items_to_messages(&items)?);
    let mut chat = Map::new();
    chat.insert("model".into(), json!(model));
    chat.insert("messages".into(), Value::Array(messages));
    chat.insert("stream".into(), json!(stream));
    if stream {
        chat.insert("stream_options".into(), json!({"include_usage": true}));
    }
    if let Some(m) = f.get("max_output_tokens") {
        chat.insert("max_tokens".into(), m.clone());
    }
    // Sampling fields chat shares (and vLLM's, as extensions), passed as they are.
    for k in [
        "temperature",
        "top_p",
        "parallel_tool_calls",
        "seed",
        "top_k",
        "min_p",
        "stop",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "chat_template_kwargs",
        "group",
        "episode",
    ] {
        if let Some(v) = f.get(k) {
            chat.insert(k.into(), v.clone());
        }
    }
    if let Some(t) = chat_tools(&f)? {
        chat.insert("tools".into(), t);
    }
    if let Some(tc) = f.get("tool_choice") {
        chat.insert("tool_choice".into(), chat_tool_choice(tc));
    }
    if let Some(rf) = chat_response_format(&f)? {
        chat.insert("response_format".into(), rf);
    }
    let asked = Asked {
        model,
        instructions: json!(instructions),
        max_output_tokens: f.get("max_output_tokens").cloned().unwrap_or(Value::Null),
        temperature: f.get("temperature").cloned().unwrap_or(json!(1.0)),
        top_p: f.get("top_p").cloned().unwrap_or(json!(1.0)),
        tools: f.get("tools").cloned().unwrap_or(json!([])),
        tool_choice: f.get("tool_choice").cloned().unwrap_or(json!("auto")),
        parallel_tool_calls: f.bool("parallel_tool_calls")?.unwrap_or(true),
        text: f
            .get("text")
            .cloned()
            .unwrap_or(json!({"format": {"type": "text"}})),
        previous_response_id: json!(previous),
        store,
        metadata: f.get("metadata").cloned().unwrap_or(json!({})),
        user: f.get("user").cloned().unwrap_or(Value::Null),
    };
    let id = random_id("resp_");
    let created = unix_now();
    let resp = super::chat::run_chat(
        &state,
        &headers,
        &Value::Object(chat),
        super::chat::ChatOptions {
            id: Some(id.clone()),
            turn: turn.map(|axum::Extension(t)| t),
            ..Default::default()
        },
    )
    .await
    .map_err(renamed)?;
    let turn = Turn {
        state,
        id,
        created,
        asked,
        items,
        key,
    };
    if stream {
        return Ok(stream::translate(turn, resp));
    }
    let bytes = axum::body::to_bytes(resp.into_body(), usize::MAX)
        .await
        .map_err(|e| ApiError::internal(format!("reading the answer: {e}")))?;
    let chat: Value = serde_json::from_slice(&bytes)
        .map_err(|e| ApiError::internal(format!("reading the answer: {e}")))?;
    let (output, cut) = output_of(&chat);
    let body = turn.finish(output, cut, usage_of(&chat));
    Ok((StatusCode::OK, axum::Json(body)).into_response())
}

/// A response being made: what it needs to finish and be stored.
struct Turn {
    state: AppState,
    id: String,
    created: u64,
    asked: Asked,
    /// The conversation so far (stored with the output appended).
    items: Vec<Value>,
    key: String,
}

impl Turn {
    /// The response body; stored (with the conversation) when asked.
    fn finish(self, output: Vec<Value>, cut: bool, usage: Value) -> Value {
        let status = if cut { "incomplete" } else { "completed" };
        let body = response_body(
            &self.id,
            self.created,
            &self.asked,
            status,
            output.clone(),
            usage,
        );
        if self.asked.store {
            let mut items = self.items;
            items.extend(output);
            self.state.responses.put(
                self.id,
                &self.key,
                Stored {
                    body: body.clone(),
                    items,
                },
            );
        }
        body
    }
}

/// `GET /v1/responses/{id}`: a stored response, for the key that made it.
pub async fn get(
    State(state): State<AppState>,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    let key = super::state::bearer_of(&headers);
    match state.responses.get(&id, key) {
        Some(Stored { body, .. }) => Ok((
            StatusCode::OK,
            [(header::CONTENT_TYPE, "application/json")],
            body.to_string(),
        )
            .into_response()),
        None => Err(ApiError::not_found(format!("no stored response '{id}'"))),
    }
}

mod stream;
