//! Tiny random-weight Llama GGUF files for tests, with a small byte-level BPE vocabulary.
#![allow(dead_code)]

pub mod adapters;
#[cfg(feature = "cuda")]
pub mod gpu;
pub mod naive;
pub mod online;
pub mod pg;
pub mod replicas;
pub mod s3;
pub mod served;
pub mod server;
pub mod stores;
pub mod tinker;
mod vocab;
pub use vocab::*;

use flywheel::kernels::quant::quantize::quantize;
use flywheel::kernels::QuantType;
use flywheel::model::gguf::Value;
use flywheel::model::gguf_writer::GgufWriter;

pub struct Rng(pub u64);
impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E3779B97F4A7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58476D1CE4E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D049BB133111EB);
        z ^ (z >> 31)
    }
    pub fn uniform(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
    }
    pub fn vec(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| self.uniform() * scale).collect()
    }
}

#[derive(Clone)]
pub struct TinySpec {
    pub hidden: usize,
    pub ffn: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub layers: usize,
    pub ctx: usize,
    pub tied: bool,
    /// Formats for q, k, v, o, gate, up, down, embedding.
    pub formats: [QuantType; 8],
    pub seed: u64,
    /// `general.architecture`: "llama", "qwen2" (q/k/v biases, NeoX RoPE) or "qwen3" (per-head
    /// q/k norms, NeoX RoPE).
    pub arch: &'static str,
    /// Written as `attention.key_length` when set (else hidden / heads).
    pub head_dim: Option<usize>,
    /// Llama 3's RoPE frequency factors (a `rope_freqs.weight` tensor).
    pub rope_freqs: bool,
    /// `tokenizer.ggml.pre`; other than "smollm", the vocab has merges across the boundaries
    /// the pre-tokenizers draw differently (digit runs, newlines, spaces, contractions).
    pub pre: &'static str,
    /// `tokenizer.chat_template` (None: a one-line ChatML template; Some(""): none).
    pub chat_template: Option<&'static str>,
    /// A mixture of experts in place of the dense MLP: (experts, used per token, expert width).
    pub experts: Option<(usize, usize, usize)>,
    /// Gemma 3's sliding window (`attention.sliding_window`; every 6th layer global).
    pub window: Option<usize>,
    /// A SentencePiece vocabulary (`tokenizer.ggml.model = "llama"`, `spm_vocab`) in place of the
    /// byte-level BPE one, with this `add_space_prefix`.
    pub spm: Option<bool>,
    /// Extra tokens (byte-level BPE vocabularies), each one token of this text, appended at the
    /// end of the vocabulary: a test can make the model say a whole phrase with one logit bias.
    pub extra_tokens: &'static [&'static str],
    /// `attn_logit_softcapping` and `final_logit_softcapping` (Gemma 2), written when set.
    pub softcaps: Option<(f32, f32)>,
}

impl TinySpec {
    pub fn small() -> TinySpec {
        use QuantType::*;
        TinySpec {
            hidden: 64,
            ffn: 96,
            heads: 4,
            kv_heads: 2,
            layers: 2,
            ctx: 256,
            tied: true,
            formats: [Q4_1, Q4_0, Q8_0, F16, Q4_1, BF16, Q8_0, Q8_0],
            seed: 11,
            arch: "llama",
            head_dim: None,
            rope_freqs: false,
            pre: "smollm",
            chat_template: None,
            experts: None,
            window: None,
            spm: None,
            extra_tokens: &[],
            softcaps: None,
        }
    }

    /// `small`, as a Llama 3 (RoPE frequency factors, 4 query heads per KV head).
    pub fn llama3() -> TinySpec {
        TinySpec {
            kv_heads: 1,
            rope_freqs: true,
            seed: 19,
            ..TinySpec::small()
        }
    }

    /// `small`, as a Qwen3 (per-head q/k norms, NeoX RoPE, a head dim that is not hidden / heads).
    pub fn qwen3() -> TinySpec {
        TinySpec {
            arch: "qwen3",
            head_dim: Some(32),
            seed: 17,
            ..TinySpec::small()
        }
    }

    /// `small`, as a Qwen3-MoE (Qwen3's attention; 8 experts of width 32, 2 per token).
    pub fn qwen3moe() -> TinySpec {
        TinySpec {
            arch: "qwen3moe",
            experts: Some((8, 2, 32)),
            seed: 23,
            ..TinySpec::qwen3()
        }
    }

    /// A Gemma 3: √hidden-scaled embedding, pre- and post-norms, GeGLU, q/k norms, one KV head,
    /// six layers (five with a sliding window of 5 keys and RoPE base 10⁴, the sixth global with
    /// base 10⁶), a SentencePiece vocabulary without the leading space (as Gemma's).
    pub fn gemma3() -> TinySpec {
        TinySpec {
            arch: "gemma3",
            kv_heads: 1,
            head_dim: Some(32),
            layers: 6,
            window: Some(5),
            spm: Some(false),
            seed: 29,
            ..TinySpec::small()
        }
    }

    /// A Gemma 2: Gemma 3's layout without q/k norms, every other layer global (a window of 5
    /// keys on the others), one RoPE base, and soft-caps small enough to bend these scores and
    /// logits (a missing cap fails the comparisons).
    pub fn gemma2() -> TinySpec {
        TinySpec {
            arch: "gemma2",
            layers: 4,
            softcaps: Some((0.5, 2.0)),
            seed: 37,
            ..TinySpec::gemma3()
        }
    }

    /// `small`, as a Qwen2 (biases on q, k and v; NeoX RoPE; untied output).
    pub fn qwen2() -> TinySpec {
        TinySpec {
            arch: "qwen2",
            tied: false,
            seed: 13,
            ..TinySpec::small()
        }
    }
    /// `small` in Q5_0 and Q5_1: what llama-quantize's K-quant presets write where 256 does not
    /// divide a row (a Q4_K_M of SmolLM2's 576 wide rows, say).
    pub fn q5() -> TinySpec {
        use QuantType::*;
        TinySpec {
            formats: [Q5_0, Q5_1, Q5_0, Q5_1, Q5_0, Q5_1, Q5_0, Q8_0],
            seed: 31,
            ..TinySpec::small()
        }
    }

    pub fn k_quants() -> TinySpec {
        use QuantType::*;
        TinySpec {
            hidden: 256,
            ffn: 512,
            heads: 4,
            kv_heads: 1,
            layers: 2,
            ctx: 128,
            tied: false,
            formats: [Q4K, Q6K, Q4K, Q6K, Q4K, Q6K, Q4K, F32],
            seed: 12,
            ..TinySpec::small()
        }
    }

    /// Every K-quant and IQ4 type (rows 256 wide): Q2_K, Q3_K, Q5_K, IQ4_XS, IQ4_NL, Q4_K, Q6_K
    /// and a Q3_K embedding and tied head.
    pub fn k_and_iq() -> TinySpec {
        use QuantType::*;
        TinySpec {
            hidden: 256,
            ffn: 512,
            formats: [Q2K, Q3K, Q5K, IQ4XS, IQ4NL, Q4K, Q6K, Q3K],
            // A seed whose completions run past one LM-head chunk (tests/train.rs asserts it).
            seed: 14,
            ..TinySpec::small()
        }
    }
}

pub struct TinyModel {
    pub spec: TinySpec,
    pub vocab_size: usize,
    pub bytes: Vec<u8>,
}

pub fn tiny_model(spec: &TinySpec) -> TinyModel {
    let (mut tokens, mut types, mut merges) = vocab();
    let mut scores = Vec::new();
    if spec.spm.is_some() {
        (tokens, types, scores) = spm_vocab();
        merges.clear();
    } else if spec.pre != "smollm" {
        for m in ["1 2", "12 3", "Ċ Ċ", "Ġ Ġ", "' s", "Ġ 1", "ĠĠ Ġ", "! Ċ"] {
            tokens.push(m.replace(' ', ""));
            types.push(1);
            merges.push(m.to_string());
        }
    }
    if spec.spm.is_none() {
        let chars = byte_chars();
        for t in spec.extra_tokens {
            tokens.push(t.bytes().map(|b| chars[b as usize]).collect());
            types.push(1);
        }
    }
    let v = tokens.len();
    let s = spec;
    let hd = s.head_dim.unwrap_or(s.hidden / s.heads);
    let mut rng = Rng(s.seed);
    let mut w = GgufWriter::new();
    let str_arr =
        |xs: &[String]| Value::Array(xs.iter().map(|x| Value::String(x.clone())).collect());
    let a = s.arch;
    let k = |key: &str| format!("{a}.{key}");
    w.meta("general.architecture", Value::String(a.into()))
        .meta("general.name", Value::String("tiny".into()))
        .meta(&k("block_count"), Value::U32(s.layers as u32))
        .meta(&k("context_length"), Value::U32(s.ctx as u32))
        .meta(&k("embedding_length"), Value::U32(s.hidden as u32))
        .meta(&k("feed_forward_length"), Value::U32(s.ffn as u32))
        .meta(&k("attention.head_count"), Value::U32(s.heads as u32))
        .meta(&k("attention.head_count_kv"), Value::U32(s.kv_heads as u32))
        .meta(
            &k("rope.freq_base"),
            Value::F32(if a == "gemma3" { 1e6 } else { 10000.0 }),
        )
        .meta(&k("rope.dimension_count"), Value::U32(hd as u32))
        .meta(&k("attention.layer_norm_rms_epsilon"), Value::F32(1e-5));
    if let Some(win) = s.window {
        w.meta(&k("attention.sliding_window"), Value::U32(win as u32));
    }
    if let Some((attn, fin)) = s.softcaps {
        w.meta(&k("attn_logit_softcapping"), Value::F32(attn))
            .meta(&k("final_logit_softcapping"), Value::F32(fin));
    }
    if let Some((e, used, ef)) = s.experts {
        w.meta(&k("expert_count"), Value::U32(e as u32))
            .meta(&k("expert_used_count"), Value::U32(used as u32))
            .meta(&k("expert_feed_forward_length"), Value::U32(ef as u32));
    }
    if let Some(d) = s.head_dim {
        w.meta(&k("attention.key_length"), Value::U32(d as u32))
            .meta(&k("attention.value_length"), Value::U32(d as u32));
    }
    match s.spm {
        None => w
            .meta("tokenizer.ggml.model", Value::String("gpt2".into()))
            .meta("tokenizer.ggml.pre", Value::String(s.pre.into()))
            .meta("tokenizer.ggml.merges", str_arr(&merges)),
        Some(prefix) => w
            .meta("tokenizer.ggml.model", Value::String("llama".into()))
            .meta(
                "tokenizer.ggml.scores",
                Value::Array(scores.iter().map(|s| Value::F32(*s)).collect()),
            )
            .meta("tokenizer.ggml.add_space_prefix", Value::Bool(prefix))
            .meta("tokenizer.ggml.unknown_token_id", Value::U32(3)),
    };
    w.meta("tokenizer.ggml.tokens", str_arr(&tokens))
        .meta(
            "tokenizer.ggml.token_type",
            Value::Array(types.iter().map(|t| Value::I32(*t)).collect()),
        )
        .meta("tokenizer.ggml.bos_token_id", Value::U32(1))
        .meta("tokenizer.ggml.eos_token_id", Value::U32(2))
        .meta("tokenizer.ggml.add_bos_token", Value::Bool(false));
    // Some(""): no template at all (a base model's file).
    if spec.chat_template != Some("") {
        w.meta(
            "tokenizer.chat_template",
            Value::String(spec.chat_template.unwrap_or(
                "{% for m in messages %}{{'<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n'}}{% endfor %}{% if add_generation_prompt %}{{'<|im_start|>assistant\n'}}{% endif %}",
            ).into()),
        );
    }
    let mat = |w: &mut GgufWriter,
               rng: &mut Rng,
               name: &str,
               rows: usize,
               cols: usize,
               ty: QuantType,
               scale: f32| {
        let data = rng.vec(rows * cols, scale);
        w.tensor(name, &[cols as u64, rows as u64], ty, quantize(ty, &data));
    };
    let f = s.formats;
    mat(
        &mut w,
        &mut rng,
        "token_embd.weight",
        v,
        s.hidden,
        f[7],
        0.3,
    );
    let (qd, kvd) = (s.heads * hd, s.kv_heads * hd);
    for l in 0..s.layers {
        let n = |x: &str| format!("blk.{l}.{x}.weight");
        mat(&mut w, &mut rng, &n("attn_q"), qd, s.hidden, f[0], 0.3);
        mat(&mut w, &mut rng, &n("attn_k"), kvd, s.hidden, f[1], 0.3);
        mat(&mut w, &mut rng, &n("attn_v"), kvd, s.hidden, f[2], 0.3);
        mat(&mut w, &mut rng, &n("attn_output"), s.hidden, qd, f[3], 0.3);
        match s.experts {
            None => {
                mat(&mut w, &mut rng, &n("ffn_gate"), s.ffn, s.hidden, f[4], 0.3);
                mat(&mut w, &mut rng, &n("ffn_up"), s.ffn, s.hidden, f[5], 0.3);
                mat(&mut w, &mut rng, &n("ffn_down"), s.hidden, s.ffn, f[6], 0.3);
            }
            Some((e, _, ef)) => {
                // The router (F32, as llama.cpp keeps it) and each projection's experts stacked.
                mat(
                    &mut w,
                    &mut rng,
                    &n("ffn_gate_inp"),
                    e,
                    s.hidden,
                    QuantType::F32,
                    1.0,
                );
                for (t, rows, cols, ty) in [
                    ("ffn_gate_exps", ef, s.hidden, f[4]),
                    ("ffn_up_exps", ef, s.hidden, f[5]),
                    ("ffn_down_exps", s.hidden, ef, f[6]),
                ] {
                    let data = rng.vec(e * rows * cols, 0.3);
                    w.tensor(
                        &n(t),
                        &[cols as u64, rows as u64, e as u64],
                        ty,
                        quantize(ty, &data),
                    );
                }
            }
        }
        if a.starts_with("gemma") {
            // As llama.cpp's converter writes Gemma's norms: 1 + w.
            for t in ["post_attention_norm", "post_ffw_norm"] {
                let norm: Vec<f32> = (0..s.hidden).map(|_| 1.0 + 0.3 * rng.uniform()).collect();
                w.tensor(
                    &n(t),
                    &[s.hidden as u64],
                    QuantType::F32,
                    quantize(QuantType::F32, &norm),
                );
            }
        }
        if matches!(a, "qwen3" | "qwen3moe" | "gemma3") {
            for t in ["attn_q_norm", "attn_k_norm"] {
                let norm: Vec<f32> = (0..hd).map(|_| 1.0 + 0.3 * rng.uniform()).collect();
                w.tensor(
                    &n(t),
                    &[hd as u64],
                    QuantType::F32,
                    quantize(QuantType::F32, &norm),
                );
            }
        }
        if s.arch == "qwen2" {
            for (t, len) in [("attn_q", qd), ("attn_k", kvd), ("attn_v", kvd)] {
                let b = rng.vec(len, 0.5);
                let name = format!("blk.{l}.{t}.bias");
                w.tensor(
                    &name,
                    &[len as u64],
                    QuantType::F32,
                    quantize(QuantType::F32, &b),
                );
            }
        }
        let norm: Vec<f32> = (0..s.hidden).map(|_| 1.0 + 0.2 * rng.uniform()).collect();
        w.tensor(
            &n("attn_norm"),
            &[s.hidden as u64],
            QuantType::F32,
            quantize(QuantType::F32, &norm),
        );
        let norm: Vec<f32> = (0..s.hidden).map(|_| 1.0 + 0.2 * rng.uniform()).collect();
        w.tensor(
            &n("ffn_norm"),
            &[s.hidden as u64],
            QuantType::F32,
            quantize(QuantType::F32, &norm),
        );
    }
    if s.rope_freqs {
        // Factors from 1 (high frequencies) to 8 (low ones), as Llama 3.1's shape them.
        let f: Vec<f32> = (0..hd / 2)
            .map(|i| 1.0 + 7.0 * (i as f32 / (hd / 2) as f32))
            .collect();
        w.tensor(
            "rope_freqs.weight",
            &[(hd / 2) as u64],
            QuantType::F32,
            quantize(QuantType::F32, &f),
        );
    }
    let norm: Vec<f32> = (0..s.hidden).map(|_| 1.0 + 0.2 * rng.uniform()).collect();
    w.tensor(
        "output_norm.weight",
        &[s.hidden as u64],
        QuantType::F32,
        quantize(QuantType::F32, &norm),
    );
    if !s.tied {
        mat(&mut w, &mut rng, "output.weight", v, s.hidden, f[7], 0.3);
    }
    TinyModel {
        spec: spec.clone(),
        vocab_size: v,
        bytes: w.to_bytes(),
    }
}

/// Write a tiny model into a temp dir; returns the dir (keep it alive) and the path.
pub fn write_tiny(spec: &TinySpec) -> (tempfile::TempDir, std::path::PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tiny.gguf");
    std::fs::write(&path, tiny_model(spec).bytes).unwrap();
    (dir, path)
}

/// Log-probs at every position of `tokens`, one sequence alone (blocks of 4 tokens, in reverse
/// order, so that paging is exercised), optionally through an adapter.
pub fn logprobs_all(
    model: &flywheel::model::decoder::Decoder,
    cpu: &flywheel::kernels::Cpu,
    tokens: &[u32],
    adapter: Option<&flywheel::adapter::AdapterWeights>,
) -> Vec<Vec<f32>> {
    use flywheel::model::decoder::{BatchSeq, Logits};
    let bs = 4;
    let table: Vec<u32> = (0..tokens.len().div_ceil(bs) as u32).rev().collect();
    let mut cache = flywheel::model::kv_cache::KvCache::new(
        model.config.num_layers,
        model.config.kv_dim(),
        bs,
        table.len(),
    );
    let logits = model
        .forward(
            cpu,
            &mut cache,
            &[BatchSeq {
                tokens,
                first_pos: 0,
                block_table: &table,
                window_table: &[],
                logits: Logits::All,
                adapter,
            }],
        )
        .unwrap();
    logits
        .chunks(model.config.vocab_size)
        .map(|r| {
            let mut r = r.to_vec();
            flywheel::kernels::reference::log_softmax(&mut r);
            r
        })
        .collect()
}

/// Run a Python `script` with `args` (argv[1..]) and parse what it prints as JSON; the script
/// prints `null` when a package it needs is missing (the caller then skips, saying so).
pub fn python_json<T: serde::de::DeserializeOwned>(script: &str, args: &[&str]) -> Option<T> {
    let out = std::process::Command::new("python3")
        .arg("-c")
        .arg(script)
        .args(args)
        .output()
        .expect("python3");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice::<Option<T>>(&out.stdout).unwrap()
}

impl TinySpec {
    /// One tiny model of each family: llama (SmolLM2's shape), Llama 3, Qwen2, Qwen3, Qwen3-MoE,
    /// Gemma 3, Gemma 2.
    pub fn families() -> [TinySpec; 7] {
        [
            TinySpec::small(),
            TinySpec::llama3(),
            TinySpec::qwen2(),
            TinySpec::qwen3(),
            TinySpec::qwen3moe(),
            TinySpec::gemma3(),
            TinySpec::gemma2(),
        ]
    }
}
