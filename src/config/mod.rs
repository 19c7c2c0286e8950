//! Configuration: a TOML file (`configs/serve.toml` documents every key and its default) with CLI
//! flags on top, validated once at start-up into `Config`. Nothing downstream re-checks it.

use crate::model::kv_cache::KvDtype;
use serde::Deserialize;
use std::path::{Path, PathBuf};

/// The file as written: every key optional, unknown keys rejected (a typo is an error, not a
/// silently ignored setting).
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawConfig {
    #[serde(default)]
    pub server: RawServer,
    #[serde(default)]
    pub model: RawModel,
    #[serde(default)]
    pub engine: RawEngine,
    /// Adapters to load at start-up: NAME = "PEFT folder".
    #[serde(default)]
    pub adapters: std::collections::BTreeMap<String, PathBuf>,
    #[serde(default)]
    pub online: crate::online::config::RawOnline,
    /// Learning adapters (`[[learn]]` tables).
    #[serde(default)]
    pub learn: Vec<crate::online::config::RawLearn>,
    #[serde(default)]
    pub limits: RawLimits,
}

/// `[limits]`: what one request or file may make an adapter allocate.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawLimits {
    pub max_lora_rank: Option<usize>,
    pub max_oft_block_size: Option<usize>,
    pub max_adapter_params: Option<usize>,
    pub max_adapter_file_mb: Option<u64>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawServer {
    pub host: Option<String>,
    pub port: Option<u16>,
    pub api_key: Option<String>,
    pub admin_key: Option<String>,
    pub served_model_name: Option<String>,
    pub max_pending_requests: Option<usize>,
    pub max_pending_per_client: Option<usize>,
    pub max_sequences_per_request: Option<usize>,
    pub retry_after_secs: Option<u64>,
    pub shutdown_timeout_secs: Option<f64>,
    pub http_threads: Option<usize>,
    pub max_body_mb: Option<f64>,
    pub header_read_timeout_secs: Option<f64>,
    pub body_read_timeout_secs: Option<f64>,
    pub max_connections: Option<usize>,
    pub allowed_origins: Option<Vec<String>>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawModel {
    pub path: Option<PathBuf>,
    pub max_model_len: Option<usize>,
    pub threads: Option<usize>,
    pub precision: Option<String>,
    pub weights: Option<String>,
    pub chat_template: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawEngine {
    pub max_num_seqs: Option<usize>,
    pub max_num_batched_tokens: Option<usize>,
    pub kv_cache_mb: Option<usize>,
    pub gpu_memory_utilization: Option<f64>,
    pub kv_cache_dtype: Option<String>,
    pub block_size: Option<usize>,
    pub enable_prefix_caching: Option<bool>,
    pub device: Option<String>,
}

/// Flags given on the command line (`flywheel serve`'s): they win over the file.
#[derive(Debug, Default, Clone, clap::Args)]
pub struct CliOverrides {
    /// GGUF model file (overrides model.path; the default model is fetched on first use).
    #[arg(long)]
    pub model: Option<PathBuf>,
    #[arg(long)]
    pub host: Option<String>,
    /// 0 picks a free port.
    #[arg(long)]
    pub port: Option<u16>,
    /// Require `Authorization: Bearer KEY` on the API routes.
    #[arg(long, env = "FLYWHEEL_API_KEY")]
    pub api_key: Option<String>,
    /// Key of the admin routes (adapters). Without one they are open only on loopback.
    #[arg(long, env = "FLYWHEEL_ADMIN_KEY")]
    pub admin_key: Option<String>,
    /// Preload a PEFT adapter folder as NAME (repeatable).
    #[arg(long = "adapter", value_name = "NAME=PATH", value_parser = parse_named_path)]
    pub adapters: Vec<(String, PathBuf)>,
    /// Make NAME a learning adapter (repeatable): created as the identity (OFT b=32 on all
    /// seven projections) or resumed from its last checkpoint; completions through it are
    /// logged, rewarded on /v1/feedback and trained on.
    #[arg(long = "learn", value_name = "NAME")]
    pub learn: Vec<String>,
    /// Where the rollout log and checkpoints live (overrides online.data_dir; default data).
    #[arg(long)]
    pub data_dir: Option<PathBuf>,
    /// Where the rollout log lives (overrides online.rollout_store): a postgres:// URL shared
    /// by several servers; default SQLite in the data directory.
    #[arg(long, env = "FLYWHEEL_ROLLOUT_STORE")]
    pub rollout_store: Option<String>,
    /// Where adapter versions are published (overrides online.adapter_store):
    /// file:///shared/dir or s3://bucket/prefix; default only the data directory. S3
    /// settings from AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN,
    /// AWS_REGION, AWS_ENDPOINT, AWS_ALLOW_HTTP or [online.adapter_store_options].
    #[arg(long, env = "FLYWHEEL_ADAPTER_STORE")]
    pub adapter_store: Option<String>,
    /// all (serve and train, the default) | train | serve (follow the trainer's versions
    /// through the shared rollout store; never train). Overrides online.role.
    #[arg(long, env = "FLYWHEEL_ROLE")]
    pub role: Option<String>,
    /// Arithmetic of the base's products, serving and training alike: auto (the default: bf16
    /// with AVX512_BF16, else exact), exact (f32), bf16 (AVX512_BF16) or int8 (8-bit
    /// activations). Overrides model.precision.
    #[arg(long)]
    pub precision: Option<String>,
    /// Where the weights live: huge_pages (2 MB pages, the default) or mmap (the file
    /// mapped, its page cache shared). Overrides model.weights.
    #[arg(long)]
    pub weights: Option<String>,
    /// The chat template, replacing the GGUF's (or for a file without one, such as a base
    /// model's): chatml, llama3, gemma, phi3, zephyr, mistral, a file, or the template's
    /// text. Overrides model.chat_template.
    #[arg(long)]
    pub chat_template: Option<String>,
    /// The longest sequence (prompt and completion) served; default the model's context,
    /// fitted to engine.kv_cache_mb. Overrides model.max_model_len.
    #[arg(long)]
    pub max_model_len: Option<usize>,
    /// Web origins whose pages may call the server (CORS), comma-separated: an origin
    /// (https://app.example) or '*'. Default: none but the server's own; a browser's request
    /// from another origin is a 403. Overrides server.allowed_origins.
    #[arg(long, value_delimiter = ',')]
    pub allowed_origins: Option<Vec<String>>,
    /// On a GPU: the share of its memory this server may take (vLLM's flag), the KV cache sized
    /// to what the weights and a step's buffers leave of it, in place of engine.kv_cache_mb
    /// (which stays the CPU's). Overrides engine.gpu_memory_utilization.
    #[arg(long)]
    pub gpu_memory_utilization: Option<f64>,
    /// What the KV cache stores: f16 (the default, half the memory) or f32. Overrides
    /// engine.kv_cache_dtype.
    #[arg(long)]
    pub kv_cache_dtype: Option<String>,
    /// Where the model runs: cpu, cuda (an NVIDIA GPU; builds with --features cuda) or auto (the
    /// GPU where the build has CUDA and one is usable and no adapter learns, else the CPU; the
    /// start-up log says which and why). Overrides engine.device.
    #[arg(long, env = "FLYWHEEL_DEVICE")]
    pub device: Option<String>,
}

/// `--adapter NAME=PATH`.
fn parse_named_path(s: &str) -> Result<(String, PathBuf), String> {
    let (n, p) = s
        .split_once('=')
        .ok_or_else(|| format!("'{s}': expected NAME=PATH"))?;
    if n.is_empty() || p.is_empty() {
        return Err(format!("'{s}': expected NAME=PATH"));
    }
    Ok((n.to_string(), PathBuf::from(p)))
}

#[derive(Clone, Debug)]
pub struct Config {
    pub host: String,
    pub port: u16,
    /// Bearer token every /v1 request must carry; None: open.
    pub api_key: Option<String>,
    /// Bearer token of the admin routes (loading, creating, exporting, deleting adapters). None:
    /// admin routes are open on a loopback-only server and refused otherwise.
    pub admin_key: Option<String>,
    /// Adapters loaded at start-up (name, PEFT folder).
    pub adapters: Vec<(String, PathBuf)>,
    /// The model id clients send; None: the GGUF file's stem.
    pub served_model_name: Option<String>,
    /// Requests queued or running at once (a request of several prompts is one); more are
    /// answered 429.
    pub max_pending_requests: usize,
    /// Requests one client (bearer key) may have queued or running; more are answered 429, so
    /// that one client never holds the whole server. Default: three quarters of
    /// `max_pending_requests`.
    pub max_pending_per_client: usize,
    /// Sequences (prompts × n) one request may hold; more are answered 400.
    pub max_sequences_per_request: usize,
    pub retry_after_secs: u64,
    /// After SIGTERM/SIGINT: how long running requests may take to finish.
    pub shutdown_timeout_secs: f64,
    pub http_threads: usize,
    /// Largest request body accepted (bytes); larger ones get 413.
    pub max_body_bytes: usize,
    /// A connection that has not sent a whole request head in this long is closed.
    pub header_read_timeout_secs: f64,
    /// A request whose body has not arrived whole in this long gets 408.
    pub body_read_timeout_secs: f64,
    /// Connections open at once; more wait in the listen backlog.
    pub max_connections: usize,
    /// Web origins (`https://app.example`, or `*`) whose pages may call the server (CORS);
    /// requests a browser sends from other origins are refused. Default: none but the server's
    /// own.
    pub allowed_origins: Vec<String>,
    pub model_path: PathBuf,
    /// None: the model's own context length, fitted to the KV cache.
    pub max_model_len: Option<usize>,
    /// The chat template replacing the GGUF's (a built-in name, a file or the template itself,
    /// resolved by `model::chat_template::resolve`); None: the GGUF's.
    pub chat_template: Option<String>,
    pub threads: usize,
    /// The arithmetic of the base's products (model.precision: exact, bf16, int8 or auto).
    pub precision: PrecisionChoice,
    /// Where the weights live (model.weights: huge_pages or mmap).
    pub weights: crate::model::gguf::WeightMemory,
    pub max_num_seqs: usize,
    pub max_num_batched_tokens: usize,
    /// What K and V are stored as (f16 by default: half the memory of f32, train = serve kept).
    pub kv_dtype: KvDtype,
    /// Where the forwards run (engine.device: cpu, cuda or auto).
    pub device: crate::engine::device::DeviceChoice,
    pub kv_cache_bytes: usize,
    /// What set `kv_cache_bytes`, for messages: engine.kv_cache_mb, or --gpu-memory-utilization
    /// where `serve` sized a GPU's cache.
    pub kv_cache_from: &'static str,
    /// On a GPU: the share of its memory the server may take, the KV cache sized to what the
    /// rest leaves (`engine::device::gpu_kv_bytes`) in place of `kv_cache_bytes` (the CPU's).
    pub gpu_memory_utilization: Option<f64>,
    pub block_size: usize,
    pub enable_prefix_caching: bool,
    pub online: crate::online::config::OnlineConfig,
    pub learn: Vec<crate::online::config::LearnConfig>,
    pub adapter_limits: crate::adapter::AdapterLimits,
}

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("reading {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: {source}")]
    Parse {
        path: PathBuf,
        source: toml::de::Error,
    },
    #[error("invalid setting {key}: {message}")]
    Invalid { key: &'static str, message: String },
    #[error("invalid setting {0}")]
    Online(#[from] crate::online::config::InvalidSetting),
}

fn invalid(key: &'static str, message: impl Into<String>) -> ConfigError {
    ConfigError::Invalid {
        key,
        message: message.into(),
    }
}

impl RawConfig {
    pub fn from_file(path: &Path) -> Result<RawConfig, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        RawConfig::from_toml(&text).map_err(|source| ConfigError::Parse {
            path: path.to_path_buf(),
            source,
        })
    }

    pub fn from_toml(text: &str) -> Result<RawConfig, toml::de::Error> {
        toml::from_str(text)
    }

    /// Apply the CLI flags and defaults, and check every value.
    pub fn validate(self, cli: &CliOverrides) -> Result<Config, ConfigError> {
        let (s, m, e) = (self.server, self.model, self.engine);
        let mut raw_online = self.online;
        if let Some(s) = &cli.rollout_store {
            raw_online.rollout_store = Some(s.clone());
        }
        if let Some(s) = &cli.adapter_store {
            raw_online.adapter_store = Some(s.clone());
        }
        if let Some(r) = &cli.role {
            raw_online.role = Some(r.clone());
        }
        let mut online = raw_online.validate()?;
        if let Some(d) = &cli.data_dir {
            online.data_dir = d.clone();
        }
        let mut raw_learn = self.learn;
        for n in &cli.learn {
            if !raw_learn.iter().any(|l| &l.name == n) {
                raw_learn.push(crate::online::config::RawLearn::named(n));
            }
        }
        let mut learn: Vec<crate::online::config::LearnConfig> = Vec::new();
        for l in raw_learn {
            let c = l
                .validate()
                .map_err(|(k, msg)| invalid("learn", format!("{k}: {msg}")))?;
            if learn.iter().any(|o| o.name == c.name) {
                return Err(invalid("learn", format!("'{}' is listed twice", c.name)));
            }
            learn.push(c);
        }
        let precision = match cli.precision.clone().or(m.precision) {
            None => PrecisionChoice::default(),
            Some(p) => p.parse().map_err(|e| invalid("model.precision", e))?,
        };
        let weights = match cli.weights.clone().or(m.weights) {
            None => Default::default(),
            Some(w) => w.parse().map_err(|e| invalid("model.weights", e))?,
        };
        let cfg = Config {
            precision,
            weights,
            host: cli.host.clone().or(s.host).unwrap_or("127.0.0.1".into()),
            port: cli.port.or(s.port).unwrap_or(8080),
            api_key: cli.api_key.clone().or(s.api_key).filter(|k| !k.is_empty()),
            admin_key: cli
                .admin_key
                .clone()
                .or(s.admin_key)
                .filter(|k| !k.is_empty()),
            adapters: {
                let mut a: Vec<(String, PathBuf)> = self.adapters.into_iter().collect();
                for (n, p) in &cli.adapters {
                    a.retain(|(m, _)| m != n);
                    a.push((n.clone(), p.clone()));
                }
                a
            },
            served_model_name: s.served_model_name.filter(|n| !n.is_empty()),
            max_pending_requests: s.max_pending_requests.unwrap_or(256),
            max_pending_per_client: s.max_pending_per_client.unwrap_or_else(|| {
                let total = s.max_pending_requests.unwrap_or(256);
                (total * 3).div_ceil(4).max(1)
            }),
            max_sequences_per_request: s.max_sequences_per_request.unwrap_or(256),
            retry_after_secs: s.retry_after_secs.unwrap_or(1),
            shutdown_timeout_secs: s.shutdown_timeout_secs.unwrap_or(30.0),
            http_threads: s.http_threads.unwrap_or(1),
            max_body_bytes: (s.max_body_mb.unwrap_or(2.0) * (1 << 20) as f64) as usize,
            header_read_timeout_secs: s.header_read_timeout_secs.unwrap_or(10.0),
            body_read_timeout_secs: s.body_read_timeout_secs.unwrap_or(30.0),
            max_connections: s.max_connections.unwrap_or(512),
            allowed_origins: cli
                .allowed_origins
                .clone()
                .or(s.allowed_origins)
                .unwrap_or_default(),
            model_path: cli
                .model
                .clone()
                .or(m.path)
                .unwrap_or(PathBuf::from(crate::fetch::DEFAULT_MODEL)),
            max_model_len: cli.max_model_len.or(m.max_model_len),
            chat_template: cli.chat_template.clone().or(m.chat_template),
            threads: m.threads.unwrap_or_else(|| {
                std::thread::available_parallelism()
                    .map(|n| n.get())
                    .unwrap_or(1)
            }),
            max_num_seqs: e.max_num_seqs.unwrap_or(64),
            max_num_batched_tokens: e.max_num_batched_tokens.unwrap_or(256),
            kv_cache_bytes: e.kv_cache_mb.unwrap_or(1024) << 20,
            kv_cache_from: "engine.kv_cache_mb",
            gpu_memory_utilization: match cli.gpu_memory_utilization.or(e.gpu_memory_utilization) {
                Some(u) if !(u > 0.0 && u <= 1.0) => {
                    return Err(invalid(
                        "engine.gpu_memory_utilization",
                        format!("{u}: a share of the GPU's memory, in (0, 1]"),
                    ))
                }
                u => u,
            },
            kv_dtype: match cli.kv_cache_dtype.clone().or(e.kv_cache_dtype) {
                None => KvDtype::F16,
                Some(d) => d.parse().map_err(|e| invalid("engine.kv_cache_dtype", e))?,
            },
            device: match cli.device.clone().or(e.device) {
                None => Default::default(),
                Some(d) => d.parse().map_err(|e| invalid("engine.device", e))?,
            },
            block_size: e.block_size.unwrap_or(16),
            enable_prefix_caching: e.enable_prefix_caching.unwrap_or(true),
            online,
            learn,
            adapter_limits: {
                let d = crate::adapter::AdapterLimits::default();
                let l = self.limits;
                crate::adapter::AdapterLimits {
                    max_lora_rank: l.max_lora_rank.unwrap_or(d.max_lora_rank),
                    max_oft_block_size: l.max_oft_block_size.unwrap_or(d.max_oft_block_size),
                    max_params: l.max_adapter_params.unwrap_or(d.max_params),
                    max_file_bytes: l
                        .max_adapter_file_mb
                        .map_or(d.max_file_bytes, |mb| mb << 20),
                }
            },
        };
        if cfg.host.is_empty() {
            return Err(invalid("server.host", "empty"));
        }
        if cfg.max_pending_requests == 0 {
            return Err(invalid("server.max_pending_requests", "must be at least 1"));
        }
        if cfg.max_pending_per_client == 0 {
            return Err(invalid(
                "server.max_pending_per_client",
                "must be at least 1",
            ));
        }
        if cfg.max_sequences_per_request == 0 {
            return Err(invalid(
                "server.max_sequences_per_request",
                "must be at least 1",
            ));
        }
        if !(cfg.shutdown_timeout_secs >= 0.0 && cfg.shutdown_timeout_secs.is_finite()) {
            return Err(invalid("server.shutdown_timeout_secs", "must be >= 0"));
        }
        if cfg.max_body_bytes < 1024 {
            return Err(invalid(
                "server.max_body_mb",
                "must be at least 0.001 (1 KiB)",
            ));
        }
        for (key, v) in [
            (
                "server.header_read_timeout_secs",
                cfg.header_read_timeout_secs,
            ),
            ("server.body_read_timeout_secs", cfg.body_read_timeout_secs),
        ] {
            if !(v > 0.0 && v <= 3600.0) {
                return Err(invalid(key, "must be in (0, 3600]"));
            }
        }
        if let Some(o) = cfg
            .allowed_origins
            .iter()
            .find(|o| *o != "*" && !(o.starts_with("http://") || o.starts_with("https://")))
        {
            return Err(invalid(
                "server.allowed_origins",
                format!("'{o}' is not an origin (http://host[:port], https://... or *)"),
            ));
        }
        if cfg.max_connections == 0 {
            return Err(invalid("server.max_connections", "must be at least 1"));
        }
        if !(1..=64).contains(&cfg.http_threads) {
            return Err(invalid("server.http_threads", "must be in 1..=64"));
        }
        if !(1..=256).contains(&cfg.threads) {
            return Err(invalid("model.threads", "must be in 1..=256"));
        }
        if cfg.max_model_len == Some(0) {
            return Err(invalid("model.max_model_len", "must be at least 1"));
        }
        if cfg.max_num_seqs == 0 {
            return Err(invalid("engine.max_num_seqs", "must be at least 1"));
        }
        if cfg.max_num_batched_tokens == 0 {
            return Err(invalid(
                "engine.max_num_batched_tokens",
                "must be at least 1",
            ));
        }
        // Whole AVX-512 vectors of keys per block: the attention kernel's fast path.
        if !matches!(cfg.block_size, 16 | 32 | 64) {
            return Err(invalid("engine.block_size", "must be 16, 32 or 64"));
        }
        if cfg.kv_cache_bytes == 0 {
            return Err(invalid("engine.kv_cache_mb", "must be at least 1"));
        }
        Ok(cfg)
    }
}

/// `model.precision` / `--precision`: the arithmetic of the base's products, for serving and
/// training alike.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum PrecisionChoice {
    /// f32 products: exact math within f32 rounding (the opt-in for checks against f32 and f64
    /// references).
    Exact,
    /// BF16 products (`vdpbf16ps`); an error on a CPU without AVX512_BF16.
    Bf16,
    /// Int8 activations x the weights' codes (`vpdpbusd` with AVX512_VNNI, else AVX2's
    /// `vpmaddubsw`: the same bits).
    Int8,
    /// The default: the fastest of the above this CPU has for serving and training together —
    /// BF16 with AVX512_BF16, else exact (said in the start-up log; `app::compute`).
    #[default]
    Auto,
}

impl std::str::FromStr for PrecisionChoice {
    type Err = String;
    fn from_str(s: &str) -> Result<PrecisionChoice, String> {
        match s {
            "exact" => Ok(PrecisionChoice::Exact),
            "bf16" => Ok(PrecisionChoice::Bf16),
            "int8" => Ok(PrecisionChoice::Int8),
            "auto" => Ok(PrecisionChoice::Auto),
            _ => Err(format!("'{s}': expected exact, bf16, int8 or auto")),
        }
    }
}

mod fit;
pub use fit::{FittedContext, WindowLayers};

#[cfg(test)]
mod tests;
