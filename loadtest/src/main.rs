//! Load generator for any OpenAI-compatible server: streaming chat requests at a fixed
//! concurrency; reports output tokens/s, requests/s, TTFT and inter-token latency percentiles and
//! errors, as a table and as JSON with the machine described. With `--peer-url` the identical
//! workload runs against a second server in the same invocation, alternating, and the ratios are
//! printed. Every loop is bounded by a count and by a deadline. With `--feedback`, each finished
//! request's choices are rewarded (`POST /v1/feedback`, a list) and the time to the
//! acknowledgement is reported too: a learning adapter's reward latency under load.

use anyhow::{bail, Context};
use bytes::Bytes;
use clap::Parser;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use serde_json::{json, Value};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

#[derive(Parser, Clone)]
#[command(
    name = "loadtest",
    about = "Streaming chat load against OpenAI-compatible servers"
)]
struct Args {
    /// Base URL of the server under test, e.g. http://127.0.0.1:8080
    #[arg(long)]
    url: String,
    /// A second server to run the same workload against, alternating; ratios are url / peer.
    #[arg(long)]
    peer_url: Option<String>,
    /// Model name to send (default: the first of the server's /v1/models).
    #[arg(long)]
    model: Option<String>,
    #[arg(long)]
    peer_model: Option<String>,
    #[arg(long, default_value_t = 16)]
    concurrency: usize,
    /// Requests per run.
    #[arg(long, default_value_t = 64)]
    requests: usize,
    #[arg(long, default_value_t = 128)]
    max_tokens: usize,
    /// Ask the server to ignore EOS so that every request generates max_tokens.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    ignore_eos: bool,
    #[arg(long, default_value_t = 0.0)]
    temperature: f64,
    /// A file of prompts, one per line (default: a built-in set of 32).
    #[arg(long)]
    prompts: Option<std::path::PathBuf>,
    /// Extra JSON fields merged into every request to --url (e.g. '{"cache_prompt": false}').
    #[arg(long)]
    extra: Option<String>,
    #[arg(long)]
    peer_extra: Option<String>,
    /// Runs per server (alternating A, B, B, A, ...); medians are reported.
    #[arg(long, default_value_t = 1)]
    rounds: usize,
    /// Warm-up requests per server before measuring (not counted).
    #[arg(long, default_value_t = 2)]
    warmup: usize,
    /// Give up a run after this many seconds.
    #[arg(long, default_value_t = 600.0)]
    timeout: f64,
    /// Bearer token for --url / --peer-url.
    #[arg(long)]
    api_key: Option<String>,
    /// Write the JSON report here as well as printing it.
    #[arg(long)]
    json_out: Option<std::path::PathBuf>,
    /// Reward each finished request's choices (Flywheel's `POST /v1/feedback`; rewards 0, 0.5, 1
    /// in turn, so groups differ) and report the acknowledgement's latency (p50/p90/p99).
    #[arg(long, default_value_t = false)]
    feedback: bool,
}

const PROMPTS: &[&str] = &[
    "Explain how a refrigerator works.",
    "Write a short poem about the sea.",
    "What are the main causes of inflation?",
    "Describe the water cycle for a ten-year-old.",
    "Give three tips for learning a new language.",
    "What is the difference between a virus and a bacterium?",
    "Summarize the plot of Romeo and Juliet.",
    "How do airplanes stay in the air?",
    "Write a recipe for a simple tomato soup.",
    "Why is the sky blue?",
    "What is machine learning?",
    "List some benefits of regular exercise.",
    "How does a bill become a law?",
    "Explain photosynthesis in simple terms.",
    "What should I pack for a weekend camping trip?",
    "Tell me a story about a brave mouse.",
    "How do vaccines work?",
    "What is the capital of Australia, and why was it chosen?",
    "Compare cats and dogs as pets.",
    "Explain the rules of chess briefly.",
    "How can I improve my sleep?",
    "What is a black hole?",
    "Write a thank-you note to a teacher.",
    "Describe how the internet works.",
    "What are renewable energy sources?",
    "Give advice for a first job interview.",
    "How does the stock market work?",
    "What causes earthquakes?",
    "Explain what DNA is.",
    "Write a limerick about a cat.",
    "How do I make a budget?",
    "What were the causes of World War I?",
];

#[derive(Default, Clone)]
struct Sample {
    ok: bool,
    error: Option<String>,
    output_tokens: usize,
    ttft: Option<f64>,
    gaps: Vec<f64>,
    /// The completion's id and the choices seen (for `--feedback`).
    id: Option<String>,
    choices: std::collections::BTreeSet<u64>,
    /// Seconds from posting the rewards to their acknowledgement (`--feedback`).
    feedback: Option<f64>,
}

#[derive(Clone, Debug, serde::Serialize)]
struct Report {
    url: String,
    model: String,
    requests: usize,
    errors: usize,
    first_error: Option<String>,
    wall_seconds: f64,
    output_tokens: usize,
    output_tokens_per_second: f64,
    requests_per_second: f64,
    ttft_p50: f64,
    ttft_p90: f64,
    ttft_p99: f64,
    itl_p50: f64,
    itl_p90: f64,
    itl_p99: f64,
    /// Reward acknowledgement latency (`--feedback`; NaN, shown as null, without).
    feedback_p50: f64,
    feedback_p90: f64,
    feedback_p99: f64,
}

fn percentile(v: &mut [f64], q: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    let i = ((v.len() - 1) as f64 * q).round() as usize;
    v[i]
}

type HttpClient = Client<hyper_util::client::legacy::connect::HttpConnector, Full<Bytes>>;

struct Target {
    url: String,
    model: String,
    extra: Option<Value>,
}

async fn get_json(client: &HttpClient, url: &str, key: &Option<String>) -> anyhow::Result<Value> {
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
        let status = resp.status();
        let body = resp.into_body().collect().await.map(|b| b.to_bytes());
        s.error = Some(format!(
            "HTTP {status}: {}",
            body.map(|b| String::from_utf8_lossy(&b).into_owned())
                .unwrap_or_default()
        ));
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

async fn run_workload(
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
                    reward(&client, &t, &args, &mut s, i).await;
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

/// Reward every choice of `s` (request number `i`) in one `POST /v1/feedback`, timing the
/// acknowledgement; a failure makes the sample an error.
async fn reward(client: &HttpClient, t: &Target, args: &Args, s: &mut Sample, i: usize) {
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
    let Ok(req) = req.body(Full::new(Bytes::from(Value::from(items).to_string()))) else {
        return;
    };
    let start = Instant::now();
    match client.request(req).await {
        Ok(r) if r.status().is_success() => {
            let _ = r.into_body().collect().await;
            s.feedback = Some(start.elapsed().as_secs_f64());
        }
        Ok(r) => {
            let status = r.status();
            let body = r.into_body().collect().await.map(|b| b.to_bytes());
            s.ok = false;
            s.error = Some(format!(
                "feedback: HTTP {status}: {}",
                body.map(|b| String::from_utf8_lossy(&b).into_owned())
                    .unwrap_or_default()
            ));
        }
        Err(e) => {
            s.ok = false;
            s.error = Some(format!("feedback: {e}"));
        }
    }
}

/// The per-field median of several runs against one server.
fn median_report(rs: &[Report]) -> Report {
    let med = |f: &dyn Fn(&Report) -> f64| {
        let mut v: Vec<f64> = rs.iter().map(f).collect();
        percentile(&mut v, 0.5)
    };
    let mut r = rs[0].clone();
    r.errors = rs.iter().map(|r| r.errors).sum();
    r.requests = rs.iter().map(|r| r.requests).sum();
    r.first_error = rs.iter().find_map(|r| r.first_error.clone());
    r.wall_seconds = med(&|r| r.wall_seconds);
    r.output_tokens = med(&|r| r.output_tokens as f64) as usize;
    r.output_tokens_per_second = med(&|r| r.output_tokens_per_second);
    r.requests_per_second = med(&|r| r.requests_per_second);
    r.ttft_p50 = med(&|r| r.ttft_p50);
    r.ttft_p90 = med(&|r| r.ttft_p90);
    r.ttft_p99 = med(&|r| r.ttft_p99);
    r.itl_p50 = med(&|r| r.itl_p50);
    r.itl_p90 = med(&|r| r.itl_p90);
    r.itl_p99 = med(&|r| r.itl_p99);
    r.feedback_p50 = med(&|r| r.feedback_p50);
    r.feedback_p90 = med(&|r| r.feedback_p90);
    r.feedback_p99 = med(&|r| r.feedback_p99);
    r
}

fn machine() -> Value {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let cpu = cpuinfo
        .lines()
        .find_map(|l| {
            l.strip_prefix("model name")
                .map(|r| r.trim_start_matches([' ', '\t', ':']))
        })
        .unwrap_or("unknown")
        .to_string();
    let flags = cpuinfo
        .lines()
        .find_map(|l| l.strip_prefix("flags"))
        .unwrap_or("");
    let isa: Vec<&str> = ["avx2", "avx512f", "avx512_vnni", "avx512_bf16"]
        .into_iter()
        .filter(|f| flags.split_whitespace().any(|x| x == *f))
        .collect();
    let mem_kb = std::fs::read_to_string("/proc/meminfo")
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("MemTotal:"))
        .and_then(|r| r.trim().trim_end_matches(" kB").parse::<u64>().ok())
        .unwrap_or(0);
    json!({
        "cpu": cpu,
        "isa": isa,
        "cores": std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0),
        "memory_gib": (mem_kb as f64 / (1 << 20) as f64 * 10.0).round() / 10.0,
        "os": std::env::consts::OS,
        "arch": std::env::consts::ARCH,
    })
}

fn print_table(rows: &[(&str, &Report)]) {
    println!(
        "{:<8} {:>9} {:>7} {:>6} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9}",
        "server",
        "out tok/s",
        "req/s",
        "errors",
        "TTFT p50",
        "TTFT p90",
        "TTFT p99",
        "ITL p50",
        "ITL p90",
        "ITL p99"
    );
    for (name, r) in rows {
        println!(
            "{:<8} {:>9.1} {:>7.2} {:>6} {:>8.3}s {:>8.3}s {:>8.3}s {:>7.1}ms {:>7.1}ms {:>7.1}ms",
            name,
            r.output_tokens_per_second,
            r.requests_per_second,
            r.errors,
            r.ttft_p50,
            r.ttft_p90,
            r.ttft_p99,
            r.itl_p50 * 1e3,
            r.itl_p90 * 1e3,
            r.itl_p99 * 1e3
        );
        if r.feedback_p50.is_finite() {
            println!(
                "{:<8} reward acknowledged: p50 {:.1}ms, p90 {:.1}ms, p99 {:.1}ms",
                "",
                r.feedback_p50 * 1e3,
                r.feedback_p90 * 1e3,
                r.feedback_p99 * 1e3
            );
        }
    }
}

async fn resolve_model(
    client: &HttpClient,
    url: &str,
    given: &Option<String>,
    key: &Option<String>,
) -> anyhow::Result<String> {
    if let Some(m) = given {
        return Ok(m.clone());
    }
    let v = get_json(client, &format!("{url}/v1/models"), key)
        .await
        .with_context(|| format!("GET {url}/v1/models"))?;
    v.pointer("/data/0/id")
        .and_then(Value::as_str)
        .map(str::to_string)
        .context("no model listed by /v1/models")
}

fn parse_extra(s: &Option<String>) -> anyhow::Result<Option<Value>> {
    s.as_deref()
        .map(|s| serde_json::from_str(s).context("--extra must be a JSON object"))
        .transpose()
}

#[tokio::main(flavor = "multi_thread", worker_threads = 1)]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    if args.rounds == 0 || args.requests == 0 {
        bail!("--rounds and --requests must be at least 1");
    }
    let prompts: Vec<String> = match &args.prompts {
        Some(p) => std::fs::read_to_string(p)?
            .lines()
            .filter(|l| !l.trim().is_empty())
            .map(str::to_string)
            .collect(),
        None => PROMPTS.iter().map(|s| s.to_string()).collect(),
    };
    if prompts.is_empty() {
        bail!("no prompts");
    }
    let prompts = Arc::new(prompts);
    // A fresh connection per request: some servers close idle keep-alive connections, and a
    // request sent on one that is closing fails for reasons unrelated to the server's speed.
    let client: HttpClient = Client::builder(TokioExecutor::new())
        .pool_max_idle_per_host(0)
        .build_http();
    let url = args.url.trim_end_matches('/').to_string();
    let mut targets = vec![Arc::new(Target {
        model: resolve_model(&client, &url, &args.model, &args.api_key).await?,
        url,
        extra: parse_extra(&args.extra)?,
    })];
    if let Some(peer) = &args.peer_url {
        let peer = peer.trim_end_matches('/').to_string();
        targets.push(Arc::new(Target {
            model: resolve_model(&client, &peer, &args.peer_model, &args.api_key).await?,
            url: peer,
            extra: parse_extra(&args.peer_extra)?,
        }));
    }
    for t in &targets {
        if args.warmup > 0 {
            run_workload(&client, t.clone(), &args, prompts.clone(), args.warmup).await;
        }
    }
    let mut runs: Vec<Vec<Report>> = vec![Vec::new(); targets.len()];
    for round in 0..args.rounds {
        let order: Vec<usize> = if round % 2 == 0 {
            (0..targets.len()).collect()
        } else {
            (0..targets.len()).rev().collect()
        };
        for i in order {
            let r = run_workload(
                &client,
                targets[i].clone(),
                &args,
                prompts.clone(),
                args.requests,
            )
            .await;
            eprintln!(
                "round {round} {}: {:.1} tok/s, TTFT p50 {:.3}s, errors {}{}",
                r.url,
                r.output_tokens_per_second,
                r.ttft_p50,
                r.errors,
                r.first_error
                    .as_deref()
                    .map(|e| format!(" (first: {e})"))
                    .unwrap_or_default()
            );
            runs[i].push(r);
        }
    }
    let reports: Vec<Report> = runs.iter().map(|r| median_report(r)).collect();
    let names = ["server", "peer"];
    println!(
        "\nconcurrency {}, {} requests x {} rounds, max_tokens {}, ignore_eos {} (medians)",
        args.concurrency, args.requests, args.rounds, args.max_tokens, args.ignore_eos
    );
    let rows: Vec<(&str, &Report)> = names.iter().copied().zip(reports.iter()).collect();
    print_table(&rows);
    let mut out = json!({
        "machine": machine(),
        "workload": {
            "concurrency": args.concurrency,
            "requests": args.requests,
            "rounds": args.rounds,
            "max_tokens": args.max_tokens,
            "ignore_eos": args.ignore_eos,
            "temperature": args.temperature,
            "num_prompts": prompts.len(),
        },
        "server": reports[0],
    });
    if reports.len() == 2 {
        let (a, b) = (&reports[0], &reports[1]);
        let ratios = json!({
            "output_tokens_per_second": a.output_tokens_per_second / b.output_tokens_per_second,
            "ttft_p50": a.ttft_p50 / b.ttft_p50,
            "ttft_p99": a.ttft_p99 / b.ttft_p99,
            "itl_p50": a.itl_p50 / b.itl_p50,
        });
        println!(
            "ratio server/peer: output tok/s {:.2}x, TTFT p50 {:.2}x, TTFT p99 {:.2}x, ITL p50 {:.2}x",
            ratios["output_tokens_per_second"].as_f64().unwrap_or(f64::NAN),
            ratios["ttft_p50"].as_f64().unwrap_or(f64::NAN),
            ratios["ttft_p99"].as_f64().unwrap_or(f64::NAN),
            ratios["itl_p50"].as_f64().unwrap_or(f64::NAN),
        );
        out["peer"] = json!(b);
        out["ratios"] = ratios;
    }
    let text = serde_json::to_string_pretty(&out)?;
    println!("{text}");
    if let Some(p) = &args.json_out {
        std::fs::write(p, &text)?;
    }
    if reports.iter().any(|r| r.errors > 0) {
        eprintln!("some requests failed");
    }
    Ok(())
}
