//! The sampler's tests: each knob against its definition, the reported log-probs the model's,
//! masks and bans limiting the draw.

use super::*;
use flywheel_kernels::{Isa, ThreadPool};

pub(super) fn cpu() -> Cpu {
    Cpu::new(
        Isa::Reference,
        ThreadPool::new(1, std::time::Duration::ZERO),
    )
}

#[test]
fn greedy_picks_argmax_and_reports_plain_log_softmax() {
    let mut l = vec![1.0, 3.0, 2.0];
    let s = sample(
        &cpu(),
        &mut l,
        &SamplingParams {
            temperature: 0.0,
            top_logprobs: 2,
            ..Default::default()
        },
        &HashMap::new(),
        &mut Rng::new(0),
    );
    assert_eq!(s.token, 1);
    let lse = (1f64.exp() + 3f64.exp() + 2f64.exp()).ln();
    assert!((s.logprob as f64 - (3.0 - lse)).abs() < 1e-6);
    assert_eq!(
        s.top.iter().map(|t| t.token_id).collect::<Vec<_>>(),
        vec![1, 2]
    );
}

/// A temperature of 1e-45 (found by fuzzing: logits / T overflowed and every log-prob was NaN)
/// samples greedily and reports temperature-0 log-probs; 1e-5 still scales.
#[test]
fn tiny_temperatures_are_greedy() {
    for (t, greedy) in [(1e-45f32, true), (1e-6, true), (1e-5, false)] {
        let mut l = vec![1.0, 3.0, 2.0 + 1e-5];
        let s = sample(
            &cpu(),
            &mut l,
            &SamplingParams {
                temperature: t,
                top_logprobs: 3,
                ..Default::default()
            },
            &HashMap::new(),
            &mut Rng::new(0),
        );
        assert_eq!(s.token, 1, "T={t}");
        assert!(s.logprob.is_finite() && s.top.iter().all(|x| x.logprob.is_finite()));
        let plain = 3.0 - (1f64.exp() + 3f64.exp() + (2.0f64 + 1e-5).exp()).ln();
        assert_eq!((s.logprob as f64 - plain).abs() < 1e-6, greedy, "T={t}");
    }
}

#[test]
fn temperature_scales_logprobs() {
    let mut l = vec![0.0, 2.0];
    let s = sample(
        &cpu(),
        &mut l,
        &SamplingParams {
            temperature: 2.0,
            top_k: 1,
            ..Default::default()
        },
        &HashMap::new(),
        &mut Rng::new(0),
    );
    // With top_k = 1 only token 1 can be drawn; its log-prob is of logits / 2, untruncated.
    assert_eq!(s.token, 1);
    let want = 1.0 - (1.0f64 + 1f64.exp()).ln();
    assert!((s.logprob as f64 - want).abs() < 1e-6);
}

#[test]
fn sampling_follows_the_distribution_and_top_p_truncates() {
    let base = [0.5f64.ln(), 0.3f64.ln(), 0.2f64.ln()];
    let mut rng = Rng::new(42);
    let mut counts = [0usize; 3];
    let n = 20000;
    for _ in 0..n {
        let mut l: Vec<f32> = base.iter().map(|v| *v as f32).collect();
        let none = HashMap::new();
        counts
            [sample(&cpu(), &mut l, &SamplingParams::default(), &none, &mut rng).token as usize] +=
            1;
    }
    for (c, p) in counts.iter().zip([0.5, 0.3, 0.2]) {
        assert!((*c as f64 / n as f64 - p).abs() < 0.02, "{counts:?}");
    }
    let mut seen = [false; 3];
    for _ in 0..2000 {
        let mut l: Vec<f32> = base.iter().map(|v| *v as f32).collect();
        let p = SamplingParams {
            top_p: 0.7,
            ..Default::default()
        };
        seen[sample(&cpu(), &mut l, &p, &HashMap::new(), &mut rng).token as usize] = true;
    }
    assert_eq!(
        seen,
        [true, true, false],
        "top_p 0.7 keeps the first two tokens only"
    );
}

#[test]
fn min_p_drops_unlikely_tokens_and_penalties_steer_without_changing_logprobs() {
    let base = [0.6f64.ln(), 0.3f64.ln(), 0.1f64.ln()];
    let mut rng = Rng::new(3);
    let none = HashMap::new();
    let mut seen = [false; 3];
    for _ in 0..2000 {
        let mut l: Vec<f32> = base.iter().map(|v| *v as f32).collect();
        let p = SamplingParams {
            min_p: 0.2,
            ..Default::default()
        };
        seen[sample(&cpu(), &mut l, &p, &none, &mut rng).token as usize] = true;
    }
    assert_eq!(seen, [true, true, false], "0.1 < 0.2 * 0.6");
    // A large presence penalty on token 0 makes greedy pick token 1; the reported log-prob is
    // still the unpenalized one.
    let mut l: Vec<f32> = base.iter().map(|v| *v as f32).collect();
    let p = SamplingParams {
        temperature: 0.0,
        presence_penalty: 2.0,
        ..Default::default()
    };
    let counts = HashMap::from([(0u32, 1u32)]);
    let s = sample(&cpu(), &mut l, &p, &counts, &mut rng);
    assert_eq!(s.token, 1);
    assert!((s.logprob as f64 - 0.3f64.ln()).abs() < 1e-5);
    // Frequency penalty scales with the count: 0.6 -> e^-0.4 * 0.6 beats 0.3 with one
    // occurrence, not with three.
    for (c, want) in [(1u32, 0u32), (3, 1)] {
        let mut l: Vec<f32> = base.iter().map(|v| *v as f32).collect();
        let p = SamplingParams {
            temperature: 0.0,
            frequency_penalty: 0.4,
            ..Default::default()
        };
        let s = sample(&cpu(), &mut l, &p, &HashMap::from([(0u32, c)]), &mut rng);
        assert_eq!(s.token, want, "count {c}");
    }
}

#[test]
fn same_seed_same_draws() {
    let (mut a, mut b) = (Rng::new(7), Rng::new(7));
    assert!((0..100).all(|_| a.next_u64() == b.next_u64()));
    assert_ne!(Rng::new(7).next_u64(), Rng::new(8).next_u64());
}

#[test]
fn logit_bias_steers_the_draw_and_marks_it_off_policy() {
    let base = [0.6f64.ln(), 0.3f64.ln(), 0.1f64.ln()];
    let mut rng = Rng::new(5);
    for (bias, want) in [(vec![(0u32, -100.0f32)], 1u32), (vec![(2, 100.0)], 2)] {
        let mut l: Vec<f32> = base.iter().map(|v| *v as f32).collect();
        let p = SamplingParams {
            temperature: 0.0,
            logit_bias: bias,
            ..Default::default()
        };
        assert!(!p.samples_the_policy());
        let s = sample(&cpu(), &mut l, &p, &HashMap::new(), &mut rng);
        assert_eq!(s.token, want);
        // The reported log-prob is the model's own.
        let lp = base[want as usize];
        assert!(
            (s.logprob as f64 - lp).abs() < 1e-5,
            "{} vs {lp}",
            s.logprob
        );
    }
    assert!(SamplingParams::default().samples_the_policy());
    let truncated = SamplingParams {
        top_k: 5,
        ..Default::default()
    };
    assert!(!truncated.samples_the_policy());
}

#[test]
fn the_repetition_penalty_scales_seen_tokens_logits_and_reports_the_models() {
    let p = SamplingParams {
        temperature: 0.0,
        repetition_penalty: 2.0,
        ..Default::default()
    };
    let mut rng = Rng::new(1);
    // Token 0 (logit 2) seen in the prompt: 2 / 2 = 1 < 1.5, so token 1 is drawn; a seen
    // negative logit is multiplied (token 2: -1 -> -2), an unseen one kept.
    let mut l = vec![2.0f32, 1.5, -1.0];
    let s = sample_seen(
        &cpu(),
        &mut l,
        &p,
        &HashMap::new(),
        &[0, 2],
        None,
        &[],
        &mut rng,
    );
    assert_eq!(s.token, 1);
    // The reported log-prob is the model's own (unpenalized) distribution's.
    let z = (2.0f32.exp() + 1.5f32.exp() + (-1.0f32).exp()).ln();
    assert!((s.logprob - (1.5 - z)).abs() < 1e-6, "{}", s.logprob);
    // Generated tokens count too; without any seen token nothing changes.
    let mut l = vec![2.0f32, 1.5, -1.0];
    let s = sample_seen(
        &cpu(),
        &mut l,
        &p,
        &HashMap::from([(0u32, 1u32)]),
        &[],
        None,
        &[],
        &mut rng,
    );
    assert_eq!(s.token, 1);
    let mut l = vec![2.0f32, 1.5, -1.0];
    assert_eq!(
        sample_seen(
            &cpu(),
            &mut l,
            &p,
            &HashMap::new(),
            &[],
            None,
            &[],
            &mut rng
        )
        .token,
        0
    );
    assert!(!p.samples_the_policy());
}

#[test]
fn a_mask_limits_the_draw_and_leaves_the_reported_logprobs_the_models() {
    let logits = [3.0f32, 1.0, 0.5, -2.0];
    let mut mask = TokenMask::alloc(4);
    mask.allow_token(2);
    mask.allow_token(3);
    let p = SamplingParams::default();
    let mut rng = Rng::new(7);
    let mut seen = [0usize; 4];
    for _ in 0..200 {
        let mut l = logits.to_vec();
        let s = sample_seen(
            &cpu(),
            &mut l,
            &p,
            &HashMap::new(),
            &[],
            Some(&mask),
            &[],
            &mut rng,
        );
        seen[s.token as usize] += 1;
        // The model's log-softmax, not the masked one.
        let z = logits.iter().map(|v| v.exp()).sum::<f32>().ln();
        assert!((s.logprob - (logits[s.token as usize] - z)).abs() < 1e-5);
    }
    assert_eq!(seen[0] + seen[1], 0, "{seen:?}");
    let mut one = TokenMask::alloc(4);
    one.allow_token(1);
    let mut l = logits.to_vec();
    let s = sample_seen(
        &cpu(),
        &mut l,
        &p,
        &HashMap::new(),
        &[],
        Some(&one),
        &[],
        &mut rng,
    );
    assert!(s.token == 1 && s.forced);
    assert!(seen[2] > seen[3] && seen[3] > 0, "{seen:?}");
    // Greedy: the best allowed token.
    let greedy = SamplingParams {
        temperature: 0.0,
        ..SamplingParams::default()
    };
    let mut l = logits.to_vec();
    let s = sample_seen(
        &cpu(),
        &mut l,
        &greedy,
        &HashMap::new(),
        &[],
        Some(&mask),
        &[],
        &mut rng,
    );
    assert_eq!(s.token, 2);
}

#[test]
fn bans_follow_min_tokens_and_bad_words_and_never_leave_nothing() {
    let p = SamplingParams {
        min_tokens: 2,
        bad_words: Arc::from(vec![vec![3], vec![1, 2]]),
        ..SamplingParams::default()
    };
    assert!(p.edits_logits());
    // Before min_tokens the end tokens are banned; a one-token bad word always; a two-token one
    // only after its first token.
    assert_eq!(p.banned(&[], &[0]), vec![0, 3]);
    assert_eq!(p.banned(&[5, 1], &[0]), vec![3, 2]);
    assert_eq!(p.banned(&[5, 5], &[0]), vec![3]);
    // Greedy: token 0 is the best, banned, so 1 is drawn; the reported log-prob is the model's.
    let logits = [3.0f32, 1.0, 0.5, -2.0];
    let mut rng = Rng::new(1);
    let greedy = SamplingParams {
        temperature: 0.0,
        ..SamplingParams::default()
    };
    let mut l = logits.to_vec();
    let s = sample_seen(
        &cpu(),
        &mut l,
        &greedy,
        &HashMap::new(),
        &[],
        None,
        &[0],
        &mut rng,
    );
    assert_eq!(s.token, 1);
    // A mask allowing only token 0 and a ban of token 0: the ban is lifted, 0 is drawn.
    let mut only = TokenMask::alloc(4);
    only.allow_token(0);
    let mut l = logits.to_vec();
    let s = sample_seen(
        &cpu(),
        &mut l,
        &greedy,
        &HashMap::new(),
        &[],
        Some(&only),
        &[0],
        &mut rng,
    );
    assert_eq!(s.token, 0);
    // allowed_token_ids: only they are drawn.
    let allowed = SamplingParams {
        allowed_tokens: Some(Arc::from(vec![2u32, 3])),
        ..SamplingParams::default()
    };
    for _ in 0..50 {
        let mut l = logits.to_vec();
        let s = sample_seen(
            &cpu(),
            &mut l,
            &allowed,
            &HashMap::new(),
            &[],
            None,
            &[],
            &mut rng,
        );
        assert!(s.token >= 2, "{}", s.token);
    }
}

/// The sampling log-prob is the token's under the distribution actually drawn from: the model's
/// own (bit for bit) when nothing edits or truncates it; the biased distribution's with a bias;
/// renormalized over the kept tokens with top-k; 0 when greedy.
#[test]
fn the_sampling_logprob_is_the_drawn_distributions() {
    let logits = [1.0f32, 3.0, 2.0, 0.5];
    let lse = |l: &[f64]| l.iter().map(|x| x.exp()).sum::<f64>().ln();
    let l64: Vec<f64> = logits.iter().map(|&x| x as f64).collect();
    let draw = |p: SamplingParams, seed: u64| {
        let mut l = logits.to_vec();
        sample(&cpu(), &mut l, &p, &HashMap::new(), &mut Rng::new(seed))
    };
    for seed in 0..20 {
        let s = draw(SamplingParams::default(), seed);
        assert_eq!(s.sampling_logprob.to_bits(), s.logprob.to_bits());
        // A bias of +1 on token 0.
        let s = draw(
            SamplingParams {
                logit_bias: vec![(0, 1.0)],
                ..Default::default()
            },
            seed,
        );
        let mut b = l64.clone();
        b[0] += 1.0;
        let want = b[s.token as usize] - lse(&b);
        assert!((s.sampling_logprob as f64 - want).abs() < 1e-5, "{seed}");
        assert!((s.logprob as f64 - (l64[s.token as usize] - lse(&l64))).abs() < 1e-5);
        // Top-k 2: tokens 1 and 2 only, renormalized.
        let s = draw(
            SamplingParams {
                top_k: 2,
                ..Default::default()
            },
            seed,
        );
        assert!(s.token == 1 || s.token == 2);
        let want = l64[s.token as usize] - lse(&[l64[1], l64[2]]);
        assert!((s.sampling_logprob as f64 - want).abs() < 1e-5, "{seed}");
    }
    let s = draw(
        SamplingParams {
            temperature: 0.0,
            ..Default::default()
        },
        0,
    );
    assert_eq!(s.sampling_logprob, 0.0);
}
