//! What the CUDA forward tests share (feature `cuda`): the GPU or why not, a test decoder's
//! shape, sequences with their blocks, a step's batch, adapters of every projection.

use super::Rng;
use flywheel::adapter::{
    AdapterConfig, AdapterLayout, AdapterWeights, LoraConfig, Method, OftConfig, Target,
};
use flywheel::kernels::cuda::Gpu;
use flywheel::model::decoder::{BatchSeq, Decoder, GpuShape, Logits};
use std::sync::Arc;

/// The GPU, or None after saying why there is none (a failure with FLYWHEEL_REQUIRE_GPU=1).
pub fn gpu() -> Option<Gpu> {
    match Gpu::open(0) {
        Ok(g) => Some(g),
        Err(e) if std::env::var("FLYWHEEL_REQUIRE_GPU").as_deref() == Ok("1") => {
            panic!("FLYWHEEL_REQUIRE_GPU=1 and no GPU: {e}")
        }
        Err(e) => {
            eprintln!("skipped: no GPU here ({e})");
            None
        }
    }
}

/// Tokens a KV block, and blocks a test decoder holds.
pub const BS: usize = 4;
pub const BLOCKS: usize = 64;

/// A test decoder's buffers: 64 blocks of 4, 64 tokens a step, 8 sequences, tokens drawn.
pub fn shape(graphs: bool) -> GpuShape {
    GpuShape {
        num_kv_blocks: BLOCKS,
        block_size: BS,
        max_tokens: 64,
        max_seqs: 8,
        max_model_len: 64,
        graphs,
        int8: false,
        draws: true,
    }
}

/// One sequence of a test: its tokens so far and its blocks (8 each, disjoint).
pub struct Seq {
    pub tokens: Vec<u32>,
    pub table: Vec<u32>,
    pub adapter: Option<Arc<AdapterWeights>>,
}

/// The step's batch: each (sequence, new tokens, logits wanted).
pub fn batch<'a>(seqs: &'a [Seq], steps: &'a [(usize, usize, Logits)]) -> Vec<BatchSeq<'a>> {
    steps
        .iter()
        .map(|&(i, new, logits)| {
            let s = &seqs[i];
            BatchSeq {
                tokens: &s.tokens[s.tokens.len() - new..],
                first_pos: s.tokens.len() - new,
                block_table: &s.table,
                window_table: &[],
                logits,
                adapter: s.adapter.as_deref(),
            }
        })
        .collect()
}

pub fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// The GPU tests' two adapter methods: LoRA of rank 4 (alpha 8) and OFT of blocks of 16.
pub fn methods() -> (Method, Method) {
    let lora = Method::Lora(LoraConfig {
        r: 4,
        alpha: 8.0,
        use_rslora: false,
    });
    let oft = Method::Oft(OftConfig {
        block_size: 16,
        ..OftConfig::default()
    });
    (lora, oft)
}

/// An adapter of every layer's projections, and of the LM head too with `head` (LoRA only).
pub fn adapter(model: &Decoder, method: Method, seed: u64, head: bool) -> Arc<AdapterWeights> {
    let mut targets = Target::ALL.to_vec();
    if head {
        targets.push(Target::Head);
    }
    let config = AdapterConfig {
        method,
        targets,
        base_model: "tiny".into(),
    };
    let layout = Arc::new(AdapterLayout::new(config, &model.config).unwrap());
    let params = Rng(seed).vec(layout.num_params, 0.05);
    Arc::new(AdapterWeights::new(layout, params).unwrap())
}
