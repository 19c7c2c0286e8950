//! The composition root: what `serve`, `generate`, `train` and `grad` run on is built here and
//! only here — the model and tokenizer, the compute pool, the adapter registry, the engine and
//! the trainer. `main.rs` parses the command line and calls one function of this file.

use crate::adapter::registry::Registry;
use crate::api::Ready;
use crate::config::{Config, PrecisionChoice};
use crate::engine::{Engine, EngineConfig};
use crate::generate::{GenerateOptions, GenerateOutput, BLOCK_SIZE};
use crate::metrics::Metrics;
use crate::model::decoder::Decoder;
use crate::model::gguf::WeightMemory;
use crate::model::tokenizer::Tokenizer;
use crate::online::start::Online;
use crate::online::trainer::Compute;
use crate::train::job::OfflineJob;
use anyhow::Context;
use flywheel_kernels::cpu::Precision;
use flywheel_kernels::{Cpu, Isa, ThreadPool};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

/// The model a command runs on.
#[derive(Clone, Debug)]
pub struct ModelSpec {
    /// A GGUF file (the default model is fetched on first use).
    pub path: PathBuf,
    /// Compute threads (None: one per core).
    pub threads: Option<usize>,
    /// The scalar reference kernels (slow; for checking).
    pub reference_kernels: bool,
    /// The arithmetic of the base's products.
    pub precision: PrecisionChoice,
    /// Where the weights live (2 MB pages or the file mapped).
    pub weights: WeightMemory,
}

/// A loaded model, its tokenizer and the compute pool.
pub struct Base {
    pub model: Arc<Decoder>,
    pub tokenizer: Arc<Tokenizer>,
    pub cpu: Arc<Cpu>,
}

/// The compute pool: `threads` (None: one per core) on the best kernels the CPU has, or the
/// scalar reference, with products in `precision`.
pub fn compute(
    threads: Option<usize>,
    reference: bool,
    precision: PrecisionChoice,
) -> anyhow::Result<Cpu> {
    let threads = threads.unwrap_or_else(|| {
        std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1)
    });
    let isa = if reference {
        Isa::Reference
    } else {
        Isa::detect()
    };
    let cpu = Cpu::new(isa, ThreadPool::new(threads, Duration::from_micros(100)));
    match precision {
        PrecisionChoice::Exact => Ok(cpu),
        PrecisionChoice::Bf16 => cpu
            .with_precision(Precision::Bf16)
            .map_err(|e| anyhow::anyhow!("precision bf16: {e}; use exact or auto")),
        PrecisionChoice::Int8 => cpu
            .with_precision(Precision::Int8)
            .map_err(|e| anyhow::anyhow!("precision int8: {e}; use exact or auto")),
        PrecisionChoice::Auto => {
            // Decided by the CPU, not by the kernels chosen: the reference kernels then emulate
            // what the fast ones run here.
            if Precision::Bf16.supported(Isa::detect()) {
                tracing::info!(
                    "precision auto: bf16 (AVX512_BF16); --precision exact for f32 products"
                );
                Ok(cpu.with_precision(Precision::Bf16).expect("supported"))
            } else {
                tracing::info!("precision auto: exact (this CPU lacks AVX512_BF16)");
                Ok(cpu)
            }
        }
    }
}

/// Says where the weights are (and whether the kernel really gave 2 MB pages).
fn log_weights(model: &Decoder) {
    let mb = model.gguf.bytes().len() as f64 / 1e6;
    if model.gguf.huge_pages() {
        let huge = std::fs::read_to_string("/proc/self/smaps_rollup")
            .ok()
            .and_then(|s| {
                s.lines()
                    .find(|l| l.starts_with("AnonHugePages:"))
                    .and_then(|l| l.split_whitespace().nth(1)?.parse::<f64>().ok())
            })
            .unwrap_or(0.0);
        tracing::info!(
            "weights: {mb:.1} MB read into memory in 2 MB pages ({:.1} MB of the process in huge pages)",
            huge / 1e3
        );
    } else {
        let why = model.gguf.why_mapped().map(|w| format!(": {w}"));
        tracing::info!(
            "weights: {mb:.1} MB mapped from the file (4 KB pages){}",
            why.unwrap_or_default()
        );
    }
}

impl Base {
    pub fn load(spec: &ModelSpec) -> anyhow::Result<Base> {
        let path = crate::fetch::ensure_model(&spec.path)?;
        let model = Decoder::open_in(&path, spec.weights)
            .with_context(|| format!("loading {}", path.display()))?;
        log_weights(&model);
        let tokenizer = Tokenizer::from_gguf(&model.gguf).context("building the tokenizer")?;
        Ok(Base {
            model: Arc::new(model),
            tokenizer: Arc::new(tokenizer),
            cpu: Arc::new(compute(
                spec.threads,
                spec.reference_kernels,
                spec.precision,
            )?),
        })
    }
}

/// `flywheel serve`.
pub fn serve(cfg: Config) -> anyhow::Result<()> {
    crate::api::serve::run(cfg, serving)
}

/// `flywheel generate`: one request through an engine of its own, sized for it, through the
/// PEFT adapter folder `adapter` when given.
pub fn generate(
    base: &Base,
    prompt: &[u32],
    opts: &GenerateOptions,
    adapter: Option<&Path>,
    on_token: impl FnMut(u32),
) -> anyhow::Result<GenerateOutput> {
    anyhow::ensure!(!prompt.is_empty(), "the prompt is empty");
    let ctx = base.model.config.context_length;
    anyhow::ensure!(
        prompt.len() < ctx,
        "the prompt has {} tokens; the context holds {ctx}",
        prompt.len()
    );
    let mut opts = opts.clone();
    opts.max_tokens = opts.max_tokens.min(ctx - prompt.len());
    if let Some(dir) = adapter {
        let w = crate::adapter::peft::load(dir, &base.model.config)
            .with_context(|| format!("adapter {}", dir.display()))?;
        let reg = Registry::new(&base.model.config, Vec::new(), Arc::new(Metrics::new()));
        opts.adapter = Some(reg.publish("adapter", w)?.0);
    }
    let cfg = EngineConfig {
        max_num_seqs: 1,
        max_num_batched_tokens: 512,
        num_kv_blocks: (prompt.len() + opts.max_tokens + 1).div_ceil(BLOCK_SIZE),
        num_window_blocks: None,
        block_size: BLOCK_SIZE,
        enable_prefix_caching: false,
        max_pending_requests: 1,
        max_pending_per_client: 1,
    };
    let (engine, join) = Engine::start(
        base.model.clone(),
        base.tokenizer.clone(),
        base.cpu.clone(),
        cfg,
        Arc::new(Metrics::new()),
    )?;
    let eos = base.tokenizer.eos_id;
    crate::generate::generate(engine, join, eos, prompt, &opts, on_token)
}

/// `flywheel train`: run `job`, print each step's statistics as a JSON line, write the adapter
/// (PEFT) and optimizer state to `out` (which must not exist).
pub fn train(base: &Base, job: &OfflineJob, out: &Path) -> anyhow::Result<()> {
    anyhow::ensure!(!out.exists(), "--out {} already exists", out.display());
    let (w, opt) = crate::train::job::run(&base.model, &base.cpu, &base.tokenizer, job, |s| {
        println!("{}", serde_json::to_string(s)?);
        Ok(())
    })?;
    crate::adapter::peft::save(&w, out)?;
    opt.save(out)?;
    Ok(())
}

fn model_name(cfg: &Config) -> String {
    cfg.served_model_name.clone().unwrap_or_else(|| {
        cfg.model_path
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_else(|| "model".into())
    })
}

/// A training step's log-probs from the engine's device (`EngineHandle::logprobs`).
struct EngineScorer(crate::engine::EngineHandle);

impl crate::train::offline::Scorer for EngineScorer {
    fn logprobs(
        &self,
        seqs: &[crate::model::decoder::TrainSeq],
        adapter: Option<&crate::adapter::AdapterWeights>,
        temperature: f32,
    ) -> anyhow::Result<Vec<Vec<f32>>> {
        let adapter = adapter.map(|a| Arc::new(a.clone()));
        self.0
            .logprobs(seqs, adapter, temperature)
            .map_err(|e| anyhow::anyhow!("the serving device's training forward: {e}"))
    }
}

/// How the start-up log names a `--chat-template` value (a template's text is not printed).
fn chat_template_name(value: &str) -> &str {
    if value.contains("{{") || value.contains("{%") {
        "given inline"
    } else {
        value
    }
}

/// What `serve` runs on: the model, its registry (with the configured adapters), the trainer
/// when adapters learn, and the engine (blocking; `api::serve::run` calls it off the async
/// threads while answering 503).
pub fn serving(cfg: &Config, metrics: Arc<Metrics>) -> anyhow::Result<Ready> {
    let path = crate::fetch::ensure_model(&cfg.model_path)?;
    let mut model = Decoder::open_in(&path, cfg.weights)?;
    model.kv_dtype = cfg.kv_dtype;
    log_weights(&model);
    let mut tokenizer = Tokenizer::from_gguf(&model.gguf)?;
    match &cfg.chat_template {
        Some(t) => {
            let text = crate::model::chat_template::resolve(t)
                .map_err(|e| anyhow::anyhow!("model.chat_template: {e}"))?;
            tokenizer.set_chat_template(text);
            tracing::info!("chat template: {}", chat_template_name(t));
        }
        None if tokenizer.chat_template().is_none() => tracing::warn!(
            "the model has no chat template: chat requests are refused unless they send \
             'chat_template' (set one with --chat-template chatml|llama3|gemma|phi3|zephyr|mistral|FILE)"
        ),
        None => {}
    }
    let tokenizer = Arc::new(tokenizer);
    let c = &model.config;
    // The trainer runs on the CPU (with --device cuda its steps' log-probs come from the GPU's
    // forward, `EngineScorer`): serving stays there under auto until that is proven on a GPU.
    let cpu_reason = (!cfg.learn.is_empty())
        .then_some("adapters learn here and the trainer's backward runs on the CPU");
    let device = crate::engine::device::select(cfg.device, cpu_reason)?;
    // The CPU's cache keeps the sliding-window layers' K/V in a pool of their own.
    let windows = c
        .sliding_window
        .filter(|_| matches!(device, crate::engine::device::Device::Cpu))
        .map(|window| crate::config::WindowLayers {
            layers: (0..c.num_layers).filter(|&l| c.window(l).is_some()).count(),
            window,
        });
    let sized = match cfg.gpu_memory_utilization {
        Some(u) => {
            use crate::engine::device::{gpu_kv_cache, DeviceChoice, StepShape};
            let shape = StepShape {
                max_tokens: cfg.max_num_batched_tokens,
                max_seqs: cfg.max_num_seqs,
                block_size: cfg.block_size,
                int8: cfg.precision == crate::config::PrecisionChoice::Int8,
            };
            let kv = gpu_kv_cache(&device, &model, u, shape).map_err(|e| anyhow::anyhow!(e))?;
            if kv.is_none() {
                anyhow::ensure!(
                    cfg.device != DeviceChoice::Cpu,
                    "--gpu-memory-utilization sizes a GPU's KV cache; with --device cpu the KV \
                     cache is engine.kv_cache_mb"
                );
                tracing::warn!(
                    "--gpu-memory-utilization {u}: the engine runs on the CPU, whose KV cache is \
                     engine.kv_cache_mb ({} MiB)",
                    cfg.kv_cache_bytes >> 20
                );
            }
            kv
        }
        None => None,
    };
    let fit = match sized {
        Some(kv_cache_bytes) => crate::config::Config {
            kv_cache_bytes,
            kv_cache_from: "--gpu-memory-utilization",
            ..cfg.clone()
        }
        .fit_context(c.num_layers, c.kv_dim(), c.context_length, windows)?,
        None => cfg.fit_context(c.num_layers, c.kv_dim(), c.context_length, windows)?,
    };
    if let Some(note) = &fit.note {
        tracing::warn!("{note}");
    }
    let (max_model_len, num_kv_blocks) = (fit.max_model_len, fit.num_kv_blocks);
    if let (Some(w), Some(pool)) = (windows, fit.num_window_blocks) {
        tracing::info!(
            "KV cache: the {} sliding-window layers (window {}) keep {pool} blocks of their own; \
             the other {} layers {num_kv_blocks}",
            w.layers,
            w.window,
            c.num_layers - w.layers
        );
    }
    let vocab_size = c.vocab_size;
    let cpu = compute(Some(cfg.threads), false, cfg.precision)?;
    let ecfg = EngineConfig {
        max_num_seqs: cfg.max_num_seqs,
        max_num_batched_tokens: cfg.max_num_batched_tokens,
        num_kv_blocks,
        num_window_blocks: fit.num_window_blocks,
        block_size: cfg.block_size,
        enable_prefix_caching: cfg.enable_prefix_caching,
        max_pending_requests: cfg.max_pending_requests,
        max_pending_per_client: cfg.max_pending_per_client,
    };
    tracing::info!(
        model = %path.display(),
        layers = c.num_layers,
        max_model_len,
        num_kv_blocks,
        isa = ?cpu.isa,
        threads = cfg.threads,
        "model loaded"
    );
    tracing::info!("cpu paths: {}", cpu.paths());
    let name = model_name(cfg);
    let registry = Arc::new(
        Registry::new(c, vec![name.clone()], metrics.clone()).with_limits(cfg.adapter_limits),
    );
    for (adapter, dir) in &cfg.adapters {
        let w = crate::adapter::peft::load_within(dir, c, &registry.limits)
            .map_err(|e| anyhow::anyhow!("adapter {adapter} ({}): {e}", dir.display()))?;
        registry
            .publish(adapter, w)
            .map_err(|e| anyhow::anyhow!("adapter {adapter}: {e}"))?;
        tracing::info!(adapter, path = %dir.display(), "adapter loaded");
    }
    let model = Arc::new(model);
    let cpu = Arc::new(cpu);
    let on_gpu = device.name() != "cpu";
    let (engine, _join) = Engine::start_on(
        model.clone(),
        tokenizer.clone(),
        cpu.clone(),
        ecfg,
        metrics.clone(),
        device,
    )?;
    let compute = Compute {
        model: model.clone(),
        tokenizer: tokenizer.clone(),
        cpu: cpu.clone(),
        registry: registry.clone(),
        evaluator: Default::default(),
        scorer: Default::default(),
    };
    if on_gpu && model.config.final_softcap.is_some() {
        // Gemma 2: the GPU's logits come back uncapped and the host caps and samples them.
        tracing::info!(
            "training: the steps' log-probs on the CPU (this model's logits are soft-capped on \
             the host: within f32 rounding of the GPU's served ones)"
        );
    } else if on_gpu {
        // The training steps' log-probs from the kernels that serve (the backward stays the
        // CPU's, from its own forward).
        let _ = compute.scorer.set(Arc::new(EngineScorer(engine.clone())));
        tracing::info!(
            "training: the steps' log-probs from the GPU's forward between serving steps (the \
             served ones, bit for bit); their backward on the CPU"
        );
    }
    let online = Online::new(cfg.online.clone(), compute, metrics.clone());
    if !cfg.learn.is_empty() {
        online.start_with(&cfg.learn)?;
    }
    Ok(Ready {
        engine,
        tokenizer,
        model_name: name,
        max_model_len,
        vocab_size,
        created: crate::util::unix_now(),
        registry,
        model,
        cpu,
        online,
        metrics,
        grammars: Default::default(),
    })
}
