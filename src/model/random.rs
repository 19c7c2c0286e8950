//! Random-weight GGUF files of real models' shapes (`flywheel random-model`): speed depends on
//! shapes and formats, not on the values, so a benchmark at a real size needs no download — on
//! a machine with no network (the lent GPUs) or in CI. Each matrix shape is quantized once and
//! its bytes reused by every layer (the memory read per token is the real one).

use super::gguf::Value;
use super::gguf_writer::GgufWriter;
use crate::util::Rng;
use flywheel_kernels::quant::quantize::quantize;
use flywheel_kernels::QuantType;
use std::collections::HashMap;

/// A model shape: the Llama-family dimensions and each matrix's format.
#[derive(Clone, Copy, Debug)]
pub struct Shape {
    pub name: &'static str,
    /// `llama`, or `qwen3` (per-head RMSNorm of q and k, RoPE base 10⁶, its own head width).
    pub arch: &'static str,
    /// Width of a head: 0 for hidden / heads.
    pub head_dim: usize,
    pub layers: usize,
    pub hidden: usize,
    pub ffn: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub vocab: usize,
    pub tied: bool,
    /// q, k, v, o, gate, up, down, embedding (and the head when untied).
    pub formats: [QuantType; 8],
}

/// The shapes `flywheel random-model` writes.
pub const SHAPES: &[Shape] = &[
    // SmolLM2-135M-Instruct as the default model's file stores it (Q4_1, Q8_0 embedding).
    Shape {
        name: "smollm2-135m",
        arch: "llama",
        head_dim: 0,
        layers: 30,
        hidden: 576,
        ffn: 1536,
        heads: 9,
        kv_heads: 3,
        vocab: 49152,
        tied: true,
        formats: [
            QuantType::Q4_1,
            QuantType::Q4_1,
            QuantType::Q4_1,
            QuantType::Q4_1,
            QuantType::Q4_1,
            QuantType::Q4_1,
            QuantType::Q4_1,
            QuantType::Q8_0,
        ],
    },
    // Llama 3.2 1B in llama-quantize's Q4_K_M mix (Q6_K for V, down and the embedding).
    Shape {
        name: "llama-1b",
        arch: "llama",
        head_dim: 0,
        layers: 16,
        hidden: 2048,
        ffn: 8192,
        heads: 32,
        kv_heads: 8,
        vocab: 128256,
        tied: true,
        formats: Q4_K_M,
    },
    // Llama 3.2 3B, Q4_K_M's mix.
    Shape {
        name: "llama-3b",
        arch: "llama",
        head_dim: 0,
        layers: 28,
        hidden: 3072,
        ffn: 8192,
        heads: 24,
        kv_heads: 8,
        vocab: 128256,
        tied: true,
        formats: Q4_K_M,
    },
    // Llama 3.1 8B, Q4_K_M's mix, its own output matrix.
    Shape {
        name: "llama-8b",
        arch: "llama",
        head_dim: 0,
        layers: 32,
        hidden: 4096,
        ffn: 14336,
        heads: 32,
        kv_heads: 8,
        vocab: 128256,
        tied: false,
        formats: Q4_K_M,
    },
    // Qwen3 0.6B, 1.7B and 4B (tied embeddings, 128-wide heads), Q4_K_M's mix.
    Shape {
        name: "qwen3-0.6b",
        arch: "qwen3",
        head_dim: 128,
        layers: 28,
        hidden: 1024,
        ffn: 3072,
        heads: 16,
        kv_heads: 8,
        vocab: 151936,
        tied: true,
        formats: Q4_K_M,
    },
    Shape {
        name: "qwen3-1.7b",
        arch: "qwen3",
        head_dim: 128,
        layers: 28,
        hidden: 2048,
        ffn: 6144,
        heads: 16,
        kv_heads: 8,
        vocab: 151936,
        tied: true,
        formats: Q4_K_M,
    },
    Shape {
        name: "qwen3-4b",
        arch: "qwen3",
        head_dim: 128,
        layers: 36,
        hidden: 2560,
        ffn: 9728,
        heads: 32,
        kv_heads: 8,
        vocab: 151936,
        tied: true,
        formats: Q4_K_M,
    },
];

/// llama-quantize's Q4_K_M mix on these shapes: Q4_K, with Q6_K for V, down and the embedding or
/// output matrix (its per-layer alternation of V and down between Q4_K and Q6_K is averaged out:
/// Q6_K on all of them reads a little more memory than the real file).
const Q4_K_M: [QuantType; 8] = [
    QuantType::Q4K,
    QuantType::Q4K,
    QuantType::Q6K,
    QuantType::Q4K,
    QuantType::Q4K,
    QuantType::Q4K,
    QuantType::Q6K,
    QuantType::Q6K,
];

/// `s` in another of llama-quantize's presets: `q4_k_m` (the shape's own formats), `q8_0` (all
/// Q8_0) or `q4_0` (Q4_0, with Q6_K for the embedding or output matrix as llama-quantize writes).
pub fn with_quant(s: Shape, quant: &str) -> Result<Shape, String> {
    let formats = match quant {
        "q4_k_m" => return Ok(s),
        "q8_0" => [QuantType::Q8_0; 8],
        "q4_0" => {
            let mut f = [QuantType::Q4_0; 8];
            f[7] = QuantType::Q6K;
            f
        }
        q => return Err(format!("no preset '{q}' (q4_k_m, q8_0, q4_0)")),
    };
    Ok(Shape { formats, ..s })
}

/// The format llama-quantize writes where a tensor's rows are not whole blocks of `ty`
/// (`tensor_type_fallback` in llama.cpp's llama-quant.cpp): the 256-value formats fall back to a
/// 32-value one (Q2_K and Q3_K to Q4_0, Q4_K to Q5_0, Q5_K to Q5_1, Q6_K to Q8_0, IQ4_XS to
/// IQ4_NL), and to F16 where even that does not fit. E.g. q4_0's Q6_K embedding of SmolLM2's 576
/// columns is Q8_0.
fn fallback(ty: QuantType, cols: usize) -> QuantType {
    if cols.is_multiple_of(ty.block_size()) {
        return ty;
    }
    let to = match ty {
        QuantType::Q2K | QuantType::Q3K => QuantType::Q4_0,
        QuantType::Q4K => QuantType::Q5_0,
        QuantType::Q5K => QuantType::Q5_1,
        QuantType::Q6K => QuantType::Q8_0,
        QuantType::IQ4XS => QuantType::IQ4NL,
        t => t,
    };
    if cols.is_multiple_of(to.block_size()) {
        to
    } else {
        QuantType::F16
    }
}

pub fn shape(name: &str) -> Result<Shape, String> {
    SHAPES
        .iter()
        .find(|s| s.name == name)
        .copied()
        .ok_or_else(|| {
            let names: Vec<&str> = SHAPES.iter().map(|s| s.name).collect();
            format!("no shape '{name}' (shapes: {})", names.join(", "))
        })
}

/// A GGUF of `s` with random weights (seeded), a byte-level vocabulary padded to its size and a
/// ChatML template: loadable by Flywheel and llama.cpp alike.
pub fn write(s: &Shape, seed: u64) -> GgufWriter {
    let mut w = GgufWriter::new();
    let k = |key: &str| format!("{}.{key}", s.arch);
    let qwen3 = s.arch == "qwen3";
    let hd = if s.head_dim > 0 {
        s.head_dim
    } else {
        s.hidden / s.heads
    };
    w.meta("general.architecture", Value::String(s.arch.into()))
        .meta("general.name", Value::String(format!("random {}", s.name)))
        .meta(&k("block_count"), Value::U32(s.layers as u32))
        .meta(&k("context_length"), Value::U32(8192))
        .meta(&k("embedding_length"), Value::U32(s.hidden as u32))
        .meta(&k("feed_forward_length"), Value::U32(s.ffn as u32))
        .meta(&k("attention.head_count"), Value::U32(s.heads as u32))
        .meta(&k("attention.head_count_kv"), Value::U32(s.kv_heads as u32))
        .meta(
            &k("rope.freq_base"),
            Value::F32(if qwen3 { 1e6 } else { 1e4 }),
        )
        .meta(&k("rope.dimension_count"), Value::U32(hd as u32))
        .meta(&k("attention.key_length"), Value::U32(hd as u32))
        .meta(&k("attention.value_length"), Value::U32(hd as u32))
        .meta(&k("attention.layer_norm_rms_epsilon"), Value::F32(1e-5));
    let (tokens, types) = vocab(s.vocab);
    let strings =
        |xs: &[String]| Value::Array(xs.iter().map(|x| Value::String(x.clone())).collect());
    w.meta("tokenizer.ggml.model", Value::String("gpt2".into()))
        .meta("tokenizer.ggml.pre", Value::String("smollm".into()))
        .meta("tokenizer.ggml.tokens", strings(&tokens))
        .meta(
            "tokenizer.ggml.token_type",
            Value::Array(types.iter().map(|t| Value::I32(*t)).collect()),
        )
        .meta("tokenizer.ggml.merges", strings(&["h e".to_string()]))
        .meta("tokenizer.ggml.bos_token_id", Value::U32(1))
        .meta("tokenizer.ggml.eos_token_id", Value::U32(2))
        .meta("tokenizer.ggml.add_bos_token", Value::Bool(false))
        .meta(
            "tokenizer.chat_template",
            Value::String(
                "{% for m in messages %}{{'<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n'}}{% endfor %}{% if add_generation_prompt %}{{'<|im_start|>assistant\n'}}{% endif %}".into(),
            ),
        );
    let mut rng = Rng::new(seed);
    let mut made: HashMap<(usize, usize, QuantType), Vec<u8>> = HashMap::new();
    let mut mat = |w: &mut GgufWriter, name: &str, rows: usize, cols: usize, ty: QuantType| {
        let ty = fallback(ty, cols);
        let bytes = made
            .entry((rows, cols, ty))
            .or_insert_with(|| {
                let x: Vec<f32> = (0..rows * cols)
                    .map(|_| ((rng.next_f64() * 2.0 - 1.0) * 0.05) as f32)
                    .collect();
                quantize(ty, &x)
            })
            .clone();
        w.tensor(name, &[cols as u64, rows as u64], ty, bytes);
    };
    let f = s.formats;
    let (qd, kvd) = (s.heads * hd, s.kv_heads * hd);
    mat(&mut w, "token_embd.weight", s.vocab, s.hidden, f[7]);
    let ones = quantize(QuantType::F32, &vec![1.0; s.hidden]);
    for l in 0..s.layers {
        let n = |x: &str| format!("blk.{l}.{x}.weight");
        mat(&mut w, &n("attn_q"), qd, s.hidden, f[0]);
        mat(&mut w, &n("attn_k"), kvd, s.hidden, f[1]);
        mat(&mut w, &n("attn_v"), kvd, s.hidden, f[2]);
        mat(&mut w, &n("attn_output"), s.hidden, qd, f[3]);
        mat(&mut w, &n("ffn_gate"), s.ffn, s.hidden, f[4]);
        mat(&mut w, &n("ffn_up"), s.ffn, s.hidden, f[5]);
        mat(&mut w, &n("ffn_down"), s.hidden, s.ffn, f[6]);
        for t in ["attn_norm", "ffn_norm"] {
            w.tensor(&n(t), &[s.hidden as u64], QuantType::F32, ones.clone());
        }
        if qwen3 {
            for t in ["attn_q_norm", "attn_k_norm"] {
                w.tensor(&n(t), &[hd as u64], QuantType::F32, ones[..4 * hd].to_vec());
            }
        }
    }
    w.tensor(
        "output_norm.weight",
        &[s.hidden as u64],
        QuantType::F32,
        ones,
    );
    if !s.tied {
        mat(&mut w, "output.weight", s.vocab, s.hidden, f[7]);
    }
    w
}

/// Three control tokens, the 256 byte-level characters, "he" (the one merge), then filler tokens
/// up to `size`.
fn vocab(size: usize) -> (Vec<String>, Vec<i32>) {
    let mut tokens: Vec<String> = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
        .map(String::from)
        .to_vec();
    let mut types = vec![3, 3, 3];
    tokens.extend(byte_chars().into_iter().map(String::from));
    tokens.push("he".into());
    types.resize(tokens.len(), 1);
    let mut i = 0;
    while tokens.len() < size {
        tokens.push(format!("<fill{i}>"));
        types.push(1);
        i += 1;
    }
    (tokens, types)
}

/// GPT-2's byte-to-character table (byte-level BPE's alphabet).
fn byte_chars() -> Vec<char> {
    let mut extra = 0u32;
    (0..256u32)
        .map(|b| {
            let printable =
                (33..=126).contains(&b) || (161..=172).contains(&b) || (174..=255).contains(&b);
            if printable {
                char::from_u32(b).unwrap()
            } else {
                extra += 1;
                char::from_u32(255 + extra).unwrap()
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::decoder::Decoder;

    /// `s` written to a temporary file and opened.
    fn written(s: &Shape) -> (tempfile::TempDir, Decoder) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("m.gguf");
        write(s, 1).write(&path).unwrap();
        (dir, Decoder::open(&path).unwrap())
    }

    #[test]
    fn a_random_model_loads_with_its_shape_and_vocabulary() {
        let s = Shape {
            name: "test",
            layers: 2,
            vocab: 400,
            ..shape("smollm2-135m").unwrap()
        };
        let (_dir, m) = written(&s);
        assert_eq!(
            (
                m.config.num_layers,
                m.config.hidden,
                m.config.ffn,
                m.config.vocab_size
            ),
            (2, 576, 1536, 400)
        );
        assert_eq!(m.layers[0].wq.ty, QuantType::Q4_1);
        let t = crate::model::tokenizer::Tokenizer::from_gguf(&m.gguf).unwrap();
        let ids = t.encode("hello").unwrap();
        assert_eq!(t.decode(&ids), "hello");
        assert!(shape("nope").unwrap_err().contains("llama-1b"));
        // q4_0's Q6_K embedding is not whole blocks of 576 columns: Q8_0, as llama-quantize does.
        let q4 = with_quant(s, "q4_0").unwrap();
        let (_dir, m) = written(&q4);
        assert_eq!(
            (m.token_embd.ty, m.layers[0].wq.ty),
            (QuantType::Q8_0, QuantType::Q4_0)
        );
        assert_eq!(fallback(QuantType::Q4K, 576), QuantType::Q5_0);
        assert_eq!(fallback(QuantType::Q4K, 512), QuantType::Q4K);
        assert_eq!(fallback(QuantType::IQ4XS, 96), QuantType::IQ4NL);
        assert_eq!(fallback(QuantType::Q6K, 40), QuantType::F16);
        let q8 = with_quant(shape("llama-8b").unwrap(), "q8_0").unwrap();
        assert_eq!((q8.formats[7], q8.tied), (QuantType::Q8_0, false));
        assert!(with_quant(q8, "q3").is_err());
    }

    #[test]
    fn a_random_qwen3_has_its_head_width_and_head_norms() {
        let s = Shape {
            layers: 2,
            vocab: 400,
            ..shape("qwen3-0.6b").unwrap()
        };
        let (_dir, m) = written(&s);
        let c = &m.config;
        assert_eq!(
            (c.hidden, c.head_dim, c.num_heads, c.qk_norm),
            (1024, 128, 16, true)
        );
        assert_eq!(m.gguf.get_str("general.architecture").unwrap(), "qwen3");
        assert_eq!(
            (m.layers[0].wq.rows, m.layers[0].wq.ty),
            (2048, QuantType::Q4K)
        );
    }
}
