//! A training batch in parts that each fit one step of a device's buffers and the KV blocks at
//! hand (`GpuDecoder::logprobs`, the engine's scoring between serving steps).

use super::TrainSeq;
use crate::model::decoder::ModelError;

/// A training batch in parts of at most `max_tokens` tokens and `max_blocks` KV blocks of
/// `block_size` tokens each, for `GpuDecoder::logprobs_part`: each part the indices of its
/// sequences, in order; a shared prefix goes with every sequence continuing it. An error names a
/// sequence (with its prefix's) that no part can hold, or a prefix that is not an earlier
/// sequence's.
pub fn score_parts(
    seqs: &[TrainSeq],
    block_size: usize,
    max_tokens: usize,
    max_blocks: usize,
) -> Result<Vec<Vec<usize>>, ModelError> {
    // Units: a sequence without a prefix, with those continuing it.
    let mut units: Vec<Vec<usize>> = Vec::new();
    let mut unit_of: Vec<Option<usize>> = vec![None; seqs.len()];
    for (i, s) in seqs.iter().enumerate() {
        let u = match s.prefix {
            None => {
                units.push(Vec::new());
                units.len() - 1
            }
            Some(j) => unit_of
                .get(j)
                .copied()
                .flatten()
                .filter(|&u| units[u][0] == j)
                .ok_or_else(|| {
                    ModelError::Batch(format!(
                        "sequence {i}: its prefix must be an earlier sequence without one"
                    ))
                })?,
        };
        units[u].push(i);
        unit_of[i] = Some(u);
    }
    let cost = |u: &[usize]| {
        let t: usize = u.iter().map(|&i| seqs[i].tokens.len()).sum();
        (t, blocks_of(u.iter().map(|&i| &seqs[i]), block_size))
    };
    let mut parts: Vec<Vec<usize>> = Vec::new();
    let (mut tokens, mut blocks) = (0, 0);
    for u in units {
        let (t, b) = cost(&u);
        if t > max_tokens || b > max_blocks {
            return Err(ModelError::Batch(format!(
                "sequence {} ({t} tokens with the sequences sharing its prefix, {b} KV blocks) is \
                 more than one step holds ({max_tokens} tokens, {max_blocks} blocks)",
                u[0]
            )));
        }
        if parts.is_empty() || tokens + t > max_tokens || blocks + b > max_blocks {
            parts.push(Vec::new());
            (tokens, blocks) = (0, 0);
        }
        parts.last_mut().expect("a part").extend(u);
        (tokens, blocks) = (tokens + t, blocks + b);
    }
    for p in &mut parts {
        p.sort_unstable();
    }
    Ok(parts)
}

/// KV blocks of `block_size` tokens that `seqs` take (a shared prefix once: its own entry).
pub fn blocks_of<'s, 'a: 's>(
    seqs: impl IntoIterator<Item = &'s TrainSeq<'a>>,
    block_size: usize,
) -> usize {
    seqs.into_iter()
        .map(|s| s.tokens.len().div_ceil(block_size))
        .sum()
}

/// For each sequence continuing a shared prefix that is not a whole number of `block_size`
/// blocks (a batch packed for the CPU trainer's blocks of 16, scored in a cache of blocks of 32
/// or 64): its tokens with the prefix's in front, for `inline_prefixes`; else None.
pub fn prefixes_to_inline(seqs: &[TrainSeq], block_size: usize) -> Vec<Option<Vec<u32>>> {
    seqs.iter()
        .map(|s| {
            let p = seqs.get(s.prefix?)?;
            (!p.tokens.len().is_multiple_of(block_size)).then(|| [p.tokens, s.tokens].concat())
        })
        .collect()
}

/// `seqs` with the sequences `inlined` names standing alone (their prompts starting with their
/// prefix's tokens, at the same positions: the same log-probs, the prefix computed again).
pub fn inline_prefixes<'a>(
    seqs: &[TrainSeq<'a>],
    inlined: &'a [Option<Vec<u32>>],
) -> Vec<TrainSeq<'a>> {
    seqs.iter()
        .zip(inlined)
        .map(|(s, t)| match t {
            Some(t) => TrainSeq {
                prompt_len: s.prompt_len + (t.len() - s.tokens.len()),
                tokens: t,
                prefix: None,
            },
            None => *s,
        })
        .collect()
}

/// The sequences `part` names, their prefixes renumbered within it.
pub fn part_seqs<'a>(seqs: &[TrainSeq<'a>], part: &[usize]) -> Vec<TrainSeq<'a>> {
    part.iter()
        .map(|&i| TrainSeq {
            prefix: seqs[i].prefix.map(|j| {
                part.iter()
                    .position(|&k| k == j)
                    .expect("a part holds its prefixes")
            }),
            ..seqs[i]
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seq(tokens: &[u32], prompt_len: usize, prefix: Option<usize>) -> TrainSeq<'_> {
        TrainSeq {
            tokens,
            prompt_len,
            prefix,
        }
    }

    #[test]
    fn parts_keep_prefixes_with_their_sequences_and_respect_both_bounds() {
        let t: Vec<u32> = (0..40).collect();
        // 0: 8 tokens; 1: a 4-token prefix, 2 and 4 continuing it; 3: 10 tokens.
        let seqs = [
            seq(&t[..8], 2, None),
            seq(&t[..4], 4, None),
            seq(&t[..6], 1, Some(1)),
            seq(&t[..10], 3, None),
            seq(&t[..5], 1, Some(1)),
        ];
        // Blocks of 4: 0 takes 2, the unit of 1 takes 1 + 2 + 2, 3 takes 3.
        assert_eq!(
            score_parts(&seqs, 4, 100, 100).unwrap(),
            vec![vec![0, 1, 2, 3, 4]]
        );
        // 15 tokens a part: 0 (8) alone, the prefix's unit (15), then 3.
        assert_eq!(
            score_parts(&seqs, 4, 15, 100).unwrap(),
            vec![vec![0], vec![1, 2, 4], vec![3]]
        );
        // 5 blocks a part: 0 (2) alone (the unit's 5 do not fit beside it), the unit, 3.
        assert_eq!(
            score_parts(&seqs, 4, 100, 5).unwrap(),
            vec![vec![0], vec![1, 2, 4], vec![3]]
        );
        let part = [1, 2, 4];
        let ps = part_seqs(&seqs, &part);
        assert_eq!(
            ps.iter().map(|s| s.prefix).collect::<Vec<_>>(),
            vec![None, Some(0), Some(0)]
        );
        assert_eq!(ps[2].tokens, seqs[4].tokens);
        // A unit more than a part holds, and a prefix that is not an earlier sequence's.
        let err = score_parts(&seqs, 4, 14, 100).unwrap_err().to_string();
        assert!(err.contains("sequence 1 (15 tokens"), "{err}");
        assert!(score_parts(&seqs, 4, 100, 4).is_err());
        assert!(score_parts(
            &[seq(&t[..4], 1, Some(1)), seq(&t[..4], 4, None)],
            4,
            99,
            99
        )
        .is_err());
        assert!(score_parts(
            &[
                seq(&t[..4], 4, None),
                seq(&t[..4], 1, Some(0)),
                seq(&t[..4], 1, Some(1))
            ],
            4,
            99,
            99
        )
        .is_err());
        assert!(score_parts(&[], 4, 1, 1).unwrap().is_empty());
    }

    #[test]
    fn prefixes_of_partial_blocks_are_inlined_into_their_sequences() {
        let t: Vec<u32> = (0..40).collect();
        let seqs = [
            seq(&t[..16], 16, None),
            seq(&t[16..22], 2, Some(0)),
            seq(&t[..32], 32, None),
            seq(&t[20..25], 1, Some(2)),
            seq(&t[..7], 3, None),
        ];
        // Blocks of 16: both prefixes whole; of 32: the first is not.
        assert!(prefixes_to_inline(&seqs, 16).iter().all(Option::is_none));
        let inl = prefixes_to_inline(&seqs, 32);
        assert_eq!(
            inl[1].as_deref(),
            Some(&[&t[..16], &t[16..22]].concat()[..])
        );
        assert!(inl.iter().enumerate().all(|(i, x)| x.is_some() == (i == 1)));
        let out = inline_prefixes(&seqs, &inl);
        assert_eq!((out[1].prompt_len, out[1].prefix), (18, None));
        assert_eq!(
            out[1].tokens.len() - out[1].prompt_len,
            4,
            "the same tokens scored"
        );
        assert_eq!(out[3].prefix, Some(2));
        assert_eq!(out[4].tokens, seqs[4].tokens);
    }
}
