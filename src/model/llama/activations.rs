//! What the training forward keeps for the backward: each layer's input (the checkpoints) and,
//! within a memory budget, the products of the last layers; a layer whose products were not kept
//! is recomputed from its input with the forward's own kernels (so with the same bits).

use super::buffers::AdapterScratch;
use super::forward::{add_in_place, AdapterGroup, Projection};
use super::Llama;
use crate::adapter::Target;
use crate::model::kv_cache::KvCache;
use flywheel_kernels::reference::AttnSeq;
use flywheel_kernels::Cpu;

/// One layer's activations kept by the training forward for its backward, T rows each: q and k
/// after RoPE, v, the attention output, the residual stream after attention (`hx`), and the MLP's
/// gate and up products. (The RMSNorm outputs and SwiGLU are recomputed: they are cheap.)
#[derive(Default)]
pub(super) struct LayerActs {
    pub q: Vec<f32>,
    pub k: Vec<f32>,
    pub v: Vec<f32>,
    pub att: Vec<f32>,
    pub hx: Vec<f32>,
    pub gate: Vec<f32>,
    pub up: Vec<f32>,
}

/// What `forward_store` keeps: every layer's input, and the activations of layers
/// `keep_from..` (the others are recomputed from their input by the backward).
#[derive(Default)]
pub(super) struct ActStore {
    /// layers × T × hidden.
    pub checkpoints: Vec<f32>,
    pub keep_from: usize,
    pub acts: Vec<Option<LayerActs>>,
}

/// Bytes of one layer's `LayerActs` for `t` tokens.
pub(super) fn layer_act_bytes(c: &super::LlamaConfig, t: usize) -> usize {
    t * (2 * c.q_dim() + 2 * c.kv_dim() + c.hidden + 2 * c.ffn) * 4
}

impl Llama {
    /// Layer `l`'s activations recomputed from its input `x0` (the same kernels as the forward,
    /// so the same bits as if they had been kept), reading K/V from the training cache.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn recompute_layer(
        &self,
        cpu: &Cpu,
        l: usize,
        x0: &[f32],
        cache: &KvCache,
        attn: &[AttnSeq],
        rope: &[f32],
        groups: &[AdapterGroup],
        scratch: &mut AdapterScratch,
    ) -> LayerActs {
        let c = &self.config;
        let layer = &self.layers[l];
        let t = x0.len() / c.hidden;
        let z = |n: usize| vec![0.0f32; n];
        let (qd, kvd, f) = (c.q_dim(), c.kv_dim(), c.ffn);
        let mut a = LayerActs {
            q: z(t * qd),
            k: z(t * kvd),
            v: z(t * kvd),
            att: z(t * qd),
            hx: z(t * c.hidden),
            gate: z(t * f),
            up: z(t * f),
        };
        let mut n = z(t * c.hidden);
        cpu.rmsnorm(x0, &layer.attn_norm, c.eps, &mut n);
        let projections = [
            (Target::Q, &layer.wq, &mut a.q),
            (Target::K, &layer.wk, &mut a.k),
            (Target::V, &layer.wv, &mut a.v),
        ];
        let mut projections =
            projections.map(|(target, weight, y)| Projection { target, weight, y });
        self.project(cpu, l, &n, &mut projections, groups, scratch);
        cpu.rope(&mut a.q, rope, c.num_heads, c.head_dim, c.rope_dim);
        cpu.rope(&mut a.k, rope, c.num_kv_heads, c.head_dim, c.rope_dim);
        cpu.attention(
            &a.q,
            &mut a.att,
            attn,
            cache.layer(l),
            c.num_heads,
            c.num_kv_heads,
            c.head_dim,
            1.0 / (c.head_dim as f32).sqrt(),
        );
        let mut o = [Projection {
            target: Target::O,
            weight: &layer.wo,
            y: &mut a.hx,
        }];
        self.project(cpu, l, &a.att, &mut o, groups, scratch);
        add_in_place(&mut a.hx, x0);
        cpu.rmsnorm(&a.hx, &layer.ffn_norm, c.eps, &mut n);
        let mut mlp = [
            Projection {
                target: Target::Gate,
                weight: &layer.w_gate,
                y: &mut a.gate,
            },
            Projection {
                target: Target::Up,
                weight: &layer.w_up,
                y: &mut a.up,
            },
        ];
        self.project(cpu, l, &n, &mut mlp, groups, scratch);
        a
    }
}
