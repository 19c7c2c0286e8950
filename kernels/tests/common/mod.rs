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
