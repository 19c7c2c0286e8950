//! Repeat detection (Kimi k1.5's): a choice whose newest tokens are one short block repeated over
//! and over is stuck in a loop; the engine ends it with `finish_reason: "repetition"` instead of
//! letting it run to `max_tokens`. Pure: tokens in, a verdict out.
//!
//! The rule: the last L generated tokens are periodic with a period p ≤ `max_period` (token i
//! equals token i − p throughout), L ≥ `min_repeats` · p and L ≥ `min_tokens`. Per token, one
//! comparison per period (`max_period` at most): each period's run of matches grows by one or
//! resets, so the detector never rescans.

/// When a loop is a loop.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RepetitionRule {
    /// The longest repeated block looked for, in tokens.
    pub max_period: usize,
    /// How many times a block must occur in a row.
    pub min_repeats: usize,
    /// The repeated span's length at least (so "ha ha" or a short list is not a loop).
    pub min_tokens: usize,
}

impl Default for RepetitionRule {
    fn default() -> Self {
        RepetitionRule {
            max_period: 64,
            min_repeats: 4,
            min_tokens: 32,
        }
    }
}

/// The largest `max_period` accepted (the detector keeps this many tokens).
pub const MAX_PERIOD: usize = 1024;

impl RepetitionRule {
    /// Err: what is out of range, naming the key.
    pub fn check(&self) -> Result<(), String> {
        if !(1..=MAX_PERIOD).contains(&self.max_period) {
            return Err(format!("max_period must be in 1..={MAX_PERIOD}"));
        }
        if !(2..=1_000_000).contains(&self.min_repeats) {
            return Err("min_repeats must be in 2..=1000000".into());
        }
        if !(2..=1_000_000).contains(&self.min_tokens) {
            return Err("min_tokens must be in 2..=1000000".into());
        }
        Ok(())
    }
}

/// One choice's detector.
#[derive(Clone, Debug)]
pub struct Detector {
    rule: RepetitionRule,
    /// The last `max_period` tokens, oldest first (a ring: `next` is where the next one goes).
    recent: Vec<u32>,
    next: usize,
    seen: usize,
    /// runs[p − 1]: how many newest tokens equal the token p before them, in a row.
    runs: Vec<usize>,
}

impl Detector {
    pub fn new(rule: RepetitionRule) -> Detector {
        Detector {
            rule,
            recent: vec![0; rule.max_period],
            next: 0,
            seen: 0,
            runs: vec![0; rule.max_period],
        }
    }

    /// Take the next generated token; true when the choice is now in a loop.
    pub fn push(&mut self, token: u32) -> bool {
        let n = self.rule.max_period;
        let mut looped = false;
        for p in 1..=n.min(self.seen) {
            // The token p back: `next` − p in the ring.
            let back = self.recent[(self.next + n - p) % n];
            let run = &mut self.runs[p - 1];
            *run = if back == token { *run + 1 } else { 0 };
            // The periodic span is the run plus the first block it repeats.
            let span = *run + p;
            if *run > 0 && span >= self.rule.min_tokens && span >= self.rule.min_repeats * p {
                looped = true;
            }
        }
        self.recent[self.next] = token;
        self.next = (self.next + 1) % n;
        self.seen += 1;
        looped
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The index of the token at which `tokens` is first found looping (None: never).
    fn ends_at(rule: RepetitionRule, tokens: &[u32]) -> Option<usize> {
        let mut d = Detector::new(rule);
        tokens.iter().position(|&t| d.push(t))
    }

    /// The same question answered by rescanning the whole history at every token.
    fn naive(rule: RepetitionRule, tokens: &[u32]) -> Option<usize> {
        (0..tokens.len()).find(|&i| {
            let h = &tokens[..=i];
            (1..=rule.max_period.min(h.len())).any(|p| {
                let mut span = p;
                while span < h.len() && h[h.len() - 1 - span] == h[h.len() - 1 - span + p] {
                    span += 1;
                }
                span > p && span >= rule.min_tokens && span >= rule.min_repeats * p
            })
        })
    }

    #[test]
    fn a_planted_loop_ends_and_a_normal_answer_does_not() {
        let rule = RepetitionRule::default();
        // An answer with repeated words and short repeats, but no loop.
        let normal: Vec<u32> = (0..400u32).map(|i| (i * 7919 % 97) + (i % 3)).collect();
        assert_eq!(ends_at(rule, &normal), None);
        // A preamble, then a 10-token sentence over and over: found once the span reaches
        // max(min_tokens, 4 × 10) = 40 tokens (a period of 10, 30 matches).
        let mut looping: Vec<u32> = (1000..1017).collect();
        let sentence: Vec<u32> = (2000..2010).collect();
        for _ in 0..20 {
            looping.extend(&sentence);
        }
        assert_eq!(ends_at(rule, &looping), Some(17 + 40 - 1));
        // One token repeated: found at min_tokens.
        let one = vec![5u32; 100];
        assert_eq!(ends_at(rule, &one), Some(31));
        // A longer block needs its repeats: period 30, 4 × 30 = 120 tokens.
        let block: Vec<u32> = (0..30).collect();
        let long: Vec<u32> = block.iter().cycle().take(200).copied().collect();
        assert_eq!(ends_at(rule, &long), Some(119));
    }

    #[test]
    fn the_incremental_runs_agree_with_a_rescan() {
        let mut rng = crate::util::Rng::new(7);
        for case in 0..300 {
            let rule = RepetitionRule {
                max_period: 1 + (case % 9),
                min_repeats: 2 + (case % 3),
                min_tokens: 2 + (case % 11),
            };
            // Few symbols and planted repeats: loops of every period occur.
            let mut t: Vec<u32> = Vec::new();
            while t.len() < 80 {
                if rng.next_u64().is_multiple_of(4) && t.len() > 3 {
                    let p = 1 + (rng.next_u64() as usize % 4).min(t.len() - 1);
                    let start = t.len() - p;
                    for k in 0..(rng.next_u64() as usize % 12) {
                        t.push(t[start + k % p]);
                    }
                } else {
                    t.push((rng.next_u64() % 3) as u32);
                }
            }
            assert_eq!(ends_at(rule, &t), naive(rule, &t), "{rule:?} {t:?}");
        }
    }

    #[test]
    fn rules_are_checked() {
        assert!(RepetitionRule::default().check().is_ok());
        let bad = RepetitionRule {
            max_period: 0,
            ..RepetitionRule::default()
        };
        assert!(bad.check().unwrap_err().contains("max_period"));
    }
}
