//! Each row's next token drawn on the GPU (`cuda/draw.cuh`): the sampler's rule for a draw from
//! the whole distribution (greedy, or the inverse CDF at a uniform the host draws from the
//! sequence's own random stream; or among the top-k candidates, top-p and min-p applied), its
//! log-prob and the top alternatives, so that a decode step reads back a few words a row instead
//! of its logits. A nucleus (top-p or min-p without a top-k) is drawn among the row's
//! `DRAW_CANDIDATES` best where its cut falls among them; where it does not (a flat
//! distribution), `draw` reads the row's log-probs back and draws it by `reference::truncated_draw`
//! on the host, so every spec gets its token. Rows the rule does not cover (penalties, biases,
//! grammars, a top-k above `DRAW_CANDIDATES`) keep their logits for the host's sampler.

use super::launch::len_at_least;
use super::{check, Gpu, Result};
use cudarc::driver::{CudaSlice, LaunchConfig};

/// The most alternatives a drawn row reports (`FW_DRAW_TOP`; OpenAI's `top_logprobs` ≤ 20).
pub const DRAW_TOP: usize = 20;
/// The largest top-k drawn on the device (`FW_DRAW_CAND`).
pub const DRAW_CANDIDATES: usize = 128;
/// `FW_DRAW_THREADS`, `FW_DRAW_SPEC_WORDS`, `FW_DRAWN_WORDS`.
const THREADS: u32 = 512;
const SPEC_WORDS: usize = 9;
/// `FW_DRAW_HOST`: a nucleus whose cut reaches past the candidates, for the host to draw.
const HOST: u32 = u32::MAX;
const DRAWN_WORDS: usize = 4 + 2 * DRAW_TOP;
/// `FW_SCORE_SPEC_WORDS`, `FW_NORMALIZE_SPEC_WORDS`.
const SCORE_SPEC_WORDS: usize = 3;
const NORMALIZE_SPEC_WORDS: usize = 2;

/// How one row of logits is drawn.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DrawSpec {
    /// The row of the step's logits.
    pub row: u32,
    /// None: greedy (the argmax of log-softmax(logits)); Some((T, u)): the inverse CDF of
    /// log-softmax(logits / T) at u in [0, 1).
    pub sample: Option<(f32, f64)>,
    /// How many alternatives to report (≤ `DRAW_TOP`).
    pub top: usize,
    /// What cuts the distribution before a (non-greedy) draw.
    pub truncate: Truncate,
}

/// Top-k, top-p and min-p (`reference::Truncate`); on the device a top-k of at most
/// `DRAW_CANDIDATES` (the candidates the draw is made among), or none.
pub use crate::reference::Truncate;

/// A drawn row: the token, its log-prob, and the `top` best (token, log-prob), best first.
#[derive(Clone, Debug, PartialEq)]
pub struct Drawn {
    pub token: u32,
    pub logprob: f32,
    /// The probability mass the truncation kept (1 when nothing was cut or greedy): the token's
    /// log-prob under the distribution drawn from is `logprob − ln kept`.
    pub kept: f64,
    pub top: Vec<(u32, f32)>,
}

/// A step's specs and results on the device, for up to `rows` drawn rows.
pub struct DrawBuffers {
    spec: CudaSlice<u32>,
    out: CudaSlice<u32>,
    host: Vec<u32>,
    rows: usize,
}

/// A row whose log-prob of a given token is wanted (`Gpu::score`): the training forward's.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ScoreSpec {
    /// The row of the step's logits.
    pub row: u32,
    pub token: u32,
    /// Log-softmax(logits / T); None: at T = 1 (greedy's log-probs, as the sampler reports them).
    pub temperature: Option<f32>,
}

/// A row whose log-sum-exp at a temperature is wanted (`Gpu::normalize`): a row the host samples
/// with the draw's log-probs.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct NormSpec {
    /// The row of the step's logits.
    pub row: u32,
    /// Log-softmax(logits / T); None: at T = 1 (greedy's log-probs, as the sampler reports them).
    pub temperature: Option<f32>,
}

/// A scored or normalized row's first words: the row (of `n`), 1/T's bits.
fn row_words(what: &str, row: u32, temperature: Option<f32>, n: usize) -> Result<[u32; 2]> {
    check((row as usize) < n, || format!("{what}: row {row} of {n}"))?;
    if let Some(t) = temperature {
        check(t > 0.0 && t.is_finite(), || {
            format!("{what}: temperature {t}")
        })?;
    }
    Ok([row, inverse(temperature).to_bits()])
}

/// 1/T as the sampler scales (`policy::scale_and_normalize`): 1 when greedy or T = 1, where it
/// does not scale (and x·1 = x).
fn inverse(temperature: Option<f32>) -> f32 {
    match temperature {
        Some(t) if t != 1.0 => 1.0 / t,
        _ => 1.0,
    }
}

impl DrawSpec {
    /// The spec's words (`fw_draw`'s layout): row, 1/T, u's low and high words, greedy, k,
    /// top-k, top-p, min-p. 1/T is 1 when greedy or T = 1, where the sampler does not scale.
    fn words(&self) -> [u32; SPEC_WORDS] {
        let (inv, u) = (
            inverse(self.sample.map(|s| s.0)),
            self.sample.map_or(0.0, |s| s.1),
        );
        let ub = u.to_bits();
        [
            self.row,
            inv.to_bits(),
            ub as u32,
            (ub >> 32) as u32,
            self.sample.is_none() as u32,
            self.top as u32,
            self.truncate.top_k as u32,
            self.truncate.top_p.to_bits(),
            self.truncate.min_p.to_bits(),
        ]
    }
}

impl Gpu {
    /// Room for the draws of up to `rows` rows a step.
    pub fn draw_buffers(&self, rows: usize) -> Result<DrawBuffers> {
        let rows = rows.max(1);
        Ok(DrawBuffers {
            spec: self.zeros(rows * SPEC_WORDS)?,
            out: self.zeros(rows * DRAWN_WORDS)?,
            host: vec![0; rows * DRAWN_WORDS],
            rows,
        })
    }

    /// Draw the rows `specs` name from `x` (`n` rows of `vocab` logits; each drawn row is left as
    /// its log-probs, the others untouched), after everything queued before; `out` gets one
    /// `Drawn` per spec, in order.
    pub fn draw(
        &self,
        x: &mut CudaSlice<f32>,
        n: usize,
        vocab: usize,
        specs: &[DrawSpec],
        bufs: &mut DrawBuffers,
        out: &mut Vec<Drawn>,
    ) -> Result<()> {
        out.clear();
        let mut words = Vec::with_capacity(specs.len() * SPEC_WORDS);
        for s in specs {
            check(s.top <= DRAW_TOP.min(vocab), || {
                format!(
                    "draw: {} alternatives of {vocab}, at most {DRAW_TOP}",
                    s.top
                )
            })?;
            if let Some((t, u)) = s.sample {
                check(t > 0.0 && t.is_finite() && (0.0..1.0).contains(&u), || {
                    format!("draw: temperature {t}, u {u}")
                })?;
            }
            let c = s.truncate;
            check(
                c.top_k <= DRAW_CANDIDATES
                    && c.top_p > 0.0
                    && c.top_p <= 1.0
                    && (0.0..=1.0).contains(&c.min_p),
                || format!("draw: {c:?} (a top-k of at most {DRAW_CANDIDATES})"),
            )?;
            words.extend(s.words());
        }
        let rows: Vec<u32> = specs.iter().map(|s| s.row).collect();
        self.launch_specs("draw", x, n, vocab, &rows, &words, bufs, DRAWN_WORDS)?;
        let got = &bufs.host[..specs.len() * DRAWN_WORDS];
        out.extend(got.chunks(DRAWN_WORDS).zip(specs).map(|(w, s)| {
            Drawn {
                token: w[0],
                logprob: f32::from_bits(w[1]),
                kept: f64::from_bits(w[2] as u64 | (w[3] as u64) << 32),
                top: (0..s.top)
                    .map(|j| (w[4 + j], f32::from_bits(w[4 + DRAW_TOP + j])))
                    .collect(),
            }
        }));
        // A nucleus whose cut reaches past the candidates: its log-probs (left in place) drawn
        // here by the reference's rule, at the same uniform.
        let mut lp = Vec::new();
        for (d, s) in out.iter_mut().zip(specs) {
            if d.token != HOST {
                continue;
            }
            let (Some((_, u)), c) = (s.sample, s.truncate) else {
                return Err(super::GpuError("draw: the kernel left a greedy row".into()));
            };
            let r = s.row as usize * vocab;
            lp.resize(vocab, 0.0);
            self.read_into(&x.slice(r..r + vocab), &mut lp)?;
            let (token, kept) = crate::reference::truncated_draw(&lp, 0, c.top_p, c.min_p, u);
            (d.token, d.logprob, d.kept) = (token, lp[token as usize], kept);
        }
        Ok(())
    }

    /// The log-prob of each spec's token in its row of `x` (`n` rows of `vocab` logits) at its
    /// temperature, by the draw's arithmetic (`fw_draw_normalize`: a drawn token's log-prob bit
    /// for bit), after everything queued before; each scored row is left as its log-probs. `out`
    /// gets one log-prob per spec, in order.
    pub fn score(
        &self,
        x: &mut CudaSlice<f32>,
        n: usize,
        vocab: usize,
        specs: &[ScoreSpec],
        bufs: &mut DrawBuffers,
        out: &mut Vec<f32>,
    ) -> Result<()> {
        let mut words = Vec::with_capacity(specs.len() * SCORE_SPEC_WORDS);
        for s in specs {
            check((s.token as usize) < vocab, || {
                format!("score: token {} of {vocab}", s.token)
            })?;
            words.extend(row_words("score", s.row, s.temperature, n)?);
            words.push(s.token);
        }
        self.launch_rows("score", x, n, vocab, &words, SCORE_SPEC_WORDS, bufs, out)
    }

    /// The log-sum-exp each spec's row of `x` (`n` rows of `vocab` logits) has at its temperature
    /// by the draw's arithmetic (`fw_normalize`), after everything queued before; each row is left
    /// as its log-probs. `out` gets one per spec, in order: with it the host computes a row's
    /// log-probs as the draw does (`policy::normalize_with`), bit for bit, from the row's logits
    /// read before.
    pub fn normalize(
        &self,
        x: &mut CudaSlice<f32>,
        n: usize,
        vocab: usize,
        specs: &[NormSpec],
        bufs: &mut DrawBuffers,
        out: &mut Vec<f32>,
    ) -> Result<()> {
        let mut words = Vec::with_capacity(specs.len() * NORMALIZE_SPEC_WORDS);
        for s in specs {
            words.extend(row_words("normalize", s.row, s.temperature, n)?);
        }
        let w = NORMALIZE_SPEC_WORDS;
        self.launch_rows("normalize", x, n, vocab, &words, w, bufs, out)
    }

    /// `fw_<what>` over the rows of `x` (`n` rows of `vocab`) its specs `words` name (`spec_words`
    /// a row, the row first; a block each), the specs written first, then one word a row read
    /// back into `out` as an f32. No row may be named twice: each is turned into its log-probs in
    /// place, and a second spec would read those.
    #[allow(clippy::too_many_arguments)]
    fn launch_rows(
        &self,
        what: &str,
        x: &mut CudaSlice<f32>,
        n: usize,
        vocab: usize,
        words: &[u32],
        spec_words: usize,
        bufs: &mut DrawBuffers,
        out: &mut Vec<f32>,
    ) -> Result<()> {
        out.clear();
        let rows: Vec<u32> = words.iter().step_by(spec_words).copied().collect();
        self.launch_specs(what, x, n, vocab, &rows, words, bufs, 1)?;
        out.extend(bufs.host[..rows.len()].iter().map(|&w| f32::from_bits(w)));
        Ok(())
    }

    /// `fw_<what>` over `rows` of `x` (`n` rows of `vocab`; a block each), its specs `words`
    /// written first, then `out_words` words a row read back into `bufs.host`. No row may be
    /// named twice: each is turned into its log-probs in place, and a second spec would read
    /// those.
    #[allow(clippy::too_many_arguments)]
    fn launch_specs(
        &self,
        what: &str,
        x: &mut CudaSlice<f32>,
        n: usize,
        vocab: usize,
        rows: &[u32],
        words: &[u32],
        bufs: &mut DrawBuffers,
        out_words: usize,
    ) -> Result<()> {
        check(rows.len() <= bufs.rows, || {
            format!("{what}: {} rows, room for {}", rows.len(), bufs.rows)
        })?;
        check(vocab > 0 && vocab <= i32::MAX as usize, || {
            format!("{what}: a vocabulary of {vocab}")
        })?;
        len_at_least(x, n * vocab, what)?;
        check(rows.iter().all(|&r| (r as usize) < n), || {
            format!("{what}: a row past the step's {n}")
        })?;
        let mut seen = rows.to_vec();
        seen.sort_unstable();
        check(seen.windows(2).all(|w| w[0] != w[1]), || {
            format!("{what}: a row named twice")
        })?;
        if rows.is_empty() {
            return Ok(());
        }
        self.write(words, &mut bufs.spec)?;
        let f = self.function(&format!("fw_{what}"))?;
        let (xp, v) = (self.ptr_mut(x), vocab as i32);
        let (sp, op) = (self.ptr(&bufs.spec), self.ptr_mut(&mut bufs.out));
        let cfg = LaunchConfig {
            grid_dim: (rows.len() as u32, 1, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        self.launch(f, cfg, &[&xp, &v, &sp, &op])?;
        let got = &mut bufs.host[..rows.len() * out_words];
        self.read_into(&bufs.out.slice(..got.len()), got)
    }
}
