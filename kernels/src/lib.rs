//! Flywheel's compute kernels: quantized block formats, matmul, attention, norms and friends on CPU,
//! and (feature `cuda`) on NVIDIA GPUs.
//! Pure compute: no I/O, no async, no engine types. Every fast path has a scalar twin in `reference`.

pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod plan;
pub mod quant;
pub mod reference;

pub use cpu::{Cpu, Isa, Matmul, Precision, RopeLayout, ThreadPool};
pub use quant::QuantType;
