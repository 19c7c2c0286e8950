//! The sampler beside a device: the draws a device makes by its rule (the same uniforms, cuts and
//! log-probs as the host's), and the rows the host samples with a device's log-sum-exp.

use super::tests::cpu;
use super::*;

/// A device's draw takes the same uniform from the choice's stream as the host's sampler, and
/// the token the reference draws with it (from the whole distribution, or among a top-k with
/// top-p and min-p) is the sampler's, with the same log-prob drawn with; what only the host's
/// sampler does is never given to a device.
#[test]
fn device_draws_take_the_samplers_uniform_and_its_cuts() {
    let logits: Vec<f32> = (0..300).map(|i| ((i * 37 % 101) as f32) / 17.0).collect();
    // Nothing cut, llama.cpp's default cut, a top-k alone, a nucleus (top-p, min-p, both).
    let cuts = [
        (0usize, 1.0f32, 0.0f32),
        (40, 0.95, 0.05),
        (5, 1.0, 0.0),
        (0, 0.9, 0.0),
        (0, 1.0, 0.1),
        (0, 0.8, 0.05),
    ];
    for (temperature, (top_k, top_p, min_p)) in [0.0f32, 0.6, 1.0, 1.7]
        .into_iter()
        .flat_map(|t| cuts.map(|c| (t, c)))
    {
        for seed in 0..20u64 {
            let p = SamplingParams {
                temperature,
                top_logprobs: 3,
                top_k,
                top_p,
                min_p,
                ..Default::default()
            };
            let (mut host_rng, mut dev_rng) = (Rng::new(seed), Rng::new(seed));
            let mut l = logits.clone();
            let host = sample(&cpu(), &mut l, &p, &HashMap::new(), &mut host_rng);
            let d = p
                .device_draw(&mut dev_rng)
                .expect("a whole-distribution draw");
            // The device's arithmetic is the reference's: log-softmax of logits / T, then the draw.
            let mut lp = logits.clone();
            scale_and_normalize(&cpu(), &mut lp, temperature);
            let (token, kept) = match d.sample {
                None => (reference::argmax(&lp), 1.0),
                Some((t, u)) => {
                    assert_eq!(t, temperature);
                    reference::draw_cut(&lp, d.truncate, u)
                }
            };
            let top: Vec<(u32, f32)> = reference::top_indices(&lp, d.top)
                .into_iter()
                .map(|i| (i, lp[i as usize]))
                .collect();
            let dev = d.sampled(token, lp[token as usize], kept, &top);
            assert_eq!(
                (dev.token, dev.logprob, dev.sampling_logprob),
                (host.token, host.logprob, host.sampling_logprob),
                "T {temperature}, seed {seed}"
            );
            let ids = |s: &Sampled| {
                s.top
                    .iter()
                    .map(|t| (t.token_id, t.logprob))
                    .collect::<Vec<_>>()
            };
            assert_eq!(ids(&dev), ids(&host));
            // The streams stay in step.
            assert_eq!(host_rng.next_u64(), dev_rng.next_u64(), "T {temperature}");
        }
    }
    let refused = [
        SamplingParams {
            top_k: DEVICE_DRAW_TOP_K + 1,
            ..Default::default()
        },
        SamplingParams {
            presence_penalty: 0.5,
            ..Default::default()
        },
        SamplingParams {
            repetition_penalty: 1.1,
            ..Default::default()
        },
        SamplingParams {
            logit_bias: vec![(1, 2.0)],
            ..Default::default()
        },
        SamplingParams {
            constrained: true,
            temperature: 0.0,
            ..Default::default()
        },
        SamplingParams {
            min_tokens: 2,
            ..Default::default()
        },
        SamplingParams {
            allowed_tokens: Some(Arc::from(vec![1u32])),
            ..Default::default()
        },
        SamplingParams {
            bad_words: Arc::from(vec![vec![1u32]]),
            ..Default::default()
        },
    ];
    for p in refused {
        let mut rng = Rng::new(1);
        assert!(p.device_draw(&mut rng).is_none(), "{p:?}");
        assert_eq!(
            rng.next_u64(),
            Rng::new(1).next_u64(),
            "a refusal takes no uniform"
        );
    }
    // Greedy ignores truncation: the argmax is inside any of it.
    let p = SamplingParams {
        temperature: 0.0,
        top_p: 0.5,
        top_k: 3,
        ..Default::default()
    };
    assert_eq!(p.device_draw(&mut Rng::new(1)).unwrap().sample, None);
}

/// A row sampled with a device's log-sum-exp (`sample_row`, beside a GPU) reports and draws from
/// logit·(1/T) − lse, each step rounded once (the device's log-probs), greedy, at T 1 and at T 0.8,
/// with or without a penalty (which edits the drawn-from distribution, not the reported one);
/// the token the host's own log-softmax draws at the same uniform.
#[test]
fn a_devices_log_sum_exp_gives_the_rows_log_probs() {
    let mut rng = crate::util::Rng::new(3);
    let logits: Vec<f32> = (0..300)
        .map(|_| (rng.next_f64() * 12.0 - 6.0) as f32)
        .collect();
    for (t, penalty) in [(0.0f32, 0.0f32), (1.0, 0.0), (0.8, 0.0), (0.8, 1.5)] {
        let p = SamplingParams {
            temperature: t,
            presence_penalty: penalty,
            top_logprobs: 5,
            ..Default::default()
        };
        let inv = if t == 0.0 || t == 1.0 { 1.0 } else { 1.0 / t };
        let scaled: Vec<f64> = logits.iter().map(|&v| (v * inv) as f64).collect();
        let max = scaled.iter().cloned().fold(f64::MIN, f64::max);
        // A log-sum-exp off the host's by a little, as another device's sums may be.
        let lse = (max + scaled.iter().map(|v| (v - max).exp()).sum::<f64>().ln()) as f32 + 1e-6;
        let counts = HashMap::from([(7u32, 2u32)]);
        let sampled = |l: &mut [f32], lse| {
            sample_row(
                &cpu(),
                l,
                lse,
                &p,
                &counts,
                &[],
                None,
                &[],
                &mut Rng::new(9),
            )
        };
        let (mut l, mut host) = (logits.clone(), logits.clone());
        let (s, h) = (sampled(&mut l, Some(lse)), sampled(&mut host, None));
        let want: Vec<u32> = logits.iter().map(|&v| (v * inv - lse).to_bits()).collect();
        let got: Vec<u32> = l.iter().map(|v| v.to_bits()).collect();
        assert_eq!(got, want, "T {t}: the row's log-probs");
        assert_eq!(s.logprob.to_bits(), want[s.token as usize], "T {t}");
        assert!(s
            .top
            .iter()
            .all(|a| a.logprob.to_bits() == want[a.token_id as usize]));
        assert_eq!(s.token, h.token, "T {t}, penalty {penalty}");
        assert!((s.logprob - h.logprob).abs() < 1e-5, "T {t}");
        assert_ne!(
            s.logprob.to_bits(),
            h.logprob.to_bits(),
            "T {t}: lse is used"
        );
        if penalty == 0.0 && t > 0.0 {
            assert_eq!(s.sampling_logprob.to_bits(), s.logprob.to_bits(), "T {t}");
        }
    }
}
