//! Putting a model on the GPU: its weights copied as stored, its KV cache, a step's buffers and
//! the adapters' directory allocated (`GpuDecoder::new`), and what those buffers take
//! (`GpuDecoder::step_bytes`, for sizing the cache to the GPU's memory).

use super::*;

impl GpuDecoder {
    /// Copy `model`'s weights to `gpu` and allocate its cache and activations; an error naming
    /// what the GPU path does not run (heads over 256) or what does not fit.
    pub fn new(gpu: Gpu, model: &Decoder, shape: GpuShape) -> Result<GpuDecoder, ModelError> {
        let c = &model.config;
        if c.head_dim > ATT_MAX_HEAD_DIM {
            return Err(ModelError::Unsupported(format!(
                "head_dim {} on the GPU (its attention takes up to {ATT_MAX_HEAD_DIM})",
                c.head_dim
            )));
        }
        let matrix = |w: &Weight| -> Result<DeviceMatrix, ModelError> {
            Ok(gpu.matrix(w.ty, w.rows, w.cols, model.bytes(w))?)
        };
        let vector = |v: &[f32]| -> Result<CudaSlice<f32>, ModelError> { Ok(gpu.upload(v)?) };
        let maybe = |v: &Option<Vec<f32>>| -> Result<Option<CudaSlice<f32>>, ModelError> {
            v.as_deref().map(vector).transpose()
        };
        let mut layers = Vec::with_capacity(model.layers.len());
        for layer in &model.layers {
            let mlp = match &layer.mlp {
                Mlp::Dense {
                    w_gate,
                    w_up,
                    w_down,
                } => GpuMlp::Dense {
                    gate: matrix(w_gate)?,
                    up: matrix(w_up)?,
                    down: matrix(w_down)?,
                },
                Mlp::Moe(x) => {
                    let all = |ws: &[Weight]| ws.iter().map(&matrix).collect::<Result<Vec<_>, _>>();
                    let (gate, up, down) = (all(&x.gate)?, all(&x.up)?, all(&x.down)?);
                    let on_device = c.moe.is_some_and(|m| m.used <= MOE_MAX_USED);
                    let tables = if on_device {
                        Some([
                            gpu.expert_table(&gate)?,
                            gpu.expert_table(&up)?,
                            gpu.expert_table(&down)?,
                        ])
                    } else {
                        None
                    };
                    GpuMlp::Moe {
                        router: matrix(&x.router)?,
                        gate,
                        up,
                        down,
                        tables,
                    }
                }
            };
            layers.push(GpuLayer {
                attn_norm: vector(&layer.attn_norm)?,
                wq: matrix(&layer.wq)?,
                wk: matrix(&layer.wk)?,
                wv: matrix(&layer.wv)?,
                bq: maybe(&layer.bq)?,
                bk: maybe(&layer.bk)?,
                bv: maybe(&layer.bv)?,
                q_norm: maybe(&layer.q_norm)?,
                k_norm: maybe(&layer.k_norm)?,
                wo: matrix(&layer.wo)?,
                post_attn_norm: maybe(&layer.post_attn_norm)?,
                ffn_norm: vector(&layer.ffn_norm)?,
                mlp,
                post_ffn_norm: maybe(&layer.post_ffn_norm)?,
            });
        }
        let embd = matrix(&model.token_embd)?;
        let tied = model.output.start == model.token_embd.start;
        let output = if tied {
            None
        } else {
            Some(matrix(&model.output)?)
        };
        let blocks = shape.num_kv_blocks + 1;
        let per_layer = blocks * shape.block_size * c.kv_dim();
        let cache = match model.kv_dtype {
            KvDtype::F32 => Cache::F32(
                (0..c.num_layers)
                    .map(|_| Ok((gpu.zeros(per_layer)?, gpu.zeros(per_layer)?)))
                    .collect::<Result<_, GpuError>>()?,
            ),
            KvDtype::F16 => Cache::F16(
                (0..c.num_layers)
                    .map(|_| Ok((gpu.zeros(per_layer)?, gpu.zeros(per_layer)?)))
                    .collect::<Result<_, GpuError>>()?,
            ),
        };
        let t = shape.max_tokens.max(GRAPH_MAX_BATCH);
        let acts = Acts::new(&gpu, c, t, shape.int8)?;
        let per_seq = shape.max_model_len.div_ceil(shape.block_size);
        let meta = gpu.tokens_with_capacity(t, shape.max_seqs.max(1) * per_seq + t)?;
        gpu.synchronize()?;
        Ok(GpuDecoder {
            layers,
            embd,
            output,
            output_norm: vector(&model.output_norm)?,
            cache,
            block_size: shape.block_size,
            scratch_block: shape.num_kv_blocks as u32,
            max_tokens: t,
            acts,
            meta,
            graphs: HashMap::new(),
            // A mixture of experts decodes through graphs where its router runs on the device.
            use_graphs: shape.graphs && c.moe.is_none_or(|m| m.used <= MOE_MAX_USED),
            adapters: HashMap::new(),
            rowwise: gpu.adapter_rows(ADAPTER_SLOTS, module_dims(c), t)?,
            free_slots: (0..ADAPTER_SLOTS).rev().collect(),
            step: 0,
            routing: MoeActs::default(),
            draw: match shape.draws && c.final_softcap.is_none() {
                true => Some(gpu.draw_buffers(HEAD_ROWS.max(GRAPH_MAX_BATCH))?),
                false => None,
            },
            drawn: Vec::new(),
            lse: Vec::new(),
            score: None,
            gpu,
        })
    }

    /// The bytes a decoder of `shape` takes on the GPU besides the weights and the KV cache: a
    /// step's buffers (`Acts`) and its block tables, for sizing the cache to the GPU's memory.
    pub fn step_bytes(c: &crate::model::decoder::DecoderConfig, shape: &GpuShape) -> usize {
        let t = shape.max_tokens.max(GRAPH_MAX_BATCH);
        let per_seq = shape.max_model_len.div_ceil(shape.block_size.max(1));
        Acts::bytes(c, t, shape.int8) + 4 * (3 * t + shape.max_seqs.max(1) * per_seq)
    }
}
