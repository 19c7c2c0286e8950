//! Host-side planning for the backends, tested on every machine (no GPU needed).

/// The largest decode batch run through a captured CUDA graph; larger ones launch eagerly.
pub const GRAPH_MAX_BATCH: usize = 256;

/// The CUDA graph a decode batch of `n` sequences replays: vLLM's capture sizes (1, 2, 4, then
/// steps of 8 up to 256), the batch padded up to its bucket; None outside them (eager launches).
pub fn graph_bucket(n: usize) -> Option<usize> {
    match n {
        0 => None,
        1 | 2 => Some(n),
        3 | 4 => Some(4),
        _ if n <= GRAPH_MAX_BATCH => Some(n.div_ceil(8) * 8),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_are_vllms_capture_sizes_and_hold_their_batch() {
        let sizes: Vec<usize> = (1..=GRAPH_MAX_BATCH).filter_map(graph_bucket).collect();
        let mut distinct = sizes.clone();
        distinct.dedup();
        let want: Vec<usize> = [1, 2, 4].into_iter().chain((8..=256).step_by(8)).collect();
        assert_eq!(distinct, want);
        for n in 1..=GRAPH_MAX_BATCH {
            let b = graph_bucket(n).unwrap();
            assert!(b >= n && b - n < 8, "{n} → {b}");
        }
        assert_eq!(graph_bucket(0), None);
        assert_eq!(graph_bucket(257), None);
    }
}
