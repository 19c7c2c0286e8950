//! Drawing a token from a row of log-probs: the engine's sampler calls these, and the GPU's draw
//! kernel (`cuda/draw.cuh`) is tested against them.

/// The index of the largest value, the lowest of equals (NaN never wins: `>` never holds for it).
pub fn argmax(x: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in x.iter().enumerate() {
        if v > x[best] {
            best = i;
        }
    }
    best as u32
}

/// The `k` best indices, best first: by value (`total_cmp`, largest first), then by index.
pub fn top_indices(lp: &[f32], k: usize) -> Vec<u32> {
    if k == 0 {
        return Vec::new();
    }
    let mut idx: Vec<u32> = (0..lp.len() as u32).collect();
    let k = k.min(idx.len());
    let cmp = |a: &u32, b: &u32| lp[*b as usize].total_cmp(&lp[*a as usize]).then(a.cmp(b));
    idx.select_nth_unstable_by(k - 1, cmp);
    idx.truncate(k);
    idx.sort_by(cmp);
    idx
}

/// A draw from the whole distribution exp(lp) by its inverse CDF at `u` in [0, 1): the first
/// index whose running sum of exp(lp) (f64, in index order) exceeds u·Σ exp(lp). Where rounding
/// leaves none (u·Σ rounded up to Σ), the last token of positive probability, where u → 1 lands
/// (the argmax if none has any).
pub fn inverse_cdf(lp: &[f32], u: f64) -> u32 {
    let target = u * lp.iter().map(|v| (*v as f64).exp()).sum::<f64>();
    let mut acc = 0.0f64;
    for (i, v) in lp.iter().enumerate() {
        acc += (*v as f64).exp();
        if acc > target {
            return i as u32;
        }
    }
    last_possible(lp).unwrap_or_else(|| argmax(lp))
}

/// The last index of positive probability (a log-prob above -inf).
pub fn last_possible(lp: &[f32]) -> Option<u32> {
    lp.iter()
        .rposition(|v| *v > f32::NEG_INFINITY)
        .map(|i| i as u32)
}

/// The cut a sampled draw is made after (the sampler's top-k, top-p and min-p; a top-k of 0 is
/// none): nothing, a top-k (with any top-p and min-p), or a nucleus (top-p or min-p alone).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Truncate {
    pub top_k: usize,
    pub top_p: f32,
    pub min_p: f32,
}

impl Truncate {
    /// Nothing cut: the whole distribution.
    pub const NONE: Truncate = Truncate {
        top_k: 0,
        top_p: 1.0,
        min_p: 0.0,
    };

    /// Whether it cuts anything.
    pub fn cuts(&self) -> bool {
        self.top_k > 0 || self.top_p < 1.0 || self.min_p > 0.0
    }
}

/// The sampler's draw at `u` after the cut `c`: the inverse CDF of the whole distribution where
/// nothing is cut, else `truncated_draw`. Returns the token and the probability mass kept (1
/// where nothing is cut).
pub fn draw_cut(lp: &[f32], c: Truncate, u: f64) -> (u32, f64) {
    if c.cuts() {
        truncated_draw(lp, c.top_k, c.top_p, c.min_p, u)
    } else {
        (inverse_cdf(lp, u), 1.0)
    }
}

/// A draw after top-k, top-p and min-p (the engine sampler's): the candidates (the `top_k` best in
/// `top_indices`' order; every token when 0), then `truncated_pick`. Returns the token and the
/// probability mass kept (its log-prob under the truncated distribution is lp − ln kept).
pub fn truncated_draw(lp: &[f32], top_k: usize, top_p: f32, min_p: f32, u: f64) -> (u32, f64) {
    let k = if top_k > 0 && top_k < lp.len() {
        top_k
    } else {
        lp.len()
    };
    let idx = top_indices(lp, k);
    let sorted: Vec<f32> = idx.iter().map(|&i| lp[i as usize]).collect();
    let (j, kept) = truncated_pick(&sorted, top_p, min_p, u);
    (idx[j], kept)
}

/// `truncated_draw` over the candidates' log-probs in their order: their probabilities exp(lp)
/// (f64); top-p keeps the shortest prefix whose running share (Σ p/total, in order) reaches
/// `top_p`; min-p the prefix at or above `min_p` times the first (at least one); then the first
/// kept candidate whose running sum passes u·kept (the last kept where rounding leaves none).
/// Returns the candidate's position and the mass kept.
pub fn truncated_pick(sorted: &[f32], top_p: f32, min_p: f32, u: f64) -> (usize, f64) {
    let probs: Vec<f64> = sorted.iter().map(|&v| (v as f64).exp()).collect();
    let total: f64 = probs.iter().sum();
    let mut keep = probs.len();
    if top_p < 1.0 {
        let mut acc = 0.0;
        for (j, p) in probs.iter().enumerate() {
            acc += p / total;
            if acc >= top_p as f64 {
                keep = j + 1;
                break;
            }
        }
    }
    if min_p > 0.0 {
        let floor = probs[0] * min_p as f64;
        keep = keep.min(probs.iter().take_while(|&&q| q >= floor).count().max(1));
    }
    let kept: f64 = probs[..keep].iter().sum();
    let target = u * kept;
    let mut acc = 0.0;
    for (j, p) in probs[..keep].iter().enumerate() {
        acc += p;
        if acc > target {
            return (j, kept);
        }
    }
    (keep - 1, kept)
}
