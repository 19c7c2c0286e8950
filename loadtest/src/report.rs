//! What a run measured (`Report`), the median of several runs, the machine it ran on, and the
//! table printed.

use serde_json::{json, Value};

#[derive(Clone, Debug, serde::Serialize)]
pub struct Report {
    pub url: String,
    pub model: String,
    pub requests: usize,
    pub errors: usize,
    pub first_error: Option<String>,
    pub wall_seconds: f64,
    pub output_tokens: usize,
    pub output_tokens_per_second: f64,
    pub requests_per_second: f64,
    pub ttft_p50: f64,
    pub ttft_p90: f64,
    pub ttft_p99: f64,
    pub itl_p50: f64,
    pub itl_p90: f64,
    pub itl_p99: f64,
    /// Reward acknowledgement latency (`--feedback`; NaN, shown as null, without).
    pub feedback_p50: f64,
    pub feedback_p90: f64,
    pub feedback_p99: f64,
}

pub fn percentile(v: &mut [f64], q: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    let i = ((v.len() - 1) as f64 * q).round() as usize;
    v[i]
}

/// The per-field median of several runs against one server.
pub fn median_report(rs: &[Report]) -> Report {
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

pub fn machine() -> Value {
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

pub fn print_table(rows: &[(&str, &Report)]) {
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
