//! An independent, straightforward forward pass for tests: f64, dequantized weights, full
//! attention over the history, every projection through an optional hook (adapters).

use flywheel::kernels::reference;
use flywheel::model::gguf::Gguf;

/// Dequantized tensor as f64 rows (rows, cols); a stack of matrices (experts) as all their rows.
pub fn mat(g: &Gguf, name: &str) -> Vec<Vec<f64>> {
    let t = g.tensor(name).unwrap_or_else(|| panic!("{name}"));
    let cols = t.dims[0] as usize;
    let rows = t.dims[1..].iter().product::<u64>().max(1) as usize;
    let mut all = vec![0.0f32; rows * cols];
    reference::dequantize_row(t.ty, g.tensor_data(t), &mut all);
    all.chunks(cols)
        .map(|r| r.iter().map(|v| *v as f64).collect())
        .collect()
}

pub fn matvec(w: &[Vec<f64>], x: &[f64]) -> Vec<f64> {
    w.iter()
        .map(|r| r.iter().zip(x).map(|(a, b)| a * b).sum())
        .collect()
}

pub fn rmsnorm(x: &[f64], w: &[f64], eps: f64) -> Vec<f64> {
    let ms = x.iter().map(|v| v * v).sum::<f64>() / x.len() as f64;
    let s = 1.0 / (ms + eps).sqrt();
    x.iter().zip(w).map(|(a, b)| a * s * b).collect()
}

/// RoPE on each head of `x`: pairs (2i, 2i+1) for `llama` GGUFs, (i, i + hd/2) (GPT-NeoX's, as
/// in Hugging Face's `rotate_half`) for the other families.
/// `factors`: Llama 3's per-frequency divisors of the angle (`rope_freqs`).
pub fn rope(x: &mut [f64], pos: usize, hd: usize, base: f64, neox: bool, factors: &[f64]) {
    for h in x.chunks_mut(hd) {
        for i in 0..hd / 2 {
            let f = factors.get(i).copied().unwrap_or(1.0);
            let th = pos as f64 * base.powf(-2.0 * i as f64 / hd as f64) / f;
            let (p, q) = if neox {
                (i, i + hd / 2)
            } else {
                (2 * i, 2 * i + 1)
            };
            let (a, b) = (h[p], h[q]);
            h[p] = a * th.cos() - b * th.sin();
            h[q] = a * th.sin() + b * th.cos();
        }
    }
}

/// Log-probs of the next token after each prefix of `tokens`, computed the obvious way.
pub fn naive_logprobs(path: &std::path::Path, tokens: &[u32]) -> Vec<Vec<f64>> {
    naive_logprobs_with(path, tokens, &|_, _, w, x| matvec(w, x))
}

/// A projection of layer `l`: (layer, target index q k v o gate up down = 0..7, W, input) -> output;
/// the LM head is target index 7 (its layer argument means nothing).
pub type Project<'a> = dyn Fn(usize, usize, &[Vec<f64>], &[f64]) -> Vec<f64> + 'a;

/// `naive_logprobs` with every linear projection of the blocks computed by `project` (adapters).
pub fn naive_logprobs_with(
    path: &std::path::Path,
    tokens: &[u32],
    project: &Project,
) -> Vec<Vec<f64>> {
    let g = Gguf::open(path).unwrap();
    let out = if g.tensor("output.weight").is_some() {
        mat(&g, "output.weight")
    } else {
        mat(&g, "token_embd.weight")
    };
    let (_, final_cap) = softcaps(&g);
    naive_hidden_with(path, tokens, project)
        .iter()
        .map(|x| {
            let logits: Vec<f64> = project(0, 7, &out, x)
                .into_iter()
                .map(|z| final_cap.map_or(z, |c| c * (z / c).tanh()))
                .collect();
            let mx = logits.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let lse = mx + logits.iter().map(|v| (v - mx).exp()).sum::<f64>().ln();
            logits.iter().map(|v| v - lse).collect()
        })
        .collect()
}

/// Gemma 2's soft-caps of the attention scores and the final logits, c·tanh(x / c): the file's
/// keys (0: none), else Gemma 2's 50 and 30 (as llama.cpp).
pub fn softcaps(g: &Gguf) -> (Option<f64>, Option<f64>) {
    let arch = g.get_str("general.architecture").unwrap().to_string();
    let gemma2 = arch == "gemma2";
    let cap = |key: &str, default: f64| match g.get(&format!("{arch}.{key}")) {
        Some(v) => Some(v.as_f64().unwrap()).filter(|&c| c != 0.0),
        None => gemma2.then_some(default),
    };
    (
        cap("attn_logit_softcapping", 50.0),
        cap("final_logit_softcapping", 30.0),
    )
}

/// Every position's final hidden state after the output norm (what the head reads; what an
/// embedding pools).
pub fn naive_hidden_with(
    path: &std::path::Path,
    tokens: &[u32],
    project: &Project,
) -> Vec<Vec<f64>> {
    let g = Gguf::open(path).unwrap();
    let arch = g.get_str("general.architecture").unwrap().to_string();
    let neox = arch != "llama";
    let get = |k: &str| g.get(&format!("{arch}.{k}")).unwrap().as_f64().unwrap();
    let (layers, hidden) = (
        get("block_count") as usize,
        get("embedding_length") as usize,
    );
    let (heads, kvh) = (
        get("attention.head_count") as usize,
        get("attention.head_count_kv") as usize,
    );
    // llama.cpp's converter leaves the RoPE base out where it is the default (Gemma 2's 10000).
    let base = g
        .get(&format!("{arch}.rope.freq_base"))
        .map_or(10000.0, |v| v.as_f64().unwrap());
    let eps = get("attention.layer_norm_rms_epsilon");
    let hd = g
        .get(&format!("{arch}.attention.key_length"))
        .map_or(hidden / heads, |v| v.as_f64().unwrap() as usize);
    let factors: Vec<f64> = if g.tensor("rope_freqs.weight").is_some() {
        mat(&g, "rope_freqs.weight")[0].clone()
    } else {
        Vec::new()
    };
    // Gemma 3: embeddings times √hidden, post-norms, GeGLU, and sliding-window layers (all but
    // every 6th) with their own RoPE base. Gemma 2: the same with every other layer global, one
    // RoPE base, and soft-capped scores.
    let gemma = arch.starts_with("gemma");
    let (period, local_base) = if arch == "gemma2" {
        (2, base)
    } else {
        (6, 10000.0)
    };
    let (score_cap, _) = softcaps(&g);
    let window = g
        .get(&format!("{arch}.attention.sliding_window"))
        .map(|v| v.as_f64().unwrap() as usize);
    let mut emb = mat(&g, "token_embd.weight");
    if gemma {
        let s = (hidden as f64).sqrt();
        emb.iter_mut().flatten().for_each(|v| *v *= s);
    }
    let on = &mat(&g, "output_norm.weight")[0];
    let mut xs: Vec<Vec<f64>> = tokens.iter().map(|&t| emb[t as usize].clone()).collect();
    for l in 0..layers {
        let m = |n: &str| mat(&g, &format!("blk.{l}.{n}.weight"));
        let (wq, wk, wv, wo) = (m("attn_q"), m("attn_k"), m("attn_v"), m("attn_output"));
        let moe = g
            .tensor(&format!("blk.{l}.ffn_gate_inp.weight"))
            .map(|_| Experts::read(&g, &arch, l));
        let dense = |n: &str| if moe.is_none() { m(n) } else { Vec::new() };
        let (wg, wu, wd) = (dense("ffn_gate"), dense("ffn_up"), dense("ffn_down"));
        let (an, fnorm) = (m("attn_norm")[0].clone(), m("ffn_norm")[0].clone());
        let local = gemma && window.is_some() && (l + 1) % period != 0;
        let (base, win) = if local {
            (local_base, window.unwrap())
        } else {
            (base, usize::MAX)
        };
        let post = |t: &str, y: Vec<f64>| -> Vec<f64> {
            match g.tensor(&format!("blk.{l}.{t}.weight")) {
                Some(_) => rmsnorm(&y, &m(t)[0], eps),
                None => y,
            }
        };
        let mut ks = Vec::new();
        let mut vs = Vec::new();
        let mut qs = Vec::new();
        for (p, x) in xs.iter().enumerate() {
            let n = rmsnorm(x, &an, eps);
            // Biases (Qwen2) after the projection, adapters included (PEFT's order).
            let bias = |t: &str, mut y: Vec<f64>| {
                if let Some(b) = g
                    .tensor(&format!("blk.{l}.{t}.bias"))
                    .map(|_| mat(&g, &format!("blk.{l}.{t}.bias"))[0].clone())
                {
                    y.iter_mut().zip(&b).for_each(|(a, b)| *a += b);
                }
                y
            };
            let mut q = bias("attn_q", project(l, 0, &wq, &n));
            let mut k = bias("attn_k", project(l, 1, &wk, &n));
            // Per-head RMSNorm of q and k (Qwen3), before RoPE.
            for (y, t) in [(&mut q, "attn_q_norm"), (&mut k, "attn_k_norm")] {
                if g.tensor(&format!("blk.{l}.{t}.weight")).is_some() {
                    let w = m(t)[0].clone();
                    let normed: Vec<f64> = y.chunks(hd).flat_map(|h| rmsnorm(h, &w, eps)).collect();
                    *y = normed;
                }
            }
            rope(&mut q, p, hd, base, neox, &factors);
            rope(&mut k, p, hd, base, neox, &factors);
            qs.push(q);
            ks.push(k);
            vs.push(bias("attn_v", project(l, 2, &wv, &n)));
        }
        for p in 0..xs.len() {
            let mut att = vec![0.0; heads * hd];
            let lo = (p + 1).saturating_sub(win);
            for h in 0..heads {
                let kv = h / (heads / kvh);
                let sc: Vec<f64> = (lo..=p)
                    .map(|j| {
                        (0..hd)
                            .map(|d| qs[p][h * hd + d] * ks[j][kv * hd + d])
                            .sum::<f64>()
                            / (hd as f64).sqrt()
                    })
                    .map(|x| score_cap.map_or(x, |c| c * (x / c).tanh()))
                    .collect();
                let mx = sc.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let e: Vec<f64> = sc.iter().map(|s| (s - mx).exp()).collect();
                let z: f64 = e.iter().sum();
                for j in lo..=p {
                    for d in 0..hd {
                        att[h * hd + d] += e[j - lo] / z * vs[j][kv * hd + d];
                    }
                }
            }
            let o = post("post_attention_norm", project(l, 3, &wo, &att));
            for (a, b) in xs[p].iter_mut().zip(o) {
                *a += b;
            }
            let n = rmsnorm(&xs[p], &fnorm, eps);
            let d = match &moe {
                None => {
                    let (gt, up) = (project(l, 4, &wg, &n), project(l, 5, &wu, &n));
                    let act = if gemma {
                        gt.iter()
                            .zip(&up)
                            .map(|(g, u)| {
                                let t = ((2.0 / std::f64::consts::PI).sqrt()
                                    * (g + 0.044715 * g * g * g))
                                    .tanh();
                                0.5 * g * (1.0 + t) * u
                            })
                            .collect()
                    } else {
                        swiglu(&gt, &up)
                    };
                    post("post_ffw_norm", project(l, 6, &wd, &act))
                }
                Some(experts) => experts.forward(&n),
            };
            for (a, b) in xs[p].iter_mut().zip(d) {
                *a += b;
            }
        }
    }
    xs.iter().map(|x| rmsnorm(x, on, eps)).collect()
}

fn swiglu(gate: &[f64], up: &[f64]) -> Vec<f64> {
    gate.iter()
        .zip(up)
        .map(|(g, u)| g / (1.0 + (-g).exp()) * u)
        .collect()
}

/// A mixture-of-experts MLP as Qwen3-MoE's modeling code writes it: softmax over the router's
/// logits, the top `used`, renormalised (unless the file says not), the weighted sum of the
/// chosen experts' SwiGLU outputs.
pub struct Experts {
    router: Vec<Vec<f64>>,
    gate: Vec<Vec<f64>>,
    up: Vec<Vec<f64>>,
    down: Vec<Vec<f64>>,
    used: usize,
    width: usize,
    hidden: usize,
    norm: bool,
}

impl Experts {
    pub fn read(g: &Gguf, arch: &str, l: usize) -> Experts {
        let get = |k: &str| g.get(&format!("{arch}.{k}")).map(|v| v.as_f64().unwrap());
        let m = |n: &str| mat(g, &format!("blk.{l}.{n}.weight"));
        let router = m("ffn_gate_inp");
        Experts {
            hidden: router[0].len(),
            router,
            gate: m("ffn_gate_exps"),
            up: m("ffn_up_exps"),
            down: m("ffn_down_exps"),
            used: get("expert_used_count").unwrap() as usize,
            width: get("expert_feed_forward_length").unwrap() as usize,
            norm: get("expert_weights_norm").is_none_or(|v| v != 0.0),
        }
    }

    pub fn forward(&self, x: &[f64]) -> Vec<f64> {
        let z = matvec(&self.router, x);
        let mx = z.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let e: Vec<f64> = z.iter().map(|v| (v - mx).exp()).collect();
        let s: f64 = e.iter().sum();
        let p: Vec<f64> = e.iter().map(|v| v / s).collect();
        let mut order: Vec<usize> = (0..p.len()).collect();
        order.sort_by(|a, b| p[*b].total_cmp(&p[*a]));
        let chosen = &order[..self.used];
        let total: f64 = chosen.iter().map(|&i| p[i]).sum();
        let (f, h) = (self.width, self.hidden);
        let mut y = vec![0.0; h];
        for &i in chosen {
            let w = if self.norm { p[i] / total } else { p[i] };
            let gt = matvec(&self.gate[i * f..(i + 1) * f], x);
            let up = matvec(&self.up[i * f..(i + 1) * f], x);
            let d = matvec(&self.down[i * h..(i + 1) * h], &swiglu(&gt, &up));
            y.iter_mut().zip(d).for_each(|(a, b)| *a += w * b);
        }
        y
    }
}
