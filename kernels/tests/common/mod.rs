//! Shared by the kernel tests: a small deterministic generator (SplitMix64) so failures reproduce.
#![allow(dead_code)]

use flywheel_kernels::reference::AttnSeq;
use flywheel_kernels::{Cpu, Isa, ThreadPool};
use std::time::Duration;

/// The ISAs this machine runs besides the reference (capped by FLYWHEEL_MAX_ISA).
pub fn fast_isas() -> Vec<Isa> {
    Isa::tested()
}

/// A `Cpu` of `isa` on its own pool of `threads`.
pub fn cpu(isa: Isa, threads: usize) -> Cpu {
    Cpu::new(isa, ThreadPool::new(threads, Duration::from_micros(50)))
}

pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E3779B97F4A7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58476D1CE4E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D049BB133111EB);
        z ^ (z >> 31)
    }
    pub fn uniform(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
    }
    pub fn vec(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| self.uniform() * scale).collect()
    }
}

/// One sequence of a packed batch: rows `q_start..q_start + q_len`, the first at `first_pos`.
pub fn seq(q_start: usize, q_len: usize, first_pos: usize, block_table: &[u32]) -> AttnSeq<'_> {
    AttnSeq {
        q_start,
        q_len,
        first_pos,
        block_table,
    }
}

/// Attention at long contexts (the chunks kernel's tests): (first position, tokens) of a prefill
/// of 40, decodes at 31, 700 and 3000, and 5 tokens from 1020.
pub const LONG_SHAPES: [(usize, usize); 5] = [(0, 40), (31, 1), (700, 1), (3000, 1), (1020, 5)];

/// Block tables of `bs`-position blocks for `shapes` (first position, tokens), every sequence's
/// blocks a run of one random permutation of the cache's (scattered, out of order); and the
/// cache's size in blocks (3 to spare).
pub fn scattered_tables(
    rng: &mut Rng,
    shapes: &[(usize, usize)],
    bs: usize,
) -> (Vec<Vec<u32>>, usize) {
    let need: Vec<usize> = shapes.iter().map(|&(f, q)| (f + q).div_ceil(bs)).collect();
    let n_blocks = need.iter().sum::<usize>() + 3;
    let mut order: Vec<u32> = (0..n_blocks as u32).collect();
    for i in (1..order.len()).rev() {
        order.swap(i, (rng.next() % (i as u64 + 1)) as usize);
    }
    let mut at = 0;
    let tables = need
        .iter()
        .map(|&k| {
            at += k;
            order[at - k..at].to_vec()
        })
        .collect();
    (tables, n_blocks)
}

/// The packed batch of `shapes` over `tables`, and its number of tokens.
pub fn packed_seqs<'a>(
    shapes: &[(usize, usize)],
    tables: &'a [Vec<u32>],
) -> (Vec<AttnSeq<'a>>, usize) {
    let mut n = 0;
    let seqs = shapes
        .iter()
        .zip(tables)
        .map(|(&(first, q_len), t)| {
            n += q_len;
            seq(n - q_len, q_len, first, t)
        })
        .collect();
    (seqs, n)
}
