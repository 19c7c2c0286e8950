//! PEFT's on-disk format: `adapter_config.json` + `adapter_model.safetensors`, read and written
//! exactly as PEFT 0.21 writes them (keys, tensor names, PEFT shapes, f32).
//!
//! Layout differences with GGUF: the llama.cpp converter permuted the rows of W_q and W_k (per
//! head, halves → adjacent pairs, for RoPE), so the output side of q_proj/k_proj differs: LoRA B
//! rows of those two are permuted on load and un-permuted on save. OFT rotates the input and
//! needs nothing; LoRA A reads the (unpermuted) hidden state.

use super::{
    config_error, AdapterBase, AdapterConfig, AdapterError, AdapterLayout, AdapterLimits,
    AdapterWeights, LoraConfig, Method, OftConfig, Target,
};
use safetensors::tensor::{Dtype, TensorView};
use safetensors::SafeTensors;
use serde_json::{json, Value};
use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

pub const CONFIG_FILE: &str = "adapter_config.json";
pub const WEIGHTS_FILE: &str = "adapter_model.safetensors";

fn io_err(path: &Path, e: impl std::fmt::Display) -> AdapterError {
    AdapterError::Io {
        path: path.display().to_string(),
        msg: e.to_string(),
    }
}

fn tensor_err(name: &str, msg: impl Into<String>) -> AdapterError {
    AdapterError::Tensor {
        name: name.into(),
        msg: msg.into(),
    }
}

/// Parse `adapter_config.json`; refuse what is not implemented, by key.
pub fn parse_config(v: &Value) -> Result<AdapterConfig, AdapterError> {
    let obj = v
        .as_object()
        .ok_or_else(|| config_error(CONFIG_FILE, "is not a JSON object"))?;
    let get = |k: &str| obj.get(k).filter(|v| !v.is_null());
    let uint = |k: &str| -> Result<Option<usize>, AdapterError> {
        match get(k) {
            None => Ok(None),
            Some(v) => v
                .as_u64()
                .map(|n| Some(n as usize))
                .ok_or_else(|| config_error(k, "must be a non-negative integer")),
        }
    };
    let boolean = |k: &str, default: bool| -> Result<bool, AdapterError> {
        match get(k) {
            None => Ok(default),
            Some(v) => v
                .as_bool()
                .ok_or_else(|| config_error(k, "must be true or false")),
        }
    };
    let number = |k: &str| -> Result<Option<f64>, AdapterError> {
        match get(k) {
            None => Ok(None),
            Some(v) => v
                .as_f64()
                .map(Some)
                .ok_or_else(|| config_error(k, "must be a number")),
        }
    };
    let refuse_if = |cond: bool, k: &str, what: &str| -> Result<(), AdapterError> {
        if cond {
            Err(config_error(k, format!("{what} is not supported")))
        } else {
            Ok(())
        }
    };
    let peft_type = get("peft_type")
        .and_then(Value::as_str)
        .ok_or_else(|| config_error("peft_type", "missing (expected \"LORA\" or \"OFT\")"))?;
    let targets = parse_targets(get("target_modules"))?;
    if let Some(b) = get("bias").and_then(Value::as_str) {
        refuse_if(b != "none", "bias", &format!("bias \"{b}\""))?;
    }
    refuse_if(boolean("fan_in_fan_out", false)?, "fan_in_fan_out", "true")?;
    for k in [
        "layers_to_transform",
        "modules_to_save",
        "layer_replication",
        "target_parameters",
    ] {
        // PEFT writes an empty list for "none" in some fields (target_parameters since 0.17).
        let set = get(k).is_some_and(|v| !v.as_array().is_some_and(|a| a.is_empty()));
        refuse_if(set, k, "a non-null value")?;
    }
    let method = match peft_type {
        "LORA" => {
            let r = uint("r")?.ok_or_else(|| config_error("r", "missing"))?;
            for k in ["rank_pattern", "alpha_pattern"] {
                let non_empty = get(k)
                    .and_then(Value::as_object)
                    .is_some_and(|m| !m.is_empty());
                refuse_if(non_empty, k, "a per-module pattern")?;
            }
            refuse_if(boolean("use_dora", false)?, "use_dora", "DoRA")?;
            refuse_if(boolean("lora_bias", false)?, "lora_bias", "a LoRA bias")?;
            refuse_if(boolean("use_qalora", false)?, "use_qalora", "QA-LoRA")?;
            let alpha = number("lora_alpha")?.unwrap_or(8.0);
            Method::Lora(LoraConfig {
                r,
                alpha: alpha as f32,
                use_rslora: boolean("use_rslora", false)?,
            })
        }
        "OFT" => {
            refuse_if(boolean("coft", false)?, "coft", "constrained OFT (coft)")?;
            refuse_if(
                boolean("block_share", false)?,
                "block_share",
                "block sharing",
            )?;
            let dropout = number("module_dropout")?.unwrap_or(0.0);
            refuse_if(dropout > 0.0, "module_dropout", "module dropout > 0")?;
            refuse_if(
                targets.contains(&Target::Head),
                "target_modules",
                "OFT on lm_head (LoRA only)",
            )?;
            let b = uint("oft_block_size")?.unwrap_or(0);
            if b == 0 {
                return Err(config_error(
                    "oft_block_size",
                    "must be set (a block count `r` alone is not supported)",
                ));
            }
            Method::Oft(OftConfig {
                block_size: b,
                use_cayley_neumann: boolean("use_cayley_neumann", true)?,
                num_cayley_neumann_terms: uint("num_cayley_neumann_terms")?.unwrap_or(5),
            })
        }
        other => {
            return Err(config_error(
                "peft_type",
                format!("\"{other}\" is not supported (LORA or OFT)"),
            ))
        }
    };
    Ok(AdapterConfig {
        method,
        targets,
        base_model: get("base_model_name_or_path")
            .and_then(Value::as_str)
            .unwrap_or("")
            .to_string(),
    })
}

fn parse_targets(v: Option<&Value>) -> Result<Vec<Target>, AdapterError> {
    let names: Vec<&str> = match v {
        Some(Value::Array(a)) => a
            .iter()
            .map(|x| {
                x.as_str()
                    .ok_or_else(|| config_error("target_modules", "must hold strings"))
            })
            .collect::<Result<_, _>>()?,
        Some(Value::String(s)) if s == "all-linear" => {
            Target::ALL.iter().map(|t| t.peft_name()).collect()
        }
        Some(Value::String(s)) => {
            return Err(config_error(
                "target_modules",
                format!("the pattern \"{s}\" is not supported: give a list of module names"),
            ))
        }
        _ => return Err(config_error("target_modules", "missing")),
    };
    let mut out = Vec::new();
    for n in names {
        let t = Target::parse(n).ok_or_else(|| {
            config_error(
                "target_modules",
                format!(
                    "unknown target \"{n}\" (known: q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj, lm_head)"
                ),
            )
        })?;
        if !out.contains(&t) {
            out.push(t);
        }
    }
    out.sort();
    Ok(out)
}

/// The config as PEFT 0.21 writes it (`save_pretrained`: inference_mode true).
pub fn config_json(c: &AdapterConfig) -> Value {
    let targets: Vec<&str> = c.targets.iter().map(|t| t.peft_name()).collect();
    let base = if c.base_model.is_empty() {
        Value::Null
    } else {
        json!(c.base_model)
    };
    match &c.method {
        Method::Lora(l) => json!({
            "task_type": "CAUSAL_LM", "peft_type": "LORA", "auto_mapping": null,
            "peft_version": "0.21.2", "base_model_name_or_path": base, "revision": null,
            "inference_mode": true, "r": l.r, "target_modules": targets,
            "exclude_modules": null, "lora_alpha": number(l.alpha), "lora_dropout": 0.0,
            "fan_in_fan_out": false, "bias": "none", "use_rslora": l.use_rslora,
            "modules_to_save": null, "init_lora_weights": true, "layers_to_transform": null,
            "layers_pattern": null, "rank_pattern": {}, "alpha_pattern": {},
            "megatron_config": null, "megatron_core": "megatron.core",
            "trainable_token_indices": null, "loftq_config": {}, "eva_config": null,
            "corda_config": null, "lora_ga_config": null, "use_dora": false,
            "velora_config": null, "alora_invocation_tokens": null, "use_qalora": false,
            "qalora_group_size": 16, "monteclora_config": null, "layer_replication": null,
            "lora_bias": false, "target_parameters": null, "use_bdlora": null,
            "arrow_config": null, "kasa_config": null, "ensure_weight_tying": false,
        }),
        Method::Oft(o) => json!({
            "task_type": "CAUSAL_LM", "peft_type": "OFT", "auto_mapping": null,
            "peft_version": "0.21.2", "base_model_name_or_path": base, "revision": null,
            "inference_mode": true, "r": 0, "oft_block_size": o.block_size,
            "module_dropout": 0.0, "target_modules": targets, "fan_in_fan_out": false,
            "bias": "none", "exclude_modules": null, "init_weights": true,
            "layers_to_transform": null, "layers_pattern": null, "modules_to_save": null,
            "coft": false, "eps": 6e-05, "block_share": false,
            "use_cayley_neumann": o.use_cayley_neumann,
            "num_cayley_neumann_terms": o.num_cayley_neumann_terms,
        }),
    }
}

/// A whole number as a JSON integer (as PEFT writes `lora_alpha = 16`), otherwise a float.
fn number(x: f32) -> Value {
    if x.fract() == 0.0 && x.abs() < 1e15 {
        json!(x as i64)
    } else {
        json!(x)
    }
}

/// Rows of a q_proj/k_proj output in Hugging Face order → GGUF order: GGUF row h·d + 2i + j holds
/// HF row h·d + j·d/2 + i (d = head dim; per head, the halves interleaved into pairs).
fn hf_row_of_gguf_row(g: usize, head_dim: usize) -> usize {
    let (h, w) = (g / head_dim, g % head_dim);
    let (i, j) = (w / 2, w % 2);
    h * head_dim + j * (head_dim / 2) + i
}

/// Permute the rows (each `cols` wide) of a q/k output-side tensor between the two layouts.
fn permute_rows(src: &[f32], cols: usize, head_dim: usize, to_gguf: bool) -> Vec<f32> {
    let rows = src.len() / cols;
    let mut out = vec![0.0f32; src.len()];
    for g in 0..rows {
        let h = hf_row_of_gguf_row(g, head_dim);
        let (from, to) = if to_gguf { (h, g) } else { (g, h) };
        out[to * cols..(to + 1) * cols].copy_from_slice(&src[from * cols..(from + 1) * cols]);
    }
    out
}

/// LoRA B rows of q_proj and k_proj, on a base whose GGUF q/k rows were permuted (LLaMA's).
fn needs_permutation(layout: &AdapterLayout, target: Target, suffix: &str) -> bool {
    layout.model.qk_rows_permuted
        && matches!(layout.config.method, Method::Lora(_))
        && matches!(target, Target::Q | Target::K)
        && suffix == "lora_B.weight"
}

/// Load a PEFT adapter folder for a model of shape `model`, within the default limits.
pub fn load(dir: &Path, model: &impl AdapterBase) -> Result<AdapterWeights, AdapterError> {
    load_within(dir, model, &AdapterLimits::default())
}

/// Load a PEFT adapter folder: the config is checked against `limits` and the weights file's
/// size before anything is allocated, and the file is mapped, not read into memory.
pub fn load_within(
    dir: &Path,
    model: &impl AdapterBase,
    limits: &AdapterLimits,
) -> Result<AdapterWeights, AdapterError> {
    let cfg_path = dir.join(CONFIG_FILE);
    let meta = std::fs::metadata(&cfg_path).map_err(|e| io_err(&cfg_path, e))?;
    if meta.len() > 1 << 20 {
        return Err(io_err(
            &cfg_path,
            "larger than 1 MiB: not an adapter config",
        ));
    }
    let text = std::fs::read_to_string(&cfg_path).map_err(|e| io_err(&cfg_path, e))?;
    let v: Value = serde_json::from_str(&text).map_err(|e| io_err(&cfg_path, e))?;
    let config = parse_config(&v)?;
    limits.check_method(&config.method)?;
    let w_path = dir.join(WEIGHTS_FILE);
    let file = std::fs::File::open(&w_path).map_err(|e| io_err(&w_path, e))?;
    let len = file.metadata().map_err(|e| io_err(&w_path, e))?.len();
    if len > limits.max_file_bytes {
        return Err(io_err(
            &w_path,
            format!(
                "{len} bytes, above this server's limit of {} for an adapter file",
                limits.max_file_bytes
            ),
        ));
    }
    // SAFETY: the map is read-only and dropped before this returns; a file truncated under it
    // by another process is the one way to fault, as with any mapped model file.
    let map = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| io_err(&w_path, e))?;
    from_safetensors_within(config, &map, model, limits)
}

/// Build the adapter of `config` from safetensors bytes: every expected tensor present with its
/// PEFT shape and finite values, no unknown tensor.
pub fn from_safetensors(
    config: AdapterConfig,
    bytes: &[u8],
    model: &impl AdapterBase,
) -> Result<AdapterWeights, AdapterError> {
    from_safetensors_within(config, bytes, model, &AdapterLimits::default())
}

fn from_safetensors_within(
    config: AdapterConfig,
    bytes: &[u8],
    model: &impl AdapterBase,
    limits: &AdapterLimits,
) -> Result<AdapterWeights, AdapterError> {
    let model = &model.adapter_shape();
    let layout = Arc::new(limits.layout(config, model)?);
    let st = SafeTensors::deserialize(bytes)
        .map_err(|e| tensor_err(WEIGHTS_FILE, format!("not a safetensors file: {e}")))?;
    let mut expected: HashMap<&str, (&super::TensorSlot, Target)> = HashMap::new();
    for m in layout.iter_modules() {
        for t in &m.tensors {
            expected.insert(t.name.as_ref() as &str, (t, m.target));
        }
    }
    for name in st.names() {
        if !expected.contains_key(name) {
            let hint = match layout.config.method {
                Method::Oft(_) => "oft_R.weight of the configured target_modules",
                Method::Lora(_) => "lora_A/lora_B.weight of the configured target_modules",
            };
            return Err(tensor_err(
                name,
                format!(
                    "unknown tensor for this adapter (expected {hint}, layers 0..{})",
                    model.num_layers
                ),
            ));
        }
    }
    let mut params = vec![0.0f32; layout.num_params];
    for m in layout.iter_modules() {
        for t in &m.tensors {
            let view = st
                .tensor(&t.name)
                .map_err(|_| tensor_err(&t.name, "missing"))?;
            if view.shape() != t.shape {
                return Err(tensor_err(
                    &t.name,
                    format!("shape {:?}, expected {:?}", view.shape(), t.shape),
                ));
            }
            let vals = to_f32(&t.name, &view)?;
            let vals = if needs_permutation(&layout, m.target, t.suffix) {
                permute_rows(&vals, t.shape[1], model.head_dim, true)
            } else {
                vals
            };
            params[t.range.clone()].copy_from_slice(&vals);
        }
    }
    AdapterWeights::new(layout, params)
}

fn to_f32(name: &str, v: &TensorView) -> Result<Vec<f32>, AdapterError> {
    let d = v.data();
    let out: Vec<f32> = match v.dtype() {
        Dtype::F32 => d
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect(),
        Dtype::F16 => d
            .chunks_exact(2)
            .map(|c| flywheel_kernels::quant::f16_to_f32(u16::from_le_bytes([c[0], c[1]])))
            .collect(),
        Dtype::BF16 => d
            .chunks_exact(2)
            .map(|c| f32::from_bits((u16::from_le_bytes([c[0], c[1]]) as u32) << 16))
            .collect(),
        other => {
            return Err(tensor_err(
                name,
                format!("dtype {other:?} is not supported (F32, F16, BF16)"),
            ))
        }
    };
    if let Some(i) = out.iter().position(|x| !x.is_finite()) {
        return Err(tensor_err(
            name,
            format!("holds a non-finite value ({}) at element {i}", out[i]),
        ));
    }
    Ok(out)
}

/// The adapter's tensors as safetensors bytes (f32, PEFT names, shapes and row order).
pub fn to_safetensors(w: &AdapterWeights) -> Result<Vec<u8>, AdapterError> {
    values_to_safetensors(&w.layout, &w.params)
}

/// Any vector in an adapter's layout (its parameters, their gradients, optimizer moments) as
/// safetensors under PEFT's names, shapes and row order.
pub fn values_to_safetensors(
    layout: &AdapterLayout,
    values: &[f32],
) -> Result<Vec<u8>, AdapterError> {
    assert_eq!(values.len(), layout.num_params);
    let mut owned: Vec<(String, [usize; 2], Vec<u8>)> = Vec::new();
    for m in layout.iter_modules() {
        for t in &m.tensors {
            let vals = &values[t.range.clone()];
            let vals = if needs_permutation(layout, m.target, t.suffix) {
                permute_rows(vals, t.shape[1], layout.model.head_dim, false)
            } else {
                vals.to_vec()
            };
            let bytes = crate::util::f32_le_bytes(&vals);
            owned.push((t.name.clone(), t.shape, bytes));
        }
    }
    let views: Vec<(String, TensorView)> = owned
        .iter()
        .map(|(n, s, b)| {
            TensorView::new(Dtype::F32, s.to_vec(), b)
                .map(|v| (n.clone(), v))
                .map_err(|e| tensor_err(n, e.to_string()))
        })
        .collect::<Result<_, _>>()?;
    let meta: HashMap<String, String> = [("format".to_string(), "pt".to_string())].into();
    safetensors::serialize(views, Some(meta)).map_err(|e| tensor_err(WEIGHTS_FILE, e.to_string()))
}

/// Write a PEFT folder at `dir` atomically: files are written and fsynced in a temporary sibling
/// folder which is then renamed into place. `dir` must not exist yet.
pub fn save(w: &AdapterWeights, dir: &Path) -> Result<(), AdapterError> {
    if dir.exists() {
        return Err(io_err(dir, "already exists"));
    }
    let parent = dir
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    std::fs::create_dir_all(parent).map_err(|e| io_err(parent, e))?;
    let base = dir
        .file_name()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|| "adapter".into());
    let tmp = parent.join(format!(".{base}.tmp-{:016x}", crate::util::random_u64()));
    let write = || -> Result<(), AdapterError> {
        std::fs::create_dir(&tmp).map_err(|e| io_err(&tmp, e))?;
        let cfg = serde_json::to_string_pretty(&config_json(&w.layout.config))
            .map_err(|e| io_err(&tmp, e))?;
        write_synced(&tmp.join(CONFIG_FILE), cfg.as_bytes())?;
        write_synced(&tmp.join(WEIGHTS_FILE), &to_safetensors(w)?)?;
        sync_dir(&tmp)?;
        std::fs::rename(&tmp, dir).map_err(|e| io_err(dir, e))?;
        sync_dir(parent)
    };
    let r = write();
    if r.is_err() {
        let _ = std::fs::remove_dir_all(&tmp);
    }
    r
}

/// Write a file and fsync it.
fn write_synced(path: &Path, bytes: &[u8]) -> Result<(), AdapterError> {
    crate::util::write_synced(path, bytes).map_err(|e| io_err(path, e))
}

/// fsync a directory (so a rename inside it is durable).
fn sync_dir(path: &Path) -> Result<(), AdapterError> {
    crate::util::sync_dir(path).map_err(|e| io_err(path, e))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::adapter::BaseShape;

    #[test]
    fn qk_row_permutation_pairs_halves_and_inverts() {
        // Head dim 4, two heads: HF rows [a0 a1 b0 b1] per head become pairs [a0 b0 a1 b1].
        assert_eq!(
            (0..8).map(|g| hf_row_of_gguf_row(g, 4)).collect::<Vec<_>>(),
            vec![0, 2, 1, 3, 4, 6, 5, 7]
        );
        let src: Vec<f32> = (0..16).map(|v| v as f32).collect();
        let g = permute_rows(&src, 2, 4, true);
        assert_eq!(&g[..4], &[0.0, 1.0, 4.0, 5.0]);
        assert_eq!(permute_rows(&g, 2, 4, false), src);
    }

    #[test]
    fn configs_refuse_what_is_not_implemented_by_key() {
        let base = json!({"peft_type": "OFT", "oft_block_size": 32, "target_modules": ["q_proj"]});
        assert!(parse_config(&base).is_ok());
        for (k, v) in [
            ("coft", json!(true)),
            ("block_share", json!(true)),
            ("module_dropout", json!(0.1)),
            ("target_modules", json!(["lm_head"])),
            ("oft_block_size", json!(0)),
            ("bias", json!("all")),
        ] {
            let mut c = base.clone();
            c[k] = v;
            let e = parse_config(&c).unwrap_err().to_string();
            assert!(e.starts_with(k), "{k}: {e}");
        }
        let lora = json!({"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "down_proj"], "use_dora": true});
        assert!(parse_config(&lora)
            .unwrap_err()
            .to_string()
            .starts_with("use_dora"));
        let round = parse_config(&config_json(&parse_config(&base).unwrap())).unwrap();
        assert_eq!(round, parse_config(&base).unwrap());
    }

    #[test]
    fn lora_b_rows_of_q_and_k_are_permuted_only_for_llama_gguf_bases() {
        let shape = |permuted| BaseShape {
            num_layers: 1,
            hidden: 8,
            q_dim: 8,
            kv_dim: 8,
            ffn: 8,
            head_dim: 4,
            vocab: 16,
            qk_rows_permuted: permuted,
        };
        let cfg = AdapterConfig {
            method: Method::Lora(LoraConfig {
                r: 2,
                alpha: 2.0,
                use_rslora: false,
            }),
            targets: vec![Target::Q],
            base_model: String::new(),
        };
        for permuted in [true, false] {
            let layout = Arc::new(AdapterLayout::new(cfg.clone(), &shape(permuted)).unwrap());
            let params: Vec<f32> = (0..layout.num_params).map(|v| v as f32).collect();
            let w = AdapterWeights::new(layout.clone(), params.clone()).unwrap();
            let bytes = to_safetensors(&w).unwrap();
            let st = SafeTensors::deserialize(&bytes).unwrap();
            let b = layout
                .tensors()
                .find(|t| t.suffix == "lora_B.weight")
                .unwrap();
            let saved = to_f32(&b.name, &st.tensor(&b.name).unwrap()).unwrap();
            assert_eq!(saved == params[b.range.clone()], !permuted, "{permuted}");
            // Loading undoes what saving did, either way.
            let back = from_safetensors(cfg.clone(), &bytes, &shape(permuted)).unwrap();
            assert_eq!(back.params, params);
        }
    }
}
