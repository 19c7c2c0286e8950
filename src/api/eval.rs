//! The runner of learning adapters' evaluation sets (`online::eval::Runner`): each request goes
//! through the chat route's own path (template, tools, tool-call parsing, the engine's batching)
//! on the version asked for, greedy, and is not logged for training. The trainer's thread calls
//! it, blocking, while the server's runtime runs the requests (all of a set at once, so the
//! engine batches them with the traffic it serves).

use super::chat::{run_chat, ChatOptions};
use super::state::{AppState, Shared};
use crate::adapter::registry::Pinned;
use crate::online::eval::{Answer, ChatCall, Runner, Through};
use axum::http::StatusCode;
use serde_json::{json, Value};
use std::sync::Weak;

/// Bytes an answer's body may have.
const BODY_LIMIT: usize = 16 << 20;
/// Requests of one set in flight at once (a large set does not fill the admission queue).
const CONCURRENCY: usize = 16;
/// How long a request refused for load (429, 503) is retried, every half second.
const RETRY_SECS: f64 = 60.0;

pub struct EvalRunner {
    /// The server (weak: the runner lives inside it).
    state: Weak<Shared>,
    rt: tokio::runtime::Handle,
}

impl EvalRunner {
    pub fn new(state: &AppState, rt: tokio::runtime::Handle) -> EvalRunner {
        EvalRunner {
            state: state.downgrade(),
            rt,
        }
    }
}

impl Runner for EvalRunner {
    fn run(&self, through: &Through, calls: Vec<ChatCall>) -> Result<Vec<Answer>, String> {
        let state = AppState::upgrade(&self.state).ok_or("the server has stopped")?;
        let ready = state.ready().map_err(|e| e.message)?;
        let (model, version) = match through {
            Through::Base => (ready.model_name.clone(), None),
            Through::Adapter(name) => (name.clone(), None),
            Through::Version(v) => (v.name.to_string(), Some(v.clone())),
        };
        let runs = calls.into_iter().map(|c| {
            let state = state.clone();
            let mut body = json!({"model": model, "messages": c.messages, "temperature": 0,
                                  "max_tokens": c.max_tokens});
            if let Some(t) = c.tools {
                body["tools"] = Value::Array(t);
            }
            if let Some(t) = c.tool_choice {
                body["tool_choice"] = t;
            }
            let opts = ChatOptions {
                version: version.clone().map(Pinned::new),
                unlogged: true,
                ..ChatOptions::default()
            };
            async move {
                let headers = axum::http::HeaderMap::new();
                let t0 = std::time::Instant::now();
                // Refused for load (the queue full of live traffic): tried again, bounded.
                let resp = loop {
                    let opts = ChatOptions {
                        version: opts.version.clone(),
                        unlogged: true,
                        ..ChatOptions::default()
                    };
                    match run_chat(&state, &headers, &body, opts).await {
                        Err(e)
                            if (e.status == StatusCode::TOO_MANY_REQUESTS
                                || e.status == StatusCode::SERVICE_UNAVAILABLE)
                                && t0.elapsed().as_secs_f64() < RETRY_SECS =>
                        {
                            tokio::time::sleep(std::time::Duration::from_millis(500)).await
                        }
                        r => break r.map_err(|e| e.message)?,
                    }
                };
                let status = resp.status();
                let bytes = axum::body::to_bytes(resp.into_body(), BODY_LIMIT)
                    .await
                    .map_err(|e| e.to_string())?;
                let v: Value = serde_json::from_slice(&bytes).map_err(|e| e.to_string())?;
                if !status.is_success() {
                    return Err(format!("{status}: {}", v["error"]["message"]));
                }
                Ok(answer(&v))
            }
        });
        use futures_util::StreamExt;
        let all = futures_util::stream::iter(runs)
            .buffered(CONCURRENCY)
            .collect::<Vec<_>>();
        self.rt.block_on(all).into_iter().collect()
    }
}

/// An answer as a chat completion's body gives it.
fn answer(v: &Value) -> Answer {
    let m = &v["choices"][0]["message"];
    let tool_calls = m["tool_calls"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|c| {
            let f = &c["function"];
            let args = f["arguments"]
                .as_str()
                .and_then(|a| serde_json::from_str(a).ok())
                .unwrap_or(Value::Null);
            (f["name"].as_str().unwrap_or_default().to_string(), args)
        })
        .collect();
    Answer {
        text: m["content"].as_str().unwrap_or_default().to_string(),
        tool_calls,
        completion_tokens: v["usage"]["completion_tokens"].as_u64().unwrap_or(0) as usize,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn answers_are_read_from_a_chat_completion() {
        let v = json!({"choices": [{"message": {"content": "hi", "tool_calls": [
            {"type": "function", "function": {"name": "f", "arguments": "{\"a\": 1}"}}]}}],
            "usage": {"completion_tokens": 3}});
        let a = answer(&v);
        assert_eq!(a.text, "hi");
        assert_eq!(a.tool_calls, vec![("f".to_string(), json!({"a": 1}))]);
        assert_eq!(a.completion_tokens, 3);
    }
}
