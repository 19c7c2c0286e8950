//! Where the engine runs its forwards: the CPU (always), or a CUDA GPU (builds with the `cuda`
//! feature, on a machine with an NVIDIA driver and a GPU of sm_80 or later). `--device auto`
//! picks the GPU where one is usable and says at start-up why not otherwise.

use super::output::SeqOutput;
use super::sampler::{DeviceDraw, Sampled};
use super::scheduler::{Chunk, Scheduler};
use super::sequence::SeqId;
use super::EngineConfig;
use crate::adapter::AdapterWeights;
use crate::model::decoder::{BatchSeq, Decoder, ForwardBuffers, ModelError, TrainSeq};
use crate::model::kv_cache::KvCache;
use flywheel_kernels::Cpu;
use std::collections::HashMap;

/// What `--device` / `engine.device` asks for.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum DeviceChoice {
    /// The GPU where this build has CUDA and a GPU is usable, else the CPU.
    #[default]
    Auto,
    Cpu,
    Cuda,
}

impl std::str::FromStr for DeviceChoice {
    type Err = String;
    fn from_str(s: &str) -> Result<DeviceChoice, String> {
        match s {
            "auto" => Ok(DeviceChoice::Auto),
            "cpu" => Ok(DeviceChoice::Cpu),
            "cuda" => Ok(DeviceChoice::Cuda),
            _ => Err(format!("'{s}': expected cpu, cuda or auto")),
        }
    }
}

/// Why the engine cannot run where it was asked to.
#[derive(Debug, thiserror::Error)]
pub enum DeviceError {
    #[error("this build has no CUDA engine (build with `--features cuda`)")]
    NotBuilt,
    /// The driver or the GPU refused (no library, no device, too old a GPU).
    #[cfg(feature = "cuda")]
    #[error("{0}")]
    Gpu(#[from] flywheel_kernels::cuda::GpuError),
    /// `--device cuda` was asked for and cannot be honoured.
    #[error("--device cuda: {0}")]
    Requested(Box<DeviceError>),
    /// The model cannot be put on the GPU.
    #[cfg(feature = "cuda")]
    #[error("the CUDA engine: {0}")]
    Engine(#[from] crate::model::decoder::ModelError),
}

/// Where the engine runs, decided.
pub enum Device {
    Cpu,
    #[cfg(feature = "cuda")]
    Cuda(flywheel_kernels::cuda::Gpu),
}

impl Device {
    pub fn name(&self) -> &'static str {
        match self {
            Device::Cpu => "cpu",
            #[cfg(feature = "cuda")]
            Device::Cuda(_) => "cuda",
        }
    }
}

/// The GPU, or why this build or this machine has none usable.
fn open_gpu() -> Result<Device, DeviceError> {
    #[cfg(feature = "cuda")]
    {
        Ok(Device::Cuda(flywheel_kernels::cuda::Gpu::open(0)?))
    }
    #[cfg(not(feature = "cuda"))]
    {
        Err(DeviceError::NotBuilt)
    }
}

/// The device for `choice`; `cpu_reason` is why the CPU should serve even where a GPU is usable
/// (auto only; e.g. learning, whose trainer runs on the CPU). The line saying what was chosen
/// and why goes to the log; an explicit `cuda` that cannot be honoured is an error.
pub fn select(choice: DeviceChoice, cpu_reason: Option<&str>) -> Result<Device, DeviceError> {
    match choice {
        DeviceChoice::Cpu => {
            tracing::info!("device: cpu (--device cpu)");
            Ok(Device::Cpu)
        }
        DeviceChoice::Cuda => {
            let d = open_gpu().map_err(|why| DeviceError::Requested(Box::new(why)))?;
            if let Some(r) = cpu_reason {
                tracing::warn!("device: cuda although {r}");
            }
            Ok(d)
        }
        DeviceChoice::Auto => match (open_gpu(), cpu_reason) {
            (Ok(_), Some(r)) => {
                tracing::info!("device: cpu (auto: {r}; --device cuda to serve on the GPU)");
                Ok(Device::Cpu)
            }
            (Ok(d), None) => Ok(d),
            (Err(why), _) => {
                tracing::info!("device: cpu (auto: {why})");
                Ok(Device::Cpu)
            }
        },
    }
}

/// Room left for what the estimate of a GPU's use leaves out (decode graphs, adapters' slots,
/// the attention's scratch, the allocator's rounding).
pub const GPU_MEMORY_MARGIN: usize = 1 << 30;

/// What `--gpu-memory-utilization u` leaves the KV cache on a GPU of `total` bytes with `free`
/// of them free now: u of the total, less what is in use (total − free: other processes, this
/// process's CUDA context), the model's `weights`, a step's buffers `step` and
/// `GPU_MEMORY_MARGIN`. Err: how much is needed before any KV cache, and of what.
pub fn gpu_kv_bytes(
    u: f64,
    free: usize,
    total: usize,
    weights: usize,
    step: usize,
) -> Result<usize, String> {
    let budget = (u * total as f64) as usize;
    let used = total.saturating_sub(free);
    let need = used + weights + step + GPU_MEMORY_MARGIN;
    let gib = |b: usize| format!("{:.2}", b as f64 / (1u64 << 30) as f64);
    budget.checked_sub(need).filter(|&kv| kv > 0).ok_or_else(|| {
        format!(
            "--gpu-memory-utilization {u} gives {} GiB of the GPU's {}; {} GiB are taken before \
             any KV cache ({} in use already, the weights {}, a step's buffers {}, a margin of {}): \
             raise it, free the GPU, or set engine.kv_cache_mb",
            gib(budget),
            gib(total),
            gib(need),
            gib(used),
            gib(weights),
            gib(step),
            gib(GPU_MEMORY_MARGIN)
        )
    })
}

/// What a GPU's decoder is sized by besides the model (the fields of `GpuShape` that size its
/// step's buffers).
#[derive(Clone, Copy, Debug)]
pub struct StepShape {
    pub max_tokens: usize,
    pub max_seqs: usize,
    pub block_size: usize,
    pub int8: bool,
}

/// The KV cache's bytes under `--gpu-memory-utilization u` where `device` is a GPU
/// (`gpu_kv_bytes`: its memory now, the model's weights as stored, the step buffers a decoder of
/// `shape` allocates for the model's whole context), the start-up log saying how; None on the
/// CPU.
pub fn gpu_kv_cache(
    device: &Device,
    #[cfg_attr(not(feature = "cuda"), allow(unused_variables))] model: &Decoder,
    #[cfg_attr(not(feature = "cuda"), allow(unused_variables))] u: f64,
    #[cfg_attr(not(feature = "cuda"), allow(unused_variables))] shape: StepShape,
) -> Result<Option<usize>, String> {
    match device {
        Device::Cpu => Ok(None),
        #[cfg(feature = "cuda")]
        Device::Cuda(gpu) => {
            let (free, total) = gpu.memory().map_err(|e| e.to_string())?;
            let weights = model.gguf.bytes().len() - model.gguf.data_offset as usize;
            let c = &model.config;
            let step = crate::model::decoder::GpuDecoder::step_bytes(
                c,
                &crate::model::decoder::GpuShape {
                    num_kv_blocks: 0,
                    block_size: shape.block_size,
                    max_tokens: shape.max_tokens,
                    max_seqs: shape.max_seqs,
                    max_model_len: c.context_length,
                    graphs: true,
                    int8: shape.int8,
                    draws: true,
                },
            );
            let kv = gpu_kv_bytes(u, free, total, weights, step)?;
            let mib = |b: usize| b >> 20;
            tracing::info!(
                "KV cache: {} MiB of the GPU (--gpu-memory-utilization {u} of {} MiB; {} MiB in \
                 use before, the weights {} MiB, a step's buffers {} MiB, a margin of {} MiB)",
                mib(kv),
                mib(total),
                mib(total - free),
                mib(weights),
                mib(step),
                mib(GPU_MEMORY_MARGIN)
            );
            Ok(Some(kv))
        }
    }
}

/// Where the forwards run and the KV cache lives.
pub(super) enum Backend {
    Cpu(KvCache),
    #[cfg(feature = "cuda")]
    Gpu(Box<crate::model::decoder::GpuDecoder>),
}

/// What the device does with a row of logits the step makes (`device_rows`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) enum DeviceRow {
    /// Its logits come back, for the host (prompt scoring; scoring only).
    Logits,
    /// Its logits come back with the log-sum-exp of logits / T (T the choice's temperature) that
    /// the device's log-softmax subtracts: the host samples it (penalties, a grammar, sibling
    /// choices to fork off it) with the device's log-probs (`sampler::sample_row`).
    Normalized(f32),
    /// The device draws its token.
    Drawn(DeviceDraw),
}

/// What the device gave back besides the logits: the drawn rows' tokens and the normalized rows'
/// log-sum-exps, each in the order of their rows.
#[derive(Default)]
pub(super) struct DeviceRows {
    pub drawn: Vec<Sampled>,
    pub lse: Vec<f32>,
}

/// For each row of logits the step of `chunks` makes, what `backend` does with it: a choice's
/// row whose draw the device's rule covers is drawn there (`SeqOutput::device_draw`, which takes
/// the draw's uniform from the choice's stream), a choice's other rows normalized there; empty
/// where `backend` draws nothing (the CPU; a GPU whose logits the host caps).
pub(super) fn device_rows(
    backend: &Backend,
    chunks: &[Chunk],
    sched: &Scheduler,
    outputs: &mut HashMap<SeqId, SeqOutput>,
) -> Vec<DeviceRow> {
    let draws_tokens = match backend {
        Backend::Cpu(_) => false,
        #[cfg(feature = "cuda")]
        Backend::Gpu(g) => g.draws(),
    };
    if !draws_tokens {
        return Vec::new();
    }
    let mut rows = Vec::new();
    for c in chunks {
        let s = sched.get(c.seq).expect("scheduled sequence exists");
        // The rows `Engine::step` asks logits for: none for embeddings, every row for prompt
        // scoring (the host scores them), the last for a token.
        if s.embed {
            continue;
        }
        if super::scores_prompt(s, c) {
            rows.extend(std::iter::repeat_n(DeviceRow::Logits, c.len));
        } else if c.wants_logits {
            rows.push(match outputs.get_mut(&c.seq) {
                Some(o) => match o.device_draw() {
                    Some(d) => DeviceRow::Drawn(d),
                    None if o.req.req.max_tokens > 0 => {
                        DeviceRow::Normalized(o.req.req.sampling.temperature)
                    }
                    None => DeviceRow::Logits,
                },
                None => DeviceRow::Logits,
            });
        }
    }
    if rows.iter().all(|r| *r == DeviceRow::Logits) {
        rows.clear();
    }
    rows
}

/// The step's forward on `backend`: the logits (and hidden rows) in `bufs`, but for the rows
/// `rows` has drawn (one entry per row of logits, or none), whose tokens come back in order, and
/// the log-sum-exps of the rows it has normalized.
pub(super) fn forward(
    backend: &mut Backend,
    model: &Decoder,
    cpu: &Cpu,
    batch: &[BatchSeq],
    bufs: &mut ForwardBuffers,
    rows: &[DeviceRow],
) -> Result<DeviceRows, ModelError> {
    match backend {
        Backend::Cpu(cache) => {
            debug_assert!(rows.is_empty(), "the CPU draws no tokens in its forward");
            model.forward_into(cpu, cache, batch, bufs)?;
            Ok(DeviceRows::default())
        }
        #[cfg(feature = "cuda")]
        Backend::Gpu(g) => {
            use crate::model::decoder::{RowOut, RowsBack};
            use flywheel_kernels::cuda::DrawSpec;
            // A vocabulary smaller than the alternatives asked for gives all it has, as the
            // host's sampler does.
            let vocab = model.config.vocab_size;
            let outs: Vec<RowOut> = rows
                .iter()
                .enumerate()
                .map(|(row, r)| match *r {
                    DeviceRow::Logits => RowOut::Logits,
                    // The sampler scales by 1/T only where T is neither greedy's nor 1.
                    DeviceRow::Normalized(t) => {
                        RowOut::Normalized((!crate::policy::is_greedy(t) && t != 1.0).then_some(t))
                    }
                    DeviceRow::Drawn(d) => RowOut::Drawn(DrawSpec {
                        row: row as u32,
                        sample: d.sample,
                        top: d.top.min(vocab),
                        truncate: d.truncate,
                    }),
                })
                .collect();
            let mut back = RowsBack::default();
            g.forward_drawing(model, batch, &outs, bufs, &mut back)?;
            let drawn = back
                .drawn
                .iter()
                .zip(rows.iter().filter_map(|r| match r {
                    DeviceRow::Drawn(d) => Some(d),
                    _ => None,
                }))
                .map(|(r, d)| d.sampled(r.token, r.logprob, r.kept, &r.top))
                .collect();
            Ok(DeviceRows {
                drawn,
                lse: back.lse,
            })
        }
    }
}

/// A training forward's bounds on `backend`: None on the CPU (a batch at once, in a cache of its
/// own); on a GPU (the most tokens a step holds, the tokens of a KV block): parts of it in blocks
/// of the engine's cache.
pub(super) fn score_bounds(backend: &Backend) -> Option<(usize, usize)> {
    match backend {
        Backend::Cpu(_) => None,
        #[cfg(feature = "cuda")]
        Backend::Gpu(g) => Some(g.step_bounds()),
    }
}

/// The log-probs of `seqs`' completion tokens on `backend` (`Decoder::logprobs` or
/// `GpuDecoder::logprobs`, in `blocks` of the engine's cache there).
#[allow(clippy::too_many_arguments)]
pub(super) fn score(
    backend: &mut Backend,
    model: &Decoder,
    cpu: &Cpu,
    seqs: &[TrainSeq],
    #[cfg_attr(not(feature = "cuda"), allow(unused_variables))] blocks: &[u32],
    adapter: Option<&AdapterWeights>,
    temperature: f32,
) -> Result<Vec<Vec<f32>>, ModelError> {
    match backend {
        Backend::Cpu(_) => model.logprobs(cpu, seqs, adapter, temperature),
        #[cfg(feature = "cuda")]
        Backend::Gpu(g) => g.logprobs(model, seqs, blocks, adapter, temperature),
    }
}

/// The window pool the block manager keeps for `backend`'s cache: (window, blocks), where its
/// sliding-window layers hold their own blocks (the CPU's cache; the GPU's takes one pool).
pub(super) fn window_pool(
    model: &Decoder,
    cfg: &EngineConfig,
    backend: &Backend,
) -> Option<(usize, usize)> {
    match backend {
        Backend::Cpu(_) => Some((model.config.sliding_window?, cfg.num_window_blocks?)),
        #[cfg(feature = "cuda")]
        Backend::Gpu(_) => None,
    }
}

/// The KV cache (and, on a GPU, the model's copy there) on `device`.
/// `precision`: the CPU's products' arithmetic, which the GPU's follow where it has them (int8;
/// bf16 is the CPU's alone: the GPU's products then run in f32, and the log says so).
pub(super) fn backend(
    model: &Decoder,
    cfg: &EngineConfig,
    device: Device,
    #[cfg_attr(not(feature = "cuda"), allow(unused_variables))]
    precision: flywheel_kernels::cpu::Precision,
) -> Result<Backend, DeviceError> {
    let c = &model.config;
    match device {
        Device::Cpu => Ok(Backend::Cpu(
            match (cfg.num_window_blocks, c.sliding_window) {
                (Some(n), Some(_)) => KvCache::with_window_pool(
                    c.kv_dim(),
                    cfg.block_size,
                    cfg.num_kv_blocks,
                    model.kv_dtype,
                    (0..c.num_layers).map(|l| c.window(l).is_some()).collect(),
                    n,
                ),
                _ => KvCache::with_dtype(
                    c.num_layers,
                    c.kv_dim(),
                    cfg.block_size,
                    cfg.num_kv_blocks,
                    model.kv_dtype,
                ),
            },
        )),
        #[cfg(feature = "cuda")]
        Device::Cuda(gpu) => {
            let shape = crate::model::decoder::GpuShape {
                num_kv_blocks: cfg.num_kv_blocks,
                block_size: cfg.block_size,
                max_tokens: cfg.max_num_batched_tokens,
                max_seqs: cfg.max_num_seqs,
                max_model_len: c.context_length,
                graphs: std::env::var("FLYWHEEL_CUDA_GRAPHS").as_deref() != Ok("0"),
                int8: precision == flywheel_kernels::cpu::Precision::Int8,
                draws: std::env::var("FLYWHEEL_CUDA_SAMPLING").as_deref() != Ok("0"),
            };
            if precision == flywheel_kernels::cpu::Precision::Bf16 {
                tracing::info!(
                    "precision bf16 is the CPU's: the GPU's products run in f32 (--precision \
                     int8 runs them in int8 there too)"
                );
            }
            let g = crate::model::decoder::GpuDecoder::new(gpu, model, shape)?;
            tracing::info!(
                "device: cuda, {} ({} KV blocks of {}, decode graphs {}, tokens drawn {})",
                g.describe(),
                cfg.num_kv_blocks,
                cfg.block_size,
                if shape.graphs {
                    "on"
                } else {
                    "off (FLYWHEEL_CUDA_GRAPHS=0)"
                },
                match (g.draws(), shape.draws) {
                    (true, _) => "on the GPU",
                    (false, true) => "on the host (the logits' final soft-cap is the host's)",
                    (false, false) => "on the host (FLYWHEEL_CUDA_SAMPLING=0)",
                }
            );
            Ok(Backend::Gpu(Box::new(g)))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The KV cache under `--gpu-memory-utilization`: u of the total less what is in use, the
    /// weights, a step's buffers and the margin; an error naming each where nothing is left.
    #[test]
    fn the_gpu_memory_utilization_leaves_the_kv_cache_the_rest() {
        let gib = 1usize << 30;
        // 80 GiB, 1 GiB in use, 16 GiB of weights, 2 GiB of step buffers: 0.9 gives 72 GiB, 20
        // of them taken, 52 left (rounded down to the byte).
        let kv = gpu_kv_bytes(0.9, 79 * gib, 80 * gib, 16 * gib, 2 * gib).unwrap();
        let budget = (0.9 * (80 * gib) as f64) as usize;
        assert_eq!(kv, budget - (gib + 16 * gib + 2 * gib + GPU_MEMORY_MARGIN));
        // Another process holding 39 GiB more leaves 39 GiB less; 0.2 (16 GiB) leaves nothing.
        let less = gpu_kv_bytes(0.9, 40 * gib, 80 * gib, 16 * gib, 2 * gib).unwrap();
        assert_eq!(kv - less, 39 * gib);
        let e = gpu_kv_bytes(0.2, 79 * gib, 80 * gib, 16 * gib, 2 * gib).unwrap_err();
        assert!(
            e.contains("0.2") && e.contains("16.00 GiB of the GPU's 80.00") && e.contains("20.00"),
            "{e}"
        );
        // Exactly what is taken: no cache at all is an error too.
        let taken = gib + 16 * gib + 2 * gib + GPU_MEMORY_MARGIN;
        assert!(gpu_kv_bytes(
            taken as f64 / (80 * gib) as f64,
            79 * gib,
            80 * gib,
            16 * gib,
            2 * gib
        )
        .is_err_and(|e| e.contains("free the GPU")));
    }

    #[test]
    fn choices_parse_and_the_cpu_is_always_there() {
        for (s, c) in [
            ("auto", DeviceChoice::Auto),
            ("cpu", DeviceChoice::Cpu),
            ("cuda", DeviceChoice::Cuda),
        ] {
            assert_eq!(s.parse::<DeviceChoice>().unwrap(), c);
        }
        assert!("gpu"
            .parse::<DeviceChoice>()
            .unwrap_err()
            .contains("cpu, cuda or auto"));
        assert_eq!(select(DeviceChoice::Cpu, None).unwrap().name(), "cpu");
        // Learning keeps auto on the CPU whatever the machine has.
        assert_eq!(
            select(DeviceChoice::Auto, Some("learning")).unwrap().name(),
            "cpu"
        );
    }

    /// Without a usable GPU (no CUDA in this build, or none on this machine): auto serves on the
    /// CPU and an explicit cuda is an error saying why.
    #[test]
    fn without_a_gpu_auto_is_the_cpu_and_cuda_is_refused() {
        if open_gpu().is_ok() {
            eprintln!("skipped: this machine has a usable GPU");
            return;
        }
        assert_eq!(select(DeviceChoice::Auto, None).unwrap().name(), "cpu");
        let err = select(DeviceChoice::Cuda, None).err().unwrap().to_string();
        assert!(err.starts_with("--device cuda: "), "{err}");
    }
}
