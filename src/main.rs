//! The `flywheel` command line: `serve`, `generate`, `tokenize`, `bench`, `fetch-model`. Wiring only.

use anyhow::Context;
use clap::{Parser, Subcommand};
use flywheel::app::{Base, ModelSpec};
use flywheel::config::{CliOverrides, PrecisionChoice, RawConfig};
use flywheel::engine::sampler::SamplingParams;
use flywheel::fetch::{ensure_model, fetch_default, DEFAULT_MODEL};
use flywheel::generate::GenerateOptions;
use flywheel::model::gguf::WeightMemory;
use flywheel::model::tokenizer::{ChatMessage, Detokenizer, Tokenizer};
use flywheel::train::job::{OfflineJob, Start};

use std::io::{Read, Write};
use std::path::PathBuf;

#[derive(Parser)]
#[command(
    name = "flywheel",
    version,
    about = "An LLM server that learns from the rewards its users post back"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(clap::Args, Clone)]
struct ModelArgs {
    /// GGUF model file (the default model is fetched on first use).
    #[arg(long, default_value = DEFAULT_MODEL)]
    model: PathBuf,
    /// Compute threads (default: one per core).
    #[arg(long)]
    threads: Option<usize>,
    /// Run the scalar reference kernels (slow; for checking).
    #[arg(long)]
    reference_kernels: bool,
    /// Arithmetic of the base's products: auto (the fastest this CPU has: bf16 with
    /// AVX512_BF16, else exact), exact (f32), bf16 (AVX512_BF16) or int8 (8-bit activations).
    #[arg(long, default_value = "auto")]
    precision: PrecisionChoice,
    /// Where the weights live: huge_pages (read into 2 MB pages where the kernel offers them,
    /// else mapped) or mmap (mapped, 4 KB pages, the page cache shared between processes).
    #[arg(long, default_value = "huge_pages")]
    weights: WeightMemory,
}

// Parsed once per process: the size of `serve`'s flags does not matter.
#[allow(clippy::large_enum_variant)]
#[derive(Subcommand)]
enum Cmd {
    /// Serve the OpenAI-compatible API (prints `listening on ADDR` once bound).
    Serve {
        /// TOML configuration (see configs/serve.toml for every key and its default).
        #[arg(long)]
        config: Option<PathBuf>,
        #[command(flatten)]
        overrides: CliOverrides,
    },
    /// Generate text from a prompt.
    Generate {
        #[command(flatten)]
        m: ModelArgs,
        /// Raw prompt text (control tokens written in it are recognised).
        #[arg(long, group = "input")]
        prompt: Option<String>,
        /// One user message, wrapped in the model's chat template.
        #[arg(long, group = "input")]
        chat: Option<String>,
        /// A JSON array of {"role", "content"} messages, wrapped in the chat template.
        #[arg(long, group = "input")]
        messages: Option<String>,
        #[arg(long, default_value_t = 128)]
        max_tokens: usize,
        /// 0 is greedy.
        #[arg(long, default_value_t = 0.0)]
        temperature: f32,
        #[arg(long, default_value_t = 1.0)]
        top_p: f32,
        /// 0 disables.
        #[arg(long, default_value_t = 0)]
        top_k: usize,
        #[arg(long, default_value_t = 0)]
        seed: u64,
        /// Report this many alternatives per token (the HTTP API caps this at 20; the CLI allows 1000 for checks).
        #[arg(long, default_value_t = 0)]
        top_logprobs: usize,
        /// Print one JSON object instead of streaming text.
        #[arg(long)]
        json: bool,
        /// Run through this PEFT adapter folder (LoRA or OFT).
        #[arg(long)]
        adapter: Option<PathBuf>,
    },
    /// J = Σ log π(completion token | prefix) through a PEFT adapter and dJ/dθ for every adapter
    /// tensor (PEFT names and shapes, f32 safetensors).
    Grad {
        #[command(flatten)]
        m: ModelArgs,
        /// PEFT adapter folder.
        #[arg(long)]
        adapter: PathBuf,
        /// JSON file {"prompt_token_ids": [...], "completion_token_ids": [...]}.
        #[arg(long)]
        sample: PathBuf,
        /// Where to write the gradients.
        #[arg(long)]
        out: Option<PathBuf>,
    },
    /// Offline RL or SFT on a JSONL file; writes the adapter (PEFT) and optimizer state to --out,
    /// one JSON line of statistics per step.
    Train {
        #[command(flatten)]
        m: ModelArgs,
        /// PEFT folder to start from (its optimizer state too, when present).
        #[arg(long, conflicts_with = "new")]
        adapter: Option<PathBuf>,
        /// Start from a new identity adapter: oft (b=32) or lora (r=16) on all seven projections.
        #[arg(long)]
        new: Option<String>,
        /// JSONL: {"prompt_token_ids", "completion_token_ids", "reward", "group", "behavior_logprobs"?}.
        #[arg(long)]
        data: PathBuf,
        /// Output folder (must not exist).
        #[arg(long)]
        out: PathBuf,
        /// grpo | dapo | dr_grpo | gspo | masked_is | sft
        #[arg(long, default_value = "grpo")]
        loss: String,
        #[arg(long, default_value_t = 1e-4)]
        lr: f32,
        #[arg(long, default_value_t = 10)]
        steps: usize,
        /// Groups per step.
        #[arg(long, default_value_t = 1)]
        batch_groups: usize,
        #[arg(long, default_value_t = 0.0)]
        kl_coef: f32,
        /// The sampling temperature the log-probs are taken at.
        #[arg(long, default_value_t = 1.0)]
        temperature: f32,
        /// Memory for the activations a step keeps (layers beyond it are recomputed).
        #[arg(long, default_value_t = flywheel::model::decoder::ACTIVATION_BUDGET >> 20)]
        activation_mb: usize,
    },
    /// Print the token ids of the text on stdin.
    Tokenize {
        #[arg(long, default_value = DEFAULT_MODEL)]
        model: PathBuf,
        #[arg(long)]
        json: bool,
    },
    /// Write the model's tokenizer as Hugging Face files (tokenizer.json, tokenizer_config.json
    /// with the chat template) into DIR, for clients that tokenize themselves (verifiers, TRL).
    ExportTokenizer {
        #[arg(long, default_value = DEFAULT_MODEL)]
        model: PathBuf,
        /// Output folder (created if missing).
        out: PathBuf,
    },
    /// Prompt-processing and decode throughput (median of several runs).
    Bench {
        #[command(flatten)]
        m: ModelArgs,
        #[arg(long, default_value_t = 512)]
        prompt_tokens: usize,
        #[arg(long, default_value_t = 128)]
        decode_tokens: usize,
        /// Each decode sequence's prompt, in tokens: the context the decode steps attend to.
        #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u64).range(1..))]
        decode_context: u64,
        /// Decode batch sizes to measure.
        #[arg(long, value_delimiter = ',', default_value = "1,16")]
        batch: Vec<usize>,
        #[arg(long, default_value_t = 5)]
        runs: usize,
        /// Keep the other cores busy with a spinning thread (how the pool copes with a trainer).
        #[arg(long)]
        busy_peer: bool,
        /// Also run every test through an adapter, alternating with the base, and print the
        /// ratio: `oft` (b=32, all seven projections), `lora` (r=16, all seven), or a PEFT folder.
        #[arg(long)]
        adapter: Option<String>,
        /// Time full training steps (forward, backward, AdamW) instead: --batch sequences (first
        /// value) of --seq-len tokens through --adapter (default oft).
        #[arg(long)]
        train: bool,
        #[arg(long, default_value_t = 256)]
        seq_len: usize,
        /// Tokens of each training sequence that are prompt (not scored); default 1.
        #[arg(long, default_value_t = 1)]
        prompt_len: usize,
        /// All training sequences share one prompt, run once (a GRPO group).
        #[arg(long)]
        shared_prompt: bool,
        /// What the KV cache stores: f32 or f16 (the server's default).
        #[arg(long, default_value = "f32")]
        kv_cache_dtype: String,
        /// Memory for the activations a training step keeps (layers beyond it are recomputed).
        #[arg(long, default_value_t = flywheel::model::decoder::ACTIVATION_BUDGET >> 20)]
        activation_mb: usize,
        /// cpu, or cuda: the CUDA engine on GPU 0 (decode through graphs and eagerly, alternating;
        /// builds with --features cuda).
        #[arg(long, default_value = "cpu")]
        device: String,
    },
    /// Write a GGUF of a real model's shape with random weights (speed does not depend on the
    /// values): smollm2-135m (the default model's shape and formats), llama-1b, llama-3b (Llama
    /// 3.2 1B/3B), llama-8b (Llama 3.1 8B), qwen3-0.6b, qwen3-1.7b or qwen3-4b, in Q4_K_M's mix
    /// unless --quant says otherwise.
    RandomModel {
        #[arg(long)]
        shape: String,
        #[arg(long)]
        out: PathBuf,
        /// llama-quantize's preset: q4_k_m (the shape's own formats), q8_0 or q4_0.
        #[arg(long, default_value = "q4_k_m")]
        quant: String,
        #[arg(long, default_value_t = 1)]
        seed: u64,
    },
    /// Fetch the default model into models/ (skips the work when it is already there).
    FetchModel {
        #[arg(long, default_value = DEFAULT_MODEL)]
        dest: PathBuf,
    },
}

impl ModelArgs {
    fn spec(&self) -> ModelSpec {
        ModelSpec {
            path: self.model.clone(),
            threads: self.threads,
            reference_kernels: self.reference_kernels,
            precision: self.precision,
            weights: self.weights,
        }
    }
}

/// glibc's malloc serves blocks from 128 KB up with fresh `mmap`s (its threshold does not rise
/// here) and returns them on free, so every training step faulted in and zeroed its ~1.3 GB of
/// activations and gradients again: at 32 MB (glibc's most) they come from the heap and are
/// reused. A training step of 8 x 256 tokens (LoRA r=16, BF16; `flywheel bench --train`, AMD
/// Zen 4, 2 cores) took 6.2-6.4 s in 7 of 8 runs (one 7.7) instead of 7.0-8.3 s; prefill and
/// decode measured the same; peak memory 1.89 vs 1.87 GB.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn tune_malloc() {
    extern "C" {
        fn mallopt(param: i32, value: i32) -> i32;
    }
    const M_MMAP_THRESHOLD: i32 = -3;
    // SAFETY: mallopt only sets an allocator parameter; called before any other thread starts.
    if unsafe { mallopt(M_MMAP_THRESHOLD, 32 << 20) } != 1 {
        eprintln!("warning: mallopt(M_MMAP_THRESHOLD, 32 MB) refused; training steps run slower");
    }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn tune_malloc() {}

fn main() {
    tune_malloc();
    if let Err(e) = run(Cli::parse()) {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}

fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.cmd {
        Cmd::Serve { config, overrides } => {
            tracing_subscriber::fmt()
                .with_env_filter(
                    tracing_subscriber::EnvFilter::try_from_default_env()
                        .unwrap_or_else(|_| "info".into()),
                )
                .with_writer(std::io::stderr)
                .init();
            let raw = match &config {
                Some(p) => RawConfig::from_file(p)?,
                None => RawConfig::default(),
            };
            flywheel::app::serve(raw.validate(&overrides)?)
        }
        Cmd::FetchModel { dest } => fetch_default(&dest),
        Cmd::Train {
            m,
            adapter,
            new,
            data,
            out,
            loss,
            lr,
            steps,
            batch_groups,
            kl_coef,
            temperature,
            activation_mb,
        } => {
            let base = Base::load(&m.spec())?;
            let start = match (adapter, new) {
                (Some(dir), _) => Start::Folder(dir),
                (None, Some(kind)) => Start::New(kind),
                (None, None) => anyhow::bail!("give --adapter DIR or --new oft|lora"),
            };
            let job = OfflineJob {
                start,
                data,
                loss,
                lr,
                steps,
                groups_per_step: batch_groups,
                kl_coef,
                temperature,
                activation_budget: activation_mb << 20,
                base_model: m.model.display().to_string(),
            };
            flywheel::app::train(&base, &job, &out)
        }
        Cmd::Grad {
            m,
            adapter,
            sample,
            out,
        } => {
            let base = Base::load(&m.spec())?;
            let model = &base.model;
            let w = flywheel::adapter::peft::load(&adapter, &model.config)
                .with_context(|| format!("adapter {}", adapter.display()))?;
            let v: serde_json::Value = serde_json::from_str(
                &std::fs::read_to_string(&sample)
                    .with_context(|| format!("reading {}", sample.display()))?,
            )
            .context("--sample must be JSON")?;
            let ids = |k: &str| -> anyhow::Result<Vec<u32>> {
                v[k].as_array()
                    .with_context(|| format!("--sample: '{k}' must be a list of token ids"))?
                    .iter()
                    .map(|x| {
                        x.as_u64()
                            .map(|t| t as u32)
                            .with_context(|| format!("--sample: '{k}' holds a non-id"))
                    })
                    .collect()
            };
            let (prompt, completion) = (ids("prompt_token_ids")?, ids("completion_token_ids")?);
            anyhow::ensure!(!prompt.is_empty(), "--sample: the prompt is empty");
            let tokens = [prompt.clone(), completion].concat();
            let (j, logps, grads) =
                flywheel::train::objective_grad(model, &base.cpu, &w, &tokens, prompt.len())?;
            if let Some(out) = out {
                let bytes = flywheel::adapter::peft::values_to_safetensors(&w.layout, &grads)?;
                std::fs::write(&out, bytes)
                    .with_context(|| format!("writing {}", out.display()))?;
            }
            println!(
                "{}",
                serde_json::json!({"objective": j, "token_logprobs": logps})
            );
            Ok(())
        }
        Cmd::Tokenize { model, json } => {
            let path = ensure_model(&model)?;
            let g = flywheel::model::gguf::Gguf::open(&path)?;
            let tok = Tokenizer::from_gguf(&g)?;
            let mut text = String::new();
            std::io::stdin().read_to_string(&mut text)?;
            let ids = tok.encode(&text)?;
            if json {
                println!("{}", serde_json::json!({ "token_ids": ids }));
            } else {
                println!(
                    "{}",
                    ids.iter()
                        .map(|i| i.to_string())
                        .collect::<Vec<_>>()
                        .join(" ")
                );
            }
            Ok(())
        }
        Cmd::ExportTokenizer { model, out } => {
            let path = ensure_model(&model)?;
            let g = flywheel::model::gguf::Gguf::open(&path)?;
            let (json, config) = Tokenizer::from_gguf(&g)?.hf_files()?;
            std::fs::create_dir_all(&out).with_context(|| format!("creating {}", out.display()))?;
            for (name, text) in [
                ("tokenizer.json", json),
                (
                    "tokenizer_config.json",
                    serde_json::to_string_pretty(&config)?,
                ),
            ] {
                let p = out.join(name);
                std::fs::write(&p, text).with_context(|| format!("writing {}", p.display()))?;
            }
            println!("{}", out.display());
            Ok(())
        }
        Cmd::Generate {
            m,
            prompt,
            chat,
            messages,
            max_tokens,
            temperature,
            top_p,
            top_k,
            seed,
            top_logprobs,
            json,
            adapter,
        } => {
            anyhow::ensure!(temperature >= 0.0, "--temperature must be >= 0");
            anyhow::ensure!(top_p > 0.0 && top_p <= 1.0, "--top-p must be in (0, 1]");
            anyhow::ensure!(top_logprobs <= 1000, "--top-logprobs must be at most 1000");
            let base = Base::load(&m.spec())?;
            let tok = base.tokenizer.clone();
            let text = match (prompt, chat, messages) {
                (Some(p), None, None) => p,
                (None, Some(c), None) => tok.apply_chat_template(
                    &[ChatMessage {
                        role: "user".into(),
                        content: c,
                    }],
                    true,
                )?,
                (None, None, Some(js)) => {
                    let msgs: Vec<ChatMessage> = serde_json::from_str(&js)
                        .context("--messages must be a JSON array of {role, content}")?;
                    tok.apply_chat_template(&msgs, true)?
                }
                _ => anyhow::bail!("give one of --prompt, --chat or --messages"),
            };
            let prompt_ids = tok.encode(&text)?;
            let opts = GenerateOptions {
                max_tokens,
                sampling: SamplingParams {
                    temperature,
                    top_p,
                    top_k,
                    top_logprobs,
                    ..Default::default()
                },
                seed,
                adapter: None,
            };
            let mut detok = Detokenizer::default();
            let mut stdout = std::io::stdout();
            let isa = base.cpu.isa;
            let out =
                flywheel::app::generate(&base, &prompt_ids, &opts, adapter.as_deref(), |id| {
                    if !json {
                        let _ = write!(stdout, "{}", detok.push(&tok, id));
                        let _ = stdout.flush();
                    }
                })?;
            if json {
                let v = serde_json::json!({
                    "prompt_token_ids": prompt_ids,
                    "token_ids": out.token_ids,
                    "text": tok.decode(&out.token_ids),
                    "finish_reason": out.finish_reason,
                    "logprobs": out.logprobs,
                    "timings": out.timings,
                });
                println!("{v}");
            } else {
                println!("{}", detok.finish());
                let t = &out.timings;
                eprintln!(
                    "[{} prompt tokens at {:.1} tok/s, {} generated at {:.1} tok/s, finish: {}, kernels: {}]",
                    t.prompt_tokens, t.prompt_tokens_per_second, t.decode_tokens, t.decode_tokens_per_second, out.finish_reason, isa.name()
                );
            }
            Ok(())
        }
        Cmd::Bench {
            m,
            prompt_tokens,
            decode_tokens,
            decode_context,
            batch,
            runs,
            busy_peer,
            adapter,
            train,
            seq_len,
            prompt_len,
            shared_prompt,
            kv_cache_dtype,
            activation_mb,
            device,
        } => {
            let base = Base::load(&m.spec())?;
            let (model, tok, cpu) = (&*base.model, &*base.tokenizer, &*base.cpu);
            if train {
                let a = flywheel::bench::adapter_for(model, adapter.as_deref().unwrap_or("oft"))?;
                let b = batch.first().copied().unwrap_or(8);
                let shape = flywheel::bench::TrainShape {
                    batch: b,
                    seq_len,
                    prompt_len,
                    shared_prompt,
                    activation_budget: activation_mb << 20,
                };
                return flywheel::bench::run_train(model, cpu, a, &shape, runs.max(1));
            }
            let adapter = adapter
                .map(|a| flywheel::bench::adapter_for(model, &a))
                .transpose()?;
            let opts = flywheel::bench::BenchOptions {
                model_path: m.model.display().to_string(),
                prompt_tokens,
                decode_tokens,
                decode_context: decode_context as usize,
                batches: batch,
                runs: runs.max(1),
                busy_peer,
                adapter,
                kv_dtype: kv_cache_dtype
                    .parse()
                    .map_err(|e: String| anyhow::anyhow!(e))?,
            };
            match device.as_str() {
                "cpu" => flywheel::bench::run(model, tok, cpu, &opts),
                #[cfg(feature = "cuda")]
                "cuda" => {
                    let mut model = flywheel::model::decoder::Decoder::open(&m.model)?;
                    model.kv_dtype = opts.kv_dtype;
                    let int8 = cpu.precision() == flywheel_kernels::cpu::Precision::Int8;
                    flywheel::bench_gpu::run(&model, &opts, int8)
                }
                #[cfg(not(feature = "cuda"))]
                "cuda" => anyhow::bail!(
                    "--device cuda: this build has no CUDA engine (build with --features cuda)"
                ),
                d => anyhow::bail!("--device '{d}': expected cpu or cuda"),
            }
        }
        Cmd::RandomModel {
            shape,
            out,
            quant,
            seed,
        } => {
            let s = flywheel::model::random::shape(&shape)
                .and_then(|s| flywheel::model::random::with_quant(s, &quant))
                .map_err(|e| anyhow::anyhow!(e))?;
            flywheel::model::random::write(&s, seed)
                .write(&out)
                .with_context(|| format!("writing {}", out.display()))?;
            eprintln!(
                "wrote {} ({} layers, hidden {}, vocab {})",
                out.display(),
                s.layers,
                s.hidden,
                s.vocab
            );
            Ok(())
        }
    }
}
