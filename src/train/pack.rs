//! Packing a batch of (prompt, completion) samples into training sequences, each prompt shared by
//! several samples (a GRPO group's) computed once: its whole `TRAIN_BLOCK`s become one unscored
//! prefix sequence that the samples continue; the rest of the prompt (1..=TRAIN_BLOCK tokens, so
//! that every sample scores its first token from a row of its own) is repeated per sample.

use crate::model::decoder::{TrainSeq, TRAIN_BLOCK};
use std::collections::HashMap;

/// Training sequences for a batch, and which one holds each sample's completion.
#[derive(Debug, Default)]
pub struct Packed {
    pub tokens: Vec<Vec<u32>>,
    /// Per sequence: its prompt length (all of it for a prefix) and its prefix sequence.
    pub specs: Vec<(usize, Option<usize>)>,
    /// Per sample: the index of its sequence.
    pub of_sample: Vec<usize>,
}

impl Packed {
    /// Pack `samples` (prompt, completion); with `share`, prompts used by two or more samples and
    /// longer than one block are shared.
    pub fn new(samples: &[(&[u32], &[u32])], share: bool) -> Packed {
        let mut uses: HashMap<&[u32], usize> = HashMap::new();
        for (p, _) in samples {
            *uses.entry(*p).or_default() += 1;
        }
        let mut prefixes: HashMap<&[u32], usize> = HashMap::new();
        let mut out = Packed::default();
        for &(p, c) in samples {
            let shared = (p.len().max(1) - 1) / TRAIN_BLOCK * TRAIN_BLOCK;
            let prefix = if share && shared > 0 && uses[p] > 1 {
                let next = out.tokens.len();
                let j = *prefixes.entry(p).or_insert(next);
                if j == next {
                    out.tokens.push(p[..shared].to_vec());
                    out.specs.push((shared, None));
                }
                Some(j)
            } else {
                None
            };
            let skip = if prefix.is_some() { shared } else { 0 };
            out.of_sample.push(out.tokens.len());
            out.tokens.push([&p[skip..], c].concat());
            out.specs.push((p.len() - skip, prefix));
        }
        out
    }

    pub fn seqs(&self) -> Vec<TrainSeq<'_>> {
        self.tokens
            .iter()
            .zip(&self.specs)
            .map(|(t, &(prompt_len, prefix))| TrainSeq {
                tokens: t,
                prompt_len,
                prefix,
            })
            .collect()
    }

    /// Tokens the forward runs (each shared prefix once).
    pub fn num_tokens(&self) -> usize {
        self.tokens.iter().map(Vec::len).sum()
    }
}

/// Consecutive runs of samples of at most `max_tokens` tokens each (prompt + completion); a
/// sample longer than that is a run of its own.
pub fn micro_batches(pairs: &[(&[u32], &[u32])], max_tokens: usize) -> Vec<std::ops::Range<usize>> {
    let mut out = Vec::new();
    let (mut start, mut tokens) = (0, 0);
    for (i, (p, c)) in pairs.iter().enumerate() {
        let n = p.len() + c.len();
        if i > start && tokens + n > max_tokens {
            out.push(start..i);
            (start, tokens) = (i, 0);
        }
        tokens += n;
    }
    if start < pairs.len() {
        out.push(start..pairs.len());
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_shared_prompt_keeps_whole_blocks_once_and_at_least_one_token_per_sample() {
        let p: Vec<u32> = (0..40).collect();
        let short: Vec<u32> = (0..16).collect();
        let (c1, c2, c3) = (vec![100, 101], vec![102], vec![103]);
        let samples = [
            (&p[..], &c1[..]),
            (&short[..], &c3[..]),
            (&p[..], &c2[..]),
            (&short[..], &c3[..]),
        ];
        let k = Packed::new(&samples, true);
        // 40 tokens: blocks 0..32 shared, 8 tokens repeated; 16 tokens: 0 whole blocks before the
        // last token, so not shared.
        assert_eq!(k.tokens[0], (0..32).collect::<Vec<u32>>());
        assert_eq!(k.specs[0], (32, None));
        assert_eq!(k.of_sample, vec![1, 2, 3, 4]);
        assert_eq!(k.tokens[1], [&p[32..], &c1[..]].concat());
        assert_eq!(k.specs[1], (8, Some(0)));
        assert_eq!(k.specs[3], (8, Some(0)));
        assert_eq!(k.specs[2], (16, None));
        assert_eq!(k.num_tokens(), 32 + 10 + 17 + 9 + 17);
        let flat = Packed::new(&samples, false);
        assert_eq!(flat.of_sample, vec![0, 1, 2, 3]);
        assert!(flat.specs.iter().all(|s| s.1.is_none()));
        assert_eq!(flat.num_tokens(), 42 + 17 + 41 + 17);
    }
}
