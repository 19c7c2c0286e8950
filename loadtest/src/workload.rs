//! One workload against one server: `concurrency` workers sending streaming chat requests until
//! `requests` are done or the deadline passes, each timed (TTFT, inter-token gaps) and, with
//! `--feedback`, rewarded; the samples summed up into a `Report`.

use crate::args::Args;
use crate::report::{percentile, Report};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use serde_json::{json, Value};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

#[derive(Default, Clone)]
pub struct Sample {
    pub ok: bool,
    pub error: Option<String>,
    pub output_tokens: usize,
    pub ttft: Option<f64>,
    pub gaps: Vec<f64>,
    /// The completion's id and the choices seen (for `--feedback`).
    pub id: Option<String>,
    pub choices: std::collections::BTreeSet<u64>,
    /// Seconds from posting the rewards to their acknowledgement (`--feedback`).
    pub feedback: Option<f64>,
}

pub type HttpClient = Client<hyper_util::client::legacy::connect::HttpConnector, Full<Bytes>>;

pub struct Target {
    pub url: String,
    pub model: String,
    pub extra: Option<Value>,
}

pub async fn get_json(
    client: &HttpClient,
    url: &str,
    key: &Option<String>,
) -> anyhow::Result<Value> {
    let mut req = hyper::Request::get(url);
    if let Some(k) = key {
        req = req.header("authorization", format!("Bearer {k}"));
    }
    let resp = client.request(req.body(Full::new(Bytes::new()))?).await?;
    let body = resp.into_body().collect().await?.to_bytes();
    Ok(serde_json::from_slice(&body)?)
}

async fn one_request(
    client: &HttpClient,
    t: &Target,
    args: &Args,
    prompt: &str,
    deadline: Instant,
) -> Sample {
    let mut body = json!({
        "model": t.model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "stream": true,
        "stream_options": {"include_usage": true},
        "ignore_eos": args.ignore_eos,
    });
    if let (Some(Value::Object(extra)), Some(b)) = (&t.extra, body.as_object_mut()) {
        for (k, v) in extra {
            b.insert(k.clone(), v.clone());
        }
    }
    let mut s = Sample::default();
    let mut req = hyper::Request::post(format!("{}/v1/chat/completions", t.url))
        .header("content-type", "application/json");
    if let Some(k) = &args.api_key {
        req = req.header("authorization", format!("Bearer {k}"));
    }
    let req = match req.body(Full::new(Bytes::from(body.to_string()))) {
        Ok(r) => r,
        Err(e) => {
            s.error = Some(e.to_string());
            return s;
        }
    };
    let start = Instant::now();
    let resp = match tokio::time::timeout_at(deadline.into(), client.request(req)).await {
        Ok(Ok(r)) => r,
        Ok(Err(e)) => {
            s.error = Some(format!("request: {e}"));
            return s;
        }
        Err(_) => {
            s.error = Some("timeout".into());
            return s;
        }
    };
    if !resp.status().is_success() {
        s.error = Some(http_error(resp).await);
        return s;
    }
    let mut body = resp.into_body();
    let mut buf = Vec::<u8>::new();
    let mut last: Option<Instant> = None;
    let mut chunks_with_content = 0usize;
    let mut usage_tokens = None;
    let mut done = false;
    while !done {
        let frame = match tokio::time::timeout_at(deadline.into(), body.frame()).await {
            Ok(Some(Ok(f))) => f,
            Ok(Some(Err(e))) => {
                s.error = Some(format!("stream: {e}"));
                return s;
            }
            Ok(None) => break,
            Err(_) => {
                s.error = Some("timeout".into());
                return s;
            }
        };
        let Some(data) = frame.data_ref() else {
            continue;
        };
        let now = Instant::now();
        buf.extend_from_slice(data);
        while let Some(pos) = buf.windows(2).position(|w| w == b"\n\n") {
            let event: Vec<u8> = buf.drain(..pos + 2).collect();
            let line = String::from_utf8_lossy(&event);
            for l in line.lines() {
                let Some(d) = l.strip_prefix("data:") else {
                    continue;
                };
                let d = d.trim();
                if d == "[DONE]" {
                    done = true;
                    continue;
                }
                let Ok(v) = serde_json::from_str::<Value>(d) else {
                    continue;
                };
                if v.get("error").is_some() {
                    s.error = Some(format!("stream error: {v}"));
                    return s;
                }
                if s.id.is_none() {
                    s.id = v.get("id").and_then(Value::as_str).map(str::to_string);
                }
                for c in v
                    .get("choices")
                    .and_then(Value::as_array)
                    .into_iter()
                    .flatten()
                {
                    if let Some(i) = c.get("index").and_then(Value::as_u64) {
                        s.choices.insert(i);
                    }
                }
                if let Some(n) = v
                    .pointer("/usage/completion_tokens")
                    .and_then(Value::as_u64)
                {
                    usage_tokens = Some(n as usize);
                }
                let has_content = v
                    .pointer("/choices/0/delta/content")
                    .and_then(Value::as_str)
                    .is_some_and(|c| !c.is_empty());
                if has_content {
                    chunks_with_content += 1;
                    match last {
                        None => s.ttft = Some((now - start).as_secs_f64()),
                        Some(t) => s.gaps.push((now - t).as_secs_f64()),
                    }
                    last = Some(now);
                }
            }
        }
    }
    s.output_tokens = usage_tokens.unwrap_or(chunks_with_content);
    s.ok = s.ttft.is_some();
    if !s.ok {
        s.error = Some("no tokens received".into());
    }
    s
}

pub async fn run_workload(
    client: &HttpClient,
    t: Arc<Target>,
    args: &Args,
    prompts: Arc<Vec<String>>,
    num_requests: usize,
) -> Report {
    let next = Arc::new(AtomicUsize::new(0));
    let deadline = Instant::now() + Duration::from_secs_f64(args.timeout);
    let start = Instant::now();
    let mut workers = Vec::new();
    for _ in 0..args.concurrency.max(1) {
        let (client, t, args, prompts, next) = (
            client.clone(),
            t.clone(),
            args.clone(),
            prompts.clone(),
            next.clone(),
        );
        workers.push(tokio::spawn(async move {
            let mut out = Vec::new();
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= num_requests || Instant::now() >= deadline {
                    break;
                }
                let p = &prompts[i % prompts.len()];
                let mut s = one_request(&client, &t, &args, p, deadline).await;
                if args.feedback && s.ok {
                    reward(&client, &t, &args, &mut s, i, deadline).await;
                }
                out.push(s);
            }
            out
        }));
    }
    let mut samples = Vec::new();
    for w in workers {
        samples.extend(w.await.unwrap_or_default());
    }
    let wall = start.elapsed().as_secs_f64();
    let ok: Vec<&Sample> = samples.iter().filter(|s| s.ok).collect();
    let output_tokens: usize = ok.iter().map(|s| s.output_tokens).sum();
    let mut ttft: Vec<f64> = ok.iter().filter_map(|s| s.ttft).collect();
    let mut gaps: Vec<f64> = ok.iter().flat_map(|s| s.gaps.iter().copied()).collect();
    let mut feedback: Vec<f64> = ok.iter().filter_map(|s| s.feedback).collect();
    Report {
        url: t.url.clone(),
        model: t.model.clone(),
        requests: samples.len(),
        errors: samples.len() - ok.len(),
        first_error: samples.iter().find_map(|s| s.error.clone()),
        wall_seconds: wall,
        output_tokens,
        output_tokens_per_second: output_tokens as f64 / wall,
        requests_per_second: ok.len() as f64 / wall,
        ttft_p50: percentile(&mut ttft, 0.5),
        ttft_p90: percentile(&mut ttft, 0.9),
        ttft_p99: percentile(&mut ttft, 0.99),
        itl_p50: percentile(&mut gaps, 0.5),
        itl_p90: percentile(&mut gaps, 0.9),
        itl_p99: percentile(&mut gaps, 0.99),
        feedback_p50: percentile(&mut feedback, 0.5),
        feedback_p90: percentile(&mut feedback, 0.9),
        feedback_p99: percentile(&mut feedback, 0.99),
    }
}

/// "HTTP status: body" of a failed response.
async fn http_error(resp: hyper::Response<hyper::body::Incoming>) -> String {
    let status = resp.status();
    let body = resp.into_body().collect().await.map(|b| b.to_bytes());
    format!(
        "HTTP {status}: {}",
        body.map(|b| String::from_utf8_lossy(&b).into_owned())
            .unwrap_or_default()
    )
}

/// Reward every choice of `s` (request number `i`) in one `POST /v1/feedback` before `deadline`,
/// timing the acknowledgement; a failure makes the sample an error.
async fn reward(
    client: &HttpClient,
    t: &Target,
    args: &Args,
    s: &mut Sample,
    i: usize,
    deadline: Instant,
) {
    let Some(id) = s.id.clone() else {
        s.ok = false;
        s.error = Some("no completion id to reward".into());
        return;
    };
    let items: Vec<Value> = s
        .choices
        .iter()
        .map(|&c| json!({"id": id, "choice": c, "reward": ((i + c as usize) % 3) as f64 / 2.0}))
        .collect();
    let mut req = hyper::Request::post(format!("{}/v1/feedback", t.url))
        .header("content-type", "application/json");
    if let Some(k) = &args.api_key {
        req = req.header("authorization", format!("Bearer {k}"));
    }
    let body = Full::new(Bytes::from(Value::from(items).to_string()));
    let start = Instant::now();
    let error = match req.body(body) {
        Err(e) => e.to_string(),
        Ok(req) => match tokio::time::timeout_at(deadline.into(), client.request(req)).await {
            Ok(Ok(r)) if r.status().is_success() => {
                let _ = r.into_body().collect().await;
                s.feedback = Some(start.elapsed().as_secs_f64());
                return;
            }
            Ok(Ok(r)) => http_error(r).await,
            Ok(Err(e)) => e.to_string(),
            Err(_) => "timeout".into(),
        },
    };
    s.ok = false;
    s.error = Some(format!("feedback: {error}"));
}
