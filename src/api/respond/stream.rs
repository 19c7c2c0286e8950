//! Streaming a response: each engine event becomes OpenAI chunks (the first event opens every
//! choice; with tools, text that may begin a call is held and the calls follow as deltas), sent
//! as server-sent events, the rollout logged before the chunk that finishes the last choice.

use super::*;

impl Responder {
    /// The chunks one event turns into (possibly none).
    fn chunks_for(&mut self, ev: &EngineEvent) -> Vec<Completion> {
        let Some(i) = self.apply(ev) else {
            return Vec::new();
        };
        // Two flags, copied out: `self` is borrowed mutably below.
        let (logprobs, token_ids) = (self.job.params.logprobs, self.job.params.return_token_ids);
        let mut out = Vec::new();
        if !self.choices[i].started {
            // The first event of the request opens every choice, in index order.
            for j in 0..self.choices.len() {
                self.choices[j].started = true;
                let first = match self.job.flavor {
                    Flavor::Chat | Flavor::Generate => {
                        Some(wire::Choice::ChatChunk(ChatChunkChoice {
                            index: self.first_choice + j,
                            delta: Delta {
                                role: Some("assistant"),
                                content: Some(String::new()),
                                ..Delta::default()
                            },
                            logprobs: None,
                            finish_reason: None,
                            stop_reason: None,
                            token_ids: None,
                            adapter_versions: None,
                        }))
                    }
                    Flavor::Completion => self.job.echo.as_ref().map(|e| {
                        wire::Choice::Text(TextChoice {
                            index: self.first_choice + j,
                            text: e.clone(),
                            logprobs: self.echo_logprobs(),
                            finish_reason: None,
                            stop_reason: None,
                            token_ids: None,
                            prompt_logprobs: None,
                            prompt_token_ids: None,
                            adapter_versions: None,
                        })
                    }),
                };
                if let Some(c) = first {
                    let mut chunk = self.envelope(true, vec![c]);
                    if token_ids && j == 0 {
                        chunk.prompt_token_ids = Some(self.job.prompt_ids.clone());
                    }
                    out.push(chunk);
                }
            }
        }
        match ev {
            EngineEvent::Token { token_id, text, .. } => {
                // A reasoning model's thinking apart; with tools, answer text that may begin a
                // call is held until the end.
                let (thinking, text) = match &mut self.choices[i].reasoning {
                    Some(r) => r.push(text),
                    None => (String::new(), text.clone()),
                };
                let text = match self.job.tools {
                    Some(t) => self.choices[i].tool_stream.push(t.format, &text),
                    None => text,
                };
                if text.is_empty() && thinking.is_empty() && !logprobs && !token_ids {
                    return out;
                }
                let c = &self.choices[i];
                let ids = token_ids.then(|| vec![*token_id]);
                // vLLM's: a completion choice's prompt ids come with its first token (an echoed
                // prompt's came with the chunk that echoed it).
                let prompt_ids = (token_ids && c.token_ids.len() == 1 && self.job.echo.is_none())
                    .then(|| self.job.prompt_ids.clone());
                let choice = match self.job.flavor {
                    Flavor::Chat | Flavor::Generate => wire::Choice::ChatChunk(ChatChunkChoice {
                        index: self.first_choice + i,
                        delta: Delta {
                            content: (!text.is_empty() || thinking.is_empty())
                                .then(|| text.clone()),
                            reasoning_content: (!thinking.is_empty()).then_some(thinking),
                            ..Delta::default()
                        },
                        logprobs: logprobs.then(|| ChatLogprobs {
                            content: c.logprobs.last().cloned().into_iter().collect(),
                            refusal: None,
                        }),
                        finish_reason: None,
                        stop_reason: None,
                        token_ids: ids,
                        adapter_versions: None,
                    }),
                    Flavor::Completion => wire::Choice::Text(TextChoice {
                        index: self.first_choice + i,
                        text: text.clone(),
                        logprobs: logprobs.then(|| TextLogprobs {
                            tokens: c.tokens.last().cloned().into_iter().collect(),
                            token_logprobs: vec![c.behavior.last().map(|v| *v as f64)],
                            top_logprobs: vec![c.top.last().cloned()],
                            text_offset: c.text_offset.last().copied().into_iter().collect(),
                        }),
                        finish_reason: None,
                        stop_reason: None,
                        token_ids: ids,
                        prompt_logprobs: None,
                        prompt_token_ids: prompt_ids,
                        adapter_versions: None,
                    }),
                };
                out.push(self.envelope(true, vec![choice]));
            }
            EngineEvent::Finished {
                reason,
                stop_reason,
                ..
            } => {
                // What the reasoning parser held (thinking, or answer through the tools'), then
                // what the tools' parser held, each delta in a chunk.
                let mut held = Vec::new();
                if let Some(r) = &mut self.choices[i].reasoning {
                    let (thinking, answer) = r.finish();
                    if !thinking.is_empty() {
                        held.push(Delta {
                            reasoning_content: Some(thinking),
                            ..Delta::default()
                        });
                    }
                    let answer = match self.job.tools {
                        Some(t) => self.choices[i].tool_stream.push(t.format, &answer),
                        None => answer,
                    };
                    if !answer.is_empty() {
                        held.push(Delta {
                            content: Some(answer),
                            ..Delta::default()
                        });
                    }
                }
                // With tools: what was held becomes content, or the calls, each in a chunk.
                let mut with_calls = false;
                let mut deltas = held;
                if let Some(mode) = self.job.tools {
                    let (rest, mut calls) = self.choices[i]
                        .tool_stream
                        .finish(mode.format, || random_id("call_"));
                    mode.keep(&mut calls);
                    with_calls = !calls.is_empty();
                    if !rest.is_empty() {
                        deltas.push(Delta {
                            content: Some(rest),
                            ..Delta::default()
                        });
                    }
                    for (k, c) in calls.into_iter().enumerate() {
                        deltas.push(match mode.legacy {
                            true => Delta {
                                function_call: Some(c.function),
                                ..Delta::default()
                            },
                            false => Delta {
                                tool_calls: Some(vec![ToolCallDelta {
                                    index: k,
                                    id: c.id,
                                    kind: c.kind,
                                    function: c.function,
                                }]),
                                ..Delta::default()
                            },
                        });
                    }
                }
                for delta in deltas {
                    let choice = wire::Choice::ChatChunk(ChatChunkChoice {
                        index: self.first_choice + i,
                        delta,
                        logprobs: None,
                        finish_reason: None,
                        stop_reason: None,
                        token_ids: None,
                        adapter_versions: None,
                    });
                    out.push(self.envelope(true, vec![choice]));
                }
                let (reason, stop) = (
                    Some(finish_with_calls(*reason, with_calls, self.job.tools)),
                    Some(stop_reason_json(stop_reason)),
                );
                let versions = self.versions_of(&self.choices[i]);
                let choice = match self.job.flavor {
                    Flavor::Chat | Flavor::Generate => wire::Choice::ChatChunk(ChatChunkChoice {
                        index: self.first_choice + i,
                        delta: Delta::default(),
                        logprobs: None,
                        finish_reason: reason,
                        stop_reason: stop,
                        token_ids: None,
                        adapter_versions: versions,
                    }),
                    Flavor::Completion => wire::Choice::Text(TextChoice {
                        index: self.first_choice + i,
                        text: String::new(),
                        logprobs: None,
                        finish_reason: reason,
                        stop_reason: stop,
                        token_ids: None,
                        prompt_logprobs: None,
                        prompt_token_ids: None,
                        adapter_versions: versions,
                    }),
                };
                out.push(self.envelope(true, vec![choice]));
            }
            EngineEvent::PromptLogprobs(_)
            | EngineEvent::Error(_)
            | EngineEvent::Embedding(_)
            | EngineEvent::GrammarFailed(_) => {}
        }
        out
    }
}

impl Responder {
    /// Fold one event (None: the engine hung up) into SSE text on `out`; false when the stream
    /// ends here (an error body written).
    fn write_event(&mut self, ev: Option<EngineEvent>, out: &mut String) -> bool {
        let err = match ev {
            Some(EngineEvent::Error(e)) => ApiError::internal(e),
            Some(EngineEvent::GrammarFailed(e)) => super::grammar_failed(&self.job, &e),
            Some(ev) => {
                for c in self.chunks_for(&ev) {
                    out.push_str(&sse(&c));
                }
                return true;
            }
            None => ApiError::internal("the engine stopped"),
        };
        out.push_str(&sse(&err.body()));
        false
    }

    /// After its events: the choices go to the rollout log once the last one finished, before
    /// the chunk that finishes it leaves (a reward posted when it arrives finds it); false when
    /// that failed (an error body written).
    async fn log_when_done(&mut self, out: &mut String) -> bool {
        if self.is_done() {
            if let Err(e) = self.log_rollouts().await {
                out.push_str(&sse(&e.body()));
                return false;
            }
        }
        true
    }
}

/// A server-sent event stream of `body`'s texts.
pub(in crate::api) fn sse_response(
    body: impl futures_util::Stream<Item = Result<Bytes, std::convert::Infallible>> + Send + 'static,
) -> Response {
    Response::builder()
        .status(StatusCode::OK)
        .header(header::CONTENT_TYPE, "text/event-stream")
        .header(header::CACHE_CONTROL, "no-cache")
        .body(Body::from_stream(body))
        .expect("valid response")
}

fn sse(v: &impl serde::Serialize) -> String {
    let text = serde_json::to_string(v).expect("response shapes serialize");
    format!("data: {text}\n\n")
}

pub(super) fn stream_response(r: Responder, stream: RequestStream) -> Response {
    let body = futures_util::stream::unfold(Some((r, stream)), |state| async move {
        let (mut r, mut stream) = state?;
        if r.is_done() {
            let mut out = String::new();
            if r.job.params.include_usage {
                let mut u = r.envelope(true, Vec::new());
                u.usage = Some(r.usage());
                out.push_str(&sse(&u));
            }
            out.push_str("data: [DONE]\n\n");
            return Some((Ok::<_, std::convert::Infallible>(Bytes::from(out)), None));
        }
        let mut out = String::new();
        // Take whatever is ready, so that a burst of events becomes one write.
        let first = stream.rx.recv().await;
        let mut evs = vec![first];
        while let Ok(ev) = stream.rx.try_recv() {
            evs.push(Some(ev));
        }
        for ev in evs {
            if !r.write_event(ev, &mut out) {
                return Some((Ok(Bytes::from(out)), None));
            }
        }
        if !r.log_when_done(&mut out).await {
            return Some((Ok(Bytes::from(out)), None));
        }
        Some((Ok(Bytes::from(out)), Some((r, stream))))
    });
    sse_response(body)
}

/// Several prompts' streams as one (completions with a batch of prompts): each prompt's chunks as
/// its events come, under the request's one id and with its choices numbered prompt × n + i;
/// each prompt's choices logged when it ends; the usage of all, then `[DONE]`, once all ended.
pub(super) fn stream_many(running: Vec<(Responder, RequestStream)>) -> Response {
    let state = Some(running);
    let body = futures_util::stream::unfold(state, |state| async move {
        let mut running = state?;
        if running.iter().all(|(r, _)| r.is_done()) {
            let mut out = String::new();
            if running[0].0.job.params.include_usage {
                let mut u = running[0].0.envelope(true, Vec::new());
                let mut usage = running[0].0.usage();
                for (r, _) in &running[1..] {
                    let more = r.usage();
                    usage.prompt_tokens += more.prompt_tokens;
                    usage.completion_tokens += more.completion_tokens;
                    usage.total_tokens += more.total_tokens;
                }
                u.usage = Some(usage);
                out.push_str(&sse(&u));
            }
            out.push_str("data: [DONE]\n\n");
            return Some((Ok::<_, std::convert::Infallible>(Bytes::from(out)), None));
        }
        // The next event of any prompt still running.
        let (ev, k) = {
            let waiting = running
                .iter_mut()
                .enumerate()
                .filter(|(_, (r, _))| !r.is_done())
                .map(|(k, (_, s))| Box::pin(async move { (s.rx.recv().await, k) }));
            futures_util::future::select_all(waiting).await.0
        };
        let mut out = String::new();
        let r = &mut running[k].0;
        if !r.write_event(ev, &mut out) || !r.log_when_done(&mut out).await {
            return Some((Ok(Bytes::from(out)), None));
        }
        Some((Ok(Bytes::from(out)), Some(running)))
    });
    sse_response(body)
}
