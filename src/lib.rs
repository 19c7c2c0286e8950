//! Flywheel: an LLM server that serves an OpenAI-compatible API and learns from rewards.
//! `model` holds the GGUF reader, tokenizer and Llama forward; `engine` the continuous-batching
//! engine; `api` the HTTP server; compute lives in `flywheel-kernels`.

pub mod adapter;
pub mod api;
pub mod app;
pub mod bench;
#[cfg(feature = "cuda")]
pub mod bench_gpu;
pub mod config;
pub mod engine;
pub mod fetch;
pub mod generate;
pub mod metrics;
pub mod model;
pub mod online;
pub mod policy;
pub mod train;
pub mod util;

pub use flywheel_kernels as kernels;
