//! The model: GGUF reading and writing, the tokenizer and chat template, the decoder (every
//! family's forward and backward).

pub mod chat_template;
pub mod conversation;
pub mod decoder;
pub mod gguf;
pub mod gguf_writer;
pub mod kv_cache;
pub mod random;
pub mod spm;
pub mod tokenizer;
pub mod weight_memory;
