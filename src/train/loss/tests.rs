use super::*;

fn seq<'a>(logp: &'a [f32], behavior: &'a [f32], a: f32) -> SeqInput<'a> {
    SeqInput {
        logp,
        behavior,
        ref_logp: None,
        old_logp: None,
        mu: None,
        advantage: a,
        token_advantage: None,
    }
}

#[test]
fn advantages_follow_grpo_and_dr_grpo_and_drop_flat_groups() {
    let a = group_advantages(&[1.0, 0.0, 0.0, 1.0], AdvantageKind::Grpo { eps: 0.0 }).unwrap();
    // mean 0.5, sample std sqrt(1/3)
    let s = (1.0f64 / 3.0).sqrt();
    for (x, r) in a.iter().zip([1.0, 0.0, 0.0, 1.0]) {
        assert!((*x as f64 - (r - 0.5) / s).abs() < 1e-6);
    }
    let d = group_advantages(&[3.0, 1.0], AdvantageKind::DrGrpo).unwrap();
    assert_eq!(d, vec![1.0, -1.0]);
    assert!(group_advantages(&[0.7, 0.7, 0.7], AdvantageKind::DrGrpo).is_none());
    assert!(group_advantages(&[1.0], AdvantageKind::DrGrpo).is_none());
}

#[test]
fn an_episodes_turns_share_its_advantage_and_count_once() {
    // Episode e1 (3 turns, reward 1) and e2 (1 turn, reward 0): the group is {1, 0}, not
    // {1, 1, 1, 0}.
    let units = [Some("e1"), Some("e2"), Some("e1"), Some("e1")];
    let a = unit_advantages(&units, &[1.0, 0.0, 1.0, 1.0], AdvantageKind::DrGrpo).unwrap();
    assert_eq!(a, vec![0.5, -0.5, 0.5, 0.5]);
    // Without episodes it is the plain group.
    let plain = unit_advantages(&[None, None], &[3.0, 1.0], AdvantageKind::DrGrpo).unwrap();
    assert_eq!(
        plain,
        group_advantages(&[3.0, 1.0], AdvantageKind::DrGrpo).unwrap()
    );
    // One episode alone has no baseline.
    assert!(unit_advantages(&[Some("e"), Some("e")], &[1.0, 1.0], AdvantageKind::DrGrpo).is_none());
    // Turns with discounted returns (a session's, γ = 0.5, final reward 4 after 3 turns:
    // 1, 2, 4; another session's 0): the units are the first turns' returns {1, 0} (mean
    // 0.5), each turn its own return against them.
    let units = [Some("s1"), Some("s1"), Some("s1"), Some("s2")];
    let a = unit_advantages(&units, &[1.0, 2.0, 4.0, 0.0], AdvantageKind::DrGrpo).unwrap();
    assert_eq!(a, vec![0.5, 1.5, 3.5, -0.5]);
    let g = unit_advantages(
        &units,
        &[1.0, 2.0, 4.0, 0.0],
        AdvantageKind::Grpo { eps: 0.0 },
    )
    .unwrap();
    let sd = (0.5f64.powi(2) * 2.0).sqrt();
    let want: Vec<f32> = [0.5, 1.5, 3.5, -0.5]
        .iter()
        .map(|x| (x / sd) as f32)
        .collect();
    assert_eq!(g, want);
}

/// Every loss variant whose coefficients are not detached by definition: the analytic gradient
/// equals central differences of the loss (masked IS detaches its coefficient r·(A − τ log r),
/// so its gradient is checked against that coefficient below).
#[test]
fn gradients_equal_finite_differences_for_every_variant() {
    let logp: Vec<Vec<f32>> = vec![
        vec![-1.0, -0.5, -2.0],
        vec![-0.3, -1.7],
        vec![-0.9, -0.2, -1.1, -0.4],
    ];
    let behav: Vec<Vec<f32>> = vec![
        vec![-1.1, -0.4, -1.2],
        vec![-0.3, -2.9],
        vec![-0.95, -0.25, -1.0, -0.5],
    ];
    let refl: Vec<Vec<f32>> = vec![
        vec![-1.3, -0.6, -1.9],
        vec![-0.2, -1.5],
        vec![-1.0, -0.3, -1.0, -0.6],
    ];
    let old: Vec<Vec<f32>> = vec![
        vec![-1.05, -0.45, -1.9],
        vec![-0.3, -2.0],
        vec![-0.9, -0.2, -1.05, -0.45],
    ];
    let adv = [1.2f32, -0.7, 0.4];
    let mut cfgs: Vec<(String, LossConfig)> = ["grpo", "dapo", "dr_grpo", "gspo", "sft"]
        .iter()
        .map(|n| (n.to_string(), LossConfig::named(n.parse().unwrap(), 4, 3)))
        .collect();
    for (name, c) in cfgs.iter_mut() {
        c.kl_coef = 0.05;
        if name == "grpo" || name == "gspo" {
            c.correction = Some(Correction::named("tis", None, None, (None, None)).unwrap());
        }
        if name == "dapo" {
            let level = Some(super::super::correction::Level::Geometric);
            c.correction = Some(Correction::named("mis", level, None, (None, None)).unwrap());
        }
        if name == "gspo" {
            // Wide enough that the sequences stay inside the clip range.
            c.objective = Objective::SequenceClipped {
                eps_low: 0.9,
                eps_high: 0.9,
            };
        }
    }
    for (name, cfg) in &cfgs {
        let run = |lp: &[Vec<f32>]| {
            let seqs: Vec<SeqInput> = (0..3)
                .map(|i| SeqInput {
                    logp: &lp[i],
                    behavior: &behav[i],
                    ref_logp: Some(&refl[i]),
                    old_logp: Some(&old[i]),
                    mu: None,
                    advantage: adv[i],
                    token_advantage: None,
                })
                .collect();
            policy_loss(cfg, &seqs)
        };
        let (_, g) = run(&logp);
        for i in 0..3 {
            for t in 0..logp[i].len() {
                let h = 1e-3f32;
                let mut p = logp.clone();
                p[i][t] += h;
                let up = run(&p).0.loss;
                p[i][t] -= 2.0 * h;
                let down = run(&p).0.loss;
                let num = (up - down) / (2.0 * h as f64);
                assert!(
                    (num - g[i][t] as f64).abs() < 2e-3 * (1.0 + num.abs()),
                    "{name} seq {i} token {t}: analytic {} numeric {num}",
                    g[i][t]
                );
            }
        }
    }
}

#[test]
fn clipping_stops_the_gradient_where_the_ratio_left_its_range() {
    let cfg = LossConfig::named(LossName::Dapo, 8, 2);
    // Token 0: r = e^0.5 ≈ 1.65 > 1.28 with A > 0: clipped. Token 1: r = 1: not clipped.
    let (st, g) = policy_loss(&cfg, &[seq(&[-0.5, -1.0], &[-1.0, -1.0], 1.0)]);
    assert_eq!(g[0][0], 0.0);
    assert!(g[0][1] < 0.0, "raising log π lowers the loss when A > 0");
    assert_eq!(st.clip_fraction, 0.5);
    // With A < 0 the same high ratio is not clipped (min picks r·A).
    let (st, g) = policy_loss(&cfg, &[seq(&[-0.5, -1.0], &[-1.0, -1.0], -1.0)]);
    assert!(g[0][0] > 0.0);
    assert_eq!(st.clip_fraction, 0.0);
    assert!((st.ratio_max - 0.5f64.exp()).abs() < 1e-6 && st.ratio_min == 1.0);
}

#[test]
fn normalizations_weigh_tokens_as_their_papers_say() {
    let s1 = [-1.0f32, -1.0];
    let s2 = [-1.0f32, -1.0, -1.0, -1.0];
    let seqs = [seq(&s1, &s1, 1.0), seq(&s2, &s2, 1.0)];
    let mut cfg = LossConfig::named(LossName::Grpo, 4, 2);
    let (st, g) = policy_loss(&cfg, &seqs);
    // Per sequence: each sequence weighs 1/2, its tokens 1/(2n); r = 1 so loss = −mean A = −1.
    assert!((st.loss + 1.0).abs() < 1e-9);
    assert!((g[0][0] + 0.25).abs() < 1e-7 && (g[1][0] + 0.125).abs() < 1e-7);
    cfg.normalization = Normalization::PerToken;
    let (_, g) = policy_loss(&cfg, &seqs);
    assert!((g[0][0] - g[1][0]).abs() < 1e-9 && (g[0][0] + 1.0 / 6.0).abs() < 1e-7);
    cfg.normalization = Normalization::Constant(16.0);
    let (st, _) = policy_loss(&cfg, &seqs);
    assert!((st.loss + 6.0 / 16.0).abs() < 1e-9);
}

#[test]
fn masked_is_drops_tokens_and_sequences_outside_the_bounds() {
    let cfg = LossConfig::named(LossName::MaskedIs, 4, 2);
    // Token ratios 1, e^3 (> 8: masked), 1; sequence mean log r = 1 → e ≈ 2.7 (kept).
    let (st, g) = policy_loss(&cfg, &[seq(&[-1.0, 1.0, -1.0], &[-1.0, -2.0, -1.0], 2.0)]);
    assert_eq!(g[0][1], 0.0);
    // Kept tokens: −coeff/N with coeff = r·A (τ = 0), N = 3 tokens.
    assert!((g[0][0] + 2.0 / 3.0).abs() < 1e-6 && (g[0][2] + 2.0 / 3.0).abs() < 1e-6);
    assert!((st.masked_fraction - 1.0 / 3.0).abs() < 1e-9);
    // A sequence whose mean ratio is e^3 > 10 is dropped whole.
    let (st, g) = policy_loss(&cfg, &[seq(&[2.0, 2.0], &[-1.0, -1.0], 2.0)]);
    assert!(g[0].iter().all(|x| *x == 0.0));
    assert_eq!(st.masked_fraction, 1.0);
}

#[test]
fn kl_is_k3_and_zero_at_the_reference() {
    let mut cfg = LossConfig::named(LossName::Sft, 4, 1);
    cfg.kl_coef = 0.1;
    let lp = [-1.0f32, -2.0];
    let s = SeqInput {
        logp: &lp,
        behavior: &lp,
        ref_logp: Some(&lp),
        old_logp: None,
        mu: None,
        advantage: 0.0,
        token_advantage: None,
    };
    let (st, _) = policy_loss(&cfg, &[s]);
    assert_eq!(st.kl, 0.0);
    let rl = [-1.5f32, -2.0];
    let (st, _) = policy_loss(
        &cfg,
        &[SeqInput {
            ref_logp: Some(&rl),
            ..s
        }],
    );
    let d = 0.5f64;
    assert!((st.kl - ((-d).exp() + d - 1.0) / 2.0).abs() < 1e-7);
}

/// Every correction at every level, on a clipped token loss (DAPO's normalization), against
/// the decoupled objective written out in f64: loss = −(1/N) Σ w_t·min(r_t·A, clip(r_t)·A)
/// with r_t = π/π_old and w_t the correction of ρ = π_old/μ; its gradient −(1/N)·w_t·r_t·A
/// where the unclipped branch is the minimum, else 0.
#[test]
fn corrected_losses_equal_an_f64_reference() {
    use super::super::correction::Level;
    let logp: Vec<Vec<f32>> = vec![vec![-1.0, -0.5, -2.0], vec![-0.3, -1.7]];
    let old: Vec<Vec<f32>> = vec![vec![-1.1, -0.5, -1.6], vec![-0.3, -1.75]];
    let mu: Vec<Vec<f32>> = vec![vec![-1.4, -0.2, -1.0], vec![-2.0, -1.5]];
    let adv = [0.8f32, -1.3];
    let n_tokens = 5.0f64;
    for (name, level) in [
        ("tis", Level::Token),
        ("tis", Level::Sequence),
        ("tis", Level::Geometric),
        ("mis", Level::Token),
        ("mis", Level::Sequence),
        ("mis", Level::Geometric),
        ("icepop", Level::Token),
    ] {
        let mut cfg = LossConfig::named(LossName::Dapo, 3, 2);
        let corr = Correction::named(name, Some(level), None, (None, None)).unwrap();
        cfg.correction = Some(corr);
        let seqs: Vec<SeqInput> = (0..2)
            .map(|i| SeqInput {
                logp: &logp[i],
                behavior: &mu[i],
                ref_logp: None,
                old_logp: Some(&old[i]),
                mu: None,
                advantage: adv[i],
                token_advantage: None,
            })
            .collect();
        let (st, g) = policy_loss(&cfg, &seqs);
        let (mut loss, mut masked) = (0.0f64, 0usize);
        for i in 0..2 {
            let lr: Vec<f64> = (0..logp[i].len())
                .map(|t| old[i][t] as f64 - mu[i][t] as f64)
                .collect();
            let sum: f64 = lr.iter().sum();
            for t in 0..logp[i].len() {
                let rho = match level {
                    Level::Token => lr[t].exp(),
                    Level::Sequence => sum.exp(),
                    Level::Geometric => (sum / lr.len() as f64).exp(),
                };
                let w = match name {
                    "tis" => rho.min(2.0),
                    _ if (0.5..=2.0).contains(&rho) => rho,
                    _ => 0.0,
                };
                masked += (w == 0.0) as usize;
                let a = adv[i] as f64;
                let r = (logp[i][t] as f64 - old[i][t] as f64).exp();
                let (unc, clp) = (r * a, r.clamp(0.8, 1.28) * a);
                loss -= w * unc.min(clp) / n_tokens;
                let want = if unc <= clp {
                    -w * r * a / n_tokens
                } else {
                    0.0
                };
                assert!(
                    (g[i][t] as f64 - want).abs() < 1e-6,
                    "{name} {level:?} seq {i} token {t}: {} vs {want}",
                    g[i][t]
                );
            }
        }
        assert!((st.loss - loss).abs() < 1e-9, "{name} {level:?}");
        assert!((st.masked_fraction - masked as f64 / n_tokens).abs() < 1e-12);
    }
}

/// Distillation's token advantages add to the sequence's: with r = 1 each token's gradient is
/// −(A + a_t)/N (DAPO's normalization over N tokens).
#[test]
fn token_advantages_add_to_the_sequences() {
    let cfg = LossConfig::named(LossName::Distill, 4, 1);
    let lp = [-1.0f32, -2.0, -0.5];
    let ta = [0.5f32, -1.0, 0.0];
    let s = SeqInput {
        token_advantage: Some(&ta),
        ..seq(&lp, &lp, 0.25)
    };
    let (st, g) = policy_loss(&cfg, &[s]);
    for t in 0..3 {
        let want = -(0.25 + ta[t] as f64) / 3.0;
        assert!((g[0][t] as f64 - want).abs() < 1e-7, "{t}: {}", g[0][t]);
    }
    assert!((st.loss - (-(0.75 - 0.5) / 3.0)).abs() < 1e-9);
}
