//! The model: GGUF reading and writing, the tokenizer and chat template, the Llama-family forward.

pub mod chat_template;
pub mod gguf;
pub mod gguf_writer;
pub mod kv_cache;
pub mod llama;
pub mod random;
pub mod spm;
pub mod tokenizer;
pub mod weight_memory;
