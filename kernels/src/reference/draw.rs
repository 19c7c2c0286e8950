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
