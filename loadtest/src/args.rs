//! The command line: the servers, the workload, the report, and the built-in prompts.

use clap::Parser;

#[derive(Parser, Clone)]
#[command(
    name = "loadtest",
    about = "Streaming chat load against OpenAI-compatible servers"
)]
pub struct Args {
    /// Base URL of the server under test, e.g. http://127.0.0.1:8080
    #[arg(long)]
    pub url: String,
    /// A second server to run the same workload against, alternating; ratios are url / peer.
    #[arg(long)]
    pub peer_url: Option<String>,
    /// Model name to send (default: the first of the server's /v1/models).
    #[arg(long)]
    pub model: Option<String>,
    #[arg(long)]
    pub peer_model: Option<String>,
    #[arg(long, default_value_t = 16)]
    pub concurrency: usize,
    /// Requests per run.
    #[arg(long, default_value_t = 64)]
    pub requests: usize,
    #[arg(long, default_value_t = 128)]
    pub max_tokens: usize,
    /// Ask the server to ignore EOS so that every request generates max_tokens.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    pub ignore_eos: bool,
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f64,
    /// A file of prompts, one per line (default: a built-in set of 32).
    #[arg(long)]
    pub prompts: Option<std::path::PathBuf>,
    /// Extra JSON fields merged into every request to --url (e.g. '{"cache_prompt": false}').
    #[arg(long)]
    pub extra: Option<String>,
    #[arg(long)]
    pub peer_extra: Option<String>,
    /// Runs per server (alternating A, B, B, A, ...); medians are reported.
    #[arg(long, default_value_t = 1)]
    pub rounds: usize,
    /// Warm-up requests per server before measuring (not counted).
    #[arg(long, default_value_t = 2)]
    pub warmup: usize,
    /// Give up a run after this many seconds.
    #[arg(long, default_value_t = 600.0)]
    pub timeout: f64,
    /// Bearer token for --url / --peer-url.
    #[arg(long)]
    pub api_key: Option<String>,
    /// Write the JSON report here as well as printing it.
    #[arg(long)]
    pub json_out: Option<std::path::PathBuf>,
    /// Reward each finished request's choices (Flywheel's `POST /v1/feedback`; rewards 0, 0.5, 1
    /// in turn, so groups differ) and report the acknowledgement's latency (p50/p90/p99).
    #[arg(long, default_value_t = false)]
    pub feedback: bool,
}

pub const PROMPTS: &[&str] = &[
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
