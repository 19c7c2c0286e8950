//! Adapters on the frozen quantized base: what they are (targets, OFT or LoRA, and their settings),
//! where their f32 parameters live (one flat vector, laid out tensor by tensor in PEFT's shapes, so
//! a gradient or an optimizer moment is a vector of the same layout), and the per-version form the
//! forward pass reads (`AdapterWeights`: OFT's rotations and LoRA's Bᵀ built once, never per token).

mod limits;
pub mod lora;
pub mod oft;
pub mod peft;
pub mod registry;

pub use limits::AdapterLimits;

use flywheel_kernels::{Cpu, Isa, ThreadPool};
use std::ops::Range;
use std::sync::Arc;
use std::time::Duration;

/// A linear projection an adapter can target: one of a transformer block's seven, or the LM head
/// (`lm_head`, once per model, LoRA only: Tinker's `train_unembed`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Target {
    Q,
    K,
    V,
    O,
    Gate,
    Up,
    Down,
    Head,
}

/// The per-layer targets (all but the LM head).
pub const NUM_TARGETS: usize = 7;

impl Target {
    /// The per-layer targets, in order (the LM head is not one of them).
    pub const ALL: [Target; NUM_TARGETS] = [
        Target::Q,
        Target::K,
        Target::V,
        Target::O,
        Target::Gate,
        Target::Up,
        Target::Down,
    ];

    pub fn index(self) -> usize {
        self as usize
    }

    /// PEFT's module name (`target_modules`).
    pub fn peft_name(self) -> &'static str {
        match self {
            Target::Q => "q_proj",
            Target::K => "k_proj",
            Target::V => "v_proj",
            Target::O => "o_proj",
            Target::Gate => "gate_proj",
            Target::Up => "up_proj",
            Target::Down => "down_proj",
            Target::Head => "lm_head",
        }
    }

    /// The module's path under `model.layers.L.` (the LM head's is `lm_head`, under none).
    pub fn peft_path(self) -> &'static str {
        match self {
            Target::Q => "self_attn.q_proj",
            Target::K => "self_attn.k_proj",
            Target::V => "self_attn.v_proj",
            Target::O => "self_attn.o_proj",
            Target::Gate => "mlp.gate_proj",
            Target::Up => "mlp.up_proj",
            Target::Down => "mlp.down_proj",
            Target::Head => "lm_head",
        }
    }

    /// Accepts PEFT's names and the short ones (`q`, `gate`, ...).
    pub fn parse(s: &str) -> Option<Target> {
        let s = s.strip_suffix("_proj").unwrap_or(s);
        Some(match s {
            "q" => Target::Q,
            "k" => Target::K,
            "v" => Target::V,
            "o" => Target::O,
            "gate" => Target::Gate,
            "up" => Target::Up,
            "down" => Target::Down,
            "lm_head" | "head" => Target::Head,
            _ => return None,
        })
    }

    /// (in, out) widths of the projection in a model.
    pub fn dims(self, c: &BaseShape) -> (usize, usize) {
        match self {
            Target::Q => (c.hidden, c.q_dim),
            Target::K | Target::V => (c.hidden, c.kv_dim),
            Target::O => (c.q_dim, c.hidden),
            Target::Gate | Target::Up => (c.hidden, c.ffn),
            Target::Down => (c.ffn, c.hidden),
            Target::Head => (c.hidden, c.vocab),
        }
    }
}

/// What an adapter depends on of its base model: the layer count and the projections' widths
/// (each model family describes itself this way; the adapter math knows no family).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BaseShape {
    pub num_layers: usize,
    pub hidden: usize,
    /// Width of the query projection's output (heads × head dim).
    pub q_dim: usize,
    /// Width of the key and value projections' outputs.
    pub kv_dim: usize,
    /// Width of the dense MLP; 0 where the model has none to adapt (a mixture of experts: the
    /// experts are not adapted, so gate/up/down targets are refused).
    pub ffn: usize,
    /// One attention head's width (PEFT's q/k row order differs from GGUF's within a head).
    pub head_dim: usize,
    /// The LM head's output width (the vocabulary).
    pub vocab: usize,
    /// The GGUF's q/k rows are permuted from Hugging Face's order (llama.cpp does it for LLaMA's
    /// adjacent-pair RoPE): LoRA B rows of q_proj and k_proj are permuted on load and save.
    pub qk_rows_permuted: bool,
}

impl BaseShape {
    /// The projections an adapter targets when its config names none: all seven where the
    /// model has a dense MLP, the attention projections otherwise.
    pub fn default_targets(&self) -> Vec<Target> {
        Target::ALL
            .iter()
            .copied()
            .filter(|t| self.has(*t))
            .collect()
    }

    /// Whether the model has `t` to adapt.
    pub fn has(&self, t: Target) -> bool {
        match t {
            Target::Gate | Target::Up | Target::Down => self.ffn > 0,
            Target::Head => self.vocab > 0,
            _ => true,
        }
    }
}

/// A base model adapters can attach to.
pub trait AdapterBase {
    fn adapter_shape(&self) -> BaseShape;
}

impl AdapterBase for BaseShape {
    fn adapter_shape(&self) -> BaseShape {
        *self
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct OftConfig {
    /// b: the input is rotated in blocks of b values (must divide every targeted input width).
    pub block_size: usize,
    /// true: R from the Cayley–Neumann series (PEFT's default); false: exact Cayley.
    pub use_cayley_neumann: bool,
    pub num_cayley_neumann_terms: usize,
}

impl Default for OftConfig {
    fn default() -> Self {
        OftConfig {
            block_size: 32,
            use_cayley_neumann: true,
            num_cayley_neumann_terms: 5,
        }
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct LoraConfig {
    pub r: usize,
    pub alpha: f32,
    pub use_rslora: bool,
}

impl LoraConfig {
    /// s in y = W x + s·B(A x): α/r, or α/√r with rsLoRA (computed in f64 like PEFT, then f32).
    pub fn scale(&self) -> f32 {
        let r = self.r as f64;
        let a = self.alpha as f64;
        (if self.use_rslora { a / r.sqrt() } else { a / r }) as f32
    }
}

#[derive(Clone, Debug, PartialEq)]
pub enum Method {
    Oft(OftConfig),
    Lora(LoraConfig),
}

impl Method {
    pub fn kind(&self) -> &'static str {
        match self {
            Method::Oft(_) => "oft",
            Method::Lora(_) => "lora",
        }
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct AdapterConfig {
    pub method: Method,
    /// Sorted, without repeats.
    pub targets: Vec<Target>,
    /// `base_model_name_or_path` as written in (or to) adapter_config.json.
    pub base_model: String,
}

#[derive(Debug, thiserror::Error)]
pub enum AdapterError {
    /// A problem with one tensor of the adapter (its name leads the message).
    #[error("tensor '{name}': {msg}")]
    Tensor { name: String, msg: String },
    /// A problem with the configuration (the key leads the message).
    #[error("{key}: {msg}")]
    Config { key: String, msg: String },
    #[error("{path}: {msg}")]
    Io { path: String, msg: String },
}

pub fn config_error(key: &str, msg: impl Into<String>) -> AdapterError {
    AdapterError::Config {
        key: key.into(),
        msg: msg.into(),
    }
}

/// One tensor of the flat parameter vector.
#[derive(Clone, Debug)]
pub struct TensorSlot {
    /// PEFT's name, e.g. `base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight`.
    pub name: String,
    /// The part after the module path: `oft_R.weight`, `lora_A.weight` or `lora_B.weight`.
    pub suffix: &'static str,
    /// PEFT's shape (rows, cols).
    pub shape: [usize; 2],
    pub range: Range<usize>,
}

/// One adapted projection of one layer.
#[derive(Clone, Debug)]
pub struct ModuleLayout {
    /// The layer (the layer count for the LM head's module).
    pub layer: usize,
    pub target: Target,
    pub in_dim: usize,
    pub out_dim: usize,
    /// OFT: [oft_R]; LoRA: [lora_A (r, in), lora_B (out, r)].
    pub tensors: Vec<TensorSlot>,
    /// Where this module's derived tensor starts in `AdapterWeights::derived`: OFT's rotations
    /// (in/b, b, b); LoRA's Bᵀ (r, out).
    pub derived_offset: usize,
}

/// Where every tensor of an adapter lives in its flat parameter vector: shared by all versions of
/// one adapter (and by its gradients and optimizer moments).
#[derive(Debug)]
pub struct AdapterLayout {
    pub config: AdapterConfig,
    pub num_layers: usize,
    /// Index `layer * NUM_TARGETS + target`: None where the projection is not adapted.
    pub modules: Vec<Option<ModuleLayout>>,
    pub num_params: usize,
    /// Floats of derived tensors per version (OFT rotations, LoRA Bᵀ).
    pub num_derived_floats: usize,
    /// The base's shape, to refuse an adapter made for other dimensions.
    pub model: BaseShape,
}

impl AdapterLayout {
    /// Check `config` against the model and lay out its tensors.
    pub fn new(
        config: AdapterConfig,
        model: &impl AdapterBase,
    ) -> Result<AdapterLayout, AdapterError> {
        let model = &model.adapter_shape();
        if config.targets.is_empty() {
            return Err(config_error("target_modules", "no target modules"));
        }
        if let Some(t) = config.targets.iter().find(|t| !model.has(**t)) {
            return Err(config_error(
                "target_modules",
                format!(
                    "{} is an expert projection of this mixture-of-experts model; adapters \
                     attach to its attention projections (q_proj, k_proj, v_proj, o_proj)",
                    t.peft_name()
                ),
            ));
        }
        match &config.method {
            Method::Oft(o) => {
                if o.block_size == 0 {
                    return Err(config_error("oft_block_size", "must be at least 1"));
                }
                if o.use_cayley_neumann && o.num_cayley_neumann_terms == 0 {
                    return Err(config_error(
                        "num_cayley_neumann_terms",
                        "must be at least 1",
                    ));
                }
                if config.targets.contains(&Target::Head) {
                    return Err(config_error(
                        "target_modules",
                        "lm_head takes LoRA only (OFT adapts the projections of the layers)",
                    ));
                }
                for t in &config.targets {
                    let (in_dim, _) = t.dims(model);
                    if !in_dim.is_multiple_of(o.block_size) {
                        return Err(config_error(
                            "oft_block_size",
                            format!(
                                "{} does not divide the input width {in_dim} of {}",
                                o.block_size,
                                t.peft_name()
                            ),
                        ));
                    }
                }
            }
            Method::Lora(l) => {
                if l.r == 0 {
                    return Err(config_error("r", "must be at least 1"));
                }
                if !l.alpha.is_finite() {
                    return Err(config_error("lora_alpha", "must be finite"));
                }
            }
        }
        // The layers' modules, then the LM head's (one slot after them).
        let mut modules = vec![None; model.num_layers * NUM_TARGETS + 1];
        let mut off = 0;
        let mut derived = 0;
        let places = (0..model.num_layers)
            .flat_map(|l| config.targets.iter().map(move |&t| (l, t)))
            .filter(|&(_, t)| t != Target::Head)
            .chain(
                config
                    .targets
                    .contains(&Target::Head)
                    .then_some((model.num_layers, Target::Head)),
            );
        for (layer, target) in places {
            {
                let (in_dim, out_dim) = target.dims(model);
                let prefix = if target == Target::Head {
                    "base_model.model.lm_head".to_string()
                } else {
                    format!(
                        "base_model.model.model.layers.{layer}.{}",
                        target.peft_path()
                    )
                };
                let mut slot = |suffix: &'static str, shape: [usize; 2]| {
                    let len = shape[0] * shape[1];
                    let s = TensorSlot {
                        name: format!("{prefix}.{suffix}"),
                        suffix,
                        shape,
                        range: off..off + len,
                    };
                    off += len;
                    s
                };
                let derived_offset = derived;
                let tensors = match &config.method {
                    Method::Oft(o) => {
                        let b = o.block_size;
                        derived += in_dim * b;
                        vec![slot("oft_R.weight", [in_dim / b, b * (b - 1) / 2])]
                    }
                    Method::Lora(l) => {
                        derived += l.r * out_dim;
                        vec![
                            slot("lora_A.weight", [l.r, in_dim]),
                            slot("lora_B.weight", [out_dim, l.r]),
                        ]
                    }
                };
                modules[Self::slot(layer, target, model.num_layers)] = Some(ModuleLayout {
                    layer,
                    target,
                    in_dim,
                    out_dim,
                    tensors,
                    derived_offset,
                });
            }
        }
        Ok(AdapterLayout {
            config,
            num_layers: model.num_layers,
            modules,
            num_params: off,
            num_derived_floats: derived,
            model: *model,
        })
    }

    /// Where a module sits in `modules`: the LM head's after every layer's (its `layer` is
    /// the layer count).
    fn slot(layer: usize, target: Target, num_layers: usize) -> usize {
        match target {
            Target::Head => num_layers * NUM_TARGETS,
            t => layer * NUM_TARGETS + t.index(),
        }
    }

    /// The module of `target` in `layer` (any layer for the LM head's).
    pub fn module(&self, layer: usize, target: Target) -> Option<&ModuleLayout> {
        self.modules[Self::slot(layer, target, self.num_layers)].as_ref()
    }

    /// The LM head's module (LoRA on the output projection), if adapted.
    pub fn head(&self) -> Option<&ModuleLayout> {
        self.module(self.num_layers, Target::Head)
    }

    pub fn iter_modules(&self) -> impl Iterator<Item = &ModuleLayout> {
        self.modules.iter().flatten()
    }

    pub fn tensors(&self) -> impl Iterator<Item = &TensorSlot> {
        self.iter_modules().flat_map(|m| m.tensors.iter())
    }

    /// Does any module of this layer adapt `target`? (Used to skip work for the base.)
    pub fn has(&self, target: Target) -> bool {
        self.config.targets.contains(&target)
    }
}

/// One immutable set of adapter values, in the form the forward pass reads.
#[derive(Clone, Debug)]
pub struct AdapterWeights {
    /// Unique in this process: what a backend's copy of these values is keyed by (a GPU keeps
    /// the versions it serves; an address could be reused by a later version). A clone keeps it:
    /// the same values.
    uid: u64,
    pub layout: Arc<AdapterLayout>,
    /// The trainable f32 parameters (PEFT shapes, flat; see `AdapterLayout`).
    pub params: Vec<f32>,
    /// Built once from `params`, per module: OFT's rotations R_k (in/b blocks of b×b, row-major);
    /// LoRA's Bᵀ (r, out), the layout of the row-times-matrix kernel.
    pub derived: Vec<f32>,
}

impl AdapterWeights {
    /// Check the values (finite) and build what the forward reads. Runs on the publisher's thread.
    pub fn new(
        layout: Arc<AdapterLayout>,
        params: Vec<f32>,
    ) -> Result<AdapterWeights, AdapterError> {
        if params.len() != layout.num_params {
            return Err(config_error(
                "parameters",
                format!(
                    "{} values, the layout holds {}",
                    params.len(),
                    layout.num_params
                ),
            ));
        }
        for t in layout.tensors() {
            if let Some(i) = params[t.range.clone()].iter().position(|v| !v.is_finite()) {
                return Err(AdapterError::Tensor {
                    name: t.name.clone(),
                    msg: format!(
                        "holds a non-finite value ({}) at element {i}",
                        params[t.range.start + i]
                    ),
                });
            }
        }
        let mut derived = vec![0.0f32; layout.num_derived_floats];
        // The publisher's own one-thread seam: building never takes the engine's pool.
        let cpu = Cpu::new(Isa::detect(), ThreadPool::new(1, Duration::ZERO));
        for m in layout.iter_modules() {
            let d = &mut derived[m.derived_offset..];
            match &layout.config.method {
                Method::Oft(o) => oft::rotations_with(
                    &cpu,
                    o,
                    &params[m.tensors[0].range.clone()],
                    &mut d[..m.in_dim * o.block_size],
                ),
                Method::Lora(l) => {
                    let b = &params[m.tensors[1].range.clone()];
                    for o in 0..m.out_dim {
                        for i in 0..l.r {
                            d[i * m.out_dim + o] = b[o * l.r + i];
                        }
                    }
                }
            }
        }
        static NEXT_UID: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
        Ok(AdapterWeights {
            uid: NEXT_UID.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            layout,
            params,
            derived,
        })
    }

    /// The identity adapter of `layout`: OFT with zero skew parameters (R = I); LoRA with B = 0
    /// and A drawn like PEFT's Kaiming-uniform init (bound 1/√in), seeded.
    pub fn identity(layout: Arc<AdapterLayout>, seed: u64) -> AdapterWeights {
        let mut params = vec![0.0f32; layout.num_params];
        if let Method::Lora(_) = layout.config.method {
            let mut rng = crate::util::Rng::new(seed);
            for m in layout.iter_modules() {
                let a = &m.tensors[0];
                let bound = 1.0 / (m.in_dim as f64).sqrt();
                for v in &mut params[a.range.clone()] {
                    *v = ((rng.next_f64() * 2.0 - 1.0) * bound) as f32;
                }
            }
        }
        AdapterWeights::new(layout, params).expect("zeros and small uniforms are finite")
    }

    /// This set of values' identity in this process (`uid`).
    pub fn uid(&self) -> u64 {
        self.uid
    }

    pub fn tensor(&self, t: &TensorSlot) -> &[f32] {
        &self.params[t.range.clone()]
    }

    /// This module's derived tensor: OFT's rotations (in/b blocks of b×b) or LoRA's Bᵀ (r, out).
    pub fn derived(&self, m: &ModuleLayout) -> &[f32] {
        let len = match &self.layout.config.method {
            Method::Oft(o) => m.in_dim * o.block_size,
            Method::Lora(l) => l.r * m.out_dim,
        };
        &self.derived[m.derived_offset..m.derived_offset + len]
    }
}
