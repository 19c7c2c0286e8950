//! Flywheel: an LLM server that serves an OpenAI-compatible API and learns from rewards.
//! This crate holds the model (GGUF reader, tokenizer, Llama forward) and the CLI's building blocks;
//! compute lives in `flywheel-kernels`.

pub mod fetch;
pub mod generate;
pub mod model;
pub mod sampler;

pub use flywheel_kernels as kernels;
