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
}
