//! Load generator for any OpenAI-compatible server: streaming chat requests at a fixed
//! concurrency; reports output tokens/s, requests/s, TTFT and inter-token latency percentiles and
//! errors, as a table and as JSON with the machine described. With `--peer-url` the identical
//! workload runs against a second server in the same invocation, alternating, and the ratios are
//! printed. Every loop is bounded by a count and by a deadline. With `--feedback`, each finished
//! request's choices are rewarded (`POST /v1/feedback`, a list) and the time to the
//! acknowledgement is reported too: a learning adapter's reward latency under load.

mod args;
mod report;
mod workload;

use anyhow::{bail, Context};
use args::{Args, PROMPTS};
use clap::Parser;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use report::{machine, median_report, print_table, Report};
use serde_json::{json, Value};
use std::sync::Arc;
use workload::{get_json, run_workload, HttpClient, Target};

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
            "feedback": args.feedback,
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
