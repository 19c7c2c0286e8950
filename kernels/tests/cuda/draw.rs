//! Tokens drawn on the GPU (`Gpu::draw`, `cuda/draw.cuh`) against the engine sampler's reference
//! (`reference::log_softmax`, `argmax`, `inverse_cdf`, `truncated_draw`, `top_indices`). The host twin checks the
//! same arithmetic on every machine (`tests/cuda_twin.rs`); this checks the kernel: its threads,
//! reductions and launch, several rows at once, the rows not drawn left as they were.

use super::gpu;
use crate::common::Rng;
use flywheel_kernels::cuda::{
    DrawBuffers, DrawSpec, Drawn, Gpu, NormSpec, ScoreSpec, Truncate, DRAW_CANDIDATES, DRAW_TOP,
};
use flywheel_kernels::reference;

#[test]
fn drawn_tokens_and_log_probs_are_the_samplers() {
    let Some(g) = gpu() else { return };
    let mut rng = Rng(41);
    for vocab in [7usize, 1000, 49152, 128256] {
        let n = 9;
        let mut x = rng.vec(n * vocab, 6.0);
        if vocab > 10 {
            // A tie at the top of row 0 and a masked token.
            let top = x[..vocab].iter().cloned().fold(f32::NEG_INFINITY, f32::max) + 0.5;
            (x[9], x[4], x[3]) = (top, top, f32::NEG_INFINITY);
        }
        // Row 7 peaked: a few tokens hold most of the mass (its nucleus is among the 128 best).
        x[7 * vocab..8 * vocab].iter_mut().for_each(|v| *v *= 4.0);
        let mut dx = g.upload(&x).unwrap();
        // Rows 0, 2, 3, 5, 6, 7, 8: greedy, and draws at three temperatures, two of them nuclei
        // (row 6's flat: past the candidates from 1000 tokens on, drawn from its log-probs by
        // the host; row 7's peaked: on the device); rows 1 and 4 kept.
        let specs: Vec<DrawSpec> = [
            (0u32, None),
            (2, Some(0.7f32)),
            (3, Some(1.0)),
            (5, Some(1.3)),
            (6, Some(1.0)),
            (7, Some(0.8)),
            (8, None),
        ]
        .into_iter()
        .map(|(row, t)| DrawSpec {
            row,
            sample: t.map(|t| (t, (rng.next() >> 11) as f64 / (1u64 << 53) as f64)),
            top: (row as usize * 3).min(DRAW_TOP).min(vocab),
            // Row 3 among llama.cpp's default cut, row 5 among its 5 best.
            truncate: match row {
                3 => Truncate {
                    top_k: 40,
                    top_p: 0.95,
                    min_p: 0.05,
                },
                5 => Truncate {
                    top_k: 5,
                    top_p: 1.0,
                    min_p: 0.0,
                },
                6 => Truncate {
                    top_k: 0,
                    top_p: 0.9,
                    min_p: 0.0,
                },
                7 => Truncate {
                    top_k: 0,
                    top_p: 0.95,
                    min_p: 0.05,
                },
                _ => Truncate::NONE,
            },
        })
        .collect();
        let mut bufs = g.draw_buffers(8).unwrap();
        let mut out = Vec::new();
        g.draw(&mut dx, n, vocab, &specs, &mut bufs, &mut out)
            .unwrap();
        let after = g.download(&dx).unwrap();
        assert_eq!(out.len(), specs.len());
        for (s, d) in specs.iter().zip(&out) {
            let r = s.row as usize;
            let mut want = x[r * vocab..(r + 1) * vocab].to_vec();
            if let Some((t, _)) = s.sample.filter(|(t, _)| *t != 1.0) {
                let inv = 1.0 / t;
                want.iter_mut().for_each(|v| *v *= inv);
            }
            reference::log_softmax(&mut want);
            let lp = &after[r * vocab..(r + 1) * vocab];
            // The device's f64 exp and log may round differently from the host's by an ulp of
            // f64, which moves lse by an ulp of f32 at most.
            for (i, (&a, &b)) in lp.iter().zip(&want).enumerate() {
                assert!(
                    a == b || (a - b).abs() <= 4e-7 * b.abs().max(1.0),
                    "vocab {vocab} row {r}: log-prob {i} is {a} on the GPU, {b} by the reference"
                );
            }
            // The rest is exact given the device's log-probs.
            let (token, kept) = match s.sample {
                None => (reference::argmax(lp), 1.0),
                Some((_, u)) => reference::draw_cut(lp, s.truncate, u),
            };
            assert_eq!(d.token, token, "vocab {vocab} row {r}: {s:?}");
            // The device's f64 exp may round an ulp away from the host's.
            assert!(
                (d.kept - kept).abs() <= 1e-12 * kept,
                "vocab {vocab} row {r}: mass kept"
            );
            assert_eq!(d.logprob.to_bits(), lp[token as usize].to_bits());
            let top: Vec<(u32, f32)> = reference::top_indices(lp, s.top)
                .into_iter()
                .map(|i| (i, lp[i as usize]))
                .collect();
            assert_eq!(d.top, top, "vocab {vocab} row {r}: the top {}", s.top);
        }
        if vocab > 10 {
            assert_eq!(out[0].token, 4, "greedy at a tie: the lower index");
        }
        for r in [1usize, 4] {
            assert_eq!(
                after[r * vocab..(r + 1) * vocab],
                x[r * vocab..(r + 1) * vocab]
            );
        }
    }
}

#[test]
fn draws_the_kernel_cannot_take_are_refused() {
    let Some(g) = gpu() else { return };
    let mut dx = g.upload(&vec![0.0f32; 2 * 50]).unwrap();
    let mut bufs = g.draw_buffers(2).unwrap();
    let mut out = Vec::new();
    let spec = |row, sample, top| DrawSpec {
        row,
        sample,
        top,
        truncate: Truncate::NONE,
    };
    let cut = |top_k, top_p| DrawSpec {
        truncate: Truncate {
            top_k,
            top_p,
            min_p: 0.0,
        },
        ..spec(0, Some((1.0, 0.5)), 0)
    };
    for bad in [
        vec![spec(2, None, 0)],                                     // past the rows
        vec![spec(0, None, DRAW_TOP + 1)],                          // too many alternatives
        vec![spec(0, None, 0), spec(0, None, 0)],                   // a row twice
        vec![spec(0, Some((0.0, 0.5)), 0)],                         // no temperature
        vec![spec(0, Some((1.0, 1.0)), 0)],                         // u outside [0, 1)
        vec![spec(0, None, 0), spec(1, None, 0), spec(1, None, 0)], // more than the room
        vec![cut(DRAW_CANDIDATES + 1, 1.0)],                        // too many candidates
        vec![cut(5, 0.0)],                                          // top-p of nothing
    ] {
        assert!(
            g.draw(&mut dx, 2, 50, &bad, &mut bufs, &mut out).is_err(),
            "{bad:?}"
        );
    }
}

/// Greedy, and at temperatures 0.7, 1 and 1.3 (T 1 as greedy's log-probs).
const TEMPS: [Option<f32>; 5] = [None, Some(0.7), Some(1.0), Some(1.3), None];

/// Rows 0..temps.len() of `x` (`n` rows of `vocab`) drawn from the whole distribution at `temps`
/// (a uniform each from `rng`), `top` alternatives each.
#[allow(clippy::too_many_arguments)]
fn draw_rows(
    g: &Gpu,
    x: &[f32],
    n: usize,
    vocab: usize,
    temps: &[Option<f32>],
    top: usize,
    bufs: &mut DrawBuffers,
    rng: &mut Rng,
) -> Vec<Drawn> {
    let specs: Vec<DrawSpec> = temps
        .iter()
        .enumerate()
        .map(|(row, &t)| DrawSpec {
            row: row as u32,
            sample: t.map(|t| (t, (rng.next() >> 11) as f64 / (1u64 << 53) as f64)),
            top,
            truncate: Truncate::NONE,
        })
        .collect();
    let mut drawn = Vec::new();
    let mut dx = g.upload(x).unwrap();
    g.draw(&mut dx, n, vocab, &specs, bufs, &mut drawn).unwrap();
    drawn
}

/// A scored token's log-prob (`Gpu::score`, the training forward's) is the log-prob the draw
/// reports for the same row, token and temperature, bit for bit (the same steps: the sampler's
/// log-probs are the trainer's), and the reference's within an ulp of f32; rows not scored are
/// left as they were, and specs the kernel cannot take are refused.
#[test]
fn scored_log_probs_are_the_drawn_ones() {
    let Some(g) = gpu() else { return };
    let mut rng = Rng(43);
    for vocab in [7usize, 1000, 49152, 128256] {
        let n = 6;
        let x = rng.vec(n * vocab, 6.0);
        // Rows 0..5 drawn greedily or at a temperature (T 1 as greedy's log-probs), then scored
        // at the drawn token from a fresh copy; row 5 neither.
        let mut bufs = g.draw_buffers(8).unwrap();
        let drawn = draw_rows(&g, &x, n, vocab, &TEMPS, 0, &mut bufs, &mut rng);
        let temps = TEMPS;
        let mut scored = Vec::new();
        // Scored in another order (and rows), token by token from the draws.
        let scores: Vec<ScoreSpec> = (0..temps.len())
            .rev()
            .map(|r| ScoreSpec {
                row: r as u32,
                token: drawn[r].token,
                temperature: temps[r],
            })
            .collect();
        let mut sx = g.upload(&x).unwrap();
        g.score(&mut sx, n, vocab, &scores, &mut bufs, &mut scored)
            .unwrap();
        let after = g.download(&sx).unwrap();
        for (s, &lp) in scores.iter().zip(&scored) {
            let r = s.row as usize;
            assert_eq!(
                lp.to_bits(),
                drawn[r].logprob.to_bits(),
                "vocab {vocab} row {r}: scored {lp}, drawn {}",
                drawn[r].logprob
            );
            let mut want = x[r * vocab..(r + 1) * vocab].to_vec();
            if let Some(t) = s.temperature.filter(|&t| t != 1.0) {
                let inv = 1.0 / t;
                want.iter_mut().for_each(|v| *v *= inv);
            }
            reference::log_softmax(&mut want);
            let b = want[s.token as usize];
            assert!(
                (lp - b).abs() <= 4e-7 * b.abs().max(1.0),
                "vocab {vocab} row {r}"
            );
        }
        assert_eq!(after[5 * vocab..], x[5 * vocab..], "the row not scored");
        let spec = |row, token, temperature| ScoreSpec {
            row,
            token,
            temperature,
        };
        for bad in [
            vec![spec(n as u32, 0, None)],            // past the rows
            vec![spec(0, vocab as u32, None)],        // past the vocabulary
            vec![spec(0, 0, None), spec(0, 1, None)], // a row twice
            vec![spec(0, 0, Some(0.0))],              // no temperature
        ] {
            assert!(
                g.score(&mut sx, n, vocab, &bad, &mut bufs, &mut scored)
                    .is_err(),
                "{bad:?}"
            );
        }
        let mut room = g.draw_buffers(2).unwrap();
        let three: Vec<ScoreSpec> = (0..3).map(|r| spec(r, 0, None)).collect();
        assert!(g
            .score(&mut sx, n, vocab, &three, &mut room, &mut scored)
            .is_err());
    }
}

/// A normalized row's log-sum-exp (`Gpu::normalize`) gives the host the draw's log-probs bit for
/// bit (`reference::log_softmax_with`): every value of the row the device left as its log-probs,
/// the drawn token's and its alternatives', greedy and at three temperatures, rows in another
/// order than drawn, a masked token; the rows not named untouched; refusals.
#[test]
fn normalized_rows_give_the_drawn_log_probs() {
    let Some(g) = gpu() else { return };
    let mut rng = Rng(44);
    for vocab in [7usize, 1000, 49152, 128256] {
        let n = 6;
        let mut x = rng.vec(n * vocab, 6.0);
        x[vocab + 2] = f32::NEG_INFINITY;
        let (temps, top) = (TEMPS, DRAW_TOP.min(vocab));
        let mut bufs = g.draw_buffers(8).unwrap();
        let drawn = draw_rows(&g, &x, n, vocab, &temps, top, &mut bufs, &mut rng);
        let mut lse = Vec::new();
        let norms: Vec<NormSpec> = (0..temps.len())
            .rev()
            .map(|r| NormSpec {
                row: r as u32,
                temperature: temps[r],
            })
            .collect();
        let mut nx = g.upload(&x).unwrap();
        g.normalize(&mut nx, n, vocab, &norms, &mut bufs, &mut lse)
            .unwrap();
        assert_eq!(lse.len(), norms.len());
        let after = g.download(&nx).unwrap();
        let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
        for (s, &l) in norms.iter().zip(&lse) {
            let r = s.row as usize;
            let inv = match s.temperature {
                Some(t) if t != 1.0 => 1.0 / t,
                _ => 1.0,
            };
            let mut host = x[r * vocab..(r + 1) * vocab].to_vec();
            reference::log_softmax_with(&mut host, inv, l);
            assert_eq!(
                bits(&host),
                bits(&after[r * vocab..(r + 1) * vocab]),
                "vocab {vocab} row {r}: the device's log-probs"
            );
            let d = &drawn[r];
            assert_eq!(host[d.token as usize].to_bits(), d.logprob.to_bits());
            for &(i, v) in &d.top {
                assert_eq!(
                    host[i as usize].to_bits(),
                    v.to_bits(),
                    "vocab {vocab} row {r}"
                );
            }
            // And a log-softmax: the f64 reference's within rounding.
            let mut want = x[r * vocab..(r + 1) * vocab].to_vec();
            want.iter_mut().for_each(|v| *v *= inv);
            reference::log_softmax(&mut want);
            let near = |a: f32, b: f32| a == b || (a - b).abs() <= 4e-7 * b.abs().max(1.0);
            assert!(
                host.iter().zip(&want).all(|(&a, &b)| near(a, b)),
                "vocab {vocab} row {r}"
            );
        }
        assert_eq!(after[5 * vocab..], x[5 * vocab..], "the row not named");
        let spec = |row, temperature| NormSpec { row, temperature };
        for bad in [
            vec![spec(n as u32, None)],              // past the rows
            vec![spec(0, None), spec(0, Some(0.5))], // a row twice
            vec![spec(0, Some(0.0))],                // no temperature
            vec![spec(0, Some(f32::NAN))],
        ] {
            assert!(
                g.normalize(&mut nx, n, vocab, &bad, &mut bufs, &mut lse)
                    .is_err(),
                "{bad:?}"
            );
        }
        let mut room = g.draw_buffers(2).unwrap();
        let three: Vec<NormSpec> = (0..3).map(|r| spec(r, None)).collect();
        assert!(g
            .normalize(&mut nx, n, vocab, &three, &mut room, &mut lse)
            .is_err());
    }
}
