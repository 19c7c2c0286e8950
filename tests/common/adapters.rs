//! Adapters for the HTTP tests: random PEFT folders for a test model and seeded chat requests.

use super::server::chat;
use super::Rng;
use flywheel::adapter::{
    peft, AdapterConfig, AdapterLayout, AdapterWeights, LoraConfig, Method, OftConfig, Target,
};
use flywheel::model::decoder::Decoder;
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// A PEFT folder for the test model with random values (written by our saver, which
/// tests/adapters.rs checks against PEFT's own files).
pub fn random_peft(model_path: &Path, dir: &Path, method: Method, seed: u64) -> PathBuf {
    let model = Decoder::open(model_path).unwrap();
    let cfg = AdapterConfig {
        method,
        targets: Target::ALL.to_vec(),
        base_model: "tiny".into(),
    };
    let layout = Arc::new(AdapterLayout::new(cfg, &model.config).unwrap());
    let params = Rng(seed).vec(layout.num_params, 0.15);
    let w = AdapterWeights::new(layout, params).unwrap();
    peft::save(&w, dir).unwrap();
    dir.to_path_buf()
}

pub fn lora() -> Method {
    Method::Lora(LoraConfig {
        r: 4,
        alpha: 8.0,
        use_rslora: false,
    })
}

pub fn oft() -> Method {
    Method::Oft(OftConfig {
        block_size: 16,
        ..OftConfig::default()
    })
}

pub fn seeded(model: &str, seed: u64, extra: Value) -> Value {
    let mut b = chat(
        "tell me about adapters",
        json!({"seed": seed, "temperature": 1.0, "ignore_eos": true, "return_token_ids": true}),
    );
    b["model"] = json!(model);
    for (k, v) in extra.as_object().unwrap() {
        b[k] = v.clone();
    }
    b
}

pub fn token_ids(v: &Value) -> Value {
    v["choices"][0]["token_ids"].clone()
}
