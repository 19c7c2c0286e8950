//! A streamed response: the chat stream's chunks read as they come and turned into the
//! Responses API's events (`response.created`, items added, text and argument deltas, items
//! done, `response.completed` or `response.incomplete`), each numbered.

use super::*;
use axum::body::Bytes;
use futures_util::StreamExt;

/// The output being built: items finished, and the one open (reasoning or message).
#[derive(Default)]
struct Build {
    output: Vec<Value>,
    /// The open item's index in `output` and its text so far.
    open: Option<(usize, String)>,
    seq: u64,
    cut: bool,
    usage: Value,
    events: String,
}

impl Build {
    fn emit(&mut self, kind: &str, mut data: Value) {
        data["type"] = json!(kind);
        data["sequence_number"] = json!(self.seq);
        self.seq += 1;
        self.events
            .push_str(&format!("event: {kind}\ndata: {data}\n\n"));
    }

    fn open_kind(&self) -> Option<&str> {
        self.open
            .as_ref()
            .and_then(|(i, _)| self.output[*i]["type"].as_str())
    }

    /// Close the open item: its text done, the item done.
    fn close(&mut self) {
        let Some((i, text)) = self.open.take() else {
            return;
        };
        let id = self.output[i]["id"].clone();
        if self.output[i]["type"] == "reasoning" {
            self.output[i] = json!({"type": "reasoning", "id": id, "summary": [],
                                   "content": [{"type": "reasoning_text", "text": text}],
                                   "status": "completed"});
            let ev = json!({"item_id": id, "output_index": i, "content_index": 0, "text": text});
            self.emit("response.reasoning_text.done", ev);
        } else {
            let status = if self.cut { "incomplete" } else { "completed" };
            self.output[i] = message_item(id.as_str().unwrap_or(""), &text, status);
            let part = self.output[i]["content"][0].clone();
            let ev = json!({"item_id": id, "output_index": i, "content_index": 0, "text": text});
            self.emit("response.output_text.done", ev);
            let ev = json!({"item_id": id, "output_index": i, "content_index": 0, "part": part});
            self.emit("response.content_part.done", ev);
        }
        let item = self.output[i].clone();
        self.emit(
            "response.output_item.done",
            json!({"output_index": i, "item": item}),
        );
    }

    /// Text for an item of `kind` (reasoning or message), opening it when needed.
    fn text(&mut self, kind: &str, delta: &str) {
        if self.open_kind() != Some(kind) {
            self.close();
            let i = self.output.len();
            let item = if kind == "reasoning" {
                json!({"type": "reasoning", "id": random_id("rs_"), "summary": [],
                       "content": [], "status": "in_progress"})
            } else {
                json!({"type": "message", "id": random_id("msg_"), "status": "in_progress",
                       "role": "assistant", "content": []})
            };
            self.output.push(item.clone());
            self.emit(
                "response.output_item.added",
                json!({"output_index": i, "item": item}),
            );
            if kind == "message" {
                let part = json!({"type": "output_text", "text": "", "annotations": [],
                                  "logprobs": []});
                let ev = json!({"item_id": item["id"], "output_index": i, "content_index": 0,
                                "part": part});
                self.emit("response.content_part.added", ev);
            }
            self.open = Some((i, String::new()));
        }
        let (i, text) = self.open.as_mut().expect("opened");
        text.push_str(delta);
        let (i, id) = (*i, self.output[*i]["id"].clone());
        let ev = json!({"item_id": id, "output_index": i, "content_index": 0, "delta": delta,
                        "logprobs": []});
        let kind = if kind == "reasoning" {
            "response.reasoning_text.delta"
        } else {
            "response.output_text.delta"
        };
        self.emit(kind, ev);
    }

    /// A whole tool call (chat streams each call in one chunk).
    fn call(&mut self, call: &Value) {
        self.close();
        let i = self.output.len();
        let done = call_item(call);
        let mut added = done.clone();
        added["arguments"] = json!("");
        added["status"] = json!("in_progress");
        self.output.push(done.clone());
        self.emit(
            "response.output_item.added",
            json!({"output_index": i, "item": added}),
        );
        let (id, args) = (done["id"].clone(), done["arguments"].clone());
        let ev = json!({"item_id": id, "output_index": i, "delta": args});
        self.emit("response.function_call_arguments.delta", ev);
        let ev = json!({"item_id": id, "output_index": i, "arguments": args});
        self.emit("response.function_call_arguments.done", ev);
        self.emit(
            "response.output_item.done",
            json!({"output_index": i, "item": done}),
        );
    }

    /// One chat chunk folded in.
    fn chunk(&mut self, c: &Value) {
        if let Some(u) = c.get("usage").filter(|u| !u.is_null()) {
            self.usage = usage_of(&json!({ "usage": u }));
        }
        let Some(choice) = c["choices"].get(0) else {
            return;
        };
        let d = &choice["delta"];
        if let Some(t) = d["reasoning_content"].as_str().filter(|t| !t.is_empty()) {
            self.text("reasoning", t);
        }
        if let Some(t) = d["content"].as_str().filter(|t| !t.is_empty()) {
            self.text("message", t);
        }
        for call in d["tool_calls"].as_array().into_iter().flatten() {
            self.call(call);
        }
        if choice["finish_reason"] == "length" {
            self.cut = true;
        }
    }
}

pub(super) fn translate(turn: Turn, chat: Response) -> Response {
    let mut b = Build::default();
    let start = response_body(
        &turn.id,
        turn.created,
        &turn.asked,
        "in_progress",
        Vec::new(),
        Value::Null,
    );
    b.emit("response.created", json!({ "response": start }));
    b.emit("response.in_progress", json!({ "response": start }));
    let first = Bytes::from(std::mem::take(&mut b.events));
    let body = chat.into_body().into_data_stream();
    let state = Some((body, b, String::new(), Some(turn)));
    let rest = futures_util::stream::unfold(state, |st| async move {
        let (mut body, mut b, mut buf, mut turn) = st?;
        loop {
            match body.next().await {
                Some(Ok(bytes)) => buf.push_str(&String::from_utf8_lossy(&bytes)),
                // The connection's end or a failed read: what was built ends the response.
                _ => buf.push_str("data: [DONE]\n\n"),
            }
            while let Some(at) = buf.find("\n\n") {
                let event: String = buf.drain(..at + 2).collect();
                let Some(data) = event.trim().strip_prefix("data: ") else {
                    continue;
                };
                if data == "[DONE]" {
                    b.close();
                    let Some(t) = turn.take() else { break };
                    let cut = b.cut;
                    let kind = if cut {
                        "response.incomplete"
                    } else {
                        "response.completed"
                    };
                    let usage = std::mem::take(&mut b.usage);
                    let output = std::mem::take(&mut b.output);
                    let body = t.finish(output, cut, usage);
                    b.emit(kind, json!({ "response": body }));
                    let out = Bytes::from(std::mem::take(&mut b.events));
                    return Some((Ok::<_, std::convert::Infallible>(out), None));
                }
                match serde_json::from_str::<Value>(data) {
                    Ok(v) if v.get("error").is_some() => {
                        let e = &v["error"];
                        b.emit(
                            "error",
                            json!({"code": e["code"], "message": e["message"], "param": e["param"]}),
                        );
                        let out = Bytes::from(std::mem::take(&mut b.events));
                        return Some((Ok(out), None));
                    }
                    Ok(v) => b.chunk(&v),
                    Err(_) => {}
                }
            }
            if !b.events.is_empty() {
                let out = Bytes::from(std::mem::take(&mut b.events));
                return Some((Ok(out), Some((body, b, buf, turn))));
            }
        }
    });
    let all = futures_util::stream::once(async move { Ok(first) }).chain(rest);
    super::super::respond::sse_response(all)
}
